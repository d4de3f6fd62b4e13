"""Numerical robustness of ``chunk_fwd_h`` / ``chunk_bwd_dh``: extreme gates and magnitudes,
non-finite inputs, state precision, and a 65,536-token sequence.

- Strong decays (natural-log gates near -20 per token, e^-20 ≈ 2e-9): the kernels only ever
  exponentiate ``Γ − G_i`` (forward) and ``G_i`` (backward), both ≤ 0 inside a chunk, so nothing
  overflows; the states stay finite and match the loop.
- Resets inside a chunk (mild gates with some tokens at -20): ``Γ − G_i`` of a recent token is a
  small difference of two large fp32 cumsums, so its factor carries a relative error up to
  ``2·ln2·2^-24·max|G|`` (~5e-5 at max|G| ≈ 500, log2) — an input rounding of the chunk-local
  form (fla's too) that the float64 loop does not make. The check allows the bound doubled.
- Large magnitudes (|k|, |v|, |q|, |do| ~ 1e3, |h0| ~ 1e6) in fp32: relative errors as at O(1);
  fp16 inputs of that size need ``states_in_fp32`` (fp16 states overflow) while ``ht`` stays fp32.
- NaN / Inf in one sequence of a packed batch (in k, v, a gate, h0; q, do, dht for the backward):
  no crash; every other sequence — and the poisoned one's states not downstream of the bad token,
  and its other heads — bit-identical to a clean run; the states downstream non-finite.
  ``gates.chunk_local_cumsum`` itself is checked for the same isolation.
- GPU only (bf16 is wrong under the interpreter; 65,536 tokens too slow there): fp32 vs bf16
  stored states against the loop, and T = 65,536 against ``reference.chunked_states`` in float64
  on the GPU, with sequence pieces on and off.

Tolerances as in test_forward.py: fp32 under the interpreter 1e-5 (exact-fp32 ``tl.dot``, ≤ ~130
fp32-rounded terms per state); fp32 on a GPU 2e-3 (tf32 ``tl.dot``: two 2^-11 roundings); fp16 2e-3
(three 2^-11 roundings); bf16 1e-2 (three 2^-8 roundings, RMS ≈ 4e-3).
"""
from __future__ import annotations

import math

import chunkstate  # first: it sets TRITON_INTERPRET on a CPU machine before Triton is imported

import pytest
import torch
import torch.nn.functional as F
import triton

from chunkstate import gates, pieces, reference, tuning
from chunkstate.backward import chunk_bwd_dh
from chunkstate.gates import prepare_chunk_offsets
from chunkstate.testing import check_close, nan_poisoned_empty, rel_err

DEVICE = chunkstate.DEVICE
ON_GPU = DEVICE == "cuda"
gpu_only = pytest.mark.gpu(reason="bf16 is silently wrong and 65,536 tokens far too slow under Triton's "
                           "interpreter on CPU")
TOL_FP32 = 2e-3 if ON_GPU else 1e-5  # tf32 tl.dot on a GPU; exact fp32 under the interpreter
TOL_FP16 = 2e-3
TOL_BF16 = 1e-2
GATE_NAMES = ("g", "g_gamma", "gk", "gv")


def forward(k, v, kg, h0=None, cu=None, BT=32, BS=None, **kw):
    with nan_poisoned_empty():
        return chunkstate.chunk_fwd_h(k, v, **kg, h0=h0, output_final_state=True, cu_seqlens=cu, chunk_size=BT,
                                      split_size=BS, **kw)


def backward(q, k, v, do, kg, h0=None, dht=None, cu=None, BT=32, BS=None, scale=0.5, **kw):
    with nan_poisoned_empty():
        return chunk_bwd_dh(q, k, v, do, h0, dht, scale, **kg, cu_seqlens=cu, chunk_size=BT, split_size=BS, **kw)


def chunk_starts(T, BT, cu):
    """First token of every chunk (every sequence's chunks restart at its start)."""
    bounds = [0, T] if cu is None else cu
    return [s for a, b in zip(bounds, bounds[1:]) for s in range(a, b, BT)], bounds


