"""chunkstate.gates against plain Python loops: chunk-local cumulative sums and packed-batch bookkeeping."""
from __future__ import annotations

import math

import pytest
import torch

from chunkstate.gates import (RCP_LN2, chunk_local_cumsum, kernel_gates, prepare_chunk_indices,
                              prepare_chunk_offsets, prepare_lens)
from chunkstate.testing import check_close, random_gates, state_tolerance

f64 = torch.float64
CU_CASES = [[0, 0, 1, 40, 100], [0, 17, 17, 50], [0, 1], [0, 33, 33], [0, 64, 128, 129]]
cu_ids = ["cu" + "-".join(map(str, cu)) for cu in CU_CASES]


def loop_cumsum(gate, chunk_size, cu=None, scale=1.0, reverse=False):
    """out[:, t] = scale · Σ gate[:, s] over the tokens s of t's chunk with s <= t (s >= t reversed)."""
    B, T = gate.shape[:2]
    out = torch.full(gate.shape, float("nan"), dtype=f64)
    segments = [(b, 0, T) for b in range(B)] if cu is None else [(0, cu[n], cu[n + 1]) for n in range(len(cu) - 1)]
    for b, bos, eos in segments:
        for c0 in range(bos, eos, chunk_size):
            c1 = min(c0 + chunk_size, eos)
            for t in range(c0, c1):
                acc = torch.zeros(gate.shape[2:], dtype=f64)
                for s in (range(t, c1) if reverse else range(c0, t + 1)):
                    acc = acc + gate[b, s].to(f64)
                out[b, t] = scale * acc
    return out


def make_gate(B, T, H, D):
    shape = (B, T, H) if D is None else (B, T, H, D)
    return torch.nn.functional.logsigmoid(torch.randn(*shape, dtype=f64))


@pytest.mark.parametrize("reverse", [False, True], ids=["forward", "reverse"])
@pytest.mark.parametrize("D", [None, 7], ids=["3d", "4d"])
@pytest.mark.parametrize("B,T,BT", [(2, 1, 16), (2, 63, 16), (1, 100, 64), (2, 100, 7), (1, 64, 64), (1, 65, 32)])
def test_chunk_local_cumsum_dense_matches_loop(B, T, BT, D, reverse):
    gate = make_gate(B, T, 3, D)
    want = loop_cumsum(gate, BT, reverse=reverse)
    got = chunk_local_cumsum(gate, BT, scale=1.0, reverse=reverse, dtype=f64)
    assert got.shape == gate.shape and got.dtype == f64
    check_close(got, want, f"cumsum B{B} T{T} BT{BT}", 1e-12)
    # Default: log2 units (times log2 e) in float32.
    got32 = chunk_local_cumsum(gate, BT, reverse=reverse)
    assert got32.dtype == torch.float32
    check_close(got32, want * RCP_LN2, f"float32 log2 cumsum B{B} T{T} BT{BT}", 1e-6)


@pytest.mark.parametrize("reverse", [False, True], ids=["forward", "reverse"])
@pytest.mark.parametrize("D", [None, 5], ids=["3d", "4d"])
@pytest.mark.parametrize("BT", [16, 7])
@pytest.mark.parametrize("cu", CU_CASES, ids=cu_ids)
def test_chunk_local_cumsum_varlen_matches_loop(cu, BT, D, reverse):
    gate = make_gate(1, cu[-1], 2, D)
    cu_seqlens = torch.tensor(cu, dtype=torch.long)
    want = loop_cumsum(gate, BT, cu, scale=0.5, reverse=reverse)
    got = chunk_local_cumsum(gate, BT, cu_seqlens=cu_seqlens, scale=0.5, reverse=reverse, dtype=f64)
    check_close(got, want, f"varlen cumsum {cu} BT{BT}", 1e-12)
    # int32 offsets (what kernels take) give the same answer.
    got32 = chunk_local_cumsum(gate, BT, cu_seqlens=cu_seqlens.int(), scale=0.5, reverse=reverse, dtype=f64)
    check_close(got32, want, f"varlen cumsum, int32 cu_seqlens {cu}", 1e-12)


