"""The forward kernel ``chunkstate.chunk_fwd_h`` against the float64 token loop.

On CPU (Triton's interpreter, fp32 and fp16): a pairwise grid over the gates (each alone and
composed, ``g`` with ``g_gamma`` included), initial / final states, both state layouts, state
precision, chunk sizes 16/32/64, split sizes 1/2/4 chunks, odd shapes (T = 1, 63, 100; K, V not
powers of two, larger than one tile), packed batches with empty and one-token sequences and
explicit multi-tile configs; then exact identities between calls, T = 0, non-contiguous inputs
and sequence pieces (``pieces=P``, also with several tiles).

On a GPU only (skipped on CPU, saying why): bf16 and fp32 at T >= 4096 with K = V = 64/128/256,
every config of ``tuning.ALL_CONFIGS``, fla-core 0.6.0's kernel where fla is right, more than
65,535 programs, and element offsets beyond 2^31.

Inputs are fresh random tensors on every run. Gates are natural-log per token in the tests and
are turned into what the kernel reads exactly as a caller does: ``gates.chunk_local_cumsum`` (log2
units, restarting every chunk and every sequence) for g / gk / gv, and ``RCP_LN2 * g_gamma``.
Every kernel call runs inside ``nan_poisoned_empty`` so an output element never written is NaN.

Tolerances (relative Frobenius error, ``testing.rel_err``) follow from the roundings the kernel
does and the loop does not; the loop reads the very same (fp16/bf16) inputs upcast to float64,
so input rounding is no error:

- fp32 under the interpreter: ``tl.dot`` is a numpy fp32 matmul (no tf32), ``exp2`` is fp32. A
  state is a sum of at most ~100 fp32 products of O(1) terms: worst case ~100 · 2^-24 ≈ 6e-6,
  typically ~1e-7. ``TOL_FP32 = 1e-5``.
- fp16 (2^-11 ≈ 4.9e-4 per rounding): the kernel rounds the decayed chunk operands to fp16 before
  ``tl.dot`` (v when a g/g_gamma/gv gate is on, k when gk is), and stores h in fp16 unless
  ``states_in_fp32``: at most three roundings in a row, worst case 3 · 2^-11 ≈ 1.5e-3 (RMS about
  5e-4). ``TOL_FP16 = 2e-3``.
- bf16 on the GPU: the same three roundings at 2^-8 ≈ 3.9e-3 each, RMS ≈ 3 · 2.3e-3 / sqrt(3) ≈
  4e-3. ``TOL_BF16 = 1e-2``.
- fp32 on the GPU: ``tl.dot`` rounds both fp32 operands to tf32 (10-bit mantissa; up to 2^-10
  each if the conversion truncates): worst case 2 · 2^-10 ≈ 2e-3. ``TOL_TF32 = 2e-3``.
"""
from __future__ import annotations

import inspect
import itertools
import math
import random

import pytest
import torch
import torch.nn.functional as F
import triton

import chunkstate
from chunkstate import tuning, gates, reference
from chunkstate.gates import RCP_LN2, prepare_chunk_offsets
from chunkstate.testing import check_close, nan_poisoned_empty

TOL_FP32 = 1e-5
TOL_FP16 = 2e-3
TOL_BF16 = 1e-2
TOL_TF32 = 2e-3
TOL = {torch.float32: TOL_FP32, torch.float16: TOL_FP16}

ON_GPU = chunkstate.DEVICE == "cuda"
gpu_only = pytest.mark.gpu(reason="bf16, large shapes and per-config compilation cannot run under Triton's "
                           "interpreter on CPU")
cpu_only = pytest.mark.skipif(ON_GPU, reason="interpreter grid (fp16/fp32, small shapes): the GPU tests "
                              "below cover the compiled kernel")

GATE_NAMES = ("g", "g_gamma", "gk", "gv")


# ---------------------------------------------------------------------------------------------
# Inputs and the two sides of every comparison
# ---------------------------------------------------------------------------------------------

def natural_gates(B, T, H, K, V, names, device):
    """Natural-log per-token gates (mild: about -0.03 per token, so a state carries ~2 chunks of
    history and a wrong carry shows) and a per-head constant decay."""
    out = {}
    if "g" in names:
        out["g"] = F.logsigmoid(4 + torch.randn(B, T, H, device=device))
    if "g_gamma" in names:
        out["g_gamma"] = -torch.empty(H, device=device).uniform_(0.01, 0.06)
    if "gk" in names:
        out["gk"] = F.logsigmoid(4 + torch.randn(B, T, H, K, device=device))
    if "gv" in names:
        out["gv"] = F.logsigmoid(4 + torch.randn(B, T, H, V, device=device))
    return out


def make_case(B, T, H, K, V, dtype, gate_names=(), use_h0=False, cu=None, device="cpu"):
    """Random inputs: k, v in ``dtype``, natural-log gates (fp32), h0 [N, H, K, V] fp32."""
    cu_seqlens = None if cu is None else torch.tensor(cu, dtype=torch.int32, device=device)
    N = B if cu is None else len(cu) - 1
    k = torch.randn(B, T, H, K, device=device).to(dtype)
    v = torch.randn(B, T, H, V, device=device).to(dtype)
    nat = natural_gates(B, T, H, K, V, gate_names, device)
    h0 = torch.randn(N, H, K, V, device=device) if use_h0 else None
    return dict(k=k, v=v, nat=nat, h0=h0, cu_seqlens=cu_seqlens)


def run_kernel(case, chunk_size=64, split_size=None, output_final_state=True, state_v_first=False,
               states_in_fp32=False, config=None, pieces=None):
    """chunk_fwd_h on ``case``; h and ht returned in the [.., K, V] layout whatever the flag."""
    h0 = case["h0"]
    if h0 is not None and state_v_first:
        h0 = h0.transpose(-1, -2).contiguous()
    with nan_poisoned_empty():
        h, ht = chunkstate.chunk_fwd_h(
            case["k"], case["v"], **gates.kernel_gates(case["nat"], chunk_size, case["cu_seqlens"]), h0=h0,
            output_final_state=output_final_state, state_v_first=state_v_first,
            cu_seqlens=case["cu_seqlens"], chunk_size=chunk_size, split_size=split_size,
            states_in_fp32=states_in_fp32, config=config, pieces=pieces)
    if state_v_first:
        h = h.transpose(-1, -2)
        ht = None if ht is None else ht.transpose(-1, -2)
    return h, ht


def run_loop(case, chunk_size=64, split_size=None):
    """The float64 token loop on the same inputs (natural-log gates)."""
    return reference.recurrent_states(case["k"], case["v"], **case["nat"], h0=case["h0"],
                                      cu_seqlens=case["cu_seqlens"], chunk_size=chunk_size,
                                      split_size=split_size)