def max_exponents(kg, BT, cu, T):
    """The largest exponent each kernel forms: forward ``Γ − G_i`` and backward ``G_i`` over every
    chunk (chunk-local cumsums in log2; g_gamma's ramp γ·(i+1))."""
    fwd, bwd = -math.inf, -math.inf
    starts, bounds = chunk_starts(T, BT, cu)
    ends = {s: min(s + BT, next(b for b in bounds if b > s)) for s in starts}
    for name, G in kg.items():
        if name == "g_gamma":
            gamma = G.max().item()  # Γ − G_i = γ·(L − 1 − i), G_i = γ·(i + 1), i < L <= BT
            fwd, bwd = max(fwd, gamma * (BT - 1), 0.0), max(bwd, gamma, gamma * BT)
            continue
        for s, e in ends.items():
            Gc = G[:, s:e]  # [B, L, H(, D)]
            fwd = max(fwd, (Gc[:, -1:] - Gc).max().item())
            bwd = max(bwd, Gc.max().item())
    return fwd, bwd


# ---------------------------------------------------------------------------------------------
# Strong decays and resets
# ---------------------------------------------------------------------------------------------

# With g_gamma the forward also evaluates 2^{γ·(L−1−i)} on the masked lanes i >= L of a sequence's
# last, partial chunk, where the exponent is positive (+1800 here) and overflows to inf before
# tl.where discards it: harmless (never selected), but numpy under the interpreter warns.
@pytest.mark.filterwarnings("ignore:overflow encountered in exp2")
@pytest.mark.parametrize("names", [("g",), ("g_gamma",), ("gk",), ("gv",), GATE_NAMES], ids="+".join)
def test_strong_decays_stay_finite_and_match_the_loop(names):
    """Per-token natural-log gates in [-21, -19] on every chosen side (all four: -60 on the key
    side): a state is essentially its chunk's last token; the sum over a chunk reaches
    max|G| ≈ 64 · 60 · 1.44 ≈ 5500 (log2), far past fp32's exp2 range, yet no exponent is positive."""
    cu_host = [0, 1, 70, 70, 135]
    cu = torch.tensor(cu_host, dtype=torch.int32, device=DEVICE)
    T, H, K, V, HQ, BT = cu_host[-1], 2, 20, 12, 4, 64
    shapes = {"g": (1, T, H), "g_gamma": (H,), "gk": (1, T, H, K), "gv": (1, T, H, V)}
    nat = {n: -19 - 2 * torch.rand(*shapes[n], device=DEVICE) for n in names}
    kg = gates.kernel_gates(nat, BT, cu)
    fwd_exp, bwd_exp = max_exponents(kg, BT, cu_host, T)
    assert fwd_exp <= 0 and bwd_exp <= 0, f"positive exponent: forward {fwd_exp}, backward {bwd_exp}"
    k, v = torch.randn(1, T, H, K, device=DEVICE), torch.randn(1, T, H, V, device=DEVICE)
    q, do = torch.randn(1, T, HQ, K, device=DEVICE), torch.randn(1, T, HQ, V, device=DEVICE)
    h0, dht = torch.randn(4, H, K, V, device=DEVICE), torch.randn(4, H, K, V, device=DEVICE)

    h, ht = forward(k, v, kg, h0, cu, BT, BS=2 * BT)
    dh, dh0 = backward(q, k, v, do, kg, h0, dht, cu, BT, BS=2 * BT)
    for name, x in (("h", h), ("ht", ht), ("dh", dh), ("dh0", dh0)):
        assert torch.isfinite(x).all(), f"{name} is not finite under decays near -20"
    h_ref, ht_ref = reference.recurrent_states(k, v, **nat, h0=h0, cu_seqlens=cu, chunk_size=BT, split_size=2 * BT)
    dh_ref, dh0_ref = reference.state_grads(q, k, v, do, **nat, h0=h0, dht=dht, cu_seqlens=cu, scale=0.5,
                                            chunk_size=BT, split_size=2 * BT)
    # Every token but a chunk's last is weighted <= e^-19 ≈ 6e-9: the exponents' fp32 rounding
    # (the resets test below) cannot show, so the plain fp32 bound holds.
    # Split by split: a gradient is dominated by the next token's e^-20-weighted output, far
    # below the last split's (= dht), so a global norm would hide errors in the early splits.
    for s in range(h.shape[1]):
        check_close(h[0, s], h_ref[0, s], f"h split {s}", TOL_FP32)
        check_close(dh[0, s], dh_ref[0, s], f"dh split {s}", TOL_FP32)
    check_close(ht, ht_ref, "ht", TOL_FP32)
    check_close(dh0, dh0_ref, "dh0", TOL_FP32)
    # the empty sequence passes h0 / dht through untouched
    assert torch.equal(ht[2], h0[2]) and torch.equal(dh0[2], dht[2])


