"""The GPUs learners have: configs chosen by the device's shared memory and compute capability.

On CPU (no GPU needed):

- ``tuning.prune`` keeps, for each of ``tuning.TARGETS`` (sm_75 64 KB, sm_80 163 KB, sm_86 and
  sm_89 99 KB, sm_90 227 KB), every grid bucket, K, V in {64, 128, 256}, every gate kind, input
  dtype and a short and a long chunk, at least one candidate, and every candidate fits the target
  by ``tuning.shared_memory`` (tests/test_compile.py checks that estimate against the compiler);
  TMA loads only where the key allows them, prefetch kept from sm_80 on;
- the replacement rule (``tuning.fit``), the H200's bf16 candidates unchanged, the autotune key's
  ``SMEM``;
- ``tuning.device_limits`` and ``tuning.sm_count`` read from a (mocked) GPU once per device, the
  pieces cut by the SM count of the call's device, and the ``CHUNKSTATE_SMEM_LIMIT`` cap.

On a GPU (written for the H200; skipped on CPU): under a cap of 99 KB (sm_86 / sm_89: RTX 30xx
and 40xx, L4) and 163 KB (sm_80: A100), with TMA loads off as on those GPUs, the forward and the
backward, autotuned, on shapes spanning the buckets (dense, GQA, packed with empty sequences,
pieces, fp16, fp32 with every gate) agree with the float64 token loop; every config the autotuner
compiled for them uses no more shared memory than the cap (read from the compiled kernel) nor
than the estimate. ``test_capped_timings`` times the autotuned kernels under each cap against the
uncapped H200 on the benchmark's B8 T4096 H16 shape (g, gk) and the fp32 case and prints the
table (``pytest -rP`` or ``-s`` shows it); it asserts nothing about speed. The whole GPU part
takes about a minute on an H200.
"""
from __future__ import annotations

import contextlib
import itertools
import json
import os
import zlib

import pytest
import torch
import torch.nn.functional as F

import chunkstate  # before triton: picks the interpreter on a machine without a GPU
import triton
from chunkstate import backward, forward, gates, launch, pieces, reference, tuning
from chunkstate.figures import committed
from chunkstate.testing import check_close, nan_poisoned_empty, state_tolerance

Device = tuning.Device
KB = 1024

# ---------------------------------------------------------------------------------------------
# CPU: the choice of candidates for each target
# ---------------------------------------------------------------------------------------------

GATE_KINDS = {
    "none": {},
    "g": {"USE_G": True},
    "g_gamma": {"USE_G_GAMMA": True},
    "gk": {"USE_GK": True},
    "gv": {"USE_GV": True},
    "g-gk-gv": {"USE_G": True, "USE_GK": True, "USE_GV": True},
}
DIMS = (64, 128, 256)
DTYPES = (torch.bfloat16, torch.float16, torch.float32)
CHUNKS = (64, 256)


def _estimate(cfg, args, device):
    BK, BV, _, stages, tma = tuning.config_tuple(cfg)
    return tuning.shared_memory(BK, BV, stages, BT=args["BT"], in_bytes=args["k"].itemsize,
                                g=args.get("USE_G", False), gk=args.get("USE_GK", False),
                                gv=args.get("USE_GV", False), tma=tma, device=device)


@pytest.mark.parametrize("target", list(tuning.TARGETS))
def test_every_bucket_keeps_a_candidate_that_fits(target):
    device = tuning.TARGETS[target]
    tma_levels = (0, 1) if device.capability >= (9, 0) else (0,)
    checked = 0
    for bucket, K, V, gate, dtype, BT, tma in itertools.product(
            range(tuning.N_BUCKETS), DIMS, DIMS, GATE_KINDS, DTYPES, CHUNKS, tma_levels):
        args = dict(K=K, V=V, OCCUPANCY=bucket, TMA_OK=tma, BT=BT, k=dtype, **GATE_KINDS[gate])
        where = f"{target} bucket {bucket} K={K} V={V} gates {gate} {dtype} BT={BT} TMA_OK={tma}"
        kept = tuning.prune(tuning.ALL_CONFIGS, args, device=device)
        assert kept, f"{where}: no candidate"
        for cfg in kept:
            BK, BV, _, _, use_tma = tuning.config_tuple(cfg)
            need = _estimate(cfg, args, device)
            assert need <= device.smem, f"{where}: {tuning.config_label(cfg)} needs {need} B of {device.smem}"
            assert BK <= max(16, triton.next_power_of_2(K)) and BV <= max(16, triton.next_power_of_2(V)), where
            assert tma or not use_tma, f"{where}: a TMA config where the key allows none"
        if device.async_copies and BT == 64:
            assert any(tuning.config_tuple(c)[3] >= 2 for c in kept), f"{where}: no config prefetches"
        checked += 1
    assert checked >= 5 * 9 * 6 * 3 * 2