def check_against_loop(case, tol_h, tol_ht, chunk_size=64, split_size=None, what="", **kw):
    h, ht = run_kernel(case, chunk_size, split_size, **kw)
    h_ref, ht_ref = run_loop(case, chunk_size, split_size)
    assert h.shape == h_ref.shape, f"{what}: h shape {tuple(h.shape)} != {tuple(h_ref.shape)}"
    check_close(h, h_ref, f"{what} h", tol_h)
    if kw.get("output_final_state", True):
        assert ht.dtype == torch.float32, f"{what}: ht must be fp32, got {ht.dtype}"
        check_close(ht, ht_ref, f"{what} ht", tol_ht)
    return h, ht


# ---------------------------------------------------------------------------------------------
# CPU: a pairwise grid
# ---------------------------------------------------------------------------------------------

def pairwise(factors: dict, seed: int = 0, tries: int = 10) -> list[dict]:
    """A small list of cases in which every pair of values of every two factors occurs together
    (greedy, deterministic: the case list and test ids are stable; the inputs are not)."""
    names = list(factors)
    sizes = [len(factors[n]) for n in names]
    pairs = list(itertools.combinations(range(len(names)), 2))

    def covered(case):
        return {(i, case[i], j, case[j]) for i, j in pairs}

    uncovered = set().union(*[{(i, a, j, b) for a in range(sizes[i]) for b in range(sizes[j])} for i, j in pairs])
    rng = random.Random(seed)
    cases = []
    while uncovered:
        best, best_gain = None, -1
        for _ in range(tries):
            i, a, j, b = rng.choice(sorted(uncovered))
            case = [rng.randrange(s) for s in sizes]
            case[i], case[j] = a, b
            for f in rng.sample(range(len(names)), len(names)):
                if f in (i, j):
                    continue
                gains = []
                for x in range(sizes[f]):
                    case[f] = x
                    gains.append(len(covered(case) & uncovered))
                case[f] = max(range(sizes[f]), key=gains.__getitem__)
            gain = len(covered(case) & uncovered)
            if gain > best_gain:
                best, best_gain = list(case), gain
        cases.append(best)
        uncovered -= covered(best)
    return [{n: factors[n][c] for n, c in zip(names, case)} for case in cases]


# (label, B, T, H, K, V, cu_seqlens)
CPU_SHAPES = [
    ("B2T63H2K20V24", 2, 63, 2, 20, 24, None),
    ("B1T100H3K24V20", 1, 100, 3, 24, 20, None),
    ("B3T1K16V8", 3, 1, 2, 16, 8, None),
    ("varlen0-1-39-0-60", 1, 100, 2, 24, 20, [0, 0, 1, 40, 40, 100]),
    ("varlen17-64K68V20", 1, 81, 1, 68, 20, [0, 17, 81]),  # K above the default 64-wide tile
    ("B1T64K33V65", 1, 64, 1, 33, 65, None),  # V above the default tile, T a multiple of 64
]
GATE_SETS = [(), ("g",), ("g_gamma",), ("gk",), ("gv",), ("g", "g_gamma"), ("gk", "gv"), ("g", "gk"),
             ("g_gamma", "gv"), ("g", "gv"), ("g_gamma", "gk"), GATE_NAMES]
SMALL_CONFIGS = [None,  # the autotuned path (one config under the interpreter: 64 x 64)
                 triton.Config({"BK": 16, "BV": 32}, num_warps=4, num_stages=1),
                 triton.Config({"BK": 32, "BV": 16}, num_warps=2, num_stages=1)]
CPU_FACTORS = dict(
    gates=GATE_SETS,
    shape=CPU_SHAPES,
    dtype=[torch.float32, torch.float16],
    chunk_size=[16, 32, 64],
    splits=[None, 2, 4],  # split_size = splits * chunk_size
    h0=[False, True],
    ht=[False, True],
    state_v_first=[False, True],
    states_in_fp32=[False, True],
    config=SMALL_CONFIGS,
)


def _case_id(c):
    cfg = "auto" if c["config"] is None else f"{c['config'].kwargs['BK']}x{c['config'].kwargs['BV']}"
    return "-".join([
        "+".join(c["gates"]) or "nogate", c["shape"][0], str(c["dtype"]).removeprefix("torch."),
        f"BT{c['chunk_size']}", f"BS{c['splits'] or 1}x", "h0" if c["h0"] else "noh0",
        "ht" if c["ht"] else "noht", "vk" if c["state_v_first"] else "kv",
        "h32" if c["states_in_fp32"] else "hlow", cfg])


CPU_CASES = pairwise(CPU_FACTORS)


@cpu_only
@pytest.mark.parametrize("c", CPU_CASES, ids=[_case_id(c) for c in CPU_CASES])
def test_grid_against_loop(c, device):
    label, B, T, H, K, V, cu = c["shape"]
    BT = c["chunk_size"]
    BS = None if c["splits"] is None else c["splits"] * BT
    case = make_case(B, T, H, K, V, c["dtype"], c["gates"], c["h0"], cu, device)
    h, _ = check_against_loop(case, TOL[c["dtype"]], TOL[c["dtype"]],
                              chunk_size=BT, split_size=BS, what=_case_id(c),
                              output_final_state=c["ht"], state_v_first=c["state_v_first"],
                              states_in_fp32=c["states_in_fp32"], config=c["config"])
    assert h.dtype == (torch.float32 if c["states_in_fp32"] else c["dtype"])


def test_grid_covers_the_brief():
    """The pairwise grid holds every gate set with each dtype, each chunk size and each shape."""
    seen = {(tuple(c["gates"]), c["dtype"], c["chunk_size"], c["shape"][0]) for c in CPU_CASES}
    for gs in GATE_SETS:
        assert {d for (g, d, _, _) in seen if g == gs} == {torch.float32, torch.float16}, gs
        assert {bt for (g, _, bt, _) in seen if g == gs} == {16, 32, 64}, gs
        assert {s for (g, _, _, s) in seen if g == gs} == {s[0] for s in CPU_SHAPES}, gs


# ---------------------------------------------------------------------------------------------
# CPU: properties the grid does not pin down
# ---------------------------------------------------------------------------------------------

@cpu_only
@pytest.mark.parametrize("BK,BV", sorted({(c.kwargs["BK"], c.kwargs["BV"]) for c in tuning.ALL_CONFIGS}))
def test_every_tile_shape_of_the_gpu_configs(BK, BV, device):
    """Each (BK, BV) a GPU may run gives the loop's states, here on K = 72, V = 40 (ragged tiles)."""
    case = make_case(1, 70, 1, 72, 40, torch.float32, ("g", "gk", "gv"), True, None, device)
    cfg = triton.Config({"BK": BK, "BV": BV}, num_warps=4, num_stages=1)
    check_against_loop(case, TOL_FP32, TOL_FP32, chunk_size=32, what=f"BK={BK} BV={BV}", config=cfg)


