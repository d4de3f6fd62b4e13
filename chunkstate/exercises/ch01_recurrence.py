"""Chapter 01 exercise: the causal masked form, with a state carried in.

Write ``masked_outputs_with_state(q, k, v, h0, scale) -> (o, ht)``, per batch row and head::

    o  = scale · [ (q kᵀ ⊙ M) v  +  q h0 ]      M[i, j] = 1 if j <= i else 0
    ht = h0 + kᵀ v

(bold in the notebook: ``q``, ``k`` [T, K] and ``v`` [T, V] are one head's rows stacked.)

Shapes (time-major, float32): ``q``, ``k`` [B,T,H,K], ``v`` [B,T,H,V], ``h0`` [B,H,K,V];
returns ``o`` [B,T,H,V] and ``ht`` [B,H,K,V]. ``h0`` summarises tokens that came *before* this
block: the token loop started from ``h0`` gives the same outputs (checked against
:func:`chunkstate.reference.recurrent_outputs`).

When an answer is wrong, the checker says which term is off: it calls the function again with
``h0 = 0`` (leaving the block's own term, ``scale · (q kᵀ ⊙ M) v`` and ``kᵀ v``) and with ``v = 0``
(leaving the carried-in term, ``scale · q h0`` and ``h0``), compares each with its reference, and
names the likely mistake where the term matches a known one (the diagonal masked out, no mask, no
scale, ``h0`` left out), and the first token whose output is off.
"""
from __future__ import annotations

import torch

from ..reference import recurrent_outputs
from ..testing import check_close, rel_err

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


def _first_wrong_token(o, o_ref, tol) -> int | None:
    """The first token t whose outputs (all rows and heads) are off by more than ``tol``."""
    for t in range(o_ref.shape[1]):
        if not rel_err(o[:, t], o_ref[:, t]) < tol:
            return t
    return None


def _diagnose(fn, name, q, k, v, h0, scale, tol) -> str:
    """Which term of ``fn``'s answer is off, found by calling it with ``h0 = 0`` and with ``v = 0``."""
    T = q.shape[1]
    q64, k64, v64, h64 = (x.double() for x in (q, k, v, h0))
    causal = torch.ones(T, T, dtype=torch.bool).tril()
    scores = torch.einsum("bihk,bjhk->bhij", q64, k64)
    block = {  # the block's own term, right and as the common mistakes make it
        "right": torch.einsum("bhij,bjhv->bihv", scores.masked_fill(~causal, 0.0), v64),
        "the diagonal masked out (M[i, i] must be 1: token i sees itself)":
            torch.einsum("bhij,bjhv->bihv", scores.masked_fill(~causal.tril(-1), 0.0), v64),
        "no causal mask (token i sees later tokens j > i)": torch.einsum("bhij,bjhv->bihv", scores, v64),
    }
    carried = torch.einsum("bihk,bhkv->bihv", q64, h64)  # q h0
    found = []
    try:
        o_block, ht_block = _pair(fn(q.clone(), k.clone(), v.clone(), torch.zeros_like(h0), scale), name)
        o_carry, ht_carry = _pair(fn(q.clone(), k.clone(), torch.zeros_like(v), h0.clone(), scale), name)
    except Exception:  # the function cannot be probed this way: say nothing more
        return ""
    if tuple(o_block.shape) == tuple(block["right"].shape) and not rel_err(o_block, scale * block["right"]) < tol:
        why = next((w for w, ref in block.items() if w != "right" and rel_err(o_block, scale * ref) < tol), None)
        if why is None and rel_err(o_block, block["right"]) < tol:
            why = "no scale (multiply by scale)"
        t = _first_wrong_token(o_block, scale * block["right"], tol)
        found.append("o's own term scale · (q kᵀ ⊙ M) v (what o is with h0 = 0) is off"
                     + (f" from token {t} on" if t is not None else "") + (f": likely {why}" if why else ""))
    if tuple(o_carry.shape) == tuple(carried.shape) and not rel_err(o_carry, scale * carried) < tol:
        why = ("h0 left out (add scale · q h0)" if o_carry.abs().max() == 0 else
               "no scale (multiply by scale)" if rel_err(o_carry, carried) < tol else None)
        found.append("o's carried-in term scale · q h0 (what o is with v = 0) is off"
                     + (f": likely {why}" if why else ""))
    if tuple(ht_block.shape) == tuple(h0.shape) and not rel_err(ht_block, torch.einsum("bthk,bthv->bhkv", k64, v64)) < tol:
        found.append("ht's own term kᵀ v (what ht is with h0 = 0) is off")
    if tuple(ht_carry.shape) == tuple(h0.shape) and not rel_err(ht_carry, h64) < tol:
        found.append("ht's carried-in term h0 (what ht is with v = 0) is off"
                     + (": likely h0 left out (ht = h0 + kᵀ v)" if ht_carry.abs().max() == 0 else ""))
    return "".join(f"\n  - {f}" for f in found)


def check_masked_outputs_with_state(fn=None) -> None:
    """Test ``fn`` (default: the shipped solution) on fresh random inputs of several odd shapes.

    Raises ``AssertionError`` naming the shape, the output that is wrong and, where it can tell,
    the term that is off and the likely mistake (module docstring); an exception raised inside
    ``fn`` (such as ``NotImplementedError`` from the stub) propagates unchanged.
    """
    fn = masked_outputs_with_state if fn is None else fn
    name = getattr(fn, "__name__", "your function")
    tol = 1e-5
    for B, T, H, K, V in CASES:
        q, k = torch.randn(B, T, H, K), torch.randn(B, T, H, K)
        v, h0 = torch.randn(B, T, H, V), torch.randn(B, H, K, V)
        scale = K ** -0.5
        o, ht = _pair(fn(q.clone(), k.clone(), v.clone(), h0.clone(), scale), name)
        o_ref, ht_ref = recurrent_outputs(q, k, v, h0=h0, scale=scale)
        shape = f"B={B}, T={T}, H={H}, K={K}, V={V}"
        try:
            check_close(o, o_ref, f"{name}: o ({shape})", tol=tol)
            check_close(ht, ht_ref, f"{name}: ht ({shape})", tol=tol)
        except AssertionError as e:
            raise AssertionError(f"{e}{_diagnose(fn, name, q, k, v, h0, scale, tol)}") from None
    print(f"{name} agrees with the token loop on {len(CASES)} shapes")
