"""``chunkstate.chunk_gla`` (forward and backward) against autograd through the float64 token loop.

On CPU (Triton's interpreter, fp32 unless said): the output, ``ht`` and every gradient (q, k, v,
g, gk, initial_state; the loss reads ``o`` and ``ht``) over odd shapes (T = 1, 63, 100; K, V not
powers of two), g alone, gk alone, both, no gate, with and without h0 / ht, chunk sizes 16/32/64
(log2 BT levels of halving each), packed batches with empty and one-token sequences; a loss on
``o`` only and on ``ht`` only; fp16; decays strong enough that e^{-G} overflows fp32;
``torch.autograd.gradcheck`` in float64; and the input errors.

gradcheck: the kernels do not compute in float64 (``tl.dot`` on a GPU takes no fp64, the state
is accumulated in fp32, and fp64 states stored by ``chunk_fwd_h`` under the interpreter came out
wrong), so ``chunk_gla`` refuses float64 and a float64 gradcheck cannot run through
``chunk_fwd_h`` / ``chunk_bwd_dh``. It runs the op's autograd Function with those two swapped for
float64 PyTorch versions written here (same signatures, same log2 chunk-local gates): everything
else — the gate cumsums, the chunk layout and its padding, the intra-chunk forward and backward,
the gate gradient, the autograd glue — is the op's own code.

On a GPU only (skipped on CPU, saying why): bf16 and fp32 against the loop, and against
fla-core 0.6.0's ``chunk_gla`` / ``chunk_simple_gla`` where fla runs here.

Inputs are fresh random tensors on every run; every call runs with ``torch.empty`` NaN-poisoned
(tests/conftest.py). Errors are relative Frobenius errors (``testing.rel_err``). Tolerances:

- ``TOL_FP32 = 1e-5`` on CPU: the interpreter's ``tl.dot`` is exact fp32, the intra-chunk part is
  fp32 PyTorch; an output or gradient is a sum of at most a few hundred O(1) fp32 products:
  worst case ~300 · 2^-24 ≈ 2e-5 in an element, RMS far less (measured ~5e-7).
- ``TOL_FP16 = 2e-3``: the kernels round their decayed chunk operands to fp16 before ``tl.dot``
  and the forward stores h in fp16; the outputs and gradients are rounded to fp16 once more:
  about three roundings of 2^-11 ≈ 4.9e-4 (worst case 1.5e-3; measured ~2e-4).
- ``TOL_STRONG = 1e-3`` for what decays under gates near -40 per token: the chunk-local cumsums
  are fp32 log2 values up to 64 · 41 · 1.4427 ≈ 3800 in size, where fp32 spacing is 2^-12; each
  factor 2^{G_i − G_j} is then off by up to 2 · 2^-13 · ln 2 ≈ 1.7e-4, and a term carries up to
  two such factors (3.4e-4). On the GPU these terms also go through tf32 ``tl.dot`` as every
  fp32 term does, so there the two errors add: ``TOL_TF32 + TOL_STRONG`` (1.01e-3 was seen for
  dinitial_state on the H200). Terms without a decay (o, ht, dq, dk, dv: dominated by the
  token's own k·v) keep ``TOL_FP32`` (``TOL_TF32`` on the GPU).
- bf16 on the GPU ``TOL_BF16 = 1e-2``: the same three roundings at 2^-8 (RMS ≈ 4e-3, as in
  tests/test_forward.py) plus the final rounding of o and of the gradients (2^-9).
- fp32 on the GPU ``TOL_TF32 = 2e-3``: the kernels' ``tl.dot`` rounds fp32 operands to tf32
  (10-bit mantissa), 2 · 2^-10 at worst; the PyTorch part stays fp32.
"""
from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F

import chunkstate
from chunkstate import gla, reference
from chunkstate.gates import chunk_local_cumsum
from chunkstate.gla import chunk_gla
from chunkstate.testing import check_close, rel_err

TOL_FP32 = 1e-5
TOL_FP16 = 2e-3
TOL_STRONG = 1e-3
TOL_BF16 = 1e-2
TOL_TF32 = 2e-3

ON_GPU = chunkstate.DEVICE == "cuda"
TOL_F32 = TOL_TF32 if ON_GPU else TOL_FP32  # fp32 cases run on either device
TOL_STRONG_HERE = TOL_TF32 + TOL_STRONG if ON_GPU else TOL_STRONG  # tf32 rounding adds on the GPU
gpu_only = pytest.mark.gpu(reason="bf16, fla and larger shapes cannot run under Triton's interpreter on CPU")


# ---------------------------------------------------------------------------------------------
# Inputs, the op and the loop
# ---------------------------------------------------------------------------------------------

