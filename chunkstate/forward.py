"""The forward kernel: the states entering every split of every sequence, ``chunk_fwd_h``.

One program owns one [BK, BV] tile of one (sequence, head)'s state and walks that sequence's
chunks in order. Per chunk of BT tokens, with the gates' chunk-local cumulative sums ``G`` (log2)
and ``Γ = G[last valid token]``::

    if the chunk starts a split:  store h          (the state *entering* the split)
    h  ←  2^{Γ} · h                                 (decay across the whole chunk)
    h  +=  (k ⊙ 2^{Γ−G})ᵀ (v ⊙ 2^{Γ−G})            (the chunk's tokens, each decayed to the end)

The scalar gates ``g`` / ``g_gamma`` scale v's rows; ``gk`` scales k (key side) and ``h``'s rows;
``gv`` scales v's columns and ``h``'s columns. They compose: any combination may be given.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from . import _host, _tuning, _validate


@triton.jit
def _store_state(p, b, o_k, o_v, K: tl.constexpr, V: tl.constexpr, STATE_V_FIRST: tl.constexpr):
    """Store a [BK, BV] tile at base ``p`` of a [K, V] state (or [V, K] with STATE_V_FIRST)."""
    m = (o_k[:, None] < K) & (o_v[None, :] < V)
    if STATE_V_FIRST:
        tl.store(p + o_v[None, :] * K + o_k[:, None], b.to(p.dtype.element_ty), mask=m)
    else:
        tl.store(p + o_k[:, None] * V + o_v[None, :], b.to(p.dtype.element_ty), mask=m)


@triton.jit
def _load_state(p, o_k, o_v, K: tl.constexpr, V: tl.constexpr, STATE_V_FIRST: tl.constexpr):
    """Load a [BK, BV] fp32 tile from base ``p`` of a [K, V] (or [V, K]) state."""
    m = (o_k[:, None] < K) & (o_v[None, :] < V)
    if STATE_V_FIRST:
        b = tl.load(p + o_v[None, :] * K + o_k[:, None], mask=m, other=0.0)
    else:
        b = tl.load(p + o_k[:, None] * V + o_v[None, :], mask=m, other=0.0)
    return b.to(tl.float32)


@triton.jit
def _program_tile(H: tl.constexpr, K: tl.constexpr, V: tl.constexpr, BK: tl.constexpr, BV: tl.constexpr):
    """Which [BK, BV] tile of which (sequence, head) this program owns, from a flat 1-D grid (no
    65,535 limit): the tiles of one head are neighbours, so they share k, v (q, do) in L2.
    Returns (i_nh, i_n, i_h) as int64 and (i_k, i_v) as int32."""
    NK: tl.constexpr = (K + BK - 1) // BK
    NV: tl.constexpr = (V + BV - 1) // BV
    pid = tl.program_id(0).to(tl.int64)
    i_nh = pid // (NK * NV)
    i_k = ((pid // NV) % NK).to(tl.int32)
    i_v = (pid % NV).to(tl.int32)
    return i_nh, i_nh // H, i_nh % H, i_k, i_v


@triton.jit
def _sequence(i_n, T, cu_seqlens, split_offsets, BS: tl.constexpr, IS_VARLEN: tl.constexpr,
              STORE_STATES: tl.constexpr):
    """Sequence i_n's first token ``bos`` (int64), its length, and its first split slot ``boh``."""
    if IS_VARLEN:
        bos = tl.load(cu_seqlens + i_n).to(tl.int64)
        T = (tl.load(cu_seqlens + i_n + 1).to(tl.int64) - bos).to(tl.int32)
        boh = bos * 0  # an int64 like the other branch's; only read when states are stored
        if STORE_STATES:
            boh = tl.load(split_offsets + i_n).to(tl.int64)
    else:
        bos = i_n * T
        boh = i_n * tl.cdiv(T, BS)
    return bos, T, boh


@triton.jit
def _rows_descriptor(x, bos, T, H: tl.constexpr, D: tl.constexpr, BT: tl.constexpr, BD: tl.constexpr):
    """A TMA descriptor over one sequence's rows of x [.., T, H, D] (from token ``bos``), read in
    [BT, 1, BD] boxes: tokens at or past T and columns at or past D arrive as zeros, so a chunk
    needs no masks and never reads the next sequence."""
    # an empty sequence loads nothing, but its descriptor still needs a non-zero extent
    return tl.make_tensor_descriptor(x + bos * H * D, shape=[tl.maximum(T, 1), H, D], strides=[H * D, D, 1],
                                     block_shape=[BT, 1, BD])