def test_the_h200_keeps_its_measured_candidates_where_they_fit():
    """On the H200 (227 KB), bf16 inputs with a scalar gate keep ``candidates`` as measured: the fit
    changes nothing there. With every gate the deepest 128×64 pipeline (~243 KB) gets 3 stages."""
    for bucket in range(tuning.N_BUCKETS):
        for tma in (0, 1):
            args = dict(K=128, V=128, OCCUPANCY=bucket, TMA_OK=tma, BT=64, k=torch.bfloat16, USE_G=True)
            kept = {tuning.config_tuple(c) for c in tuning.prune(tuning.ALL_CONFIGS, args, device=tuning.H200)}
            want = set(tuning.candidates(128, 128, bucket, bool(tma)))
            assert kept == want, (bucket, tma)
    args = dict(K=128, V=128, OCCUPANCY=4, TMA_OK=0, BT=64, k=torch.bfloat16, USE_G=True, USE_GK=True, USE_GV=True)
    kept = {tuning.config_tuple(c) for c in tuning.prune(tuning.ALL_CONFIGS, args, device=tuning.H200)}
    assert (128, 64, 8, 3, False) in kept and (128, 64, 8, 4, False) not in kept


def _h200_kept(K, V, bucket, tma, **gates):
    args = dict(K=K, V=V, OCCUPANCY=bucket, TMA_OK=int(tma), BT=64, k=torch.bfloat16, **gates)
    return {tuning.config_tuple(c) for c in tuning.prune(tuning.ALL_CONFIGS, args, device=tuning.H200)}


def test_candidates_follow_the_longer_side_of_the_state():
    """The third sweep's rules (figures/sweep_losses_h200.json), as the H200 prunes them for bf16:
    K > V in bucket 2 gets 128×64 tiles (and no 64×128 cut down to 64×64 by V); with a key gate and
    TMA, pointer 64×64 with 2 stages from bucket 2 on, and in bucket 1 the wide TMA tile along the
    longer side only for a state past 128 × 128."""
    kv_wide = _h200_kept(256, 64, 2, False, USE_G_GAMMA=True)
    assert {(128, 64, 8, 3, False), (128, 64, 4, 3, False), (128, 64, 4, 2, False)} <= kv_wide
    assert _h200_kept(64, 256, 2, False, USE_G_GAMMA=True) == {  # V > K: the list as measured
        (64, 128, 8, 3, False), (64, 128, 4, 3, False), (64, 64, 2, 3, False), (64, 64, 2, 4, False),
        (64, 64, 4, 2, False), (64, 64, 4, 3, False), (32, 64, 4, 3, False),
        (64, 64, 4, 4, False)}  # fla's constant-gate winner on the random shapes of 2026-12-04
    for bucket in (2, 3, 4):
        for K, V in ((64, 64), (256, 64), (128, 128)):
            assert (64, 64, 4, 2, False) in _h200_kept(K, V, bucket, True, USE_GK=True), (K, V, bucket)
    assert (64, 128, 8, 3, True) in _h200_kept(256, 256, 1, True, USE_GK=True)
    assert (128, 64, 8, 3, True) in _h200_kept(256, 128, 1, True, USE_GK=True)
    assert _h200_kept(128, 128, 1, True, USE_GK=True) == {(64, 64, 4, 4, True), (32, 64, 4, 4, True),
                                                         (64, 64, 4, 3, True)}


