"""chunk_bwd_dh: against autograd through the float64 token loop, round trips with chunk_fwd_h,
its own invariants (split sampling, GQA as a sum of heads), bad inputs, and — on a GPU — large
shapes, bf16, every autotune config and fla-core 0.6.0.

Tolerances (relative Frobenius error ‖out − ref‖ / ‖ref‖), from the arithmetic, not from runs:

- fp32 under the interpreter: tl.dot is exact fp32 there, so the only errors are fp32 roundings
  (u = 2^-24 ≈ 6e-8): the log2 gate cumsums, exp2, q·scale·2^G, and the fp32 accumulation. An
  element of dh sums at most n ≈ 600 tokens' terms (the longest CPU case); independent rounding
  errors grow like √n·u ≈ 25u ≈ 1.5e-6, and 1e-5 leaves room for cancellation in ‖ref‖.
- 16-bit inputs, and fp32 on a GPU (tl.dot rounds its inputs to tf32): each term of dh carries at
  most three roundings of relative size ≤ u (q·scale·2^G and do·2^Gv cast to the dot's dtype,
  dh stored in k's dtype), so one term is off by ≤ 3u; sums of random terms average this down
  (≈ 0.7u). We allow 4u: fp16 and tf32 (u = 2^-11) 2e-3, bf16 (u = 2^-8) 1.6e-2.
"""
from __future__ import annotations

import functools
import itertools
import math
import random

import numpy as np
import pytest
import torch
import torch.nn.functional as F

import chunkstate  # before triton: picks the interpreter on a machine without a GPU
import triton

from chunkstate import tuning, chunk_bwd_dh, chunk_fwd_h, gates, reference
from chunkstate.testing import check_close, nan_poisoned_empty, rel_err

DEVICE = chunkstate.DEVICE
ON_GPU = DEVICE == "cuda"

U = {torch.float16: 2.0 ** -11, torch.bfloat16: 2.0 ** -8, torch.float32: 2.0 ** -11}  # fp32: tf32 in tl.dot
TOL = {dtype: 4 * u for dtype, u in U.items()}
if not ON_GPU:
    TOL[torch.float32] = 1e-5  # the interpreter's tl.dot is exact fp32

GATES = ("g", "g_gamma", "gk", "gv")


# ---------------------------------------------------------------------------------------------
# inputs and the oracle
# ---------------------------------------------------------------------------------------------
def natural_gates(names, B, T, H, K, V, device=DEVICE):
    """Natural-log per-token gates, mostly mild (decay ~0.98 per token, some ~0.7), so that
    gradients reach back across many chunks and every gate's effect shows."""
    out = {}
    if "g" in names:
        out["g"] = F.logsigmoid(torch.randn(B, T, H, device=device) + 4)
    if "g_gamma" in names:
        out["g_gamma"] = -(0.005 + 0.05 * torch.rand(H, device=device))
    if "gk" in names:
        out["gk"] = F.logsigmoid(torch.randn(B, T, H, K, device=device) + 4)
    if "gv" in names:
        out["gv"] = F.logsigmoid(torch.randn(B, T, H, V, device=device) + 4)
    return out


def make_case(B, T, H, G, K, V, gate_names, chunk_size, dtype, cu=None, h0=True, dht=True, device=DEVICE):
    """Fresh random inputs; returns (kernel inputs dict, natural gates, h0, dht, cu_seqlens)."""
    cu = None if cu is None else torch.tensor(cu, dtype=torch.int32, device=device)
    N = B if cu is None else len(cu) - 1
    q = torch.randn(B, T, H * G, K, device=device).to(dtype)
    k = torch.randn(B, T, H, K, device=device).to(dtype)
    v = torch.randn(B, T, H, V, device=device).to(dtype)
    do = torch.randn(B, T, H * G, V, device=device).to(dtype)
    nat = natural_gates(gate_names, B, T, H, K, V, device)
    h0_ = torch.randn(N, H, K, V, device=device) if h0 else None
    dht_ = torch.randn(N, H, K, V, device=device) if dht else None
    return dict(q=q, k=k, v=v, do=do, scale=K ** -0.5), nat, h0_, dht_, cu


def run_backward(inp, nat, h0, dht, cu, chunk_size, split_size=None, state_v_first=False, states_in_fp32=False,
                 config=None, pieces=None):
    """chunk_bwd_dh with NaN-poisoned outputs; dh, dh0 returned in the [K, V] layout."""
    flip = (lambda x: None if x is None else x.transpose(-1, -2)) if state_v_first else (lambda x: x)
    with nan_poisoned_empty():
        dh, dh0 = chunk_bwd_dh(inp["q"], inp["k"], inp["v"], inp["do"], flip(h0), flip(dht), inp["scale"],
                               **gates.kernel_gates(nat, chunk_size, cu), state_v_first=state_v_first, cu_seqlens=cu,
                               chunk_size=chunk_size, split_size=split_size, states_in_fp32=states_in_fp32,
                               config=config, pieces=pieces)
    return flip(dh), flip(dh0)


def loop_grads(inp, nat, h0, dht, cu, chunk_size, split_size=None):
    """The oracle: autograd through the float64 token loop."""
    return reference.state_grads(inp["q"], inp["k"], inp["v"], inp["do"], h0=h0, dht=dht, cu_seqlens=cu,
                                 scale=inp["scale"], chunk_size=chunk_size, split_size=split_size, **nat)


