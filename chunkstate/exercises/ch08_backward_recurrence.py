"""Chapter 08: the chunked backward in PyTorch, and the exercise (a chunk's gradients from dh[n]).

``chunked_state_grads`` is the chapter's reverse chunk scan, with packed batches added: chapter
09 checks its kernels against it. Per (sequence, head), walking the chunks from the last::

    store dh                                         (if the chunk closes a split)
    dh  ←  diag(2^Γ) · dh · diag(2^Γv)               (back across the chunk's decay)
    dh  +=  scale · (q ⊙ 2^G)ᵀ (do ⊙ 2^Gv)           (the chunk's own outputs)

with ``G``, ``Gv`` the chunk-local log2 cumulative gates and ``Γ``, ``Γv`` their last values.

**Exercise.** Write ``chunk_grads(h, dh, q, k, v, do, gk, scale) -> (dq, dk, dv)``: the gradients of
one chunk's queries, keys and values, given the state entering the chunk ``h`` = h[n] and the
gradient of the state leaving it ``dh`` = dh[n], with GLA's key gate ``gk`` (natural log per
token; ``G`` its chunk-local cumulative sum in log2 units)::

    G_i    = log2(e) · Σ_{s<=i} gk_s  (chunk-local),  Γ = G_{L-1}
    P_ij   = Σ_k q_ik k_jk 2^{G_ik − G_jk}          (j <= i)
    dA_ij  = scale · do_i · v_j                      (j <= i)
    dq_i   = scale · 2^{G_i} ⊙ (h do_i)  +  Σ_{j<=i} dA_ij (k_j ⊙ 2^{G_i − G_j})
    dk_j   = 2^{Γ − G_j} ⊙ (dh v_j)      +  Σ_{i>=j} dA_ij (q_i ⊙ 2^{G_i − G_j})
    dv_j   = (k_j ⊙ 2^{Γ − G_j})ᵀ dh      +  scale · Σ_{i>=j} P_ij do_i

Shapes (float32): ``h``, ``dh`` [B,H,K,V]; ``q``, ``k``, ``gk`` [B,L,H,K]; ``v``, ``do`` [B,L,H,V]
(1 <= L <= BT). Returns ``dq``, ``dk`` [B,L,H,K] and ``dv`` [B,L,H,V]: the gradients of the whole
sequence's loss ``Σ o·do + ht·dht`` with respect to the chunk's q, k, v (gates held fixed). The
checker walks whole sequences chunk by chunk and compares with autograd through the token loop.
"""
from __future__ import annotations

import math

import torch
import torch.nn.functional as F

from ..gates import RCP_LN2, chunk_local_cumsum, prepare_chunk_offsets
from ..reference import recurrent_outputs, recurrent_states, state_grads
from ..testing import check_close


# ---- the chapter's PyTorch chunked backward (packed batches too) ----------------------------------