@triton.jit(do_not_specialize=["T", "GRID", "TMA_OK"])
def chunk_fwd_kernel_h(
    k,  # [B, T, H, K]
    v,  # [B, T, H, V]
    h,  # [B, NS, H, K, V]  (or [.., V, K])   out: state entering each split
    g,  # [B, T, H]     chunk-local cumsum, log2
    g_gamma,  # [H]     per-step decay, log2
    gk,  # [B, T, H, K] chunk-local cumsum, log2
    gv,  # [B, T, H, V] chunk-local cumsum, log2
    h0,  # [N, H, K, V] (or [.., V, K])
    ht,  # [N, H, K, V] (or [.., V, K])       out: final state, fp32
    cu_seqlens,  # [N + 1] packed-batch offsets
    split_offsets,  # [N + 1] first split slot of each packed sequence
    decay_k,  # [N, H, K] out: each sequence's total key-side log2 decay (STORE_DECAY)
    decay_v,  # [N, H, V] out: each sequence's total value-side log2 decay (STORE_DECAY and USE_GV)
    T,
    GRID,  # autotune key only, never specialised: N·H relative to the SM count (see _tuning)
    TMA_OK,  # autotune key only: 1 when k, v, gk, gv can be read through TMA descriptors
    H: tl.constexpr,
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
    USE_INITIAL_STATE: tl.constexpr,
    STORE_FINAL_STATE: tl.constexpr,
    IS_VARLEN: tl.constexpr,
    STATE_V_FIRST: tl.constexpr,
    STORE_STATES: tl.constexpr = True,  # False: only ht (and decays) — the pieces' first pass
    STORE_DECAY: tl.constexpr = False,
    USE_TMA: tl.constexpr = False,  # load k, v, gk, gv through TMA descriptors (a config choice)
    NARROW_V: tl.constexpr = False,  # scale v by g in v's own dtype (g alone; see _tuning.narrow_v)
):
    tl.static_assert(not NARROW_V or (USE_G and not USE_G_GAMMA and not USE_GV), "NARROW_V is for the gate g alone")
    i_nh, i_n, i_h, i_k, i_v = _program_tile(H, K, V, BK, BV)
    bos, T, boh = _sequence(i_n, T, cu_seqlens, split_offsets, BS, IS_VARLEN, STORE_STATES)
    NT = tl.cdiv(T, BT)
    CHUNKS_PER_SPLIT: tl.constexpr = BS // BT
    if USE_TMA:
        d_k = _rows_descriptor(k, bos, T, H, K, BT, BK)
        d_v = _rows_descriptor(v, bos, T, H, V, BT, BV)
        if USE_GK:
            d_gk = _rows_descriptor(gk, bos, T, H, K, BT, BK)
        if USE_GV:
            d_gv = _rows_descriptor(gv, bos, T, H, V, BT, BV)
        i_h32 = i_h.to(tl.int32)  # descriptor coordinates are int32

    o_t = tl.arange(0, BT)  # [BT]
    o_k = i_k * BK + tl.arange(0, BK)  # [BK]
    o_v = i_v * BV + tl.arange(0, BV)  # [BV]
    m_k = o_k < K
    m_v = o_v < V
    # Base pointers of this (sequence, head): token t of k is at p_k0 + t·H·K.
    p_k0 = k + (bos * H + i_h) * K
    p_v0 = v + (bos * H + i_h) * V

    b_h = tl.zeros([BK, BV], dtype=tl.float32)  # [BK, BV]
    if USE_INITIAL_STATE:
        b_h = _load_state(h0 + i_nh * K * V, o_k, o_v, K, V, STATE_V_FIRST)
    if USE_G_GAMMA:
        b_gamma = tl.load(g_gamma + i_h).to(tl.float32)
    if STORE_DECAY:
        b_dk = tl.zeros([BK], dtype=tl.float32)  # [BK] running sum of the chunks' Γ, key side
        b_dv = tl.zeros([BV], dtype=tl.float32)  # [BV] value side

    for i_t in range(0, NT):
        t0 = tl.cast(i_t, tl.int64) * BT  # first token of the chunk
        if STORE_STATES:
            if i_t % CHUNKS_PER_SPLIT == 0:  # the chunk opens a split: store the state entering it
                i_s = boh + i_t // CHUNKS_PER_SPLIT
                _store_state(h + (i_s * H + i_h) * K * V, b_h, o_k, o_v, K, V, STATE_V_FIRST)
        rows = t0 + o_t  # [BT] token index inside the sequence
        m_t = rows < T
        last = tl.minimum(t0 + BT, T) - 1  # last valid token of the chunk
        # k is used transposed, [BK, BT], so the chunk's update is one [BK, BT] @ [BT, BV] dot.
        if USE_TMA:
            b_k = tl.trans(d_k.load([i_t * BT, i_h32, i_k * BK]).reshape(BT, BK))
            b_v = d_v.load([i_t * BT, i_h32, i_v * BV]).reshape(BT, BV)
        else:
            b_k = tl.load(p_k0 + rows[None, :] * (H * K) + o_k[:, None], mask=m_k[:, None] & m_t[None, :], other=0.0)
            b_v = tl.load(p_v0 + rows[:, None] * (H * V) + o_v[None, :], mask=m_t[:, None] & m_v[None, :], other=0.0)
        if (USE_G or USE_G_GAMMA or USE_GV) and not NARROW_V:
            b_v = b_v.to(tl.float32)
        if USE_GK:
            b_k = b_k.to(tl.float32)

        if USE_G:  # scalar gate: rows of v, and all of h
            b_g = tl.load(g + (bos + rows) * H + i_h, mask=m_t, other=0.0).to(tl.float32)  # [BT]
            b_g_last = tl.load(g + (bos + last) * H + i_h).to(tl.float32)
            b_h *= tl.math.exp2(b_g_last)
            if NARROW_V:  # as fla does: the product rounded to v's dtype at once, rows past T left as
                # 0 · 2^{Γ} (finite whenever 2^{Γ} is; where it is not, h above is already inf)
                b_v = (b_v * tl.math.exp2(b_g_last - b_g)[:, None]).to(k.dtype.element_ty)
            else:
                b_v *= tl.where(m_t, tl.math.exp2(b_g_last - b_g), 0.0)[:, None]
            if STORE_DECAY:
                b_dk += b_g_last
        if USE_G_GAMMA:  # constant gate: G_i = γ·(i+1), Γ = γ·(valid length)
            b_gg = b_gamma * (o_t + 1).to(tl.float32)  # [BT]
            b_gg_last = b_gamma * (last - t0 + 1).to(tl.float32)
            b_h *= tl.math.exp2(b_gg_last)
            b_v *= tl.where(m_t, tl.math.exp2(b_gg_last - b_gg), 0.0)[:, None]
            if STORE_DECAY:
                b_dk += b_gg_last
        if USE_GK:  # key-side gate: columns of kᵀ, rows of h
            p_gk0 = gk + (bos * H + i_h) * K
            if USE_TMA:
                b_gk = tl.trans(d_gk.load([i_t * BT, i_h32, i_k * BK]).reshape(BT, BK)).to(tl.float32)
            else:
                b_gk = tl.load(p_gk0 + rows[None, :] * (H * K) + o_k[:, None], mask=m_k[:, None] & m_t[None, :],
                               other=0.0).to(tl.float32)  # [BK, BT]
            b_gk_last = tl.load(p_gk0 + last * (H * K) + o_k, mask=m_k, other=0.0).to(tl.float32)  # [BK]
            b_h *= tl.math.exp2(b_gk_last)[:, None]
            b_k *= tl.where(m_t[None, :], tl.math.exp2(b_gk_last[:, None] - b_gk), 0.0)
            if STORE_DECAY:
                b_dk += b_gk_last
        if USE_GV:  # value-side gate: columns of v and of h
            p_gv0 = gv + (bos * H + i_h) * V
            if USE_TMA:
                b_gv = d_gv.load([i_t * BT, i_h32, i_v * BV]).reshape(BT, BV).to(tl.float32)
            else:
                b_gv = tl.load(p_gv0 + rows[:, None] * (H * V) + o_v[None, :], mask=m_t[:, None] & m_v[None, :],
                               other=0.0).to(tl.float32)  # [BT, BV]
            b_gv_last = tl.load(p_gv0 + last * (H * V) + o_v, mask=m_v, other=0.0).to(tl.float32)  # [BV]
            b_h *= tl.math.exp2(b_gv_last)[None, :]
            b_v *= tl.where(m_t[:, None], tl.math.exp2(b_gv_last[None, :] - b_gv), 0.0)
            if STORE_DECAY:
                b_dv += b_gv_last

        # [BK, BT] @ [BT, BV] in the inputs' dtype, accumulated in fp32
        b_h = tl.dot(b_k.to(k.dtype.element_ty), b_v.to(k.dtype.element_ty), b_h)

    if STORE_FINAL_STATE:
        _store_state(ht + i_nh * K * V, b_h, o_k, o_v, K, V, STATE_V_FIRST)
    if STORE_DECAY:  # one writer per element: the tiles of the first column (row) of tiles
        if i_v == 0:
            tl.store(decay_k + i_nh * K + o_k, b_dk, mask=m_k)
        if USE_GV and i_k == 0:
            tl.store(decay_v + i_nh * V + o_v, b_dv, mask=m_v)


