"""``chunkstate.testing.fla_one_config``: fla's autotuners cut to one config for a block, then
restored. Runs anywhere: a stand-in ``fla`` package of plain Triton autotuners (no kernel is
launched), so no GPU and no fla install are needed."""
from __future__ import annotations

import sys
import types

import chunkstate  # noqa: F401  (before triton: picks the interpreter without a GPU)
import pytest
import triton
from triton.runtime.autotuner import Autotuner

from chunkstate.testing import fla_one_config, one_config


def cfg(warps, stages, **kwargs):
    return triton.Config(kwargs, num_warps=warps, num_stages=stages)


def test_one_config_takes_fewest_stages_then_four_warps_then_list_order():
    configs = [cfg(8, 3, BK=32), cfg(2, 2, BK=32), cfg(8, 2, BK=64), cfg(4, 2, BK=64), cfg(4, 2, BK=32)]
    assert one_config(configs) is configs[3]
    assert one_config([cfg(1, 2), cfg(8, 2), cfg(2, 2)]).num_warps == 2  # the nearest to 4
    assert one_config([cfg(8, 4), cfg(1, 3)]).num_stages == 3


@triton.jit
def _kernel(x, BK: triton.language.constexpr):
    pass


@pytest.fixture
def fake_fla(monkeypatch):
    """``fla`` and ``fla.ops.fake`` in sys.modules: an autotuner (under a heuristics wrapper, as
    fla's chunk_h kernels are), a one-config autotuner, and an unrelated object."""
    configs = [cfg(w, s, BK=bk) for bk in (32, 64) for w in (2, 4, 8) for s in (2, 3)]
    tuned = triton.autotune(configs=list(configs), key=["BK"])(_kernel)
    single = triton.autotune(configs=[cfg(8, 4, BK=16)], key=["BK"])(_kernel)
    wrapped = triton.heuristics({"BK": lambda args: 32})(tuned)
    ops = types.ModuleType("fla.ops.fake")
    ops.kernel, ops.single, ops.other = wrapped, single, object()
    monkeypatch.setitem(sys.modules, "fla", types.ModuleType("fla"))
    monkeypatch.setitem(sys.modules, "fla.ops.fake", ops)
    return tuned, single, configs


def test_fla_autotuners_run_one_config_inside_and_all_after(fake_fla):
    tuned, single, configs = fake_fla
    assert isinstance(tuned, Autotuner)
    with fla_one_config() as limited:
        assert limited >= 1  # (more where the real fla's ops were imported before)
        assert tuned.configs == [one_config(configs)]
        assert (tuned.configs[0].kwargs["BK"], tuned.configs[0].num_warps, tuned.configs[0].num_stages) == (32, 4, 2)
        assert len(single.configs) == 1
    assert tuned.configs == configs


def test_fla_autotuners_are_restored_when_the_block_raises(fake_fla):
    tuned, _, configs = fake_fla
    with pytest.raises(RuntimeError, match="inside"):
        with fla_one_config():
            raise RuntimeError("inside")
    assert tuned.configs == configs


def test_other_modules_autotuners_are_untouched(fake_fla):
    from chunkstate import forward

    ours = forward._tuned_forward.configs
    with fla_one_config():
        assert forward._tuned_forward.configs is ours