def chunked_state_grads(q, k, v, do, g=None, g_gamma=None, gk=None, gv=None, dht=None, cu_seqlens=None,
                        scale=None, chunk_size=64, split_size=None):
    """The reverse chunk scan in PyTorch: ``dh`` [B, NS, H, K, V] and ``dh0`` [N, H, K, V].

    Args:
        q: [B, T, HQ, K], do: [B, T, HQ, V] (HQ a multiple of H: with group = HQ // H, query
            head j reads state head j // group);
            k: [B, T, H, K], v: [B, T, H, V] give H and V only (the scan never reads them).
        g [B,T,H], g_gamma [H], gk [B,T,H,K], gv [B,T,H,V]: *natural-log* per-token gates, as the
            reference takes them; made into chunk-local log2 cumsums here, like the kernels get.
        dht: [N, H, K, V] gradient w.r.t. the final states, or None (zero).
        cu_seqlens: [N + 1] offsets of a packed batch (B = 1), or None.
        scale: the outputs' scale (default K ** -0.5).
        chunk_size: BT; split_size: BS, a multiple of BT (default BT).
    Returns:
        ``dh[:, s]`` the gradient w.r.t. the state *leaving* split s, counting only later outputs
        and ``dht`` (stored when the scan reaches the split's last chunk); ``dh0`` the gradient
        w.r.t. the initial state. Computed in float32 (float64 for float64 inputs).
    Raises:
        ValueError: ``split_size`` not a multiple of ``chunk_size``, or HQ not a multiple of H.
    """
    BT = chunk_size
    BS = split_size or BT
    if BS % BT:
        raise ValueError(f"split_size={BS} must be a multiple of chunk_size={BT}")
    B, T, H, K = k.shape
    V, HQ = v.shape[-1], q.shape[2]
    if HQ % H:
        raise ValueError(f"q's heads HQ={HQ} must be a multiple of k's H={H}")
    NG, CPS = HQ // H, BS // BT
    scale = K ** -0.5 if scale is None else scale
    dtype = torch.promote_types(q.dtype, torch.float32)
    a = torch.zeros(B, T, H, K, dtype=dtype, device=q.device)  # key-side natural-log decay per token
    if g is not None:
        a = a + g[..., None]
    if g_gamma is not None:
        a = a + g_gamma[:, None]
    if gk is not None:
        a = a + gk
    G = chunk_local_cumsum(a, BT, cu_seqlens, dtype=dtype)  # [B, T, H, K] log2, restarts every chunk
    Gv = chunk_local_cumsum(gv, BT, cu_seqlens, dtype=dtype) if gv is not None else None  # [B, T, H, V]
    qs = q.to(dtype).view(B, T, H, NG, K) * scale  # a state head's NG = HQ // H query heads side by side
    dos = do.to(dtype).view(B, T, H, NG, V)

    if cu_seqlens is None:
        NS = math.ceil(T / BS)
        segments = [(b, 0, T, b, b * NS) for b in range(B)]  # (row, first token, end, sequence, first slot)
        n_slots, N = B * NS, B
    else:
        cu = [int(c) for c in cu_seqlens.tolist()]
        offsets = prepare_chunk_offsets(cu_seqlens, BS).tolist()
        N = len(cu) - 1
        segments = [(0, cu[n], cu[n + 1], n, offsets[n]) for n in range(N)]
        n_slots = offsets[-1]
    dh = torch.zeros(n_slots, H, K, V, dtype=dtype, device=q.device)
    dh0 = torch.zeros(N, H, K, V, dtype=dtype, device=q.device)
    for b, bos, eos, n, slot0 in segments:
        d = dht[n].to(dtype) if dht is not None else dh0.new_zeros(H, K, V)  # [H, K, V]
        NT = math.ceil((eos - bos) / BT)
        for i_t in range(NT - 1, -1, -1):
            s = bos + i_t * BT
            e = min(s + BT, eos)
            if i_t % CPS == CPS - 1 or i_t == NT - 1:  # the chunk closes a split: store, then go on
                dh[slot0 + i_t // CPS] = d
            d = torch.exp2(G[b, e - 1])[..., None] * d  # diag(2^Γ) dh
            q_c = qs[b, s:e] * torch.exp2(G[b, s:e])[:, :, None]  # q ⊙ 2^G      [L, H, NG, K]
            do_c = dos[b, s:e]  # [L, H, NG, V]
            if Gv is not None:
                d = d * torch.exp2(Gv[b, e - 1])[:, None, :]  # · diag(2^Γv)
                do_c = do_c * torch.exp2(Gv[b, s:e])[:, :, None]  # do ⊙ 2^Gv
            d = d + torch.einsum("lhgk,lhgv->hkv", q_c, do_c)  # summed over tokens and the group
        dh0[n] = d
    dh = dh.view(B, -1, H, K, V) if cu_seqlens is None else dh[None]
    return dh, dh0


# ---- the exercise ------------------------------------------------------------------------------

CASES = [  # (B, T, H, K, V, BT)
    (1, 1, 1, 4, 3, 16),      # one token: a chunk of length 1
    (2, 100, 2, 12, 10, 32),  # last chunk of 4 tokens
    (1, 64, 2, 9, 17, 64),    # exactly one full chunk, K and V odd
    (1, 70, 1, 20, 6, 16),
]


def chunk_grads(h, dh, q, k, v, do, gk, scale):
    """The shipped solution (see the module docstring for the formulas and shapes)."""
    L = q.shape[1]
    G = RCP_LN2 * gk.cumsum(1)  # [B, L, H, K] chunk-local, log2 units
    Gamma = G[:, -1]  # [B, H, K]
    causal = torch.ones(L, L, dtype=torch.bool, device=q.device).tril()  # [i, j]: j <= i
    diff = (G[:, :, None] - G[:, None, :]).masked_fill(~causal[None, :, :, None, None], -math.inf)
    W = torch.exp2(diff)  # [B, i, j, H, K]: 2^{G_i − G_j}, 0 where j > i
    P = torch.einsum("bihk,bjhk,bijhk->bhij", q, k, W)  # [B, H, L, L]
    dA = scale * torch.einsum("bihv,bjhv->bhij", do, v) * causal  # [B, H, L, L]
    k_out = k * torch.exp2(Gamma[:, None] - G)  # k_j ⊙ 2^{Γ − G_j}: how k_j reaches the next chunk
    dq = scale * torch.exp2(G) * torch.einsum("bhkv,bihv->bihk", h, do) \
        + torch.einsum("bhij,bjhk,bijhk->bihk", dA, k, W)
    dk = torch.exp2(Gamma[:, None] - G) * torch.einsum("bhkv,bjhv->bjhk", dh, v) \
        + torch.einsum("bhij,bihk,bijhk->bjhk", dA, q, W)
    dv = torch.einsum("bjhk,bhkv->bjhv", k_out, dh) + scale * torch.einsum("bhij,bihv->bjhv", P, do)
    return dq, dk, dv


def _triple(out, name):
    if not (isinstance(out, tuple) and len(out) == 3 and all(isinstance(x, torch.Tensor) for x in out)):
        raise AssertionError(f"{name} must return a tuple (dq, dk, dv) of three tensors, got {type(out).__name__}")
    return out


def check_chunk_grads(fn=None) -> None:
    """Run ``fn`` (default: the shipped solution) on every chunk of whole sequences.

    For each chunk it hands ``fn`` the state entering it (``reference.recurrent_states``) and the
    gradient of the state leaving it (``reference.state_grads``) and compares ``dq``, ``dk``,
    ``dv`` with autograd through the float64 token loop, on fresh random inputs with ``h0`` and
    ``dht``. Raises ``AssertionError`` naming the shape, the chunk and the gradient; an exception
    raised inside ``fn`` (such as ``NotImplementedError``) propagates unchanged.
    """
    fn = chunk_grads if fn is None else fn
    name = getattr(fn, "__name__", "your function")
    for B, T, H, K, V, BT in CASES:
        q, k = torch.randn(B, T, H, K), torch.randn(B, T, H, K)
        v, do = torch.randn(B, T, H, V), torch.randn(B, T, H, V)
        h0, dht = torch.randn(B, H, K, V), torch.randn(B, H, K, V)
        gk = F.logsigmoid(torch.randn(B, T, H, K)) / 4
        scale = K ** -0.5
        leaves = [x.double().requires_grad_() for x in (q, k, v)]
        o, ht = recurrent_outputs(*leaves, gk=gk, h0=h0, scale=scale)
        loss = (o * do.double()).sum() + (ht * dht.double()).sum()
        refs = torch.autograd.grad(loss, leaves)
        h, _ = recurrent_states(k, v, gk=gk, h0=h0, chunk_size=BT)  # entering each chunk
        dh, _ = state_grads(q, k, v, do, gk=gk, h0=h0, dht=dht, scale=scale, chunk_size=BT)  # leaving
        shape = f"B={B}, T={T}, H={H}, K={K}, V={V}, BT={BT}"
        for n, s in enumerate(range(0, T, BT)):
            e = min(s + BT, T)
            args = [h[:, n].float(), dh[:, n].float()] + [x[:, s:e].clone() for x in (q, k, v, do, gk)]
            got = _triple(fn(*args, scale), name)
            for what, x, ref in zip(("dq", "dk", "dv"), got, refs):
                check_close(x, ref[:, s:e], f"{name}: {what} of chunk {n}, tokens {s}..{e - 1} ({shape})", tol=1e-5)
    print(f"{name} gives every chunk's dq, dk, dv of the token loop on {len(CASES)} shapes")
