"""Chapter 10 exercises: the layer's backward — the gate gradient from ``dh``, and the wiring.

1. ``chunk_gate_grad(h, dh, q, k, v, do, gk, scale) -> dgk`` [B, L, H, K]: the gradient of the
   whole sequence's loss ``Σ o·do + Σ ht·dht`` with respect to one chunk's per-key gate ``gk``
   (natural log per token), given the state entering the chunk ``h`` = h[n] and the gradient of
   the state leaving it ``dh`` = dh[n], [B, H, K, V]. Shapes as in chapter 08's exercise (float32;
   ``q``, ``k``, ``gk`` [B, L, H, K]; ``v``, ``do`` [B, L, H, V]). With ``G`` the chunk-local
   cumulative sum of ``gk`` in log2 units, ``Γ = G[last token]``, ``dq``, ``dk`` chapter 08's
   chunk gradients and ``dk_inter_j = 2^{Γ − G_j} ⊙ (dh v_j)`` the part of ``dk`` through ``dh``::

       c_i    = q_i ⊙ dq_i − k_i ⊙ dk_i
       c_last += Σ_j k_j ⊙ dk_inter_j  +  2^{Γ} ⊙ Σ_v (h ⊙ dh)        (Γ's two appearances)
       dgk_t  = Σ_{i >= t} c_i                                         (a reverse cumulative sum)

   The checker walks whole sequences chunk by chunk and compares with autograd through the float64
   token loop; a wrong answer that matches a known mistake is named.

2. ``layer_backward(q, k, v, g, do, dht, h0, cu_seqlens, scale, chunk_size) -> (dq, dk, dv, dg, dh0)``:
   ``chunk_gla``'s backward for simple GLA (the scalar gate ``g`` [1, T, H], natural log) on a
   packed batch (``cu_seqlens`` [N + 1], B = 1): the gates' chunk-local log2 cumsums, the states
   ``h`` from ``chunk_fwd_h``, ``dh`` and ``dh0`` from ``chunk_bwd_dh``, then ``gla.intra_backward``
   in the chunk layout. ``q``, ``k`` [1, T, H, K], ``v``, ``do`` [1, T, H, V] fp32 on
   ``chunkstate.DEVICE``; ``dht``, ``h0`` [N, H, K, V]. Returns ``dq``, ``dk`` [1, T, H, K], ``dv``
   [1, T, H, V], ``dg`` [1, T, H], ``dh0`` [N, H, K, V]. The checker compares with autograd through
   the float64 token loop and names the wiring mistake a wrong answer matches.
"""
from __future__ import annotations

import math

import torch
import torch.nn.functional as F

from .. import gla
from ..backward import chunk_bwd_dh
from ..env import DEVICE
from ..forward import chunk_fwd_h
from ..gates import RCP_LN2, chunk_local_cumsum
from ..reference import recurrent_outputs, recurrent_states, state_grads
from ..testing import check_close, rel_err, state_tolerance
from .ch08_backward_recurrence import chunk_grads

CASES = [  # (B, T, H, K, V, BT)
    (1, 1, 1, 4, 3, 16),      # one token: a chunk of length 1
    (2, 100, 2, 12, 10, 32),  # last chunk of 4 tokens
    (1, 64, 3, 9, 17, 64),    # exactly one full chunk, K and V odd
]
TOL = 1e-5  # float32 answers against float64 references


def _reverse_cumsum(x):
    """Σ_{i >= t} x_i along dim 1."""
    return x.flip(1).cumsum(1).flip(1)


# ---- 1. the gate gradient of one chunk ---------------------------------------------------------

def _gate_grad_terms(h, dh, q, k, v, do, gk, scale):
    """``c`` [B, L, H, K] without the chunk-end terms, and the two chunk-end terms [B, H, K]."""
    dq, dk, _ = chunk_grads(h, dh, q, k, v, do, gk, scale)  # chapter 08's exercise
    G = RCP_LN2 * gk.cumsum(1)  # [B, L, H, K] chunk-local, log2 units
    Gamma = G[:, -1]  # [B, H, K]
    dk_inter = torch.exp2(Gamma[:, None] - G) * torch.einsum("bhkv,bjhv->bjhk", dh, v)  # dk through dh
    c = q * dq - k * dk  # [B, L, H, K]
    end_k = (k * dk_inter).sum(1)  # Γ in each k_j's decay to the chunk's end, 2^{Γ − G_j}
    end_h = torch.exp2(Gamma) * (h * dh).sum(-1)  # Γ in the entering state's decay, 2^{Γ} h
    return c, end_k, end_h


