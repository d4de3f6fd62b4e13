"""Sequence pieces: the answer to the occupancy cliff at small batch × heads.

One program walks one (sequence, head)'s chunks serially and streams only ~30 GB/s, so with
fewer programs than the GPU's multiprocessors (B·H·tiles ≪ #SM, e.g. B1 H4 T128k) the kernel
starves however fast the memory is. The recurrence is linear in the state, so a sequence can be
cut into P pieces (each a whole number of splits) and the pieces run in parallel:

1. every piece runs the forward from a zero state: its final state ``F_p`` and its total decay
   ``D_p`` (log2, key side [K] and value side [V]) — no states stored;
2. a short scan per (sequence, head) hands each piece its true initial state:
   ``S_0 = h0``, ``S_{p+1} = D_p ⊙ S_p + F_p`` (``D_p`` acting as diagonals on both sides);
   the last one is ``ht``;
3. every piece runs the forward again from ``S_p``, storing its states where the unsplit run
   would have stored them (pieces are whole splits, so the state slots line up).

It reads k and v twice (1.5× the unsplit bytes), so it pays only below about one wave of
programs; ``auto_pieces`` decides, and ``chunk_fwd_h(..., pieces=P)`` lets the caller choose
(``pieces=1``: never split). The backward runs the same three steps in reverse time.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from . import _host, _tuning
from .env import INTERPRET
from .forward import _load_state, _program_tile, _store_state

MIN_PIECE_TOKENS = 2048  # shorter pieces do too little work to repay the extra pass
WAVES = 2  # auto_pieces aims at this many waves of programs


def auto_pieces(N: int, H: int, K: int, V: int, max_len: int, BS: int) -> int:
    """How many pieces to cut each sequence into: 1 unless programs (64×64 tiles) fill under
    half the SMs and sequences are long; then enough pieces for about two waves."""
    if INTERPRET:
        return 1
    programs = N * H * _host.cdiv(K, 64) * _host.cdiv(V, 64)
    sms = _tuning.sm_count()
    if programs == 0 or programs >= sms // 2:
        return 1
    most = max_len // max(MIN_PIECE_TOKENS, BS)
    return max(1, min(_host.cdiv(WAVES * sms, programs), most))


def choose(pieces, N: int, H: int, K: int, V: int, lengths: list[int], BS: int) -> int:
    """Validate the caller's ``pieces`` (None: ``auto_pieces``) and return the count to use."""
    if pieces is None:
        return auto_pieces(N, H, K, V, max(lengths, default=0), BS)
    if isinstance(pieces, bool) or not isinstance(pieces, int) or pieces < 1:
        raise ValueError(f"pieces must be None or a positive int, got {pieces!r}")
    return pieces


def plan(lengths: list[int], BS: int, pieces: int) -> tuple[list[int], list[int]]:
    """Cut each sequence into pieces of a common length (a multiple of BS).

    Returns ``cu_pieces`` (offsets of all pieces packed along T, [NP + 1]) and ``seq_pieces``
    (the first piece of each sequence, [N + 1]). An empty sequence owns no piece.
    """
    longest = max(lengths, default=0)
    piece_len = max(BS, _host.cdiv(_host.cdiv(longest, max(pieces, 1)), BS) * BS)
    cu_pieces, seq_pieces, pos = [0], [0], 0
    for L in lengths:
        for start in range(0, L, piece_len):
            cu_pieces.append(pos + min(start + piece_len, L))
        pos += L
        seq_pieces.append(len(cu_pieces) - 1)
    return cu_pieces, seq_pieces


