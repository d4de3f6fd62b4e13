"""Gates as the kernels consume them, and the bookkeeping of packed (varlen) batches.

A gate is a per-token *natural-log* decay: ``g`` [B,T,H] (scalar per head), ``gk`` [B,T,H,K]
(per key dim), ``gv`` [B,T,H,V] (per value dim), ``g_gamma`` [H] (one constant per head).
The kernels (like fla >= 0.5.2) take each per-token gate as a *chunk-local inclusive cumulative
sum in log2 units* (``G`` of chapter 00's notation; ``Gv`` for ``gv``): inside a chunk that starts
at token c, ``G_t = log2(e) · Σ_{s=c..t} gate_s``; the sum restarts at every chunk (and at every
sequence start in a packed batch), so within a chunk ``Γ − G_t <= 0`` for decaying gates (``Γ``:
``G`` at the chunk's last token) and ``exp2`` of it never overflows. ``g_gamma`` is passed as it
is, one per-step decay per head in log2 units, ``log2(e) · g_gamma``, and the kernels cumulate it
themselves.

**Decays of zero.** A gate of −inf (a decay of exactly zero: the state forgets everything) is
allowed, but its cumulative sum is −inf from that token to the end of the chunk, and the
kernels' ``2^(Γ − G)`` becomes −inf − (−inf) = NaN: the information the kernels need (the sum of
the gates *after* the zero) is gone. So ``chunk_local_cumsum`` raises every gate below
``MIN_GATE`` = −160·ln 2 (a per-token decay below 2^−160 ≈ 7e−49) to ``MIN_GATE`` before summing,
which keeps every sum finite. The kernels compute in fp32, where 2^x is 0 below x ≈ −150: no
path through such a decay is representable there, so the states and every gradient are the
ones fp32 gives for the true, smaller decay (the gradient of the raised gate itself, e^{gate}
times something, is taken as 0). The kernels do the same for ``g_gamma``.
"""
from __future__ import annotations

import math
import numbers
from collections.abc import Mapping

import torch

from . import _validate

RCP_LN2 = 1.0 / math.log(2.0)  # log2(e): natural-log gates times this are log2 gates
MIN_GATE = -160.0 * math.log(2.0)  # natural log: smaller gates (-inf too) count as this (module docstring)


def prepare_lens(cu_seqlens: torch.Tensor) -> torch.Tensor:
    """Sequence lengths [N] from cumulative offsets ``cu_seqlens`` [N+1] (a 1-D int tensor; its values
    are not checked here: that would wait for the GPU)."""
    if not isinstance(cu_seqlens, torch.Tensor):
        raise TypeError(f"cu_seqlens must be a torch.Tensor, got {type(cu_seqlens).__name__}")
    if cu_seqlens.dim() != 1 or cu_seqlens.is_floating_point() or cu_seqlens.is_complex():
        raise TypeError(f"cu_seqlens must be a 1-D int tensor, got {cu_seqlens.dim()}-D {cu_seqlens.dtype}")
    return cu_seqlens[1:] - cu_seqlens[:-1]


def prepare_chunk_offsets(cu_seqlens: torch.Tensor, chunk_size: int) -> torch.Tensor:
    """Where each sequence's chunk (or split) slots start: [N+1], int64.

    Sequence n of length L_n owns ``ceil(L_n / chunk_size)`` slots (none when empty), so its
    states are ``h[0, offsets[n] : offsets[n+1]]`` and ``offsets[-1]`` is the total count.
    Raises ValueError unless ``chunk_size`` is a positive int.
    """
    chunk_size = _validate.positive_int("chunk_size", chunk_size)
    n_chunks = (prepare_lens(cu_seqlens).long() + chunk_size - 1) // chunk_size
    return torch.cat([n_chunks.new_zeros(1), n_chunks.cumsum(0)])


