"""The backward kernel: the gradients of the states leaving every split, ``chunk_bwd_dh``.

The forward's recurrence is linear in the state, so its gradient runs the same scan backwards.
The output ``o_t = scale · S_tᵀ q_t`` reads the state after token t, so a chunk of BT tokens
entered with state ``h`` adds to ``h``'s gradient ``scale · (q_t ⊙ 2^{G_t}) (do_t ⊙ 2^{Gv_t})ᵀ``
per token (``G`` the gates' chunk-local cumulative sums, log2). One program owns one [BK, BV]
tile of one (sequence, KV head)'s gradient and walks that sequence's chunks from last to first,
with ``Γ = G[last valid token]``::

    if the chunk closes a split:  store dh          (gradient w.r.t. the state *leaving* the split)
    dh  ←  diag(2^{Γ}) · dh · diag(2^{Γv})           (back across the whole chunk's decay)
    dh  +=  scale · (q ⊙ 2^{G})ᵀ (do ⊙ 2^{Gv})       (the chunk's own outputs)

The scalar gates ``g`` / ``g_gamma`` scale q's tokens and all of ``dh``; ``gk`` scales q per key
and ``dh``'s rows; ``gv`` scales do per value and ``dh``'s columns. They compose: any combination
may be given. After the first chunk ``dh`` is the gradient w.r.t. the initial state, ``dh0``.

GQA (HQ query heads, a multiple of H; query head j reads KV head j // (HQ / H)): the program of
KV head h adds the HQ / H query heads of its group each chunk, so ``dh`` has H heads and needs no
atomics.
The parts the kernel is built from (and the fast paths behind them) are in ``kernel_parts``.
Reading the kernel: as the forward's (its module docstring); in one pass only walk 1 runs.
"""
from __future__ import annotations

import functools

import torch
import triton
import triton.language as tl

from . import _host, _validate, launch, tuning
from . import pieces as _pieces
from .kernel_parts import (chunk_mask, chunk_rows, constant_gate, gate_last, load_gamma, load_rows,
                           load_scaled_query, load_state, program_tile, query_factor, scalar_gate,
                           sequence_bounds, store_decays, store_state)
from .pieces import fold_contributions, piece_role, publish_contribution


