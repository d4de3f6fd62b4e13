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