# ---------------------------------------------------------------------------------------------
# CPU grid: every pair of factor levels appears in some case (pairwise coverage)
# ---------------------------------------------------------------------------------------------
def pairwise(factors: dict[str, list]) -> list[dict]:
    """A small deterministic set of cases in which every pair of levels of any two factors meets.

    Greedy: seed each new case with the first pair still uncovered, then give every other factor
    the level that covers the most uncovered pairs with the levels chosen so far (ties: the level
    used least so far, then a fixed pseudo-random order, so that the padding spreads over all levels).
    """
    rng = random.Random(0)  # fixes which cases the grid holds, not their inputs
    names = list(factors)
    sizes = [len(factors[n]) for n in names]
    uncovered = {(a, i, b, j) for a, b in itertools.combinations(range(len(names)), 2)
                 for i in range(sizes[a]) for j in range(sizes[b])}
    used = [[0] * n for n in sizes]

    def key(f, lf, g, lg):
        return (f, lf, g, lg) if f < g else (g, lg, f, lf)

    def gain(f, lf, case):
        return sum(key(f, lf, g, lg) in uncovered for g, lg in case.items()), -used[f][lf], rng.random()

    cases = []
    while uncovered:
        a, i, b, j = min(uncovered)
        case = {a: i, b: j}
        for f in range(len(names)):
            if f not in case:
                case[f] = max(range(sizes[f]), key=lambda lf: gain(f, lf, case))
        uncovered -= {key(f, lf, g, lg) for (f, lf), (g, lg) in itertools.combinations(case.items(), 2)}
        for f, lf in case.items():
            used[f][lf] += 1
        cases.append({names[f]: factors[names[f]][lf] for f, lf in sorted(case.items())})
    return cases


def shape(name, BT, BS):
    """(B, T, cu_seqlens, K, V) of a grid case. K and V are not powers of two; lengths are set by
    the split size BS so that every sequence but the tiny ones spans two splits, the last one over
    a chunk long and ending in a ragged chunk (T odd); the packed batch has empty and one-token
    sequences."""
    if name == "T1":
        return 2, 1, None, 20, 36
    if name == "ragged":  # a full split, then a chunk and a half and one token
        return 2, BS + BT + BT // 2 + 1, None, 28, 17
    lens = [0, 1, BS + 3, 0, BS + BT + 1]  # packed: empty, one token, just over a split, empty, ...
    cu = [0, *itertools.accumulate(lens)]
    return 1, cu[-1], cu, 24, 40


# None: the autotuned path (one 64 x 64 tile under the interpreter); the others split K and V
# into several ragged tiles.
CONFIGS = {"auto": None, "16x16": triton.Config({"BK": 16, "BV": 16}, num_warps=4, num_stages=1),
           "32x16": triton.Config({"BK": 32, "BV": 16}, num_warps=4, num_stages=1)}

GRID = pairwise({
    "gates": [(), ("g",), ("g_gamma",), ("gk",), ("gv",), ("g", "g_gamma"), ("g", "gk"), ("gk", "gv"),
              ("g_gamma", "gv"), GATES],
    "shape": ["T1", "ragged", "varlen"],
    "chunk_size": [16, 32, 64],
    "splits": [1, 2, 4],  # split_size = splits × chunk_size (1: None, fla's default)
    "G": [1, 2, 3],
    "config": list(CONFIGS),
    "dtype": [torch.float32, torch.float16],
    "h0": [True, False],
    "dht": [True, False],
    "state_v_first": [False, True],
    "states_in_fp32": [False, True],
})


def _case_id(c):
    flags = [name for name, on in (("h0", c["h0"]), ("dht", c["dht"]), ("vk", c["state_v_first"]),
                                   ("fp32dh", c["states_in_fp32"])) if on]
    return "-".join(["+".join(c["gates"]) or "nogate", c["shape"], f"BT{c['chunk_size']}", f"BS{c['splits']}x",
                     f"G{c['G']}", c["config"], str(c["dtype"]).removeprefix("torch."), *flags])


@pytest.fixture(autouse=True, scope="module")
def _one_cpu_thread():
    """The float64 loop's many tiny ops run several times faster on one thread (and test
    processes often share a few cores): use one while this module runs on CPU."""
    n = torch.get_num_threads()
    if not ON_GPU:
        torch.set_num_threads(1)
    yield
    torch.set_num_threads(n)


@pytest.mark.parametrize("case", GRID, ids=[_case_id(c) for c in GRID])
def test_matches_autograd_of_the_loop(case):
    BT, dtype = case["chunk_size"], case["dtype"]
    BS = case["splits"] * BT
    B, T, cu, K, V = shape(case["shape"], BT, BS)
    inp, nat, h0, dht, cu = make_case(B, T, 2, case["G"], K, V, case["gates"], BT, dtype, cu, case["h0"], case["dht"])
    split_size = None if case["splits"] == 1 else BS
    dh, dh0 = run_backward(inp, nat, h0, dht, cu, BT, split_size, case["state_v_first"], case["states_in_fp32"],
                           CONFIGS[case["config"]])
    ref_dh, ref_dh0 = loop_grads(inp, nat, h0, dht, cu, BT, split_size)
    assert dh.dtype == (torch.float32 if case["states_in_fp32"] else dtype)
    check_close(dh, ref_dh, "dh", TOL[dtype])
    if case["h0"]:
        assert dh0.dtype == torch.float32
        check_close(dh0, ref_dh0, "dh0", TOL[dtype])
    else:
        assert dh0 is None


@pytest.mark.parametrize("T", [63, 100])
def test_odd_lengths_all_gates(T):
    """T = 63 and 100 (B = 2, G = 2, all gates, splits of two chunks), the autotuned path."""
    inp, nat, h0, dht, cu = make_case(2, T, 2, 2, 33, 17, GATES, 16, torch.float32)
    dh, dh0 = run_backward(inp, nat, h0, dht, cu, 16, 32)
    ref_dh, ref_dh0 = loop_grads(inp, nat, h0, dht, cu, 16, 32)
    check_close(dh, ref_dh, "dh", TOL[torch.float32])
    check_close(dh0, ref_dh0, "dh0", TOL[torch.float32])


def test_grid_is_pairwise_and_small():
    """The grid above covers every pair of levels (so each gate combination meets every shape,
    chunk size, split, G, dtype, layout...) in far fewer cases than the full product."""
    factors = {"a": [0, 1, 2], "b": [0, 1], "c": [0, 1, 2, 3]}
    cases = pairwise(factors)
    for (fa, la), (fb, lb) in itertools.combinations(factors.items(), 2):
        for x, y in itertools.product(la, lb):
            assert any(c[fa] == x and c[fb] == y for c in cases), (fa, x, fb, y)
    assert len(cases) == 12  # 4 x 3 is the least possible
    assert len(GRID) <= 40 < 10 * 3 ** 5 * 2 ** 5  # the full product


