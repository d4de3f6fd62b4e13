"""The forward kernel: the states entering every split of every sequence, ``chunk_fwd_h``.

One program owns one [BK, BV] tile of one (sequence, head)'s state and walks that sequence's
chunks in order. Per chunk of BT tokens, with the gates' chunk-local cumulative sums ``G`` (log2;
key side: g, g_gamma and gk summed) and ``Gv`` (value side: gv), and ``Γ``, ``Γv`` their values at
the chunk's last valid token::

    if the chunk starts a split:  store h                        (the state *entering* the split)
    h  ←  diag(2^{Γ}) · h · diag(2^{Γv})                          (decay across the whole chunk)
    h  +=  (k ⊙ 2^{Γ−G})ᵀ (v ⊙ 2^{Γv−Gv})                         (each token decayed to the end)

(chapter 03's chunk step). The scalar gates ``g`` / ``g_gamma`` scale all of ``h`` and, one
number per token, v's rows (the same product as scaling k's; chapter 05); ``gk`` scales k per key
and ``h``'s rows; ``gv`` scales v per value and ``h``'s columns. They compose: any combination may
be given. The parts the kernel is built from (and the fast paths behind them) are in
``kernel_parts``.

Reading the kernel: a call in one pass (every call but chapter 11's pieces) has ``LOOK_BACK``
False, so the ``for walk`` loop runs once (walk 1) and the chunk loop inside it is the step above;
the lines under ``if LOOK_BACK`` / ``walk == 0`` and the ``b_decay_k`` / ``b_decay_v`` sums serve
the pieces (``chunkstate.pieces``); ``USE_TMA`` and ``NARROW_V`` choose how tiles are loaded and v
is scaled, not what is computed.
"""
from __future__ import annotations

import functools

import torch
import triton
import triton.language as tl

from . import _host, _validate, launch, tuning
from . import pieces as _pieces
from .kernel_parts import (chunk_mask, chunk_rows, constant_gate, decay_rows, gate_last, load_gamma, load_rows,
                           load_rows_t, load_state, program_tile, scalar_gate, sequence_bounds, store_decays,
                           store_state)
from .pieces import fold_contributions, piece_role, publish_contribution