@cpu_only
@pytest.mark.parametrize("use_h0", [False, True])
def test_empty_and_one_token_sequences(use_h0, device):
    """cu_seqlens [0, 0, 1, 40, 40, 100]: empty sequences own no split and their ht is h0 (or 0)."""
    cu = [0, 0, 1, 40, 40, 100]
    case = make_case(1, 100, 2, 24, 20, torch.float32, ("g", "gk"), use_h0, cu, device)
    h, ht = check_against_loop(case, TOL_FP32, TOL_FP32, chunk_size=16, split_size=32, what="varlen")
    offsets = prepare_chunk_offsets(case["cu_seqlens"], 32).tolist()
    assert offsets == [0, 0, 1, 3, 3, 5] and h.shape[1] == 5
    for n in (0, 3):  # the empty sequences: the state passes through untouched
        want = case["h0"][n] if use_h0 else torch.zeros_like(ht[n])
        assert torch.equal(ht[n], want), f"ht of empty sequence {n} must equal {'h0' if use_h0 else 0}"
    # every sequence's first stored state is its initial state, bit for bit
    for n in (1, 2, 4):
        want = case["h0"][n] if use_h0 else torch.zeros_like(ht[n])
        assert torch.equal(h[0, offsets[n]], want), f"first state of sequence {n}"


@cpu_only
@pytest.mark.parametrize("cu", [None, [0, 0, 0]], ids=["dense", "varlen-all-empty"])
@pytest.mark.parametrize("use_h0", [False, True])
def test_no_tokens(cu, use_h0, device):
    """T = 0: no split is stored, and the final state is the initial one."""
    B = 2 if cu is None else 1
    case = make_case(B, 0, 2, 24, 20, torch.float32, ("g", "gv"), use_h0, cu, device)
    h, ht = run_kernel(case, chunk_size=32)
    assert h.shape == (B, 0, 2, 24, 20)
    want = case["h0"] if use_h0 else torch.zeros(2, 2, 24, 20)
    assert torch.equal(ht, want)
    h_ref, ht_ref = run_loop(case, 32)
    assert h_ref.shape == h.shape and torch.equal(ht_ref.float(), ht)


@cpu_only
@pytest.mark.parametrize("cu", [None, [0, 0, 1, 40, 40, 100]], ids=["dense", "varlen"])
def test_split_states_are_every_kth_chunk_state(cu, device):
    """With split_size = 4·BT the kernel stores exactly every 4th state of the split_size = BT run."""
    B, H = (2, 1) if cu is None else (1, 2)
    case = make_case(B, 100, H, 24, 20, torch.float32, ("g", "g_gamma", "gk", "gv"), True, cu, device)
    h1, ht1 = run_kernel(case, chunk_size=16)
    h4, ht4 = run_kernel(case, chunk_size=16, split_size=64)
    assert torch.equal(ht1, ht4)
    if cu is None:
        assert torch.equal(h4, h1[:, ::4])
    else:
        o1 = prepare_chunk_offsets(case["cu_seqlens"], 16).tolist()
        o4 = prepare_chunk_offsets(case["cu_seqlens"], 64).tolist()
        for n in range(len(cu) - 1):
            assert torch.equal(h4[0, o4[n]:o4[n + 1]], h1[0, o1[n]:o1[n + 1]:4]), f"sequence {n}"


@cpu_only
def test_layouts_and_state_precisions_agree_exactly(device):
    """state_v_first only transposes; states_in_fp32 only skips the final rounding of h."""
    case = make_case(2, 63, 1, 20, 36, torch.float16, ("g", "gk"), True, None, device)
    h, ht = run_kernel(case, chunk_size=16)
    h_vk, ht_vk = run_kernel(case, chunk_size=16, state_v_first=True)  # returned transposed back
    h32, ht32 = run_kernel(case, chunk_size=16, states_in_fp32=True)
    assert h.dtype == torch.float16 and h32.dtype == torch.float32
    assert torch.equal(h, h_vk) and torch.equal(ht, ht_vk)
    assert torch.equal(h32.to(torch.float16), h) and torch.equal(ht32, ht)


@cpu_only
@pytest.mark.parametrize("chunk_size", [16, 64])
def test_g_with_g_gamma_is_one_merged_scalar_gate(chunk_size, device):
    """g and g_gamma in one call decay like the single scalar gate g + g_gamma (fla-core 0.6.0
    overwrites the g_gamma ramp with g's and gets this wrong)."""
    case = make_case(1, 100, 3, 20, 24, torch.float32, ("g", "g_gamma"), True, None, device)
    merged = dict(case, nat={"g": case["nat"]["g"] + case["nat"]["g_gamma"]})
    h, ht = check_against_loop(case, TOL_FP32, TOL_FP32, chunk_size, what="g+g_gamma")
    h_m, ht_m = run_kernel(merged, chunk_size)
    check_close(h, h_m, "g+g_gamma vs merged g", TOL_FP32)
    check_close(ht, ht_m, "g+g_gamma vs merged g (ht)", TOL_FP32)


@cpu_only
def test_scalar_gate_equals_a_constant_key_gate(device):
    """g (one decay per token) and gk with that decay on every key dimension give the same states."""
    case = make_case(1, 70, 2, 20, 24, torch.float32, ("g",), True, None, device)
    as_gk = dict(case, nat={"gk": case["nat"]["g"][..., None].expand(-1, -1, -1, 20).contiguous()})
    as_gv = dict(case, nat={"gv": case["nat"]["g"][..., None].expand(-1, -1, -1, 24).contiguous()})
    h, ht = run_kernel(case, 32)
    for name, other in (("gk", as_gk), ("gv", as_gv)):
        h2, ht2 = run_kernel(other, 32)
        check_close(h2, h, f"g as {name}", TOL_FP32)
        check_close(ht2, ht, f"g as {name} (ht)", TOL_FP32)


@cpu_only
@pytest.mark.parametrize("state_v_first", [False, True])
def test_noncontiguous_inputs(state_v_first, device):
    """Strided views (k and gk transposed, v and g sliced, h0 transposed) give the same states as
    their contiguous copies."""
    B, T, H, K, V, BT = 2, 63, 2, 20, 36, 16
    k = torch.randn(B, T, K, H, device=device).transpose(2, 3)  # [B, T, H, K], not contiguous
    v = torch.randn(B, T, H, 2 * V, device=device)[..., ::2]  # every other column
    g_nat = F.logsigmoid(4 + torch.randn(B, T, 2 * H, device=device))[..., ::2]
    gk_nat = F.logsigmoid(4 + torch.randn(B, T, K, H, device=device)).transpose(2, 3)
    h0 = torch.randn(B, H, V, K, device=device).transpose(-1, -2)  # [B, H, K, V]
    assert not any(x.is_contiguous() for x in (k, v, g_nat, gk_nat, h0))
    g = gates.chunk_local_cumsum(g_nat, BT)
    gk = gates.chunk_local_cumsum(gk_nat, BT).transpose(2, 3).contiguous().transpose(2, 3)
    assert not gk.is_contiguous()
    h0_arg = h0.transpose(-1, -2) if state_v_first else h0  # [V, K] view when V-first
    with nan_poisoned_empty():
        h, ht = chunkstate.chunk_fwd_h(k, v, g=g, gk=gk, h0=h0_arg, output_final_state=True,
                                       state_v_first=state_v_first, chunk_size=BT)
        h_c, ht_c = chunkstate.chunk_fwd_h(k.contiguous(), v.contiguous(), g=g.contiguous(),
                                           gk=gk.contiguous(), h0=h0_arg.contiguous(),
                                           output_final_state=True, state_v_first=state_v_first,
                                           chunk_size=BT)
    assert torch.equal(h, h_c) and torch.equal(ht, ht_c)
    if state_v_first:
        h, ht = h.transpose(-1, -2), ht.transpose(-1, -2)
    h_ref, ht_ref = reference.recurrent_states(k, v, g=g_nat, gk=gk_nat, h0=h0, chunk_size=BT)
    check_close(h, h_ref, "strided h", TOL_FP32)
    check_close(ht, ht_ref, "strided ht", TOL_FP32)


