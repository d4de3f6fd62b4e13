"""Chapter 12 exercise: the UT transform of one chunk.

Write ``ut_transform(k, beta) -> T``: for one chunk of L tokens of one head, keys ``k`` [L, K] and
write strengths ``beta`` [L] (float64), return the lower-triangular ``T`` [L, L] with::

    T = (I + tril(diag(β) k kᵀ, −1))⁻¹ diag(β)

so that the chunk's pseudo-values are ``U = T (v − k h)`` for any values ``v`` [L, V] and entering
state ``h`` [K, V]. Solve the unit lower-triangular system (``torch.linalg.solve_triangular``) or
run the forward substitution ``u_t = β_t (x_t − Σ_{s<t} (k_tᵀ k_s) u_s)`` row by row; both are
fine. The checker compares ``T`` with ``chunkstate.delta.ut_transform`` and checks what ``T`` is
for: ``h + kᵀ T (v − k h)`` is the state the token loop reaches after the chunk.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

from ..delta import recurrent_delta, ut_transform
from ..testing import check_close

CASES = [(1, 4), (5, 3), (16, 16), (37, 8), (64, 32)]  # (L, K)


def check_ut_transform(fn=None) -> None:
    """Run ``fn`` (default: the shipped solution, ``chunkstate.delta.ut_transform`` itself) on fresh
    chunks with unit-norm keys and ``beta`` in (0, 1).

    Raises ``AssertionError`` naming the case; an exception raised inside ``fn`` (such as
    ``NotImplementedError``) propagates unchanged.
    """
    fn = ut_transform if fn is None else fn
    name = getattr(fn, "__name__", "your function")
    for L, K in CASES:
        V = 6
        k = F.normalize(torch.randn(L, K, dtype=torch.float64), dim=-1)
        beta = torch.sigmoid(torch.randn(L, dtype=torch.float64))
        v, h = torch.randn(L, V, dtype=torch.float64), torch.randn(K, V, dtype=torch.float64)
        where = f"L={L}, K={K}"
        T = fn(k.clone(), beta.clone())
        if not isinstance(T, torch.Tensor) or tuple(T.shape) != (L, L):
            raise AssertionError(f"{name} must return a tensor [L, L] = [{L}, {L}], got "
                                 f"{tuple(T.shape) if isinstance(T, torch.Tensor) else type(T).__name__} ({where})")
        if T.dtype != torch.float64:
            raise AssertionError(f"{name} must compute in float64 (k and beta are float64), got {T.dtype} ({where})")
        check_close(T, ut_transform(k, beta), f"{name}: T ({where})", 1e-10)
        _, _, after = recurrent_delta(torch.zeros(1, L, 1, K), k[None, :, None], v[None, :, None],
                                      beta[None, :, None], h[None, None], chunk_size=L)
        check_close(h + k.T @ (T.to(torch.float64) @ (v - k @ h)), after[0, 0],
                    f"{name}: h + kᵀ T (v − k h) vs the token loop's state after the chunk ({where})", 1e-10)
    print(f"{name} gives the UT transform of {len(CASES)} chunks, and the token loop's state after each")