def _check_tma_config(config, tma_ok: bool, names: str) -> None:
    """An explicit config that asks for TMA loads on inputs that cannot have them is refused."""
    if config is not None and config.kwargs.get("USE_TMA", False) and not tma_ok:
        raise ValueError(
            f"config asks for TMA loads (USE_TMA=True), but {names} cannot be read through tensor "
            "descriptors here: that needs a GPU of compute capability 9.0 or newer (or the interpreter), "
            "Triton's tl.make_tensor_descriptor, and contiguous tensors whose start and last dimension "
            "(size x element bytes) are multiples of 16 bytes; pass a config with USE_TMA=False")


def _config_kwargs(config, g_alone: bool, narrow: bool) -> tuple[dict, bool]:
    """An explicit config's kernel keywords without ``NARROW_V``, and whether v is scaled narrow:
    the config's ``NARROW_V`` where it gives one (refused unless ``g`` is the only gate on v),
    else ``narrow`` (``_tuning.narrow_v``'s answer)."""
    kwargs = dict(config.kwargs)
    if "NARROW_V" in kwargs:
        narrow = bool(kwargs.pop("NARROW_V"))
        if narrow and not g_alone:
            raise ValueError("config asks for NARROW_V=True (v scaled by the gate g in v's own dtype), which needs "
                             "g given and neither g_gamma nor gv; pass NARROW_V=False or leave it out")
    return kwargs, narrow


