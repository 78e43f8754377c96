"""Without a GPU, the kernel tests run under the Triton interpreter; triton reads the
variable when a kernel is decorated, so it is set before any kernel module is imported
(server/tests/conftest.py does the same for the backend tests)."""

import os

import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")
