"""Chapter 08: the checker rejects wrong answers (the shipped solution and a stub:
tests/test_exercises.py); the chapter's PyTorch chunked backward (used by chapter 09) agrees with autograd."""
import math

import pytest
import torch
import torch.nn.functional as F

from chunkstate import reference
from chunkstate.exercises import ch08_backward_recurrence as ex
from chunkstate.testing import check_close


# ---- check_chunk_grads ----

def _parts(h, dh, q, k, v, do, gk, scale, causal_offset=0, out_weight=None):
    """The solution's pieces with knobs that break one thing at a time."""
    L = q.shape[1]
    G = gk.cumsum(1) / math.log(2.0)  # chunk-local, log2 units
    Gamma = G[:, -1]
    causal = torch.ones(L, L, dtype=torch.bool).tril(causal_offset)
    W = torch.exp2((G[:, :, None] - G[:, None, :]).masked_fill(~causal[None, :, :, None, None], -math.inf))
    P = torch.einsum("bihk,bjhk,bijhk->bhij", q, k, W)
    dA = scale * torch.einsum("bihv,bjhv->bhij", do, v) * causal
    w_out = torch.exp2(Gamma[:, None] - G) if out_weight is None else out_weight(G, Gamma)
    dq_inter = scale * torch.exp2(G) * torch.einsum("bhkv,bihv->bihk", h, do)
    dq_intra = torch.einsum("bhij,bjhk,bijhk->bihk", dA, k, W)
    dk_inter = w_out * torch.einsum("bhkv,bjhv->bjhk", dh, v)
    dk_intra = torch.einsum("bhij,bihk,bijhk->bjhk", dA, q, W)
    dv_inter = torch.einsum("bjhk,bhkv->bjhv", k * w_out, dh)
    dv_intra = scale * torch.einsum("bhij,bihv->bjhv", P, do)
    return dq_inter, dq_intra, dk_inter, dk_intra, dv_inter, dv_intra


def _right(*args):
    dqa, dqb, dka, dkb, dva, dvb = _parts(*args)
    return dqa + dqb, dka + dkb, dva + dvb


def _dv_without_dh(*args):  # forgets that v_j reaches later chunks through h[n+1]
    dqa, dqb, dka, dkb, dva, dvb = _parts(*args)
    return dqa + dqb, dka + dkb, dvb


def _dq_without_h(*args):  # forgets the state entering the chunk
    dqa, dqb, dka, dkb, dva, dvb = _parts(*args)
    return dqb, dka + dkb, dva + dvb


def _h_and_dh_swapped(h, dh, *rest):  # pairs h[n] with the wrong side of the chunk
    return _right(dh, h, *rest)


def _strict_mask(*args):
    dqa, dqb, dka, dkb, dva, dvb = _parts(*args, causal_offset=-1)
    return dqa + dqb, dka + dkb, dva + dvb


def _keys_leave_with_2_G(*args):  # 2^{G_j} (the query's weight) instead of 2^{Γ − G_j}
    dqa, dqb, dka, dkb, dva, dvb = _parts(*args, out_weight=lambda G, Gamma: torch.exp2(G))
    return dqa + dqb, dka + dkb, dva + dvb


def _undecayed_exit(*args):  # keys reach the next chunk undecayed
    dqa, dqb, dka, dkb, dva, dvb = _parts(*args, out_weight=lambda G, Gamma: torch.ones_like(G))
    return dqa + dqb, dka + dkb, dva + dvb


def _unscaled(h, dh, q, k, v, do, gk, scale):
    return ex.chunk_grads(h, dh, q, k, v, do, gk, 1.0)


def _two_outputs(*args):
    return ex.chunk_grads(*args)[:2]


def _nan_in_dv(*args):
    dq, dk, dv = ex.chunk_grads(*args)
    dv[:, -1] = float("nan")
    return dq, dk, dv


def test_knobs_at_defaults_reproduce_the_solution():
    ex.check_chunk_grads(_right)