def chunk_gate_grad(h, dh, q, k, v, do, gk, scale):
    """The shipped solution of exercise 1 (module docstring)."""
    c, end_k, end_h = _gate_grad_terms(h, dh, q, k, v, do, gk, scale)
    c[:, -1] += end_k + end_h  # Γ = G_{L-1}: both terms belong to the last token's c
    return _reverse_cumsum(c)  # gk_t enters every G_i with i >= t


def _gate_grad_mistakes(h, dh, q, k, v, do, gk, scale):
    """{what went wrong: the answer it gives} for exercise 1."""
    c, end_k, end_h = _gate_grad_terms(h, dh, q, k, v, do, gk, scale)
    full = c.clone()
    full[:, -1] += end_k + end_h
    only = {name: c.clone() for name in ("k", "h")}
    only["k"][:, -1] += end_k
    only["h"][:, -1] += end_h
    right = _reverse_cumsum(full)
    return {
        "a forward cumulative sum: gk_t enters G_i for every i >= t, so its gradient is Σ_{i>=t} c_i "
        "(reverse: x.flip(1).cumsum(1).flip(1))": full.cumsum(1),
        "the chunk-end terms are missing: Γ = G_{L-1} appears in every k_j's decay 2^(Γ−G_j) and in "
        "the state's decay 2^Γ, so the last token's c gets Σ_j k_j ⊙ dk_inter_j + 2^Γ ⊙ Σ_v h ⊙ dh":
            _reverse_cumsum(c),
        "the entering state's term is missing: the last token's c gets 2^Γ ⊙ Σ_v (h ⊙ dh), from "
        "h[n+1] = 2^Γ h[n] + ...": _reverse_cumsum(only["k"]),
        "Σ_j k_j ⊙ dk_inter_j is missing from the last token's c: Γ sits in every k_j's decay "
        "2^(Γ−G_j) to the chunk's end": _reverse_cumsum(only["h"]),
        "a factor ln 2 too many: gk is a natural-log gate and 2^(G_i) = e^(Σ gk), so d2^(G_i)/dgk_t "
        "= 2^(G_i) with no ln 2": math.log(2.0) * right,
        "a factor ln 2 too few (log2(e) too many): the gradient is w.r.t. the natural-log gk, "
        "not the log2 G": RCP_LN2 * right,
        "the sign is flipped: c_i = q_i ⊙ dq_i − k_i ⊙ dk_i (a larger G_i scales q_i up, k_i down)": -right,
    }


def _diagnose(out, mistakes, tol):
    """The first known mistake whose answer ``out`` matches (tuples compared element by element)."""
    for what, wrong in mistakes.items():
        pairs = zip(out, wrong) if isinstance(wrong, tuple) else [(out, wrong)]
        try:
            if all(a.shape == b.shape and rel_err(a, b) < tol for a, b in pairs):
                return what
        except AssertionError:
            continue
    return None


def _tensor(out, name, what, shape):
    if not isinstance(out, torch.Tensor):
        raise AssertionError(f"{name} must return a tensor ({what}), got {type(out).__name__}")
    if tuple(out.shape) != tuple(shape):
        raise AssertionError(f"{name}: {what} must be {list(shape)}, got {list(out.shape)}")
    return out


