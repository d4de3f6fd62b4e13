"""The float64 oracle (chunkstate.reference) checked against itself in independent forms.

Every kernel test trusts these functions, so each is checked against a form that shares no code
path with it: the token loop against the chunked form (states) and the masked attention form
(outputs); the loop's gradients against a hand-written backward recurrence, against autograd
through the attention form, and against finite differences; packed (varlen) batches against
running each sequence alone. Inputs are fresh random numbers on every run.
"""
from __future__ import annotations

import itertools
import math

import pytest
import torch
import torch.nn.functional as F

from chunkstate import reference
from chunkstate.gates import RCP_LN2, prepare_chunk_offsets
from chunkstate.testing import Check, check_close

f64 = torch.float64
TOL = 1e-10  # float64 against float64: rounding only
GATES = ("g", "g_gamma", "gk", "gv")
GATE_SETS = [c for r in range(len(GATES) + 1) for c in itertools.combinations(GATES, r)]
gate_ids = ["+".join(c) or "no_gate" for c in GATE_SETS]

# (B, T, H, K, V, chunk_size BT, split_size BS): odd T, K and V; BS = BT, 2 BT and 4 BT.
SHAPES = [
    (2, 100, 2, 5, 7, 16, 16),
    (2, 63, 2, 7, 5, 16, 32),
    (1, 100, 3, 24, 33, 32, 128),
    (1, 1, 2, 33, 24, 64, 64),
    (2, 63, 1, 5, 24, 64, 128),
    (1, 100, 2, 7, 33, 64, 256),
]
shape_ids = ["B{}T{}H{}K{}V{}BT{}BS{}".format(*s) for s in SHAPES]


def decay(*shape):
    """Natural-log decays: mostly mild (~ -0.05 per token) with an occasional strong one."""
    return F.logsigmoid(torch.randn(*shape, dtype=f64) + 3)


def make_gates(which, B, T, H, K, V):
    return {
        "g": decay(B, T, H) if "g" in which else None,
        "g_gamma": decay(H) if "g_gamma" in which else None,
        "gk": decay(B, T, H, K) if "gk" in which else None,
        "gv": decay(B, T, H, V) if "gv" in which else None,
    }


def make_inputs(B, T, H, K, V, HQ=None, N=None):
    HQ = HQ or H
    N = N or B
    q = torch.randn(B, T, HQ, K, dtype=f64)
    k = torch.randn(B, T, H, K, dtype=f64)
    v = torch.randn(B, T, H, V, dtype=f64)
    do = torch.randn(B, T, HQ, V, dtype=f64)
    h0 = torch.randn(N, H, K, V, dtype=f64)
    dht = torch.randn(N, H, K, V, dtype=f64)
    return q, k, v, do, h0, dht


def log_decays(gates, B, T, H, K, V):
    """Per-token log-decays of the key side [B,T,H,K] and value side [B,T,H,V] (test's own)."""
    a = torch.zeros(B, T, H, K, dtype=f64)
    if gates["g"] is not None:
        a = a + gates["g"][..., None]
    if gates["g_gamma"] is not None:
        a = a + gates["g_gamma"][:, None]
    if gates["gk"] is not None:
        a = a + gates["gk"]
    b = gates["gv"] if gates["gv"] is not None else torch.zeros(B, T, H, V, dtype=f64)
    return a, b


