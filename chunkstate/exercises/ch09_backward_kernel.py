"""Chapter 09 exercises: where the backward stores, and a tiled backward kernel with the value gate.

1. ``store_slot(i_t, NT, chunks_per_split) -> int | None``: walking a sequence's NT chunks from the
   last, the backward kernel is about to process chunk ``i_t`` holding the gradient w.r.t. the
   state *leaving* it. Return the split slot (counted from the sequence's first split) it must
   store that gradient in — when chunk ``i_t`` is the last chunk of its split — or None.

2. ``gv_dh(q, do, gv, scale, chunk_size, BK, BV) -> dh``: a Triton kernel (and its launcher)
   holding one [BK, BV] tile of the state gradient per program on a flat grid, with the
   value-side gate only and one query head per state. Inputs: ``q`` [B, T, H, K], ``do``
   [B, T, H, V] fp32; ``gv`` [B, T, H, V] the *chunk-local cumulative sum in log2 units* of a
   natural-log gate (``gates.chunk_local_cumsum(gv, chunk_size)``); BK, BV powers of two >= 16
   (K, V any size). Returns ``dh`` [B, NT, H, K, V] fp32, ``dh[:, n]`` the gradient w.r.t. the
   state leaving chunk n (zero after the last chunk: no ``dht``). Walking the chunks from the
   last, with ``Γv = Gv[last valid token]``::

       store dh[n];   dh  ←  dh · diag(2^{Γv})  +  scale · qᵀ (do ⊙ 2^{Gv})
"""
from __future__ import annotations

import math
import random

import torch
import torch.nn.functional as F
import triton
import triton.language as tl

from ..env import DEVICE
from ..gates import chunk_local_cumsum
from ..reference import state_grads
from ..testing import check_close, nan_poisoned_empty
from ..testing import state_tolerance


# ---- 1. where the backward stores ---------------------------------------------------------------

def store_slot(i_t: int, NT: int, chunks_per_split: int) -> int | None:
    """The shipped solution: store when the chunk closes its split (or the sequence)."""
    if i_t % chunks_per_split == chunks_per_split - 1 or i_t == NT - 1:
        return i_t // chunks_per_split
    return None


