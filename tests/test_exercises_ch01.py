"""Chapter 01's checker rejects wrong answers (the shipped solution and a stub: tests/test_exercises.py)."""
import pytest
import torch

from chunkstate.exercises import ch01_recurrence as ex


def _strict_mask(q, k, v, h0, scale):  # j < i: each token forgets itself
    T = q.shape[1]
    m = torch.ones(T, T, dtype=torch.bool).tril(-1)
    s = torch.einsum("bihk,bjhk->bhij", q, k).masked_fill(~m, 0.0)
    o = torch.einsum("bhij,bjhv->bihv", s, v) + torch.einsum("bihk,bhkv->bihv", q, h0)
    return scale * o, h0 + torch.einsum("bthk,bthv->bhkv", k, v)


def _ignores_h0(q, k, v, h0, scale):
    o, ht = ex.masked_outputs_with_state(q, k, v, torch.zeros_like(h0), scale)
    return o, ht + h0


def _no_mask(q, k, v, h0, scale):  # every token sees the future
    s = torch.einsum("bihk,bjhk->bhij", q, k)
    o = torch.einsum("bhij,bjhv->bihv", s, v) + torch.einsum("bihk,bhkv->bihv", q, h0)
    return scale * o, h0 + torch.einsum("bthk,bthv->bhkv", k, v)


def _unscaled(q, k, v, h0, scale):
    return ex.masked_outputs_with_state(q, k, v, h0, 1.0)


def _final_state_without_h0(q, k, v, h0, scale):
    o, ht = ex.masked_outputs_with_state(q, k, v, h0, scale)
    return o, ht - h0


def _only_o(q, k, v, h0, scale):
    return ex.masked_outputs_with_state(q, k, v, h0, scale)[0]


def _nan_o(q, k, v, h0, scale):
    o, ht = ex.masked_outputs_with_state(q, k, v, h0, scale)
    o[:, -1] = float("nan")
    return o, ht


def _transposed_o(q, k, v, h0, scale):  # [B, H, T, V] instead of [B, T, H, V]
    o, ht = ex.masked_outputs_with_state(q, k, v, h0, scale)
    return o.transpose(1, 2), ht


@pytest.mark.parametrize("wrong", [_strict_mask, _ignores_h0, _no_mask, _unscaled,
                                   _final_state_without_h0, _only_o, _nan_o, _transposed_o])
def test_wrong_answer_rejected(wrong):
    with pytest.raises(AssertionError):
        ex.check_masked_outputs_with_state(wrong)