@triton.jit
def piece_scan_kernel(
    F,  # [NP, H, K, V] fp32  each piece's contribution, started from zero
    decay_k,  # [NP, H, K] fp32  each piece's total key-side log2 decay
    decay_v,  # [NP, H, V] fp32  value side (USE_DECAY_V)
    s0,  # [N, H, K, V]  the state before the first piece (h0; dht in reverse)
    S,  # [NP, H, K, V] fp32 out: the state entering each piece (leaving it, in reverse)
    s_end,  # [N, H, K, V] fp32 out: after the last piece (ht; dh0 in reverse)
    seq_pieces,  # [N + 1] first piece of each sequence
    H: tl.constexpr,
    K: tl.constexpr,
    V: tl.constexpr,
    BK: tl.constexpr,
    BV: tl.constexpr,
    USE_DECAY_V: tl.constexpr,
    USE_S0: tl.constexpr,
    STORE_END: tl.constexpr,
    REVERSE: tl.constexpr,
    STATE_V_FIRST: tl.constexpr,
):
    i_nh, i_n, i_h, i_k, i_v = _program_tile(H, K, V, BK, BV)
    p_first = tl.load(seq_pieces + i_n).to(tl.int64)
    n_pieces = tl.load(seq_pieces + i_n + 1).to(tl.int32) - p_first.to(tl.int32)
    o_k = i_k * BK + tl.arange(0, BK)  # [BK]
    o_v = i_v * BV + tl.arange(0, BV)  # [BV]
    b_s = tl.zeros([BK, BV], dtype=tl.float32)  # [BK, BV]
    if USE_S0:
        b_s = _load_state(s0 + i_nh * K * V, o_k, o_v, K, V, STATE_V_FIRST)
    for j in range(0, n_pieces):
        if REVERSE:
            i_p = p_first + n_pieces - 1 - tl.cast(j, tl.int64)
        else:
            i_p = p_first + tl.cast(j, tl.int64)
        o_p = i_p * H + i_h
        _store_state(S + o_p * K * V, b_s, o_k, o_v, K, V, STATE_V_FIRST)
        b_s *= tl.math.exp2(tl.load(decay_k + o_p * K + o_k, mask=o_k < K, other=0.0))[:, None]
        if USE_DECAY_V:
            b_s *= tl.math.exp2(tl.load(decay_v + o_p * V + o_v, mask=o_v < V, other=0.0))[None, :]
        b_s += _load_state(F + o_p * K * V, o_k, o_v, K, V, STATE_V_FIRST)
    if STORE_END:
        _store_state(s_end + i_nh * K * V, b_s, o_k, o_v, K, V, STATE_V_FIRST)


def scan(F, decay_k, decay_v, s0, s_end, seq_pieces, N, H, K, V, reverse, state_v_first):
    """Run ``piece_scan_kernel``: returns S [NP, H, K, V] fp32 (layout as ``F``)."""
    S = torch.empty_like(F)
    if N * H == 0:
        return S
    BK, BV = min(64, _host.next_power_of_2(K)), min(64, _host.next_power_of_2(V))
    grid = (_host.cdiv(K, BK) * _host.cdiv(V, BV) * N * H,)
    piece_scan_kernel[grid](F, decay_k, decay_v, s0, S, s_end, seq_pieces, H=H, K=K, V=V, BK=BK, BV=BV,
                            USE_DECAY_V=decay_v is not None, USE_S0=s0 is not None,
                            STORE_END=s_end is not None, REVERSE=reverse, STATE_V_FIRST=state_v_first,
                            num_warps=4)
    return S


def _packed(B: int, T: int, x):
    """A dense [B, T, ...] tensor as one packed row [1, B·T, ...] (the same memory)."""
    return None if x is None else x.reshape(1, B * T, *x.shape[2:])