@cpu_only
@pytest.mark.parametrize("pieces,cu,gs,vf,tile", [
    (2, None, ("g", "gk"), False, None),
    (3, [0, 0, 1, 40, 40, 100], ("g_gamma", "gv"), True, None),
    (4, [0, 100], GATE_NAMES, False, (16, 16)),  # 2 x 2 tiles: the decays have one writer per element
], ids=["2-dense-g+gk", "3-varlen-g_gamma+gv-vk", "4-one-sequence-allgates-16x16"])
def test_sequence_pieces_against_loop(pieces, cu, gs, vf, tile, device):
    """chunk_fwd_h(pieces=P): each sequence cut into P runs from zero, a scan of their final states
    and total decays, then the states again; the same states as the loop (and as one piece)."""
    B, H = (2, 1) if cu is None else (1, 2)
    case = make_case(B, 100, H, 24, 20, torch.float32, gs, True, cu, device)
    cfg = None if tile is None else triton.Config({"BK": tile[0], "BV": tile[1]}, num_warps=4, num_stages=1)
    h, ht = check_against_loop(case, TOL_FP32, TOL_FP32, 16, 32, what=f"pieces={pieces}", state_v_first=vf,
                               pieces=pieces, config=cfg)
    h1, ht1 = run_kernel(case, 16, 32, state_v_first=vf, pieces=1, config=cfg)
    check_close(h, h1, "pieces vs one piece", TOL_FP32)
    check_close(ht, ht1, "pieces vs one piece (ht)", TOL_FP32)


def _look_back_sync_zero():
    """Every kept one-launch workspace's flags and ticket counter are zero (as a launch must leave them)."""
    from chunkstate import pieces
    kept = [views for key, views in pieces._WORKSPACES.items() if key[0] == "look_back"]
    return bool(kept) and all(int(views[3].abs().sum()) == 0 and int(views[4].abs().sum()) == 0 for views in kept)


ONE_LAUNCH_TILES = [(16, 16), (32, 64), (64, 64)]  # 2 x 2, 1 x 1 tiles of K = 24, V = 20: one flag per tile
if ON_GPU:  # every tile shape the GPU configs use, each with 4 and 8 warps
    ONE_LAUNCH_TILES += [(64, 128), (128, 64), (128, 128), (32, 32)]


@pytest.mark.parametrize("tile", ONE_LAUNCH_TILES, ids=lambda t: f"{t[0]}x{t[1]}")
def test_pieces_in_one_launch_give_the_three_launches_states(tile, device, monkeypatch):
    """``pieces.ONE_LAUNCH``: each program walks its piece from zero and publishes its contribution,
    then folds those of the pieces before its own into its start, as the scan does, and walks again
    storing the states. The states are the three launches' bit for bit on CPU (the same arithmetic in
    the same order; a GPU may fuse a multiply-add differently: 1e-6 there); the final state, which
    the last piece walks to rather than the scan folding it, agrees to fp32 rounding; the flags and
    the ticket counter are zero after every call (the next call, and a CUDA graph replay, start from
    them); repeated calls reuse them. Dense and packed batches (one-token sequences, uneven pieces),
    every gate, h0, split 32, both state layouts."""
    from chunkstate import pieces

    pieces.clear_workspaces()
    warps = (4, 8) if ON_GPU else (4,)
    for vf, (B, T, cu, P) in itertools.product((False, True), [(2, 100, None, 3), (1, 130, [0, 1, 60, 61, 130], 4)]):
        case = make_case(B, T, 2, 24, 20, torch.float32, GATE_NAMES, True, cu, device)
        for w in warps:
            cfg = triton.Config({"BK": tile[0], "BV": tile[1]}, num_warps=w, num_stages=1)
            out = {}
            for one in (False, True):
                monkeypatch.setattr(pieces, "ONE_LAUNCH", one)
                out[one] = run_kernel(case, 16, 32, state_v_first=vf, pieces=P, config=cfg)
            where = f"B{B} T{T} cu={cu} pieces={P} state_v_first={vf} {tile} w{w}"
            if ON_GPU:
                check_close(out[True][0], out[False][0], f"states, one launch vs three ({where})", 1e-6)
            else:
                assert torch.equal(out[True][0], out[False][0]), f"states, one launch vs three ({where})"
            check_close(out[True][1], out[False][1], f"final states, one launch vs three ({where})", TOL_FP32)
            assert _look_back_sync_zero(), f"flags and counter left non-zero ({where})"
    h, ht = run_kernel(case, 16, 32, pieces=4)  # the one-launch path, again, against the loop
    h_ref, ht_ref = run_loop(case, 16, 32)
    check_close(h, h_ref, "one launch vs the loop", TOL_TF32 if ON_GPU else TOL_FP32)
    check_close(ht, ht_ref, "one launch vs the loop (ht)", TOL_TF32 if ON_GPU else TOL_FP32)
    pieces.clear_workspaces()


@gpu_only
@pytest.mark.parametrize("direction", ["fwd", "bwd"])
def test_gpu_pieces_in_one_launch_under_load(direction, monkeypatch):
    """Many programs waiting at once, over and over: B1 T65536 H4 K = V = 128 in 16 and 32 pieces (up
    to 512 programs of 64×64 tiles, past one wave: programs that start late wait on earlier ones),
    autotuned, 20 calls each on fresh gates; every call's states equal to the three launches' to
    1e-6 and the flags and counter back at zero. A missed release or acquire shows as a wrong or
    changing answer; a deadlock as a hang (pytest's timeout)."""
    from chunkstate import pieces

    pieces.clear_workspaces()
    B, T, H, K, V, BT = 1, 65536, 4, 128, 128, 64
    k, v = (torch.randn(B, T, H, D, device="cuda", dtype=torch.bfloat16) for D in (K, V))
    for P in (16, 32):
        for call in range(20):
            g = gates.chunk_local_cumsum(F.logsigmoid(torch.randn(B, T, H, device="cuda") + 4), BT)
            dht = torch.randn(1, H, K, V, device="cuda")
            out = {}
            for one in (False, True):
                monkeypatch.setattr(pieces, "ONE_LAUNCH", one)
                with nan_poisoned_empty():
                    if direction == "fwd":
                        out[one] = chunkstate.chunk_fwd_h(k, v, g=g, output_final_state=True, states_in_fp32=True,
                                                          pieces=P)
                    else:
                        out[one] = chunkstate.chunk_bwd_dh(k, k, v, v, None, dht, 0.088, g=g, states_in_fp32=True,
                                                           pieces=P)
            check_close(out[True][0], out[False][0], f"{direction} pieces={P} call {call}: one launch vs three", 1e-6)
            assert _look_back_sync_zero(), f"{direction} pieces={P} call {call}: flags or counter left non-zero"
    pieces.clear_workspaces()


