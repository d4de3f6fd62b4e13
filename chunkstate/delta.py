"""The delta rule's state, token by token and a chunk at a time (chapter 12): where the ladder goes
next.

Per sequence and head, with ``β_t`` in (0, 1] and (usually L2-normalised) keys, DeltaNet's state
``S ∈ R^{K×V}`` does not just add ``k_t v_tᵀ``: it first asks what it already stores under
``k_t`` and writes only the correction::

    S_t = S_{t-1} + β_t k_t (v_t − S_{t-1}ᵀ k_t)ᵀ  =  (I − β_t k_t k_tᵀ) S_{t-1} + β_t k_t v_tᵀ,
    o_t = scale · S_tᵀ q_t.

**A chunk at a time.** Inside a chunk entered with state ``h``, write ``S_t = h + Σ_{s<=t} k_s u_sᵀ``
with *pseudo-values* ``u_t``. The recurrence gives ``u_t = β_t (v_t − hᵀk_t − Σ_{s<t} (k_sᵀk_t) u_s)``,
a unit lower-triangular system for all of the chunk's ``U`` [L, V] at once::

    (I + tril(diag(β) K Kᵀ, −1)) U = diag(β) (V − K h),

so ``U = Ũ − W h`` with the *UT transform* ``T = (I + tril(diag(β) K Kᵀ, −1))⁻¹ diag(β)``,
``W = T K`` and ``Ũ = T V``: both depend on the chunk alone, so every chunk computes them in
parallel. Then the scan over chunks, and the outputs::

    v_new[n] = Ũ[n] − W[n] h[n],      h[n+1] = h[n] + K[n]ᵀ v_new[n],
    O[n]     = scale · (Q[n] h[n] + tril(Q[n] K[n]ᵀ) v_new[n]).

The state update is chapter 03's, ungated, with ``v_new`` for ``v``: ``chunk_fwd_h(k, v_new)``
gives the same states. But ``v_new[n]`` needs ``h[n]``, so a delta-rule kernel computes it inside
its chunk loop — one more ``[BT, K] @ [K, BV]`` product per chunk before the update, and a store
of ``v_new`` for the outputs (fla's ``chunk_gated_delta_rule_fwd_h``).

Everything here is plain PyTorch, float64 in the loop; dense batches ``[B, T, H, D]``, a ragged
last chunk allowed.
"""
from __future__ import annotations

import math

import torch

from . import _validate
from .reference import _f64


def _check(q, k, v, beta, h0, scale, chunk_size):
    """The arguments of :func:`recurrent_delta` / :func:`chunked_delta`, checked (shapes, float
    dtypes, one device): every mismatch a ValueError / TypeError naming the argument, never a
    broadcast. Returns ``scale`` (a float, K ** -0.5 when None) and ``chunk_size`` (an int)."""
    B, T, H, K = _validate.sequence_tensor("q", q, contiguous=False).shape
    _validate.tensor("k", k, (B, T, H, K), like=q, contiguous=False)
    _validate.tensor("v", v, (B, T, H, None), like=q, contiguous=False)
    _validate.tensor("beta", beta, (B, T, H), like=q, contiguous=False)
    if h0 is not None:
        _validate.tensor("h0", h0, (B, H, K, v.shape[-1]), like=q, contiguous=False)
    scale = _validate.scale(scale, K, fp32=False)
    return scale, _validate.positive_int("chunk_size", chunk_size)


def _check_ut(k, beta):
    """:func:`ut_transform`'s arguments: k [..., L, K] and beta [..., L], float, on one device."""
    _validate.tensor("k", k, contiguous=False)
    if k.dim() < 2:
        raise ValueError(f"k must have shape [..., L, K], got {list(k.shape)}")
    _validate.tensor("beta", beta, tuple(k.shape[:-1]), like=k, contiguous=False)


