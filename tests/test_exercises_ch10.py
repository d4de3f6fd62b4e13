"""Chapter 10's checkers reject wrong answers and name the likely mistake (the shipped solutions and a
stub: tests/test_exercises.py)."""
import math

import pytest
import torch

from chunkstate import gla
from chunkstate.backward import chunk_bwd_dh
from chunkstate.exercises import ch10_complete_layer as ex
from chunkstate.exercises.ch08_backward_recurrence import chunk_grads
from chunkstate.forward import chunk_fwd_h
from chunkstate.gates import chunk_local_cumsum


# ---------------------------------------------------------------- exercise 1: the gate gradient

def _gate_grad(h, dh, q, k, v, do, gk, scale, reverse=True, end_k=True, end_h=True, factor=1.0, sign=1.0):
    """A learner's answer with knobs that break one thing at a time (natural-log G here, unlike the
    shipped solution's log2: the same numbers)."""
    dq, dk, _ = chunk_grads(h, dh, q, k, v, do, gk, scale)
    G = gk.cumsum(1)
    c = sign * (q * dq - k * dk)
    if end_k:
        c[:, -1] += sign * (k * torch.exp(G[:, -1:] - G) * torch.einsum("bhkv,bjhv->bjhk", dh, v)).sum(1)
    if end_h:
        c[:, -1] += sign * torch.exp(G[:, -1]) * (h * dh).sum(-1)
    out = c.flip(1).cumsum(1).flip(1) if reverse else c.cumsum(1)
    return factor * out


def test_gate_grad_knobs_at_defaults_pass():
    ex.check_chunk_gate_grad(_gate_grad)


@pytest.mark.parametrize("knobs, message", [
    (dict(reverse=False), "a forward cumulative sum"),
    (dict(end_k=False, end_h=False), "the chunk-end terms are missing"),
    (dict(end_h=False), "the entering state's term is missing"),
    (dict(end_k=False), "k_j ⊙ dk_inter_j is missing"),
    (dict(factor=math.log(2.0)), "a factor ln 2 too many"),
    (dict(factor=1 / math.log(2.0)), "a factor ln 2 too few"),
    (dict(sign=-1.0), "the sign is flipped"),
], ids=["forward-cumsum", "no-end-terms", "no-state-term", "no-k-term", "times-ln2", "over-ln2", "sign"])
def test_gate_grad_mistake_named(knobs, message):
    def wrong(h, dh, q, k, v, do, gk, scale):
        return _gate_grad(h, dh, q, k, v, do, gk, scale, **knobs)

    with pytest.raises(AssertionError, match=message):
        ex.check_chunk_gate_grad(wrong)


def test_gate_grad_unknown_mistake_reports_the_chunk():
    def wrong(h, dh, q, k, v, do, gk, scale):  # the diagonal's term dropped: no known mistake
        out = _gate_grad(h, dh, q, k, v, do, gk, scale)
        return out + 0.1 * q

    with pytest.raises(AssertionError, match=r"dgk of chunk 0, tokens 0\.\.0 \(B=1"):
        ex.check_chunk_gate_grad(wrong)


def test_gate_grad_wrong_shape_rejected():
    def wrong(h, dh, q, k, v, do, gk, scale):
        return _gate_grad(h, dh, q, k, v, do, gk, scale).sum(-1)

    with pytest.raises(AssertionError, match=r"dgk must be \[1, 1, 1, 4\]"):
        ex.check_chunk_gate_grad(wrong)


# ---------------------------------------------------------------- exercise 2: the layer's backward, wired

def _wired(q, k, v, g, do, dht, h0, cu_seqlens, scale, chunk_size, cumsum="right", use_dht=True, use_h0=True,
           pad="last", sum_keys=True):
    """A learner's wiring with knobs that break one thing at a time."""
    _, T, H, K = q.shape
    V = v.shape[-1]
    Gg = {"right": lambda: chunk_local_cumsum(g, chunk_size, cu_seqlens),
          "raw": lambda: g,
          "natural": lambda: chunk_local_cumsum(g, chunk_size, cu_seqlens, scale=1.0),
          "flat": lambda: chunk_local_cumsum(g, chunk_size)}[cumsum]()
    h, _ = chunk_fwd_h(k, v, g=Gg, h0=h0 if use_h0 else None, cu_seqlens=cu_seqlens, chunk_size=chunk_size,
                       states_in_fp32=True)
    dh, dh0 = chunk_bwd_dh(q, k, v, do, h0, dht if use_dht else None, scale, g=Gg, cu_seqlens=cu_seqlens,
                           chunk_size=chunk_size, states_in_fp32=True)
    lay = gla.ChunkLayout(1, T, cu_seqlens, chunk_size, q.device)
    G = lay.to_chunks(Gg[..., None].repeat(1, 1, 1, K), pad=pad)
    C = lay.C
    dq, dk, dv, da = gla.intra_backward(lay.to_chunks(q), lay.to_chunks(k), lay.to_chunks(v), G,
                                        h.view(C, H, K, V), lay.to_chunks(do), dh.view(C, H, K, V), scale)
    da = lay.from_chunks(da)
    return lay.from_chunks(dq), lay.from_chunks(dk), lay.from_chunks(dv), da.sum(-1) if sum_keys else da, dh0


def test_wiring_knobs_at_defaults_pass():
    ex.check_layer_backward(_wired)


@pytest.mark.parametrize("knobs, message", [
    (dict(cumsum="raw"), "the kernels got the per-token gate g itself"),
    (dict(cumsum="natural"), "the gate's cumulative sum is in natural log"),
    (dict(cumsum="flat"), "the gate's cumulative sum ignores cu_seqlens"),
    (dict(use_dht=False), "dht never reached chunk_bwd_dh"),
    (dict(use_h0=False), "chunk_fwd_h ran without h0"),
    (dict(pad="zero"), "G was padded with zeros"),
    (dict(sum_keys=False), r"dg must be \[1, T, H\].*summed over the key dimension"),
], ids=["raw-gate", "natural-log", "across-sequences", "no-dht", "no-h0", "zero-padding", "dg-not-summed"])
def test_wiring_mistake_named(knobs, message):
    def wrong(*args):
        return _wired(*args, **knobs)

    with pytest.raises(AssertionError, match=message):
        ex.check_layer_backward(wrong)


def test_wiring_unknown_mistake_names_the_gradient():
    def wrong(*args):
        dq, dk, dv, dg, dh0 = _wired(*args)
        return dq, dk, dv, dg, 2 * dh0

    with pytest.raises(AssertionError, match=r"packed lengths \[0, 1, 37, 20\], BT=16: dh0 vs autograd through the token loop"):
        ex.check_layer_backward(wrong)


def test_wiring_not_a_tuple_rejected():
    with pytest.raises(AssertionError, match=r"must return a tuple \(dq, dk, dv, dg, dh0\)"):
        ex.check_layer_backward(lambda *args: list(_wired(*args)))
