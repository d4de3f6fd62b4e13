"""Chapter 06's checkers reject wrong answers (the shipped solutions and a stub: tests/test_exercises.py)."""
import pytest
import torch

from chunkstate import _host
from chunkstate.exercises import ch06_state_in_out as ex
from chunkstate.gates import prepare_chunk_offsets


# ---- pack ----

def _lengths_not_offsets(seqs):
    x, cu = ex.pack(seqs)
    return x, torch.tensor([s.shape[0] for s in seqs] + [0], dtype=torch.int32)


def _no_leading_zero(seqs):
    x, cu = ex.pack(seqs)
    return x, cu[1:]


def _batch_major(seqs):  # stacks along a batch axis after padding: not packed
    L = max(s.shape[0] for s in seqs)
    x = torch.stack([torch.cat([s, s.new_zeros(L - s.shape[0], *s.shape[1:])]) for s in seqs])
    return x, ex.pack(seqs)[1]


def _reversed(seqs):
    x, _ = ex.pack(seqs[::-1])
    return x, ex.pack(seqs)[1]


def _float_offsets(seqs):
    x, cu = ex.pack(seqs)
    return x, cu.float()


@pytest.mark.parametrize("wrong", [_lengths_not_offsets, _no_leading_zero, _batch_major, _reversed, _float_offsets])
def test_pack_wrong_answer_rejected(wrong):
    with pytest.raises(AssertionError):
        ex.check_pack(wrong)


# ---- states_per_sequence ----

def _by_chunk_size(h, cu_seqlens, split_size):  # offsets counted in chunks of 16, not splits
    offsets = prepare_chunk_offsets(cu_seqlens, 16).tolist()
    return [h[0, a:b] for a, b in zip(offsets[:-1], offsets[1:])]


def _by_token_offsets(h, cu_seqlens, split_size):  # cu_seqlens // split_size: wrong for ragged ends
    cu = (cu_seqlens // split_size).tolist()
    return [h[0, a:b] for a, b in zip(cu[:-1], cu[1:])]


def _skips_empty(h, cu_seqlens, split_size):
    pieces = ex.states_per_sequence(h, cu_seqlens, split_size)
    return [p for p in pieces if p.shape[0] > 0]


def _not_tensors(h, cu_seqlens, split_size):
    return [p.tolist() for p in ex.states_per_sequence(h, cu_seqlens, split_size)]


def test_fresh_lengths_always_tell_chunk_offsets_from_split_offsets():
    """The checker's lengths must catch ``_by_chunk_size`` on every draw, not most: its offsets
    (counted in chunks of 16) must differ from the split offsets (splits of 32) before the last
    sequence. When every sequence but the last fit one chunk they agreed, and the wrong answer
    passed (about one run in 17 with the earlier lengths)."""
    for _ in range(500):
        before_last = ex._lengths()[:-1]
        assert _host.split_offsets(before_last, 16)[-1] != _host.split_offsets(before_last, 32)[-1], before_last


@pytest.mark.parametrize("wrong", [_by_chunk_size, _by_token_offsets, _skips_empty, _not_tensors])
def test_states_per_sequence_wrong_answer_rejected(wrong):
    with pytest.raises(AssertionError):
        ex.check_states_per_sequence(wrong)