def _piece_buffers(lengths, BS, pieces, H, K, V, state_v_first, use_gv, dev):
    """The piece plan on the device and the first pass's outputs: (cu_pieces, seq_pieces,
    split_offsets of the pieces, NP, F [NP, H, K, V] fp32, decay_k [NP, H, K] fp32,
    decay_v [NP, H, V] fp32 or None). The plan's tensors are cached per plan (``_host.on_device``),
    so a repeated call copies nothing to the device and waits for nothing."""
    cu_host, seq_host = plan(lengths, BS, pieces)
    cu_pieces = _host.on_device(cu_host, torch.int32, dev)
    seq_pieces = _host.on_device(seq_host, torch.int32, dev)
    _, split_offsets = _host.split_slots(_host.lengths(cu_host), BS, dev)
    NP = len(cu_host) - 1
    state = (V, K) if state_v_first else (K, V)
    F = torch.empty(NP, H, *state, dtype=torch.float32, device=dev)
    decay_k = torch.empty(NP, H, K, dtype=torch.float32, device=dev)
    decay_v = torch.empty(NP, H, V, dtype=torch.float32, device=dev) if use_gv else None
    return cu_pieces, seq_pieces, split_offsets, NP, F, decay_k, decay_v


def forward_in_pieces(k, v, h, g, g_gamma, gk, gv, h0, ht, lengths, N, BT, BS, state_v_first, pieces,
                      config=None):
    """The forward's three steps (module docstring) for sequences of the given lengths, packed
    along T (a dense batch is passed as one packed row). Fills ``h`` and ``ht`` in place."""
    from .forward import _launch_forward

    B, T, H, K = k.shape
    V = v.shape[-1]
    k, v, g, gk, gv = (_packed(B, T, x) for x in (k, v, g, gk, gv))
    cu_pieces, seq_pieces, piece_splits, NP, F, decay_k, decay_v = _piece_buffers(
        lengths, BS, pieces, H, K, V, state_v_first, gv is not None, k.device)
    # 1. each piece from zero: its contribution F_p and its total decay D_p
    _launch_forward(k, v, None, g, g_gamma, gk, gv, None, F, cu_pieces, None, NP, BT, BS,
                    state_v_first, config, decay_k=decay_k, decay_v=decay_v)
    # 2. the true state entering each piece (and ht)
    S = scan(F, decay_k, decay_v, h0, ht, seq_pieces, N, H, K, V, False, state_v_first)
    # 3. each piece again from its true initial state, storing its states in place
    _launch_forward(k, v, h.view(1, -1, *h.shape[2:]), g, g_gamma, gk, gv, S, None, cu_pieces,
                    piece_splits, NP, BT, BS, state_v_first, config)


def backward_in_pieces(q, do, dh, g, g_gamma, gk, gv, dht, dh0, scale, lengths, N, H, K, V, BT, BS,
                       state_v_first, pieces, config=None):
    """The backward's three steps, in reverse time: each piece from a zero gradient at its end
    (its contribution Q_p to the gradient entering it, and its decay D_p); a reverse scan
    ``dS_{p} = D_{p+1} ⊙ dS_{p+1} + Q_{p+1}`` from ``dht`` (the gradient leaving each piece; the
    last one is ``dh0``); each piece again from its true ``dS_p``, storing ``dh`` in place."""
    from .backward import _launch_backward

    B, T = q.shape[:2]
    q, do, g, gk, gv = (_packed(B, T, x) for x in (q, do, g, gk, gv))
    cu_pieces, seq_pieces, piece_splits, NP, Q, decay_k, decay_v = _piece_buffers(
        lengths, BS, pieces, H, K, V, state_v_first, gv is not None, q.device)
    # 1. each piece from a zero gradient at its end
    _launch_backward(q, do, None, g, g_gamma, gk, gv, None, Q, cu_pieces, None, scale, NP, H, K, V, BT, BS,
                     state_v_first, config, decay_k=decay_k, decay_v=decay_v)
    # 2. the true gradient leaving each piece (and dh0), scanning from the last piece
    dS = scan(Q, decay_k, decay_v, dht, dh0, seq_pieces, N, H, K, V, True, state_v_first)
    # 3. each piece again from its true gradient, storing dh in place
    _launch_backward(q, do, dh.view(1, -1, *dh.shape[2:]), g, g_gamma, gk, gv, dS, None, cu_pieces,
                     piece_splits, scale, NP, H, K, V, BT, BS, state_v_first, config)