def test_cumsum_restarts_at_sequence_starts_not_at_global_chunk_boundaries():
    """A sequence starting at token 5 has its first chunk at 5..5+BT-1, not at a multiple of BT."""
    gate = torch.ones(1, 12, 1, dtype=f64)
    got = chunk_local_cumsum(gate, 4, cu_seqlens=torch.tensor([0, 5, 12]), scale=1.0, dtype=f64)[0, :, 0]
    assert got.tolist() == [1, 2, 3, 4, 1, 1, 2, 3, 4, 1, 2, 3]


@pytest.mark.parametrize("BT", [1, 7, 16, 64])
@pytest.mark.parametrize("cu", CU_CASES + [[0], [0, 0, 0]], ids=cu_ids + ["cu0", "cu0-0-0"])
def test_chunk_bookkeeping_matches_loops(cu, BT):
    cu_seqlens = torch.tensor(cu, dtype=torch.long)
    lens = [b - a for a, b in zip(cu, cu[1:])]
    assert prepare_lens(cu_seqlens).tolist() == lens
    offsets, rows = [0], []
    for n, L in enumerate(lens):
        offsets.append(offsets[-1] + math.ceil(L / BT))
        rows += [[n, i] for i in range(math.ceil(L / BT))]
    got_offsets = prepare_chunk_offsets(cu_seqlens, BT)
    got_rows = prepare_chunk_indices(cu_seqlens, BT)
    assert got_offsets.dtype == torch.int64 and got_offsets.tolist() == offsets
    assert got_rows.dtype == torch.int64 and got_rows.shape == (len(rows), 2)
    assert got_rows.tolist() == rows
    # int32 offsets give the same bookkeeping
    assert prepare_chunk_offsets(cu_seqlens.int(), BT).tolist() == offsets
    assert prepare_chunk_indices(cu_seqlens.int(), BT).tolist() == rows


@pytest.mark.parametrize("shape", [(4, 3), (10,), (1, 4, 2, 3, 5)], ids=["2d", "1d", "5d"])
def test_cumsum_rejects_wrong_dims(shape):
    with pytest.raises(ValueError, match=r"gate must be \[B, T, H\] or \[B, T, H, D\]"):
        chunk_local_cumsum(torch.zeros(shape), 4)


@pytest.mark.parametrize("D", [None, 3], ids=["3d", "4d"])
def test_cumsum_rejects_batch_with_cu_seqlens(D):
    gate = make_gate(2, 10, 2, D)
    with pytest.raises(ValueError, match="batch size must be 1"):
        chunk_local_cumsum(gate, 4, cu_seqlens=torch.tensor([0, 4, 10]))


@pytest.mark.parametrize("chunk_size,exc", [(0, ValueError), (-4, ValueError), (2.5, TypeError)])
def test_rejects_non_positive_chunk_size(chunk_size, exc):
    """Not positive: a ValueError; not an int: a TypeError (as the kernels' chunk_size)."""
    gate = make_gate(1, 10, 2, None)
    cu = torch.tensor([0, 3, 10])
    for fn in (lambda: chunk_local_cumsum(gate, chunk_size), lambda: prepare_chunk_offsets(cu, chunk_size),
               lambda: prepare_chunk_indices(cu, chunk_size)):
        with pytest.raises(exc, match="chunk_size must be"):
            fn()


@pytest.mark.parametrize("cu,why", [([0, 8], "end at T"), ([0, 12], "end at T"), ([1, 10], "start at 0"),
                                    ([0, 6, 3, 10], "non-decreasing"), ([0], "at least 2")],
                         ids=["short", "long", "start", "decreasing", "one"])