def check_chunk_gate_grad(fn=None) -> None:
    """Run ``fn`` (default: the shipped solution) on every chunk of fresh random sequences and
    compare with autograd's ``gk`` gradient through the float64 token loop (with ``h0`` and ``dht``).

    Raises ``AssertionError`` naming the chunk, and the likely mistake when the answer matches a
    known one; an exception raised inside ``fn`` (such as ``NotImplementedError``) propagates.
    """
    fn = chunk_gate_grad if fn is None else fn
    name = getattr(fn, "__name__", "your function")
    for B, T, H, K, V, BT in CASES:
        q, k = torch.randn(B, T, H, K), torch.randn(B, T, H, K)
        v, do = torch.randn(B, T, H, V), torch.randn(B, T, H, V)
        h0, dht = torch.randn(B, H, K, V), torch.randn(B, H, K, V)
        gk = F.logsigmoid(torch.randn(B, T, H, K)) / 4
        scale = K ** -0.5
        gk64 = gk.double().requires_grad_()
        o, ht = recurrent_outputs(q, k, v, gk=gk64, h0=h0, scale=scale)
        (ref,) = torch.autograd.grad((o * do.double()).sum() + (ht * dht.double()).sum(), [gk64])
        h, _ = recurrent_states(k, v, gk=gk, h0=h0, chunk_size=BT)  # entering each chunk
        dh, _ = state_grads(q, k, v, do, gk=gk, h0=h0, dht=dht, scale=scale, chunk_size=BT)  # leaving
        shape = f"B={B}, T={T}, H={H}, K={K}, V={V}, BT={BT}"
        for n, s in enumerate(range(0, T, BT)):
            e = min(s + BT, T)
            args = [h[:, n].float(), dh[:, n].float()] + [x[:, s:e].clone() for x in (q, k, v, do, gk)]
            out = _tensor(fn(*args, scale), name, "dgk", (B, e - s, H, K))
            where = f"{name}: dgk of chunk {n}, tokens {s}..{e - 1} ({shape})"
            if not rel_err(out, ref[:, s:e]) < TOL:
                mistake = _diagnose(out, _gate_grad_mistakes(*args, scale), TOL)
                if mistake:
                    raise AssertionError(f"{where}: {mistake}")
            check_close(out, ref[:, s:e], where, tol=TOL)
    print(f"{name} gives every chunk's gate gradient of the token loop on {len(CASES)} shapes")


# ---- 2. the layer's backward, wired -------------------------------------------------------------

def layer_backward(q, k, v, g, do, dht, h0, cu_seqlens, scale, chunk_size):
    """The shipped solution of exercise 2 (module docstring)."""
    B, T, H, K = q.shape
    V = v.shape[-1]
    Gg = chunk_local_cumsum(g, chunk_size, cu_seqlens)  # [1, T, H] log2, restarting every chunk of every sequence
    h, _ = chunk_fwd_h(k, v, g=Gg, h0=h0, cu_seqlens=cu_seqlens, chunk_size=chunk_size, states_in_fp32=True)
    dh, dh0 = chunk_bwd_dh(q, k, v, do, h0, dht, scale, g=Gg, cu_seqlens=cu_seqlens, chunk_size=chunk_size,
                           states_in_fp32=True)
    layout = gla.ChunkLayout(B, T, cu_seqlens, chunk_size, q.device)  # [1, T, H, D] <-> [C, H, BT, D]
    qc, kc, vc, doc = (layout.to_chunks(x) for x in (q, k, v, do))
    G = layout.to_chunks(Gg[..., None].expand(B, T, H, K), pad="last")  # padded slots repeat the last G (Γ)
    dq, dk, dv, da = gla.intra_backward(qc, kc, vc, G, h.reshape(layout.C, H, K, V), doc,
                                        dh.reshape(layout.C, H, K, V), scale)
    dg = layout.from_chunks(da).sum(-1)  # one scalar gate per token and head: the sum over keys
    return layout.from_chunks(dq), layout.from_chunks(dk), layout.from_chunks(dv), dg, dh0


def _wired_wrong(q, k, v, g, do, dht, h0, cu_seqlens, scale, chunk_size, mistake):
    """``layer_backward`` with one wiring mistake (the names of ``_WIRING_MISTAKES``)."""
    B, T, H, K = q.shape
    V = v.shape[-1]
    if mistake == "raw gate":
        Gg = g
    else:
        Gg = chunk_local_cumsum(g, chunk_size, None if mistake == "cumsum across sequences" else cu_seqlens,
                                scale=1.0 if mistake == "natural-log cumsum" else RCP_LN2)
    h, _ = chunk_fwd_h(k, v, g=Gg, h0=None if mistake == "no h0" else h0, cu_seqlens=cu_seqlens,
                       chunk_size=chunk_size, states_in_fp32=True)
    dh, dh0 = chunk_bwd_dh(q, k, v, do, h0, None if mistake == "no dht" else dht, scale, g=Gg,
                           cu_seqlens=cu_seqlens, chunk_size=chunk_size, states_in_fp32=True)
    layout = gla.ChunkLayout(B, T, cu_seqlens, chunk_size, q.device)
    G = layout.to_chunks(Gg[..., None].expand(B, T, H, K), pad="zero" if mistake == "zero padding" else "last")
    grads = gla.intra_backward(*(layout.to_chunks(x) for x in (q, k, v)), G, h.reshape(layout.C, H, K, V),
                               layout.to_chunks(do), dh.reshape(layout.C, H, K, V), scale)
    dq, dk, dv, da = (layout.from_chunks(x) for x in grads)
    return dq, dk, dv, da.sum(-1), dh0