def make_inputs(B, T, H, K, V, gates=(), h0=False, cu=None, dtype=torch.float32, gate_mean=3.0,
                device="cpu"):
    """Leaves that need gradients (q, k, v in ``dtype``; natural-log gates logsigmoid(mean + N(0,1))
    in fp32; initial_state fp32), cu_seqlens, and the upstream gradients do, dht."""
    cu_seqlens = None if cu is None else torch.tensor(cu, dtype=torch.int32, device=device)
    N = B if cu is None else len(cu) - 1

    def leaf(*shape, dt=torch.float32):
        return torch.randn(*shape, device=device).to(dt).requires_grad_()

    x = dict(q=leaf(B, T, H, K, dt=dtype), k=leaf(B, T, H, K, dt=dtype), v=leaf(B, T, H, V, dt=dtype))
    if "g" in gates:
        x["g"] = F.logsigmoid(gate_mean + torch.randn(B, T, H, device=device)).requires_grad_()
    if "gk" in gates:
        x["gk"] = F.logsigmoid(gate_mean + torch.randn(B, T, H, K, device=device)).requires_grad_()
    if h0:
        x["initial_state"] = leaf(N, H, K, V)
    do = torch.randn(B, T, H, V, device=device).to(dtype)
    dht = torch.randn(N, H, K, V, device=device)
    return x, cu_seqlens, do, dht


def loss_of(o, ht, do, dht, use_o=True, use_ht=True):
    loss = 0
    if use_o:
        loss = loss + (o.to(torch.float64) * do.to(torch.float64)).sum()
    if use_ht:
        loss = loss + (ht.to(torch.float64) * dht.to(torch.float64)).sum()
    return loss


def run_op(x, cu_seqlens, do, dht, chunk_size=64, scale=None, use_o=True, use_ht=True):
    """chunk_gla and the gradients of the loss w.r.t. every leaf: (o, ht, {name: grad})."""
    o, ht = chunk_gla(**x, scale=scale, output_final_state=use_ht, cu_seqlens=cu_seqlens, chunk_size=chunk_size)
    names = list(x)
    grads = torch.autograd.grad(loss_of(o, ht, do, dht, use_o, use_ht), [x[n] for n in names], allow_unused=True)
    return o, ht, dict(zip(names, grads))


def run_loop(x, cu_seqlens, do, dht, scale=None, use_o=True, use_ht=True):
    """The float64 token loop on the same (upcast) inputs, and autograd through it."""
    x64 = {n: t.detach().to(torch.float64).requires_grad_() for n, t in x.items()}
    o, ht = reference.recurrent_outputs(x64["q"], x64["k"], x64["v"], g=x64.get("g"), gk=x64.get("gk"),
                                        h0=x64.get("initial_state"), cu_seqlens=cu_seqlens, scale=scale)
    names = list(x64)
    grads = torch.autograd.grad(loss_of(o, ht, do, dht, use_o, use_ht), [x64[n] for n in names],
                                allow_unused=True)
    return o, ht, dict(zip(names, grads))


def check_against_loop(x, cu_seqlens, do, dht, tol, chunk_size=64, scale=None, use_o=True, use_ht=True,
                       what="", tols=None):
    """Compare o, ht and every gradient; ``tols`` overrides ``tol`` per name. Returns the errors."""
    tols = tols or {}
    o, ht, grads = run_op(x, cu_seqlens, do, dht, chunk_size, scale, use_o, use_ht)
    o_ref, ht_ref, grads_ref = run_loop(x, cu_seqlens, do, dht, scale, use_o, use_ht)
    assert o.dtype == x["v"].dtype, f"{what}: o must be in v's dtype {x['v'].dtype}, got {o.dtype}"
    errs = {"o": check_close(o, o_ref, f"{what} o", tols.get("o", tol))}
    if use_ht:
        assert ht.dtype == torch.float32, f"{what}: ht must be fp32, got {ht.dtype}"
        errs["ht"] = check_close(ht, ht_ref, f"{what} ht", tols.get("ht", tol))
    else:
        assert ht is None, f"{what}: ht must be None without output_final_state"
    for name, ref in grads_ref.items():
        got = grads[name]
        if ref is None:  # the leaf does not reach the loss (e.g. no output read): zero gradient
            assert got is None or not got.any(), f"{what}: d{name} must be zero"
            continue
        assert got is not None, f"{what}: no gradient for {name}"
        assert got.dtype == x[name].dtype, f"{what}: d{name} must be in {name}'s dtype {x[name].dtype}, got {got.dtype}"
        errs[f"d{name}"] = check_close(got, ref, f"{what} d{name}", tols.get(f"d{name}", tol))
    return errs


# ---------------------------------------------------------------------------------------------
# CPU: fp32 against the loop
# ---------------------------------------------------------------------------------------------

