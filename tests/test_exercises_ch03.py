"""Chapter 03's checker rejects wrong answers (the shipped solution and a stub: tests/test_exercises.py)."""
import math

import pytest
import torch

from chunkstate.exercises import ch03_chunking as ex


def _parts(h, q, k, v, gk, scale, G=None, causal_offset=0, sign=1.0):
    """The solution's pieces with knobs to break one thing at a time."""
    G = gk.cumsum(1) if G is None else G
    Gamma = G[:, -1]
    L = q.shape[1]
    o_inter = torch.einsum("blhk,bhkv->blhv", q * torch.exp(G), h)
    causal = torch.ones(L, L, dtype=torch.bool).tril(causal_offset)
    diff = (sign * (G[:, :, None] - G[:, None, :])).masked_fill(~causal[None, :, :, None, None], -math.inf)
    P = torch.einsum("bihk,bjhk,bijhk->bhij", q, k, torch.exp(diff))
    o_intra = torch.einsum("bhij,bjhv->bihv", P, v)
    k_dec = k * torch.exp(Gamma[:, None] - G)
    h_next = torch.exp(Gamma)[..., None] * h + torch.einsum("blhk,blhv->bhkv", k_dec, v)
    return o_inter, o_intra, h_next, G, Gamma


def _no_past(h, q, k, v, gk, scale):  # forgets the state entering the chunk in the outputs
    o_inter, o_intra, h_next, *_ = _parts(h, q, k, v, gk, scale)
    return scale * o_intra, h_next


def _state_not_decayed(h, q, k, v, gk, scale):
    o_inter, o_intra, h_next, G, Gamma = _parts(h, q, k, v, gk, scale)
    return scale * (o_inter + o_intra), h_next - torch.exp(Gamma)[..., None] * h + h


def _strict_mask(h, q, k, v, gk, scale):
    o_inter, o_intra, h_next, *_ = _parts(h, q, k, v, gk, scale, causal_offset=-1)
    return scale * (o_inter + o_intra), h_next


def _flipped_exponent(h, q, k, v, gk, scale):  # e^{G_j − G_i} instead of e^{G_i − G_j}
    o_inter, o_intra, h_next, *_ = _parts(h, q, k, v, gk, scale, sign=-1.0)
    return scale * (o_inter + o_intra), h_next


def _exclusive_cumsum(h, q, k, v, gk, scale):
    o_inter, o_intra, h_next, *_ = _parts(h, q, k, v, gk, scale, G=gk.cumsum(1) - gk)
    return scale * (o_inter + o_intra), h_next


def _unscaled(h, q, k, v, gk, scale):
    return ex.chunk_step(h, q, k, v, gk, 1.0)


def _past_not_decayed_in_outputs(h, q, k, v, gk, scale):  # q ⊙ 1 instead of q ⊙ e^{G}
    o_inter, o_intra, h_next, *_ = _parts(h, q, k, v, gk, scale)
    return scale * (torch.einsum("blhk,bhkv->blhv", q, h) + o_intra), h_next


def _keys_weighted_by_G(h, q, k, v, gk, scale):  # k ⊙ e^{G} instead of k ⊙ e^{Γ − G}
    o_inter, o_intra, h_next, G, Gamma = _parts(h, q, k, v, gk, scale)
    h_bad = torch.exp(Gamma)[..., None] * h + torch.einsum("blhk,blhv->bhkv", k * torch.exp(G), v)
    return scale * (o_inter + o_intra), h_bad


def _only_o(h, q, k, v, gk, scale):
    return ex.chunk_step(h, q, k, v, gk, scale)[0]


def _nan_state(h, q, k, v, gk, scale):
    o, h_next = ex.chunk_step(h, q, k, v, gk, scale)
    h_next[..., -1] = float("nan")
    return o, h_next