@pytest.mark.parametrize("name", ["g", "gk", "gv"])
def test_resets_inside_a_chunk_stay_within_the_cumsum_rounding(name):
    """Mild gates (~-0.02) with a quarter of the tokens at -20: after a reset the recent tokens'
    factors 2^{Γ−G_i} come from fp32 cumsums of size up to max|G| (hundreds): relative error
    <= 2 · ln2 · 2^-24 · max|G| per factor (two roundings), allowed twice over."""
    B, T, H, K, V, BT = 1, 128, 2, 16, 16, 64
    shape = {"g": (B, T, H), "gk": (B, T, H, K), "gv": (B, T, H, V)}[name]
    nat = F.logsigmoid(4 + torch.randn(*shape, device=DEVICE))
    reset = (torch.rand(B, T, H, device=DEVICE) < 0.25).reshape(B, T, H, *[1] * (len(shape) - 3))
    nat = torch.where(reset, torch.full_like(nat, -20.0), nat)
    kg = gates.kernel_gates({name: nat}, BT)
    G_max = kg[name].abs().max().item()
    assert G_max > 200, "the draw must hold resets"
    tol = TOL_FP32 + 2 * (2 * math.log(2) * 2.0 ** -24 * G_max)
    k, v = torch.randn(B, T, H, K, device=DEVICE), torch.randn(B, T, H, V, device=DEVICE)
    q, do = torch.randn(B, T, H, K, device=DEVICE), torch.randn(B, T, H, V, device=DEVICE)
    h, ht = forward(k, v, kg, BT=BT)
    h_ref, ht_ref = reference.recurrent_states(k, v, **{name: nat}, chunk_size=BT)
    check_close(h, h_ref, "h", tol)
    check_close(ht, ht_ref, "ht", tol)
    h0 = torch.zeros(B, H, K, V, device=DEVICE)
    dh, dh0 = backward(q, k, v, do, kg, h0=h0, BT=BT)
    dh_ref, dh0_ref = reference.state_grads(q, k, v, do, **{name: nat}, h0=h0, scale=0.5, chunk_size=BT)
    check_close(dh, dh_ref, "dh", tol)
    check_close(dh0, dh0_ref, "dh0", tol)


ZERO_DECAY_TOKENS = (0, 20, 21, 31, 47, 69)  # chunk starts and ends, two in a row, the sequence's first and last


