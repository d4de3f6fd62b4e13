"""The parts both state kernels are built from, each a ``@triton.jit`` function inlined where it is
called: which tile a program owns, where its sequence lies, how a state tile is loaded and stored,
how a chunk's rows are read, what a gate does to one chunk, and where each sequence's total decay
goes.

The fast paths hide here behind one-line calls, so ``forward.py`` and ``backward.py`` read like
the chapters that derive them:

- **TMA loads** (``USE_TMA``, chapter 11): ``chunk_rows`` makes either a pointer to a sequence's
  first token or a tensor descriptor over its rows; ``load_rows`` / ``load_rows_t`` read a chunk
  through either. A descriptor's rows end at the sequence's end, so the tail of a chunk arrives
  as zeros without masks;
- **v in its own dtype** (``NARROW_V``, chapter 11): ``decay_rows``;
- **sequence pieces** (``STORE_STATES`` / ``STORE_DECAY``, chapter 11): ``store_decays``.

Notation as in the chapters: a chunk of BT tokens, gates as chunk-local cumulative sums ``G`` in
log2 units, ``Γ`` = G at the chunk's last valid token, so ``2^{Γ−G_i}`` decays token i to the end
of its chunk.
"""
from __future__ import annotations

import triton
import triton.language as tl


# ---------------------------------------------------------------------------------------------
# Which work a program owns
# ---------------------------------------------------------------------------------------------

@triton.jit
def program_tile(H: tl.constexpr, K: tl.constexpr, V: tl.constexpr, BK: tl.constexpr, BV: tl.constexpr):
    """Which [BK, BV] tile of which (sequence, head) this program owns, from a flat 1-D grid (no
    65,535 limit): the tiles of one head are neighbours, so they share k, v (q, do) in L2.
    Returns (i_nh, i_n, i_h) as int64 and (i_k, i_v) as int32."""
    return tile_of(tl.program_id(0).to(tl.int64), H, K, V, BK, BV)