# (id, B, T, H, K, V, gates, h0, cu_seqlens, chunk_size, scale)
CPU_CASES = [
    ("T1-nogate-h0-BT16", 2, 1, 2, 12, 10, (), True, None, 16, None),
    ("T63-g-BT32", 2, 63, 2, 20, 12, ("g",), False, None, 32, None),
    ("T100-gk-h0-BT32", 1, 100, 2, 24, 36, ("gk",), True, None, 32, None),
    ("T100-g+gk-h0-BT64-scale0.3", 1, 100, 1, 20, 20, ("g", "gk"), True, None, 64, 0.3),
    ("T63-nogate-BT16", 1, 63, 2, 8, 12, (), True, None, 16, None),
    ("B2T64-g+gk-BT32", 2, 64, 1, 12, 20, ("g", "gk"), True, None, 32, None),  # T a multiple of BT
    ("varlen0-1-39-0-60-g+gk-h0-BT32", 1, 100, 2, 12, 20, ("g", "gk"), True, [0, 0, 1, 40, 40, 100], 32, None),
    ("varlen1-16-0-64-gk-BT16", 1, 81, 1, 20, 12, ("gk",), False, [0, 1, 17, 17, 81], 16, None),
    ("varlen63-1-0-g-h0-BT64", 1, 64, 2, 10, 14, ("g",), True, [0, 63, 64, 64], 64, None),
]


@pytest.mark.parametrize("c", CPU_CASES, ids=[c[0] for c in CPU_CASES])
def test_against_loop(c, device):
    what, B, T, H, K, V, gates, h0, cu, BT, scale = c
    x, cu_seqlens, do, dht = make_inputs(B, T, H, K, V, gates, h0, cu, device=device)
    check_against_loop(x, cu_seqlens, do, dht, TOL_F32, BT, scale, what=what)


@pytest.mark.parametrize("use_o,use_ht", [(True, False), (False, True)], ids=["o-only", "ht-only"])
def test_loss_on_o_only_or_ht_only(use_o, use_ht, device):
    """A loss that reads only o (no ``ht``: output_final_state=False) or only ``ht`` (the op's
    backward then gets no ``do``)."""
    x, cu_seqlens, do, dht = make_inputs(1, 70, 2, 12, 10, ("g", "gk"), True, [0, 5, 70], device=device)
    check_against_loop(x, cu_seqlens, do, dht, TOL_F32, 32, use_o=use_o, use_ht=use_ht,
                       what=f"use_o={use_o} use_ht={use_ht}")


def test_fp16(device):
    x, cu_seqlens, do, dht = make_inputs(1, 100, 2, 20, 12, ("g", "gk"), True, [0, 1, 37, 100],
                                         dtype=torch.float16, device=device)
    check_against_loop(x, cu_seqlens, do, dht, TOL_FP16, 32, what="fp16")


@pytest.mark.parametrize("gates", [("g",), ("gk",), ("g", "gk")], ids=["g", "gk", "g+gk"])
def test_strong_decays_do_not_overflow(gates, device):
    """Gates near -40 per token: e^{-G} of a chunk-local cumsum overflows fp32 after 3 tokens, so
    an op that split e^{G_i − G_j} into e^{G_i} · e^{-G_j} over a chunk would give inf / NaN. The
    outputs and gradients stay finite and right; the gate gradient (the true one is ~e^{-40} in
    size, next to O(1) terms that cancel exactly) stays accurate too."""
    x, cu_seqlens, do, dht = make_inputs(1, 100, 1, 20, 12, gates, True, dtype=torch.float32,
                                         gate_mean=-40.0, device=device)
    a = sum(x[n].detach()[..., None] if n == "g" else x[n].detach() for n in gates if n in x)
    G = chunk_local_cumsum(a, 64, scale=1.0)  # natural log
    assert torch.isinf(torch.exp(-G)).any(), "the premise: e^{-G} overflows fp32 for these gates"
    errs = check_against_loop(x, cu_seqlens, do, dht, TOL_F32, 64, what="strong decays",
                              tols={"dg": TOL_STRONG_HERE, "dgk": TOL_STRONG_HERE,
                                    "dinitial_state": TOL_STRONG_HERE})
    assert all(math.isfinite(e) for e in errs.values()), errs