@pytest.mark.filterwarnings("ignore:overflow encountered in exp2")  # g_gamma's masked lanes (see above)
@pytest.mark.parametrize("pieces", [1, 2])
def test_zero_decays_and_huge_negative_gates_are_exact(pieces):
    """Gates of −inf (a decay of exactly zero: the state forgets everything) and of −1e30 / −1e4
    natural log, through ``gates.chunk_local_cumsum`` (which raises gates below ``MIN_GATE`` to it)
    and a g_gamma of −inf for one head: forward and backward match the float64 loop, which applies
    the −inf as it is. Before, ``2^{Γ−G}`` was −inf − (−inf) = NaN from the first −inf on. Up to
    two zero decays in one chunk make its cumsum reach ~320 (log2): the tolerance adds the rounding
    of such cumsums, as in the test above."""
    B, T, H, K, V, BT = 2, 70, 2, 16, 24, 16
    k, v = torch.randn(B, T, H, K, device=DEVICE), torch.randn(B, T, H, V, device=DEVICE)
    q, do = torch.randn(B, T, H, K, device=DEVICE), torch.randn(B, T, H, V, device=DEVICE)
    nat = dict(g=F.logsigmoid(2 + torch.randn(B, T, H, device=DEVICE)),
               gk=F.logsigmoid(2 + torch.randn(B, T, H, K, device=DEVICE)),
               gv=F.logsigmoid(2 + torch.randn(B, T, H, V, device=DEVICE)),
               g_gamma=torch.tensor([-0.05, -math.inf], device=DEVICE))
    for t in ZERO_DECAY_TOKENS:
        nat["g"][0, t, 0] = -math.inf
    nat["gk"][1, 5, 1, 3] = -1e30
    nat["gv"][1, 40, 0, :] = -1e4
    kg = gates.kernel_gates(nat, BT)
    assert all(torch.isfinite(x).all() for x in kg.values() if x.dim() > 1), "the cumsums must be finite"
    tol = TOL_FP32 + 2 * (2 * math.log(2) * 2.0 ** -24 * max(x.abs().max().item() for x in kg.values() if x.dim() > 1))
    h0, dht = torch.randn(B, H, K, V, device=DEVICE), torch.randn(B, H, K, V, device=DEVICE)
    h, ht = forward(k, v, kg, h0=h0, BT=BT, pieces=pieces)
    h_ref, ht_ref = reference.recurrent_states(k, v, **nat, h0=h0, chunk_size=BT)
    check_close(h, h_ref, "h with zero decays", tol)
    check_close(ht, ht_ref, "ht with zero decays", tol)
    dh, dh0 = backward(q, k, v, do, kg, h0=h0, dht=dht, BT=BT, pieces=pieces)
    dh_ref, dh0_ref = reference.state_grads(q, k, v, do, **nat, h0=h0, dht=dht, scale=0.5, chunk_size=BT)
    check_close(dh, dh_ref, "dh with zero decays", tol)
    check_close(dh0, dh0_ref, "dh0 with zero decays", tol)


def test_issue_22_reproducer_gives_finite_states():
    """The report's case: g = −0.1 everywhere but −inf at token 20 (chunk 1 of two): every state
    finite and equal to the loop's."""
    k, v = torch.randn(1, 32, 1, 16, device=DEVICE), torch.randn(1, 32, 1, 16, device=DEVICE)
    g = torch.full((1, 32, 1), -0.1, device=DEVICE)
    g[0, 20, 0] = float("-inf")
    h, ht = chunkstate.chunk_fwd_h(k, v, g=gates.chunk_local_cumsum(g, 16), output_final_state=True, chunk_size=16)
    h_ref, ht_ref = reference.recurrent_states(k, v, g=g, chunk_size=16)
    check_close(h, h_ref, "h", TOL_FP32)
    check_close(ht, ht_ref, "ht", TOL_FP32)


def test_chunk_local_cumsum_floor():
    """Gates below ``MIN_GATE`` count as ``MIN_GATE`` (−inf included), NaN stays NaN, ``floor=None``
    sums the values as they are."""
    g = torch.tensor([[-1.0, -math.inf, -0.5, -1e30, math.nan, -2.0]])[..., None]  # [1, 6, 1]
    got = gates.chunk_local_cumsum(g, 4, scale=1.0, dtype=torch.float64)[0, :, 0].tolist()
    m = gates.MIN_GATE
    assert got[:4] == [-1.0, -1.0 + m, -1.5 + m, -1.5 + 2 * m]
    assert math.isnan(got[4]) and math.isnan(got[5])  # the NaN's chunk (tokens 4, 5) from it on
    raw = gates.chunk_local_cumsum(g, 4, scale=1.0, dtype=torch.float64, floor=None)[0, :, 0].tolist()
    assert raw[1] == -math.inf and raw[3] == -math.inf


# ---------------------------------------------------------------------------------------------
# Large magnitudes
# ---------------------------------------------------------------------------------------------