def test_a_key_four_times_the_value_adds_a_pointer_tile_in_bucket_1():
    """The fourth sweep's rule (session 32, figures/README.md): with a key gate and TMA in bucket 1,
    pointer 64×64 with 8 warps and 4 stages joins the TMA tiles where K is four times V (K256 V64),
    and not at K128 V64, K256 V128 or V > K, where it lost every time."""
    extra = (64, 64, 8, 4, False)
    assert extra in _h200_kept(256, 64, 1, True, USE_GK=True)
    for K, V in ((128, 64), (256, 128), (64, 256), (128, 128)):
        assert extra not in _h200_kept(K, V, 1, True, USE_GK=True), (K, V)
    assert extra not in _h200_kept(256, 64, 2, True, USE_GK=True)  # bucket 1 only

    runs = json.loads(committed("sweep_kv_bucket1_h100.json").read_text())
    ratio = {True: [], False: []}  # K256 V64 or not -> the extra tile's time over the list's best before it
    for r in runs["first_draw"]:
        if r["cls"] == "A":  # the bucket-1 draw (the other class: K = V = 256 in bucket 3)
            best_before = min(r["res"][str(tuple(c))]["ms"] for c in r["tried"])
            ratio[" K256 V64 " in r["case"]].append(r["res"][str(extra)]["ms"] / best_before)
    for r in runs["second_draw"]:
        ratio[" K256 V64 " in r["case"]].append(r["new_over_best_old"])
    assert (len(ratio[True]), sum(x < 0.97 for x in ratio[True])) == (12, 9)  # K256 V64: > 3 % faster in 9 of 12
    assert (len(ratio[False]), sum(x > 1 for x in ratio[False])) == (12, 12)  # elsewhere: slower in all


@pytest.mark.parametrize("target,config,dtype,expected", [
    ("sm_90", (128, 64, 8, 4, False), torch.bfloat16, (128, 64, 8, 3, False)),  # fewer stages
    ("sm_80", (64, 128, 8, 3, False), torch.bfloat16, (64, 128, 8, 2, False)),
    ("sm_86", (64, 128, 8, 3, False), torch.bfloat16, (64, 64, 8, 2, False)),  # then the longer side halved
    ("sm_86", (32, 32, 4, 5, False), torch.float32, (32, 32, 4, 3, False)),
    ("sm_90", (64, 128, 8, 3, True), torch.float32, (64, 128, 8, 2, True)),  # TMA configs alike
    ("sm_75", (128, 64, 8, 4, False), torch.bfloat16, (128, 64, 8, 4, False)),  # nothing buffered below sm_80:
    ("sm_75", (128, 64, 8, 4, False), torch.float32, (64, 64, 8, 4, False)),  # only the tile can shrink
])
def test_fit_takes_the_nearest_config_that_fits(target, config, dtype, expected):
    device = tuning.TARGETS[target]
    shape = dict(BT=64, in_bytes=dtype.itemsize, g=True, gk=True, gv=True)
    assert tuning.fit(config, device, **shape) == expected
    assert tuning.shared_memory(*expected[:2], expected[3], tma=expected[4], device=device, **shape) <= device.smem
    assert tuning.fit(expected, device, **shape) == expected  # a config that fits stays


def test_fit_with_almost_no_shared_memory_ends_at_16x16_without_prefetch():
    tiny = Device((8, 0), 1)
    assert tuning.fit((128, 64, 8, 4, False), tiny, BT=64) == (16, 16, 8, 1, False)


def test_shared_memory_grows_with_what_is_buffered():
    """The estimate: nothing buffered below sm_80; from there each stage past the first adds a chunk's
    loads (k, v and the gates' tiles), TMA a few barrier bytes."""
    h200, t4 = tuning.TARGETS["sm_90"], tuning.TARGETS["sm_75"]
    base = tuning.shared_memory(64, 64, 1, device=h200)  # the dot's operands, v in two copies
    assert base == (64 + 2 * 64) * 64 * 2 == tuning.shared_memory(64, 64, 5, device=t4)
    per_stage = tuning.shared_memory(64, 64, 3, device=h200) - tuning.shared_memory(64, 64, 2, device=h200)
    assert per_stage == (64 + 64) * 64 * 2
    with_gates = tuning.shared_memory(64, 64, 3, g=True, gk=True, gv=True, device=h200)
    assert with_gates - tuning.shared_memory(64, 64, 2, g=True, gk=True, gv=True, device=h200) == \
        per_stage + 4 * (64 + 1) + 4 * 64 * 65 * 2
    assert tuning.shared_memory(64, 64, 3, tma=True, device=h200) > tuning.shared_memory(64, 64, 3, device=h200)
    assert tuning.shared_memory(64, 64, 3, in_bytes=4, device=h200) == 2 * tuning.shared_memory(64, 64, 3, device=h200)