def test_pieces_of_a_batch_with_an_empty_sequence_take_three_launches(device, monkeypatch):
    """An empty sequence owns no piece, so no program of a one-launch call would store its final
    state (h0): such a call takes the three launches, whose scan stores it."""
    from chunkstate import pieces

    pieces.clear_workspaces()
    case = make_case(1, 100, 2, 16, 16, torch.float32, ("g",), True, [0, 0, 50, 100], device)
    tol = TOL_TF32 if ON_GPU else TOL_FP32  # fp32 dots are tf32 on a GPU
    check_against_loop(case, tol, tol, 16, 32, what="pieces=3, an empty sequence", pieces=3)
    assert [key for key in pieces._WORKSPACES if key[0] == "look_back"] == []
    assert len(pieces._WORKSPACES) == 1  # the three launches' workspace
    pieces.clear_workspaces()


def _kept_workspace_ptrs():
    from chunkstate import pieces
    return [views[0].data_ptr() for views in pieces._WORKSPACES.values()]


@cpu_only
@pytest.mark.parametrize("keep", [True, False], ids=["kept", "too-large-to-keep"])
def test_pieces_workspace_kept_between_calls_never_mixes_them(keep, device, monkeypatch):
    """A call in pieces keeps its workspace (F, S and the decays) for the next call of the same sizes
    on the same device and stream: the second call, on other inputs, reuses that memory and still
    gets its own answer; a workspace over ``MAX_KEPT_BYTES`` is allocated per call and not kept."""
    from chunkstate import pieces

    pieces.clear_workspaces()
    if not keep:
        monkeypatch.setattr(pieces, "MAX_KEPT_BYTES", 0)
    B, T, H, K, V, BT, BS = 1, 96, 2, 16, 16, 16, 32
    for round_ in range(3):  # fresh inputs each round, the same sizes
        case = make_case(B, T, H, K, V, torch.float32, ("g", "gk"), True, None, device)
        h, ht = check_against_loop(case, TOL_FP32, TOL_FP32, BT, BS, what=f"pieces=3, call {round_}", pieces=3)
        ptrs = _kept_workspace_ptrs()
        if keep:
            assert len(ptrs) == 1, "one workspace kept for these sizes"
            if round_ == 0:
                first = ptrs[0]
            assert ptrs[0] == first, "a later call of the same sizes must reuse the kept workspace"
        else:
            assert ptrs == [], "a workspace over MAX_KEPT_BYTES must not be kept"
    other = make_case(B, T, 3, K, V, torch.float32, ("g",), False, None, device)  # other sizes: another one
    check_against_loop(other, TOL_FP32, TOL_FP32, BT, BS, what="pieces=3, three heads", pieces=3)
    assert len(_kept_workspace_ptrs()) == (2 if keep else 0)
    pieces.clear_workspaces()
    assert _kept_workspace_ptrs() == []


@gpu_only
def test_gpu_pieces_on_two_streams_and_in_a_cuda_graph():
    """Calls in pieces alternating between two streams keep one workspace per stream and give each
    call its own answer; a call captured in a CUDA graph allocates its own (none kept from inside the
    capture) and replays to the answer of the inputs it finds."""
    from chunkstate import pieces

    pieces.clear_workspaces()
    B, T, H, K, V, BT = 1, 8192, 2, 64, 64, 64
    cases = [make_case(B, T, H, K, V, torch.bfloat16, ("g",), True, None, "cuda") for _ in range(4)]
    refs = [run_kernel(c, BT, pieces=1, states_in_fp32=True) for c in cases]
    streams = [torch.cuda.Stream(), torch.cuda.Stream()]
    for s in streams:
        s.wait_stream(torch.cuda.current_stream())  # the inputs were made on the default stream
    outs = []
    for i, c in enumerate(cases):
        with torch.cuda.stream(streams[i % 2]):
            outs.append(run_kernel(c, BT, pieces=4, states_in_fp32=True))
    torch.cuda.synchronize()
    assert len(_kept_workspace_ptrs()) == 2, "one workspace per stream"
    for i, ((h, ht), (h1, ht1)) in enumerate(zip(outs, refs)):
        check_close(h, h1, f"call {i} on stream {i % 2}: h, pieces=4 vs one pass", TOL_TF32)
        check_close(ht, ht1, f"call {i} on stream {i % 2}: ht, pieces=4 vs one pass", TOL_TF32)

    c = cases[0]
    kw = dict(**gates.kernel_gates(c["nat"], BT, None), h0=c["h0"], output_final_state=True, chunk_size=BT,
              states_in_fp32=True, pieces=4)
    k, v = c["k"].clone(), c["v"].clone()
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())  # k, v cloned on the default stream
    with torch.cuda.stream(side):
        chunkstate.chunk_fwd_h(k, v, **kw)  # warm: tuned and compiled outside the capture
    torch.cuda.synchronize()
    kept = _kept_workspace_ptrs()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        h_g, ht_g = chunkstate.chunk_fwd_h(k, v, **kw)
    assert _kept_workspace_ptrs() == kept, "nothing kept from inside a capture"
    for c2 in cases[1:]:  # new k and v in the captured tensors; the gate and h0 captured stay
        k.copy_(c2["k"]), v.copy_(c2["v"])
        h1, ht1 = run_kernel({**c2, "h0": c["h0"], "nat": c["nat"]}, BT, pieces=1, states_in_fp32=True)
        graph.replay()
        torch.cuda.synchronize()
        check_close(h_g, h1, "graph replay: h", TOL_TF32)
        check_close(ht_g, ht1, "graph replay: ht", TOL_TF32)


# -- TMA loads (USE_TMA configs): the interpreter emulates Hopper's tensor descriptors

def tma_config(BK, BV):
    return triton.Config({"BK": BK, "BV": BV, "USE_TMA": True}, num_warps=4, num_stages=1)


TMA_CASES = [  # (id, B, T, H, K, V, cu, gates, dtype, BT, BS, tile, pieces, state_v_first)
    ("dense-T100-allgates-ragged-tiles", 2, 100, 2, 24, 20, None, GATE_NAMES, torch.float32, 16, 32, (16, 16), 1, False),
    ("varlen-empty-one-token-vk", 1, 100, 2, 20, 24, [0, 0, 1, 40, 40, 100], ("g_gamma", "gk", "gv"),
     torch.float32, 32, 64, (32, 16), 1, True),
    ("T1-tile-wider-than-K-V", 3, 1, 2, 16, 8, None, ("gk",), torch.float32, 16, None, (64, 64), 1, False),
    ("varlen17-64-K68", 1, 81, 1, 68, 20, [0, 17, 81], ("g", "gk"), torch.float32, 64, None, (64, 32), 1, False),
    ("pieces3-varlen-allgates", 1, 100, 2, 24, 20, [0, 0, 1, 40, 40, 100], GATE_NAMES, torch.float32, 16, 32,
     (16, 16), 3, False),
    ("fp16-dense-g+gv", 2, 63, 2, 24, 16, None, ("g", "gv"), torch.float16, 16, None, (16, 16), 1, False),
]