# ``scale`` is never specialised: an integer 1 specialised away makes Triton 3.6's ptxas
# miscompile this kernel on Hopper (fla keeps it dynamic for the same reason).
@triton.jit(do_not_specialize=["T", "scale", "OCCUPANCY", "TMA_OK", "SMEM"])
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
    counter,  # [1] int32 (LOOK_BACK): hands out the programs' tickets; 0 between launches
    flags,  # int32 (LOOK_BACK): per piece, head and tile, the readers its contribution has left; 0 between launches
    contributions,  # [N, H, K, V] fp32 (LOOK_BACK): each piece's gradient leaving its start, from a zero one at its end
    piece_seq,  # [N] (LOOK_BACK): the sequence each piece belongs to
    seq_pieces,  # [sequences + 1] (LOOK_BACK): each sequence's first piece
    scale,
    T,
    OCCUPANCY,  # autotune key only, never specialised: the launch's size against the SM count (tuning.launch_bucket)
    TMA_OK,  # autotune key only: 1 when q, do, gk, gv can be read through TMA descriptors
    SMEM,  # autotune key only: bytes of shared memory a block may use on this GPU (tuning.device_limits)
    H: tl.constexpr,
    NG: tl.constexpr,  # HQ / H: query heads per KV head (the GQA group)
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
    STORE_STATES: tl.constexpr = True,  # False: only dh0 (and decays): the pieces' first pass
    STORE_DECAY: tl.constexpr = False,  # store each sequence's total decay (decay_k, decay_v)
    USE_TMA: tl.constexpr = False,  # load q, do, gk, gv through TMA descriptors (a config choice)
    LOOK_BACK: tl.constexpr = False,  # the N sequences are pieces, each walked twice in one launch (pieces)
):
    HQ: tl.constexpr = H * NG
    if LOOK_BACK:  # a piece: walked from zero to publish what it adds, then from its true end storing gradients
        i_nh, i_n, i_h, i_k, i_v, i_seq, p_first, p_last = piece_role(counter, piece_seq, seq_pieces, H, K, V, BK, BV,
                                                                      True)
    else:
        i_nh, i_n, i_h, i_k, i_v = program_tile(H, K, V, BK, BV)  # a tile of one (sequence, KV head)
    bos, T, boh = sequence_bounds(i_n, T, cu_seqlens, split_offsets, BS, IS_VARLEN, STORE_STATES)
    NT = tl.cdiv(T, BT)
    CHUNKS_PER_SPLIT: tl.constexpr = BS // BT
    o_k = i_k * BK + tl.arange(0, BK)  # [BK]
    o_v = i_v * BV + tl.arange(0, BV)  # [BV]
    src_q = chunk_rows(q, bos, T, HQ, K, BT, BK, USE_TMA)  # this sequence's rows of q, do, gk, gv
    src_do = chunk_rows(do, bos, T, HQ, V, BT, BV, USE_TMA)
    src_gk = gk  # read only with USE_GK
    if USE_GK:
        src_gk = chunk_rows(gk, bos, T, H, K, BT, BK, USE_TMA)
    if USE_GV:
        src_gv = chunk_rows(gv, bos, T, H, V, BT, BV, USE_TMA)
    if USE_G_GAMMA:
        b_gamma = load_gamma(g_gamma, i_h)

    # The walk over the chunks (in reverse), once; with LOOK_BACK twice (unrolled): walk 0 from zero, to publish
    # the piece's contribution (not the first piece's: nothing before it reads one), then walk 1 from its true end
    for walk in tl.static_range(0 if LOOK_BACK else 1, 2):
        b_dh = tl.zeros([BK, BV], dtype=tl.float32)  # [BK, BV]
        n_chunks = NT
        if walk == 0:
            n_chunks = tl.where(i_n > p_first, NT, 0)
        elif LOOK_BACK:  # the gradient leaving the piece: dht, carried back across the pieces after it
            if USE_FINAL_STATE_GRADIENT:
                b_dh = load_state(dht + (i_seq * H + i_h) * K * V, o_k, o_v, K, V, STATE_V_FIRST)
            b_dh = fold_contributions(b_dh, contributions, decay_k, decay_v, flags, i_h, i_k, i_v, p_last,
                                      p_last - i_n, o_k, o_v, H, K, V, BK, BV, USE_GV, STATE_V_FIRST, True)
        elif USE_FINAL_STATE_GRADIENT:
            b_dh = load_state(dht + i_nh * K * V, o_k, o_v, K, V, STATE_V_FIRST)
        b_decay_k = tl.zeros([BK], dtype=tl.float32)  # [BK] Σ of the chunks' Γ, key side (STORE_DECAY, walk 0)
        b_decay_v = tl.zeros([BV], dtype=tl.float32)  # [BV] value side

        for i_t in range(n_chunks - 1, -1, -1):
            if STORE_STATES and walk == 1:  # the chunk closes a split (or the sequence): store the gradient leaving it
                if (i_t % CHUNKS_PER_SPLIT == CHUNKS_PER_SPLIT - 1) | (i_t == NT - 1):
                    i_s = boh + i_t // CHUNKS_PER_SPLIT
                    store_state(dh + (i_s * H + i_h) * K * V, b_dh, o_k, o_v, K, V, STATE_V_FIRST)
            m_t = chunk_mask(i_t, T, BT)  # [BT] which of the chunk's rows lie inside the sequence
            b_gq = tl.zeros([BT], dtype=tl.float32)  # [BT] the scalar gates' G_i: q's decay from the chunk's start
            if USE_G:  # scalar gate: all of dh, and q's tokens
                b_g, b_g_last = scalar_gate(g, bos, i_h, i_t, T, H, BT)  # [BT], Γ
                b_dh *= tl.math.exp2(b_g_last)
                b_gq += b_g
                b_decay_k += b_g_last
            if USE_G_GAMMA:  # constant gate: G_i = γ·(i+1)
                b_gg, b_gg_last, _ = constant_gate(b_gamma, i_t, T, BT)  # [BT] G, Γ
                b_dh *= tl.math.exp2(b_gg_last)
                b_gq += b_gg
                b_decay_k += b_gg_last
            if USE_GK:  # key gate: dh's rows (and q per key, in query_factor)
                b_gk_last = gate_last(gk, bos, i_h, i_t, i_k, T, H, K, BT, BK)  # [BK]
                b_dh *= tl.math.exp2(b_gk_last)[:, None]
                b_decay_k += b_gk_last
            if USE_GV:  # value gate: dh's columns, and do per value
                b_gv_last = gate_last(gv, bos, i_h, i_t, i_v, T, H, V, BT, BV)  # [BV]
                b_dh *= tl.math.exp2(b_gv_last)[None, :]
                b_decay_v += b_gv_last
                b_gv = load_rows(src_gv, i_t, i_h, i_v, T, H, V, BT, BV, USE_TMA).to(tl.float32)  # [BT, BV]
                b_dof = tl.where(m_t[:, None], tl.math.exp2(b_gv), 0.0)  # [BT, BV]
            b_qf = query_factor(src_gk, b_gq, scale, i_t, i_h, i_k, T, H, K, BT, BK, USE_GK, USE_TMA)  # scale·2^{G}

            # The chunk's outputs, summed over the NG = HQ / H query heads that read this KV head. A loop, not
            # tl.static_range: the software pipeliner multi-buffers every unrolled head's tiles (fp32
            # with NG = 8 then needs 320 KB of shared memory at BK = BV = 64, over an H200's 227 KB).
            for i_g in range(NG):
                b_q = load_scaled_query(src_q, b_qf, i_t, i_h * NG + i_g, i_k, T, HQ, K, BT, BK, USE_TMA)  # [BK, BT]
                b_do = load_rows(src_do, i_t, i_h * NG + i_g, i_v, T, HQ, V, BT, BV, USE_TMA)  # [BT, BV]
                if USE_GV:
                    b_do = (b_do.to(tl.float32) * b_dof).to(b_do.dtype)
                # dh += qᵀ do: [BK, BT] @ [BT, BV] in the inputs' dtype, accumulated in fp32
                b_dh = tl.dot(b_q, b_do, b_dh)

        if walk == 0:
            if i_n > p_first:
                publish_contribution(contributions, decay_k, decay_v, flags, b_dh, b_decay_k, b_decay_v, i_nh, i_k,
                                     i_v, i_n - p_first, o_k, o_v, K, V, BK, BV, USE_GV, STATE_V_FIRST)

    if LOOK_BACK:
        if STORE_INITIAL_STATE_GRADIENT:
            if i_n == p_first:  # the sequence's first piece ends, walking back, where the sequence starts
                store_state(dh0 + (i_seq * H + i_h) * K * V, b_dh, o_k, o_v, K, V, STATE_V_FIRST)
    else:
        if STORE_INITIAL_STATE_GRADIENT:
            store_state(dh0 + i_nh * K * V, b_dh, o_k, o_v, K, V, STATE_V_FIRST)
        if STORE_DECAY:
            store_decays(decay_k, decay_v, i_nh, b_decay_k, b_decay_v, i_k, i_v, K, V, BK, BV, USE_GV)


