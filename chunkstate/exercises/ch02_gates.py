"""Chapter 02 exercise: the chunk-local cumulative gate of a packed (varlen) batch.

Write ``chunk_local_cumsum(gate, chunk_size, cu_seqlens=None) -> G``:

- ``gate``: [B, T, H] or [B, T, H, D] natural-log per-token gates (``g``, ``gk`` or ``gv``);
- ``cu_seqlens``: None (every batch row is one sequence) or int64 [N+1] offsets of N sequences
  packed into one row (B = 1); sequences may be empty or a single token;
- returns float32 ``G`` shaped like ``gate``, in **log2 units**:
  ``G[:, t] = log2(e) · Σ gate[:, s]`` over the tokens ``s <= t`` of t's chunk, where chunks are
  ``chunk_size`` tokens counted from each *sequence's* start (the sum restarts at every chunk and
  at every sequence).

Checked against :func:`chunkstate.gates.chunk_local_cumsum` (the package's vectorised version).
"""
from __future__ import annotations

import torch

from ..gates import RCP_LN2
from ..gates import chunk_local_cumsum as package_cumsum
from ..testing import check_close, rel_err

CASES = [  # (B, T, H, D or None, chunk_size, cu_seqlens or None)
    (2, 100, 3, None, 16, None),
    (1, 63, 2, 5, 64, None),
    (3, 1, 2, None, 16, None),
    (1, 107, 2, 3, 16, [0, 0, 1, 40, 40, 107]),  # an empty sequence, a one-token one, ragged chunks
    (1, 15, 1, None, 16, [0, 15]),
    (1, 200, 2, None, 32, [0, 70, 200]),
]


def chunk_local_cumsum(gate, chunk_size, cu_seqlens=None):
    """The shipped solution: a loop over sequences and their chunks (see the module docstring)."""
    B, T = gate.shape[:2]
    if cu_seqlens is None:
        segments = [(b, 0, T) for b in range(B)]
    else:
        cu = [int(c) for c in cu_seqlens]
        segments = [(0, cu[n], cu[n + 1]) for n in range(len(cu) - 1)]
    out = torch.zeros(gate.shape, dtype=torch.float64, device=gate.device)
    for b, bos, eos in segments:
        for start in range(bos, eos, chunk_size):
            end = min(start + chunk_size, eos)
            out[b, start:end] = gate[b, start:end].to(torch.float64).cumsum(0)
    return (RCP_LN2 * out).to(torch.float32)


def _diagnose(out, gate, chunk_size, cu_seqlens, name, what):
    """A hint when ``out`` matches a common near miss."""
    near = {
        "natural-log units (multiply by RCP_LN2 = log2(e))":
            package_cumsum(gate, chunk_size, cu_seqlens, scale=1.0),
        "a sum that does not restart at chunk boundaries":
            package_cumsum(gate, 10 ** 9, cu_seqlens),
        "an exclusive sum (each token's own gate left out)":
            package_cumsum(gate, chunk_size, cu_seqlens) - RCP_LN2 * gate,
    }
    if cu_seqlens is not None:
        near["chunks counted from the start of the packed row, not of each sequence"] = \
            package_cumsum(gate, chunk_size)
    for hint, candidate in near.items():
        if out.shape == candidate.shape and rel_err(out, candidate) < 1e-5:
            raise AssertionError(f"{name}: {what}: this looks like {hint}")


def check_chunk_local_cumsum(fn=None) -> None:
    """Test ``fn`` (default: the shipped solution) on fresh random gates of several odd shapes.

    Raises ``AssertionError`` naming the case that is wrong (with a hint for common near misses);
    an exception raised inside ``fn`` (such as ``NotImplementedError``) propagates unchanged.
    """
    fn = chunk_local_cumsum if fn is None else fn
    name = getattr(fn, "__name__", "your function")
    for B, T, H, D, BT, cu in CASES:
        shape = (B, T, H) if D is None else (B, T, H, D)
        gate = torch.nn.functional.logsigmoid(torch.randn(shape))  # decays: every gate <= 0
        cu_seqlens = None if cu is None else torch.tensor(cu, dtype=torch.long)
        out = fn(gate.clone(), BT, cu_seqlens)
        what = f"gate {list(shape)}, chunk_size={BT}, cu_seqlens={cu}"
        if not isinstance(out, torch.Tensor):
            raise AssertionError(f"{name} must return a tensor, got {type(out).__name__}")
        if out.dtype != torch.float32:
            raise AssertionError(f"{name}: {what}: expected a float32 result, got {out.dtype}")
        ref = package_cumsum(gate, BT, cu_seqlens)
        if not torch.isnan(out).any() and out.shape == ref.shape and rel_err(out, ref) >= 1e-5:
            _diagnose(out, gate, BT, cu_seqlens, name, what)
        check_close(out, ref, f"{name}: {what}", tol=1e-5)
    print(f"{name} agrees with chunkstate.gates.chunk_local_cumsum on {len(CASES)} cases")