def test_large_magnitudes_fp32():
    """|k|, |v|, |q|, |do| ~ 1e3, |h0|, |dht| ~ 1e6 in fp32: states ~1e7, relative errors unchanged."""
    B, T, H, K, V, BT = 2, 100, 2, 20, 24, 32
    nat = {"g": F.logsigmoid(4 + torch.randn(B, T, H, device=DEVICE)),
           "gv": F.logsigmoid(4 + torch.randn(B, T, H, V, device=DEVICE))}
    kg = gates.kernel_gates(nat, BT)
    k, v = 1e3 * torch.randn(B, T, H, K, device=DEVICE), 1e3 * torch.randn(B, T, H, V, device=DEVICE)
    q, do = 1e3 * torch.randn(B, T, H, K, device=DEVICE), 1e3 * torch.randn(B, T, H, V, device=DEVICE)
    h0, dht = 1e6 * torch.randn(B, H, K, V, device=DEVICE), 1e6 * torch.randn(B, H, K, V, device=DEVICE)
    h, ht = forward(k, v, kg, h0, BT=BT)
    dh, dh0 = backward(q, k, v, do, kg, h0, dht, BT=BT)
    assert ht.abs().max() > 1e6  # the magnitudes the test is about
    h_ref, ht_ref = reference.recurrent_states(k, v, **nat, h0=h0, chunk_size=BT)
    dh_ref, dh0_ref = reference.state_grads(q, k, v, do, **nat, h0=h0, dht=dht, scale=0.5, chunk_size=BT)
    for name, x, ref in (("h", h, h_ref), ("ht", ht, ht_ref), ("dh", dh, dh_ref), ("dh0", dh0, dh0_ref)):
        assert torch.isfinite(x).all(), name
        check_close(x, ref, name, TOL_FP32)


@pytest.mark.filterwarnings("ignore:overflow encountered in cast")  # the fp16 states that overflow, on purpose
def test_large_magnitudes_fp16_need_fp32_states():
    """fp16 inputs ~1e3 (representable) build states ~1e7, past fp16's 65504: with
    ``states_in_fp32`` they match the loop; with fp16 states h overflows but ht (always fp32) and
    the backward's dh0 (always fp32) stay finite and right."""
    B, T, H, K, V, BT = 1, 100, 2, 20, 24, 32
    nat = {"g": F.logsigmoid(4 + torch.randn(B, T, H, device=DEVICE))}
    kg = gates.kernel_gates(nat, BT)
    k = (1e3 * torch.randn(B, T, H, K, device=DEVICE)).half()
    v = (1e3 * torch.randn(B, T, H, V, device=DEVICE)).half()
    h_ref, ht_ref = reference.recurrent_states(k, v, **nat, chunk_size=BT)
    assert h_ref.abs().max() > 65504
    # one explicit config for both precisions: the autotuner keys on dtypes and might pick two
    # configs whose dots round differently, and the bit-for-bit comparisons below need one kernel
    cfg = triton.Config({"BK": 32, "BV": 32}, num_warps=4, num_stages=2)
    h32, ht32 = forward(k, v, kg, BT=BT, states_in_fp32=True, config=cfg)
    check_close(h32, h_ref, "fp32 states", TOL_FP16)
    check_close(ht32, ht_ref, "ht (fp32 states)", TOL_FP16)
    h16, ht16 = forward(k, v, kg, BT=BT, config=cfg)
    assert h16.dtype == torch.float16 and torch.isinf(h16).any(), "fp16 states of this size must overflow"
    assert torch.equal(h16, h32.half()), "fp16 states must be the fp32 ones rounded"
    assert torch.equal(ht16, ht32)

    q, do = (300 * torch.randn(B, T, H, K, device=DEVICE)).half(), (300 * torch.randn(B, T, H, V, device=DEVICE)).half()
    h0 = torch.zeros(B, H, K, V, device=DEVICE)
    dh_ref, dh0_ref = reference.state_grads(q, k, v, do, **nat, h0=h0, scale=1.0, chunk_size=BT)
    assert dh0_ref.abs().max() > 65504
    dh32, dh0_32 = backward(q, k, v, do, kg, h0=h0, BT=BT, scale=1.0, states_in_fp32=True, config=cfg)
    check_close(dh32, dh_ref, "dh (fp32)", TOL_FP16)
    check_close(dh0_32, dh0_ref, "dh0", TOL_FP16)
    _, dh0_16 = backward(q, k, v, do, kg, h0=h0, BT=BT, scale=1.0, config=cfg)
    assert torch.equal(dh0_16, dh0_32)


# ---------------------------------------------------------------------------------------------
# NaN / Inf in one sequence of a packed batch
# ---------------------------------------------------------------------------------------------

