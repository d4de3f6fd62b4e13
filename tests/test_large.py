"""Large shapes on a GPU: element offsets past 2^31 and more than 65,535 (sequence, head) pairs,
for ``chunk_fwd_h`` and ``chunk_bwd_dh``, each with sequence pieces off and on.

GPU only: these tensors hold billions of elements (a CPU interpreter would need hours). Each GPU
test has a toy twin that runs the *same* checking code at a few hundred tokens on CPU, so the
sampled-window oracle below is itself tested everywhere.

Checking 2M tokens against a float64 loop would take hours, so states are checked in short
windows, exactly:

- forward: the state entering split s0 is the kernel's own fp32 state (``states_in_fp32``); the
  float64 chunked reference restarted from it over the next few splits must give the kernel's
  next states (and ``ht`` when the window reaches T). Windows sit at each row's start, middle
  and end, and at the splits where an element offset of k/v/gk or of h first passes a multiple
  of 2^31 — a wrapped int32 offset reads or writes the wrong place right there;
- backward (pieces off and on, as the forward): ``dh`` is linear in later outputs, so the
  gradient leaving the window's last split (the kernel's own fp32 ``dh``, or ``dht`` at the end)
  stands for everything after it; autograd through the float64 loop over the window must then
  give the kernel's ``dh`` of the window's earlier splits (and ``dh0`` for the window at the
  start).

Memory: (a) forward ~31 GB, (c) backward ~28 GB, (b) ~0.2 GB — each test frees its tensors and
asserts its peak stays under ``MAX_GB``. Configs are explicit (``config=``) so no autotuning runs.

Tolerances: bf16 1e-2 (three 2^-8 roundings: decayed operand, dot inputs; states are fp32 here);
fp32 on a GPU 2e-3 (tf32 dots); fp32 under the interpreter 1e-5 (exact-fp32 dots) — as in
test_forward.py.
"""
from __future__ import annotations

import itertools
import random

import chunkstate  # first: it sets TRITON_INTERPRET on a CPU machine before Triton is imported

import pytest
import torch
import torch.nn.functional as F
import triton

from chunkstate import gates, reference
from chunkstate.backward import chunk_bwd_dh
from chunkstate.gates import RCP_LN2, prepare_chunk_offsets
from chunkstate.testing import check_close

DEVICE = chunkstate.DEVICE
ON_GPU = DEVICE == "cuda"
gpu_only = pytest.mark.gpu(reason="billions of elements (up to ~31 GB) cannot run under Triton's interpreter "
                           "on CPU; the toy twins below check the same code at small size")
TOL = {torch.bfloat16: 1e-2, torch.float32: 2e-3 if ON_GPU else 1e-5}
MAX_GB = 60
INT31 = 2 ** 31
SLICE = 2 ** 16  # tokens per slice when building gates (bounds the float64 cumsum's temporaries)
WINDOW = 3  # splits per checked window


# ---------------------------------------------------------------------------------------------
# Building big inputs
# ---------------------------------------------------------------------------------------------

def mild_gate(*shape, dtype=torch.float32):
    """Natural-log per-token gates ~-0.02 (decay e^-1.3 per 64-token chunk), in ``dtype``."""
    return F.logsigmoid(4 + torch.randn(*shape, device=DEVICE)).to(dtype)


def big_gate(B, T, H, D, BT, dtype):
    """A [B, T, H, D] natural-log gate in ``dtype`` and its kernel form (fp32 chunk-local log2
    cumsum), built SLICE tokens at a time (SLICE is a multiple of BT, so chunks never straddle)."""
    nat = torch.zeros(B, T, H, D, device=DEVICE, dtype=dtype)
    ker = torch.zeros(B, T, H, D, device=DEVICE, dtype=torch.float32)
    for t0 in range(0, T, SLICE):
        t1 = min(T, t0 + SLICE)
        nat[:, t0:t1] = mild_gate(B, t1 - t0, H, D, dtype=dtype)
        ker[:, t0:t1] = gates.chunk_local_cumsum(nat[:, t0:t1], BT)
    return nat, ker


