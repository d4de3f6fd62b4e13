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


def _diagonal_ht_ignores_h0(q, k, v, h0, scale):  # two mistakes at once: both are named
    o, _ = _strict_mask(q, k, v, h0, scale)
    return o, torch.einsum("bthk,bthv->bhkv", k, v)


OWN_O, CARRIED_O = "o's own term scale · (q kᵀ ⊙ M) v", "o's carried-in term scale · q h0"
OWN_HT, CARRIED_HT = "ht's own term kᵀ v", "ht's carried-in term h0"


@pytest.mark.parametrize("wrong, named, right_terms", [
    (_strict_mask, [OWN_O, "from token 0 on", "the diagonal masked out"], [CARRIED_O, OWN_HT, CARRIED_HT]),
    (_no_mask, [OWN_O, "from token 0 on", "no causal mask"], [CARRIED_O, OWN_HT, CARRIED_HT]),
    (_unscaled, [OWN_O, CARRIED_O, "no scale"], [OWN_HT, CARRIED_HT]),
    (_ignores_h0, [CARRIED_O, "h0 left out (add scale · q h0)"], [OWN_O, OWN_HT, CARRIED_HT]),
    (_final_state_without_h0, [CARRIED_HT, "likely h0 left out (ht = h0 + kᵀ v)"], [OWN_O, CARRIED_O, OWN_HT]),
    (_diagonal_ht_ignores_h0, [OWN_O, "the diagonal masked out", CARRIED_HT], [CARRIED_O, OWN_HT]),
])
def test_wrong_answer_names_the_term(wrong, named, right_terms):
    with pytest.raises(AssertionError) as e:
        ex.check_masked_outputs_with_state(wrong)
    message = str(e.value)
    for part in named:
        assert part in message, (part, message)
    for term in right_terms:  # the terms that are right are not blamed
        assert term not in message, (term, message)


def test_a_right_answer_names_no_term():
    q, k, v, h0 = torch.randn(1, 5, 1, 3), torch.randn(1, 5, 1, 3), torch.randn(1, 5, 1, 2), torch.randn(1, 1, 3, 2)
    assert ex._diagnose(ex.masked_outputs_with_state, "solution", q, k, v, h0, 0.5, 1e-5) == ""