CU = [0, 20, 20, 21, 69, 90]  # sequence 3 (tokens 21..68, three chunks) gets the bad value
BAD_SEQ, BAD_POS, BAD_HEAD, NH = 3, 21, 1, 2  # token 21 + 21 = 42, in the sequence's 2nd chunk (BT 16)
BT_NAN, BS_NAN = 16, 16


def _nan_case(G=1):
    T, K, V = CU[-1], 20, 12
    nat = {"g": F.logsigmoid(4 + torch.randn(1, T, NH, device=DEVICE)),
           "gk": F.logsigmoid(4 + torch.randn(1, T, NH, K, device=DEVICE))}
    cu = torch.tensor(CU, dtype=torch.int32, device=DEVICE)
    return dict(k=torch.randn(1, T, NH, K, device=DEVICE), v=torch.randn(1, T, NH, V, device=DEVICE),
                q=torch.randn(1, T, NH * G, K, device=DEVICE), do=torch.randn(1, T, NH * G, V, device=DEVICE),
                kg=gates.kernel_gates(nat, BT_NAN, cu), h0=torch.randn(len(CU) - 1, NH, K, V, device=DEVICE),
                dht=torch.randn(len(CU) - 1, NH, K, V, device=DEVICE), cu=cu)


def _poison(case, where, value):
    """A copy of ``case`` with ``value`` at one element of sequence BAD_SEQ (head BAD_HEAD, query
    head 2·BAD_HEAD+1 for q / do with G = 2)."""
    bad = dict(case, kg=dict(case["kg"]))
    t = CU[BAD_SEQ] + BAD_POS
    if where in ("g", "gk"):
        x = bad["kg"][where].clone()
        x[0, t, BAD_HEAD] = value
        bad["kg"][where] = x
    elif where in ("h0", "dht"):
        bad[where] = case[where].clone()
        bad[where][BAD_SEQ, BAD_HEAD, 3, 5] = value
    else:
        bad[where] = case[where].clone()
        head = 2 * BAD_HEAD + 1 if where in ("q", "do") else BAD_HEAD
        bad[where][0, t, head, 3] = value
    return bad


def _slots(n):
    o = prepare_chunk_offsets(torch.tensor(CU), BS_NAN).tolist()
    return range(o[n], o[n + 1])


@pytest.mark.filterwarnings("ignore:invalid value encountered in matmul")  # the interpreter's numpy dot on inf
@pytest.mark.parametrize("where,value,pieces", [("k", math.nan, 1), ("v", math.inf, 2), ("g", math.nan, 1),
                                                ("gk", -math.inf, 2), ("h0", math.nan, 2)])
def test_forward_non_finite_stays_in_its_sequence(where, value, pieces):
    """pieces = 2 cuts the bad sequence in two: the piece scan must carry the bad state on, and
    only for that sequence."""
    case = _nan_case()
    run = lambda c: forward(c["k"], c["v"], c["kg"], c["h0"], c["cu"], BT_NAN, BS_NAN, pieces=pieces)  # noqa: E731
    h, ht = run(case)
    h_bad, ht_bad = run(_poison(case, where, value))
    assert torch.isfinite(h).all() and torch.isfinite(ht).all()
    for n in range(len(CU) - 1):
        if n == BAD_SEQ:
            continue
        assert all(torch.equal(h_bad[0, s], h[0, s]) for s in _slots(n)), f"sequence {n}'s states changed"
        assert torch.equal(ht_bad[n], ht[n]), f"sequence {n}'s final state changed"
    first_bad = 0 if where == "h0" else BAD_POS // BS_NAN + 1  # the first split entered after the bad token
    other = 1 - BAD_HEAD
    for i, s in enumerate(_slots(BAD_SEQ)):
        assert torch.equal(h_bad[0, s, other], h[0, s, other]), f"head {other} of the bad sequence changed"
        if i < first_bad:
            assert torch.equal(h_bad[0, s], h[0, s]), f"split {i} entered before the bad token changed"
        else:
            assert not torch.isfinite(h_bad[0, s, BAD_HEAD]).all(), f"split {i}: the bad value did not propagate"
    assert not torch.isfinite(ht_bad[BAD_SEQ, BAD_HEAD]).all()
    assert torch.equal(ht_bad[BAD_SEQ, other], ht[BAD_SEQ, other])


