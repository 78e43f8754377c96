"""Fixtures shared by server/tests (the kernels' tests among them) and integration-tests."""

from __future__ import annotations

import os
import random
import zlib
from collections.abc import Iterator

import numpy
import pytest
import torch

# Without a GPU the Triton kernels' tests run under the interpreter. Triton (and
# `cadence.kernels`) read the variable once, when a kernel module is imported: so it is set
# here, before anything of cadence is.
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

from cadence.kernels.cpu import isa  # noqa: E402


@pytest.fixture(params=isa.ISAS)
def cpu_isa(request: pytest.FixtureRequest) -> Iterator[str]:
    """Parametrizes a test over every instruction set of the C++ CPU kernels (the test id
    names it); the ones this CPU cannot run are skipped with what it lacks."""
    from cadence.kernels import cpu

    why_not = cpu.not_selectable(request.param)
    if why_not:
        pytest.skip(why_not)
    with cpu.selected(request.param):
        yield request.param


@pytest.fixture(autouse=True)
def seeded_random_inputs(request: pytest.FixtureRequest) -> None:
    """Seeds torch's, numpy's and Python's generators from the test's id, so every run of a
    test draws the same random inputs: a tolerance holds or fails for the same values each
    time, and a failure reproduces (an unseeded bfloat16 kernel test failed about one run in
    500 on a rounding it drew by chance). Tests that seed for themselves still do."""
    seed = zlib.crc32(request.node.nodeid.encode())
    torch.manual_seed(seed)
    numpy.random.seed(seed)
    random.seed(seed)
