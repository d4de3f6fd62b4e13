"""Chapter 03 exercise: one full chunk step — the chunk's outputs and the state leaving it.

Write ``chunk_step(h, q, k, v, gk, scale) -> (o, h_next)`` for one chunk of L tokens
(1 <= L <= BT) with a per-key-dimension gate (GLA's ``gk``), all batch rows and heads at once::

    G      = log2(e) · cumsum of gk over the chunk's tokens   (chunk-local, log2 units)   [B,L,H,K]
    Γ      = G[last token]                                                                [B,H,K]
    o_i    = scale · [ (q_i ⊙ 2^(G_i))ᵀ h  +  Σ_{j<=i} (Σ_k q_ik k_jk 2^(G_ik − G_jk)) v_j ]
    h_next = diag(2^Γ) h + (k_n ⊙ 2^(Γ − G))ᵀ v_n

Shapes (float32): ``h`` [B,H,K,V] (the state entering the chunk), ``q``, ``k``, ``gk`` [B,L,H,K]
(``gk`` natural-log, <= 0), ``v`` [B,L,H,V]; returns ``o`` [B,L,H,V] and ``h_next`` [B,H,K,V].

The checker walks whole sequences chunk by chunk with your step (the last chunk shorter than BT)
and compares every output and every state with the token loop (:mod:`chunkstate.reference`).
When a chunk's answer is wrong it says which of the four terms is off — the carried-state term
``diag(2^Γ) h`` and the past's outputs ``scale · (q_i ⊙ 2^(G_i))ᵀ h`` (the step called again with
``v = 0``), the chunk's own contribution ``(k_n ⊙ 2^(Γ − G))ᵀ v_n`` and its own outputs (called
with ``h = 0``) — and names the likely mistake where the term matches a known one.
"""
from __future__ import annotations

import math

import torch
import torch.nn.functional as F

from ..reference import recurrent_outputs, recurrent_states
from ..gates import RCP_LN2
from ..testing import check_close, rel_err

CASES = [  # (B, T, H, K, V, BT)
    (2, 100, 2, 12, 10, 32),  # last chunk of 4 tokens
    (1, 1, 1, 4, 3, 16),      # one token: a chunk of length 1
    (1, 64, 3, 9, 17, 64),    # exactly one full chunk, K and V odd
    (1, 70, 1, 20, 6, 16),
]


def chunk_step(h, q, k, v, gk, scale):
    """The shipped solution (see the module docstring for the formula and shapes)."""
    G = RCP_LN2 * gk.cumsum(1)                                      # [B, L, H, K]  log2 units
    Gamma = G[:, -1]                                                # [B, H, K]
    L = q.shape[1]
    o_inter = torch.einsum("blhk,bhkv->blhv", q * torch.exp2(G), h)  # what the past contributes
    causal = torch.ones(L, L, dtype=torch.bool, device=q.device).tril()  # [i, j]: j <= i
    diff = (G[:, :, None] - G[:, None, :])                          # [B, i, j, H, K]: G_i − G_j
    diff = diff.masked_fill(~causal[None, :, :, None, None], -math.inf)  # 2^(...) = 0 where j > i
    P = torch.einsum("bihk,bjhk,bijhk->bhij", q, k, torch.exp2(diff))  # [B, H, L, L]
    o_intra = torch.einsum("bhij,bjhv->bihv", P, v)                 # this chunk's own tokens
    h_next = torch.exp2(Gamma)[..., None] * h + torch.einsum("blhk,blhv->bhkv", k * torch.exp2(Gamma[:, None] - G), v)
    return scale * (o_inter + o_intra), h_next


def _terms(h, q, k, v, gk, scale, units=RCP_LN2, exclusive=False, diagonal=0, sign=1.0) -> dict:
    """The step's four terms in float64 (module docstring), with knobs that make a known mistake:
    ``units`` (log2(e): right; 1 or log2(e)²: natural-log and log2 units mixed), ``exclusive``
    (a cumsum without the token's own gate), ``diagonal`` = -1 (token i does not see itself),
    ``sign`` = -1 (the exponent G_j − G_i)."""
    h, q, k, v, gk = (x.double() for x in (h, q, k, v, gk))
    G = units * (gk.cumsum(1) - gk if exclusive else gk.cumsum(1))
    Gamma = units * gk.sum(1)  # the chunk's whole decay: an exclusive cumsum's last value misses a gate
    Gamma = G[:, -1] if exclusive else Gamma
    L = q.shape[1]
    causal = torch.ones(L, L, dtype=torch.bool).tril(diagonal)
    diff = (sign * (G[:, :, None] - G[:, None, :])).masked_fill(~causal[None, :, :, None, None], -math.inf)
    return {
        "carried": torch.exp2(Gamma)[..., None] * h,
        "own": torch.einsum("blhk,blhv->bhkv", k * torch.exp2(Gamma[:, None] - G), v),
        "past_o": scale * torch.einsum("blhk,bhkv->blhv", q * torch.exp2(G), h),
        "own_o": scale * torch.einsum("bhij,bjhv->bihv", torch.einsum("bihk,bjhk,bijhk->bhij", q, k, torch.exp2(diff)), v),
    }


_TERMS = {  # term: what the reader sees
    "carried": "the carried-state term diag(2^Γ) h of h_next (what h_next is with v = 0)",
    "own": "the chunk's own contribution (k_n ⊙ 2^(Γ − G))ᵀ v_n to h_next (what h_next is with h = 0)",
    "past_o": "the past's term scale · (q_i ⊙ 2^(G_i))ᵀ h of o (what o is with v = 0)",
    "own_o": "the chunk's own term of o, scale · Σ_{j<=i} (Σ_k q_ik k_jk 2^(G_ik − G_jk)) v_j (what o is with h = 0)",
}