def backward_recurrence(q, do, a, b, dht, scale, split_size, group):
    """dh leaving each split and dh0 for one sequence, written out by hand (no autograd).

    q [L,HQ,K], do [L,HQ,V], a [L,H,K], b [L,H,V] (natural-log decays), dht [H,K,V] or None;
    ``group`` = HQ / H query heads per state head. With G, G_v the cumulative log-decays in log2
    units from the start of split s to token t (inclusive), the state entering split s, h_in,
    reaches token t as diag(2^(G_t)) h_in diag(2^(G_v,t)), so::

        dh[s-1] = diag(2^Γ) dh[s] diag(2^Γ_v)
                  + scale · Σ_{t in s} Σ_{query heads of h} (q_t ⊙ 2^(G_t)) ⊗ (do_t ⊙ 2^(G_v,t))

    with Γ, Γ_v their values at the split's last token.
    """
    L, H, K = a.shape
    V = b.shape[-1]
    dh = dht.clone() if dht is not None else torch.zeros(H, K, V, dtype=f64)
    starts = list(range(0, L, split_size))
    leaving = [None] * len(starts)
    for i in reversed(range(len(starts))):
        leaving[i] = dh
        s0, s1 = starts[i], min(starts[i] + split_size, L)
        G, Gv = RCP_LN2 * a[s0:s1].cumsum(0), RCP_LN2 * b[s0:s1].cumsum(0)  # [l, H, K], [l, H, V]
        qg = q[s0:s1].view(s1 - s0, H, group, K) * torch.exp2(G)[:, :, None]
        dog = do[s0:s1].view(s1 - s0, H, group, V) * torch.exp2(Gv)[:, :, None]
        contrib = scale * torch.einsum("thgk,thgv->hkv", qg, dog)
        dh = torch.exp2(G[-1])[:, :, None] * dh * torch.exp2(Gv[-1])[:, None, :] + contrib
    return leaving, dh


# ---------------------------------------------------------------------------------------------
# States: token loop vs one matmul per chunk
# ---------------------------------------------------------------------------------------------

@pytest.mark.parametrize("which", GATE_SETS, ids=gate_ids)
def test_chunked_states_match_token_loop(which):
    for i, (B, T, H, K, V, BT, BS) in enumerate(SHAPES):
        use_h0 = (i + GATE_SETS.index(which)) % 2 == 1  # each gate set sees both, over the shapes
        _, k, v, _, h0, _ = make_inputs(B, T, H, K, V)
        gates = make_gates(which, B, T, H, K, V)
        h0 = h0 if use_h0 else None
        h_ref, ht_ref = reference.recurrent_states(k, v, **gates, h0=h0, chunk_size=BT, split_size=BS)
        h, ht = reference.chunked_states(k, v, **gates, h0=h0, chunk_size=BT, split_size=BS)
        NS = math.ceil(T / BS)
        assert h_ref.shape == (B, NS, H, K, V) and ht_ref.shape == (B, H, K, V)
        what = f"{'+'.join(which) or 'no gate'}, h0={use_h0}, B{B} T{T} BT{BT} BS{BS}"
        check_close(h, h_ref, f"h (chunked vs loop), {what}", TOL)
        check_close(ht, ht_ref, f"ht (chunked vs loop), {what}", TOL)
        # The state entering the first split is h0 (or zero).
        first = h0 if use_h0 else torch.zeros(B, H, K, V, dtype=f64)
        assert torch.equal(h_ref[:, 0], first), f"h[:, 0] is not the initial state, {what}"


def test_chunked_states_reject_split_not_multiple_of_chunk():
    _, k, v, _, _, _ = make_inputs(1, 10, 1, 4, 4)
    with pytest.raises(ValueError, match="split_size"):
        reference.chunked_states(k, v, chunk_size=16, split_size=24)


def test_states_without_gates_are_prefix_sums():
    """No gate, no h0: the state entering split s is Σ_{t < s·BS} k_t v_tᵀ (an independent formula)."""
    B, T, H, K, V, BS = 2, 63, 2, 5, 7, 16
    _, k, v, _, _, _ = make_inputs(B, T, H, K, V)
    h, ht = reference.recurrent_states(k, v, chunk_size=BS)
    assert torch.count_nonzero(h[:, 0]) == 0, "the state entering split 0 is not zero"
    for s in range(1, math.ceil(T / BS)):
        want = torch.einsum("bthk,bthv->bhkv", k[:, : s * BS], v[:, : s * BS])
        check_close(h[:, s], want, f"h[:, {s}] without gates", TOL)
    check_close(ht, torch.einsum("bthk,bthv->bhkv", k, v), "ht without gates", TOL)


# ---------------------------------------------------------------------------------------------
# Outputs: token loop vs the masked attention form; outputs vs stored states
# ---------------------------------------------------------------------------------------------

