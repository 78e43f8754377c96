"""Model runners: how one step's flat batch goes through the model. `ModelRunner` calls
the model's own forward with the step's attention installed; `LlamaCpuFlatRunner` runs
the Llama family on CPU as one flat loop of C++ kernels and matrix products (same bits,
less Python per layer). The engine picks one when it is built (`cadence.shard.backends`)."""

from cadence.runners.generic import ModelRunner
from cadence.runners.llama_cpu_flat import LlamaCpuFlatRunner

__all__ = ["LlamaCpuFlatRunner", "ModelRunner"]