@pytest.mark.parametrize("BT", [16, 32, 64])
@pytest.mark.parametrize("strength", [0.3, 60.0], ids=["mild", "strong"])
def test_intra_attention_is_its_definition(BT, strength):
    """``intra_attention`` and ``intra_attention_grads`` against ``P_ij = Σ_k q_ik k_jk
    2^{G_ik − G_jk}`` (j <= i) written out elementwise in float64, where every exponent is <= 0,
    and against autograd of ``Σ dP ⊙ P`` through it: mild decays and decays of up to 60 (log2)
    per token, where ``2^{-G}`` alone would overflow."""
    C, H, K = 3, 2, 5
    q, k, dP = torch.randn(C, H, BT, K), torch.randn(C, H, BT, K), torch.randn(C, H, BT, BT)
    G = -torch.cumsum(torch.rand(C, H, BT, K) * strength, 2)
    q64, k64 = q.double().requires_grad_(), k.double().requires_grad_()
    diff = G.double()[:, :, :, None, :] - G.double()[:, :, None, :, :]  # [C, H, i, j, K]
    lower = torch.ones(BT, BT, dtype=torch.bool).tril()
    decay = torch.exp2(torch.where(lower[:, :, None], diff, float("-inf")))
    P_ref = (q64[:, :, :, None, :] * k64[:, :, None, :, :] * decay).sum(-1)
    strict = dP.double() * torch.ones(BT, BT).tril(-1).double()  # the grads leave out the diagonal
    dq_ref, dk_ref = torch.autograd.grad((P_ref * strict).sum(), [q64, k64])
    check_close(gla.intra_attention(q, k, G), P_ref, f"P, BT={BT}", 1e-5)
    dq, dk = gla.intra_attention_grads(q, k, G, dP)
    check_close(dq, dq_ref, f"dq, BT={BT}", 1e-5)
    check_close(dk, dk_ref, f"dk, BT={BT}", 1e-5)


@pytest.mark.parametrize("BT", [16, 64])
def test_halving_figure_matches_the_code(BT):
    """figures/intra_halving.png colours entry (i, j) by ``figures.layer.level_of``: the level
    ``gla._quadrants`` fills it at (each entry below the diagonal exactly once)."""
    from chunkstate.figures import layer

    filled = torch.zeros(BT, BT, dtype=torch.long)
    for half in gla._levels(BT):
        M = torch.zeros(1, 1, BT, BT)
        gla._quadrants(M, half).fill_(1)
        filled += M[0, 0].long()
        for i, j in M[0, 0].nonzero().tolist():
            assert j < i and layer.level_of(i, j) == half, (i, j, half)
    assert torch.equal(filled, torch.ones(BT, BT, dtype=torch.long).tril(-1))


def test_chunk_size_does_not_change_the_result(device):
    """The same call with BT = 16, 32, 64, 128: the outputs and gradients agree to rounding."""
    x, cu_seqlens, do, dht = make_inputs(1, 90, 1, 12, 10, ("g", "gk"), True, [0, 0, 90], device=device)
    results = [run_op(x, cu_seqlens, do, dht, BT) for BT in (16, 32, 64, 128)]
    o0, ht0, g0 = results[0]
    for BT, (o, ht, grads) in zip((32, 64, 128), results[1:]):
        check_close(o, o0, f"o BT={BT} vs BT=16", TOL_F32)
        check_close(ht, ht0, f"ht BT={BT} vs BT=16", TOL_F32)
        for name in grads:
            check_close(grads[name], g0[name], f"d{name} BT={BT} vs BT=16", TOL_F32)


def test_no_tokens(device):
    """T = 0: empty outputs, ``ht`` = h0, and the gradient of h0 through ht is dht."""
    x, cu_seqlens, do, dht = make_inputs(2, 0, 2, 8, 6, ("g", "gk"), True, device=device)
    o, ht, grads = run_op(x, cu_seqlens, do, dht)
    assert o.shape == (2, 0, 2, 6)
    assert torch.equal(ht, x["initial_state"].detach())
    assert torch.equal(grads["initial_state"], dht)


def test_noncontiguous_inputs(device):
    x, cu_seqlens, do, dht = make_inputs(1, 40, 2, 12, 10, ("g", "gk"), True, device=device)
    ref = run_op(x, cu_seqlens, do, dht, 32)
    # the same values, laid out [B, H, T, D] in memory and viewed as [B, T, H, D]
    y = {n: (t.detach().transpose(1, 2).contiguous().transpose(1, 2) if t.dim() == 4 and n != "initial_state"
             else t.detach().clone()).requires_grad_() for n, t in x.items()}
    assert not y["q"].is_contiguous()
    got = run_op(y, cu_seqlens, do.transpose(1, 2).contiguous().transpose(1, 2), dht, 32)
    assert torch.equal(got[0], ref[0]) and torch.equal(got[1], ref[1])
    for name in x:
        assert torch.equal(got[2][name], ref[2][name]), name


# ---------------------------------------------------------------------------------------------
# CPU: gradcheck in float64 (the states' kernels swapped for float64 PyTorch, see the docstring)
# ---------------------------------------------------------------------------------------------

def _segments(B, T, cu_seqlens):
    if cu_seqlens is None:
        return [(b, 0, T, b) for b in range(B)]
    cu = cu_seqlens.tolist()
    return [(0, cu[n], cu[n + 1], n) for n in range(len(cu) - 1)]


def _chunk_G(g, gk, b, s, e, H, K, dtype, device):
    """Key-side chunk-local cumsum (log2) of tokens s..e-1 of row b, [L, H, K]."""
    G = torch.zeros(e - s, H, K, dtype=dtype, device=device)
    if g is not None:
        G = G + g[b, s:e, :, None]
    if gk is not None:
        G = G + gk[b, s:e]
    return G