_tuned_backward = triton.autotune(
    configs=tuning.CONFIGS,
    key=["K", "V", "NG", "BT", "BS", "OCCUPANCY", "TMA_OK", "SMEM", "USE_G", "USE_G_GAMMA", "USE_GK", "USE_GV",
         "STATE_V_FIRST", "USE_FINAL_STATE_GRADIENT", "STORE_INITIAL_STATE_GRADIENT", "IS_VARLEN", "STORE_STATES",
         "STORE_DECAY", "LOOK_BACK"],
    prune_configs_by={"early_config_prune": tuning.Pruner(chunk_bwd_kernel_dh)},
    do_bench=tuning.autotune_timing,
)(chunk_bwd_kernel_dh)


@_host.on_inputs_device  # Triton launches on the current device: make it q's
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
    outputs of the forward recurrence (S_t the state after token t; the recurrence is in
    ``chunk_fwd_h``'s docstring, the float64 loop ``chunkstate.reference.state_grads``).

    Args:
        q: [B, T, HQ, K] queries; HQ a multiple of H (GQA: query head j reads KV head j // (HQ / H)).
        k: [B, T, H, K], v: [B, T, H, V]: read for their shapes and dtype only (q, do, k, v share
            one float dtype; fp16/bf16/fp32), so any strides do, and they are never copied.
        do: [B, T, HQ, V] gradient of the outputs.
        h0: initial states [N, H, K, V] ([N, H, V, K] with ``state_v_first``) or None: only says
            whether ``dh0`` is wanted.
        dht: [N, H, K, V] ([N, H, V, K]) gradient w.r.t. the final states (any float dtype), or None.
        scale: the outputs' scale (a real number, usually K ** -0.5).
        g: [B, T, H] scalar gate, gk: [B, T, H, K] key gate, gv: [B, T, H, V] value gate — each the
            *chunk-local inclusive cumulative sum in log2 units* of natural-log per-token gates
            (``gates.chunk_local_cumsum(gate, chunk_size, cu_seqlens)``, which also makes a gate of
            −inf, a decay of zero, finite: ``gates.MIN_GATE``); any combination. Read as fp32: keep
            them in the fp32 ``chunk_local_cumsum`` returns (sums rounded to bf16 cost about 1e-3
            of relative error in ``dh``, to fp16 about 1e-4). A non-finite value in these sums
            makes its (sequence, head)'s gradients non-finite from there on.
        g_gamma: [H] constant per-step decay in log2 units (``RCP_LN2 * natural``; below −160, −inf
            included, it counts as −160; NaN or +inf makes its head's gradients non-finite).
        state_v_first: store ``dh`` / ``dh0`` and read ``dht`` as [V, K] instead of [K, V].
        cu_seqlens: [N + 1] int offsets of sequences packed along T (then B must be 1).
        chunk_size: BT, a power of two in [16, 256] (the gates' cumsum must use the same).
        split_size: BS, a multiple of BT (default BT): one gradient is stored per BS tokens.
        states_in_fp32: store ``dh`` in fp32 instead of k's dtype.
        pieces: cut each sequence into this many pieces run in parallel (``chunkstate.pieces``);
            None (default) decides from the occupancy (only far below one wave of programs),
            1 never splits. The result is the same up to rounding.
        config: run one explicit ``triton.Config`` (BK, BV, warps, stages, ``maxnreg`` if set: a cap on
            a thread's registers; ``USE_TMA``: load the tiles through TMA descriptors, ValueError where
            the inputs do not allow it) instead of autotuning.
    Returns:
        dh: [B, NS, H, K, V], ``dh[:, s]`` the gradient w.r.t. the state *leaving* split s (after
            its last token), counting the outputs after split s and ``dht``; summed over the HQ / H
            query heads of each KV head (fla-core 0.6.0 allocates HQ heads here, most of them never
            written: chapter 09) (NS = ceil(T / BS); packed: [1, Σ_n ceil(L_n / BS), H, K, V]).
            With ``split_size`` = ``chunk_size`` this is fla's ``dh``.
        dh0: [N, H, K, V] fp32 gradient w.r.t. ``h0`` (= ``dht``, or 0, for an empty sequence), or
            None when ``h0`` is None.
    Raises:
        TypeError / ValueError naming the argument for wrong types, shapes, heads, devices, sizes,
        offsets, a ``scale`` that is not a real number finite in fp32, flags that are not bools, or
        a malformed ``config``; TypeError for bf16 under Triton's interpreter (which computes it
        wrongly).

    The outputs are plain tensors, detached from autograd even when the inputs require grad:
    ``chunkstate.chunk_gla`` is the differentiable op built on this kernel.
    """
    q = _validate.sequence_tensor("q", q, "B, T, HQ, K")
    B, T, HQ, K = q.shape
    # k and v give their sizes and dtype only (no kernel reads them): never copied, whatever their strides
    k = _validate.tensor("k", k, (B, T, None, K), like=q, contiguous=False)
    H = k.shape[2]
    _validate.query_heads(HQ, H)
    v = _validate.tensor("v", v, (B, T, H, None), like=q, contiguous=False)
    V = v.shape[-1]
    do = _validate.tensor("do", do, (B, T, HQ, V), like=q)
    for name, x in (("k", k), ("v", v), ("do", do)):
        if x.dtype != q.dtype:
            raise TypeError(f"{name} must have q's dtype {q.dtype}, got {x.dtype}")
    _validate.kernel_input("q", q)
    scale = _validate.real("scale", scale)
    state_v_first = _validate.flag("state_v_first", state_v_first)
    states_in_fp32 = _validate.flag("states_in_fp32", states_in_fp32)
    g, g_gamma, gk, gv = _validate.gates(B, T, H, K, V, g, g_gamma, gk, gv, like=q)
    p = launch.problem(q, B, T, H, K, V, cu_seqlens, chunk_size, split_size, state_v_first)
    if h0 is not None:
        h0 = _validate.tensor("h0", h0, (p.N, H, *p.state), like=q, contiguous=False)  # its presence only
    if dht is not None:
        dht = _validate.tensor("dht", dht, (p.N, H, *p.state), like=q)
    launch.check_config(config, ("USE_TMA",))
    _validate.config_values(config, ("USE_TMA",))

    dh = torch.empty(B, p.NS, H, *p.state, dtype=torch.float32 if states_in_fp32 else k.dtype, device=q.device)
    dh0 = torch.empty(p.N, H, *p.state, dtype=torch.float32, device=q.device) if h0 is not None else None
    run_pass = functools.partial(_backward_pass, q, do, g, g_gamma, gk, gv, scale, p, config)
    _pieces.dispatch(pieces, p, run_pass, dh, dht, dh0, direction="bwd", gate=_pieces.gate_kind(g, g_gamma, gk, gv),
                     use_gv=gv is not None,
                     tag=(q.dtype, dh.dtype, dht is not None, dh0 is not None, config and tuning.config_label(config)),
                     call=lambda P: chunk_bwd_dh(q, k, v, do, h0, dht, scale, g, g_gamma, gk, gv, state_v_first,
                                                 cu_seqlens, chunk_size, split_size, states_in_fp32, pieces=P,
                                                 config=config))
    return dh, dh0


def _backward_pass(q, do, g, g_gamma, gk, gv, scale, p: launch.Problem, config, *, cu_seqlens, split_offsets, N,
                   states, start, end, decay_k=None, decay_v=None, look_back=None) -> None:
    """One launch of the backward kernel over N sequences (``states`` None: store none, only
    ``end`` and, given ``decay_k``, each sequence's total decay: the pieces' first pass; ``look_back``:
    the N sequences are pieces walked in one launch, and these its buffers by argument name, from
    ``pieces.run``)."""
    args = dict(q=q, do=do, dh=states, g=g, g_gamma=g_gamma, gk=gk, gv=gv, dht=start, dh0=end,
                cu_seqlens=cu_seqlens, split_offsets=split_offsets, decay_k=decay_k, decay_v=decay_v,
                scale=scale, T=q.shape[1], H=p.H, NG=q.shape[2] // max(p.H, 1), K=p.K, V=p.V, BT=p.BT, BS=p.BS,
                USE_G=g is not None, USE_G_GAMMA=g_gamma is not None, USE_GK=gk is not None,
                USE_GV=gv is not None, USE_FINAL_STATE_GRADIENT=start is not None,
                STORE_INITIAL_STATE_GRADIENT=end is not None, IS_VARLEN=cu_seqlens is not None,
                STATE_V_FIRST=p.state_v_first, STORE_STATES=states is not None,
                STORE_DECAY=decay_k is not None and look_back is None, LOOK_BACK=look_back is not None,
                **(look_back or dict(counter=None, flags=None, contributions=None, piece_seq=None, seq_pieces=None)))
    launch.run(_tuned_backward, chunk_bwd_kernel_dh, args, N=N, H=p.H, K=p.K, V=p.V,
               config=config, tma_inputs=dict(q=q, do=do, gk=gk, gv=gv))