@pytest.mark.filterwarnings("ignore:invalid value encountered in matmul")
@pytest.mark.parametrize("where,value,pieces", [("q", math.nan, 1), ("do", math.inf, 2), ("g", math.nan, 1),
                                                ("gk", math.nan, 2), ("dht", math.nan, 2)])
def test_backward_non_finite_stays_in_its_sequence(where, value, pieces):
    """GQA G = 2: the bad query head 2·BAD_HEAD+1 reaches only KV head BAD_HEAD. dh[s] (leaving
    split s) collects the outputs after split s: splits ending at or after the bad token keep
    their values, earlier ones (and dh0) turn non-finite; pieces = 2 carries it across the reverse
    piece scan, for that sequence only."""
    case = _nan_case(G=2)
    run = lambda c: backward(c["q"], c["k"], c["v"], c["do"], c["kg"], c["h0"], c["dht"], c["cu"],  # noqa: E731
                             BT_NAN, BS_NAN, pieces=pieces)
    dh, dh0 = run(case)
    dh_bad, dh0_bad = run(_poison(case, where, value))
    assert torch.isfinite(dh).all() and torch.isfinite(dh0).all()
    for n in range(len(CU) - 1):
        if n == BAD_SEQ:
            continue
        assert all(torch.equal(dh_bad[0, s], dh[0, s]) for s in _slots(n)), f"sequence {n}'s gradients changed"
        assert torch.equal(dh0_bad[n], dh0[n]), f"sequence {n}'s dh0 changed"
    n_splits = len(_slots(BAD_SEQ))
    first_clean = n_splits if where == "dht" else BAD_POS // BS_NAN
    other = 1 - BAD_HEAD
    for i, s in enumerate(_slots(BAD_SEQ)):
        assert torch.equal(dh_bad[0, s, other], dh[0, s, other]), f"head {other} of the bad sequence changed"
        if i >= first_clean:
            assert torch.equal(dh_bad[0, s], dh[0, s]), f"split {i}, closed at or after the bad token, changed"
        else:
            assert not torch.isfinite(dh_bad[0, s, BAD_HEAD]).all(), f"split {i}: the bad value did not propagate"
    assert not torch.isfinite(dh0_bad[BAD_SEQ, BAD_HEAD]).all()
    assert torch.equal(dh0_bad[BAD_SEQ, other], dh0[BAD_SEQ, other])