def torch_fwd_h(k, v, g=None, g_gamma=None, gk=None, gv=None, h0=None, output_final_state=False,
                state_v_first=False, cu_seqlens=None, chunk_size=64, split_size=None, states_in_fp32=False):
    """``chunk_fwd_h`` in float64 PyTorch (g, gk only; split = chunk)."""
    assert g_gamma is None and gv is None and not state_v_first and split_size is None
    B, T, H, K = k.shape
    V = v.shape[-1]
    states, finals = [], []
    for b, bos, eos, n in _segments(B, T, cu_seqlens):
        S = h0[n].to(k.dtype) if h0 is not None else k.new_zeros(H, K, V)
        for s in range(bos, eos, chunk_size):
            e = min(s + chunk_size, eos)
            states.append(S)
            G = _chunk_G(g, gk, b, s, e, H, K, k.dtype, k.device)
            S = torch.exp2(G[-1])[..., None] * S + torch.einsum("lhk,lhv->hkv", k[b, s:e] * torch.exp2(G[-1] - G),
                                                                v[b, s:e])
        finals.append(S)
    h = torch.stack(states).reshape(B if cu_seqlens is None else 1, -1, H, K, V) if states \
        else k.new_zeros(B if cu_seqlens is None else 1, 0, H, K, V)
    return h, (torch.stack(finals) if output_final_state else None)


def torch_bwd_dh(q, k, v, do, h0, dht, scale, g=None, g_gamma=None, gk=None, gv=None, state_v_first=False,
                 cu_seqlens=None, chunk_size=64, split_size=None, states_in_fp32=False):
    """``chunk_bwd_dh`` in float64 PyTorch (g, gk only; split = chunk; no GQA)."""
    assert g_gamma is None and gv is None and not state_v_first and split_size is None
    B, T, H, K = q.shape
    V = v.shape[-1]
    dhs, dh0 = [], []
    for b, bos, eos, n in _segments(B, T, cu_seqlens):
        dS = dht[n].to(q.dtype) if dht is not None else q.new_zeros(H, K, V)
        mine = []
        for s in reversed(range(bos, eos, chunk_size)):
            e = min(s + chunk_size, eos)
            mine.append(dS)
            G = _chunk_G(g, gk, b, s, e, H, K, q.dtype, q.device)
            dS = torch.exp2(G[-1])[..., None] * dS + scale * torch.einsum("lhk,lhv->hkv", q[b, s:e] * torch.exp2(G),
                                                                          do[b, s:e])
        dhs += mine[::-1]
        dh0.append(dS)
    dh = torch.stack(dhs).reshape(B if cu_seqlens is None else 1, -1, H, K, V) if dhs \
        else q.new_zeros(B if cu_seqlens is None else 1, 0, H, K, V)
    return dh, (torch.stack(dh0) if h0 is not None else None)


def test_torch_states_match_the_kernels(device):
    """The float64 stand-ins compute what the kernels compute (so gradcheck checks the real op)."""
    x, cu_seqlens, do, dht = make_inputs(1, 50, 2, 12, 10, ("g", "gk"), True, [0, 0, 1, 50], device=device)
    Gg = chunk_local_cumsum(x["g"].detach(), 32, cu_seqlens)
    Gk = chunk_local_cumsum(x["gk"].detach(), 32, cu_seqlens)
    q, k, v, h0 = (x[n].detach() for n in ("q", "k", "v", "initial_state"))
    kw = dict(g=Gg, gk=Gk, cu_seqlens=cu_seqlens, chunk_size=32)
    h, ht = chunkstate.chunk_fwd_h(k, v, h0=h0, output_final_state=True, states_in_fp32=True, **kw)
    h64, ht64 = torch_fwd_h(k.double(), v.double(), h0=h0.double(), output_final_state=True,
                            **{**kw, "g": Gg.double(), "gk": Gk.double()})
    check_close(h, h64, "torch_fwd_h h", TOL_F32)
    check_close(ht, ht64, "torch_fwd_h ht", TOL_F32)
    dh, dh0 = gla.chunk_bwd_dh(q, k, v, do, h0, dht, 0.7, states_in_fp32=True, **kw)
    dh64, dh064 = torch_bwd_dh(q.double(), k.double(), v.double(), do.double(), h0.double(), dht.double(), 0.7,
                               **{**kw, "g": Gg.double(), "gk": Gk.double()})
    check_close(dh, dh64, "torch_bwd_dh dh", TOL_F32)
    check_close(dh0, dh064, "torch_bwd_dh dh0", TOL_F32)


@pytest.mark.parametrize("T,K,cu,fast", [(34, 2, None, False), (37, 3, [0, 0, 1, 35, 37], True)],
                         ids=["dense-T34-full", "varlen-0-1-34-2-fast"])