# ---------------------------------------------------------------------------------------------
# Round trips with the forward kernel
# ---------------------------------------------------------------------------------------------
def token_layout(T, block, cu):
    """Per token of the time axis: (sequence, slot of its block, position in its block), [T] each,
    blocks of ``block`` tokens restarting at each sequence (slots in the kernels' order)."""
    bounds = [0, T] if cu is None else cu.tolist()
    seq, slot, pos, first_slot = [], [], [], 0
    for n, (bos, eos) in enumerate(zip(bounds, bounds[1:])):
        for t in range(bos, eos):
            seq.append(n)
            slot.append(first_slot + (t - bos) // block)
            pos.append((t - bos) % block)
        first_slot += -(-(eos - bos) // block)
    return torch.tensor(seq), torch.tensor(slot), torch.tensor(pos)


def cpu(x):
    """Tensors (in a dict, or None) on the CPU: the tests' own arithmetic runs there."""
    if isinstance(x, dict):
        return {name: cpu(t) for name, t in x.items()}
    return x.cpu() if isinstance(x, torch.Tensor) else x


def per_sequence(x, seq, cu):
    """Sum x [B, T, H] over each sequence's tokens -> [N, H] (dense: N = B; packed: B = 1)."""
    if cu is None:
        return x.sum(1)
    return torch.zeros(len(cu) - 1, x.shape[-1], dtype=x.dtype).index_add_(0, seq, x[0])


@pytest.mark.parametrize("gate_names,G,cu,BT,BS", [
    (GATES, 2, None, 16, 48),
    (("g", "gk", "gv"), 1, [0, 0, 1, 40, 40, 100], 16, 32),
    (("g_gamma", "gv"), 3, [0, 70, 70, 100], 32, 32),
])
def test_round_trip_loss_on_forward_split_states(gate_names, G, cu, BT, BS):
    """L = Σ_s ⟨h[s], W[s]⟩ + ⟨ht, dht⟩ over the forward's states h[s] entering splits s ≥ 1.

    h[s] is the state after the last token t_s of split s − 1, so with q, do zero except at the
    tokens t_s, the backward's loss Σ_t ⟨o_t, do_t⟩ + ⟨ht, dht⟩ is exactly L with
    W[s] = scale · Σ_j q_{t_s,j} do_{t_s,j}ᵀ (j over the KV head's query heads). Then the backward's
    dh0 must be (1) dL/dh0 by autograd through reference.recurrent_states (the loop), and (2) with
    k = v = 0, where L is linear in h0, L evaluated on chunk_fwd_h's states equals ⟨dh0, h0⟩.
    """
    T, H, K, V = 100, 2, 20, 12
    inp, nat, h0, dht, cu_t = make_case(1, T, H, G, K, V, gate_names, BT, torch.float32, cu)
    N = h0.shape[0]
    seq, split, pos = token_layout(T, BS, cu_t)
    seq_end = torch.ones(T, dtype=torch.bool)
    seq_end[:-1] = seq[1:] != seq[:-1]
    closing = (pos == BS - 1) & ~seq_end  # t_s: closes a split that another split follows
    assert closing.sum() >= 2
    inp["q"][:, ~closing.to(DEVICE)] = 0
    inp["do"][:, ~closing.to(DEVICE)] = 0
    W = torch.zeros(1, int(split.max()) + 1, H, K, V, dtype=torch.float64)
    qg, dog = cpu(inp["q"]).double().view(T, H, G, K), cpu(inp["do"]).double().view(T, H, G, V)
    for t in closing.nonzero().flatten().tolist():
        W[0, split[t] + 1] = inp["scale"] * torch.einsum("hgk,hgv->hkv", qg[t], dog[t])

    dh0 = cpu(run_backward(inp, nat, h0, dht, cu_t, BT, BS)[1])

    # (1) autograd through the loop
    with torch.enable_grad():
        h0_leaf = cpu(h0).double().requires_grad_(True)
        h_ref, ht_ref = reference.recurrent_states(cpu(inp["k"]), cpu(inp["v"]), h0=h0_leaf, cu_seqlens=cpu(cu_t),
                                                   chunk_size=BT, split_size=BS, **cpu(nat))
        (grad_h0,) = torch.autograd.grad((h_ref * W).sum() + (ht_ref * cpu(dht).double()).sum(), h0_leaf)
    check_close(dh0, grad_h0, "dh0 vs autograd of L through the loop", TOL[torch.float32])

    # (2) L on the forward kernel's states with k = v = 0 (no cancellation between a k, v part and
    # a h0 part), per (sequence, head)
    with nan_poisoned_empty():
        h, ht = chunk_fwd_h(torch.zeros_like(inp["k"]), torch.zeros_like(inp["v"]), h0=h0, output_final_state=True,
                            cu_seqlens=cu_t, chunk_size=BT, split_size=BS, **gates.kernel_gates(nat, BT, cu_t))
    h, ht, h0, dht = cpu(h), cpu(ht), cpu(h0), cpu(dht)
    split_seq = torch.zeros(W.shape[1], dtype=torch.long).index_put_((split,), seq)  # sequence of each slot
    L = torch.zeros(N, H, dtype=torch.float64).index_add_(0, split_seq, (h[0].double() * W[0]).sum((2, 3))) \
        + (ht.double() * dht.double()).sum((2, 3))
    check_close(L, (dh0.double() * h0.double()).sum((2, 3)), "L on the forward's states vs <dh0, h0>",
                TOL[torch.float32])  # 1e-5 under the interpreter; tf32 dots on a GPU


@pytest.mark.parametrize("gate_names,G,cu,BT", [
    (GATES, 3, None, 16),
    (("gk", "gv"), 2, [0, 0, 1, 40, 40, 100], 32),
    (("g", "g_gamma"), 1, [0, 17, 100], 16),
])
def test_round_trip_adjoint_of_the_forward(gate_names, G, cu, BT):
    """The backward is the adjoint of the forward. With k = v = 0 the forward maps h0 linearly to
    its chunk states h[n] = P_n h0, and a token t of chunk n outputs
    o_t = scale · diag(2^{Gv_t}) h[n]ᵀ (q_t ⊙ 2^{G_t}) (no intra-chunk part). So the dense loss
    L = Σ_t ⟨o_t, do_t⟩ + ⟨ht, dht⟩, evaluated on the forward kernel's states, is ⟨dh0, h0⟩
    (per sequence and head) for any h0 — the "dot-product test" of an adjoint pair."""
    B, T, H, K, V = (2, 63, 2, 20, 12) if cu is None else (1, 100, 2, 20, 12)
    inp, nat, h0, dht, cu_t = make_case(B, T, H, G, K, V, gate_names, BT, torch.float32, cu)
    inp["k"].zero_()
    inp["v"].zero_()
    _, dh0 = run_backward(inp, nat, h0, dht, cu_t, BT)
    lg = gates.kernel_gates(nat, BT, cu_t)
    with nan_poisoned_empty():
        h, ht = chunk_fwd_h(inp["k"], inp["v"], h0=h0, output_final_state=True, cu_seqlens=cu_t, chunk_size=BT, **lg)
    inp, lg, h, ht, h0, dht, dh0 = cpu(inp), cpu(lg), cpu(h), cpu(ht), cpu(h0), cpu(dht), cpu(dh0)

    seq, chunk, pos = token_layout(T, BT, cu_t)
    G_q = torch.zeros(B, T, H, K, dtype=torch.float64)  # log2 factor of q_t: all key-side gates
    if "g" in lg:
        G_q += lg["g"].double()[..., None]
    if "g_gamma" in lg:
        G_q += (lg["g_gamma"].double()[None, :] * (pos.double() + 1)[:, None])[None, :, :, None]
    if "gk" in lg:
        G_q += lg["gk"].double()
    G_do = lg["gv"].double() if "gv" in lg else torch.zeros(B, T, H, V, dtype=torch.float64)
    q = inp["scale"] * inp["q"].double().view(B, T, H, G, K) * torch.exp2(G_q)[:, :, :, None]
    do = inp["do"].double().view(B, T, H, G, V) * torch.exp2(G_do)[:, :, :, None]
    o_do = torch.einsum("bthgk,bthkv,bthgv->bth", q, h.double()[:, chunk], do)  # Σ_j ⟨o_tj, do_tj⟩
    L = per_sequence(o_do, seq, cu_t) + (ht.double() * dht.double()).sum((2, 3))
    check_close((dh0.double() * h0.double()).sum((2, 3)), L, "<dh0, h0> vs L on the forward's states",
                TOL[torch.float32])  # 1e-5 under the interpreter; tf32 dots on a GPU


# ---------------------------------------------------------------------------------------------
# Invariants of the kernel itself (exact: the same arithmetic in both runs)
# ---------------------------------------------------------------------------------------------
@pytest.mark.parametrize("cu", [None, [0, 0, 1, 40, 40, 100]])
def test_split_gradients_are_those_of_their_last_chunk(cu):
    """With split_size = 4 chunks, dh[s] is the per-chunk dh of split s's last chunk (or of its
    sequence's last chunk) — fla 0.6.0 stores the split's first chunk's instead."""
    B, T = (2, 100) if cu is None else (1, 100)
    inp, nat, h0, dht, cu = make_case(B, T, 2, 2, 20, 12, ("g", "gk"), 16, torch.float32, cu)
    cfg = CONFIGS["32x16"]  # one config for both runs (the autotuner keys on the split size)
    per_chunk, dh0_c = run_backward(inp, nat, h0, dht, cu, 16, None, config=cfg, pieces=1)
    per_split, dh0_s = run_backward(inp, nat, h0, dht, cu, 16, 64, config=cfg, pieces=1)
    _, chunk, _ = token_layout(T, 16, cu)
    _, split, _ = token_layout(T, 64, cu)
    last_chunk = torch.zeros(int(split.max()) + 1, dtype=torch.long).scatter_reduce_(0, split, chunk, "amax",
                                                                                     include_self=False)
    assert torch.equal(per_split, per_chunk[:, last_chunk.to(per_chunk.device)])
    assert torch.equal(dh0_s, dh0_c)


def test_gqa_sums_the_query_heads_of_a_group():
    """With HQ = G·H, dh is the sum over j of the dh of query heads j, G + j, 2G + j, ... alone."""
    G, H = 3, 2
    inp, nat, h0, dht, cu = make_case(2, 70, H, G, 20, 12, ("g_gamma", "gv"), 32, torch.float32)
    dh, dh0 = run_backward(inp, nat, h0, dht, cu, 32, 64)
    parts = [run_backward({**inp, "q": inp["q"][:, :, j::G], "do": inp["do"][:, :, j::G]}, nat, h0,
                          dht if j == 0 else None, cu, 32, 64) for j in range(G)]
    check_close(dh, sum(p[0] for p in parts), "dh vs the sum over query heads", TOL[torch.float32])
    check_close(dh0, sum(p[1] for p in parts), "dh0 vs the sum over query heads", TOL[torch.float32])


def _tma_config(BK, BV):
    return triton.Config({"BK": BK, "BV": BV, "USE_TMA": True}, num_warps=4, num_stages=1)


TMA_CASES = [  # (id, B, T, H, G, K, V, cu, gates, dtype, BT, BS, tile, pieces)
    ("dense-T100-gqa3-allgates-ragged", 2, 100, 2, 3, 24, 20, None, GATES, torch.float32, 16, 32, (16, 16), 1),
    ("varlen-empty-one-token-gqa2", 1, 100, 2, 2, 20, 24, [0, 0, 1, 40, 40, 100], ("g", "gk", "gv"),
     torch.float32, 32, 64, (32, 16), 1),
    ("T1-tile-wider-than-K-V", 3, 1, 2, 1, 16, 8, None, ("gk",), torch.float32, 16, None, (64, 64), 1),
    ("pieces3-varlen-gqa2-allgates", 1, 100, 2, 2, 24, 20, [0, 0, 1, 40, 40, 100], GATES, torch.float32, 16,
     32, (16, 16), 3),
    ("fp16-dense-g_gamma+gv", 2, 63, 2, 2, 24, 16, None, ("g_gamma", "gv"), torch.float16, 16, None, (16, 16), 1),
]


@pytest.mark.parametrize("c", TMA_CASES, ids=[c[0] for c in TMA_CASES])
def test_tma_loads_match_autograd_of_the_loop(c):
    """q, do, gk, gv read through tensor descriptors (one per sequence; query head j of a group at
    descriptor row i_h·G + j) give the loop's gradients, and the pointer loads' on the same tiles."""
    name, B, T, H, G, K, V, cu, gs, dtype, BT, BS, (BK, BV), pieces = c
    inp, nat, h0, dht, cu = make_case(B, T, H, G, K, V, gs, BT, dtype, cu)
    if ON_GPU and not tuning.tma_usable(inp["q"]):
        pytest.skip("this GPU has no TMA (compute capability < 9.0)")
    assert tuning.tma_usable(inp["q"], inp["do"])
    dh, dh0 = run_backward(inp, nat, h0, dht, cu, BT, BS, config=_tma_config(BK, BV), pieces=pieces)
    ref_dh, ref_dh0 = loop_grads(inp, nat, h0, dht, cu, BT, BS)
    check_close(dh, ref_dh, f"{name}: dh", TOL[dtype])
    check_close(dh0, ref_dh0, f"{name}: dh0", TOL[dtype])
    pointer = triton.Config({"BK": BK, "BV": BV}, num_warps=4, num_stages=1)
    dh_p, dh0_p = run_backward(inp, nat, h0, dht, cu, BT, BS, config=pointer, pieces=pieces)
    check_close(dh, dh_p, f"{name}: TMA vs pointer loads", TOL[dtype])
    check_close(dh0, dh0_p, f"{name}: TMA vs pointer loads (dh0)", TOL[dtype])


def test_tma_config_refused_where_descriptors_cannot_read_the_inputs():
    """K = 33 fp32 rows (132 bytes) cannot be TMA descriptors: the autotuned call falls back to
    pointer loads, an explicit USE_TMA config is refused naming the inputs that cannot be read."""
    inp, nat, h0, dht, cu = make_case(1, 40, 2, 2, 33, 16, ("gk",), 16, torch.float32)
    assert not tuning.tma_usable(inp["q"])
    dh, dh0 = run_backward(inp, nat, h0, dht, cu, 16)
    ref_dh, ref_dh0 = loop_grads(inp, nat, h0, dht, cu, 16)
    check_close(dh, ref_dh, "dh", TOL[torch.float32])
    with pytest.raises(ValueError, match=r"USE_TMA=True\), but q, gk cannot be read"):
        run_backward(inp, nat, h0, dht, cu, 16, config=_tma_config(16, 16))


ONE_LAUNCH_TILES = [(16, 16), (32, 64), (64, 64)]  # 2 x 2 and 1 x 1 tiles of K = 24, V = 20
if ON_GPU:
    ONE_LAUNCH_TILES += [(64, 128), (128, 64), (128, 128), (32, 32)]


@pytest.mark.parametrize("tile", ONE_LAUNCH_TILES, ids=lambda t: f"{t[0]}x{t[1]}")
def test_pieces_in_one_launch_give_the_three_launches_gradients(tile, monkeypatch):
    """The backward's ``pieces.ONE_LAUNCH``: the pieces after each one (it walks in reverse) folded
    into its start as the scan folds them. dh is the three launches' bit for bit on CPU (1e-6 on a
    GPU, which may fuse a multiply-add differently); dh0, which the first piece walks back to, agrees
    to fp32 rounding; flags and the ticket counter are zero after each call. GQA (2 query heads per
    KV head), every gate, dense and packed batches, split 32, both state layouts."""
    from chunkstate import pieces

    pieces.clear_workspaces()
    warps = (4, 8) if ON_GPU else (4,)
    for vf, (B, T, cu, P) in itertools.product((False, True), [(2, 100, None, 3), (1, 130, [0, 1, 60, 61, 130], 4)]):
        inp, nat, h0, dht, cu_t = make_case(B, T, 2, 2, 24, 20, GATES, 16, torch.float32, cu)
        for w in warps:
            cfg = triton.Config({"BK": tile[0], "BV": tile[1]}, num_warps=w, num_stages=1)
            out = {}
            for one in (False, True):
                monkeypatch.setattr(pieces, "ONE_LAUNCH", one)
                out[one] = run_backward(inp, nat, h0, dht, cu_t, 16, 32, state_v_first=vf, config=cfg, pieces=P)
            where = f"B{B} T{T} cu={cu} pieces={P} state_v_first={vf} {tile} w{w}"
            if ON_GPU:
                check_close(out[True][0], out[False][0], f"dh, one launch vs three ({where})", 1e-6)
            else:
                assert torch.equal(out[True][0], out[False][0]), f"dh, one launch vs three ({where})"
            check_close(out[True][1], out[False][1], f"dh0, one launch vs three ({where})", TOL[torch.float32])
            kept = [views for key, views in pieces._WORKSPACES.items() if key[0] == "look_back"]
            assert kept and all(int(v[3].abs().sum()) == 0 and int(v[4].abs().sum()) == 0 for v in kept), where
    dh, dh0 = run_backward(inp, nat, h0, dht, cu_t, 16, 32, pieces=4)
    ref_dh, ref_dh0 = loop_grads(inp, nat, h0, dht, cu_t, 16, 32)
    check_close(dh, ref_dh, "one launch vs autograd of the loop: dh", TOL[torch.float32])
    check_close(dh0, ref_dh0, "one launch vs autograd of the loop: dh0", TOL[torch.float32])
    pieces.clear_workspaces()


@pytest.mark.parametrize("cu", [None, [0, 0, 0]])
def test_no_tokens(cu):
    """Sequences without tokens: no split to store, dh0 = dht (or 0 without dht)."""
    B = 2 if cu is None else 1
    for with_dht in (True, False):
        inp, nat, h0, dht, cu_t = make_case(B, 0, 2, 2, 20, 12, GATES, 16, torch.float32, cu, dht=with_dht)
        dh, dh0 = run_backward(inp, nat, h0, dht, cu_t, 16)
        assert dh.shape == (B, 0, 2, 20, 12)
        assert torch.equal(dh0, dht if with_dht else torch.zeros_like(h0))


def test_scale_is_taken_as_a_float():
    """An int scale (fla's callers pass 1 for some ops) gives exactly the float result; numpy
    scalars work; anything that is not a finite real number is refused."""
    inp, nat, h0, dht, cu = make_case(1, 20, 1, 1, 16, 16, ("g",), 16, torch.float32)
    ref = run_backward({**inp, "scale": 1.0}, nat, h0, dht, cu, 16)
    for scale in (1, np.float32(1.0), np.int64(1)):
        out = run_backward({**inp, "scale": scale}, nat, h0, dht, cu, 16)
        assert torch.equal(out[0], ref[0]) and torch.equal(out[1], ref[1])
    for bad, err in ((True, TypeError), ("0.5", TypeError), (torch.tensor(0.5), TypeError), (None, TypeError),
                     (math.nan, ValueError), (math.inf, ValueError)):
        with pytest.raises(err, match="scale"):
            run_backward({**inp, "scale": bad}, nat, h0, dht, cu, 16)


def test_k_v_and_h0_are_read_for_their_sizes_only_never_copied(monkeypatch):
    """The backward reads k and v for their sizes and dtype, and h0 for its presence: given as
    strided views (k and v split off a fused projection, h0 transposed), they give exactly the
    result of contiguous copies and are never copied themselves (a copy of k and v would move
    more bytes than the kernel)."""
    B, T, H, K, V = 2, 40, 2, 16, 16
    qkv = torch.randn(B, T, H, 3 * K, device=DEVICE)
    q, k, v = qkv[..., :K], qkv[..., K:2 * K], qkv[..., 2 * K:]
    do = torch.randn(B, T, H, V, device=DEVICE)
    h0 = torch.randn(B, H, V, K, device=DEVICE).transpose(-1, -2)  # [B, H, K, V], strided
    dht = torch.randn(B, H, K, V, device=DEVICE)
    g = gates.chunk_local_cumsum(F.logsigmoid(torch.randn(B, T, H, device=DEVICE) + 3), 16)
    assert not (k.is_contiguous() or v.is_contiguous() or h0.is_contiguous())
    kw = dict(g=g, scale=K ** -0.5, chunk_size=16)
    want = chunk_bwd_dh(q.contiguous(), k.contiguous(), v.contiguous(), do, h0.contiguous(), dht, **kw)
    copied = []
    real = torch.Tensor.contiguous

    def recording(x, *args, **kwargs):
        out = real(x, *args, **kwargs)
        if out is not x:
            copied.append(x)
        return out

    monkeypatch.setattr(torch.Tensor, "contiguous", recording)
    got = chunk_bwd_dh(q, k, v, do, h0, dht, **kw)
    assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1])
    assert not any(x is k or x is v or x is h0 for x in copied)
    assert any(x is q for x in copied)  # q is read by the kernel: made contiguous