@pytest.mark.parametrize("which", GATE_SETS, ids=gate_ids)
def test_outputs_match_parallel_form(which):
    for i, ((B, T, H, K, V), group) in enumerate([((2, 63, 2, 5, 7), 1), ((1, 100, 2, 7, 5), 2),
                                              ((2, 1, 1, 24, 33), 3), ((1, 63, 1, 33, 24), 3)]):
        use_h0 = (i + GATE_SETS.index(which)) % 2 == 1  # each gate set sees both, over the shapes
        q, k, v, _, h0, _ = make_inputs(B, T, H, K, V, HQ=group * H)
        gates = make_gates(which, B, T, H, K, V)
        h0 = h0 if use_h0 else None
        scale = float(torch.rand(()) + 0.1)
        o_ref, ht = reference.recurrent_outputs(q, k, v, **gates, h0=h0, scale=scale)
        assert o_ref.shape == (B, T, group * H, V)
        o = reference.parallel_outputs(q, k, v, **gates, h0=h0, scale=scale)
        what = f"{'+'.join(which) or 'no gate'}, h0={use_h0}, B{B} T{T} HQ={group}H"
        check_close(o, o_ref, f"o (parallel vs loop), {what}", TOL)
        _, ht_states = reference.recurrent_states(k, v, **gates, h0=h0)
        check_close(ht, ht_states, f"ht (outputs vs states), {what}", TOL)


def test_default_scale_is_inverse_sqrt_k():
    q, k, v, _, _, _ = make_inputs(1, 20, 2, 9, 5)
    o_default, _ = reference.recurrent_outputs(q, k, v)
    o_explicit, _ = reference.recurrent_outputs(q, k, v, scale=9 ** -0.5)
    check_close(o_default, o_explicit, "o with default scale", TOL)
    check_close(reference.parallel_outputs(q, k, v), o_explicit, "parallel o with default scale", TOL)


@pytest.mark.parametrize("which", [(), ("g",), ("gk", "gv"), GATES], ids=["no_gate", "g", "gk+gv", "all"])
@pytest.mark.parametrize("group", [1, 2, 3])  # query heads per state head, HQ / H
def test_outputs_at_chunk_ends_read_the_stored_states(which, group):
    """o_t for the last token of chunk n is scale · h[n+1]ᵀ q_t: the state entering chunk n+1 is the
    state after that token. The sequence's last token reads ht."""
    B, T, H, K, V, BT = 2, 100, 2, 7, 5, 16
    q, k, v, _, h0, _ = make_inputs(B, T, H, K, V, HQ=group * H)
    gates = make_gates(which, B, T, H, K, V)
    scale = 0.3
    o, ht = reference.recurrent_outputs(q, k, v, **gates, h0=h0, scale=scale)
    h, ht_states = reference.recurrent_states(k, v, **gates, h0=h0, chunk_size=BT)
    head = torch.arange(group * H) // group  # the state each query head reads (GQA)
    for n in range(h.shape[1] - 1):
        t = (n + 1) * BT - 1
        want = scale * torch.einsum("bhkv,bhk->bhv", h[:, n + 1][:, head], q[:, t])
        check_close(o[:, t], want, f"o at the end of chunk {n}, HQ={group}H", TOL)
    want = scale * torch.einsum("bhkv,bhk->bhv", ht_states[:, head], q[:, -1])
    check_close(o[:, -1], want, f"o at the last token vs ht, HQ={group}H", TOL)
    check_close(ht, ht_states, "ht (outputs vs states)", TOL)


# ---------------------------------------------------------------------------------------------
# Gradients of the states
# ---------------------------------------------------------------------------------------------

GRAD_GATE_SETS = [(), ("g",), ("g_gamma",), ("gk",), ("gv",), ("g", "gk"), ("g_gamma", "gv"), GATES]


