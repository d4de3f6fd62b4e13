"""Chapter 05 exercises: which program owns which tile, and a tiled kernel with the value gate.

1. ``program_id_of(i_n, i_h, i_k, i_v, H, NK, NV) -> int``: the flat program id of the program
   that owns tile (i_k, i_v) of head i_h of sequence i_n — the inverse of the chapter's decode::

       i_nh = pid // (NK·NV),  i_k = (pid // NV) % NK,  i_v = pid % NV,  i_n, i_h = divmod(i_nh, H)

2. ``gv_states(k, v, gv, chunk_size, BK, BV) -> h``: a Triton kernel (and its launcher) holding one
   [BK, BV] tile of the state per program, with the value-side gate only. Inputs: ``k``
   [B, T, H, K], ``v`` [B, T, H, V] fp32; ``gv`` [B, T, H, V] the *chunk-local cumulative sum in
   log2 units* of a natural-log gate (``gates.chunk_local_cumsum(gv, chunk_size)``); BK, BV powers
   of two >= 16 (K, V any size). Returns ``h`` [B, NT, H, K, V] (fp32), ``h[:, n]`` the state
   entering chunk n. Per chunk, with ``G_v`` the given cumsum and ``Γ_v = G_v[last valid token]``::

       h  ←  h · diag(2^{Γ_v})  +  kᵀ (v ⊙ 2^{Γ_v − G_v})
"""
from __future__ import annotations

import random

import torch
import torch.nn.functional as F
import triton
import triton.language as tl

from ..env import DEVICE
from ..gates import chunk_local_cumsum
from ..reference import chunked_states
from ..testing import check_close, nan_poisoned_empty
from ..testing import state_tolerance


# ---- 1. the flat grid -------------------------------------------------------------------------

def program_id_of(i_n: int, i_h: int, i_k: int, i_v: int, H: int, NK: int, NV: int) -> int:
    """The shipped solution: tiles of one (sequence, head) are neighbours, i_v fastest."""
    return ((i_n * H + i_h) * NK + i_k) * NV + i_v


def _decode(pid: int, H: int, NK: int, NV: int) -> tuple[int, int, int, int]:
    i_nh = pid // (NK * NV)
    return i_nh // H, i_nh % H, (pid // NV) % NK, pid % NV


def check_program_id_of(fn=None) -> None:
    """Test ``fn(i_n, i_h, i_k, i_v, H, NK, NV)`` (default: the shipped solution): for every program
    of several grids it must give the pid that the kernel's decode maps back to the same tile.

    Raises ``AssertionError`` naming the grid and tile; an exception raised inside ``fn`` (such
    as ``NotImplementedError`` from the stub) propagates unchanged.
    """
    fn = program_id_of if fn is None else fn
    name = getattr(fn, "__name__", "your function")
    grids = [(1, 1, 1, 1), (2, 3, 2, 2), (3, 2, 1, 4), (1, 5, 4, 1), (random.randint(1, 4), 3, 3, 2)]
    for N, H, NK, NV in grids:
        for pid in range(N * H * NK * NV):
            tile = _decode(pid, H, NK, NV)
            got = fn(*tile, H, NK, NV)
            if got != pid:
                raise AssertionError(f"{name}: with N={N}, H={H}, NK={NK}, NV={NV}, tile "
                                     f"(i_n, i_h, i_k, i_v)={tile} belongs to program {pid}, got {got}")
    print(f"{name} inverts the kernel's decode on {len(grids)} grids")


# ---- 2. a tiled kernel with the value-side gate ------------------------------------------------