# ---------------------------------------------------------------------------------------------
# Bad inputs: a clear error naming the argument
# ---------------------------------------------------------------------------------------------
def _bad_inputs():
    B, T, H, G, K, V = 2, 8, 2, 2, 12, 20
    randn = functools.partial(torch.randn, device=DEVICE)
    q, k, v, do = randn(B, T, H * G, K), randn(B, T, H, K), randn(B, T, H, V), randn(B, T, H * G, V)
    ok = dict(q=q, k=k, v=v, do=do, h0=randn(B, H, K, V), dht=randn(B, H, K, V), scale=0.5)
    return ok, [
        ("q", dict(q=q.tolist()), TypeError, "q must be a torch.Tensor"),
        ("q", dict(q=q[0]), ValueError, "q must have shape"),
        ("q", dict(q=q.long()), TypeError, "q must be a floating-point"),
        ("k", dict(k=k[..., :-1]), ValueError, "k must have shape"),
        ("k", dict(k=k.double()), TypeError, "k must have q's dtype"),
        ("heads", dict(q=randn(B, T, 3, K)), ValueError, "q must have a positive multiple of k's H=2"),
        ("heads", dict(q=randn(B, T, 0, K), do=randn(B, T, 0, V)), ValueError, "q must have a positive"),
        ("v", dict(v=v[:, :-1]), ValueError, "v must have shape"),
        ("do", dict(do=do[:, :, :H]), ValueError, r"do must have shape \[2, 8, 4, 20\]"),
        ("do", dict(do=do.half()), TypeError, "do must have q's dtype"),
        ("h0", dict(h0=randn(B, H, V, K)), ValueError, "h0 must have shape"),
        ("dht", dict(dht=randn(B, H * G, K, V)), ValueError, r"dht must have shape \[2, 2, 12, 20\]"),
        ("dht", dict(dht=torch.randn(B, H, K, V, device="meta")), ValueError, "dht is on meta"),
        ("scale", dict(scale="1"), TypeError, "scale must be a real number"),
        ("chunk_size", dict(chunk_size=48), ValueError, "chunk_size must be a power of two"),
        ("split_size", dict(split_size=24), ValueError, "split_size must be a positive multiple"),
        ("g", dict(g=randn(B, T, H * G)), ValueError, "g must have shape"),
        ("g_gamma", dict(g_gamma=randn(H * G)), ValueError, "g_gamma must have shape"),
        ("gk", dict(gk=randn(B, T, H, V)), ValueError, "gk must have shape"),
        ("gv", dict(gv=randn(B, T, H, K)), ValueError, "gv must have shape"),
        ("cu_seqlens", dict(cu_seqlens=torch.tensor([0, 4, 8], device=DEVICE)), ValueError, "batch size must be 1"),
        ("cu_seqlens", dict(q=q[:1], k=k[:1], v=v[:1], do=do[:1], h0=None, dht=None,
                            cu_seqlens=torch.tensor([0, 4, 7], device=DEVICE)), ValueError, "cu_seqlens must end at T=8"),
    ]