def test_gradcheck_float64(T, K, cu, fast, monkeypatch, device):
    """BT = 32: two chunks per sequence (five levels of halving each), the last chunk
    partly padded. The dense case checks the full Jacobian; the packed one (slower per call) its
    projections on random directions (``fast_mode``) to keep the file's run time down."""
    monkeypatch.setattr(gla, "chunk_fwd_h", torch_fwd_h)
    monkeypatch.setattr(gla, "chunk_bwd_dh", torch_bwd_dh)
    B, H, V, BT = 1, 1, 2, 32
    N = B if cu is None else len(cu) - 1
    cu_seqlens = None if cu is None else torch.tensor(cu, device=device)

    def leaf(*shape):
        return torch.randn(*shape, dtype=torch.float64, device=device).requires_grad_()

    q, k, v, h0 = leaf(B, T, H, K), leaf(B, T, H, K), leaf(B, T, H, V), leaf(N, H, K, V)
    g = F.logsigmoid(2 + torch.randn(B, T, H, dtype=torch.float64, device=device)).requires_grad_()
    gk = F.logsigmoid(2 + torch.randn(B, T, H, K, dtype=torch.float64, device=device)).requires_grad_()

    def f(q, k, v, g, gk, h0):  # the Function itself: chunk_gla takes fp16/bf16/fp32 only
        return gla.ChunkGLAFunction.apply(q, k, v, g, gk, 0.6, h0, True, cu_seqlens, BT)

    assert torch.autograd.gradcheck(f, (q, k, v, g, gk, h0), fast_mode=fast)


# ---------------------------------------------------------------------------------------------
# CPU: bad input
# ---------------------------------------------------------------------------------------------

def _args(device, **over):
    B, T, H, K, V = 1, 8, 2, 4, 3
    args = dict(q=torch.randn(B, T, H, K, device=device), k=torch.randn(B, T, H, K, device=device),
                v=torch.randn(B, T, H, V, device=device), g=torch.randn(B, T, H, device=device),
                gk=torch.randn(B, T, H, K, device=device))
    args.update(over)
    return args


BAD = [
    ("q-3d", dict(q=torch.randn(1, 8, 4)), ValueError, "q must have shape"),
    ("q-int", dict(q=torch.ones(1, 8, 2, 4, dtype=torch.int32)), TypeError, "q must be a floating-point"),
    ("q-float64", dict(q=torch.randn(1, 8, 2, 4, dtype=torch.float64)), TypeError, "q must be fp16, bf16 or fp32"),
    ("k-shape", dict(k=torch.randn(1, 8, 2, 5)), ValueError, "k must have shape"),
    ("v-shape", dict(v=torch.randn(1, 7, 2, 3)), ValueError, "v must have shape"),
    ("v-dtype", dict(v=torch.randn(1, 8, 2, 3, dtype=torch.float16)), TypeError, "v must have q's dtype"),
    ("g-shape", dict(g=torch.randn(1, 8, 3)), ValueError, "g must have shape"),
    ("g-per-key", dict(g=torch.randn(1, 8, 2, 4)), ValueError,
     r"\[B, T, H, K\] \(what fla's chunk_gla calls g\) goes in gk="),
    ("gk-shape", dict(gk=torch.randn(1, 8, 2, 3)), ValueError, "gk must have shape"),
    ("g-not-tensor", dict(g=0.5), TypeError, "g must be a torch.Tensor"),
    ("scale-str", dict(scale="0.5"), TypeError, "scale must be a real number"),
    ("scale-bool", dict(scale=True), TypeError, "scale must be a real number"),
    ("scale-tensor", dict(scale=torch.tensor(0.5)), TypeError, "scale must be a real number"),
    ("scale-nan", dict(scale=float("nan")), ValueError, "scale must be finite"),
    ("h0-shape", dict(initial_state=torch.randn(2, 2, 4, 3)), ValueError, "initial_state must have shape"),
    ("final-not-bool", dict(output_final_state=1), TypeError, "output_final_state must be a bool"),
    ("chunk-48", dict(chunk_size=48), ValueError, "chunk_size must be a power of two"),
    ("chunk-8", dict(chunk_size=8), ValueError, "chunk_size must be a power of two"),
    ("cu-float", dict(cu_seqlens=torch.tensor([0.0, 8.0])), TypeError, "cu_seqlens must be a 1-D int32/int64"),
    ("cu-end", dict(cu_seqlens=torch.tensor([0, 7])), ValueError, "cu_seqlens must end at T=8"),
    ("cu-decreasing", dict(cu_seqlens=torch.tensor([0, 5, 3, 8])), ValueError, "non-decreasing"),
]


@pytest.mark.parametrize("name,over,exc,match", BAD, ids=[b[0] for b in BAD])
def test_bad_input(name, over, exc, match, device):
    over = {n: t.to(device) if isinstance(t, torch.Tensor) else t for n, t in over.items()}
    with pytest.raises(exc, match=match):
        chunk_gla(**_args(device, **over))