def test_the_autotune_key_holds_the_usable_shared_memory():
    """``SMEM`` is in both autotuners' keys, and prune picks for the key's value: configs tuned for
    one GPU kind (or cap) are never reused for another."""
    assert "SMEM" in forward._tuned_forward.keys and "SMEM" in backward._tuned_backward.keys
    for cap in (64 * KB, 99 * KB, 163 * KB):
        args = dict(K=128, V=128, OCCUPANCY=2, TMA_OK=0, BT=64, k=torch.bfloat16, USE_GK=True, USE_GV=True)
        by_key = tuning.prune(tuning.ALL_CONFIGS, dict(args, SMEM=cap))
        by_device = tuning.prune(tuning.ALL_CONFIGS, args, device=Device(tuning.device_limits().capability, cap))
        assert [tuning.config_tuple(c) for c in by_key] == [tuning.config_tuple(c) for c in by_device], cap


@pytest.fixture
def fake_gpus(monkeypatch):
    """torch.cuda answering for two GPUs: 0 an RTX 4090 (8.9, 99 KB), 1 an A100 (8.0, 163 KB)."""
    class Props:
        def __init__(self, smem, sms):
            self.shared_memory_per_block_optin = smem
            self.multi_processor_count = sms

    gpus = {0: ((8, 9), 99 * KB, 128), 1: ((8, 0), 163 * KB, 108)}
    asked = []

    def properties(index):
        asked.append(index)
        return Props(*gpus[index][1:])

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)
    monkeypatch.setattr(torch.cuda, "get_device_properties", properties)
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda index=None: gpus[index or 0][0])
    monkeypatch.delenv(tuning.SMEM_LIMIT_ENV, raising=False)
    tuning._device_limits.cache_clear()
    tuning._sm_count.cache_clear()
    yield asked
    tuning._device_limits.cache_clear()
    tuning._sm_count.cache_clear()


def test_device_limits_are_read_once_per_device(fake_gpus):
    assert tuning.device_limits() == Device((8, 9), 99 * KB)
    assert tuning.device_limits("cuda") == tuning.device_limits("cuda:0") == Device((8, 9), 99 * KB)
    assert tuning.device_limits(torch.device("cuda", 1)) == Device((8, 0), 163 * KB)
    assert tuning.device_limits("cpu") == tuning.H200  # the interpreter's tensors: the H200's, as sm_count
    assert sorted(fake_gpus) == [0, 1], "each device's properties are read once"


def test_sm_counts_are_read_once_per_device(fake_gpus):
    assert [tuning.sm_count(i) for i in (0, 1, 0, 1)] == [128, 108, 128, 108]
    assert tuning.sm_count() == 128  # the current device, 0
    assert tuning.sm_count(-1) == tuning.H200_SMS  # a CPU tensor's get_device(): as an H200, asking nothing
    assert sorted(fake_gpus) == [0, 1], "each device's properties are read once"


def test_each_device_cuts_pieces_by_its_own_sm_count(fake_gpus, monkeypatch):
    """B1 T131072 H14 (56 programs of 64×64 tiles) is under half a wave of the RTX 4090's 128 SMs,
    where the cost model cuts it, and over half of the A100's 108, where it is never cut: the
    default call decides by the SM count of its tensors' device (``Problem.device``), whichever
    device was asked first."""
    monkeypatch.setattr(pieces, "INTERPRET", False)  # as on a GPU: auto_pieces decides
    p = launch.problem(torch.zeros(0), 1, 131072, 14, 128, 128, None, 64, None, False)
    assert p.device == -1  # a CPU tensor
    on = {index: pieces.choose(None, p._replace(device=index), "fwd", "g") for index in (1, 0)}
    assert on[1] == 1 and on[0] > 1, on
    assert on[0] == pieces.auto_pieces(1, 14, 128, 128, 131072, 64, 128, direction="fwd", gate="g")
    assert pieces.choose(None, p, "fwd", "g") == pieces.auto_pieces(1, 14, 128, 128, 131072, 64, tuning.H200_SMS,
                                                                    direction="fwd", gate="g")


