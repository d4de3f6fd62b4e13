"""The session seed of tests/conftest.py: the same ``CHUNKSTATE_SEED`` draws the same numbers in a
test, whether it runs with the others or alone; another seed draws others; the header names the
seed and a failure says how to replay it.

Each check runs pytest in this process (``pytester``) on a small generated test file, with this
directory's conftest registered as its plugin: the real hooks, not a copy.
"""
from __future__ import annotations

import re
from pathlib import Path

import hypothesis  # noqa: F401  imported once here: pytester forgets the modules each of its runs imports
import pytest

pytest_plugins = ["pytester"]

TESTS = '''
import random

import numpy as np
import pytest
import torch
from hypothesis import given, settings, strategies as st

AT_IMPORT = random.random()
DRAWN = []


@pytest.fixture(scope="module")
def shared():
    return torch.randn(1).item()


def test_first():
    print("VALUE first", torch.randn(1).item(), torch.randn(1).item(), random.random(), np.random.rand())


def test_second():
    print("VALUE second", torch.randn(1).item(), torch.randn(1).item(), random.random(), np.random.rand(), AT_IMPORT)


def test_shared(shared):
    print("VALUE shared", shared)


@settings(max_examples=5, database=None)
@given(st.integers(0, 2 ** 30))
def test_drawn(n):
    DRAWN.append(n)


def test_drawn_after():
    print("VALUE drawn", DRAWN)


def test_fails():
    assert torch.randn(1).item() > 100
'''


@pytest.fixture
def run(pytester, request, monkeypatch):
    """Run the generated tests with tests/conftest.py as a plugin under ``CHUNKSTATE_SEED=seed``
    (None: unset); return ({test: the values it printed}, output lines)."""
    conftest_path = str(Path(__file__).with_name("conftest.py"))
    conftest = next(p for p in request.config.pluginmanager.get_plugins()
                    if getattr(p, "__file__", None) == conftest_path)
    pytester.makepyfile(test_generated=TESTS)

    def go(seed, *args):
        if seed is None:
            monkeypatch.delenv("CHUNKSTATE_SEED", raising=False)
        else:
            monkeypatch.setenv("CHUNKSTATE_SEED", str(seed))
        result = pytester.runpytest_inprocess("-s", "-p", "no:cacheprovider", *args, plugins=[conftest])
        lines = result.outlines + result.errlines
        return dict(re.findall(r"VALUE (\w+) (.*)", "\n".join(lines))), lines

    return go


def test_same_seed_same_numbers(run):
    """With one seed, a test draws the same numbers with the others or alone (its module's import
    and module fixture included, and Hypothesis's examples); the header and a failure name it."""
    everything, lines = run(123456)
    text = "\n".join(lines)
    assert everything.keys() == {"first", "second", "shared", "drawn"}, text
    assert everything["first"] != everything["second"]  # each test draws from its own seed
    assert "chunkstate seed: 123456 (replay: CHUNKSTATE_SEED=123456 python -m pytest ...)" in lines, text
    assert re.search(r"-+ chunkstate seed -+\nreplay: CHUNKSTATE_SEED=123456 python -m pytest "
                     r"'test_generated.py::test_fails'\n", text), text
    alone, _ = run(123456, "test_generated.py::test_second")
    assert alone == {"second": everything["second"]}
    some, _ = run(123456, "-k", "shared or drawn")
    assert some == {"shared": everything["shared"], "drawn": everything["drawn"]}


def test_fresh_seed_is_printed_replays_and_differs(run):
    """Without CHUNKSTATE_SEED a seed is drawn and printed; it replays; its numbers are others."""
    fresh, lines = run(None, "-k", "second or drawn")
    header = next((line for line in lines if line.startswith("chunkstate seed: ")), "")
    assert re.fullmatch(r"chunkstate seed: (\d+) \(replay: CHUNKSTATE_SEED=\1 python -m pytest \.\.\.\)", header), lines
    seed = int(header.split()[2])
    assert run(seed, "-k", "second")[0] == {"second": fresh["second"]}
    other, _ = run(seed ^ 1, "-k", "second or drawn")
    assert other["second"] != fresh["second"] and other["drawn"] != fresh["drawn"]


@pytest.mark.parametrize("bad", ["x", "-1", str(2 ** 32)])
def test_bad_seed_is_refused(run, bad):
    _, lines = run(bad)
    assert f"CHUNKSTATE_SEED must be an integer in [0, 2**32), got '{bad}'" in "\n".join(lines)

