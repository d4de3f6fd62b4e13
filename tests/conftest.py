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

Random inputs replay. The session has one seed: ``CHUNKSTATE_SEED`` (an integer in [0, 2^32))
when set, else drawn fresh; the header prints it. Before each test, torch (CPU and CUDA),
``random`` and numpy's global generator are seeded from (session seed, the test's node id), so a
test draws the same numbers whatever else runs: alone, with ``-k``, in another order or on a
pytest-xdist worker (the seed drawn here is exported to the workers through the environment).
The same holds where randomness happens outside a test: a module's import and collection (e.g.
``@example`` arguments built with ``random``) is seeded from its path, and a fixture scoped to a
module, class or session from its scope and name. A failed test's report carries the line that
replays it (``CHUNKSTATE_SEED=... python -m pytest <node id>``).

Hypothesis tests (test_fuzz.py) are seeded from the same per-test seed (``hypothesis.seed``), so
the same ``CHUNKSTATE_SEED`` draws the same examples, unless ``--hypothesis-seed`` is given or the
test carries its own ``@seed``. Not replayed by the seed: the notebooks (nbval runs each in its own
kernel process; a notebook seeds itself or draws fresh numbers), subprocesses a test starts, and
anything that depends on timing (autotuning picks, thread interleaving).
"""
from __future__ import annotations

import os
import random
import zlib

import numpy as np
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
    config.stash[SEED] = _session_seed()


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


# ---------------------------------------------------------------------------------------------
# The session seed
# ---------------------------------------------------------------------------------------------
SEED_ENV = "CHUNKSTATE_SEED"
SEED = pytest.StashKey[int]()


def _session_seed() -> int:
    """``CHUNKSTATE_SEED`` if set, else a fresh one, exported so xdist workers and a rerun agree."""
    text = os.environ.get(SEED_ENV, "").strip()
    if not text:
        seed = int.from_bytes(os.urandom(4), "little")
        os.environ[SEED_ENV] = str(seed)  # inherited by xdist workers, started after this hook
        return seed
    try:
        seed = int(text, 0)
    except ValueError:
        seed = -1
    if not 0 <= seed < 2 ** 32:
        raise pytest.UsageError(f"{SEED_ENV} must be an integer in [0, 2**32), got {text!r}")
    return seed


def derived_seed(seed: int, key: str) -> int:
    """The seed of one test (``key``: its node id) or one collection / fixture scope: the session
    seed mixed with a stable hash of the key, in [0, 2^32) as numpy requires."""
    return (zlib.crc32(key.encode()) ^ seed) & 0xFFFFFFFF


def seed_everything(seed: int) -> None:
    """Seed torch (every device), ``random`` and numpy's global generator."""
    random.seed(seed)
    np.random.seed(seed)
    torch.manual_seed(seed)


def _replay(config, what: str = "...") -> str:
    return f"{SEED_ENV}={config.stash[SEED]} python -m pytest {what}"


def pytest_report_header(config):
    return f"chunkstate seed: {config.stash[SEED]} (replay: {_replay(config)})"


@pytest.hookimpl(wrapper=True)
def pytest_make_collect_report(collector):
    """Seed before a test module is imported and collected: module-level draws replay too."""
    if isinstance(collector, pytest.Module):
        seed_everything(derived_seed(collector.config.stash[SEED], collector.nodeid))
    return (yield)


@pytest.hookimpl(wrapper=True)
def pytest_fixture_setup(fixturedef, request):
    """Seed before a fixture wider than one test is built (it is built once, by whichever test
    needs it first): its draws depend on its scope and name, not on that test."""
    if fixturedef.scope != "function":
        seed_everything(derived_seed(request.config.stash[SEED], f"{request.node.nodeid}::{fixturedef.argname}"))
    return (yield)


@pytest.fixture(autouse=True)
def _seeded(request):
    """Seed torch, ``random``, numpy and a Hypothesis test from (session seed, node id)."""
    seed = derived_seed(request.config.stash[SEED], request.node.nodeid)
    test = getattr(request.node, "obj", None)
    test = getattr(test, "__func__", test)  # of a method, the function (Hypothesis keeps its seed there)
    if getattr(test, "is_hypothesis_test", False) and request.config.getoption("--hypothesis-seed", None) is None:
        import hypothesis

        if getattr(test, "_hypothesis_internal_use_seed", None) is None or getattr(test, "_chunkstate_seeded", False):
            hypothesis.seed(seed)(test)
            test._chunkstate_seeded = True
    seed_everything(seed)
    yield


@pytest.hookimpl(wrapper=True)
def pytest_runtest_makereport(item, call):
    """A failed test's report says how to replay it."""
    report = yield
    if report.failed:
        report.sections.append(("chunkstate seed", f"replay: {_replay(item.config, repr(item.nodeid))}"))
    return report


def pytest_terminal_summary(terminalreporter, exitstatus, config):
    """After failures, the seed again, where the run's last lines are read."""
    if terminalreporter.stats.get("failed") or terminalreporter.stats.get("error"):
        terminalreporter.write_sep("-", "chunkstate seed")
        terminalreporter.write_line(f"replay a failed test with {_replay(config, '<node id>')}")


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
