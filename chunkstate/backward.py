"""The backward kernel: the gradients of the states leaving every split, ``chunk_bwd_dh``.

The forward's recurrence is linear in the state, so its gradient runs the same scan backwards.
The output ``o_t = scale · S_tᵀ q_t`` reads the state after token t, so a chunk of BT tokens
entered with state ``h`` adds to ``h``'s gradient ``scale · (q_t ⊙ 2^{G_t}) (do_t ⊙ 2^{Gv_t})ᵀ``
per token (``G`` the gates' chunk-local cumulative sums, log2). One program owns one [BK, BV]
tile of one (sequence, KV head)'s gradient and walks that sequence's chunks from last to first,
with ``Γ = G[last valid token]``::

    if the chunk closes a split:  store dh          (gradient w.r.t. the state *leaving* the split)
    dh  ←  2^{Γ} · dh                                (back across the whole chunk's decay)
    dh  +=  scale · (q ⊙ 2^{G})ᵀ (do ⊙ 2^{Gv})       (the chunk's own outputs)

The scalar gates ``g`` / ``g_gamma`` scale q's tokens and all of ``dh``; ``gk`` scales q per key
and ``dh``'s rows; ``gv`` scales do per value and ``dh``'s columns. They compose: any combination
may be given. After the first chunk ``dh`` is the gradient w.r.t. the initial state, ``dh0``.

GQA (HQ = G·H query heads, query head j reading KV head j // G): the program of KV head h adds
the G query heads of its group each chunk, so ``dh`` has H heads and needs no atomics.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from . import _host, _tuning, _validate
from . import pieces as _pieces
from .forward import _check_tma_config, _load_state, _program_tile, _rows_descriptor, _sequence, _store_state


# ``scale`` is never specialised: an integer 1 specialised away makes Triton 3.6's ptxas
# miscompile this kernel on Hopper (fla keeps it dynamic for the same reason).
@triton.jit(do_not_specialize=["T", "scale", "GRID", "TMA_OK"])
def chunk_bwd_kernel_dh(
    q,  # [B, T, HQ, K]
    do,  # [B, T, HQ, V]  gradient of the outputs
    dh,  # [B, NS, H, K, V]  (or [.., V, K])  out: gradient w.r.t. the state leaving each split
    g,  # [B, T, H]     chunk-local cumsum, log2
    g_gamma,  # [H]     per-step decay, log2
    gk,  # [B, T, H, K] chunk-local cumsum, log2
    gv,  # [B, T, H, V] chunk-local cumsum, log2
    dht,  # [N, H, K, V] (or [.., V, K])      gradient w.r.t. the final state
    dh0,  # [N, H, K, V] (or [.., V, K])      out: gradient w.r.t. the initial state, fp32
    cu_seqlens,  # [N + 1] packed-batch offsets
    split_offsets,  # [N + 1] first split slot of each packed sequence
    decay_k,  # [N, H, K] out: each sequence's total key-side log2 decay (STORE_DECAY)
    decay_v,  # [N, H, V] out: each sequence's total value-side log2 decay (STORE_DECAY and USE_GV)
    scale,
    T,
    GRID,  # autotune key only, never specialised: N·H relative to the SM count (see _tuning)
    TMA_OK,  # autotune key only: 1 when q, do, gk, gv can be read through TMA descriptors
    H: tl.constexpr,
    NG: tl.constexpr,  # G: query heads per KV head (HQ = NG·H)
    K: tl.constexpr,
    V: tl.constexpr,
    BT: tl.constexpr,
    BS: tl.constexpr,
    BK: tl.constexpr,
    BV: tl.constexpr,
    USE_G: tl.constexpr,
    USE_G_GAMMA: tl.constexpr,
    USE_GK: tl.constexpr,
    USE_GV: tl.constexpr,
    USE_FINAL_STATE_GRADIENT: tl.constexpr,
    STORE_INITIAL_STATE_GRADIENT: tl.constexpr,
    IS_VARLEN: tl.constexpr,
    STATE_V_FIRST: tl.constexpr,
    STORE_STATES: tl.constexpr = True,  # False: only dh0 (and decays) — the pieces' first pass
    STORE_DECAY: tl.constexpr = False,
    USE_TMA: tl.constexpr = False,  # load q, do, gk, gv through TMA descriptors (a config choice)
):
    HQ: tl.constexpr = H * NG
    i_nh, i_n, i_h, i_k, i_v = _program_tile(H, K, V, BK, BV)  # a tile of one (sequence, KV head)
    bos, T, boh = _sequence(i_n, T, cu_seqlens, split_offsets, BS, IS_VARLEN, STORE_STATES)
    NT = tl.cdiv(T, BT)
    CHUNKS_PER_SPLIT: tl.constexpr = BS // BT

    o_t = tl.arange(0, BT)  # [BT]
    o_k = i_k * BK + tl.arange(0, BK)  # [BK]
    o_v = i_v * BV + tl.arange(0, BV)  # [BV]
    m_k = o_k < K
    m_v = o_v < V
    # Base pointers of the group's first query head: token t of query head i_h·NG + j is at
    # p_q0 + t·HQ·K + j·K.
    p_q0 = q + (bos * HQ + i_h * NG) * K
    p_do0 = do + (bos * HQ + i_h * NG) * V
    if USE_TMA:
        d_q = _rows_descriptor(q, bos, T, HQ, K, BT, BK)
        d_do = _rows_descriptor(do, bos, T, HQ, V, BT, BV)
        if USE_GK:
            d_gk = _rows_descriptor(gk, bos, T, H, K, BT, BK)
        if USE_GV:
            d_gv = _rows_descriptor(gv, bos, T, H, V, BT, BV)
        i_h32 = i_h.to(tl.int32)  # descriptor coordinates are int32

    b_dh = tl.zeros([BK, BV], dtype=tl.float32)  # [BK, BV]
    if USE_FINAL_STATE_GRADIENT:
        b_dh = _load_state(dht + i_nh * K * V, o_k, o_v, K, V, STATE_V_FIRST)
    if USE_G_GAMMA:
        b_gamma = tl.load(g_gamma + i_h).to(tl.float32)
    if STORE_DECAY:
        b_dk = tl.zeros([BK], dtype=tl.float32)  # [BK] running sum of the chunks' Γ, key side
        b_dv = tl.zeros([BV], dtype=tl.float32)  # [BV] value side

    for i_t in range(NT - 1, -1, -1):
        t0 = tl.cast(i_t, tl.int64) * BT  # first token of the chunk
        # The chunk closes a split (or the sequence): store the gradient w.r.t. the state leaving
        # it, before the chunk's own outputs are added.
        if STORE_STATES:
            if (i_t % CHUNKS_PER_SPLIT == CHUNKS_PER_SPLIT - 1) | (i_t == NT - 1):
                i_s = boh + i_t // CHUNKS_PER_SPLIT
                _store_state(dh + (i_s * H + i_h) * K * V, b_dh, o_k, o_v, K, V, STATE_V_FIRST)
        rows = t0 + o_t  # [BT] token index inside the sequence
        m_t = rows < T
        last = tl.minimum(t0 + BT, T) - 1  # last valid token of the chunk

        # Decay dh back across the chunk; collect each query token's log2 factor on the way.
        b_gq = tl.zeros([BT], dtype=tl.float32)  # [BT] scalar gates' G_i
        if USE_G:
            b_g = tl.load(g + (bos + rows) * H + i_h, mask=m_t, other=0.0).to(tl.float32)  # [BT]
            b_g_last = tl.load(g + (bos + last) * H + i_h).to(tl.float32)
            b_dh *= tl.math.exp2(b_g_last)
            b_gq += b_g
            if STORE_DECAY:
                b_dk += b_g_last
        if USE_G_GAMMA:  # constant gate: G_i = γ·(i+1), Γ = γ·(valid length)
            b_dh *= tl.math.exp2(b_gamma * (last - t0 + 1).to(tl.float32))
            b_gq += b_gamma * (o_t + 1).to(tl.float32)
            if STORE_DECAY:
                b_dk += b_gamma * (last - t0 + 1).to(tl.float32)
        # q's factor scale·2^{G}: [BK, BT] like q's pointer tile, or [BT, BK] like its TMA box (q
        # is transposed after the product there, which needs one shared-memory buffer less than
        # transposing q and gk first). Rows past T are 0 with pointers; TMA zero-fills q there.
        if USE_GK:  # key-side gate: q per key, rows of dh
            p_gk0 = gk + (bos * H + i_h) * K
            if USE_TMA:
                b_gk = d_gk.load([i_t * BT, i_h32, i_k * BK]).reshape(BT, BK).to(tl.float32)  # [BT, BK]
                b_qf = scale * tl.math.exp2(b_gk + b_gq[:, None])  # [BT, BK]
            else:
                b_gk = tl.load(p_gk0 + rows[None, :] * (H * K) + o_k[:, None], mask=m_k[:, None] & m_t[None, :],
                               other=0.0).to(tl.float32)  # [BK, BT]
                b_qf = tl.where(m_t[None, :], scale * tl.math.exp2(b_gk + b_gq[None, :]), 0.0)  # [BK, BT]
            b_gk_last = tl.load(p_gk0 + last * (H * K) + o_k, mask=m_k, other=0.0).to(tl.float32)  # [BK]
            b_dh *= tl.math.exp2(b_gk_last)[:, None]
            if STORE_DECAY:
                b_dk += b_gk_last
        elif USE_TMA:
            b_qf = (scale * tl.math.exp2(b_gq))[:, None]  # [BT, 1]
        else:
            b_qf = tl.where(m_t, scale * tl.math.exp2(b_gq), 0.0)[None, :]  # [1, BT]
        if USE_GV:  # value-side gate: do per value, columns of dh
            p_gv0 = gv + (bos * H + i_h) * V
            if USE_TMA:
                b_gv = d_gv.load([i_t * BT, i_h32, i_v * BV]).reshape(BT, BV).to(tl.float32)
            else:
                b_gv = tl.load(p_gv0 + rows[:, None] * (H * V) + o_v[None, :], mask=m_t[:, None] & m_v[None, :],
                               other=0.0).to(tl.float32)  # [BT, BV]
            b_gv_last = tl.load(p_gv0 + last * (H * V) + o_v, mask=m_v, other=0.0).to(tl.float32)  # [BV]
            b_dh *= tl.math.exp2(b_gv_last)[None, :]
            if STORE_DECAY:
                b_dv += b_gv_last
            b_dof = tl.where(m_t[:, None], tl.math.exp2(b_gv), 0.0)  # [BT, BV]

        # The chunk's outputs, summed over the G query heads that read this KV head. A loop, not
        # tl.static_range: the software pipeliner multi-buffers every unrolled head's tiles (fp32
        # with G = 8 then needs 320 KB of shared memory at BK = BV = 64, over an H200's 227 KB).
        for i_g in range(NG):
            # q is used transposed, [BK, BT], so each head's update is one [BK, BT] @ [BT, BV] dot.
            if USE_TMA:
                b_q = d_q.load([i_t * BT, i_h32 * NG + i_g, i_k * BK]).reshape(BT, BK)  # [BT, BK]
                b_q = tl.trans((b_q.to(tl.float32) * b_qf).to(q.dtype.element_ty))  # [BK, BT]
                b_do = d_do.load([i_t * BT, i_h32 * NG + i_g, i_v * BV]).reshape(BT, BV)  # [BT, BV]
            else:
                b_q = tl.load(p_q0 + i_g * K + rows[None, :] * (HQ * K) + o_k[:, None],
                              mask=m_k[:, None] & m_t[None, :], other=0.0)  # [BK, BT]
                b_q = (b_q.to(tl.float32) * b_qf).to(q.dtype.element_ty)
                b_do = tl.load(p_do0 + i_g * V + rows[:, None] * (HQ * V) + o_v[None, :],
                               mask=m_t[:, None] & m_v[None, :], other=0.0)  # [BT, BV]
            if USE_GV:
                b_do = (b_do.to(tl.float32) * b_dof).to(q.dtype.element_ty)
            # [BK, BT] @ [BT, BV] in the inputs' dtype, accumulated in fp32
            b_dh = tl.dot(b_q, b_do, b_dh)

    if STORE_INITIAL_STATE_GRADIENT:
        _store_state(dh0 + i_nh * K * V, b_dh, o_k, o_v, K, V, STATE_V_FIRST)
    if STORE_DECAY:  # one writer per element: the tiles of the first column (row) of tiles
        if i_v == 0:
            tl.store(decay_k + i_nh * K + o_k, b_dk, mask=m_k)
        if USE_GV and i_k == 0:
            tl.store(decay_v + i_nh * V + o_v, b_dv, mask=m_v)


def _launch_backward(q, do, dh, g, g_gamma, gk, gv, dht, dh0, cu_seqlens, split_offsets, scale, N, H, K, V,
                     BT, BS, state_v_first, config=None, decay_k=None, decay_v=None):
    """Launch ``chunk_bwd_kernel_dh``: autotuned, or with one explicit ``triton.Config``.

    ``dh`` None: store no gradients (only ``dh0`` and, given ``decay_k``, each sequence's total decay)."""
    B, T, HQ, _ = q.shape
    if N * H * K * V == 0:
        return
    tma_ok = _tuning.tma_usable(q, do, gk, gv)
    _check_tma_config(config, tma_ok, "q, do, gk, gv")
    if tma_ok and q.is_cuda:
        _tuning.ensure_allocator()
    args = dict(q=q, do=do, dh=dh, g=g, g_gamma=g_gamma, gk=gk, gv=gv, dht=dht, dh0=dh0,
                cu_seqlens=cu_seqlens, split_offsets=split_offsets, decay_k=decay_k, decay_v=decay_v,
                scale=scale, T=T, H=H, NG=HQ // H,
                K=K, V=V, BT=BT, BS=BS, GRID=_tuning.grid_bucket(N * H), TMA_OK=int(tma_ok),
                USE_G=g is not None, USE_G_GAMMA=g_gamma is not None, USE_GK=gk is not None,
                USE_GV=gv is not None, USE_FINAL_STATE_GRADIENT=dht is not None,
                STORE_INITIAL_STATE_GRADIENT=dh0 is not None, IS_VARLEN=cu_seqlens is not None,
                STATE_V_FIRST=state_v_first, STORE_STATES=dh is not None, STORE_DECAY=decay_k is not None)

    def grid(meta):
        return (_host.cdiv(K, meta["BK"]) * _host.cdiv(V, meta["BV"]) * N * H,)

    if config is None:
        _tuned_backward[grid](**args)
    else:
        chunk_bwd_kernel_dh[grid](**args, **config.kwargs, num_warps=config.num_warps,
                                  num_stages=config.num_stages)


_tuned_backward = triton.autotune(
    configs=_tuning.CONFIGS,
    key=["K", "V", "NG", "BT", "BS", "GRID", "TMA_OK", "USE_G", "USE_G_GAMMA", "USE_GK", "USE_GV", "STATE_V_FIRST",
         "USE_FINAL_STATE_GRADIENT", "STORE_INITIAL_STATE_GRADIENT", "IS_VARLEN", "STORE_STATES", "STORE_DECAY"],
    prune_configs_by={"early_config_prune": _tuning.Pruner(chunk_bwd_kernel_dh)},
    do_bench=_tuning.autotune_timing,
)(chunk_bwd_kernel_dh)


def chunk_bwd_dh(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    do: torch.Tensor,
    h0: torch.Tensor | None,
    dht: torch.Tensor | None,
    scale: float,
    g: torch.Tensor | None = None,
    g_gamma: torch.Tensor | None = None,
    gk: torch.Tensor | None = None,
    gv: torch.Tensor | None = None,
    state_v_first: bool = False,
    cu_seqlens: torch.Tensor | None = None,
    chunk_size: int = 64,
    split_size: int | None = None,
    states_in_fp32: bool = False,
    *,
    pieces: int | None = None,
    config: triton.Config | None = None,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Gradients w.r.t. the states leaving every split: a drop-in for fla-core 0.6.0's ``chunk_bwd_dh``.

    The loss is taken to be ``Σ_t ⟨o_t, do_t⟩ + ⟨ht, dht⟩`` with ``o_t = scale · S_tᵀ q_t`` the
    outputs of the forward recurrence (``chunk_fwd_h``'s docstring; S_t the state after token t).

    Args:
        q: [B, T, HQ, K] queries; HQ = G·H (GQA: query head j reads KV head j // G).
        k: [B, T, H, K], v: [B, T, H, V]: read for their shapes and dtype only (q, do, k, v share
            one float dtype; fp16/bf16/fp32).
        do: [B, T, HQ, V] gradient of the outputs.
        h0: initial states [N, H, K, V] ([N, H, V, K] with ``state_v_first``) or None: only says
            whether ``dh0`` is wanted.
        dht: [N, H, K, V] ([N, H, V, K]) gradient w.r.t. the final states (any float dtype), or None.
        scale: the outputs' scale (a real number, usually K ** -0.5).
        g: [B, T, H] scalar gate, gk: [B, T, H, K] key gate, gv: [B, T, H, V] value gate — each the
            *chunk-local inclusive cumulative sum in log2 units* of natural-log per-token gates
            (``gates.chunk_local_cumsum(gate, chunk_size, cu_seqlens)``); any combination.
        g_gamma: [H] constant per-step decay in log2 units (``RCP_LN2 * natural``).
        state_v_first: store ``dh`` / ``dh0`` and read ``dht`` as [V, K] instead of [K, V].
        cu_seqlens: [N + 1] int offsets of sequences packed along T (then B must be 1).
        chunk_size: BT, a power of two in [16, 256] (the gates' cumsum must use the same).
        split_size: BS, a multiple of BT (default BT): one gradient is stored per BS tokens.
        states_in_fp32: store ``dh`` in fp32 instead of k's dtype.
        pieces: cut each sequence into this many pieces run in parallel (``chunkstate.pieces``);
            None (default) decides from the occupancy (only far below one wave of programs),
            1 never splits. The result is the same up to rounding.
        config: run one explicit ``triton.Config`` (BK, BV, warps, stages, and ``USE_TMA``: load the
            tiles through TMA descriptors, ValueError where the inputs do not allow it) instead of
            autotuning.
    Returns:
        dh: [B, NS, H, K, V], ``dh[:, s]`` the gradient w.r.t. the state *leaving* split s (after
            its last token), counting the outputs after split s and ``dht``; summed over the G
            query heads of each KV head (NS = ceil(T / BS); packed: [1, Σ_n ceil(L_n / BS), H, K, V]).
            With ``split_size`` = ``chunk_size`` this is fla's ``dh``.
        dh0: [N, H, K, V] fp32 gradient w.r.t. ``h0`` (= ``dht``, or 0, for an empty sequence), or
            None when ``h0`` is None.
    Raises:
        TypeError / ValueError naming the argument for wrong types, shapes, heads, devices, sizes,
        offsets or a non-real ``scale``.
    """
    q = _validate.tensor("q", q)
    if q.dim() != 4:
        raise ValueError(f"q must have shape [B, T, HQ, K], got {list(q.shape)}")
    B, T, HQ, K = q.shape
    k = _validate.tensor("k", k, (B, T, None, K), like=q)
    H = k.shape[2]
    if (H == 0 and HQ != 0) or (H > 0 and (HQ == 0 or HQ % H)):
        raise ValueError(f"q must have a positive multiple of k's H={H} heads (GQA: HQ = G·H), got HQ={HQ}")
    v = _validate.tensor("v", v, (B, T, H, None), like=q)
    V = v.shape[-1]
    do = _validate.tensor("do", do, (B, T, HQ, V), like=q)
    for name, x in (("k", k), ("v", v), ("do", do)):
        if x.dtype != q.dtype:
            raise TypeError(f"{name} must have q's dtype {q.dtype}, got {x.dtype}")
    _validate.kernel_input("q", q)
    scale = _validate.real("scale", scale)
    BT, BS = _validate.sizes(chunk_size, split_size)
    g, g_gamma, gk, gv = _validate.gates(B, T, H, K, V, g, g_gamma, gk, gv, like=q)
    cu_seqlens, N = _validate.cu_seqlens(cu_seqlens, B, T, like=q)
    state = (V, K) if state_v_first else (K, V)
    if h0 is not None:
        h0 = _validate.tensor("h0", h0, (N, H, *state), like=q)
    if dht is not None:
        dht = _validate.tensor("dht", dht, (N, H, *state), like=q)

    # host offsets are cached per tensor: a repeated packed call waits for nothing on the device
    lengths, NS, split_offsets = _host.splits(cu_seqlens, B, T, BS, q.device)
    dh = torch.empty(B, NS, H, *state, dtype=torch.float32 if states_in_fp32 else k.dtype, device=q.device)
    dh0 = torch.empty(N, H, *state, dtype=torch.float32, device=q.device) if h0 is not None else None
    P = _pieces.choose(pieces, N, H, K, V, lengths, BS)
    if P > 1:
        _pieces.backward_in_pieces(q, do, dh, g, g_gamma, gk, gv, dht, dh0, scale, lengths, N, H, K, V,
                                   BT, BS, state_v_first, P, config)
    else:
        _launch_backward(q, do, dh, g, g_gamma, gk, gv, dht, dh0, cu_seqlens, split_offsets, scale, N, H, K, V,
                         BT, BS, state_v_first, config)
    return dh, dh0
