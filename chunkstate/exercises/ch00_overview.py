"""Chapter 00 exercise: how many states are stored, and in what shape.

Write ``state_shapes(B, T, H, K, V, chunk_size, split_size=None, cu_seqlens=None) -> (h_shape, ht_shape)``
returning the shapes (tuples of ints) of the two outputs of the forward pass:

- ``h``: the state *entering* each split, ``[B, NS, H, K, V]``. A split is ``split_size`` tokens
  of one sequence (``split_size`` defaults to ``chunk_size``); a sequence n of L_n tokens owns
  ``ceil(L_n / split_size)`` splits, the last one possibly short, an empty sequence none.
- ``ht``: the final state of each sequence, ``[N, H, K, V]``.
- a packed batch (``cu_seqlens`` given, a list or tensor [0, ..., T] of N + 1 offsets) has B = 1
  and N = len(cu_seqlens) - 1 sequences; otherwise each of the B rows is one sequence (N = B).

Checked against the shapes :func:`chunkstate.reference.recurrent_states` really returns.
"""
from __future__ import annotations

import math
import numbers

import torch

from ..reference import recurrent_states

CASES = [  # (B, T, H, K, V, chunk_size, split_size, cu_seqlens)
    (2, 100, 3, 5, 7, 16, None, None),  # 100 = 6 * 16 + 4: a short last split
    (3, 1, 1, 4, 3, 64, None, None),  # one token
    (1, 64, 2, 3, 5, 32, None, None),  # an exact multiple
    (2, 63, 2, 24, 33, 16, 64, None),  # splits of 4 chunks
    (1, 65, 1, 3, 5, 32, 64, None),  # one token past a split
    (1, 100, 2, 5, 7, 16, None, [0, 0, 1, 40, 100]),  # packed: an empty and a one-token sequence
    (1, 100, 2, 5, 7, 16, 32, [0, 0, 1, 40, 100]),
    (1, 50, 1, 3, 3, 16, None, [0, 17, 17, 50]),
]


def state_shapes(B, T, H, K, V, chunk_size, split_size=None, cu_seqlens=None):
    """The shipped solution: see the module docstring."""
    BS = split_size or chunk_size
    if cu_seqlens is None:
        return (B, math.ceil(T / BS), H, K, V), (B, H, K, V)
    cu = [int(c) for c in cu_seqlens]
    NS = sum(math.ceil((end - start) / BS) for start, end in zip(cu, cu[1:]))
    return (1, NS, H, K, V), (len(cu) - 1, H, K, V)


def _as_shape(x, name, what):
    """``x`` as a tuple of ints, or an AssertionError saying what it should be."""
    if not isinstance(x, (tuple, list)) or not all(
            isinstance(d, numbers.Integral) and not isinstance(d, bool) for d in x):
        raise AssertionError(f"{name}: {what} must be a tuple of ints, got {x!r}")
    return tuple(int(d) for d in x)


def check_state_shapes(fn=None) -> None:
    """Test ``fn`` (default: the shipped solution) against the shapes the reference loop returns.

    Raises ``AssertionError`` naming the case that is wrong; an exception raised inside ``fn``
    (such as ``NotImplementedError`` from the stub) propagates unchanged.
    """
    fn = state_shapes if fn is None else fn
    name = getattr(fn, "__name__", "your function")
    for B, T, H, K, V, BT, BS, cu in CASES:
        k, v = torch.randn(B, T, H, K), torch.randn(B, T, H, V)
        cu_seqlens = None if cu is None else torch.tensor(cu, dtype=torch.long)
        h, ht = recurrent_states(k, v, cu_seqlens=cu_seqlens, chunk_size=BT, split_size=BS)
        case = f"B={B}, T={T}, H={H}, K={K}, V={V}, chunk_size={BT}, split_size={BS}, cu_seqlens={cu}"
        out = fn(B, T, H, K, V, BT, BS, None if cu is None else list(cu))
        if not (isinstance(out, (tuple, list)) and len(out) == 2):
            raise AssertionError(f"{name} must return (h_shape, ht_shape), got {out!r}")
        got_h, got_ht = _as_shape(out[0], name, "h_shape"), _as_shape(out[1], name, "ht_shape")
        if got_h != tuple(h.shape):
            raise AssertionError(f"{name}: h_shape for {case} is {got_h}, expected {tuple(h.shape)}")
        if got_ht != tuple(ht.shape):
            raise AssertionError(f"{name}: ht_shape for {case} is {got_ht}, expected {tuple(ht.shape)}")
    print(f"{name} gives the reference's shapes in {len(CASES)} cases")
