"""Chapter 10 exercises: how a chunk consumes the states the kernels store.

Both work on one chunk of L tokens (1 <= L <= BT) with a per-key-dimension gate (GLA's ``gk``,
*natural-log* per token, <= 0), every batch row and head at once. Shapes (float32): ``q``, ``k``,
``gk`` [B, L, H, K]; ``v``, ``do`` [B, L, H, V]; states [B, H, K, V]. Inside the chunk
``G = cumsum(gk)`` over its tokens (chunk-local, natural log) and ``Γ = G[last token]``.

1. ``inter_output(q, gk, h, scale) -> o_inter`` [B, L, H, V]: what the state ``h`` *entering* the
   chunk contributes to its outputs::

       o_inter_i = scale · (q_i ⊙ e^{G_i})ᵀ h

   The checker walks whole sequences chunk by chunk, feeding the states ``h[n]`` of the float64
   token loop, and compares with the loop's outputs from ``h[n]`` minus its outputs from a zero
   state (the state enters the outputs linearly, so the difference is exactly the inter part).

2. ``chunk_dv(q, k, v, gk, do, dh, scale) -> dv`` [B, L, H, V]: the gradient of the loss w.r.t.
   the chunk's values, given ``do`` (the gradient of its outputs) and ``dh`` (the gradient w.r.t.
   the state *leaving* the chunk, counting the later outputs and ``dht``)::

       P_ij = Σ_k q_ik k_jk e^{G_ik − G_jk}   (j <= i, else 0)
       dv_j = scale · Σ_{i>=j} P_ij do_i  +  (k_j ⊙ e^{Γ − G_j})ᵀ dh

   The checker takes ``dh`` per chunk from ``reference.state_grads`` and compares every chunk's
   ``dv`` with autograd through the float64 token loop (loss ``Σ o·do + Σ ht·dht``, with h0).
"""
from __future__ import annotations

import math

import torch
import torch.nn.functional as F

from ..reference import recurrent_outputs, recurrent_states, state_grads
from ..testing import check_close

CASES = [  # (B, T, H, K, V, BT)
    (1, 1, 1, 4, 3, 16),      # one token: a chunk of length 1
    (2, 100, 2, 12, 10, 32),  # last chunk of 4 tokens
    (1, 64, 3, 9, 17, 64),    # exactly one full chunk, K and V odd
    (1, 70, 1, 20, 6, 16),
]
TOL = 1e-5  # float32 answers against float64 references


def inter_output(q, gk, h, scale):
    """The shipped solution of exercise 1 (module docstring)."""
    G = gk.cumsum(1)  # [B, L, H, K] chunk-local, natural log
    return scale * torch.einsum("blhk,bhkv->blhv", q * torch.exp(G), h)


def chunk_dv(q, k, v, gk, do, dh, scale):
    """The shipped solution of exercise 2 (module docstring)."""
    G = gk.cumsum(1)  # [B, L, H, K]
    Gamma = G[:, -1]  # [B, H, K]
    L = q.shape[1]
    causal = torch.ones(L, L, dtype=torch.bool, device=q.device).tril()  # [i, j]: j <= i
    diff = (G[:, :, None] - G[:, None, :]).masked_fill(~causal[None, :, :, None, None], -math.inf)
    P = torch.einsum("bihk,bjhk,bijhk->bhij", q, k, torch.exp(diff))  # [B, H, L(i), L(j)]
    dv_intra = scale * torch.einsum("bhij,bihv->bjhv", P, do)  # the chunk's own later outputs
    dv_inter = torch.einsum("bjhk,bhkv->bjhv", k * torch.exp(Gamma[:, None] - G), dh)  # through dh
    return dv_intra + dv_inter


def _tensor(out, name, what):
    if not isinstance(out, torch.Tensor):
        raise AssertionError(f"{name} must return a tensor ({what}), got {type(out).__name__}")
    return out


def _inputs(B, T, H, K, V):
    q, k = torch.randn(B, T, H, K), torch.randn(B, T, H, K)
    v, do, h0 = torch.randn(B, T, H, V), torch.randn(B, T, H, V), torch.randn(B, H, K, V)
    gk = F.logsigmoid(torch.randn(B, T, H, K)) / 4
    return q, k, v, do, h0, gk


def check_inter_output(fn=None) -> None:
    """Run ``fn`` (default: the shipped solution) on every chunk of fresh random sequences.

    Raises ``AssertionError`` naming the shape and the chunk; an exception raised inside ``fn``
    (such as ``NotImplementedError``) propagates unchanged.
    """
    fn = inter_output if fn is None else fn
    name = getattr(fn, "__name__", "your function")
    for B, T, H, K, V, BT in CASES:
        q, k, v, _, h0, gk = _inputs(B, T, H, K, V)
        scale = K ** -0.5
        h, _ = recurrent_states(k, v, gk=gk, h0=h0, chunk_size=BT)  # h[:, n]: state entering chunk n
        shape = f"B={B}, T={T}, H={H}, K={K}, V={V}, BT={BT}"
        for n, s in enumerate(range(0, T, BT)):
            e = min(s + BT, T)
            c = slice(s, e)
            from_state, _ = recurrent_outputs(q[:, c], k[:, c], v[:, c], gk=gk[:, c], h0=h[:, n], scale=scale)
            from_zero, _ = recurrent_outputs(q[:, c], k[:, c], v[:, c], gk=gk[:, c], scale=scale)
            out = _tensor(fn(q[:, c].clone(), gk[:, c].clone(), h[:, n].float(), scale), name, "o_inter")
            check_close(out, from_state - from_zero,
                        f"{name}: inter-chunk outputs of chunk {n}, tokens {s}..{e - 1} ({shape})", tol=TOL)
    print(f"{name} gives the state's share of every chunk's outputs on {len(CASES)} shapes")


def check_chunk_dv(fn=None) -> None:
    """Run ``fn`` (default: the shipped solution) on every chunk of fresh random sequences and
    compare with autograd through the float64 token loop.

    Raises ``AssertionError`` naming the shape and the chunk; an exception raised inside ``fn``
    (such as ``NotImplementedError``) propagates unchanged.
    """
    fn = chunk_dv if fn is None else fn
    name = getattr(fn, "__name__", "your function")
    for B, T, H, K, V, BT in CASES:
        q, k, v, do, h0, gk = _inputs(B, T, H, K, V)
        dht = torch.randn(B, H, K, V)
        scale = K ** -0.5
        v64 = v.double().requires_grad_()
        o, ht = recurrent_outputs(q, k, v64, gk=gk, h0=h0, scale=scale)
        (dv_ref,) = torch.autograd.grad((o * do.double()).sum() + (ht * dht.double()).sum(), [v64])
        dh, _ = state_grads(q, k, v, do, gk=gk, h0=h0, dht=dht, scale=scale, chunk_size=BT)  # leaving chunk n
        shape = f"B={B}, T={T}, H={H}, K={K}, V={V}, BT={BT}"
        for n, s in enumerate(range(0, T, BT)):
            e = min(s + BT, T)
            c = slice(s, e)
            out = _tensor(fn(q[:, c].clone(), k[:, c].clone(), v[:, c].clone(), gk[:, c].clone(),
                             do[:, c].clone(), dh[:, n].float(), scale), name, "dv")
            check_close(out, dv_ref[:, c], f"{name}: dv of chunk {n}, tokens {s}..{e - 1} ({shape})", tol=TOL)
    print(f"{name} reproduces autograd's dv chunk by chunk on {len(CASES)} shapes")
