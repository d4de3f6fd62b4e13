"""The oracle: the gated state recurrence as plain float64 PyTorch, token by token.

Per sequence and head the state is ``h ∈ R^{K×V}``. With *natural-log* per-token gates
(any combination, each optional)::

    a_t = g_t + g_gamma + gk_t          # [K]  log-decay of the key side
    b_t = gv_t                          # [V]  log-decay of the value side
    S_t = diag(e^{a_t}) · S_{t-1} · diag(e^{b_t}) + k_t v_tᵀ
    o_t = scale · S_tᵀ q_t

Shapes (time-major, like fla): ``q`` [B,T,HQ,K], ``k`` [B,T,H,K], ``v`` [B,T,H,V], ``g`` [B,T,H],
``g_gamma`` [H], ``gk`` [B,T,H,K], ``gv`` [B,T,H,V], ``h0`` [N,H,K,V]. A packed batch has B = 1 and
``cu_seqlens`` [N+1]; otherwise N = B. With GQA, ``HQ / H`` query heads share each state head:
query head j reads state j // (HQ // H).

The chunked and masked forms below cumulate the gates as chapter 00's notation does, in *log2
units*: ``G_t = log2(e) · Σ a_s`` (key side), ``Gv_t = log2(e) · Σ b_s`` (value side), so a decay
is ``2^(G_t − G_j)``; in :func:`chunked_states` the sums restart every chunk and ``Γ``, ``Γ_v`` are
their values at the chunk's last token.

States are stored at *split* boundaries: a split is ``split_size`` tokens (default
``chunk_size``) of one sequence; ``h[s]`` is the state *entering* split s, shaped
[B, NS, H, K, V] (packed: [1, sum_n ceil(L_n / BS), H, K, V], sequence n's splits starting at
``gates.prepare_chunk_offsets(cu_seqlens, BS)[n]``).

Everything is computed and returned in float64; pass any float dtype, on any one device.
Every function first checks its arguments (``_check``): a shape that does not match (never a
broadcast), a tensor not floating-point or on another device, bad ``cu_seqlens`` offsets, a
``scale`` not a finite real number or a chunk / split size not a positive int (the split a multiple
of the chunk) is a TypeError / ValueError naming the argument.
"""
from __future__ import annotations

import math

import torch

from . import _host, _validate
from .gates import RCP_LN2, prepare_chunk_offsets

_NOT_TAKEN = object()  # _check's default for q / do: the checked function has no such argument


def _check(k, v, g, g_gamma, gk, gv, h0, cu_seqlens=None, *, q=_NOT_TAKEN, do=_NOT_TAKEN, dht=None, scale=None,
           sizes=None):
    """The arguments of the functions below, checked before anything is computed: exact shapes
    (module doc; q / do with HQ heads, a positive multiple of H), float tensors (any float dtype,
    any strides) on k's device, packed-batch offsets (B = 1; 0 first, never decreasing, T last),
    ``scale`` a finite real number, ``sizes`` = (chunk_size, split_size) for a function that takes
    them. Returns ``scale`` (a float; K ** -0.5 when None, 1 when K = 0) and the split (an int,
    ``chunk_size`` when ``split_size`` is None; None without ``sizes``)."""
    B, T, H, K = _validate.sequence_tensor("k", k, contiguous=False).shape
    _validate.tensor("v", v, (B, T, H, None), like=k, contiguous=False)
    V = v.shape[-1]
    _validate.gates(B, T, H, K, V, g, g_gamma, gk, gv, like=k)
    _, _, N = _validate.cu_seqlens(cu_seqlens, B, T, like=k)
    for name, x in (("h0", h0), ("dht", dht)):
        if x is not None:
            _validate.tensor(name, x, (N, H, K, V), like=k, contiguous=False)
    if q is not _NOT_TAKEN:
        _validate.tensor("q", q, (B, T, None, K), like=k, contiguous=False)
        _validate.query_heads(q.shape[2], H)
    if do is not _NOT_TAKEN:
        _validate.tensor("do", do, (B, T, q.shape[2], V), like=k, contiguous=False)
    scale = _validate.scale(scale, K, fp32=False)
    if sizes is None:
        return scale, None
    chunk_size = _validate.positive_int("chunk_size", sizes[0])
    if sizes[1] is None:
        return scale, chunk_size
    split_size = _validate.positive_int("split_size", sizes[1])
    if split_size % chunk_size:
        raise ValueError(f"split_size must be a positive multiple of chunk_size={chunk_size}, got {split_size}")
    return scale, split_size