@triton.jit(do_not_specialize=["T", "OCCUPANCY", "TMA_OK", "SMEM"])
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
    counter,  # [1] int32 (LOOK_BACK): hands out the programs' tickets; 0 between launches
    flags,  # int32 (LOOK_BACK): per piece, head and tile, the readers its contribution has left; 0 between launches
    contributions,  # [N, H, K, V] fp32 (LOOK_BACK): each piece's final state from a zero start
    piece_seq,  # [N] (LOOK_BACK): the sequence each piece belongs to
    seq_pieces,  # [sequences + 1] (LOOK_BACK): each sequence's first piece
    T,
    OCCUPANCY,  # autotune key only, never specialised: the launch's size against the SM count (tuning.launch_bucket)
    TMA_OK,  # autotune key only: 1 when k, v, gk, gv can be read through TMA descriptors
    SMEM,  # autotune key only: bytes of shared memory a block may use on this GPU (tuning.device_limits)
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
    STORE_STATES: tl.constexpr = True,  # False: only ht (and decays): the pieces' first pass
    STORE_DECAY: tl.constexpr = False,  # store each sequence's total decay (decay_k, decay_v)
    USE_TMA: tl.constexpr = False,  # load k, v, gk, gv through TMA descriptors (a config choice)
    NARROW_V: tl.constexpr = False,  # scale v by g or g_gamma in v's own dtype (one scalar gate alone; tuning.narrow_v)
    LOOK_BACK: tl.constexpr = False,  # the N sequences are pieces, each walked twice in one launch (pieces)
):
    tl.static_assert(not NARROW_V or (USE_G != USE_G_GAMMA and not USE_GV), "NARROW_V is for one scalar gate alone")
    if LOOK_BACK:  # a piece: walked from zero to publish what it adds, then from its true start storing states
        i_nh, i_n, i_h, i_k, i_v, i_seq, p_first, p_last = piece_role(counter, piece_seq, seq_pieces, H, K, V, BK, BV,
                                                                      False)
    else:
        i_nh, i_n, i_h, i_k, i_v = program_tile(H, K, V, BK, BV)
    bos, T, boh = sequence_bounds(i_n, T, cu_seqlens, split_offsets, BS, IS_VARLEN, STORE_STATES)
    CHUNKS_PER_SPLIT: tl.constexpr = BS // BT
    src_k = chunk_rows(k, bos, T, H, K, BT, BK, USE_TMA)  # this sequence's rows of k, v, gk, gv
    src_v = chunk_rows(v, bos, T, H, V, BT, BV, USE_TMA)
    if USE_GK:
        src_gk = chunk_rows(gk, bos, T, H, K, BT, BK, USE_TMA)
    if USE_GV:
        src_gv = chunk_rows(gv, bos, T, H, V, BT, BV, USE_TMA)
    o_k = i_k * BK + tl.arange(0, BK)  # [BK]
    o_v = i_v * BV + tl.arange(0, BV)  # [BV]
    if USE_G_GAMMA:
        b_gamma = load_gamma(g_gamma, i_h)
    NT = tl.cdiv(T, BT)

    # The walk over the chunks, once; with LOOK_BACK twice (unrolled): walk 0 from zero, to publish the
    # piece's contribution (not the last piece's: nothing after it reads one), then walk 1 from its true start
    for walk in tl.static_range(0 if LOOK_BACK else 1, 2):
        b_h = tl.zeros([BK, BV], dtype=tl.float32)  # [BK, BV]
        n_chunks = NT
        if walk == 0:
            n_chunks = tl.where(i_n < p_last, NT, 0)
        elif LOOK_BACK:  # the piece's true start: h0, carried across the pieces before it
            if USE_INITIAL_STATE:
                b_h = load_state(h0 + (i_seq * H + i_h) * K * V, o_k, o_v, K, V, STATE_V_FIRST)
            b_h = fold_contributions(b_h, contributions, decay_k, decay_v, flags, i_h, i_k, i_v, p_first,
                                     i_n - p_first, o_k, o_v, H, K, V, BK, BV, USE_GV, STATE_V_FIRST, False)
        elif USE_INITIAL_STATE:
            b_h = load_state(h0 + i_nh * K * V, o_k, o_v, K, V, STATE_V_FIRST)
        b_decay_k = tl.zeros([BK], dtype=tl.float32)  # [BK] Σ of the chunks' Γ, key side (STORE_DECAY, walk 0)
        b_decay_v = tl.zeros([BV], dtype=tl.float32)  # [BV] value side

        for i_t in range(0, n_chunks):
            if STORE_STATES and walk == 1:
                if i_t % CHUNKS_PER_SPLIT == 0:  # the chunk opens a split: store the state entering it
                    i_s = boh + i_t // CHUNKS_PER_SPLIT
                    store_state(h + (i_s * H + i_h) * K * V, b_h, o_k, o_v, K, V, STATE_V_FIRST)
            m_t = chunk_mask(i_t, T, BT)  # [BT] which of the chunk's rows lie inside the sequence
            b_k = load_rows_t(src_k, i_t, i_h, i_k, T, H, K, BT, BK, USE_TMA)  # [BK, BT] k, transposed
            b_v = load_rows(src_v, i_t, i_h, i_v, T, H, V, BT, BV, USE_TMA)  # [BT, BV]
            if USE_G:  # scalar gate: all of h, and v's rows
                b_g, b_g_last = scalar_gate(g, bos, i_h, i_t, T, H, BT)  # [BT], Γ
                b_h *= tl.math.exp2(b_g_last)
                b_v = decay_rows(b_v, b_g_last - b_g, m_t, NARROW_V)
                b_decay_k += b_g_last
            if USE_G_GAMMA:  # constant gate: G_i = γ·(i+1)
                _, b_gg_last, b_gg_to_end = constant_gate(b_gamma, i_t, T, BT)  # Γ, [BT] Γ − G
                b_h *= tl.math.exp2(b_gg_last)
                b_v = decay_rows(b_v, b_gg_to_end, m_t, NARROW_V)
                b_decay_k += b_gg_last
            if USE_GK:  # key gate: h's rows, and k's columns (its tokens)
                b_gk = load_rows_t(src_gk, i_t, i_h, i_k, T, H, K, BT, BK, USE_TMA).to(tl.float32)  # [BK, BT]
                b_gk_last = gate_last(gk, bos, i_h, i_t, i_k, T, H, K, BT, BK)  # [BK]
                b_h *= tl.math.exp2(b_gk_last)[:, None]
                b_k = b_k.to(tl.float32) * tl.where(m_t[None, :], tl.math.exp2(b_gk_last[:, None] - b_gk), 0.0)
                b_decay_k += b_gk_last
            if USE_GV:  # value gate: h's columns, and v's
                b_gv = load_rows(src_gv, i_t, i_h, i_v, T, H, V, BT, BV, USE_TMA).to(tl.float32)  # [BT, BV]
                b_gv_last = gate_last(gv, bos, i_h, i_t, i_v, T, H, V, BT, BV)  # [BV]
                b_h *= tl.math.exp2(b_gv_last)[None, :]
                b_v = b_v.to(tl.float32) * tl.where(m_t[:, None], tl.math.exp2(b_gv_last[None, :] - b_gv), 0.0)
                b_decay_v += b_gv_last
            # h += kᵀ v: [BK, BT] @ [BT, BV] in the inputs' dtype, accumulated in fp32
            b_h = tl.dot(b_k.to(k.dtype.element_ty), b_v.to(k.dtype.element_ty), b_h)

        if walk == 0:
            if i_n < p_last:
                publish_contribution(contributions, decay_k, decay_v, flags, b_h, b_decay_k, b_decay_v, i_nh, i_k,
                                     i_v, p_last - i_n, o_k, o_v, K, V, BK, BV, USE_GV, STATE_V_FIRST)

    if LOOK_BACK:
        if STORE_FINAL_STATE:
            if i_n == p_last:  # the sequence's last piece ends where the sequence does
                store_state(ht + (i_seq * H + i_h) * K * V, b_h, o_k, o_v, K, V, STATE_V_FIRST)
    else:
        if STORE_FINAL_STATE:
            store_state(ht + i_nh * K * V, b_h, o_k, o_v, K, V, STATE_V_FIRST)
        if STORE_DECAY:
            store_decays(decay_k, decay_v, i_nh, b_decay_k, b_decay_v, i_k, i_v, K, V, BK, BV, USE_GV)


