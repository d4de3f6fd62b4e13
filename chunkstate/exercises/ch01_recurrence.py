"""Chapter 01 exercise: the causal masked form, with a state carried in.

Write ``masked_outputs_with_state(q, k, v, h0, scale) -> (o, ht)``, per batch row and head::

    o  = scale · [ (Q Kᵀ ⊙ M) V  +  Q h0 ]      M[i, j] = 1 if j <= i else 0
    ht = h0 + Kᵀ V

Shapes (time-major, float32): ``q``, ``k`` [B,T,H,K], ``v`` [B,T,H,V], ``h0`` [B,H,K,V];
returns ``o`` [B,T,H,V] and ``ht`` [B,H,K,V]. ``h0`` summarises tokens that came *before* this
block: the token loop started from ``h0`` gives the same outputs (checked against
:func:`chunkstate.reference.recurrent_outputs`).
"""
from __future__ import annotations

import torch

from ..reference import recurrent_outputs
from ..testing import check_close

CASES = [  # (B, T, H, K, V): one token, odd lengths, K and V not powers of two
    (1, 1, 1, 3, 5),
    (2, 63, 3, 24, 20),
    (1, 100, 2, 17, 9),
]


def masked_outputs_with_state(q, k, v, h0, scale):
    """The shipped solution: see the module docstring for the formula and shapes."""
    T = q.shape[1]
    causal = torch.ones(T, T, dtype=torch.bool, device=q.device).tril()  # [i, j]: j <= i
    scores = torch.einsum("bihk,bjhk->bhij", q, k).masked_fill(~causal, 0.0)  # [B, H, T, T]
    o = torch.einsum("bhij,bjhv->bihv", scores, v) + torch.einsum("bihk,bhkv->bihv", q, h0)
    ht = h0 + torch.einsum("bthk,bthv->bhkv", k, v)
    return scale * o, ht


def _pair(out, name):
    if not (isinstance(out, tuple) and len(out) == 2 and all(isinstance(x, torch.Tensor) for x in out)):
        raise AssertionError(f"{name} must return a tuple (o, ht) of two tensors, got {type(out).__name__}")
    return out


def check_masked_outputs_with_state(fn=None) -> None:
    """Test ``fn`` (default: the shipped solution) on fresh random inputs of several odd shapes.

    Raises ``AssertionError`` naming the shape and the output that is wrong; an exception raised
    inside ``fn`` (such as ``NotImplementedError`` from the stub) propagates unchanged.
    """
    fn = masked_outputs_with_state if fn is None else fn
    name = getattr(fn, "__name__", "your function")
    for B, T, H, K, V in CASES:
        q, k = torch.randn(B, T, H, K), torch.randn(B, T, H, K)
        v, h0 = torch.randn(B, T, H, V), torch.randn(B, H, K, V)
        scale = K ** -0.5
        o, ht = _pair(fn(q.clone(), k.clone(), v.clone(), h0.clone(), scale), name)
        o_ref, ht_ref = recurrent_outputs(q, k, v, h0=h0, scale=scale)
        shape = f"B={B}, T={T}, H={H}, K={K}, V={V}"
        check_close(o, o_ref, f"{name}: o ({shape})", tol=1e-5)
        check_close(ht, ht_ref, f"{name}: ht ({shape})", tol=1e-5)
    print(f"{name} agrees with the token loop on {len(CASES)} shapes")