def test_the_cap_lowers_but_never_raises_the_limit(fake_gpus, monkeypatch):
    monkeypatch.setenv(tuning.SMEM_LIMIT_ENV, str(64 * KB))
    assert tuning.device_limits("cuda:1") == Device((8, 0), 64 * KB)
    monkeypatch.setenv(tuning.SMEM_LIMIT_ENV, "0x40000")  # 256 KB: above both GPUs
    assert tuning.device_limits("cuda:0").smem == 99 * KB
    for bad in ("99KB", "-1", "0"):
        monkeypatch.setenv(tuning.SMEM_LIMIT_ENV, bad)
        with pytest.raises(ValueError, match=tuning.SMEM_LIMIT_ENV):
            tuning.device_limits()


def test_smem_limit_sets_and_restores_the_cap(monkeypatch):
    monkeypatch.delenv(tuning.SMEM_LIMIT_ENV, raising=False)
    full = tuning.device_limits().smem
    with tuning.smem_limit(99 * KB):
        assert tuning.device_limits().smem == min(full, 99 * KB)
        with tuning.smem_limit(None):
            assert tuning.device_limits().smem == full
        assert tuning.device_limits().smem == min(full, 99 * KB)
    assert tuning.SMEM_LIMIT_ENV not in os.environ
    monkeypatch.setenv(tuning.SMEM_LIMIT_ENV, str(163 * KB))
    with tuning.smem_limit(64 * KB):
        assert tuning.device_limits().smem == 64 * KB
    assert tuning.device_limits().smem == min(full, 163 * KB)


# ---------------------------------------------------------------------------------------------
# GPU: the kernels under a capped shared memory, as an A100 or an RTX 4090 user runs them
# ---------------------------------------------------------------------------------------------

gpu = pytest.mark.gpu(reason="autotuning compiled kernels and reading their shared memory needs a GPU")

# name -> (cap in bytes or None, TMA loads allowed): the uncapped H200 and the two smaller levels
LEVELS = {
    "H200": (None, True),
    "163KB-sm80": (163 * KB, False),  # A100
    "99KB-sm86-sm89": (99 * KB, False),  # RTX 30xx / 40xx, L4, A10
}


class Case:
    """One shape: B × T tokens (or packed ``cu``), H KV heads and G query heads per KV head."""

    def __init__(self, name, B, T, H, gates, dtype, G=1, cu=None, pieces=1, K=128, V=128):
        self.name, self.B, self.T, self.H, self.G, self.K, self.V = name, B, T, H, G, K, V
        self.gates, self.dtype, self.cu, self.pieces = gates, dtype, cu, pieces


# The buckets with 132 SMs end at N·H = 16, 33, 132, 528.
CASES = {c.name: c for c in (
    Case("dense-g-bucket0", B=1, T=2048, H=8, gates=("g",), dtype=torch.bfloat16),
    Case("gqa-gk-gv-bucket2", B=4, T=1024, H=16, G=2, gates=("gk", "gv"), dtype=torch.bfloat16),
    Case("packed-ggamma-gk-bucket3", B=1, T=2048, H=80, gates=("g_gamma", "gk"), dtype=torch.float16,
         cu=[0, 0, 300, 1000, 1001, 2048]),
    Case("pieces-g-gv", B=1, T=2048, H=2, gates=("g", "gv"), dtype=torch.bfloat16, pieces=4),
    Case("fp32-allgates-bucket4", B=6, T=256, H=96, gates=("g", "gk", "gv"), dtype=torch.float32),
)}
# (case, level) pairs checked against the loop: every case at 99 KB, the three heaviest at the others
CHECKED = [(c, "99KB-sm86-sm89") for c in CASES] + [
    (c, level) for c in ("gqa-gk-gv-bucket2", "packed-ggamma-gk-bucket3", "fp32-allgates-bucket4")
    for level in ("163KB-sm80", "H200")]
