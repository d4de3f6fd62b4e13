"""Chapter 03 exercise: one full chunk step — the chunk's outputs and the state leaving it.

Write ``chunk_step(h, q, k, v, gk, scale) -> (o, h_next)`` for one chunk of L tokens
(1 <= L <= BT) with a per-key-dimension gate (GLA's ``gk``), all batch rows and heads at once::

    G      = cumsum of gk over the chunk's tokens          (chunk-local, natural log)   [B,L,H,K]
    Γ      = G[last token]                                                               [B,H,K]
    o_i    = scale · [ (q_i ⊙ e^{G_i})ᵀ h  +  Σ_{j<=i} (Σ_k q_ik k_jk e^{G_ik − G_jk}) v_j ]
    h_next = diag(e^{Γ}) h + (k ⊙ e^{Γ − G})ᵀ v

Shapes (float32): ``h`` [B,H,K,V] (the state entering the chunk), ``q``, ``k``, ``gk`` [B,L,H,K]
(``gk`` natural-log, <= 0), ``v`` [B,L,H,V]; returns ``o`` [B,L,H,V] and ``h_next`` [B,H,K,V].

The checker walks whole sequences chunk by chunk with your step (the last chunk shorter than BT)
and compares every output and every state with the token loop (:mod:`chunkstate.reference`).
"""
from __future__ import annotations

import math

import torch
import torch.nn.functional as F

from ..reference import recurrent_outputs, recurrent_states
from ..testing import check_close

CASES = [  # (B, T, H, K, V, BT)
    (1, 1, 1, 4, 3, 16),      # one token: a chunk of length 1
    (2, 100, 2, 12, 10, 32),  # last chunk of 4 tokens
    (1, 64, 3, 9, 17, 64),    # exactly one full chunk, K and V odd
    (1, 70, 1, 20, 6, 16),
]


def chunk_step(h, q, k, v, gk, scale):
    """The shipped solution (see the module docstring for the formula and shapes)."""
    G = gk.cumsum(1)                                                # [B, L, H, K]
    Gamma = G[:, -1]                                                # [B, H, K]
    L = q.shape[1]
    o_inter = torch.einsum("blhk,bhkv->blhv", q * torch.exp(G), h)  # what the past contributes
    causal = torch.ones(L, L, dtype=torch.bool, device=q.device).tril()  # [i, j]: j <= i
    diff = (G[:, :, None] - G[:, None, :])                          # [B, i, j, H, K]: G_i − G_j
    diff = diff.masked_fill(~causal[None, :, :, None, None], -math.inf)  # e^{...} = 0 where j > i
    P = torch.einsum("bihk,bjhk,bijhk->bhij", q, k, torch.exp(diff))  # [B, H, L, L]
    o_intra = torch.einsum("bhij,bjhv->bihv", P, v)                 # this chunk's own tokens
    h_next = torch.exp(Gamma)[..., None] * h + torch.einsum("blhk,blhv->bhkv", k * torch.exp(Gamma[:, None] - G), v)
    return scale * (o_inter + o_intra), h_next


def _pair(out, name):
    if not (isinstance(out, tuple) and len(out) == 2 and all(isinstance(x, torch.Tensor) for x in out)):
        raise AssertionError(f"{name} must return a tuple (o, h_next) of two tensors, got {type(out).__name__}")
    return out


def check_chunk_step(fn=None) -> None:
    """Run ``fn`` (default: the shipped solution) over whole sequences, chunk by chunk.

    Compares the outputs and the state leaving every chunk with the float64 token loop, on fresh
    random inputs. Raises ``AssertionError`` naming the shape, the chunk and what is wrong; an
    exception raised inside ``fn`` (such as ``NotImplementedError``) propagates unchanged.
    """
    fn = chunk_step if fn is None else fn
    name = getattr(fn, "__name__", "your function")
    for B, T, H, K, V, BT in CASES:
        q, k = torch.randn(B, T, H, K), torch.randn(B, T, H, K)
        v, h0 = torch.randn(B, T, H, V), torch.randn(B, H, K, V)
        gk = F.logsigmoid(torch.randn(B, T, H, K)) / 4
        scale = K ** -0.5
        o_ref, ht_ref = recurrent_outputs(q, k, v, gk=gk, h0=h0, scale=scale)
        h_ref, _ = recurrent_states(k, v, gk=gk, h0=h0, chunk_size=BT)  # state entering each chunk
        shape = f"B={B}, T={T}, H={H}, K={K}, V={V}, BT={BT}"
        h = h0.clone()
        for n, s in enumerate(range(0, T, BT)):
            e = min(s + BT, T)
            check_close(h, h_ref[:, n], f"{name}: state entering chunk {n} ({shape})", tol=1e-5)
            o_c, h = _pair(fn(h.clone(), q[:, s:e].clone(), k[:, s:e].clone(), v[:, s:e].clone(),
                              gk[:, s:e].clone(), scale), name)
            check_close(o_c, o_ref[:, s:e], f"{name}: outputs of chunk {n}, tokens {s}..{e - 1} ({shape})",
                        tol=1e-5)
        check_close(h, ht_ref, f"{name}: state after the last chunk ({shape})", tol=1e-5)
    print(f"{name} reproduces the token loop chunk by chunk on {len(CASES)} shapes")