@pytest.mark.parametrize("which", GRAD_GATE_SETS, ids=["+".join(c) or "no_gate" for c in GRAD_GATE_SETS])
def test_state_grads_match_backward_recurrence(which):
    j = GRAD_GATE_SETS.index(which)
    for i, ((B, T, H, K, V, BT, BS), group) in enumerate(zip(SHAPES, [1, 2, 3, 1, 2, 3])):
        use_h0, use_dht = [(False, False), (True, False), (False, True), (True, True)][(i + j) % 4]
        q, k, v, do, h0, dht = make_inputs(B, T, H, K, V, HQ=group * H)
        gates = make_gates(which, B, T, H, K, V)
        h0, dht = (h0 if use_h0 else None), (dht if use_dht else None)
        scale = float(torch.rand(()) + 0.1)
        dh, dh0 = reference.state_grads(q, k, v, do, **gates, h0=h0, dht=dht, scale=scale,
                                        chunk_size=BT, split_size=BS)
        NS = math.ceil(T / BS)
        assert dh.shape == (B, NS, H, K, V) and dh0.shape == (B, H, K, V)
        a, b = log_decays(gates, B, T, H, K, V)
        what = f"{'+'.join(which) or 'no gate'}, h0={use_h0}, dht={use_dht}, B{B} T{T} BS{BS} HQ={group}H"
        for bi in range(B):
            leaving, want_dh0 = backward_recurrence(q[bi], do[bi], a[bi], b[bi],
                                                    None if dht is None else dht[bi], scale, BS, group)
            check_close(dh[bi], torch.stack(leaving), f"dh[{bi}], {what}", TOL)
            check_close(dh0[bi], want_dh0, f"dh0[{bi}], {what}", TOL)


@pytest.mark.parametrize("which", [(), ("g", "g_gamma"), ("gk",), GATES], ids=["no_gate", "g+g_gamma", "gk", "all"])
def test_dh0_matches_autograd_through_parallel_form(which):
    """dh0 = d/dh0 [Σ o·do + Σ ht·dht], with o from the attention form and ht from the chunked
    form: neither shares code with the token loop that state_grads differentiates."""
    B, T, H, K, V, group = 2, 63, 2, 5, 7, 2
    q, k, v, do, h0, dht = make_inputs(B, T, H, K, V, HQ=group * H)
    gates = make_gates(which, B, T, H, K, V)
    scale = 0.7
    h0_leaf = h0.clone().requires_grad_(True)
    o = reference.parallel_outputs(q, k, v, **gates, h0=h0_leaf, scale=scale)
    _, ht = reference.chunked_states(k, v, **gates, h0=h0_leaf, chunk_size=16)
    (want,) = torch.autograd.grad((o * do).sum() + (ht * dht).sum(), h0_leaf)
    _, dh0 = reference.state_grads(q, k, v, do, **gates, h0=h0, dht=dht, scale=scale, chunk_size=16)
    check_close(dh0, want, "dh0 vs autograd through the parallel form", TOL)


def test_state_grads_match_finite_differences():
    """The loss is linear in the state, so a central difference along any direction u is exact up to
    rounding: <dh0, u> = (L(h0 + u) - L(h0 - u)) / 2. Likewise dh[s] is dh0 of the suffix that starts
    from the state leaving split s."""
    B, T, H, K, V, BS, group = 1, 63, 2, 5, 7, 16, 2
    q, k, v, do, h0, dht = make_inputs(B, T, H, K, V, HQ=group * H)
    gates = make_gates(GATES, B, T, H, K, V)
    scale = 0.5

    def loss(h_init, t0=0):
        sl = lambda x: None if x is None or x.dim() == 1 else x[:, t0:]  # noqa: E731
        sub = {name: (gate if name == "g_gamma" else sl(gate)) for name, gate in gates.items()}
        o, ht = reference.recurrent_outputs(q[:, t0:], k[:, t0:], v[:, t0:], **sub, h0=h_init, scale=scale)
        return float((o * do[:, t0:]).sum() + (ht * dht).sum())

    dh, dh0 = reference.state_grads(q, k, v, do, **gates, h0=h0, dht=dht, scale=scale, chunk_size=BS)
    h, _ = reference.recurrent_states(k, v, **gates, h0=h0, chunk_size=BS)
    for s in range(-1, dh.shape[1] - 1):  # s = -1: h0 itself
        grad = dh0 if s < 0 else dh[:, s]
        h_leaving = h0 if s < 0 else h[:, s + 1]
        t0 = (s + 1) * BS
        for _ in range(2):
            u = torch.randn_like(h0)
            fd = (loss(h_leaving + u, t0) - loss(h_leaving - u, t0)) / 2
            an = float((grad * u).sum())
            assert abs(fd - an) <= 1e-9 * max(1.0, abs(fd)), \
                f"split {s}: finite difference {fd:.12g} != <dh, u> {an:.12g}"
    # The last split's leaving gradient is dht: nothing comes after it.
    check_close(dh[:, -1], dht, "dh leaving the last split", TOL)