@pytest.mark.parametrize("c", TMA_CASES, ids=[c[0] for c in TMA_CASES])
def test_tma_loads_against_loop(c, device):
    """Tiles read through tensor descriptors (one per sequence: rows past its end and columns past
    K, V arrive as zeros) give the loop's states, and the pointer loads' states on the same tiles.
    On CPU and on a GPU (there fp32 dots are tf32)."""
    name, B, T, H, K, V, cu, gs, dtype, BT, BS, (BK, BV), pieces, vf = c
    tol = {torch.float32: TOL_TF32, torch.float16: TOL_FP16}[dtype] if ON_GPU else TOL[dtype]
    case = make_case(B, T, H, K, V, dtype, gs, True, cu, device)
    if ON_GPU and not tuning.tma_usable(case["k"]):
        pytest.skip("this GPU has no TMA (compute capability < 9.0)")
    assert tuning.tma_usable(case["k"], case["v"])
    h, ht = check_against_loop(case, tol, tol, BT, BS, what=name, state_v_first=vf,
                               config=tma_config(BK, BV), pieces=pieces)
    pointer = triton.Config({"BK": BK, "BV": BV}, num_warps=4, num_stages=1)
    h_p, ht_p = run_kernel(case, BT, BS, state_v_first=vf, config=pointer, pieces=pieces)
    check_close(h, h_p, f"{name}: TMA vs pointer loads", tol)
    check_close(ht, ht_p, f"{name}: TMA vs pointer loads (ht)", tol)


def test_tma_refused_where_descriptors_cannot_read_the_inputs(device):
    """A row of K = 33 fp32 (132 bytes) or a k starting 4 bytes off a 16-byte boundary cannot be a
    TMA descriptor: auto-tuned calls fall back to pointer loads (right answer), and an explicit
    USE_TMA config is refused with an error naming the inputs that cannot be read."""
    odd = make_case(1, 40, 2, 33, 16, torch.float32, ("gk",), False, None, device)
    flat = torch.randn(1 * 40 * 2 * 32 + 1, device=device)
    shifted = make_case(1, 40, 2, 32, 16, torch.float32, ("gk",), False, None, device)
    shifted["k"] = flat[1:].view(1, 40, 2, 32)  # contiguous, but 4 bytes past the storage's start
    tol = TOL_TF32 if ON_GPU else TOL_FP32
    for case, names in ((odd, "k, gk cannot"), (shifted, "k cannot")):
        assert not tuning.tma_usable(case["k"], case["v"])
        check_against_loop(case, tol, tol, 16, what="fallback to pointer loads")
        with pytest.raises(ValueError, match=rf"USE_TMA=True\), but {names} be read"):
            run_kernel(case, 16, config=tma_config(16, 16))


def test_tma_device_rule(monkeypatch):
    """TMA descriptors on an NVIDIA GPU of compute capability 9 or newer (and the interpreter's
    CPU), never on an older GPU or on ROCm (whose gfx9 reports capability 9.x). The answer is
    cached per device, so the cache is emptied around each pretended device."""
    import triton.language as tl

    if not hasattr(tl, "make_tensor_descriptor"):
        pytest.skip("this Triton has no tl.make_tensor_descriptor")
    for capability, hip, expected in [((9, 0), None, True), ((10, 0), None, True), ((8, 9), None, False),
                                      ((9, 4), "6.2", False)]:
        monkeypatch.setattr(torch.cuda, "get_device_capability", lambda index=None, c=capability: c)
        monkeypatch.setattr(torch.version, "hip", hip)
        tuning._tma_device.cache_clear()
        try:
            assert tuning.tma_device("cuda:0") is expected, (capability, hip)
        finally:
            tuning._tma_device.cache_clear()
    assert tuning.tma_device("cpu")


def test_tma_candidates_only_where_usable():
    """The autotuner's TMA candidates appear only when the wrapper says descriptors can be used;
    with a vector gate and TMA they are most of the list, and in every bucket."""
    for bucket in range(tuning.N_BUCKETS):
        base = {"K": 128, "V": 128, "OCCUPANCY": bucket}
        for vector in (False, True):
            off = tuning.prune(tuning.ALL_CONFIGS, {**base, "TMA_OK": 0, "USE_GK": vector})
            assert off and not any(tuning.config_tuple(c)[4] for c in off)
        on = tuning.prune(tuning.ALL_CONFIGS, {**base, "TMA_OK": 1, "USE_GK": True})
        assert 2 * sum(tuning.config_tuple(c)[4] for c in on) > len(on)


# -- the scalar gate's scaling of v: in v's own dtype below a quarter wave, else in fp32

def test_narrow_v_only_below_a_quarter_wave():
    """``tuning.narrow_v``: v is scaled by g in its own dtype in grid buckets 0 and 1 (under a
    quarter wave of (sequence, head) pairs), in fp32 from bucket 2 on."""
    assert [tuning.narrow_v(b) for b in range(tuning.N_BUCKETS)] == [True, True, False, False, False]


@pytest.mark.parametrize("gate", ["g", "g_gamma"])
def test_narrow_and_wide_v_give_the_same_states(gate, monkeypatch, device):
    """Scaled in v's dtype (``NARROW_V``: the product rounded at once, as fla does) or in fp32 until
    the dot, v is rounded once at the same point: both give the loop's states, bit for bit the same,
    for either scalar gate alone. The last chunk is ragged (T = 100): its rows past T are 0 · 2^{..}
    in the narrow form and must stay 0 — with g growing (g > 0, so Γ > 0), and with g_gamma steep
    (γ = −200 a token: past the end, γ times a negative count would overflow 2^{..} to inf, and
    0 · inf is NaN). Autotuned, the launcher asks ``tuning.narrow_v`` (here bucket 0: narrow). With
    a second gate on v (gv, or g beside g_gamma) an explicit ``NARROW_V=True`` is refused."""
    asked = []

    def spy(bucket, real=tuning.narrow_v):
        asked.append((bucket, real(bucket)))
        return real(bucket)

    monkeypatch.setattr(tuning, "narrow_v", spy)
    dtypes = [torch.float32, torch.float16] + ([torch.bfloat16] if ON_GPU else [])
    for dtype in dtypes:
        tol = GPU_TOL[dtype] if ON_GPU else TOL[dtype]
        case = make_case(2, 100, 3, 24, 40, dtype, (gate,), True, None, device)
        if gate == "g":
            case["nat"]["g"] = 0.05 * torch.rand(2, 100, 3, device=device)  # growing by up to 5 % a token
        else:
            case["nat"]["g_gamma"] = torch.tensor([-200.0, -0.3, -0.01], device=device)  # natural log a token
        out = {}
        for narrow in (False, True):
            cfg = triton.Config({"BK": 32, "BV": 64, "NARROW_V": narrow}, num_warps=4, num_stages=1)
            out[narrow] = check_against_loop(case, tol, tol, 64, 64, what=f"{dtype} NARROW_V={narrow}", config=cfg)
        assert torch.equal(out[False][0], out[True][0]) and torch.equal(out[False][1], out[True][1]), dtype
        assert not out[True][0].isnan().any() and not out[True][1].isnan().any()
        asked.clear()
        auto = run_kernel(case, 64, 64)
        assert asked == [(0, True)], asked
        assert torch.equal(auto[0], out[True][0]), dtype
    for gates in (("g", "gv"), ("g_gamma", "gv"), ("g", "g_gamma")):
        case = make_case(2, 100, 3, 24, 40, torch.float32, gates, False, None, device)
        with pytest.raises(ValueError, match=r"NARROW_V=True.*one of g and g_gamma given, not both, and no gv"):
            run_kernel(case, 64, config=triton.Config({"BK": 32, "BV": 64, "NARROW_V": True}, num_warps=4, num_stages=1))
        asked.clear()
        check_against_loop(case, TOL_TF32 if ON_GPU else TOL_FP32, TOL_TF32 if ON_GPU else TOL_FP32, 64,
                           what="+".join(gates))
        assert asked == [], f"with {gates} the launcher must not scale v narrow, whatever the bucket"