_WIRING_MISTAKES = {
    "raw gate": "the kernels got the per-token gate g itself: they take its chunk-local cumulative sum in "
                "log2 units, gates.chunk_local_cumsum(g, chunk_size, cu_seqlens)",
    "natural-log cumsum": "the gate's cumulative sum is in natural log: the kernels and intra_backward use "
                          "2^G, so G must be in log2 units (chunk_local_cumsum's default scale)",
    "cumsum across sequences": "the gate's cumulative sum ignores cu_seqlens: it must restart at every "
                               "chunk of every packed sequence (chunk_local_cumsum(g, chunk_size, cu_seqlens))",
    "no dht": "dht never reached chunk_bwd_dh: dh[n] counts the final state's gradient too",
    "no h0": "chunk_fwd_h ran without h0: the states entering each sequence's chunks (and so dq and dg) "
             "start from the initial state",
    "zero padding": "G was padded with zeros in the chunk layout: a short last chunk's padded slots must "
                    "repeat its last G (to_chunks(..., pad='last')), else intra_backward reads Γ = 0",
}
LAYER_CASES = [  # (lens of the packed sequences, H, K, V, BT)
    ([0, 1, 37, 20], 2, 12, 10, 16),  # an empty and a one-token sequence, ragged last chunks
    ([40, 9], 1, 16, 16, 32),
]


def check_layer_backward(fn=None) -> None:
    """Run ``fn`` (default: the shipped solution) on packed batches on ``chunkstate.DEVICE`` and
    compare every gradient with autograd through the float64 token loop.

    Raises ``AssertionError`` naming the gradient, and the wiring mistake when the answer matches
    a known one; an exception raised inside ``fn`` (such as ``NotImplementedError``) propagates.
    """
    fn = layer_backward if fn is None else fn
    name = getattr(fn, "__name__", "your function")
    tol = state_tolerance(torch.float32)
    for lens, H, K, V, BT in LAYER_CASES:
        N, T = len(lens), sum(lens)
        cu_seqlens = torch.tensor([0] + lens).cumsum(0).to(torch.int32)
        x = dict(q=torch.randn(1, T, H, K), k=torch.randn(1, T, H, K), v=torch.randn(1, T, H, V),
                 g=F.logsigmoid(torch.randn(1, T, H) + 3), h0=torch.randn(N, H, K, V))
        do, dht, scale = torch.randn(1, T, H, V), torch.randn(N, H, K, V), K ** -0.5
        leaves = {n: t.double().requires_grad_() for n, t in x.items()}
        o, ht = recurrent_outputs(leaves["q"], leaves["k"], leaves["v"], g=leaves["g"], h0=leaves["h0"],
                                  cu_seqlens=cu_seqlens, scale=scale)
        ((o * do.double()).sum() + (ht * dht.double()).sum()).backward()
        refs = [leaves[n].grad for n in ("q", "k", "v", "g", "h0")]
        dev = {n: t.to(DEVICE) for n, t in dict(**x, do=do, dht=dht, cu_seqlens=cu_seqlens).items()}
        args = [dev[n] for n in ("q", "k", "v", "g", "do", "dht", "h0", "cu_seqlens")] + [scale, BT]
        out = fn(*args)
        if not (isinstance(out, tuple) and len(out) == 5):
            raise AssertionError(f"{name} must return a tuple (dq, dk, dv, dg, dh0), got {type(out).__name__}")
        names = ("dq", "dk", "dv", "dg", "dh0")
        if isinstance(out[3], torch.Tensor) and out[3].dim() == 4:
            raise AssertionError(f"{name}: dg must be [1, T, H], got {list(out[3].shape)}: a scalar gate's "
                                 f"gradient is intra_backward's da summed over the key dimension")
        for what, got, ref in zip(names, out, refs):
            _tensor(got, name, what, ref.shape)
        where = f"{name}, packed lengths {lens}, BT={BT}"
        if not all(rel_err(got, ref) < tol for got, ref in zip(out, refs)):
            mistakes = {why: _wired_wrong(*args, mistake) for mistake, why in _WIRING_MISTAKES.items()}
            mistake = _diagnose(out, mistakes, tol)
            if mistake:
                raise AssertionError(f"{where}: {mistake}")
        for what, got, ref in zip(names, out, refs):
            check_close(got, ref, f"{where}: {what} vs autograd through the token loop", tol=tol)
    print(f"{name} gives dq, dk, dv, dg and dh0 of the token loop on {len(LAYER_CASES)} packed batches")