@pytest.mark.parametrize("wrong", [_no_past, _state_not_decayed, _strict_mask, _flipped_exponent,
                                   _exclusive_cumsum, _unscaled, _past_not_decayed_in_outputs,
                                   _keys_weighted_by_G, _only_o, _nan_state])
def test_wrong_answer_rejected(wrong):
    with pytest.raises(AssertionError):
        ex.check_chunk_step(wrong)


def test_knobs_at_defaults_reproduce_the_solution():
    # The wrong answers above are the solution with one knob turned: at the defaults they pass.
    def right(h, q, k, v, gk, scale):
        o_inter, o_intra, h_next, *_ = _parts(h, q, k, v, gk, scale)
        return scale * (o_inter + o_intra), h_next

    ex.check_chunk_step(right)


def _units_mixed(h, q, k, v, gk, scale):  # log2-unit G put through e^(...)
    o_inter, o_intra, h_next, *_ = _parts(h, q, k, v, gk, scale, G=ex.RCP_LN2 * gk.cumsum(1))  # _parts uses e^(...)
    return scale * (o_inter + o_intra), h_next


CARRIED, OWN = "the carried-state term diag(2^Γ) h of h_next", "the chunk's own contribution (k_n ⊙ 2^(Γ − G))ᵀ v_n"
PAST_O, OWN_O = "the past's term scale · (q_i ⊙ 2^(G_i))ᵀ h of o", "the chunk's own term of o"


@pytest.mark.parametrize("wrong, named, right_terms", [
    (_no_past, [PAST_O, "the state's term left out"], [CARRIED, OWN, OWN_O]),
    (_state_not_decayed, [CARRIED, "the state not decayed"], [OWN, PAST_O, OWN_O]),
    (_strict_mask, [OWN_O, "the diagonal masked out"], [CARRIED, OWN, PAST_O]),
    (_flipped_exponent, [OWN_O, "the exponent flipped"], [CARRIED, OWN, PAST_O]),
    (_exclusive_cumsum, [CARRIED, OWN, PAST_O, OWN_O, "an exclusive cumsum"], []),
    (_unscaled, [PAST_O, OWN_O, "no scale"], [CARRIED, OWN]),
    (_past_not_decayed_in_outputs, [PAST_O, "q not decayed"], [CARRIED, OWN, OWN_O]),
    (_keys_weighted_by_G, [OWN, "keys weighted by 2^(G) instead of 2^(Γ − G)"], [CARRIED, PAST_O, OWN_O]),
    (_units_mixed, [CARRIED, OWN, PAST_O, OWN_O, "a log2 cumsum put through e^(...)"], []),
])
def test_wrong_answer_names_the_term(wrong, named, right_terms):
    with pytest.raises(AssertionError) as e:
        ex.check_chunk_step(wrong)
    message = str(e.value)
    assert "chunk 0, tokens 0..31" in message or "leaving chunk 0" in message, message
    for part in named:
        assert part in message, (part, message)
    for term in right_terms:  # the terms that are right are not blamed
        assert term not in message, (term, message)


def test_a_right_answer_names_no_term():
    h, v = torch.randn(1, 2, 5, 3), torch.randn(1, 7, 2, 3)
    q, k, gk = torch.randn(1, 7, 2, 5), torch.randn(1, 7, 2, 5), torch.nn.functional.logsigmoid(torch.randn(1, 7, 2, 5))
    assert ex._diagnose(ex.chunk_step, "solution", h, q, k, v, gk, 0.5, 1e-5) == ""


def test_natural_log_cumsum_through_exp2_is_named():
    def natural_through_exp2(h, q, k, v, gk, scale):  # G = gk.cumsum(1) (natural log), then 2^(...)
        o_inter, o_intra, h_next, *_ = _parts(h, q, k, v, gk, scale, G=gk.cumsum(1) / ex.RCP_LN2)
        return scale * (o_inter + o_intra), h_next

    with pytest.raises(AssertionError, match="a natural-log cumsum put through 2"):
        ex.check_chunk_step(natural_through_exp2)
