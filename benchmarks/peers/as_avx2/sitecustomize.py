"""Makes a Python process on an AVX-512 CPU see an AVX2-only one, for vLLM's CPU build.

vLLM picks its kernel library (`_C`, `_C_AVX512` or `_C_AVX2`) and its attention
kernels by asking torch whether the CPU has AVX-512, AVX-512 BF16 and AMX; torch answers
from the CPU itself, whatever `ATEN_CPU_CAPABILITY` says. With this folder on
`PYTHONPATH` those questions answer as on an AVX2-only CPU. The rest of the hold comes
from the environment `alternate.sh` sets with `AS_AVX2=1`: `ATEN_CPU_CAPABILITY=avx2`
(torch's kernels and inductor's vector code), `ONEDNN_MAX_CPU_ISA=AVX2`,
`MKL_ENABLE_INSTRUCTIONS=AVX2` and `TORCHINDUCTOR_CPP_MARCH=x86-64-v3` (the compiler
flags of the code torch.compile generates).
"""

import torch.cpu


def _absent() -> bool:
    return False


for _probe in (
    "_is_avx512_supported",
    "_is_avx512_vnni_supported",
    "_is_avx512_bf16_supported",
    "_is_amx_tile_supported",
    "_is_amx_fp16_supported",
):
    if hasattr(torch.cpu, _probe):
        setattr(torch.cpu, _probe, _absent)
