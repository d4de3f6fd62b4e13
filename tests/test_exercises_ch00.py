"""Chapter 00's checker passes a differently written right answer and rejects wrong answers (the
shipped solution and a stub: tests/test_exercises.py)."""
import math

import pytest
import torch

from chunkstate.exercises import ch00_overview as ex
from chunkstate.gates import prepare_chunk_offsets


def test_another_right_answer_passes():
    def via_offsets(B, T, H, K, V, chunk_size, split_size=None, cu_seqlens=None):
        BS = split_size or chunk_size
        if cu_seqlens is None:
            return torch.Size([B, -(-T // BS), H, K, V]), [B, H, K, V]  # a torch.Size and a list are fine
        NS = int(prepare_chunk_offsets(torch.tensor(cu_seqlens), BS)[-1])
        return (1, NS, H, K, V), (len(cu_seqlens) - 1, H, K, V)

    ex.check_state_shapes(via_offsets)


def _floor(B, T, H, K, V, chunk_size, split_size=None, cu_seqlens=None):  # drops the short last split
    (b, _, h, k, v), ht = ex.state_shapes(B, T, H, K, V, chunk_size, split_size, cu_seqlens)
    BS = split_size or chunk_size
    NS = T // BS if cu_seqlens is None else sum((e - s) // BS for s, e in zip(cu_seqlens, cu_seqlens[1:]))
    return (b, NS, h, k, v), ht


def _chunks_not_splits(B, T, H, K, V, chunk_size, split_size=None, cu_seqlens=None):
    return ex.state_shapes(B, T, H, K, V, chunk_size, None, cu_seqlens)


def _packed_row_as_one_sequence(B, T, H, K, V, chunk_size, split_size=None, cu_seqlens=None):
    (b, _, h, k, v), _ = ex.state_shapes(B, T, H, K, V, chunk_size, split_size, None)
    return (b, math.ceil(T / (split_size or chunk_size)), h, k, v), (B, H, K, V)


def _k_and_v_swapped(B, T, H, K, V, chunk_size, split_size=None, cu_seqlens=None):
    return ex.state_shapes(B, T, H, V, K, chunk_size, split_size, cu_seqlens)


def _empty_sequence_owns_a_split(B, T, H, K, V, chunk_size, split_size=None, cu_seqlens=None):
    (b, NS, h, k, v), ht = ex.state_shapes(B, T, H, K, V, chunk_size, split_size, cu_seqlens)
    empty = 0 if cu_seqlens is None else sum(s == e for s, e in zip(cu_seqlens, cu_seqlens[1:]))
    return (b, NS + empty, h, k, v), ht


def _one_state_more(B, T, H, K, V, chunk_size, split_size=None, cu_seqlens=None):  # counts ht among h
    (b, NS, h, k, v), ht = ex.state_shapes(B, T, H, K, V, chunk_size, split_size, cu_seqlens)
    return (b, NS + 1, h, k, v), ht


def _only_h(B, T, H, K, V, chunk_size, split_size=None, cu_seqlens=None):
    return ex.state_shapes(B, T, H, K, V, chunk_size, split_size, cu_seqlens)[0]


def _float_sizes(B, T, H, K, V, chunk_size, split_size=None, cu_seqlens=None):
    (b, _, h, k, v), ht = ex.state_shapes(B, T, H, K, V, chunk_size, split_size, cu_seqlens)
    return (b, T / (split_size or chunk_size), h, k, v), ht


@pytest.mark.parametrize("wrong", [_floor, _chunks_not_splits, _packed_row_as_one_sequence, _k_and_v_swapped,
                                   _empty_sequence_owns_a_split, _one_state_more, _only_h, _float_sizes])
def test_wrong_answer_rejected(wrong):
    with pytest.raises(AssertionError):
        ex.check_state_shapes(wrong)