def _f64(x):
    return None if x is None else x.to(torch.float64)


def _segments(B: int, T: int, cu_seqlens):
    """(batch row, first token, end token, sequence index) for each sequence."""
    if cu_seqlens is None:
        return [(b, 0, T, b) for b in range(B)]
    cu = _host.host_offsets(cu_seqlens)  # as _check read them (a CUDA tensor's are cached: no second sync)
    return [(0, cu[n], cu[n + 1], n) for n in range(len(cu) - 1)]


def _log_decays(B, T, H, K, V, g, g_gamma, gk, gv, device):
    """Per-token log-decays: key side a [B,T,H,K], value side b [B,T,H,V] or None."""
    a = torch.zeros(B, T, H, K, dtype=torch.float64, device=device)
    if g is not None:
        a = a + _f64(g)[..., None]
    if g_gamma is not None:
        a = a + _f64(g_gamma)[:, None]
    if gk is not None:
        a = a + _f64(gk)
    b = _f64(gv) if gv is not None else None
    return a, b


def _scan(k, v, q=None, g=None, g_gamma=None, gk=None, gv=None, h0=None, cu_seqlens=None,
          split_size=64, scale=1.0, leaves=None):
    """Run the recurrence. Returns (h [B,NS,H,K,V], ht [N,H,K,V], o [B,T,HQ,V] or None).

    ``leaves``: optional list of [H,K,V] tensors, one per stored split (in h's slot order); each is
    added to the state *after* the output of the split's last token, so its gradient is the
    gradient w.r.t. the state leaving that split, counting only later outputs.
    """
    B, T, H, K = k.shape
    V = v.shape[-1]
    k, v, q = _f64(k), _f64(v), _f64(q)
    a, b = _log_decays(B, T, H, K, V, g, g_gamma, gk, gv, k.device)
    segs = _segments(B, T, cu_seqlens)
    HQ = q.shape[2] if q is not None else H
    group = HQ // H if H else 1  # query heads per state head (GQA)
    states, finals = [], []
    outs = [[None] * T for _ in range(B)] if q is not None else None
    slot = 0
    for (bi, bos, eos, n) in segs:
        S = _f64(h0[n]) if h0 is not None else k.new_zeros(H, K, V)
        for t in range(bos, eos):
            if (t - bos) % split_size == 0:
                states.append((bi, S))
            S = torch.exp(a[bi, t])[..., None] * S
            if b is not None:
                S = S * torch.exp(b[bi, t])[:, None, :]
            S = S + k[bi, t][..., None] * v[bi, t][:, None, :]
            if q is not None:
                S_q = S.repeat_interleave(group, 0) if group > 1 else S  # [HQ, K, V]
                outs[bi][t] = scale * torch.einsum("hkv,hk->hv", S_q, q[bi, t])
            if leaves is not None and ((t - bos) % split_size == split_size - 1 or t == eos - 1):
                S = S + leaves[slot]
                slot += 1
        finals.append(S)
    if cu_seqlens is None:
        NS = math.ceil(T / split_size)
        h = torch.stack([s for _, s in states]).view(B, NS, H, K, V) if states else k.new_zeros(B, NS, H, K, V)
    else:
        h = torch.stack([s for _, s in states])[None] if states else k.new_zeros(1, 0, H, K, V)
    ht = torch.stack(finals) if finals else k.new_zeros(0, H, K, V)  # (B = 0: no sequence)
    o = None
    if q is not None:
        zero = q.new_zeros(HQ, V)
        o = torch.stack([torch.stack([x if x is not None else zero for x in row]) for row in outs]) \
            if T > 0 and B > 0 else q.new_zeros(B, T, HQ, V)
    return h, ht, o


def recurrent_states(k, v, g=None, g_gamma=None, gk=None, gv=None, h0=None, cu_seqlens=None,
                     chunk_size=64, split_size=None):
    """The token loop's stored states: ``h`` [B,NS,H,K,V] (state entering each split) and the
    final state ``ht`` [N,H,K,V], both float64. Gates are natural-log per token (module doc)."""
    _, split_size = _check(k, v, g, g_gamma, gk, gv, h0, cu_seqlens, sizes=(chunk_size, split_size))
    h, ht, _ = _scan(k, v, None, g, g_gamma, gk, gv, h0, cu_seqlens, split_size)
    return h, ht


