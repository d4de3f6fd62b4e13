"""Chapter 06 exercises: pack ragged sequences, and find each sequence's states in a packed ``h``.

1. ``pack(seqs) -> (x, cu_seqlens)``: ``seqs`` is a list of N tensors [L_n, H, D] (any L_n >= 0,
   same H, D, dtype); return ``x`` [1, ΣL_n, H, D], the sequences one after another along time,
   and ``cu_seqlens`` [N + 1] (int32 or int64) with ``x[0, cu_seqlens[n]:cu_seqlens[n+1]] == seqs[n]``.
2. ``states_per_sequence(h, cu_seqlens, split_size) -> list``: ``h`` [1, NS, H, K, V] is what
   ``chunk_fwd_h(..., cu_seqlens=cu_seqlens, split_size=split_size)`` returned for a packed batch;
   return N tensors, the n-th [NS_n, H, K, V] (NS_n = ceil(L_n / split_size), 0 for an empty
   sequence): the states entering the splits of sequence n, exactly as a dense run of that
   sequence alone would give them (``h_n[0]`` for B = 1).
"""
from __future__ import annotations

import random

import torch

from ..env import DEVICE
from ..forward import chunk_fwd_h
from ..gates import prepare_chunk_offsets
from ..reference import chunked_states
from ..testing import check_close
from ..testing import state_tolerance


# ---- 1. packing -------------------------------------------------------------------------------

def pack(seqs: list[torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
    """The shipped solution: concatenate along time, offsets are the running sum of lengths."""
    lens = torch.tensor([s.shape[0] for s in seqs], dtype=torch.int32)
    cu_seqlens = torch.cat([lens.new_zeros(1), lens.cumsum(0, dtype=torch.int32)]).to(seqs[0].device)
    return torch.cat(seqs, 0)[None], cu_seqlens


def _lengths() -> list[int]:
    """Fresh ragged lengths: a one-token and an empty sequence first, then one of 17-40 tokens
    (more than one split of 16, so offsets counted in the wrong unit shift every later sequence),
    two random ones, and one of 33-47 tokens last (more than two splits of 16, a ragged end, more
    than one split of 32)."""
    return [1, 0, random.randint(17, 40)] + [random.randint(2, 40) for _ in range(2)] + [random.randint(33, 47)]


def check_pack(fn=None) -> None:
    """Test ``fn(seqs) -> (x, cu_seqlens)`` (default: the shipped solution) on fresh ragged batches
    with empty and one-token sequences.

    Raises ``AssertionError`` naming what is wrong; an exception raised inside ``fn`` (such as
    ``NotImplementedError`` from the stub) propagates unchanged.
    """
    fn = pack if fn is None else fn
    name = getattr(fn, "__name__", "your function")
    for H, D in [(1, 3), (2, 16)]:
        lens = _lengths()
        seqs = [torch.randn(L, H, D, device=DEVICE) for L in lens]
        out = fn([s.clone() for s in seqs])
        if not (isinstance(out, tuple) and len(out) == 2 and all(isinstance(o, torch.Tensor) for o in out)):
            raise AssertionError(f"{name} must return a tuple (x, cu_seqlens) of two tensors")
        x, cu = out
        if cu.dtype not in (torch.int32, torch.int64) or cu.dim() != 1:
            raise AssertionError(f"{name}: cu_seqlens must be a 1-D int32/int64 tensor, got {cu.dim()}-D {cu.dtype}")
        want = [0]
        for L in lens:
            want.append(want[-1] + L)
        if cu.tolist() != want:
            raise AssertionError(f"{name}: lengths {lens} give cu_seqlens {want}, got {cu.tolist()}")
        if tuple(x.shape) != (1, sum(lens), H, D):
            raise AssertionError(f"{name}: x must have shape {[1, sum(lens), H, D]}, got {list(x.shape)}")
        for n, s in enumerate(seqs):
            if not torch.equal(x[0, want[n]:want[n + 1]], s):
                raise AssertionError(f"{name}: x[0, {want[n]}:{want[n + 1]}] is not sequence {n} (lengths {lens})")
    print(f"{name} packs ragged batches correctly")


# ---- 2. where each sequence's states are ------------------------------------------------------

def states_per_sequence(h: torch.Tensor, cu_seqlens: torch.Tensor, split_size: int) -> list[torch.Tensor]:
    """The shipped solution: sequence n owns slots ``offsets[n]:offsets[n+1]`` of ``h[0]``."""
    offsets = prepare_chunk_offsets(cu_seqlens, split_size).tolist()
    return [h[0, a:b] for a, b in zip(offsets[:-1], offsets[1:])]


def check_states_per_sequence(fn=None) -> None:
    """Test ``fn(h, cu_seqlens, split_size)`` (default: the shipped solution): run ``chunk_fwd_h`` on
    a fresh packed batch (empty and one-token sequences included, split_size = 1 and 2 chunks),
    split its ``h`` with ``fn`` and compare each piece with the reference run on that sequence alone.

    Raises ``AssertionError`` naming the sequence; an exception raised inside ``fn`` propagates.
    """
    fn = states_per_sequence if fn is None else fn
    name = getattr(fn, "__name__", "your function")
    H, K, V, BT = 2, 16, 32, 16
    for BS in (BT, 2 * BT):
        lens = _lengths()
        seqs_k = [torch.randn(L, H, K, device=DEVICE) for L in lens]
        seqs_v = [torch.randn(L, H, V, device=DEVICE) for L in lens]
        k, cu = pack(seqs_k)
        v, _ = pack(seqs_v)
        h, _ = chunk_fwd_h(k, v, cu_seqlens=cu, chunk_size=BT, split_size=BS)
        pieces = fn(h, cu, BS)
        if not isinstance(pieces, (list, tuple)):
            raise AssertionError(f"{name} must return a list of tensors, one per sequence, got "
                                 f"{type(pieces).__name__}")
        if len(pieces) != len(lens):
            raise AssertionError(f"{name}: {len(lens)} sequences (lengths {lens}), got {len(pieces)} pieces")
        for n, (kn, vn) in enumerate(zip(seqs_k, seqs_v)):
            if not isinstance(pieces[n], torch.Tensor):
                raise AssertionError(f"{name}: piece {n} must be a tensor, got {type(pieces[n]).__name__}")
            h_ref, _ = chunked_states(kn[None], vn[None], chunk_size=BT, split_size=BS)
            check_close(pieces[n], h_ref[0], f"{name}: sequence {n} of lengths {lens} (split_size={BS})",
                        tol=state_tolerance(torch.float32))
    print(f"{name} finds every sequence's states in a packed batch")