# Timed only (no reference): the benchmark's B8 T4096 H16 shape (N·H = 128, bucket 2), g and gk
TIMED = {c.name: c for c in (
    Case("bench-g-B8T4096H16", B=8, T=4096, H=16, gates=("g",), dtype=torch.bfloat16),
    Case("bench-gk-B8T4096H16", B=8, T=4096, H=16, gates=("gk",), dtype=torch.bfloat16),
    CASES["fp32-allgates-bucket4"],
)}


@contextlib.contextmanager
def as_level(level, monkeypatch):
    """Launches choose configs as on that level's GPU: shared memory capped, TMA off below sm_90."""
    cap, tma = LEVELS[level]
    with tuning.smem_limit(cap), monkeypatch.context() as m:
        if not tma:
            m.setattr(tuning, "tma_device", lambda device: False)
        yield


class Prepared:
    """A case's inputs (drawn once, from the case's name) and its float64 references, made on first use."""

    def __init__(self, case):
        torch.manual_seed(zlib.crc32(case.name.encode()))
        B, T, H, G, K, V, dev = case.B, case.T, case.H, case.G, case.K, case.V, "cuda"
        self.cu = None if case.cu is None else torch.tensor(case.cu, dtype=torch.int32, device=dev)
        N = B if case.cu is None else len(case.cu) - 1
        self.k = (torch.randn(B, T, H, K, device=dev) * K ** -0.5).to(case.dtype)
        self.v = torch.randn(B, T, H, V, device=dev).to(case.dtype)
        self.q = (torch.randn(B, T, H * G, K, device=dev) * K ** -0.5).to(case.dtype)
        self.do = torch.randn(B, T, H * G, V, device=dev).to(case.dtype)
        self.h0 = torch.randn(N, H, K, V, device=dev)
        self.dht = torch.randn(N, H, K, V, device=dev)
        shapes = {"g": (B, T, H), "gk": (B, T, H, K), "gv": (B, T, H, V)}
        self.nat = {n: -(0.005 + 0.05 * torch.rand(H, device=dev)) if n == "g_gamma"
                    else F.logsigmoid(torch.randn(*shapes[n], device=dev) + 4) for n in case.gates}
        self.kg = {n: x * gates.RCP_LN2 if n == "g_gamma" else gates.chunk_local_cumsum(x, 64, self.cu)
                   for n, x in self.nat.items()}
        self.case, self._refs = case, {}

    def run(self, direction, poison=True):
        """The autotuned kernel: (states, final or initial state); ``poison``: outputs start as NaN
        (``nan_poisoned_empty``: an element never written fails the check), not when timed."""
        c = self.case
        with nan_poisoned_empty() if poison else contextlib.nullcontext():
            if direction == "fwd":
                return chunkstate.chunk_fwd_h(self.k, self.v, **self.kg, h0=self.h0, output_final_state=True,
                                              cu_seqlens=self.cu, pieces=c.pieces)
            return chunkstate.chunk_bwd_dh(self.q, self.k, self.v, self.do, self.h0, self.dht, c.K ** -0.5,
                                           **self.kg, cu_seqlens=self.cu, pieces=c.pieces)

    def reference(self, direction):
        if direction not in self._refs:
            if direction == "fwd":
                self._refs[direction] = reference.recurrent_states(self.k, self.v, **self.nat, h0=self.h0,
                                                                   cu_seqlens=self.cu)
            else:
                self._refs[direction] = reference.state_grads(self.q, self.k, self.v, self.do, **self.nat,
                                                              h0=self.h0, dht=self.dht, cu_seqlens=self.cu,
                                                              scale=self.case.K ** -0.5)
        return self._refs[direction]


@pytest.fixture(scope="module")
def prepared():
    made = {}

    def get(name):
        if name not in made:
            made[name] = Prepared(CASES.get(name) or TIMED[name])
        return made[name]
    return get


