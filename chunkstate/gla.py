"""Chunked gated linear attention, forward and backward: ``chunk_gla``.

The op puts the pieces of the package together. Per (sequence, head), with natural-log per-token
gates (scalar ``g`` and/or per-key ``gk``; their sum ``a_t`` is the log-decay of the key side), the
token recurrence ``S_t = diag(e^{a_t}) S_{t-1} + k_t v_tᵀ``, ``o_t = s · S_tᵀ q_t`` is computed a
chunk of BT tokens at a time. Inside chunk n, with ``G`` the chunk-local inclusive cumulative sum
of ``a`` in log2 units (``G_i = log2(e) · Σ_{t≤i} a_t``, chapter 00's notation) and ``Γ = G[last
token]``::

    o_i  = s · [ (q_i ⊙ 2^{G_i})ᵀ h[n]  +  Σ_{j≤i} P_ij v_j ],   P_ij = Σ_k q_ik k_jk 2^{G_ik − G_jk}

- the *inter-chunk* part reads ``h[n]``, the state entering chunk n, from the kernel
  ``chunk_fwd_h`` (one program per state tile walks the chunks in order);
- the *intra-chunk* part is plain PyTorch, batched over every chunk of every sequence at once.

The backward is the same split (notebooks/10_complete_layer.ipynb, section 2, derives it). The
kernel ``chunk_bwd_dh`` gives ``dh[n]``, the gradient w.r.t. the state *leaving* chunk n (outputs
after it, plus ``dht``), and ``dh0``; then per chunk, with ``dA_ij = s · do_i·v_j`` (j ≤ i)::

    dv_j = s · Σ_{i≥j} P_ij do_i  +  (k_j ⊙ 2^{Γ−G_j})ᵀ dh[n]
    dq_i = s · 2^{G_i} ⊙ (h[n] do_i)  +  Σ_{j≤i} dA_ij · k_j ⊙ 2^{G_i−G_j}
    dk_j = 2^{Γ−G_j} ⊙ (dh[n] v_j)     +  Σ_{i≥j} dA_ij · q_i ⊙ 2^{G_i−G_j}
    dG_i = q_i ⊙ dq_i − k_i ⊙ dk_i      (+ at the chunk's last token: Σ_j k_j ⊙ dk_inter_j
                                           + 2^{Γ} ⊙ Σ_v h[n] ⊙ dh[n])

Here ``dG_i`` is the gradient w.r.t. the *natural-log* partial sum ``Σ_{t≤i} a_t`` (since
``2^{G_i}`` is ``e`` to that sum, its derivative is ``2^{G_i}`` itself, no ln 2 anywhere), so
``da`` is the *reverse* cumulative sum of ``dG`` inside each chunk: ``dgk = da``, ``dg = Σ_k da``.

Summed that way, ``da`` cancels terms of size O(1) that appear once with each sign: the diagonal
``dA_ii q_i ⊙ k_i`` (in both ``q_i ⊙ dq_i`` and ``k_i ⊙ dk_i``) and ``k_j ⊙ dk_inter_j`` (at j and
in the last token's term). Under strong decays the true ``da`` is tiny (e^{-40} at a gate of -40
per token, 2^{−58}) and that rounding noise (~1e-7) would be all that is left. So the op sums the same
terms without the pairs that cancel exactly::

    da_t = Σ_{i≥t} [q_i ⊙ (dq_inter_i + dq_strict_i) − k_i ⊙ dk_strict_i]     (reverse cumsum)
         + Σ_{j<t} k_j ⊙ dk_inter_j                                          (exclusive cumsum)
         + 2^{Γ} ⊙ Σ_v h[n] ⊙ dh[n]

with ``dq_strict``, ``dk_strict`` the intra-chunk sums over j < i only.

Design choices, each for clarity or safety:

- **Units.** The kernels take the gates' chunk-local cumsums in log2 units
  (``gates.chunk_local_cumsum``); the PyTorch part uses the very same tensors with ``exp2``.
  The gradient formulas above are w.r.t. the natural-log gates the caller passes.
- **No overflow under strong decays.** A factor ``2^{G_i}`` or ``2^{Γ−G_j}`` is ≤ 1 for decaying
  gates. ``2^{G_i − G_j}`` is never split into ``2^{G_i}·2^{−G_j}`` over a whole chunk (``2^{−G_j}``
  overflows fp32 once a chunk decays below ``G = −128``). Instead the chunk is cut in two:
  for rows i in the second half and columns j in the first, the product goes through ``r`` = the
  first half's last token, ``2^{G_i−G_r} · 2^{G_r−G_j}``, both factors ≤ 1, so that quadrant is
  one matmul. Each half is cut in two the same way, and so on down to single tokens: log2(BT)
  levels of batched matmuls cover the lower triangle, and the diagonal (i = j) has no decay at
  all. (fla stops at sub-chunks of 16 tokens and fills their diagonal blocks column by column.)
- **Packed (varlen) batches: each sequence is padded to a multiple of BT.** Tokens are gathered
  into a chunk layout [C, H, BT, D] (C = all chunks of all sequences, in the kernels' state
  order); a padded slot holds zeros for q, k, v, do and repeats the last valid token's ``G``, so
  it adds nothing and the chunk's last slot carries ``Γ``. An empty sequence owns no chunk (its
  ``ht`` is ``h0``); a one-token sequence owns one chunk of one valid token. Dense batches use
  the same layout (sequences of length T), a plain reshape when T is a multiple of BT.
- **States in fp32 for the backward.** The backward recomputes ``h`` with
  ``states_in_fp32=True`` and asks for ``dh`` in fp32 (as fla does): bf16 states carry ~3
  significant digits, and the gate gradient is a difference of products of ``h`` / ``dh`` with
  q and k (``q ⊙ dq − k ⊙ dk``) summed over up to BT tokens, small next to its terms: rounding
  in the states shows up magnified in ``dg``. Nothing is kept from the forward but the inputs:
  ``h``, ``G`` and the intra-chunk matrix ``P`` are recomputed, so no state memory lives between
  forward and backward. The forward stores ``h`` in the inputs' dtype (the output reads it once).
- **Precision.** The PyTorch part computes in fp32 whatever the inputs; o and the gradients are
  cast back at the end. (``ChunkGLAFunction`` keeps float64 inputs in float64 there: the tests
  gradcheck it with float64 stand-ins for the two state kernels. ``chunk_gla`` itself takes
  fp16/bf16/fp32 only.)
- **Speed.** The intra-chunk part is plain PyTorch written for reading, not speed: a few dozen
  ops with fp32 temporaries of q's size, several times slower than fla's fused Triton op.
  ``python -m chunkstate.bench --gla`` times both on a GPU.
"""
from __future__ import annotations