@triton.jit
def gv_states_kernel(
    k,  # [B, T, H, K]
    v,  # [B, T, H, V]
    gv,  # [B, T, H, V] chunk-local cumsum, log2
    h,  # [B, NT, H, K, V]  out: state entering each chunk
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
    p_k0 = k + (i_b * T * H + i_h) * K
    p_v0 = v + (i_b * T * H + i_h) * V
    p_g0 = gv + (i_b * T * H + i_h) * V
    b_h = tl.zeros([BK, BV], dtype=tl.float32)  # [BK, BV]
    for i_t in range(0, NT):
        t0 = tl.cast(i_t, tl.int64) * BT
        p_h = h + ((i_b * NT + i_t) * H + i_h) * K * V
        tl.store(p_h + o_k[:, None] * V + o_v[None, :], b_h, mask=m_k[:, None] & m_v[None, :])
        rows = t0 + o_t  # [BT]
        m_t = rows < T
        last = tl.minimum(t0 + BT, T) - 1
        m_tv = m_t[:, None] & m_v[None, :]
        b_k = tl.load(p_k0 + rows[None, :] * (H * K) + o_k[:, None], mask=m_k[:, None] & m_t[None, :], other=0.0)
        b_v = tl.load(p_v0 + rows[:, None] * (H * V) + o_v[None, :], mask=m_tv, other=0.0)  # [BT, BV]
        b_g = tl.load(p_g0 + rows[:, None] * (H * V) + o_v[None, :], mask=m_tv, other=0.0)  # [BT, BV]
        b_g_last = tl.load(p_g0 + last * (H * V) + o_v, mask=m_v, other=0.0)  # [BV]
        b_h *= tl.math.exp2(b_g_last)[None, :]
        b_v *= tl.where(m_tv, tl.math.exp2(b_g_last[None, :] - b_g), 0.0)
        b_h = tl.dot(b_k, b_v, b_h)


def gv_states(k, v, gv, chunk_size: int = 64, BK: int = 32, BV: int = 32) -> torch.Tensor:
    """The shipped solution: ``h`` [B, NT, H, K, V] fp32 (see the module docstring)."""
    B, T, H, K = k.shape
    V = v.shape[-1]
    NT = triton.cdiv(T, chunk_size)
    h = torch.empty(B, NT, H, K, V, dtype=torch.float32, device=k.device)
    grid = (triton.cdiv(K, BK) * triton.cdiv(V, BV) * B * H,)
    gv_states_kernel[grid](k.contiguous(), v.contiguous(), gv.contiguous(), h, T,
                           H=H, K=K, V=V, BT=chunk_size, BK=BK, BV=BV)
    return h


def check_gv_states(fn=None) -> None:
    """Test ``fn(k, v, gv, chunk_size, BK, BV) -> h`` (default: the shipped solution) on fresh random
    inputs: several tiles per state, K and V not multiples of the tile, ragged last chunks.

    ``gv`` handed to ``fn`` is the chunk-local log2 cumsum of a natural-log gate ``logsigmoid(x)``;
    the reference gets the natural-log gate. Outputs are allocated NaN-filled. Raises
    ``AssertionError`` naming the shape; an exception raised inside ``fn`` propagates unchanged.
    """
    fn = gv_states if fn is None else fn
    name = getattr(fn, "__name__", "your function")
    cases = [(1, 1, 1, 16, 16, 16, 16, 16), (2, 40, 2, 24, 40, 16, 16, 16), (1, 70, 2, 32, 20, 32, 16, 16)]
    for B, T, H, K, V, BT, BK, BV in cases:
        k = torch.randn(B, T, H, K, device=DEVICE)
        v = torch.randn(B, T, H, V, device=DEVICE)
        gv_nat = F.logsigmoid(torch.randn(B, T, H, V, device=DEVICE))  # per-token, natural log, < 0
        with nan_poisoned_empty():
            h = fn(k, v, chunk_local_cumsum(gv_nat, BT), BT, BK, BV)
        if not isinstance(h, torch.Tensor):
            raise AssertionError(f"{name} must return a tensor h, got {type(h).__name__}")
        h_ref, _ = chunked_states(k, v, gv=gv_nat, chunk_size=BT)
        check_close(h, h_ref, f"{name}: h (B={B}, T={T}, H={H}, K={K}, V={V}, BT={BT}, BK={BK}, BV={BV})",
                    tol=state_tolerance(torch.float32))
    print(f"{name} agrees with the chunked reference on {len(cases)} shapes")