# ---------------------------------------------------------------------------------------------
# GPU only
# ---------------------------------------------------------------------------------------------

GPU_TOL = {torch.bfloat16: TOL_BF16, torch.float32: TOL_TF32, torch.float16: TOL_FP16}

# (dtype, B, T, H, K, V, gates, h0, cu_seqlens or None, chunk_size, split_size, state_v_first, states_in_fp32)
# fp32 with all four gates at K = V = 128 over 40 sequences lands in grid bucket 1, whose candidates
# include 64x128 tiles needing more shared memory than Hopper has with fp32 k, v, gk, gv (~248 KB):
# the autotuner must skip them and still answer. Small B·H cases go through sequence pieces.
_CU_40 = [0] + [100 * i + (i * 37) % 61 for i in range(1, 40)] + [4000]
GPU_CASES = [
    (torch.bfloat16, 2, 4100, 16, 128, 128, ("g",), True, None, 64, None, False, False),
    (torch.bfloat16, 2, 4096, 2, 64, 64, ("gk",), False, None, 64, 256, False, False),
    (torch.bfloat16, 1, 4133, 2, 256, 256, ("gk", "gv"), True, [0, 0, 1, 1000, 4133], 64, 128, True, False),
    (torch.float32, 2, 4096, 2, 128, 128, ("g", "g_gamma"), True, None, 64, None, False, True),
    (torch.float32, 1, 4100, 2, 64, 64, GATE_NAMES, True, None, 32, 128, True, True),
    (torch.float32, 1, 4200, 2, 256, 256, ("g_gamma", "gv"), False, [0, 63, 64, 4200], 64, None, False, True),
    (torch.float32, 1, 4000, 1, 128, 128, GATE_NAMES, True, _CU_40, 64, None, False, False),
    (torch.bfloat16, 3, 1001, 3, 100, 72, ("g", "gv"), True, None, 16, 64, False, False),  # ragged tiles
]


def _gpu_id(c):
    dtype, B, T, H, K, V, gs, h0, cu, BT, BS, vf, s32 = c
    return "-".join([str(dtype).removeprefix("torch."), f"B{B}T{T}H{H}K{K}V{V}", "+".join(gs) or "nogate",
                     "h0" if h0 else "noh0", "varlen" if cu else "dense", f"BT{BT}", f"BS{BS or BT}",
                     "vk" if vf else "kv", "h32" if s32 else "hlow"])


@gpu_only
@pytest.mark.parametrize("c", GPU_CASES, ids=[_gpu_id(c) for c in GPU_CASES])
def test_gpu_against_loop(c, device):
    dtype, B, T, H, K, V, gs, use_h0, cu, BT, BS, vf, s32 = c
    case = make_case(B, T, H, K, V, dtype, gs, use_h0, cu, device)
    check_against_loop(case, GPU_TOL[dtype], GPU_TOL[dtype], BT, BS, what=_gpu_id(c),
                       state_v_first=vf, states_in_fp32=s32)


# -- every config that may ever run: one shape, its reference computed once

ALL_CONFIG_SHAPE = dict(B=2, T=4100, H=2, K=128, V=128)


@pytest.fixture(scope="module")
def all_config_case():
    case = make_case(**ALL_CONFIG_SHAPE, dtype=torch.bfloat16, gate_names=("g", "gk"), use_h0=True,
                     device=chunkstate.DEVICE)
    return case, run_loop(case, 64)


def _fits(cfg, K, V):
    """A config is valid for a shape when its tiles are not wider than K, V rounded up (as prune)."""
    return cfg.kwargs["BK"] <= max(16, triton.next_power_of_2(K)) and \
        cfg.kwargs["BV"] <= max(16, triton.next_power_of_2(V))


@gpu_only
@pytest.mark.parametrize("cfg", tuning.ALL_CONFIGS, ids=tuning.config_label)
def test_gpu_every_config(cfg, all_config_case):
    """Not only the autotuner's winner: every config of ALL_CONFIGS valid for the shape is right."""
    assert _fits(cfg, ALL_CONFIG_SHAPE["K"], ALL_CONFIG_SHAPE["V"])  # every config fits K = V = 128
    case, (h_ref, ht_ref) = all_config_case
    h, ht = run_kernel(case, 64, config=cfg, pieces=1)  # the plain kernel, not sequence pieces
    check_close(h, h_ref, f"{tuning.config_label(cfg)} h", TOL_BF16)
    check_close(ht, ht_ref, f"{tuning.config_label(cfg)} ht", TOL_BF16)


# The candidates of the buckets where v is scaled in its own dtype (g or g_gamma alone), each run that
# way: B2 H2 is bucket 0, so every one of them, pointer or TMA loads, compiles with NARROW_V.
NARROW_CONFIGS = list(dict.fromkeys(
    c for bucket in range(tuning.N_BUCKETS) if tuning.narrow_v(bucket) for tma in (0, 1)
    for c in tuning.prune(tuning.ALL_CONFIGS, {"K": 128, "V": 128, "OCCUPANCY": bucket, "TMA_OK": tma})))


@gpu_only
@pytest.mark.parametrize("gate", ["g", "g_gamma"])
@pytest.mark.parametrize("cfg", NARROW_CONFIGS, ids=tuning.config_label)
def test_gpu_every_narrow_v_config(cfg, gate, device):
    assert tuning.narrow_v(tuning.launch_bucket(ALL_CONFIG_SHAPE["B"], ALL_CONFIG_SHAPE["H"], ALL_CONFIG_SHAPE["K"], ALL_CONFIG_SHAPE["V"]))
    case = make_case(**ALL_CONFIG_SHAPE, dtype=torch.bfloat16, gate_names=(gate,), use_h0=True, device=device)
    check_against_loop(case, TOL_BF16, TOL_BF16, 64, what=tuning.config_label(cfg), config=cfg, pieces=1)