def test_chunk_local_cumsum_keeps_a_nan_in_its_chunk():
    """A NaN natural-log gate at one token makes its chunk's cumsum NaN from that token on, and
    nothing else: other chunks and other sequences are unchanged."""
    T = CU[-1]
    g = F.logsigmoid(4 + torch.randn(1, T, NH, device=DEVICE))
    cu = torch.tensor(CU, dtype=torch.int32, device=DEVICE)
    clean = gates.chunk_local_cumsum(g, BT_NAN, cu)
    g_bad = g.clone()
    t = CU[BAD_SEQ] + BAD_POS
    g_bad[0, t, BAD_HEAD] = math.nan
    bad = gates.chunk_local_cumsum(g_bad, BT_NAN, cu)
    chunk_end = min(CU[BAD_SEQ] + (BAD_POS // BT_NAN + 1) * BT_NAN, CU[BAD_SEQ + 1])
    touched = torch.zeros_like(g, dtype=torch.bool)
    touched[0, t:chunk_end, BAD_HEAD] = True
    assert torch.isnan(bad[touched]).all()
    assert torch.equal(bad[~touched], clean[~touched]), "the NaN leaked out of its chunk"


# ---------------------------------------------------------------------------------------------
# GPU only
# ---------------------------------------------------------------------------------------------

@gpu_only
def test_gpu_fp32_states_beat_bf16_states(record_property):
    """bf16 inputs; states stored in fp32 vs in bf16, both against the loop: the fp32 ones carry one
    rounding fewer, so they must be closer, and the bf16 ones stay within 1e-2. The errors are
    attached to the test report (``record_property``) and printed."""
    B, T, H, HQ, K, V, BT = 2, 2048 + 17, 4, 8, 128, 128, 64
    nat = {"g": F.logsigmoid(4 + torch.randn(B, T, H, device=DEVICE)),
           "gk": F.logsigmoid(4 + torch.randn(B, T, H, K, device=DEVICE))}
    kg = gates.kernel_gates(nat, BT)
    k = torch.randn(B, T, H, K, device=DEVICE).bfloat16()
    v = torch.randn(B, T, H, V, device=DEVICE).bfloat16()
    q = torch.randn(B, T, HQ, K, device=DEVICE).bfloat16()
    do = torch.randn(B, T, HQ, V, device=DEVICE).bfloat16()
    h0 = torch.randn(B, H, K, V, device=DEVICE)
    h_ref, _ = reference.chunked_states(k, v, **nat, h0=h0, chunk_size=BT)
    dh_ref, _ = reference.state_grads(q[:, :300], k[:, :300], v[:, :300], do[:, :300],
                                      **{n: x[:, :300] for n, x in nat.items()}, h0=h0, scale=K ** -0.5,
                                      chunk_size=BT)
    errs = {}
    for s32 in (True, False):
        h, _ = forward(k, v, kg, h0, BT=BT, states_in_fp32=s32)
        kg300 = gates.kernel_gates({n: x[:, :300] for n, x in nat.items()}, BT)
        dh, _ = backward(q[:, :300], k[:, :300], v[:, :300], do[:, :300], kg300, h0=h0, BT=BT, scale=K ** -0.5,
                         states_in_fp32=s32)
        assert h.dtype == dh.dtype == (torch.float32 if s32 else torch.bfloat16)
        errs[s32] = (rel_err(h, h_ref), rel_err(dh, dh_ref))
    report = (f"h: fp32 states {errs[True][0]:.2e}, bf16 states {errs[False][0]:.2e}; "
              f"dh: fp32 {errs[True][1]:.2e}, bf16 {errs[False][1]:.2e}")
    print(report)
    record_property("state_precision_errors", report)
    for i, name in enumerate(("h", "dh")):
        assert errs[True][i] < errs[False][i], f"{name}: fp32 states not better ({report})"
        assert errs[False][i] <= TOL_BF16, f"{name}: bf16 states beyond 1e-2 ({report})"


@gpu_only
@pytest.mark.parametrize("names", [(), ("g", "gk")], ids=["no-gate", "g+gk"])
def test_gpu_long_sequence_65536(names):
    """B1 H2 K=V=64, T = 65,536 in fp32 (tf32 dots): against the chunked float64 reference on the
    GPU (one matmul per chunk) — without a gate the state sums all 65,536 outer products, the
    hardest case for accumulated rounding — with sequence pieces off (1), automatic and 7 (a
    ragged last piece); the piece counts also agree with one another."""
    B, T, H, K, V, BT = 1, 65_536, 2, 64, 64, 64
    nat = {}
    if "g" in names:
        nat["g"] = F.logsigmoid(6 + torch.randn(B, T, H, device=DEVICE))  # ~-0.0025: memory ~400 tokens
    if "gk" in names:
        nat["gk"] = F.logsigmoid(6 + torch.randn(B, T, H, K, device=DEVICE))
    kg = gates.kernel_gates(nat, BT)
    k, v = torch.randn(B, T, H, K, device=DEVICE), torch.randn(B, T, H, V, device=DEVICE)
    h0 = torch.randn(B, H, K, V, device=DEVICE)
    h_ref, ht_ref = reference.chunked_states(k, v, **nat, h0=h0, chunk_size=BT)
    gate = pieces.gate_kind(**kg)  # the gate kind the wrapper's automatic choice weighs
    assert pieces.auto_pieces(B, H, K, V, T, BT, tuning.sm_count(), direction="fwd", gate=gate) > 1, \
        "the automatic choice must use pieces here"
    runs = {}
    for P in (1, None, 7):
        h, ht = forward(k, v, kg, h0, BT=BT, pieces=P)
        check_close(h, h_ref, f"h, pieces={P}", TOL_FP32)
        check_close(ht, ht_ref, f"ht, pieces={P}", TOL_FP32)
        runs[P] = (h, ht)
    for P in (None, 7):
        check_close(runs[P][0], runs[1][0], f"h pieces={P} vs unsplit", TOL_FP32)
        check_close(runs[P][1], runs[1][1], f"ht pieces={P} vs unsplit", TOL_FP32)