def test_varlen_needs_batch_one(device):
    args = _args(device, **{n: torch.randn(2, 8, *s, device=device) for n, s in
                            (("q", (2, 4)), ("k", (2, 4)), ("v", (2, 3)), ("g", (2,)), ("gk", (2, 4)))})
    with pytest.raises(ValueError, match="batch size must be 1"):
        chunk_gla(**args, cu_seqlens=torch.tensor([0, 8], device=device))


# ---------------------------------------------------------------------------------------------
# GPU only: bf16 / fp32 against the loop, and against fla-core 0.6.0
# ---------------------------------------------------------------------------------------------

GPU_TOL = {torch.bfloat16: TOL_BF16, torch.float32: TOL_TF32}
GPU_SHAPES = [  # (id, B, T, H, K, V, cu)
    ("B2T300K100V72", 2, 300, 2, 100, 72, None),
    ("varlen0-1-129-170-K64V128", 1, 300, 3, 64, 128, [0, 0, 1, 130, 300]),
]


@gpu_only
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=["bf16", "fp32"])
@pytest.mark.parametrize("gates", [(), ("g",), ("gk",), ("g", "gk")], ids=["nogate", "g", "gk", "g+gk"])
@pytest.mark.parametrize("shape", GPU_SHAPES, ids=[s[0] for s in GPU_SHAPES])
def test_gpu_against_loop(shape, gates, dtype, device):
    what, B, T, H, K, V, cu = shape
    x, cu_seqlens, do, dht = make_inputs(B, T, H, K, V, gates, True, cu, dtype=dtype, device=device)
    check_against_loop(x, cu_seqlens, do, dht, GPU_TOL[dtype], 64, what=f"{what} {gates} {dtype}")


@gpu_only
def test_gpu_strong_decays(device):
    x, cu_seqlens, do, dht = make_inputs(2, 300, 2, 64, 64, ("g", "gk"), True, dtype=torch.float32,
                                         gate_mean=-40.0, device=device)
    errs = check_against_loop(x, cu_seqlens, do, dht, TOL_TF32, 64, what="GPU strong decays")
    assert all(math.isfinite(e) for e in errs.values()), errs


def _fla_op(gates):
    """fla's op for these gates, as f(q, k, v, g, gk, h0, cu) -> (o, ht); skips if fla is absent."""
    try:
        from fla.ops.gla import chunk_gla as fla_gla
        from fla.ops.simple_gla import chunk_simple_gla as fla_simple
    except Exception as e:  # not installed, or fails to import on this machine
        pytest.skip(f"fla (fla-core 0.6.0) is not importable here: {type(e).__name__}: {e}")
    if gates == ("g",):
        return lambda q, k, v, g, gk, h0, cu: fla_simple(q, k, v, g=g, initial_state=h0, output_final_state=True,
                                                         cu_seqlens=cu)

    def gla_op(q, k, v, g, gk, h0, cu):  # fla's GLA takes one per-key gate: g + gk, summed in autograd
        a = gk if g is None else gk + g[..., None]
        return fla_gla(q, k, v, g=a, initial_state=h0, output_final_state=True, cu_seqlens=cu)
    return gla_op


def _is_fla_hopper_refusal(e: Exception) -> bool:
    """fla 0.6.0 raises for the gated simple-GLA backward on Hopper with Triton >= 3.4, < 3.7.1."""
    return isinstance(e, RuntimeError) and "3.7.1" in str(e) and "Hopper" in str(e)


FLA_CASES = [  # (id, B, T, H, K, V, gates, cu)
    ("gk-B2T500K128V128", 2, 500, 4, 128, 128, ("gk",), None),
    ("g+gk-B2T500K64V64", 2, 500, 4, 64, 64, ("g", "gk"), None),
    ("g-B2T500K128V128", 2, 500, 4, 128, 128, ("g",), None),
    ("gk-varlen0-1-200-299", 1, 500, 4, 64, 64, ("gk",), [0, 0, 1, 201, 500]),
]