@triton.jit
def tile_of(pid, H: tl.constexpr, K: tl.constexpr, V: tl.constexpr, BK: tl.constexpr, BV: tl.constexpr):
    """``program_tile`` for the int64 position ``pid`` in a flat order of tiles."""
    NK: tl.constexpr = (K + BK - 1) // BK
    NV: tl.constexpr = (V + BV - 1) // BV
    i_nh = pid // (NK * NV)
    i_k = ((pid // NV) % NK).to(tl.int32)
    i_v = (pid % NV).to(tl.int32)
    return i_nh, i_nh // H, i_nh % H, i_k, i_v


@triton.jit
def sequence_bounds(i_n, T, cu_seqlens, split_offsets, BS: tl.constexpr, IS_VARLEN: tl.constexpr,
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


# ---------------------------------------------------------------------------------------------
# State tiles
# ---------------------------------------------------------------------------------------------

@triton.jit
def load_state(p, o_k, o_v, K: tl.constexpr, V: tl.constexpr, STATE_V_FIRST: tl.constexpr):
    """Load a [BK, BV] fp32 tile from base ``p`` of a [K, V] (or [V, K]) state."""
    return load_state_cached(p, o_k, o_v, K, V, STATE_V_FIRST, "")


@triton.jit
def load_state_cached(p, o_k, o_v, K: tl.constexpr, V: tl.constexpr, STATE_V_FIRST: tl.constexpr,
                      CACHE: tl.constexpr):
    """``load_state`` with ``tl.load``'s cache modifier ``CACHE``: ".cg" reads past the
    multiprocessor's L1, for what another program published. (A separate function, not a default
    argument: Triton 3.6's compiler does not turn a callee's default string into a constexpr.)"""
    m = (o_k[:, None] < K) & (o_v[None, :] < V)
    if STATE_V_FIRST:
        b = tl.load(p + o_v[None, :] * K + o_k[:, None], mask=m, other=0.0, cache_modifier=CACHE)
    else:
        b = tl.load(p + o_k[:, None] * V + o_v[None, :], mask=m, other=0.0, cache_modifier=CACHE)
    return b.to(tl.float32)


@triton.jit
def store_state(p, b, o_k, o_v, K: tl.constexpr, V: tl.constexpr, STATE_V_FIRST: tl.constexpr):
    """Store a [BK, BV] tile at base ``p`` of a [K, V] state (or [V, K] with STATE_V_FIRST)."""
    m = (o_k[:, None] < K) & (o_v[None, :] < V)
    if STATE_V_FIRST:
        tl.store(p + o_v[None, :] * K + o_k[:, None], b.to(p.dtype.element_ty), mask=m)
    else:
        tl.store(p + o_k[:, None] * V + o_v[None, :], b.to(p.dtype.element_ty), mask=m)


# ---------------------------------------------------------------------------------------------
# A chunk's rows of k, v, q, do and the vector gates: by pointer, or through a TMA descriptor
# ---------------------------------------------------------------------------------------------

@triton.jit
def chunk_rows(x, bos, T, H: tl.constexpr, D: tl.constexpr, BT: tl.constexpr, BD: tl.constexpr,
               USE_TMA: tl.constexpr):
    """Where the rows of one sequence of x [.., T, H, D] (from token ``bos``) are read from: a TMA
    descriptor over them, read in [BT, 1, BD] boxes (USE_TMA), else a pointer to token ``bos``,
    head 0."""
    if USE_TMA:
        # an empty sequence loads nothing, but its descriptor still needs a non-zero extent
        return tl.make_tensor_descriptor(x + bos * H * D, shape=[tl.maximum(T, 1), H, D], strides=[H * D, D, 1],
                                         block_shape=[BT, 1, BD])
    else:
        return x + bos * H * D


@triton.jit
def load_rows(src, i_t, i_head, i_d, T, H: tl.constexpr, D: tl.constexpr, BT: tl.constexpr, BD: tl.constexpr,
              USE_TMA: tl.constexpr):
    """The [BT, BD] tile of chunk i_t, head i_head, columns i_d·BD .. of a ``chunk_rows`` source:
    rows past the sequence's end and columns past D read 0."""
    if USE_TMA:
        return src.load([i_t * BT, i_head.to(tl.int32), i_d * BD]).reshape(BT, BD)
    else:
        rows = tl.cast(i_t, tl.int64) * BT + tl.arange(0, BT)  # [BT] tokens of the chunk
        o_d = i_d * BD + tl.arange(0, BD)  # [BD]
        return tl.load(src + i_head * D + rows[:, None] * (H * D) + o_d[None, :],
                       mask=(rows < T)[:, None] & (o_d < D)[None, :], other=0.0)


@triton.jit
def load_rows_t(src, i_t, i_head, i_d, T, H: tl.constexpr, D: tl.constexpr, BT: tl.constexpr,
                BD: tl.constexpr, USE_TMA: tl.constexpr):
    """``load_rows`` transposed, [BD, BT]: the operand layout of ``tl.dot(kᵀ, v)``."""
    if USE_TMA:
        return tl.trans(src.load([i_t * BT, i_head.to(tl.int32), i_d * BD]).reshape(BT, BD))
    else:
        rows = tl.cast(i_t, tl.int64) * BT + tl.arange(0, BT)  # [BT]
        o_d = i_d * BD + tl.arange(0, BD)  # [BD]
        return tl.load(src + i_head * D + rows[None, :] * (H * D) + o_d[:, None],
                       mask=(o_d < D)[:, None] & (rows < T)[None, :], other=0.0)


# ---------------------------------------------------------------------------------------------
# A chunk's gates
# ---------------------------------------------------------------------------------------------

@triton.jit
def chunk_mask(i_t, T, BT: tl.constexpr):
    """Which of chunk i_t's BT rows lie inside the sequence of T tokens: [BT] bool."""
    return tl.cast(i_t, tl.int64) * BT + tl.arange(0, BT) < T


@triton.jit
def scalar_gate(g, bos, i_h, i_t, T, H: tl.constexpr, BT: tl.constexpr):
    """The scalar gate g [.., T, H] over chunk i_t: G [BT] (0 past T) and Γ, both fp32."""
    rows = tl.cast(i_t, tl.int64) * BT + tl.arange(0, BT)  # [BT]
    last = tl.minimum(tl.cast(i_t, tl.int64) * BT + BT, T) - 1
    b_g = tl.load(g + (bos + rows) * H + i_h, mask=rows < T, other=0.0).to(tl.float32)
    return b_g, tl.load(g + (bos + last) * H + i_h).to(tl.float32)


@triton.jit
def constant_gate(b_gamma, i_t, T, BT: tl.constexpr):
    """The constant gate γ per token over chunk i_t: G_i = γ·(i+1) [BT], Γ = γ·(valid length), and
    Γ − G_i = γ·(length − 1 − i) [BT] as one product (the difference of two large products would
    lose it to rounding), 0 past the chunk's valid rows (where γ·(negative) could overflow 2^{..}
    and turn those rows' zeros into NaN in ``decay_rows``' narrow form)."""
    length = tl.minimum(tl.cast(i_t, tl.int64) * BT + BT, T) - tl.cast(i_t, tl.int64) * BT
    o_t = tl.arange(0, BT)
    return b_gamma * (o_t + 1).to(tl.float32), b_gamma * length.to(tl.float32), \
        b_gamma * tl.maximum(length - 1 - o_t, 0).to(tl.float32)


@triton.jit
def load_gamma(g_gamma, i_h):
    """Head i_h's constant gate γ (log2) in fp32, raised to −160 if below (a decay of zero, −inf,
    included: ``gates.MIN_GATE``'s rule); NaN stays NaN."""
    b_gamma = tl.load(g_gamma + i_h).to(tl.float32)
    return tl.where(b_gamma < -160.0, -160.0, b_gamma)


@triton.jit
def gate_last(x, bos, i_h, i_t, i_d, T, H: tl.constexpr, D: tl.constexpr, BT: tl.constexpr, BD: tl.constexpr):
    """Γ of a vector gate x [.., T, H, D] over chunk i_t: its [BD] row at the last valid token, fp32."""
    last = tl.minimum(tl.cast(i_t, tl.int64) * BT + BT, T) - 1
    o_d = i_d * BD + tl.arange(0, BD)
    return tl.load(x + ((bos + last) * H + i_h) * D + o_d, mask=o_d < D, other=0.0).to(tl.float32)


@triton.jit
def decay_rows(b_x, b_exponent, m_t, NARROW: tl.constexpr):
    """x [BT, BD] with row i times 2^{exponent_i}, rows past the sequence's end (``m_t`` False) 0, in
    fp32; with ``NARROW``, rounded to x's own dtype at once instead (the same bits once the dot
    rounds its fp32 operand, as fla-core does; rows past the end stay 0·2^{..}, since x is 0 there)."""
    if NARROW:
        return (b_x * tl.math.exp2(b_exponent)[:, None]).to(b_x.dtype)
    else:
        return b_x.to(tl.float32) * tl.where(m_t, tl.math.exp2(b_exponent), 0.0)[:, None]


@triton.jit
def query_factor(src_gk, b_gq, scale, i_t, i_h, i_k, T, H: tl.constexpr, K: tl.constexpr, BT: tl.constexpr,
                 BK: tl.constexpr, USE_GK: tl.constexpr, USE_TMA: tl.constexpr):
    """The backward's factor on chunk i_t's queries, ``scale · 2^{G}``: the scalar gates' G_i
    (``b_gq`` [BT]) plus, with ``USE_GK``, the key gate's G from ``src_gk`` (a ``chunk_rows``
    source). 0 past the sequence's end with pointer loads; TMA zero-fills q there instead. Laid out
    like q's tile before its transpose: [BT, BK] (or [BT, 1]) with TMA, so q is transposed after
    the product (one shared-memory buffer less than transposing q and gk first), [BK, BT] (or
    [1, BT]) by pointer."""
    m_t = chunk_mask(i_t, T, BT)
    if USE_GK:
        if USE_TMA:
            b_gk = load_rows(src_gk, i_t, i_h, i_k, T, H, K, BT, BK, USE_TMA).to(tl.float32)  # [BT, BK]
            return scale * tl.math.exp2(b_gk + b_gq[:, None])
        else:
            b_gk = load_rows_t(src_gk, i_t, i_h, i_k, T, H, K, BT, BK, USE_TMA).to(tl.float32)  # [BK, BT]
            return tl.where(m_t[None, :], scale * tl.math.exp2(b_gk + b_gq[None, :]), 0.0)
    else:
        if USE_TMA:
            return (scale * tl.math.exp2(b_gq))[:, None]  # [BT, 1]
        else:
            return tl.where(m_t, scale * tl.math.exp2(b_gq), 0.0)[None, :]  # [1, BT]


@triton.jit
def load_scaled_query(src_q, b_qf, i_t, i_head, i_k, T, HQ: tl.constexpr, K: tl.constexpr, BT: tl.constexpr,
                      BK: tl.constexpr, USE_TMA: tl.constexpr):
    """Chunk i_t's queries of head ``i_head`` times ``query_factor``'s ``b_qf``, rounded to q's dtype,
    as the [BK, BT] operand of ``tl.dot(qᵀ, do)``."""
    if USE_TMA:
        b_q = load_rows(src_q, i_t, i_head, i_k, T, HQ, K, BT, BK, USE_TMA)  # [BT, BK]
        return tl.trans((b_q.to(tl.float32) * b_qf).to(b_q.dtype))
    else:
        b_q = load_rows_t(src_q, i_t, i_head, i_k, T, HQ, K, BT, BK, USE_TMA)  # [BK, BT]
        return (b_q.to(tl.float32) * b_qf).to(b_q.dtype)


# ---------------------------------------------------------------------------------------------
# Epilogue of the pieces' first pass
# ---------------------------------------------------------------------------------------------

@triton.jit
def store_decays(decay_k, decay_v, i_nh, b_decay_k, b_decay_v, i_k, i_v, K: tl.constexpr, V: tl.constexpr,
                 BK: tl.constexpr, BV: tl.constexpr, USE_GV: tl.constexpr):
    """Store a sequence's total log2 decay, key side [K] and (``USE_GV``) value side [V], once per
    element: the tiles of the first column (row) of tiles write it."""
    o_k = i_k * BK + tl.arange(0, BK)
    o_v = i_v * BV + tl.arange(0, BV)
    if i_v == 0:
        tl.store(decay_k + i_nh * K + o_k, b_decay_k, mask=o_k < K)
    if USE_GV:
        if i_k == 0:
            tl.store(decay_v + i_nh * V + o_v, b_decay_v, mask=o_v < V)