# -- fla-core 0.6.0 where it is right (not g together with g_gamma)

def _fla():
    try:
        from fla.ops.common import chunk_h
    except Exception as e:  # not installed, or fails to import on this machine
        pytest.skip(f"fla (fla-core 0.6.0) is not importable here: {type(e).__name__}: {e}")
    return chunk_h


@gpu_only
@pytest.mark.parametrize("gs,cu,BS", [(("g", "gk", "gv"), None, None), (("g_gamma",), [0, 0, 1, 2000, 4100], 128)],
                         ids=["g+gk+gv-dense", "g_gamma-varlen-BS128"])
def test_gpu_against_fla(gs, cu, BS, device, fla_one_config):
    chunk_h = _fla()
    # fla >= 0.5.2 uses exp2 and reads log2 gates; older fla read natural-log gates.
    fla_scale = RCP_LN2 if "exp2" in inspect.getsource(chunk_h) else 1.0
    B = 2 if cu is None else 1
    case = make_case(B, 4100, 4, 128, 128, torch.bfloat16, gs, True, cu, device)
    fla_gates = {n: x * fla_scale if n == "g_gamma" else
                 gates.chunk_local_cumsum(x, 64, case["cu_seqlens"], scale=fla_scale)
                 for n, x in case["nat"].items()}
    params = inspect.signature(chunk_h.chunk_fwd_h).parameters
    kw = dict(h0=case["h0"], output_final_state=True, cu_seqlens=case["cu_seqlens"], chunk_size=64,
              split_size=BS)
    missing = [n for n in list(kw) + list(fla_gates) if n not in params]
    if missing:
        pytest.skip(f"this fla's chunk_fwd_h lacks {missing}")
    with nan_poisoned_empty():
        h_fla, ht_fla = chunk_h.chunk_fwd_h(case["k"], case["v"], **fla_gates, **kw)
    h, ht = check_against_loop(case, TOL_BF16, TOL_BF16, 64, BS, what="ours")
    h_ref, ht_ref = run_loop(case, 64, BS)
    check_close(h_fla, h_ref, "fla h vs loop (fla itself wrong?)", TOL_BF16)
    check_close(ht_fla, ht_ref, "fla ht vs loop (fla itself wrong?)", TOL_BF16)
    check_close(h, h_fla, "ours vs fla h", TOL_BF16)
    check_close(ht, ht_fla, "ours vs fla ht", TOL_BF16)


# -- more than 65,535 programs

def _sub_batch(case, seqs):
    """The packed sub-batch holding only sequences ``seqs`` (with their h0), for the loop."""
    cu = case["cu_seqlens"].tolist()
    idx = torch.cat([torch.arange(cu[n], cu[n + 1]) for n in seqs]).to(case["k"].device)
    lens = [cu[n + 1] - cu[n] for n in seqs]
    sub_cu = torch.tensor([0] + list(itertools.accumulate(lens)), dtype=torch.int32, device=case["k"].device)
    return dict(k=case["k"][:, idx], v=case["v"][:, idx], nat={n: x[:, idx] for n, x in case["nat"].items()},
                h0=None if case["h0"] is None else case["h0"][list(seqs)], cu_seqlens=sub_cu)


@gpu_only
def test_gpu_many_sequences(device):
    """70,000 short sequences x 1 head = 70,000 programs (fla 0.5.2's 3-D grid stopped at 65,535):
    sampled sequences, before and beyond that count, against the loop."""
    N, H, K, V, BT = 70_000, 1, 32, 32, 16
    lens = torch.randint(0, 41, (N,))
    lens[0], lens[1], lens[65_535], lens[-1] = 0, 1, 0, 1
    cu = [0] + torch.cumsum(lens, 0).tolist()
    case = make_case(1, cu[-1], H, K, V, torch.float32, ("g", "gk"), True, cu, device)
    h, ht = run_kernel(case, BT)
    offsets = prepare_chunk_offsets(case["cu_seqlens"], BT).tolist()
    assert h.shape[1] == offsets[-1]
    seqs = sorted({0, 1, 2, 65_534, 65_535, 65_536, N - 2, N - 1, *random.sample(range(N), 12)})
    h_ref, ht_ref = run_loop(_sub_batch(case, seqs), BT)
    h_pick = torch.cat([h[:, offsets[n]:offsets[n + 1]] for n in seqs], 1)
    check_close(h_pick, h_ref, "sampled sequences h", TOL_TF32)
    check_close(ht[seqs], ht_ref, "sampled sequences ht", TOL_TF32)
    assert torch.equal(ht[65_535], case["h0"][65_535])  # an empty sequence beyond 65,535


# -- element offsets beyond 2^31

@gpu_only
@pytest.mark.parametrize("pieces", [1, None], ids=["one-piece", "auto-pieces"])
def test_gpu_offsets_beyond_int32(pieces, device):
    """bf16 B=1, T = 2^21 + 1000, H = 8, K = V = 128: k and v hold 2^31 + 1,024,000 elements and the
    fp32 states 4.3e9, so any int32 offset wraps. Looping 2M tokens in float64 is too slow: the
    loop restarts from the kernel's own fp32 state entering split s0 (exact, no rounding) and
    runs the last ~170 tokens, whose k, v offsets lie beyond 2^31 — their contribution dominates
    the last states (decay ~e^-5 over that span), so reading the wrong k, v would show; a wrong h
    slot stays NaN. The first states are checked from h0 the same way."""
    B, T, H, K, V, BT = 1, 2 ** 21 + 1000, 8, 128, 128, 64
    assert B * T * H * K > 2 ** 31
    case = make_case(B, T, H, K, V, torch.bfloat16, ("g",), True, None, device)
    cfg = triton.Config({"BK": 64, "BV": 64}, num_warps=4, num_stages=2)
    h, ht = run_kernel(case, BT, states_in_fp32=True, config=cfg, pieces=pieces)
    NS = h.shape[1]
    assert NS == math.ceil(T / BT) and NS * H * K * V > 2 ** 32
    for s0 in (0, NS - 3):
        t0 = s0 * BT
        t1 = min(T, t0 + 3 * BT)
        piece = dict(k=case["k"][:, t0:t1], v=case["v"][:, t0:t1], nat={"g": case["nat"]["g"][:, t0:t1]},
                     h0=h[:, s0].clone(), cu_seqlens=None)
        h_ref, ht_ref = run_loop(piece, BT)
        if s0 == 0:
            assert torch.equal(h[:, 0], case["h0"])
        check_close(h[:, s0:s0 + h_ref.shape[1]], h_ref, f"states from split {s0}", TOL_BF16)
        if t1 == T:
            check_close(ht, ht_ref, "final state", TOL_BF16)