def recurrent_outputs(q, k, v, g=None, g_gamma=None, gk=None, gv=None, h0=None, cu_seqlens=None,
                      scale=None):
    """The token loop's outputs ``o_t = scale · S_tᵀ q_t``: ``o`` [B,T,HQ,V] and ``ht`` [N,H,K,V],
    float64. ``scale`` defaults to K ** -0.5."""
    scale, _ = _check(k, v, g, g_gamma, gk, gv, h0, cu_seqlens, q=q, scale=scale)
    _, ht, o = _scan(k, v, q, g, g_gamma, gk, gv, h0, cu_seqlens, max(k.shape[1], 1), scale)
    return o, ht


def state_grads(q, k, v, do, g=None, g_gamma=None, gk=None, gv=None, h0=None, dht=None,
                cu_seqlens=None, scale=None, chunk_size=64, split_size=None):
    """Gradients of the stored states, by autograd through the token loop.

    The loss is ``sum(o · do) + sum(ht · dht)`` with ``o`` from :func:`recurrent_outputs`.
    Returns ``dh`` [B,NS,H,K,V]: the gradient w.r.t. the state *leaving* split s (after its last
    token), counting only outputs after split s and ``dht`` — what the backward kernel stores —
    and ``dh0`` [N,H,K,V], the gradient w.r.t. ``h0`` (zeros-initial state when ``h0`` is None).
    With GQA (``HQ / H`` query heads per state head) the gradient of a shared state sums over
    its query heads.
    """
    scale, split_size = _check(k, v, g, g_gamma, gk, gv, h0, cu_seqlens, q=q, do=do, dht=dht, scale=scale,
                               sizes=(chunk_size, split_size))
    B, T, H, K = k.shape
    V = v.shape[-1]
    segs = _segments(B, T, cu_seqlens)
    N = len(segs)
    if cu_seqlens is None:
        n_slots = B * math.ceil(T / split_size)
    else:
        n_slots = int(prepare_chunk_offsets(cu_seqlens, split_size)[-1])
    with torch.enable_grad():
        leaves = [k.new_zeros(H, K, V, dtype=torch.float64, requires_grad=True) for _ in range(n_slots)]
        h0_leaf = (_f64(h0) if h0 is not None else k.new_zeros(N, H, K, V, dtype=torch.float64)) \
            .detach().requires_grad_(True)
        _, ht, o = _scan(k.detach(), v.detach(), q.detach(), g, g_gamma, gk, gv, h0_leaf, cu_seqlens,
                         split_size, scale, leaves)
        loss = (o * _f64(do)).sum()
        if dht is not None:
            loss = loss + (ht * _f64(dht)).sum()
        grads = torch.autograd.grad(loss, leaves + [h0_leaf], allow_unused=True) if loss.requires_grad \
            else [None] * (n_slots + 1)  # no output and no dht (T = 0): every gradient is zero
    dh_list = [x if x is not None else torch.zeros(H, K, V, dtype=torch.float64, device=k.device)
               for x in grads[:-1]]
    if cu_seqlens is None:
        NS = math.ceil(T / split_size)
        dh = torch.stack(dh_list).view(B, NS, H, K, V) if dh_list else k.new_zeros(B, NS, H, K, V, dtype=torch.float64)
    else:
        dh = torch.stack(dh_list)[None] if dh_list else k.new_zeros(1, 0, H, K, V, dtype=torch.float64)
    return dh, (grads[-1] if grads[-1] is not None else torch.zeros_like(h0_leaf))