@gpu_only
@pytest.mark.parametrize("c", FLA_CASES, ids=[c[0] for c in FLA_CASES])
def test_gpu_against_fla(c, device, fla_one_config):
    """bf16 forward and backward against fla's op on the same inputs (both also against the loop,
    so a failure says which side is off). fla runs one config per kernel (``fla_one_config``)."""
    what, B, T, H, K, V, gates, cu = c
    fla_op = _fla_op(gates)
    x, cu_seqlens, do, dht = make_inputs(B, T, H, K, V, gates, True, cu, dtype=torch.bfloat16, device=device)
    o, ht, grads = run_op(x, cu_seqlens, do, dht)
    o_ref, ht_ref, grads_ref = run_loop(x, cu_seqlens, do, dht)
    y = {n: t.detach().clone().requires_grad_() for n, t in x.items()}
    o_fla, ht_fla = fla_op(y["q"], y["k"], y["v"], y.get("g"), y.get("gk"), y["initial_state"],
                           None if cu_seqlens is None else cu_seqlens.long())

    def both(name, ours, theirs, ref):
        check_close(ours, ref, f"{what} {name}: ours vs loop", TOL_BF16)
        check_close(theirs, ref, f"{what} {name}: fla vs loop (fla itself off?)", TOL_BF16)
        check_close(ours, theirs, f"{what} {name}: ours vs fla (ours vs loop {rel_err(ours, ref):.1e}, "
                    f"fla vs loop {rel_err(theirs, ref):.1e})", TOL_BF16)

    both("o", o, o_fla, o_ref)
    both("ht", ht, ht_fla, ht_ref)
    try:
        grads_fla = torch.autograd.grad(loss_of(o_fla, ht_fla, do, dht), list(y.values()))
    except RuntimeError as e:
        if _is_fla_hopper_refusal(e):
            pytest.skip(f"forward checked; fla refuses its backward on this GPU/Triton: {e}")
        raise
    for name, gf in zip(y, grads_fla):
        both(f"d{name}", grads[name], gf, grads_ref[name])


# ---------------------------------------------------------------------------------------------
# Decays of zero, K = 0, second derivatives
# ---------------------------------------------------------------------------------------------

@pytest.mark.parametrize("gates", [("g",), ("gk",), ("g", "gk")], ids=["g", "gk", "g+gk"])
def test_zero_decays_match_the_loop(gates, device):
    """Gates of −inf (a decay of exactly zero) at a chunk's first and last tokens, twice in a row,
    and at a packed sequence's first token, and one of −1e30: outputs and every gradient match the
    float64 loop (which applies −inf as it is); the gradient of a −inf gate is 0 there and here.
    Each zero decay adds ``MIN_GATE`` to its chunk's cumsum, and three in one chunk, in g and gk
    both, make it ~−960 (log2): the tolerance adds the rounding of such cumsums in fp32, as
    ``tests/test_numerics.py``'s reset tests do."""
    x, cu_seqlens, do, dht = make_inputs(1, 100, 2, 12, 10, gates, True, [0, 37, 100], device=device)
    with torch.no_grad():
        for name in gates:
            t = x[name]
            for tok in (0, 31, 32, 33, 37, 63, 99):  # BT = 32: chunk edges; 37 starts sequence 1
                t[0, tok, 0] = -math.inf
            t[0, 50, 1] = -1e30
    a = sum(x[n].detach()[..., None] if n == "g" else x[n].detach() for n in gates)
    G_max = sum(chunk_local_cumsum(x[n].detach(), 32, cu_seqlens).abs().max().item() for n in gates)
    tol = TOL_F32 + 2 * (2 * math.log(2) * 2.0 ** -24 * G_max)
    assert torch.isinf(a).any() and G_max > 300, "the draw must hold zero decays"
    errs = check_against_loop(x, cu_seqlens, do, dht, tol, 32, what="zero decays")
    assert all(math.isfinite(e) for e in errs.values()), errs
    for name in gates:
        o, ht = chunk_gla(**x, output_final_state=True, cu_seqlens=cu_seqlens, chunk_size=32)
        grad = torch.autograd.grad(loss_of(o, ht, do, dht), x[name])[0]
        assert torch.isfinite(grad).all() and (grad[0, 31, 0] == 0).all(), f"d{name} at a -inf gate"


def test_no_key_dimension(device):
    """K = 0: no state, every output 0 and every gradient 0 (the default scale K^-0.5 has no value
    there; any scale gives the same)."""
    x, cu_seqlens, do, dht = make_inputs(1, 40, 2, 0, 8, ("g",), True, None, device=device)
    o, ht = chunk_gla(**x, output_final_state=True, chunk_size=16)
    assert o.shape == (1, 40, 2, 8) and not o.any() and ht.shape == (1, 2, 0, 8)
    grads = torch.autograd.grad(loss_of(o, ht, do, dht), [x["v"], x["g"]])
    assert all(not g.any() for g in grads)


def test_second_derivatives_raise(device):
    """The op's backward is not itself differentiable: asking for a second derivative raises
    instead of returning a wrong one (it used to be 20-47 % off)."""
    x, cu_seqlens, do, dht = make_inputs(1, 20, 1, 8, 8, ("g",), False, None, device=device)
    o, _ = chunk_gla(**x, chunk_size=16)
    do.requires_grad_()  # as gradgradcheck's upstream gradients do
    (dq,) = torch.autograd.grad((o * do).sum(), x["q"], create_graph=True)
    with pytest.raises(RuntimeError, match="once_differentiable"):
        dq.sum().backward()