def prepare_chunk_indices(cu_seqlens: torch.Tensor, chunk_size: int) -> torch.Tensor:
    """One row per chunk of a packed batch: [NT, 2] int64 of (sequence n, chunk index in n).

    Raises ValueError unless ``chunk_size`` is a positive int."""
    chunk_size = _validate.positive_int("chunk_size", chunk_size)
    n_chunks = (prepare_lens(cu_seqlens).long() + chunk_size - 1) // chunk_size
    seq = torch.repeat_interleave(torch.arange(len(n_chunks), device=cu_seqlens.device), n_chunks)
    first = torch.cat([n_chunks.new_zeros(1), n_chunks.cumsum(0)[:-1]])
    idx = torch.arange(int(n_chunks.sum()), device=cu_seqlens.device) - first[seq]
    return torch.stack([seq, idx], 1)


def _chunk_ids(T: int, chunk_size: int, cu_seqlens: torch.Tensor | None, device) -> torch.Tensor:
    """A group id per token [T]: equal ids <=> same sequence and same chunk of it."""
    t = torch.arange(T, device=device)
    if cu_seqlens is None:
        return t // chunk_size
    cu = cu_seqlens.to(device=device, dtype=torch.long)
    seq = torch.searchsorted(cu[1:], t, right=True)  # sequence of each token
    pos = t - cu[seq]  # position inside its sequence
    offsets = prepare_chunk_offsets(cu, chunk_size)
    return offsets[seq] + pos // chunk_size


GATE_NAMES = ("g", "g_gamma", "gk", "gv")


def kernel_gates(gates: dict, chunk_size: int, cu_seqlens: torch.Tensor | None = None) -> dict:
    """The kernels' form of natural-log per-token gates, ready to pass as keyword arguments:
    ``chunk_fwd_h(k, v, **kernel_gates(gates, BT))``.

    Args:
        gates: any of ``g`` [B, T, H], ``gk`` [B, T, H, K], ``gv`` [B, T, H, V] (natural-log per-token
            decays) and ``g_gamma`` [H] (a natural-log per-step decay), by name.
        chunk_size: the kernels' BT (their ``chunk_size``): the sums restart every BT tokens.
        cu_seqlens: [N + 1] offsets of a packed batch, or None. Pass the kernel's own: sums made
            without them restart on the packed row's chunk grid, not each sequence's, and the
            kernel cannot tell (its states then come out wrong, with no error).
    Returns:
        ``g``, ``gk``, ``gv`` as ``chunk_local_cumsum(x, chunk_size, cu_seqlens)`` (chunk-local
        cumulative sums in log2 units, fp32) and ``g_gamma`` as ``RCP_LN2 * g_gamma`` (log2 units), for
        the names given.
    Raises:
        ValueError naming a key that is not a gate (``GATE_NAMES``); TypeError for ``gates`` not a
        dict, or a value not a tensor.
    """
    if not isinstance(gates, Mapping):
        raise TypeError(f"gates must be a dict of gate tensors by name ({', '.join(GATE_NAMES)}), "
                        f"got {type(gates).__name__}")
    unknown = sorted(set(gates) - set(GATE_NAMES), key=repr)
    if unknown:
        raise ValueError(f"gates may hold {', '.join(GATE_NAMES)}, got {', '.join(map(repr, unknown))}")
    for name, x in gates.items():
        if not isinstance(x, torch.Tensor):
            raise TypeError(f"gates[{name!r}] must be a torch.Tensor, got {type(x).__name__}")
    return {name: RCP_LN2 * x if name == "g_gamma" else chunk_local_cumsum(x, chunk_size, cu_seqlens)
            for name, x in gates.items()}


def _check_cumsum(gate, chunk_size, cu_seqlens, scale, reverse, dtype, floor):
    """``chunk_local_cumsum``'s arguments checked (its Raises); returns gate, chunk_size, scale and
    reverse as it uses them."""
    gate = _validate.tensor("gate", gate, floating=False, contiguous=False)
    if gate.is_complex() or gate.dtype == torch.bool:
        raise TypeError(f"gate must be real numbers (natural-log decays), got dtype {gate.dtype}")
    if gate.is_meta:
        raise ValueError("gate is on the meta device, which holds no values to sum")
    if gate.dim() not in (3, 4):
        raise ValueError(f"gate must be [B, T, H] or [B, T, H, D], got shape {tuple(gate.shape)}")
    # cu_seqlens may live on any device (it is moved to the gate's): only its values are checked.
    _validate.cu_seqlens(cu_seqlens, gate.shape[0], gate.shape[1], like=gate if cu_seqlens is None else cu_seqlens)
    chunk_size = _validate.positive_int("chunk_size", chunk_size)
    scale = _validate.real("scale", scale, fp32=False)
    reverse = _validate.flag("reverse", reverse)
    if not isinstance(dtype, torch.dtype) or not dtype.is_floating_point:
        raise TypeError(f"dtype must be a floating-point torch.dtype, got {dtype!r}")
    if floor is not None:
        if isinstance(floor, bool) or not isinstance(floor, numbers.Real):
            raise TypeError(f"floor must be None or a real number, got {type(floor).__name__}")
        if math.isnan(floor):
            raise ValueError("floor must not be NaN (None: no floor)")
    return gate, chunk_size, scale, reverse