def test_token_loop_passes_gradcheck():
    """state_grads is autograd through the token loop: gradcheck that loop in every input."""
    B, T, H, K, V, group = 1, 5, 1, 3, 2, 2
    q, k, v, _, h0, _ = make_inputs(B, T, H, K, V, HQ=group * H)
    g, gk, gv = decay(B, T, H), decay(B, T, H, K), decay(B, T, H, V)
    g_gamma = decay(H)
    inputs = [x.requires_grad_(True) for x in (q, k, v, g, g_gamma, gk, gv, h0)]

    def f(q, k, v, g, g_gamma, gk, gv, h0):
        o, ht = reference.recurrent_outputs(q, k, v, g, g_gamma, gk, gv, h0, scale=0.6)
        return o, ht

    assert torch.autograd.gradcheck(f, inputs, eps=1e-6, atol=1e-7, rtol=1e-5, fast_mode=True)


# ---------------------------------------------------------------------------------------------
# Packed (varlen) batches vs each sequence alone
# ---------------------------------------------------------------------------------------------

@pytest.mark.parametrize("cu", [[0, 0, 1, 40, 100], [0, 17, 17, 50], [0, 1], [0, 33, 33]],
                         ids=lambda cu: "cu" + "-".join(map(str, cu)))
@pytest.mark.parametrize("which", [(), ("g",), ("g_gamma", "gk"), GATES], ids=["no_gate", "g", "g_gamma+gk", "all"])
def test_varlen_matches_each_sequence_alone(which, cu):
    T, H, K, V, group, BT, BS = cu[-1], 2, 5, 7, 2, 16, 32
    N = len(cu) - 1
    cu_seqlens = torch.tensor(cu, dtype=torch.long)
    q, k, v, do, h0, dht = make_inputs(1, T, H, K, V, HQ=group * H, N=N)
    gates = make_gates(which, 1, T, H, K, V)
    scale = 0.4
    h, ht = reference.recurrent_states(k, v, **gates, h0=h0, cu_seqlens=cu_seqlens, chunk_size=BT, split_size=BS)
    hc, htc = reference.chunked_states(k, v, **gates, h0=h0, cu_seqlens=cu_seqlens, chunk_size=BT, split_size=BS)
    o, ht_o = reference.recurrent_outputs(q, k, v, **gates, h0=h0, cu_seqlens=cu_seqlens, scale=scale)
    dh, dh0 = reference.state_grads(q, k, v, do, **gates, h0=h0, dht=dht, cu_seqlens=cu_seqlens, scale=scale,
                                    chunk_size=BT, split_size=BS)
    offsets = prepare_chunk_offsets(cu_seqlens, BS).tolist()
    assert h.shape == (1, offsets[-1], H, K, V) and dh.shape == h.shape and ht.shape == (N, H, K, V)
    check_close(hc, h, "varlen h (chunked vs loop)", TOL)
    check_close(htc, ht, "varlen ht (chunked vs loop)", TOL)
    check_close(ht_o, ht, "varlen ht (outputs vs states)", TOL)
    for n in range(N):
        bos, eos = cu[n], cu[n + 1]
        s0, s1 = offsets[n], offsets[n + 1]
        if bos == eos:  # an empty sequence: no slots, no outputs, its final state is its h0
            assert s0 == s1, f"empty sequence {n} owns slots {s0}:{s1}"
            check_close(ht[n], h0[n], f"ht of empty sequence {n}", TOL)
            check_close(dh0[n], dht[n], f"dh0 of empty sequence {n}", TOL)
            continue
        sl = lambda x: None if x is None else (x if x.dim() == 1 else x[:, bos:eos])  # noqa: E731
        one = {name: sl(gate) for name, gate in gates.items()}
        h1, ht1 = reference.recurrent_states(k[:, bos:eos], v[:, bos:eos], **one, h0=h0[n:n + 1],
                                             chunk_size=BT, split_size=BS)
        o1, _ = reference.recurrent_outputs(q[:, bos:eos], k[:, bos:eos], v[:, bos:eos], **one,
                                            h0=h0[n:n + 1], scale=scale)
        dh1, dh01 = reference.state_grads(q[:, bos:eos], k[:, bos:eos], v[:, bos:eos], do[:, bos:eos], **one,
                                          h0=h0[n:n + 1], dht=dht[n:n + 1], scale=scale,
                                          chunk_size=BT, split_size=BS)
        check_close(h[:, s0:s1], h1, f"varlen h of sequence {n}", TOL)
        check_close(ht[n:n + 1], ht1, f"varlen ht of sequence {n}", TOL)
        check_close(o[:, bos:eos], o1, f"varlen o of sequence {n}", TOL)
        check_close(dh[:, s0:s1], dh1, f"varlen dh of sequence {n}", TOL)
        check_close(dh0[n:n + 1], dh01, f"varlen dh0 of sequence {n}", TOL)


