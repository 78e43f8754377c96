"""Kernel tests run on CPU under the Triton interpreter unless a GPU is present; the
variable must be set before any kernel module is imported (triton decides at
decoration time)."""

import os

import torch

if not torch.cuda.is_available():
    os.environ["TRITON_INTERPRET"] = "1"
