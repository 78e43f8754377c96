"""Attention over the paged KV cache, one backend object per implementation.

Per layer the cache is a key and a value tensor `[num_blocks, block_size, kv_heads,
head_dim]`; a token's slot is `block * block_size + offset`. Each step the runner asks its
backend once for the step's metadata (`AttentionBackend.metadata`, from the flat
`StepLayout`) and installs both with `forward_context`; every `Attention` layer then calls
`backend.forward(layer, q, k, v, metadata)`: write the new keys/values, attend the decode
rows (one query each, ordered first), attend the prefill rows (a chunk of queries each,
over their cached prefix and causally among themselves).

Backends (`cadence.shard.backends` picks one when the engine is built):
- `TorchAttention` (`torch_sdpa`): gathers each sequence's context through its block
  table into a padded tensor and calls `scaled_dot_product_attention` once per batch; runs
  anywhere, the fallback without a C++ compiler.
- `CpuAttention` (`cpu_paged`): the decode rows read the cache through their block tables
  in place with the C++ kernels of `cadence.kernels.cpu`; prefill rows as torch does.
- `TritonAttention` (`triton_paged`): the paged Triton kernels of `cadence.kernels`, which
  read the cache through the block tables without a gather; the default on CUDA.
"""

from cadence.attention_backends.base import (
    AttentionBackend,
    StepLayout,
    forward_context,
    get_context,
)

__all__ = [
    "AttentionBackend",
    "StepLayout",
    "forward_context",
    "get_context",
]