def chunked_states(k, v, g=None, g_gamma=None, gk=None, gv=None, h0=None, cu_seqlens=None,
                   chunk_size=64, split_size=None):
    """The same states as :func:`recurrent_states`, one matmul per chunk (float64).

    Inside a chunk of L tokens with the chunk-local inclusive cumulative log-decays in log2 units,
    ``G_i`` (key side) and ``G_v,i`` (value side), and ``Γ = G_{L-1}``, ``Γ_v = G_v,L-1``::

        h_out = diag(2^Γ) h_in diag(2^Γ_v) + (k_n ⊙ 2^(Γ − G))ᵀ (v_n ⊙ 2^(Γ_v − G_v))

    with ``k_n`` [L, K], ``v_n`` [L, V] the chunk's rows.

    Every exponent is ``<= 0`` for decaying gates: nothing overflows however long the sequence.
    """
    _, split_size = _check(k, v, g, g_gamma, gk, gv, h0, cu_seqlens, sizes=(chunk_size, split_size))
    B, T, H, K = k.shape
    V = v.shape[-1]
    k, v = _f64(k), _f64(v)
    a, b = _log_decays(B, T, H, K, V, g, g_gamma, gk, gv, k.device)
    states, finals = [], []
    for (bi, bos, eos, n) in _segments(B, T, cu_seqlens):
        S = _f64(h0[n]) if h0 is not None else k.new_zeros(H, K, V)
        for s in range(bos, eos, chunk_size):
            e = min(s + chunk_size, eos)
            if (s - bos) % split_size == 0:
                states.append(S)
            G = RCP_LN2 * a[bi, s:e].cumsum(0)  # [L, H, K]  chunk-local, log2 units
            k_c = k[bi, s:e] * torch.exp2(G[-1] - G)  # k_n ⊙ 2^(Γ − G)   [L, H, K]
            S = torch.exp2(G[-1])[..., None] * S  # diag(2^Γ) h
            v_c = v[bi, s:e]
            if b is not None:
                Gv = RCP_LN2 * b[bi, s:e].cumsum(0)  # [L, H, V]
                v_c = v_c * torch.exp2(Gv[-1] - Gv)  # v_n ⊙ 2^(Γ_v − G_v)
                S = S * torch.exp2(Gv[-1])[:, None, :]  # h diag(2^Γ_v)
            S = S + torch.einsum("lhk,lhv->hkv", k_c, v_c)
        finals.append(S)
    if cu_seqlens is None:
        NS = math.ceil(T / split_size)
        h = torch.stack(states).view(B, NS, H, K, V) if states else k.new_zeros(B, NS, H, K, V)
    else:
        h = torch.stack(states)[None] if states else k.new_zeros(1, 0, H, K, V)
    return h, (torch.stack(finals) if finals else k.new_zeros(0, H, K, V))


def parallel_outputs(q, k, v, g=None, g_gamma=None, gk=None, gv=None, h0=None, scale=None):
    """The outputs in the masked "attention" form, no state at all (dense batches only)::

        o_i = scale · Σ_{j<=i} Σ_k q_ik k_jk 2^(G_ik − G_jk) · v_j ⊙ 2^(G_v,i − G_v,j)
              + scale · (q_i ⊙ 2^(G_i))ᵀ h0 diag(2^(G_v,i))

    with ``G``, ``G_v`` the inclusive cumulative log-decays in log2 units over the whole sequence
    (from its start, as in chapter 02). O(T²) memory:
    for checking the loop on small T only. Returns ``o`` [B,T,HQ,V] float64.
    """
    scale, _ = _check(k, v, g, g_gamma, gk, gv, h0, q=q, scale=scale)
    B, T, H, K = k.shape
    V = v.shape[-1]
    HQ = q.shape[2]
    q, k, v = _f64(q), _f64(k), _f64(v)
    a, b = _log_decays(B, T, H, K, V, g, g_gamma, gk, gv, k.device)
    G = RCP_LN2 * a.cumsum(1)  # [B, T, H, K]  from the sequence start, log2 units
    Gv = RCP_LN2 * b.cumsum(1) if b is not None else torch.zeros_like(v)
    group = HQ // H if H else 1  # query heads per state head (GQA)
    rep = lambda x: x.repeat_interleave(group, 2)  # noqa: E731  state head -> its query heads
    G, Gv, k, v = rep(G), rep(Gv), rep(k), rep(v)
    causal = torch.ones(T, T, dtype=torch.bool, device=k.device).tril()  # [i, j]: j <= i
    dG = (G[:, :, None] - G[:, None, :]).masked_fill(~causal[None, :, :, None, None], -math.inf)
    dGv = (Gv[:, :, None] - Gv[:, None, :]).masked_fill(~causal[None, :, :, None, None], -math.inf)
    scores = torch.einsum("bihk,bjhk,bijhk->bijh", q, k, torch.exp2(dG))  # [B, T, T, HQ]
    o = torch.einsum("bijh,bjhv,bijhv->bihv", scores, v, torch.exp2(dGv))
    if h0 is not None:
        h0r = _f64(h0).repeat_interleave(group, 1)  # [B, HQ, K, V]
        o = o + torch.einsum("bihk,bhkv->bihv", q * torch.exp2(G), h0r) * torch.exp2(Gv)
    return scale * o