def _expected_slots(T: int, BT: int, BS: int) -> dict[int, int]:
    """From the definition: dh[m] is the gradient leaving split m, i.e. after its last token."""
    out = {}
    for m in range(math.ceil(T / BS)):
        last_token = min((m + 1) * BS, T) - 1
        out[last_token // BT] = m  # the chunk holding that token is the one that stores
    return out


def check_store_slot(fn=None) -> None:
    """Test ``fn(i_t, NT, chunks_per_split)`` (default: the shipped solution) on many sequence
    lengths, chunk and split sizes (ragged last chunks and splits, one-chunk sequences, and a
    split holding every chunk): each chunk must store in exactly the slot the definition gives.

    Raises ``AssertionError`` naming the case; an exception raised inside ``fn`` (such as
    ``NotImplementedError``) propagates unchanged.
    """
    fn = store_slot if fn is None else fn
    name = getattr(fn, "__name__", "your function")
    cases = [(T, BT, m * BT) for BT in (16, 64) for m in (1, 2, 3, 4)
             for T in (1, BT - 1, BT, BT + 1, 2 * BT, 5 * BT + 7, 8 * BT, random.randint(1, 12 * BT))]
    for T, BT, BS in cases:
        NT, cps = -(-T // BT), BS // BT
        want = _expected_slots(T, BT, BS)
        for i_t in range(NT - 1, -1, -1):
            got = fn(i_t, NT, cps)
            if got != want.get(i_t):
                raise AssertionError(f"{name}: T={T}, BT={BT}, BS={BS} (NT={NT}, {cps} chunks per split): "
                                     f"chunk {i_t} should store in slot {want.get(i_t)}, got {got}")
    print(f"{name} stores every split's gradient at its last chunk on {len(cases)} cases")


# ---- 2. a tiled backward kernel with the value-side gate ------------------------------------------

@triton.jit(do_not_specialize=["T", "scale"])
def gv_dh_kernel(
    q,  # [B, T, H, K]
    do,  # [B, T, H, V]
    gv,  # [B, T, H, V] chunk-local cumsum, log2
    dh,  # [B, NT, H, K, V]  out: gradient w.r.t. the state leaving each chunk
    scale,
    T,
    H: tl.constexpr,
    K: tl.constexpr,
    V: tl.constexpr,
    BT: tl.constexpr,
    BK: tl.constexpr,
    BV: tl.constexpr,
):
    NK: tl.constexpr = (K + BK - 1) // BK
    NV: tl.constexpr = (V + BV - 1) // BV
    pid = tl.program_id(0).to(tl.int64)
    i_nh = pid // (NK * NV)
    i_k, i_v = (pid // NV) % NK, pid % NV
    i_b, i_h = i_nh // H, i_nh % H  # sequence i_b (in a dense batch, batch row i_b), head i_h
    NT = tl.cdiv(T, BT)
    o_t = tl.arange(0, BT)  # [BT]
    o_k = i_k * BK + tl.arange(0, BK)  # [BK]
    o_v = i_v * BV + tl.arange(0, BV)  # [BV]
    m_k, m_v = o_k < K, o_v < V
    p_q0 = q + (i_b * T * H + i_h) * K
    p_do0 = do + (i_b * T * H + i_h) * V
    p_g0 = gv + (i_b * T * H + i_h) * V
    b_dh = tl.zeros([BK, BV], dtype=tl.float32)  # [BK, BV]
    for i_t in range(NT - 1, -1, -1):
        t0 = tl.cast(i_t, tl.int64) * BT
        p_dh = dh + ((i_b * NT + i_t) * H + i_h) * K * V
        tl.store(p_dh + o_k[:, None] * V + o_v[None, :], b_dh, mask=m_k[:, None] & m_v[None, :])
        rows = t0 + o_t  # [BT]
        m_t = rows < T
        last = tl.minimum(t0 + BT, T) - 1
        m_tv = m_t[:, None] & m_v[None, :]
        b_q = tl.load(p_q0 + rows[None, :] * (H * K) + o_k[:, None], mask=m_k[:, None] & m_t[None, :], other=0.0)
        b_do = tl.load(p_do0 + rows[:, None] * (H * V) + o_v[None, :], mask=m_tv, other=0.0)  # [BT, BV]
        b_g = tl.load(p_g0 + rows[:, None] * (H * V) + o_v[None, :], mask=m_tv, other=0.0)  # [BT, BV]
        b_g_last = tl.load(p_g0 + last * (H * V) + o_v, mask=m_v, other=0.0)  # [BV]
        b_dh *= tl.math.exp2(b_g_last)[None, :]
        b_do *= tl.where(m_tv, scale * tl.math.exp2(b_g), 0.0)
        b_dh = tl.dot(b_q, b_do, b_dh)


def gv_dh(q, do, gv, scale: float, chunk_size: int = 64, BK: int = 32, BV: int = 32) -> torch.Tensor:
    """The shipped solution: ``dh`` [B, NT, H, K, V] fp32 (see the module docstring)."""
    B, T, H, K = q.shape
    V = do.shape[-1]
    NT = triton.cdiv(T, chunk_size)
    dh = torch.empty(B, NT, H, K, V, dtype=torch.float32, device=q.device)
    grid = (triton.cdiv(K, BK) * triton.cdiv(V, BV) * B * H,)
    gv_dh_kernel[grid](q.contiguous(), do.contiguous(), gv.contiguous(), dh, float(scale), T,
                       H=H, K=K, V=V, BT=chunk_size, BK=BK, BV=BV)
    return dh


def check_gv_dh(fn=None) -> None:
    """Test ``fn(q, do, gv, scale, chunk_size, BK, BV) -> dh`` (default: the shipped solution) on
    fresh random inputs against autograd through the float64 token loop: several tiles per
    state, K and V not multiples of the tile, ragged last chunks, a one-token sequence.

    ``gv`` handed to ``fn`` is the chunk-local log2 cumsum of a mild natural-log gate; the
    reference gets the natural-log gate. Outputs are allocated NaN-filled. Raises
    ``AssertionError`` naming the shape; an exception raised inside ``fn`` propagates unchanged.
    """
    fn = gv_dh if fn is None else fn
    name = getattr(fn, "__name__", "your function")
    cases = [(1, 1, 1, 16, 16, 16, 16, 16), (2, 40, 2, 24, 40, 16, 16, 16), (1, 70, 2, 32, 20, 32, 16, 16)]
    for B, T, H, K, V, BT, BK, BV in cases:
        q = torch.randn(B, T, H, K, device=DEVICE)
        do = torch.randn(B, T, H, V, device=DEVICE)
        kv = torch.zeros(B, T, H, K, device=DEVICE), torch.zeros(B, T, H, V, device=DEVICE)  # shapes only
        gv_nat = F.logsigmoid(torch.randn(B, T, H, V, device=DEVICE) + 3)  # per token, natural log, < 0
        scale = K ** -0.5
        with nan_poisoned_empty():
            dh = fn(q, do, chunk_local_cumsum(gv_nat, BT), scale, BT, BK, BV)
        if not isinstance(dh, torch.Tensor):
            raise AssertionError(f"{name} must return a tensor dh, got {type(dh).__name__}")
        dh_ref, _ = state_grads(q, *kv, do, gv=gv_nat, scale=scale, chunk_size=BT)
        check_close(dh, dh_ref, f"{name}: dh (B={B}, T={T}, H={H}, K={K}, V={V}, BT={BT}, BK={BK}, BV={BV})",
                    tol=state_tolerance(torch.float32))
    print(f"{name} agrees with autograd through the token loop on {len(cases)} shapes")