def chunk_local_cumsum(gate: torch.Tensor, chunk_size: int, cu_seqlens: torch.Tensor | None = None,
                       scale: float = RCP_LN2, reverse: bool = False,
                       dtype: torch.dtype = torch.float32, floor: float | None = MIN_GATE) -> torch.Tensor:
    """Chunk-local inclusive cumulative sum along time, times ``scale`` (default: to log2 units,
    the ``G`` / ``Gv`` the kernels take).

    Args:
        gate: [B, T, H] or [B, T, H, D] per-token natural-log gates (``g``, ``gk`` or ``gv``).
        chunk_size: chunk length BT; the sum restarts every BT tokens of each sequence.
        cu_seqlens: [N+1] offsets of a packed batch (B must be 1), or None.
        scale: multiplies the result (``RCP_LN2`` = log2(e) for the kernels; 1.0 keeps natural log).
        reverse: sum from each token to the *end* of its chunk instead (used by gradients).
        dtype: of the result (float32 by default, as the kernels expect).
        floor: gates below it are raised to it first (default ``MIN_GATE``: a gate of −inf, a
            decay of zero, then gives finite sums; module docstring); None sums the values as
            they are (e.g. gradients, with ``reverse``). NaN stays NaN.
    Returns:
        a tensor shaped like ``gate``: ``out[:, t] = scale * sum(max(gate[:, s], floor))`` over the
        tokens s of t's chunk with s <= t (s >= t when ``reverse``). Summed in float64 for accuracy.
    Raises:
        ValueError: ``gate`` not 3-D or 4-D; ``chunk_size`` not a positive int; ``cu_seqlens``
        with B != 1, or not a 1-D int tensor [0, ..., T] that never decreases. TypeError / ValueError
        for ``gate`` not a real tensor, ``scale`` not a finite real number, ``reverse`` not a bool,
        ``dtype`` not a floating-point dtype, ``floor`` not None or a real number (NaN).
    """
    gate, chunk_size, scale, reverse = _check_cumsum(gate, chunk_size, cu_seqlens, scale, reverse, dtype, floor)
    T = gate.shape[1]
    ids = _chunk_ids(T, chunk_size, cu_seqlens, gate.device)  # [T] chunk of each token
    # Scatter the tokens into [B, chunks, BT, ...] (position inside its chunk), sum along the chunk,
    # gather back: each chunk's sum sees only its own tokens, so a NaN or -inf gate stays in its chunk.
    first = torch.ones_like(ids, dtype=torch.bool)
    first[1:] = ids[1:] != ids[:-1]
    start = torch.cummax(torch.where(first, torch.arange(T, device=gate.device), 0), 0).values
    pos = torch.arange(T, device=gate.device) - start  # [T] position inside its chunk
    n_chunks, width = (int(ids[-1]) + 1, int(pos.max()) + 1) if T > 0 else (0, 0)  # width <= chunk_size
    x = gate.to(torch.float64)
    if floor is not None:
        x = torch.where(x < floor, floor, x)  # a NaN stays (x < floor is False for it)
    padded = x.new_zeros(x.shape[0], n_chunks, width, *x.shape[2:])
    padded[:, ids, pos] = x
    if reverse:
        padded = padded.flip(2).cumsum(2).flip(2)
    else:
        padded = padded.cumsum(2)
    out = padded[:, ids, pos]
    return (out * scale).to(dtype)