def recurrent_delta(q, k, v, beta, h0=None, scale=None, chunk_size=64):
    """The token loop, in float64.

    Args: ``q``, ``k`` [B, T, H, K]; ``v`` [B, T, H, V]; ``beta`` [B, T, H]; ``h0`` [B, H, K, V] or
    None (zeros); ``scale`` (default K ** -0.5); ``chunk_size``: which states to return.
    Returns ``o`` [B, T, H, V], ``h`` [B, NT, H, K, V] (the state entering each chunk) and ``ht``
    [B, H, K, V] (after the last token).
    Raises TypeError / ValueError naming the argument for a shape that does not match (never a
    broadcast), a tensor not floating-point or on another device, ``scale`` not a finite real number
    or ``chunk_size`` not a positive int.
    """
    scale, chunk_size = _check(q, k, v, beta, h0, scale, chunk_size)
    B, T, H, K = k.shape
    V = v.shape[-1]
    q, k, v, beta = (_f64(x) for x in (q, k, v, beta))
    S = _f64(h0).clone() if h0 is not None else k.new_zeros(B, H, K, V)
    o = k.new_zeros(B, T, H, V)
    h = k.new_zeros(B, math.ceil(T / chunk_size), H, K, V)
    for t in range(T):
        if t % chunk_size == 0:
            h[:, t // chunk_size] = S
        kt, vt, bt = k[:, t], v[:, t], beta[:, t, :, None]  # [B, H, K], [B, H, V], [B, H, 1]
        error = vt - torch.einsum("bhkv,bhk->bhv", S, kt)  # what S gets wrong about v_t
        S = S + torch.einsum("bhk,bhv->bhkv", kt, bt * error)
        o[:, t] = scale * torch.einsum("bhkv,bhk->bhv", S, q[:, t])
    return o, h, S


def ut_transform(k, beta):
    """The UT transform of chunks: ``T = (I + tril(diag(β) K Kᵀ, −1))⁻¹ diag(β)``.

    ``k`` [..., L, K], ``beta`` [..., L] (any leading dimensions, one chunk of L tokens each).
    Returns ``T`` [..., L, L], lower triangular. A unit lower-triangular solve, not an inverse."""
    _check_ut(k, beta)
    L = k.shape[-2]
    A = torch.tril(beta[..., :, None] * (k @ k.transpose(-1, -2)), diagonal=-1)
    eye = torch.eye(L, dtype=k.dtype, device=k.device).expand_as(A)
    return torch.linalg.solve_triangular(eye + A, torch.diag_embed(beta), upper=False, unitriangular=True)


def chunked_delta(q, k, v, beta, h0=None, scale=None, chunk_size=64):
    """The chunked form (module docstring), in the inputs' dtype (float64 for an exact check).

    Same arguments as :func:`recurrent_delta`. Returns ``o`` [B, T, H, V], ``h`` [B, NT, H, K, V],
    ``ht`` [B, H, K, V], and ``v_new`` [B, T, H, V]: the pseudo-values ``Ũ − W h``, the values the
    state update actually adds.
    """
    scale, chunk_size = _check(q, k, v, beta, h0, scale, chunk_size)
    B, T, H, K = k.shape
    V = v.shape[-1]
    BT = chunk_size
    S = h0.to(k.dtype).clone() if h0 is not None else k.new_zeros(B, H, K, V)
    o, v_new = v.new_zeros(B, T, H, V, dtype=k.dtype), v.new_zeros(B, T, H, V, dtype=k.dtype)
    h = k.new_zeros(B, math.ceil(T / BT), H, K, V)
    for n, s in enumerate(range(0, T, BT)):
        e = min(s + BT, T)
        # one chunk, heads first: [B, H, L, D]
        qc, kc, vc = (x[:, s:e].transpose(1, 2).to(k.dtype) for x in (q, k, v))
        Tc = ut_transform(kc, beta[:, s:e].transpose(1, 2).to(k.dtype))  # [B, H, L, L]
        W, U = Tc @ kc, Tc @ vc  # [B, H, L, K], [B, H, L, V]: the chunk's own part, parallel over chunks
        h[:, n] = S
        U = U - W @ S  # v_new: needs the state entering the chunk
        o[:, s:e] = (scale * (qc @ S + torch.tril(qc @ kc.transpose(-1, -2)) @ U)).transpose(1, 2)
        v_new[:, s:e] = U.transpose(1, 2)
        S = S + kc.transpose(-1, -2) @ U
    return o, h, S, v_new