def _diagnose(fn, name, h, q, k, v, gk, scale, tol) -> str:
    """Which of the step's terms ``fn`` gets wrong, and the likely mistake (module docstring)."""
    try:
        o_past, h_carried = _pair(fn(h.clone(), q.clone(), k.clone(), torch.zeros_like(v), gk.clone(), scale), name)
        o_own, h_own = _pair(fn(torch.zeros_like(h), q.clone(), k.clone(), v.clone(), gk.clone(), scale), name)
    except Exception:  # the function cannot be probed this way: say nothing more
        return ""
    got = {"carried": h_carried, "own": h_own, "past_o": o_past, "own_o": o_own}
    right = _terms(h, q, k, v, gk, scale)
    h64, q64, k64, v64 = (x.double() for x in (h, q, k, v))
    mistakes = {  # term: {likely mistake: what the term is then}
        "carried": {"the state not decayed (h_next must start from diag(2^Γ) h)": h64},
        "own": {"keys weighted by 2^(G) instead of 2^(Γ − G)":
                    torch.einsum("blhk,blhv->bhkv", k64 * torch.exp2(RCP_LN2 * gk.double().cumsum(1)), v64),
                "keys not decayed (k_n ⊙ 2^(Γ − G))": torch.einsum("blhk,blhv->bhkv", k64, v64)},
        "past_o": {"the state's term left out": torch.zeros_like(right["past_o"]),
                   "q not decayed (q_i ⊙ 2^(G_i))": scale * torch.einsum("blhk,bhkv->blhv", q64, h64),
                   "no scale": right["past_o"] / scale},
        "own_o": {"the diagonal masked out (token i sees itself: j <= i)": _terms(h, q, k, v, gk, scale, diagonal=-1)["own_o"],
                  "the exponent flipped (2^(G_ik − G_jk) for j <= i, not 2^(G_jk − G_ik))": _terms(h, q, k, v, gk, scale, sign=-1.0)["own_o"],
                  "no scale": right["own_o"] / scale},
    }
    for why, knobs in (("an exclusive cumsum (G_i includes token i's own gate)", dict(exclusive=True)),
                       ("natural-log and log2 units mixed: a natural-log cumsum put through 2^(...)",
                        dict(units=1.0)),
                       ("natural-log and log2 units mixed: a log2 cumsum put through e^(...)",
                        dict(units=RCP_LN2 ** 2))):
        for term, value in _terms(h, q, k, v, gk, scale, **knobs).items():
            mistakes[term].setdefault(why, value)
    found = []
    for term, value in got.items():
        if tuple(value.shape) != tuple(right[term].shape) or rel_err(value, right[term]) < tol:
            continue
        why = " or ".join(w for w, ref in mistakes[term].items() if rel_err(value, ref) < tol)
        found.append(f"{_TERMS[term]} is off" + (f": likely {why}" if why else ""))
    return "".join(f"\n  - {f}" for f in found)


def _pair(out, name):
    if not (isinstance(out, tuple) and len(out) == 2 and all(isinstance(x, torch.Tensor) for x in out)):
        raise AssertionError(f"{name} must return a tuple (o, h_next) of two tensors, got {type(out).__name__}")
    return out


def check_chunk_step(fn=None) -> None:
    """Run ``fn`` (default: the shipped solution) over whole sequences, chunk by chunk.

    Compares the outputs and the state leaving every chunk with the float64 token loop, on fresh
    random inputs. Raises ``AssertionError`` naming the shape, the chunk, what is wrong and, where
    it can tell, which term is off and the likely mistake (module docstring); an exception raised
    inside ``fn`` (such as ``NotImplementedError``) propagates unchanged.
    """
    fn = chunk_step if fn is None else fn
    name = getattr(fn, "__name__", "your function")
    tol = 1e-5
    for B, T, H, K, V, BT in CASES:
        q, k = torch.randn(B, T, H, K), torch.randn(B, T, H, K)
        v, h0 = torch.randn(B, T, H, V), torch.randn(B, H, K, V)
        gk = F.logsigmoid(torch.randn(B, T, H, K)) / 4
        scale = K ** -0.5
        o_ref, ht_ref = recurrent_outputs(q, k, v, gk=gk, h0=h0, scale=scale)
        h_ref, _ = recurrent_states(k, v, gk=gk, h0=h0, chunk_size=BT)  # state entering each chunk
        h_ref = torch.cat([h_ref, ht_ref[:, None]], 1)  # ... and the state after the last
        shape = f"B={B}, T={T}, H={H}, K={K}, V={V}, BT={BT}"
        h = h0.clone()  # the right state entering chunk n: every earlier step was checked
        for n, s in enumerate(range(0, T, BT)):
            e = min(s + BT, T)
            inputs = (h, q[:, s:e], k[:, s:e], v[:, s:e], gk[:, s:e])
            o_c, h_next = _pair(fn(*(x.clone() for x in inputs), scale), name)
            try:
                check_close(o_c, o_ref[:, s:e], f"{name}: outputs of chunk {n}, tokens {s}..{e - 1} ({shape})",
                            tol=tol)
                check_close(h_next, h_ref[:, n + 1], f"{name}: state leaving chunk {n} ({shape})", tol=tol)
            except AssertionError as err:
                raise AssertionError(f"{err}{_diagnose(fn, name, *inputs, scale, tol)}") from None
            h = h_next
    print(f"{name} reproduces the token loop chunk by chunk on {len(CASES)} shapes")
