"""Shared fixtures for the unit tests in tests/ (notebooks have their own notebooks/conftest.py).

- Every test here runs with ``torch.empty`` / ``torch.empty_like`` returning NaN-filled tensors
  (``chunkstate.testing.nan_poisoned_empty``), so an output element a kernel never writes shows
  up as NaN instead of as leftover memory that happens to look right.
- ``device``: where kernel inputs must live (``chunkstate.DEVICE``: "cuda", or "cpu" under
  Triton's interpreter).
- torch uses one CPU thread (tiny tensors; see ``pytest_configure``).
- ``fla_one_config``: fla-core's autotuned kernels run one config each for the test
  (``chunkstate.testing.fla_one_config``): comparisons check fla's numbers, not its speed.
- ``@pytest.mark.gpu`` (or ``@pytest.mark.gpu(reason="...")``): the test needs a CUDA GPU (bf16,
  large shapes, many autotune configs); it is skipped under the interpreter, with the reason. This
  is the one way to mark a GPU-only test. The opposite case, a test that only makes sense without a
  GPU (a message printed there, the interpreter's grid), stays a plain ``skipif(ON_GPU, ...)``.
"""
from __future__ import annotations

import pytest
import torch

import chunkstate
from chunkstate.testing import fla_one_config as _fla_one_config
from chunkstate.testing import nan_poisoned_empty


def pytest_configure(config):
    config.addinivalue_line("markers", "gpu(reason=...): needs a CUDA GPU; skipped under Triton's interpreter, "
                            "saying why (the reason, when given, says what the interpreter cannot do)")
    # The tests' CPU tensors are tiny: one intra-op thread is faster than several, and several
    # threads fighting other processes for a few cores made the reference tests 10x slower.
    torch.set_num_threads(1)


def pytest_collection_modifyitems(config, items):
    """Skip every ``@pytest.mark.gpu`` test where there is no GPU, with the marker's reason."""
    if chunkstate.DEVICE == "cuda":
        return
    for item in items:
        marker = item.get_closest_marker("gpu")
        if marker is not None:
            why = marker.kwargs.get("reason") or (marker.args[0] if marker.args else None)
            reason = "needs a CUDA GPU" + (f": {why}" if why else " (chunkstate runs Triton's interpreter on CPU here)")
            item.add_marker(pytest.mark.skip(reason=reason))


@pytest.fixture(autouse=True)
def _nan_poisoned_empty():
    """NaN-poison torch.empty / torch.empty_like for the duration of each test."""
    with nan_poisoned_empty():
        yield


@pytest.fixture
def device() -> str:
    """``chunkstate.DEVICE``: "cuda" on a GPU machine, "cpu" under Triton's interpreter."""
    return chunkstate.DEVICE


@pytest.fixture
def fla_one_config() -> int:
    """fla-core's autotuners limited to one config each for the test (how many were limited; 0
    without fla). Its first call would otherwise compile and time every config: minutes."""
    with _fla_one_config() as limited:
        yield limited