def _launch_forward(k, v, h, g, g_gamma, gk, gv, h0, ht, cu_seqlens, split_offsets, N, BT, BS,
                    state_v_first, config=None, decay_k=None, decay_v=None):
    """Launch ``chunk_fwd_kernel_h``: autotuned, or with one explicit ``triton.Config``.

    ``h`` None: store no states (only ``ht`` and, given ``decay_k``, each sequence's total decay)."""
    B, T, H, K = k.shape
    V = v.shape[-1]
    if N * H == 0:
        return
    tma_ok = _tuning.tma_usable(k, v, gk, gv)
    _check_tma_config(config, tma_ok, "k, v, gk, gv")
    if tma_ok and k.is_cuda:
        _tuning.ensure_allocator()
    bucket = _tuning.grid_bucket(N * H)
    args = dict(k=k, v=v, h=h, g=g, g_gamma=g_gamma, gk=gk, gv=gv, h0=h0, ht=ht,
                cu_seqlens=cu_seqlens, split_offsets=split_offsets, decay_k=decay_k, decay_v=decay_v,
                T=T, H=H, K=K, V=V, BT=BT, BS=BS,
                GRID=bucket, TMA_OK=int(tma_ok),
                USE_G=g is not None, USE_G_GAMMA=g_gamma is not None, USE_GK=gk is not None,
                USE_GV=gv is not None, USE_INITIAL_STATE=h0 is not None, STORE_FINAL_STATE=ht is not None,
                IS_VARLEN=cu_seqlens is not None, STATE_V_FIRST=state_v_first,
                STORE_STATES=h is not None, STORE_DECAY=decay_k is not None)
    g_alone = g is not None and g_gamma is None and gv is None
    narrow = g_alone and _tuning.narrow_v(bucket)

    def grid(meta):
        return (_host.cdiv(K, meta["BK"]) * _host.cdiv(V, meta["BV"]) * N * H,)

    if config is None:
        _tuned_forward[grid](**args, NARROW_V=narrow)
    else:
        kwargs, narrow = _config_kwargs(config, g_alone, narrow)
        chunk_fwd_kernel_h[grid](**args, **kwargs, NARROW_V=narrow, num_warps=config.num_warps,
                                 num_stages=config.num_stages)


_tuned_forward = triton.autotune(
    configs=_tuning.CONFIGS,
    key=["K", "V", "BT", "BS", "GRID", "TMA_OK", "USE_G", "USE_G_GAMMA", "USE_GK", "USE_GV", "STATE_V_FIRST",
         "USE_INITIAL_STATE", "STORE_FINAL_STATE", "IS_VARLEN", "STORE_STATES", "STORE_DECAY"],
    prune_configs_by={"early_config_prune": _tuning.Pruner(chunk_fwd_kernel_h)},
    do_bench=_tuning.autotune_timing,
)(chunk_fwd_kernel_h)


