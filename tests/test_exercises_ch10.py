"""Chapter 10's checkers reject wrong answers (the shipped solutions and a stub: tests/test_exercises.py)."""
import math

import pytest
import torch

from chunkstate.exercises import ch10_complete_layer as ex


# ---------------------------------------------------------------- exercise 1: the inter-chunk outputs

def _inter(q, gk, h, scale, G=None, decay=True, use_scale=True):
    G = gk.cumsum(1) if G is None else G
    qd = q * torch.exp(G) if decay else q
    return (scale if use_scale else 1.0) * torch.einsum("blhk,bhkv->blhv", qd, h)


def _inter_unscaled(q, gk, h, scale):
    return _inter(q, gk, h, scale, use_scale=False)


def _inter_not_decayed(q, gk, h, scale):  # q instead of q ⊙ e^{G}
    return _inter(q, gk, h, scale, decay=False)


def _inter_decayed_to_end(q, gk, h, scale):  # e^{Γ} for every token instead of e^{G_i}
    G = gk.cumsum(1)
    return _inter(q, gk, h, scale, G=G[:, -1:].expand_as(G))


def _inter_exclusive_cumsum(q, gk, h, scale):  # the state decayed up to token i-1 only
    return _inter(q, gk, h, scale, G=gk.cumsum(1) - gk)


def _inter_whole_output(q, gk, h, scale):  # adds the chunk's own tokens (needs k, v: a zero-free stand-in)
    return _inter(q, gk, h, scale) + 0.1 * q.sum(-1, keepdim=True)


def _inter_wrong_shape(q, gk, h, scale):
    return _inter(q, gk, h, scale).transpose(1, 2)


def _inter_nan(q, gk, h, scale):
    o = _inter(q, gk, h, scale)
    o[:, -1] = float("nan")
    return o


def _inter_not_a_tensor(q, gk, h, scale):
    return _inter(q, gk, h, scale).tolist()


@pytest.mark.parametrize("wrong", [_inter_unscaled, _inter_not_decayed, _inter_decayed_to_end,
                                   _inter_exclusive_cumsum, _inter_whole_output, _inter_wrong_shape,
                                   _inter_nan, _inter_not_a_tensor])
def test_inter_output_wrong_answer_rejected(wrong):
    with pytest.raises(AssertionError):
        ex.check_inter_output(wrong)


# ---------------------------------------------------------------- exercise 2: dv from dh

def _dv(q, k, v, gk, do, dh, scale, mask_offset=0, upper=False, inter=True, intra=True, to_end=True,
        intra_scale=True, G=None):
    """The solution with knobs to break one thing at a time."""
    G = gk.cumsum(1) if G is None else G
    Gamma = G[:, -1]
    L = q.shape[1]
    causal = torch.ones(L, L, dtype=torch.bool).tril(mask_offset)
    if upper:
        causal = causal.T
    diff = (G[:, :, None] - G[:, None, :]).masked_fill(~causal[None, :, :, None, None], -math.inf)
    P = torch.einsum("bihk,bjhk,bijhk->bhij", q, k, torch.exp(diff))
    dv = torch.zeros_like(v)
    if intra:
        dv = dv + (scale if intra_scale else 1.0) * torch.einsum("bhij,bihv->bjhv", P, do)
    if inter:
        w = torch.exp(Gamma[:, None] - G) if to_end else torch.exp(G)
        dv = dv + torch.einsum("bjhk,bhkv->bjhv", k * w, dh)
    return dv


def test_chunk_dv_knobs_at_defaults_pass():
    ex.check_chunk_dv(_dv)


@pytest.mark.parametrize("knobs", [
    dict(inter=False),                # forgets the later chunks (dh)
    dict(intra=False),                # forgets the chunk's own outputs
    dict(to_end=False),               # k_j ⊙ e^{G_j} instead of e^{Γ − G_j}
    dict(mask_offset=-1),             # drops the diagonal (i = j)
    dict(upper=True),                 # sums over i <= j instead of i >= j
    dict(intra_scale=False),          # scale left out of the intra term
], ids=["no-inter", "no-intra", "decay-from-start", "strict-mask", "wrong-side", "unscaled"])
def test_chunk_dv_wrong_answer_rejected(knobs):
    def wrong(q, k, v, gk, do, dh, scale):
        return _dv(q, k, v, gk, do, dh, scale, **knobs)

    with pytest.raises(AssertionError):
        ex.check_chunk_dv(wrong)


def test_chunk_dv_exclusive_cumsum_rejected():
    def wrong(q, k, v, gk, do, dh, scale):
        return _dv(q, k, v, gk, do, dh, scale, G=gk.cumsum(1) - gk)

    with pytest.raises(AssertionError):
        ex.check_chunk_dv(wrong)