def test_varlen_rejects_batch_larger_than_one():
    _, k, v, _, _, _ = make_inputs(2, 10, 1, 4, 4)
    with pytest.raises(ValueError, match="batch size must be 1"):
        reference.recurrent_states(k, v, cu_seqlens=torch.tensor([0, 10]))


def test_conftest_poisons_empty_with_nan():
    """tests/conftest.py makes torch.empty / empty_like return NaN in every test here, so a kernel's
    output element that is never written fails its check instead of passing by luck."""
    assert torch.isnan(torch.empty(3, 4)).all()
    assert torch.isnan(torch.empty_like(torch.zeros(5, dtype=torch.float16))).all()
    assert torch.empty(3, dtype=torch.long).shape == (3,)  # integer tensors are left alone


# ---------------------------------------------------------------------------------------------
# check_close: the labelled line a notebook cell shows
# ---------------------------------------------------------------------------------------------

def test_check_close_shows_a_labelled_line_and_stays_a_number():
    ref = torch.randn(6, 5, dtype=f64)
    out = ref + 1e-9 * torch.randn(6, 5, dtype=f64)
    err = check_close(out, ref, "h: chunked form vs token loop", 1e-6)
    exact = (out - ref).norm().item() / ref.norm().item()
    shown = repr(err)
    assert isinstance(err, Check) and isinstance(err, float)
    assert shown.startswith("h: chunked form vs token loop: "), shown  # what was compared
    shown_err = float(shown.split("rel. error ")[1].split(" <")[0])  # the error, to 2 significant digits
    assert abs(shown_err - exact) <= 0.05 * exact, (shown, exact)
    assert "< 1e-6" in shown and shown.endswith("✓"), shown  # the tolerance
    assert str(err) == shown and f"{err}" == shown
    # a number for the callers that compute with it
    assert err == exact and err < 1e-6 and 2 * err == 2 * exact and f"{err:.3e}" == f"{exact:.3e}"
    assert type(err + 0) is float
    zero = check_close(ref, ref.clone(), "o: kernel vs loop", 2.5e-3)
    assert repr(zero) == "o: kernel vs loop: rel. error 0 < 0.0025 ✓"


def test_check_close_labelled_line_is_what_ipython_displays():
    formatters = pytest.importorskip("IPython.core.formatters")
    err = check_close(torch.ones(3), torch.ones(3), "dh0: kernel vs autograd", 1e-12)
    assert formatters.PlainTextFormatter()(err) == "dh0: kernel vs autograd: rel. error 0 < 1e-12 ✓"


def test_check_close_failure_names_what_the_error_and_the_tolerance():
    ref = torch.ones(4, dtype=f64)
    with pytest.raises(AssertionError, match=r"^ht: loop vs chunked: relative error 1\.000e-01 is not below 1\.0e-03$"):
        check_close(ref * 1.1, ref, "ht: loop vs chunked", 1e-3)