def chunk_fwd_h(
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor | None = None,
    g_gamma: torch.Tensor | None = None,
    gk: torch.Tensor | None = None,
    gv: torch.Tensor | None = None,
    h0: torch.Tensor | None = None,
    output_final_state: bool = False,
    state_v_first: bool = False,
    cu_seqlens: torch.Tensor | None = None,
    chunk_size: int = 64,
    split_size: int | None = None,
    states_in_fp32: bool = False,
    *,
    pieces: int | None = None,
    config: triton.Config | None = None,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """The states entering every split: a drop-in for fla-core 0.6.0's ``chunk_fwd_h``.

    Args:
        k: [B, T, H, K] keys; v: [B, T, H, V] values (same float dtype; fp16/bf16/fp32).
        g: [B, T, H] scalar gate, gk: [B, T, H, K] key gate, gv: [B, T, H, V] value gate — each the
            *chunk-local inclusive cumulative sum in log2 units* of natural-log per-token gates
            (``gates.chunk_local_cumsum(gate, chunk_size, cu_seqlens)``); any combination.
        g_gamma: [H] constant per-step decay in log2 units (``RCP_LN2 * natural``).
        h0: [N, H, K, V] initial states (any float dtype; [N, H, V, K] with ``state_v_first``).
        output_final_state: also return ``ht``, the state after each sequence's last token.
        state_v_first: store ``h`` / read ``h0`` / write ``ht`` as [V, K] instead of [K, V].
        cu_seqlens: [N + 1] int offsets of sequences packed along T (then B must be 1).
        chunk_size: BT, a power of two in [16, 256] (the gates' cumsum must use the same).
        split_size: BS, a multiple of BT (default BT): states are stored every BS tokens.
        states_in_fp32: store ``h`` in fp32 instead of k's dtype.
        pieces: cut each sequence into this many pieces run in parallel (``chunkstate.pieces``);
            None (default) decides from the occupancy (only far below one wave of programs),
            1 never splits. The result is the same up to rounding.
        config: run one explicit ``triton.Config`` (BK, BV, warps, stages, and ``USE_TMA``: load the
            tiles through TMA descriptors, ValueError where the inputs do not allow it; ``NARROW_V``:
            scale v by ``g`` in v's own dtype or in fp32, the same numbers either way, by default
            as ``_tuning.narrow_v`` decides; ValueError unless ``g`` is the only gate on v) instead
            of autotuning.
    Returns:
        h: [B, NS, H, K, V], ``h[:, s]`` the state entering split s (NS = ceil(T / BS); packed:
            [1, Σ_n ceil(L_n / BS), H, K, V], empty sequences owning no split);
        ht: [N, H, K, V] fp32, or None unless ``output_final_state`` (= h0, or 0, for an empty sequence).
    Raises:
        TypeError / ValueError naming the argument for wrong types, shapes, heads, devices, sizes
        or offsets.
    """
    k = _validate.tensor("k", k)
    if k.dim() != 4:
        raise ValueError(f"k must have shape [B, T, H, K], got {list(k.shape)}")
    B, T, H, K = k.shape
    v = _validate.tensor("v", v, (B, T, H, None), like=k)
    V = v.shape[-1]
    if v.dtype != k.dtype:
        raise TypeError(f"v must have k's dtype {k.dtype}, got {v.dtype}")
    _validate.kernel_input("k", k)
    BT, BS = _validate.sizes(chunk_size, split_size)
    g, g_gamma, gk, gv = _validate.gates(B, T, H, K, V, g, g_gamma, gk, gv, like=k)
    cu_seqlens, N = _validate.cu_seqlens(cu_seqlens, B, T, like=k)
    state = (V, K) if state_v_first else (K, V)
    if h0 is not None:
        h0 = _validate.tensor("h0", h0, (N, H, *state), like=k)

    # host offsets are cached per tensor: a repeated packed call waits for nothing on the device
    lengths, NS, split_offsets = _host.splits(cu_seqlens, B, T, BS, k.device)
    h = torch.empty(B, NS, H, *state, dtype=torch.float32 if states_in_fp32 else k.dtype, device=k.device)
    ht = torch.empty(N, H, *state, dtype=torch.float32, device=k.device) if output_final_state else None
    P = _pieces.choose(pieces, N, H, K, V, lengths, BS)
    if P > 1:
        _pieces.forward_in_pieces(k, v, h, g, g_gamma, gk, gv, h0, ht, lengths, N, BT, BS, state_v_first, P,
                                  config)
    else:
        _launch_forward(k, v, h, g, g_gamma, gk, gv, h0, ht, cu_seqlens, split_offsets, N, BT, BS,
                        state_v_first, config)
    return h, ht


from . import pieces as _pieces  # noqa: E402  (pieces builds on this module's kernel)