@pytest.mark.parametrize("i", range(len(_bad_inputs()[1])), ids=[f"{c[0]}-{n}" for n, c in enumerate(_bad_inputs()[1])])
def test_bad_input_is_refused_naming_it(i):
    ok, cases = _bad_inputs()
    _, change, err, match = cases[i]
    args = {**ok, **change}
    with pytest.raises(err, match=match):
        chunk_bwd_dh(args.pop("q"), args.pop("k"), args.pop("v"), args.pop("do"), args.pop("h0"), args.pop("dht"),
                     args.pop("scale"), **args)
    chunk_bwd_dh(ok["q"], ok["k"], ok["v"], ok["do"], ok["h0"], ok["dht"], ok["scale"])  # the unchanged call runs


# ---------------------------------------------------------------------------------------------
# GPU: large shapes, bf16, every autotune config, fla-core 0.6.0
# ---------------------------------------------------------------------------------------------
def reverse_loop(inp, nat, dht, cu, split_size):
    """The token loop run backwards in float64, without autograd: fast enough for T = 4096.

    R, the gradient w.r.t. the state after token t counting outputs after t, starts at dht; per
    token from the last: store R if t closes a split, add scale · Σ_j q_tj do_tjᵀ, then undo the
    token's decay, R ← diag(e^{a_t}) R diag(e^{b_t}). Same result as reference.state_grads
    (test_reverse_loop_is_autograd_of_the_loop). Returns dh [B, NS, H, K, V], dh0 [N, H, K, V].
    """
    q, do = inp["q"].double(), inp["do"].double()
    B, T, HQ, K = q.shape
    H, V = inp["k"].shape[2], do.shape[-1]
    G = HQ // H
    a = torch.zeros(B, T, H, K, dtype=torch.float64, device=q.device)  # key-side log-decay per token
    if "g" in nat:
        a = a + nat["g"].double()[..., None]
    if "g_gamma" in nat:
        a = a + nat["g_gamma"].double()[:, None]
    if "gk" in nat:
        a = a + nat["gk"].double()
    b = nat["gv"].double() if "gv" in nat else None
    if cu is None:  # (rows, first token, end, sequences, first split slot): dense rows run together
        segments = [(list(range(B)), 0, T, list(range(B)), 0)]
        NS = -(-T // split_size)
    else:
        bounds, slots = cu.tolist(), gates.prepare_chunk_offsets(cu, split_size).tolist()
        segments = [([0], bounds[n], bounds[n + 1], [n], slots[n]) for n in range(len(bounds) - 1)]
        NS = slots[-1]
    N = B if cu is None else len(cu) - 1
    dh = torch.zeros(B, NS, H, K, V, dtype=torch.float64, device=q.device)
    dh0 = torch.zeros(N, H, K, V, dtype=torch.float64, device=q.device)
    for rows, bos, eos, seqs, first_slot in segments:
        R = dht[seqs].double() if dht is not None else torch.zeros_like(dh0[seqs])
        for t in range(eos - 1, bos - 1, -1):
            if (t - bos) % split_size == split_size - 1 or t == eos - 1:
                dh[rows, first_slot + (t - bos) // split_size] = R
            R = R + inp["scale"] * torch.einsum("nhgk,nhgv->nhkv", q[rows, t].view(-1, H, G, K),
                                                do[rows, t].view(-1, H, G, V))
            R = torch.exp(a[rows, t])[..., None] * R
            if b is not None:
                R = R * torch.exp(b[rows, t])[:, :, None, :]
        dh0[seqs] = R
    return dh, dh0


@pytest.mark.parametrize("cu", [None, [0, 0, 1, 40, 40, 100]])
def test_reverse_loop_is_autograd_of_the_loop(cu):
    """The GPU tests' fast oracle agrees with reference.state_grads (float64 both: 1e-12)."""
    B = 2 if cu is None else 1
    inp, nat, h0, dht, cu = make_case(B, 100, 2, 2, 12, 20, GATES, 16, torch.float64, cu, device="cpu")
    dh, dh0 = reverse_loop(inp, nat, dht, cu, 32)
    ref_dh, ref_dh0 = loop_grads(inp, nat, h0, dht, cu, 16, 32)
    check_close(dh, ref_dh, "dh", 1e-12)
    check_close(dh0, ref_dh0, "dh0", 1e-12)


# (B, T, H, G, K, V, cu_seqlens, gates, BT, split multiple, state_v_first)
GPU_CASES = [
    (2, 4096, 4, 1, 128, 128, None, ("g",), 64, 1, False),
    (2, 4096, 4, 1, 128, 128, None, ("gk",), 64, 1, True),
    (2, 4096, 4, 1, 128, 128, None, ("g", "g_gamma"), 64, 2, False),
    (2, 4096, 4, 1, 128, 128, None, GATES, 64, 4, False),
    (4, 1000, 4, 2, 128, 128, None, ("g_gamma", "gv"), 32, 2, True),
    (8, 777, 2, 8, 64, 96, None, ("g",), 128, 2, False),
    (1, 4096, 4, 2, 128, 128, [0, 0, 1, 1000, 1000, 3001, 4096], GATES, 64, 2, False),
    (1, 3000, 8, 1, 100, 72, [0, 1500, 1501, 3000], ("gk", "gv"), 64, 1, True),
]


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=["bf16", "fp32"])
@pytest.mark.parametrize("case", GPU_CASES, ids=lambda c: f"B{c[0]}T{c[1]}H{c[2]}G{c[3]}K{c[4]}V{c[5]}-"
                         f"{'varlen-' if c[6] else ''}{'+'.join(c[7])}-BT{c[8]}-BS{c[9]}x{'-vk' if c[10] else ''}")
def test_gpu_large_against_the_loop(case, dtype):
    """Long sequences, K = V = 128: the plain kernel (pieces=1) and the default (sequence pieces
    where the grid is far under a wave, e.g. B = 2, H = 4, T = 4096)."""
    B, T, H, G, K, V, cu, gate_names, BT, splits, state_v_first = case
    inp, nat, h0, dht, cu = make_case(B, T, H, G, K, V, gate_names, BT, dtype, cu)
    BS = splits * BT
    ref_dh, ref_dh0 = reverse_loop(inp, nat, dht, cu, BS)
    for pieces in (1, None):
        dh, dh0 = run_backward(inp, nat, h0, dht, cu, BT, None if splits == 1 else BS, state_v_first, pieces=pieces)
        check_close(dh, ref_dh, f"dh (pieces={pieces})", TOL[dtype])
        check_close(dh0, ref_dh0, f"dh0 (pieces={pieces})", TOL[dtype])


def _configs_to_check(dtype):
    """bf16: every config in tuning.ALL_CONFIGS. fp32: those the autotuner tries at K = V = 128
    (compiling all 60 twice would cost minutes of GPU time for the same tiling logic)."""
    if dtype == torch.bfloat16:
        return tuning.ALL_CONFIGS
    tried = {t for bucket in range(tuning.N_BUCKETS) for tma in (False, True) for vector in (False, True)
             for t in tuning.candidates(128, 128, bucket, tma, vector)}
    return [c for c in tuning.ALL_CONFIGS if tuning.config_tuple(c) in tried]


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=["bf16", "fp32"])
def test_gpu_every_config(dtype):
    """Configs run through config= and checked, not only the autotuned winner (K = V = 128: every
    config's tiles are valid). A config over the shared memory raises Triton's OutOfResources,
    which the autotuner skips; all bf16 configs must fit."""
    from triton.runtime.errors import OutOfResources

    inp, nat, h0, dht, cu = make_case(2, 512, 4, 2, 128, 128, GATES, 64, dtype)
    ref_dh, ref_dh0 = reverse_loop(inp, nat, dht, cu, 128)
    configs = _configs_to_check(dtype)
    wrong, too_big = [], []
    for config in configs:
        name = tuning.config_label(config)
        try:
            dh, dh0 = run_backward(inp, nat, h0, dht, cu, 64, 128, config=config)
        except OutOfResources:
            too_big.append(name)
            continue
        if not (rel_err(dh, ref_dh) < TOL[dtype] and rel_err(dh0, ref_dh0) < TOL[dtype]):
            wrong.append(f"{name}: dh {rel_err(dh, ref_dh):.2e}, dh0 {rel_err(dh0, ref_dh0):.2e}")
    assert not wrong, f"{len(wrong)} of {len(configs)} configs give wrong gradients: {wrong}"
    if dtype == torch.bfloat16:
        assert not too_big, f"bf16 configs over the shared memory: {too_big}"
    assert len(too_big) < len(configs), "no config fits"