import torch

from torch.autograd.function import once_differentiable

from . import _validate
from .backward import chunk_bwd_dh
from .forward import chunk_fwd_h
from .gates import MIN_GATE, chunk_local_cumsum, prepare_chunk_indices, prepare_chunk_offsets



# ---------------------------------------------------------------------------------------------
# The chunk layout: every sequence padded to a multiple of BT, tokens of one chunk together
# ---------------------------------------------------------------------------------------------

class ChunkLayout:
    """Where each token lives in the chunk layout [C, H, BT, D], and back.

    ``C`` chunks in the kernels' state order (sequence by sequence, chunk by chunk), so chunk c's
    entering state is ``h.reshape(C, H, K, V)[c]``. Slot p of chunk c holds token
    ``index[c, p]``; slots past a sequence's end (``valid`` False) repeat its last token's index.
    """

    def __init__(self, B: int, T: int, cu_seqlens: torch.Tensor | None, chunk_size: int, device,
                 dtype: torch.dtype = torch.float32):
        self.B, self.T, self.BT, self.dtype = B, T, chunk_size, dtype  # dtype: of the chunk tensors
        self.identity = cu_seqlens is None and T % chunk_size == 0  # a plain reshape
        if cu_seqlens is None:
            cu = torch.arange(B + 1, device=device, dtype=torch.long) * T  # B sequences of length T
        else:
            cu = cu_seqlens.to(torch.long)
        lens = cu[1:] - cu[:-1]
        chunks = prepare_chunk_indices(cu, chunk_size)  # [C, 2]: (sequence, chunk in sequence)
        self.C = chunks.shape[0]
        if self.identity:
            return
        seq, first = chunks[:, 0], chunks[:, 1] * chunk_size
        n_valid = torch.clamp(lens[seq] - first, max=chunk_size)  # [C] >= 1
        slot = torch.arange(chunk_size, device=device)
        self.valid = (slot[None, :] < n_valid[:, None]).reshape(-1)  # [C·BT]
        self.index = (cu[seq] + first)[:, None] + torch.minimum(slot[None, :], n_valid[:, None] - 1)
        self.index = self.index.reshape(-1)  # [C·BT] token (in the flattened B·T) of each slot
        t = torch.arange(int(cu[-1]), device=device)
        s = torch.searchsorted(cu[1:], t, right=True)  # sequence of each token
        local = t - cu[s]
        self.pos = (prepare_chunk_offsets(cu, chunk_size)[s] + local // chunk_size) * chunk_size \
            + local % chunk_size  # [B·T] slot of each token

    def to_chunks(self, x: torch.Tensor, pad: str = "zero") -> torch.Tensor:
        """[B, T, H, D] -> [C, H, BT, D] in the layout's dtype; padded slots are 0 (``pad="zero"``) or repeat the
        sequence's last token (``pad="last"``, for cumulative gates)."""
        B, T, H, D = x.shape
        x = x.reshape(B * T, H, D).to(self.dtype)
        if not self.identity:
            x = x.index_select(0, self.index)
            if pad == "zero":
                x = x * self.valid[:, None, None]
        return x.reshape(self.C, self.BT, H, D).transpose(1, 2).contiguous()

    def from_chunks(self, x: torch.Tensor) -> torch.Tensor:
        """[C, H, BT, D] -> [B, T, H, D] (padded slots dropped)."""
        C, H, BT, D = x.shape
        x = x.transpose(1, 2).reshape(C * BT, H, D)
        if not self.identity:
            x = x.index_select(0, self.pos)
        return x.reshape(self.B, self.T, H, D)


# ---------------------------------------------------------------------------------------------
# The intra-chunk part, batched over all chunks: tensors [C, H, BT, D] fp32, G in log2 units
# ---------------------------------------------------------------------------------------------

def _levels(BT: int):
    """The widths of the halves, coarse to fine: BT/2, BT/4, ..., 1 (BT a power of two)."""
    half = BT // 2
    while half >= 1:
        yield half
        half //= 2


def _halves(x: torch.Tensor, half: int) -> torch.Tensor:
    """[C, H, BT, D] -> [C, H, nb, 2, half, D] (a view): the chunk as nb = BT / (2·half) blocks of
    2·half tokens, each cut in two."""
    C, H, BT, D = x.shape
    return x.view(C, H, BT // (2 * half), 2, half, D)


def _quadrants(M: torch.Tensor, half: int) -> torch.Tensor:
    """[C, H, BT, BT] -> [C, H, half, half, nb] (a view): in each diagonal block of 2·half tokens
    of the matrix, the quadrant of rows in its second half and columns in its first half."""
    C, H, BT, _ = M.shape
    nb = BT // (2 * half)
    return M.view(C, H, nb, 2, half, nb, 2, half).diagonal(dim1=2, dim2=5)[:, :, 1, :, 0, :, :]


def _factored_halves(q: torch.Tensor, k: torch.Tensor, G: torch.Tensor, half: int):
    """One level: with r the last token of each block's first half, the rows of its second half
    ``q_i ⊙ 2^{G_i − G_r}`` and the columns of its first half ``k_j ⊙ 2^{G_r − G_j}``, [C, H, nb,
    half, K] each, and the two decay factors (all <= 1 for decaying gates). A row times a column is
    ``Σ_k q_ik k_jk 2^{G_ik − G_jk}``."""
    Gh = _halves(G, half)
    G_r = Gh[:, :, :, 0, half - 1:half]  # [C, H, nb, 1, K]
    f_row, f_col = torch.exp2(Gh[:, :, :, 1] - G_r), torch.exp2(G_r - Gh[:, :, :, 0])
    return _halves(q, half)[:, :, :, 1] * f_row, _halves(k, half)[:, :, :, 0] * f_col, f_row, f_col


def intra_attention(q: torch.Tensor, k: torch.Tensor, G: torch.Tensor) -> torch.Tensor:
    """``P`` [C, H, BT, BT]: ``P_ij = Σ_k q_ik k_jk 2^{G_ik − G_jk}`` for j <= i, 0 above.

    q, k, G: [C, H, BT, K] fp32 (G a chunk-local cumsum in log2 units). Every exponent taken is
    <= 0 for decaying gates (module docstring): one batched matmul per level of halving, and the
    diagonal, which has no decay."""
    q, k, G = q.contiguous(), k.contiguous(), G.contiguous()  # the levels are views
    C, H, BT, K = q.shape
    P = q.new_zeros(C, H, BT, BT)
    P.diagonal(dim1=-2, dim2=-1).copy_((q * k).sum(-1))
    for half in _levels(BT):
        rows, cols, _, _ = _factored_halves(q, k, G, half)  # [C, H, nb, half, K]
        _quadrants(P, half).copy_((rows @ cols.transpose(-1, -2)).permute(0, 1, 3, 4, 2))
    return P


def intra_attention_grads(q, k, G, dP):
    """The strictly-lower part of the gradients of ``Σ_ij dP_ij P_ij`` (``P`` =
    :func:`intra_attention`, ``dP`` [C, H, BT, BT], read below its diagonal only) w.r.t. q and k,
    holding G fixed: ``dq_i = Σ_{j<i} dP_ij k_j ⊙ 2^{G_i−G_j}``, ``dk_j = Σ_{i>j} dP_ij q_i ⊙
    2^{G_i−G_j}``; [C, H, BT, K] each, through the same levels of halving. (The diagonal,
    ``dP_ii k_i`` and ``dP_ii q_i``, has no decay: the caller adds it.)"""
    q, k, G, dP = q.contiguous(), k.contiguous(), G.contiguous(), dP.contiguous()  # the levels are views
    dq, dk = torch.zeros_like(q), torch.zeros_like(k)
    for half in _levels(q.shape[2]):
        rows, cols, f_row, f_col = _factored_halves(q, k, G, half)  # [C, H, nb, half, K]
        dP_q = _quadrants(dP, half).permute(0, 1, 4, 2, 3)  # [C, H, nb, half, half]
        _halves(dq, half)[:, :, :, 1] += f_row * (dP_q @ cols)
        _halves(dk, half)[:, :, :, 0] += f_col * (dP_q.transpose(-1, -2) @ rows)
    return dq, dk


def intra_forward(q, k, v, G, h, scale: float) -> torch.Tensor:
    """The outputs of every chunk: ``o = s·[(q ⊙ 2^G) h + P v]`` [C, H, BT, V].

    q, k, G: [C, H, BT, K]; v: [C, H, BT, V]; h: [C, H, K, V] the state entering each chunk
    (all fp32, G in log2 units)."""
    P = intra_attention(q, k, G)
    return scale * ((q * torch.exp2(G)) @ h + P @ v)


def intra_backward(q, k, v, G, h, do, dh, scale: float, gate_grad: bool = True):
    """The chunks' gradients given ``dh`` [C, H, K, V], the gradient w.r.t. the state *leaving*
    each chunk: returns dq, dk [C,H,BT,K], dv [C,H,BT,V] and ``da`` [C,H,BT,K], the gradient
    w.r.t. each token's key-side natural-log gate (None unless ``gate_grad``), summed without
    the terms that cancel exactly (module docstring)."""
    P = intra_attention(q, k, G)
    dP = scale * (do @ v.transpose(-1, -2))  # dA_ij = s·do_i·v_j (read for j <= i only)
    dP_diag = dP.diagonal(dim1=-2, dim2=-1)[..., None]  # [C, H, BT, 1]
    G_end = G[:, :, -1:]  # [C, H, 1, K]: Γ (padded slots repeat the last valid token)
    to_end = torch.exp2(G_end - G)  # k_j's decay to the chunk's end, <= 1
    dv = scale * (P.transpose(-1, -2) @ do) + (k * to_end) @ dh
    dq_inter = scale * torch.exp2(G) * (do @ h.transpose(-1, -2))
    dk_inter = to_end * (v @ dh.transpose(-1, -2))
    dq_strict, dk_strict = intra_attention_grads(q, k, G, dP)
    dq = dq_inter + dq_strict + dP_diag * k
    dk = dk_inter + dk_strict + dP_diag * q
    da = None
    if gate_grad:
        x = q * (dq_inter + dq_strict) - k * dk_strict
        y = k * dk_inter
        y = torch.cat([torch.zeros_like(y[:, :, :1]), y[:, :, :-1]], 2)  # shift by one token (not
        # cumsum(y) − y: that subtracts y_t after adding it, and y_t is O(1) near the chunk's end)
        da = (x.flip(2).cumsum(2).flip(2)  # Σ_{i≥t}
              + y.cumsum(2)  # Σ_{j<t}
              + torch.exp2(G_end) * (h * dh).sum(-1)[:, :, None, :])  # the entering state's decay
    return dq, dk, dv, da


# ---------------------------------------------------------------------------------------------
# The op
# ---------------------------------------------------------------------------------------------

def _compute_dtype(x: torch.Tensor) -> torch.dtype:
    """The intra-chunk part runs in fp32 (in float64 for float64 inputs: gradcheck)."""
    return torch.float64 if x.dtype == torch.float64 else torch.float32


def _gate_cumsums(g, gk, chunk_size, cu_seqlens, dtype):
    """The kernels' gates: chunk-local cumsums in log2 units (``dtype``), or None."""
    Gg = None if g is None else chunk_local_cumsum(g, chunk_size, cu_seqlens, dtype=dtype)
    Gk = None if gk is None else chunk_local_cumsum(gk, chunk_size, cu_seqlens, dtype=dtype)
    return Gg, Gk


def _key_side_G(layout: ChunkLayout, Gg, Gk, like: torch.Tensor) -> torch.Tensor:
    """The key-side cumsum ``G = Gg + Gk`` (log2) in the chunk layout [C, H, BT, K]."""
    C, H, BT, K = like.shape
    G = like.new_zeros(C, H, BT, K)
    if Gg is not None:
        G = G + layout.to_chunks(Gg[..., None], pad="last")
    if Gk is not None:
        G = G + layout.to_chunks(Gk, pad="last")
    return G


class ChunkGLAFunction(torch.autograd.Function):
    """Autograd glue of :func:`chunk_gla` (inputs validated there)."""

    @staticmethod
    def forward(ctx, q, k, v, g, gk, scale, initial_state, output_final_state, cu_seqlens, chunk_size):
        B, T, H, K = q.shape
        Gg, Gk = _gate_cumsums(g, gk, chunk_size, cu_seqlens, _compute_dtype(q))
        h, ht = chunk_fwd_h(k, v, g=Gg, gk=Gk, h0=initial_state, output_final_state=output_final_state,
                            cu_seqlens=cu_seqlens, chunk_size=chunk_size, states_in_fp32=False)
        layout = ChunkLayout(B, T, cu_seqlens, chunk_size, q.device, _compute_dtype(q))
        qc, kc, vc = layout.to_chunks(q), layout.to_chunks(k), layout.to_chunks(v)
        G = _key_side_G(layout, Gg, Gk, qc)
        o = intra_forward(qc, kc, vc, G, h.reshape(layout.C, H, K, v.shape[-1]).to(layout.dtype), scale)
        ctx.save_for_backward(q, k, v, g, gk, initial_state, cu_seqlens)
        ctx.scale, ctx.chunk_size = scale, chunk_size
        ctx.set_materialize_grads(False)
        return layout.from_chunks(o).to(v.dtype), ht

    @staticmethod
    @once_differentiable  # its backward is not differentiable: a second derivative raises, never a wrong one
    def backward(ctx, do, dht):
        q, k, v, g, gk, initial_state, cu_seqlens = ctx.saved_tensors
        scale, BT = ctx.scale, ctx.chunk_size
        B, T, H, K = q.shape
        V = v.shape[-1]
        if do is None:  # only ht was used
            do = torch.zeros_like(v)
        do = do.to(q.dtype)
        Gg, Gk = _gate_cumsums(g, gk, BT, cu_seqlens, _compute_dtype(q))
        # States in fp32: the gate gradient amplifies bf16 rounding (module docstring).
        h, _ = chunk_fwd_h(k, v, g=Gg, gk=Gk, h0=initial_state, cu_seqlens=cu_seqlens, chunk_size=BT,
                           states_in_fp32=True)
        dh, dh0 = chunk_bwd_dh(q, k, v, do, initial_state, dht, scale, g=Gg, gk=Gk, cu_seqlens=cu_seqlens,
                               chunk_size=BT, states_in_fp32=True)
        layout = ChunkLayout(B, T, cu_seqlens, BT, q.device, _compute_dtype(q))
        qc, kc, vc, doc = (layout.to_chunks(x) for x in (q, k, v, do))
        G = _key_side_G(layout, Gg, Gk, qc)
        gated = g is not None or gk is not None
        dq, dk, dv, da = intra_backward(qc, kc, vc, G, h.reshape(layout.C, H, K, V).to(layout.dtype), doc,
                                        dh.reshape(layout.C, H, K, V).to(layout.dtype), scale, gate_grad=gated)
        dg = dgk = None
        if gated:  # a gate raised to MIN_GATE by the cumsum has no gradient (gates module docstring)
            da = layout.from_chunks(da)
            dgk = None if gk is None else torch.where(gk < MIN_GATE, 0.0, da).to(gk.dtype)
            dg = None if g is None else torch.where(g < MIN_GATE, 0.0, da.sum(-1)).to(g.dtype)
        dh0 = None if dh0 is None else dh0.to(initial_state.dtype)
        return (layout.from_chunks(dq).to(q.dtype), layout.from_chunks(dk).to(k.dtype),
                layout.from_chunks(dv).to(v.dtype), dg, dgk, None, dh0, None, None, None)


def chunk_gla(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor | None = None,
    gk: torch.Tensor | None = None,
    scale: float | None = None,
    initial_state: torch.Tensor | None = None,
    output_final_state: bool = False,
    cu_seqlens: torch.Tensor | None = None,
    chunk_size: int = 64,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Chunked gated linear attention, differentiable in every tensor argument.

    Per (sequence, head): ``S_t = diag(e^{g_t + gk_t}) S_{t-1} + k_t v_tᵀ``, ``o_t = scale·S_tᵀ q_t``,
    ``S_{-1} = initial_state`` (or 0). ``g`` alone is simple GLA (a Mamba-2-style scalar decay),
    ``gk`` alone is GLA; both may be given (their log-decays add), or neither (plain linear
    attention). The module docstring has the chunked math, its gradients and the design.

    Args:
        q, k: [B, T, H, K]; v: [B, T, H, V] (one dtype: fp16, bf16 or fp32).
        g: [B, T, H] scalar gate, gk: [B, T, H, K] per-key gate: *natural-log* per-token decays
            (e.g. ``F.logsigmoid(x)``), any float dtype; the op takes their chunk-local cumulative
            sums itself (log2 units for the kernels). For overflow safety they should be <= 0;
            −inf (a decay of zero) is allowed (``gates.MIN_GATE``); a NaN or +inf gate makes its
            (sequence, head)'s outputs non-finite from its token on, and ``ht`` and the gradients of
            that (sequence, head) too (not checked: a check would wait for the GPU). fla's
            ``chunk_gla`` names its per-key gate ``g``: pass it here as ``gk`` (fla's
            ``chunk_simple_gla``'s ``g`` is ``g``).
        scale: a real number (default ``K ** -0.5``, 1 when K = 0).
        initial_state: [N, H, K, V] (any float dtype), N = B, or the number of packed sequences.
        output_final_state: also return ``ht``.
        cu_seqlens: [N + 1] int32/int64 offsets of sequences packed along T (then B must be 1).
        chunk_size: BT, a power of two in [16, 256].
    Returns:
        o: [B, T, H, V] in v's dtype;
        ht: [N, H, K, V] fp32, the state after each sequence's last token (``initial_state``, or
            0, for an empty sequence), or None unless ``output_final_state``.
    Gradients: for q, k, v, g, gk and initial_state, in their dtypes (through ``ht`` too); once
        only: differentiating the gradients again raises RuntimeError.
    Raises:
        TypeError / ValueError naming the argument for wrong types, shapes, dtypes, devices,
        sizes, offsets or a non-real ``scale``.
    """
    q = _validate.sequence_tensor("q", q)
    B, T, H, K = q.shape
    if q.dtype not in (torch.float16, torch.bfloat16, torch.float32):
        raise TypeError(f"q must be fp16, bf16 or fp32 (what the kernels take), got {q.dtype}")
    k = _validate.tensor("k", k, (B, T, H, K), like=q)
    v = _validate.tensor("v", v, (B, T, H, None), like=q)
    for name, x in (("k", k), ("v", v)):
        if x.dtype != q.dtype:
            raise TypeError(f"{name} must have q's dtype {q.dtype}, got {x.dtype}")
    _validate.kernel_input("q", q)
    V = v.shape[-1]
    g, _, gk, _ = _validate.gates(B, T, H, K, V, g, None, gk, None, like=q)
    scale = _validate.scale(scale, K)  # K ** -0.5 by default (1 when K = 0: every output is 0 whatever the scale)
    output_final_state = _validate.flag("output_final_state", output_final_state)
    BT, _ = _validate.sizes(chunk_size, None)
    cu_seqlens, _, N = _validate.cu_seqlens(cu_seqlens, B, T, like=q)
    if initial_state is not None:
        initial_state = _validate.tensor("initial_state", initial_state, (N, H, K, V), like=q)
    return ChunkGLAFunction.apply(q, k, v, g, gk, scale, initial_state, output_final_state, cu_seqlens, BT)