@pytest.mark.parametrize("wrong", [_dv_without_dh, _dq_without_h, _h_and_dh_swapped, _strict_mask,
                                   _keys_leave_with_2_G, _undecayed_exit, _unscaled, _two_outputs, _nan_in_dv])
def test_wrong_answer_rejected(wrong):
    with pytest.raises(AssertionError):
        ex.check_chunk_grads(wrong)


# ---- chunked_state_grads: the PyTorch form chapter 09 checks its kernels against ----

def _gates(names, B, T, H, K, V):
    all_ = dict(g=F.logsigmoid(torch.randn(B, T, H)), g_gamma=-(0.01 + 0.1 * torch.rand(H)),
                gk=F.logsigmoid(torch.randn(B, T, H, K)) / 4, gv=F.logsigmoid(torch.randn(B, T, H, V)) / 4)
    return {n: all_[n] for n in names}


@pytest.mark.parametrize("names", [(), ("g",), ("g_gamma",), ("gk",), ("gv",), ("g", "g_gamma", "gk", "gv")])
@pytest.mark.parametrize("B, T, H, G, K, V, BT, BS, dht", [
    (2, 100, 2, 1, 12, 10, 16, 32, True),   # ragged last chunk, last split of one chunk
    (1, 1, 1, 2, 5, 7, 16, 16, False),      # one token, GQA
    (1, 63, 2, 3, 9, 6, 16, 64, True),      # GQA G = 3, one split holding every chunk
])
def test_chunked_state_grads_dense(names, B, T, H, G, K, V, BT, BS, dht):
    q, do = torch.randn(B, T, H * G, K), torch.randn(B, T, H * G, V)
    k, v = torch.randn(B, T, H, K), torch.randn(B, T, H, V)
    nat = _gates(names, B, T, H, K, V)
    dht_ = torch.randn(B, H, K, V) if dht else None
    dh, dh0 = ex.chunked_state_grads(q, k, v, do, **nat, dht=dht_, chunk_size=BT, split_size=BS)
    r, r0 = reference.state_grads(q, k, v, do, **nat, dht=dht_, chunk_size=BT, split_size=BS)
    check_close(dh, r, f"dh, gates {names}", tol=1e-5)
    check_close(dh0, r0, f"dh0, gates {names}", tol=1e-5)


def test_chunked_state_grads_packed_with_empty_sequences():
    H, G, K, V, BT = 2, 2, 12, 10, 16
    lens = [0, 1, 37, 50, 0, 20]
    cu = torch.tensor([0] + lens).cumsum(0)
    T, N = sum(lens), len(lens)
    q, do = torch.randn(1, T, H * G, K), torch.randn(1, T, H * G, V)
    k, v = torch.randn(1, T, H, K), torch.randn(1, T, H, V)
    nat = _gates(("g", "g_gamma", "gk", "gv"), 1, T, H, K, V)
    dht = torch.randn(N, H, K, V)
    dh, dh0 = ex.chunked_state_grads(q, k, v, do, **nat, dht=dht, cu_seqlens=cu, chunk_size=BT, split_size=2 * BT)
    r, r0 = reference.state_grads(q, k, v, do, **nat, dht=dht, cu_seqlens=cu, chunk_size=BT, split_size=2 * BT)
    check_close(dh, r, "packed dh", tol=1e-5)
    check_close(dh0, r0, "packed dh0", tol=1e-5)
    assert torch.equal(dh0[0], dht[0]) and torch.equal(dh0[4], dht[4])  # empty sequences: dh0 = dht


def test_chunked_state_grads_rejects_bad_sizes():
    q, v = torch.randn(1, 8, 3, 4), torch.randn(1, 8, 2, 4)
    with pytest.raises(ValueError, match="split_size"):
        ex.chunked_state_grads(q[:, :, :2], q[:, :, :2], v, v, chunk_size=16, split_size=24)
    with pytest.raises(ValueError, match="HQ"):
        ex.chunked_state_grads(q, q[:, :, :2], v, torch.randn(1, 8, 3, 4), chunk_size=16)