@pytest.fixture
def compiled_for(monkeypatch):
    """Records every (kernel, arguments, configs) the autotuners compile candidates for
    (``tuning.compile_configs``, called by the pruner once per new key). The autotuners start
    from empty caches, so every key of the test is pruned and tuned anew; the keys tuned before
    are given back after."""
    seen = []
    original = tuning.compile_configs

    def record(kernel, args, configs):
        seen.append((kernel, dict(args), list(configs)))
        return original(kernel, args, configs)

    monkeypatch.setattr(tuning, "compile_configs", record)
    tuners = (forward._tuned_forward, backward._tuned_backward)
    saved = [dict(t.cache) for t in tuners]
    for t in tuners:
        t.cache.clear()
    yield seen
    for t, cache in zip(tuners, saved):
        t.cache.clear()
        t.cache.update(cache)


def check_fits(seen, level):
    """Every candidate compiled under ``level`` uses at most the cap and the estimate (the kernel
    compiled for it, read back from the JIT cache through ``warmup``)."""
    cap, _ = LEVELS[level]
    limit = tuning.device_limits("cuda").smem if cap is None else min(cap, tuning.device_limits("cuda").smem)
    assert seen, "no new key was tuned: the cap did not reach the autotune key"
    for kernel, args, configs in seen:
        assert args["SMEM"] == limit, (args["SMEM"], limit)
        inputs = args.get("k", args.get("q"))
        for cfg in configs:
            BK, BV, _, stages, tma = tuning.config_tuple(cfg)
            assert tma is False or LEVELS[level][1], f"{tuning.config_label(cfg)}: TMA under {level}"
            used = kernel.warmup(grid=(1,), **args, **cfg.all_kwargs()).metadata.shared
            bound = tuning.shared_memory(BK, BV, stages, BT=args["BT"], in_bytes=inputs.element_size(),
                                         g=args["USE_G"], gk=args["USE_GK"], gv=args["USE_GV"], tma=tma,
                                         device=tuning.device_limits("cuda"))
            what = f"{kernel.__name__} {tuning.config_label(cfg)} under {level}"
            assert used <= bound, f"{what}: uses {used} B, estimated {bound} B"
            assert used <= limit, f"{what}: uses {used} B, the cap is {limit} B"


@gpu
@pytest.mark.parametrize("direction", ["fwd", "bwd"])
@pytest.mark.parametrize("name,level", CHECKED, ids=[f"{c}-{lv}" for c, lv in CHECKED])
def test_capped_against_loop(name, level, direction, prepared, compiled_for, monkeypatch):
    p = prepared(name)
    with as_level(level, monkeypatch):
        states, edge = p.run(direction)
    ref_states, ref_edge = p.reference(direction)
    tol = state_tolerance(p.case.dtype)
    what = f"{direction} {name} under {level}"
    check_close(states, ref_states, f"{what}: {'h' if direction == 'fwd' else 'dh'}", tol)
    check_close(edge, ref_edge, f"{what}: {'ht' if direction == 'fwd' else 'dh0'}", tol)
    check_fits(compiled_for, level)


@gpu
@pytest.mark.parametrize("name", list(TIMED))
def test_capped_timings(name, prepared, monkeypatch, record_property):
    """Median times of the autotuned kernels at each level, and the config each picked; printed
    (``pytest -rP``), nothing asserted about speed."""
    p = prepared(name)
    lines = []
    for direction, tuner in (("fwd", forward._tuned_forward), ("bwd", backward._tuned_backward)):
        base = None
        for level in LEVELS:
            with as_level(level, monkeypatch):
                p.run(direction)  # tunes the key if new
                picked = tuning.config_label(tuner.best_config)
                ms = triton.testing.do_bench(lambda d=direction: p.run(d, poison=False), warmup=25, rep=100,
                                             return_mode="median")
            base = base or ms
            record_property(f"{direction}-{level}-ms", round(ms, 4))
            record_property(f"{direction}-{level}-config", picked)
            lines.append(f"{direction} {name:22s} {level:15s} {ms:8.3f} ms  x{ms / base:4.2f}  {picked}")
    print(f"\nautotuned times on {torch.cuda.get_device_name()} (x: against the uncapped H200):")
    print("\n".join(lines))
