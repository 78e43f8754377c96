"""Without a GPU, Triton kernels run under its interpreter in the tests. Set here, at the
root, because triton reads the variable when a kernel is decorated, and any test
directory may import a kernel module first."""

import os

import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")