def crossing_windows(B, T, NS, BS, token_elems, slot_elems, first, limit=INT31):
    """(b, s0) windows around every split where an element offset passes a multiple of ``limit``
    (2^31): in a token-major tensor with ``token_elems`` elements per token (k: H·K) and in a
    slot-major one with ``slot_elems`` per stored split (h: H·K·V). ``first``: the smallest s0."""
    out = set()
    for m in range(1, (B * T * token_elems - 1) // limit + 1):
        b, t = divmod(m * limit // token_elems, T)  # the first token at or past m·limit
        out.add((b, max(first, t // BS - 1)))
    for m in range(1, (B * NS * slot_elems - 1) // limit + 1):
        b, s = divmod(m * limit // slot_elems, NS)  # the first split slot at or past m·limit
        out.add((b, max(first, s - 1)))
    return out


def row_windows(B, NS, first, last):
    return {(b, s) for b in range(B) for s in (first, (NS - 1) // 2, last)}


# ---------------------------------------------------------------------------------------------
# (a) forward with offsets past 2^31
# ---------------------------------------------------------------------------------------------

def check_forward_windows(B, T, H, K, V, BT, BS, dtype, pieces_list, config, limit=INT31):
    k = torch.randn(B, T, H, K, device=DEVICE, dtype=dtype)
    v = torch.randn(B, T, H, V, device=DEVICE, dtype=dtype)
    g_nat = mild_gate(B, T, H)
    g = gates.chunk_local_cumsum(g_nat, BT)
    gk_nat, gk = big_gate(B, T, H, K, BT, dtype)
    h0 = torch.randn(B, H, K, V, device=DEVICE)
    NS = triton.cdiv(T, BS)
    windows = row_windows(B, NS, 0, max(0, NS - WINDOW))
    windows |= crossing_windows(B, T, NS, BS, H * max(K, V), H * K * V, 0, limit)
    for pieces in pieces_list:
        h, ht = chunkstate.chunk_fwd_h(k, v, g=g, gk=gk, h0=h0, output_final_state=True, chunk_size=BT,
                                       split_size=BS, states_in_fp32=True, pieces=pieces, config=config)
        assert h.shape == (B, NS, H, K, V) and h.dtype == torch.float32
        assert torch.equal(h[:, 0], h0), f"pieces={pieces}: first states must be h0"
        for b, s0 in sorted(windows):
            t0, t1 = s0 * BS, min(T, (s0 + WINDOW) * BS)
            sl = (slice(b, b + 1), slice(t0, t1))
            h_ref, ht_ref = reference.chunked_states(k[sl], v[sl], g=g_nat[sl], gk=gk_nat[sl], h0=h[b, s0][None],
                                                     chunk_size=BT, split_size=BS)
            n = h_ref.shape[1]
            what = f"pieces={pieces} row {b} splits {s0 + 1}..{s0 + n - 1} (tokens {t0}..{t1})"
            if n > 1:
                check_close(h[b:b + 1, s0 + 1:s0 + n], h_ref[:, 1:], what, TOL[dtype])
            if t1 == T:
                check_close(ht[b:b + 1], ht_ref, f"{what}: ht", TOL[dtype])
        del h, ht
    return windows


@gpu_only
def test_gpu_forward_offsets_beyond_2_31():
    """bf16 B2 T=2^20+1000 H8 K=V=128: k, v and gk hold 2.15e9 elements each (the second row's
    base offset b·T·H·K is 1.07e9), the fp32 states 4.3e9; pieces off (the plain kernel) and
    automatic (5 pieces per row here: 64 programs on 132 SMs)."""
    B, T, H, K, V, BT = 2, 2 ** 20 + 1000, 8, 128, 128, 64
    assert B * T * H * K > INT31 and B * triton.cdiv(T, BT) * H * K * V > 2 * INT31
    torch.cuda.reset_peak_memory_stats()
    cfg = triton.Config({"BK": 64, "BV": 64}, num_warps=4, num_stages=2)
    windows = check_forward_windows(B, T, H, K, V, BT, BT, torch.bfloat16, (1, None), cfg)
    assert any(s0 * BT * H * K + b * T * H * K > INT31 for b, s0 in windows)
    torch.cuda.empty_cache()
    assert torch.cuda.max_memory_allocated() < MAX_GB * 2 ** 30


TOY_LIMIT = 2 ** 11  # stands in for 2^31 at toy size, so the crossing windows are exercised too


def test_forward_windows_toy():
    """The same code at toy size under the interpreter (or on the GPU): the window oracle."""
    cfg = triton.Config({"BK": 16, "BV": 16}, num_warps=4, num_stages=1)
    assert crossing_windows(2, 100, 4, 32, 2 * 16, 2 * 16 * 16, 0, TOY_LIMIT)  # some offsets do cross
    check_forward_windows(2, 100, 2, 16, 16, 16, 32, torch.float32, (1, 2), cfg, TOY_LIMIT)


# ---------------------------------------------------------------------------------------------
# (c) backward with offsets past 2^31
# ---------------------------------------------------------------------------------------------

def check_backward_windows(B, T, H, G, K, V, BT, BS, dtype, pieces_list, config, limit=INT31):
    HQ, scale = H * G, K ** -0.5
    q = torch.randn(B, T, HQ, K, device=DEVICE, dtype=dtype)
    do = torch.randn(B, T, HQ, V, device=DEVICE, dtype=dtype)
    k = torch.zeros(B, T, H, K, device=DEVICE, dtype=dtype)  # read for their shapes only
    v = torch.zeros(B, T, H, V, device=DEVICE, dtype=dtype)
    g_nat = mild_gate(B, T, H)
    g = gates.chunk_local_cumsum(g_nat, BT)
    gv_nat, gv = big_gate(B, T, H, V, BT, dtype)
    h0 = torch.zeros(B, H, K, V, device=DEVICE)  # asks for dh0
    dht = torch.randn(B, H, K, V, device=DEVICE)
    NS = triton.cdiv(T, BS)
    # s0 = -1: the window opens at token 0 and its first checked gradient is dh0
    windows = row_windows(B, NS, -1, max(-1, NS - 1 - WINDOW))
    windows |= crossing_windows(B, T, NS, BS, HQ * max(K, V), H * K * V, -1, limit)
    for pieces in pieces_list:
        dh, dh0 = chunk_bwd_dh(q, k, v, do, h0, dht, scale, g=g, gv=gv, chunk_size=BT, split_size=BS,
                               states_in_fp32=True, pieces=pieces, config=config)
        assert dh.shape == (B, NS, H, K, V) and dh.dtype == torch.float32 and dh0.dtype == torch.float32
        assert torch.equal(dh[:, -1], dht), f"pieces={pieces}: the last split's gradient must be dht"
        for b, s0 in sorted(windows):
            ta, tb = (s0 + 1) * BS, min(T, (s0 + 1 + WINDOW) * BS)
            D = dht[b] if tb == T else dh[b, s0 + WINDOW]  # gradient leaving the window's last split
            sl = (slice(b, b + 1), slice(ta, tb))
            dh_ref, dh0_ref = reference.state_grads(q[sl], k[sl], v[sl], do[sl], g=g_nat[sl], gv=gv_nat[sl],
                                                    dht=D[None], scale=scale, chunk_size=BT, split_size=BS)
            n = dh_ref.shape[1]  # window splits s0+1 .. s0+n; the last one's gradient is D itself
            want = torch.cat([dh0_ref, dh_ref[0, :-1]])  # gradients leaving splits s0 .. s0+n-1
            first = dh0[b][None] if s0 == -1 else dh[b, s0][None]
            got = torch.cat([first, dh[b, s0 + 1:s0 + n]])
            check_close(got, want, f"pieces={pieces} row {b} splits {s0}..{s0 + n - 1} (tokens {ta}..{tb})",
                        TOL[dtype])
        del dh, dh0
    return windows


@gpu_only
def test_gpu_backward_offsets_beyond_2_31():
    """bf16 B2 T=2^20+1000 H4 G2 (HQ 8) K=V=128, gates g and gv: q and do hold 2.15e9 elements
    each, the fp32 gradients 2.15e9; pieces off and automatic (32 programs: pieces are chosen)."""
    B, T, H, G, K, V, BT = 2, 2 ** 20 + 1000, 4, 2, 128, 128, 64
    assert B * T * H * G * K > INT31 and B * triton.cdiv(T, BT) * H * K * V > INT31
    torch.cuda.reset_peak_memory_stats()
    cfg = triton.Config({"BK": 64, "BV": 64}, num_warps=4, num_stages=2)
    windows = check_backward_windows(B, T, H, G, K, V, BT, BT, torch.bfloat16, (1, None), cfg)
    assert any((s0 + 1) * BT * H * G * K + b * T * H * G * K > INT31 for b, s0 in windows)
    torch.cuda.empty_cache()
    assert torch.cuda.max_memory_allocated() < MAX_GB * 2 ** 30


def test_backward_windows_toy():
    cfg = triton.Config({"BK": 16, "BV": 16}, num_warps=4, num_stages=1)
    assert crossing_windows(2, 100, 4, 32, 4 * 16, 2 * 16 * 16, -1, TOY_LIMIT)
    check_backward_windows(2, 100, 2, 2, 16, 16, 16, 32, torch.float32, (1, 2), cfg, TOY_LIMIT)


# ---------------------------------------------------------------------------------------------
# (b) more than 65,535 (sequence, head) pairs
# ---------------------------------------------------------------------------------------------

def sub_batch(cu, seqs, tensors):
    """The packed sub-batch of sequences ``seqs``: token-major tensors cut and re-packed."""
    idx = torch.cat([torch.arange(cu[n], cu[n + 1]) for n in seqs]).to(DEVICE)
    lens = [cu[n + 1] - cu[n] for n in seqs]
    sub_cu = torch.tensor([0, *itertools.accumulate(lens)], dtype=torch.int32, device=DEVICE)
    return {name: x[:, idx] for name, x in tensors.items()}, sub_cu


def check_many_sequences(N, H, G, K, V, BT, BS, pieces_list, config, special, max_len=40):
    """N packed sequences of 0..max_len tokens (``special`` ones forced: index -> length); forward and
    backward of sampled sequences (the special ones and 12 random) against the loop."""
    lens = torch.randint(0, max_len + 1, (N,))
    for n, L in special.items():
        lens[n] = L
    cu = [0, *torch.cumsum(lens, 0).tolist()]
    T = cu[-1]
    cu_t = torch.tensor(cu, dtype=torch.int32, device=DEVICE)
    nat = {"g": mild_gate(1, T, H), "g_gamma": -0.02 * torch.rand(H, device=DEVICE),
           "gk": mild_gate(1, T, H, K), "gv": mild_gate(1, T, H, V)}
    kg = {n: x * RCP_LN2 if n == "g_gamma" else gates.chunk_local_cumsum(x, BT, cu_t) for n, x in nat.items()}
    x = dict(k=torch.randn(1, T, H, K, device=DEVICE), v=torch.randn(1, T, H, V, device=DEVICE),
             q=torch.randn(1, T, H * G, K, device=DEVICE), do=torch.randn(1, T, H * G, V, device=DEVICE))
    h0, dht = torch.randn(N, H, K, V, device=DEVICE), torch.randn(N, H, K, V, device=DEVICE)
    seqs = sorted({*(n % N for n in special), *random.sample(range(N), min(12, N))})
    sub, sub_cu = sub_batch(cu, seqs, {**x, **{n: t for n, t in nat.items() if n != "g_gamma"}})
    sub_nat = {n: sub[n] for n in ("g", "gk", "gv")}
    offsets = prepare_chunk_offsets(cu_t, BS).tolist()
    pick = lambda y: torch.cat([y[:, offsets[n]:offsets[n + 1]] for n in seqs], 1)  # noqa: E731
    empty = [n for n in seqs if lens[n] == 0]
    tol = TOL[torch.float32]

    h_ref, ht_ref = reference.recurrent_states(sub["k"], sub["v"], **sub_nat, g_gamma=nat["g_gamma"], h0=h0[seqs],
                                               cu_seqlens=sub_cu, chunk_size=BT, split_size=BS)
    for pieces in pieces_list:
        h, ht = chunkstate.chunk_fwd_h(x["k"], x["v"], **kg, h0=h0, output_final_state=True, cu_seqlens=cu_t,
                                       chunk_size=BT, split_size=BS, pieces=pieces, config=config)
        assert h.shape[1] == offsets[-1]
        check_close(pick(h), h_ref, f"pieces={pieces}: sampled sequences' h", tol)
        check_close(ht[seqs], ht_ref, f"pieces={pieces}: sampled sequences' ht", tol)
        for n in empty:
            assert torch.equal(ht[n], h0[n]), f"pieces={pieces}: empty sequence {n}'s ht must be its h0"
        del h, ht

    dh_ref, dh0_ref = reference.state_grads(sub["q"], sub["k"], sub["v"], sub["do"], **sub_nat,
                                            g_gamma=nat["g_gamma"], h0=h0[seqs], dht=dht[seqs], cu_seqlens=sub_cu,
                                            scale=K ** -0.5, chunk_size=BT, split_size=BS)
    for pieces in pieces_list:
        dh, dh0 = chunk_bwd_dh(x["q"], x["k"], x["v"], x["do"], h0, dht, K ** -0.5, **kg, cu_seqlens=cu_t,
                               chunk_size=BT, split_size=BS, pieces=pieces, config=config)
        check_close(pick(dh), dh_ref, f"pieces={pieces}: sampled sequences' dh", tol)
        check_close(dh0[seqs], dh0_ref, f"pieces={pieces}: sampled sequences' dh0", tol)
        for n in empty:
            assert torch.equal(dh0[n], dht[n]), f"pieces={pieces}: empty sequence {n}'s dh0 must be its dht"
        del dh, dh0
    return seqs


@gpu_only
def test_gpu_more_than_65535_sequence_heads():
    """35,000 sequences x 2 heads = 70,000 (sequence, head) pairs — 70,000 programs of 16x32 tiles
    (fla 0.5.2's grid stopped at 65,535) — all four gates, split = 2 chunks, GQA G = 2 in the
    backward, pieces off and 2 in both directions (the piece scan then also has 70,000 programs). Sampled: both sides
    of pair 65,535 (sequences 32,767 / 32,768), the first and last ones, empty and one-token ones."""
    N, H = 35_000, 2
    assert N * H > 65_535
    torch.cuda.reset_peak_memory_stats()
    cfg = triton.Config({"BK": 16, "BV": 32}, num_warps=4, num_stages=2)
    special = {0: 0, 1: 1, 2: 40, 32_766: 17, 32_767: 40, 32_768: 0, 32_769: 33, N - 2: 0, N - 1: 1}
    check_many_sequences(N, H, 2, 16, 32, 16, 32, (1, 2), cfg, special)
    torch.cuda.empty_cache()
    assert torch.cuda.max_memory_allocated() < MAX_GB * 2 ** 30


def test_many_sequences_toy():
    cfg = triton.Config({"BK": 16, "BV": 32}, num_warps=4, num_stages=1)
    check_many_sequences(7, 2, 2, 16, 32, 16, 32, (1, 2), cfg, {0: 0, 1: 1, 3: 40, 5: 0, 6: 1}, max_len=20)