_tuned_forward = triton.autotune(
    configs=tuning.CONFIGS,
    key=["K", "V", "BT", "BS", "OCCUPANCY", "TMA_OK", "SMEM", "USE_G", "USE_G_GAMMA", "USE_GK", "USE_GV",
         "STATE_V_FIRST", "USE_INITIAL_STATE", "STORE_FINAL_STATE", "IS_VARLEN", "STORE_STATES", "STORE_DECAY",
         "LOOK_BACK"],
    prune_configs_by={"early_config_prune": tuning.Pruner(chunk_fwd_kernel_h)},
    do_bench=tuning.autotune_timing,
)(chunk_fwd_kernel_h)


@_host.on_inputs_device  # Triton launches on the current device: make it k's
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

    The recurrence, token by token, with natural-log per-token gates (``chunkstate.reference``)::

        S_t = diag(e^{g_t + g_gamma + gk_t}) · S_{t−1} · diag(e^{gv_t}) + k_t v_tᵀ    (S_t: [K, V])

    and the kernel stores ``S`` entering every split of ``split_size`` tokens.

    Args:
        k: [B, T, H, K] keys; v: [B, T, H, V] values (same float dtype; fp16/bf16/fp32).
        g: [B, T, H] scalar gate, gk: [B, T, H, K] key gate, gv: [B, T, H, V] value gate — each the
            *chunk-local inclusive cumulative sum in log2 units* of natural-log per-token gates
            (``gates.chunk_local_cumsum(gate, chunk_size, cu_seqlens)``, which also makes a gate of
            −inf, a decay of zero, finite: ``gates.MIN_GATE``); any combination. Read as fp32: keep
            them in the fp32 ``chunk_local_cumsum`` returns (sums rounded to bf16 cost several 1e-3
            of relative error in ``h``, to fp16 several 1e-4). A non-finite value in these sums makes
            its (sequence, head)'s states non-finite from there on.
        g_gamma: [H] constant per-step decay in log2 units (``RCP_LN2 * natural``; below −160, −inf
            included, it counts as −160; NaN or +inf makes its head's states non-finite).
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
        config: run one explicit ``triton.Config`` (BK, BV, warps, stages, ``maxnreg`` if set: a cap on
            a thread's registers; ``USE_TMA``: load the tiles through TMA descriptors, ValueError where
            the inputs do not allow it; ``NARROW_V``: scale v by its scalar gate, ``g`` or ``g_gamma``,
            in v's own dtype or in fp32, the same numbers either way, by default as ``tuning.narrow_v``
            decides; ValueError unless one of them is the only gate on v) instead of autotuning.
    Returns:
        h: [B, NS, H, K, V], ``h[:, s]`` the state entering split s (NS = ceil(T / BS); packed:
            [1, Σ_n ceil(L_n / BS), H, K, V], empty sequences owning no split);
        ht: [N, H, K, V] fp32, or None unless ``output_final_state`` (= h0, or 0, for an empty sequence).
    Raises:
        TypeError / ValueError naming the argument for wrong types, shapes, heads, devices, sizes,
        offsets, flags that are not bools, or a malformed ``config``; TypeError for bf16 under
        Triton's interpreter (which computes it wrongly).

    The outputs are plain tensors, detached from autograd even when the inputs require grad:
    ``chunkstate.chunk_gla`` is the differentiable op built on this kernel.
    """
    k = _validate.sequence_tensor("k", k)
    B, T, H, K = k.shape
    v = _validate.tensor("v", v, (B, T, H, None), like=k)
    V = v.shape[-1]
    if v.dtype != k.dtype:
        raise TypeError(f"v must have k's dtype {k.dtype}, got {v.dtype}")
    _validate.kernel_input("k", k)
    output_final_state = _validate.flag("output_final_state", output_final_state)
    state_v_first = _validate.flag("state_v_first", state_v_first)
    states_in_fp32 = _validate.flag("states_in_fp32", states_in_fp32)
    g, g_gamma, gk, gv = _validate.gates(B, T, H, K, V, g, g_gamma, gk, gv, like=k)
    p = launch.problem(k, B, T, H, K, V, cu_seqlens, chunk_size, split_size, state_v_first)
    if h0 is not None:
        h0 = _validate.tensor("h0", h0, (p.N, H, *p.state), like=k)
    launch.check_config(config, ("USE_TMA", "NARROW_V"))
    _validate.config_values(config, ("USE_TMA", "NARROW_V"))
    if config is not None and config.kwargs.get("NARROW_V") and not _narrow_v_applies(g, g_gamma, gv):
        raise ValueError("config asks for NARROW_V=True (v scaled by its scalar gate in v's own dtype), which needs "
                         "one of g and g_gamma given, not both, and no gv; pass NARROW_V=False or leave it out")

    h = torch.empty(B, p.NS, H, *p.state, dtype=torch.float32 if states_in_fp32 else k.dtype, device=k.device)
    ht = torch.empty(p.N, H, *p.state, dtype=torch.float32, device=k.device) if output_final_state else None
    run_pass = functools.partial(_forward_pass, k, v, g, g_gamma, gk, gv, p, config)
    _pieces.dispatch(pieces, p, run_pass, h, h0, ht, direction="fwd", gate=_pieces.gate_kind(g, g_gamma, gk, gv),
                     use_gv=gv is not None,
                     tag=(k.dtype, h.dtype, h0 is not None, ht is not None, config and tuning.config_label(config)),
                     call=lambda P: chunk_fwd_h(k, v, g, g_gamma, gk, gv, h0, output_final_state, state_v_first,
                                                cu_seqlens, chunk_size, split_size, states_in_fp32, pieces=P,
                                                config=config))
    return h, ht


def _narrow_v_applies(g, g_gamma, gv) -> bool:
    """Whether v's rows are scaled by one scalar gate alone (``g`` or ``g_gamma``, not both, no
    ``gv``): where the kernel's ``NARROW_V`` may scale them in v's own dtype."""
    return (g is None) != (g_gamma is None) and gv is None


def _forward_pass(k, v, g, g_gamma, gk, gv, p: launch.Problem, config, *, cu_seqlens, split_offsets, N, states,
                  start, end, decay_k=None, decay_v=None, look_back=None) -> None:
    """One launch of the forward kernel over N sequences (``states`` None: store none, only ``end``
    and, given ``decay_k``, each sequence's total decay: the pieces' first pass; ``look_back``: the
    N sequences are pieces walked in one launch, and these its buffers by argument name, from
    ``pieces.run``)."""
    narrow = _narrow_v_applies(g, g_gamma, gv) and tuning.narrow_v(
        tuning.launch_bucket(N, p.H, p.K, p.V, tuning.sm_count(p.device)))
    args = dict(k=k, v=v, h=states, g=g, g_gamma=g_gamma, gk=gk, gv=gv, h0=start, ht=end,
                cu_seqlens=cu_seqlens, split_offsets=split_offsets, decay_k=decay_k, decay_v=decay_v,
                T=k.shape[1], H=p.H, K=p.K, V=p.V, BT=p.BT, BS=p.BS,
                USE_G=g is not None, USE_G_GAMMA=g_gamma is not None, USE_GK=gk is not None,
                USE_GV=gv is not None, USE_INITIAL_STATE=start is not None, STORE_FINAL_STATE=end is not None,
                IS_VARLEN=cu_seqlens is not None, STATE_V_FIRST=p.state_v_first,
                STORE_STATES=states is not None, STORE_DECAY=decay_k is not None and look_back is None,
                NARROW_V=narrow, LOOK_BACK=look_back is not None,
                **(look_back or dict(counter=None, flags=None, contributions=None, piece_seq=None, seq_pieces=None)))
    launch.run(_tuned_forward, chunk_fwd_kernel_h, args, N=N, H=p.H, K=p.K, V=p.V,
               config=config, tma_inputs=dict(k=k, v=v, gk=gk, gv=gv))