def test_cumsum_rejects_bad_cu_seqlens(cu, why):
    gate = make_gate(1, 10, 2, None)
    with pytest.raises(ValueError, match=f"cu_seqlens must .*{why}"):
        chunk_local_cumsum(gate, 4, cu_seqlens=torch.tensor(cu))


# ---------------------------------------------------------------------------------------------
# kernel_gates: natural-log gates to the kernels' arguments; random_gates: gates for checks
# ---------------------------------------------------------------------------------------------

@pytest.mark.parametrize("cu", [None, [0, 0, 1, 40, 100]], ids=["dense", "packed"])
def test_kernel_gates_is_each_gates_cumsum_and_log2_gamma(cu):
    B, T, H, K, V, BT = (2, 100, 3, 5, 6, 16) if cu is None else (1, 100, 3, 5, 6, 16)
    cu = None if cu is None else torch.tensor(cu)
    nat = random_gates(B, T, H, K, V)
    got = kernel_gates(nat, BT, cu)
    assert set(got) == {"g", "g_gamma", "gk", "gv"}
    for name in ("g", "gk", "gv"):
        assert got[name].dtype == torch.float32
        check_close(got[name], loop_cumsum(nat[name], BT, None if cu is None else cu.tolist(), scale=RCP_LN2),
                    f"kernel_gates {name}", 1e-6)
    assert torch.equal(got["g_gamma"], RCP_LN2 * nat["g_gamma"])
    assert set(kernel_gates({"gk": nat["gk"]}, BT, cu)) == {"gk"}  # only the gates given


def test_kernel_gates_drive_the_kernel_to_the_token_loop(device):
    """What kernel_gates returns is what chunk_fwd_h takes: its states match the token loop run on
    the natural-log gates."""
    import chunkstate
    from chunkstate import reference

    B, T, H, K, V, BT = 1, 40, 2, 16, 16, 16
    k, v = torch.randn(B, T, H, K, device=device), torch.randn(B, T, H, V, device=device)
    nat = random_gates(B, T, H, K, V, mild=True, device=device)
    h, ht = chunkstate.chunk_fwd_h(k, v, **kernel_gates(nat, BT), output_final_state=True, chunk_size=BT)
    ref_h, ref_ht = reference.recurrent_states(k, v, **nat, chunk_size=BT)
    tol = state_tolerance(torch.float32)  # fp32 dots: exact in the interpreter, tf32 on a GPU
    check_close(h, ref_h, "chunk_fwd_h with kernel_gates vs the loop: h", tol)
    check_close(ht, ref_ht, "ht", tol)


def test_kernel_gates_names_a_key_that_is_no_gate():
    with pytest.raises(ValueError, match="'gq'"):
        kernel_gates({"g": torch.zeros(1, 4, 1), "gq": torch.zeros(1)}, 4)


@pytest.mark.parametrize("mild", [False, True])
def test_random_gates_shapes_and_strengths(mild):
    B, T, H, K, V = 2, 400, 3, 4, 5
    nat = random_gates(B, T, H, K, V, mild=mild)
    shapes = {"g": (B, T, H), "g_gamma": (H,), "gk": (B, T, H, K), "gv": (B, T, H, V)}
    assert {n: tuple(x.shape) for n, x in nat.items()} == shapes
    assert all((x < 0).all() for x in nat.values())  # every gate decays
    check_close(nat["g_gamma"], torch.log(1 - 2.0 ** (-5.0 - torch.arange(H))), "RetNet's decays", 1e-7)
    mean_g = nat["g"].mean().item()  # E[logsigmoid(x)] ≈ -0.81 for x ~ N(0, 1); ≈ -0.07 for x + 3
    assert (-0.12 < mean_g < -0.03) if mild else (-0.95 < mean_g < -0.68), mean_g
    ratio = nat["gk"].mean().item() / mean_g
    assert 0.6 < ratio < 1.6 if mild else 0.15 < ratio < 0.35, ratio  # gk a quarter of g's strength unless mild
