"""Triton kernels for the paged KV cache, each module with a plain torch reference
beside its kernel (the `*_ref` functions), which is what the tests compare against.

Importing a kernel module imports triton and decorates its kernels; whether they run
compiled or under the interpreter is decided then, by `TRITON_INTERPRET`. The shard's
CPU path never imports these modules (see `cadence.layers.attention`).
"""

from __future__ import annotations

import os


def triton_available() -> bool:
    try:
        import triton  # noqa: F401
    except ImportError:
        return False
    return True


# Read once, as triton reads it when the kernels are decorated.
INTERPRETED = os.environ.get("TRITON_INTERPRET", "0") == "1"


def dot_in_f32(dtype: object) -> bool:
    """The Triton interpreter computes bfloat16 arithmetic on raw bits (wrong results), so
    under it the attention kernels upcast their bfloat16 tiles before `tl.dot`; compiled
    kernels keep bfloat16 tensor-core dots."""
    import torch

    return dtype == torch.bfloat16 and INTERPRETED