def _fla_chunk_h():
    """fla-core 0.6.0's chunk_h module; skips when fla is not installed. (The tests that call it
    take the ``fla_one_config`` fixture: fla's backward would time 48 configs per specialisation,
    34-49 s each on an H200.)"""
    fla_chunk_h = pytest.importorskip("fla.ops.common.chunk_h")
    import importlib.metadata

    if importlib.metadata.version("fla-core") != "0.6.0":
        pytest.skip("compares against fla-core 0.6.0 exactly")
    return fla_chunk_h


@pytest.mark.gpu
@pytest.mark.parametrize("gate_names", [("g",), ("g_gamma",), ("gk",), ("gv",), ("gk", "gv"), ("g", "gk", "gv")],
                         ids="+".join)
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=["bf16", "fp32"])
@pytest.mark.parametrize("cu", [None, [0, 0, 700, 2048, 4096]], ids=["dense", "varlen"])
def test_gpu_matches_fla_where_fla_is_right(gate_names, dtype, cu, fla_one_config):
    """HQ = H and split_size = chunk_size, one gate kind or gk with gv (fla 0.6.0's GQA and split
    paths are wrong, and so is g with g_gamma). fla takes the same log2 chunk-local cumsums."""
    fla = _fla_chunk_h()
    B, T = (2, 2048) if cu is None else (1, 4096)
    inp, nat, h0, dht, cu = make_case(B, T, 4, 1, 128, 128, gate_names, 64, dtype, cu)
    ours = run_backward(inp, nat, h0, dht, cu, 64)
    with nan_poisoned_empty():
        theirs = fla.chunk_bwd_dh(inp["q"], inp["k"], inp["v"], inp["do"], h0, dht, inp["scale"],
                                  **gates.kernel_gates(nat, 64, cu), cu_seqlens=cu, chunk_size=64)
    check_close(ours[0], theirs[0], "dh vs fla", TOL[dtype])
    check_close(ours[1], theirs[1], "dh0 vs fla", TOL[dtype])


@pytest.mark.gpu
def test_gpu_fla_gqa_bug_is_not_ours(fla_one_config):
    """fla 0.6.0 with HQ = 2H allocates HQ heads, launches N·H programs and indexes by HQ: its dh0
    is wrong (and part of its dh never written), while chunkstate matches the loop."""
    fla = _fla_chunk_h()
    inp, nat, h0, dht, cu = make_case(2, 512, 2, 2, 64, 64, ("g",), 64, torch.float32)
    ref_dh, ref_dh0 = reverse_loop(inp, nat, dht, cu, 64)
    dh, dh0 = run_backward(inp, nat, h0, dht, cu, 64)
    check_close(dh, ref_dh, "dh", TOL[torch.float32])
    check_close(dh0, ref_dh0, "dh0", TOL[torch.float32])
    with nan_poisoned_empty():
        _, fla_dh0 = fla.chunk_bwd_dh(inp["q"], inp["k"], inp["v"], inp["do"], h0, dht, inp["scale"],
                                      **gates.kernel_gates(nat, 64, cu), chunk_size=64)
    err = rel_err(fla_dh0, ref_dh0)
    assert not err < 0.1, f"fla's GQA dh0 is within {err:.1e} of the loop: fixed upstream? update this test"
