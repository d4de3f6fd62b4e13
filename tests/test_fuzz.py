"""Property-based fuzzing: ``chunk_fwd_h`` and ``chunk_bwd_dh`` against the float64 token loop.

Hypothesis draws whole cases — B, T (0..130), H, query heads HQ = G·H (backward), K and V
(1..40, odd ones included), any combination of the four gates at a mild or a strong decay,
h0 / ht / dht, both state layouts, state precision, chunk size 16/32/64, split size 1–3 chunks,
sequence pieces (forward: None, 1, 2, 3), explicit tile configs, and packed batches whose
``cu_seqlens`` hold empty, one-token and chunk-edge sequences — and checks every stored state
against ``reference.recurrent_states`` / ``reference.state_grads`` (float64, natural-log gates).

Hypothesis picks new cases every run: it is seeded from the session seed (``CHUNKSTATE_SEED``,
printed in pytest's header; tests/conftest.py), so the same seed draws the same cases again; its
example database is off, so nothing is written to the checkout. The tensors of a case come from a
torch generator seeded by a drawn integer, so a failing case replays and shrinks exactly; its
printed ``seed`` reproduces it.

Run time: under the interpreter a program costs ~10-25 ms per chunk on this 2-core machine, so
each drawn case is capped at ``MAX_WORK`` program-chunks (tiles × heads × chunks); the file runs
in well under a minute. ``CHUNKSTATE_FUZZ_EXAMPLES=500 pytest tests/test_fuzz.py`` searches longer.
On a GPU the same properties run with fewer drawn examples (each new shape compiles kernels) and
the GPU's tolerances (fp32 dots there are tf32).

Tolerance (relative Frobenius error, ``testing.rel_err``):

- fp32 under the interpreter, ``TOL_FP32 = 1e-5``: ``tl.dot`` is an exact-fp32 numpy matmul and
  ``exp2`` is fp32, so a state is a sum of at most ~130·G fp32-rounded O(1) products — worst case
  ~130·2^-24 ≈ 8e-6 relative, typically ~1e-7 (measured).
- fp16 inputs, or fp32 on a GPU (tf32 ``tl.dot``), ``TOL_LOW = 2e-3``: at most three roundings of
  2^-11 (the decayed chunk operand, the dot's inputs, the stored state), as in test_forward.py.
- plus a gate term: the kernels read the gates as fp32 chunk-local cumsums ``G`` (log2). A decay
  factor ``2^{Γ−G_i}`` (forward) or ``2^{G_i}`` (backward) is computed from fp32 values of size up
  to ``max|G|`` whose rounding is ``2^-24·max|G|`` absolute, i.e. a relative error of
  ``ln2·2^-24·max|G|`` in the factor — an input rounding the float64 loop does not make. It is
  negligible for mild gates (max|G| ~ 10) and ~3e-5 for the strong ones (per-token decays up to
  -1 on each side, max|G| ~ 280 at BT = 64). The check allows 4× that (cancellation in a sum of
  a few dominant terms).
"""
from __future__ import annotations

import inspect
import math
import os
import random

import chunkstate  # first: it sets TRITON_INTERPRET on a CPU machine before Triton is imported

import torch
import triton
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st

from chunkstate import gates, reference
from chunkstate.backward import chunk_bwd_dh
from chunkstate.testing import check_close, nan_poisoned_empty

ON_GPU = chunkstate.DEVICE == "cuda"
TOL_FP32 = 1e-5
TOL_LOW = 2e-3
GATE_NAMES = ("g", "g_gamma", "gk", "gv")
MAX_T = 130
MAX_WORK = 16  # program-chunks (tiles x heads x chunks) per kernel launch in one drawn case
BACKWARD_HAS_PIECES = "pieces" in inspect.signature(chunk_bwd_dh).parameters


def _examples(cpu: int, gpu: int) -> int:
    """Drawn examples per property: fewer on a GPU, where every new K, V or flag combination
    compiles its kernels (~1 s each) and compilation, not running, is the cost."""
    return int(os.environ.get("CHUNKSTATE_FUZZ_EXAMPLES", "0")) or (gpu if ON_GPU else cpu)


FUZZ = dict(deadline=None, database=None, print_blob=True,
            suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture,
                                   HealthCheck.data_too_large])


# ---------------------------------------------------------------------------------------------
# Drawing a case
# ---------------------------------------------------------------------------------------------

@st.composite
def seq_lengths(draw, BT: int, max_chunks: int) -> list[int]:
    """Lengths of a packed batch: empty, one-token, chunk-edge (BT-1, BT, BT+1) and random
    sequences, at most ``max_chunks`` chunks and ``MAX_T`` tokens in all (longer draws are cut to
    fit, leaving further empty sequences)."""
    one = st.one_of(st.just(0), st.just(1), st.sampled_from([BT - 1, BT, BT + 1]), st.integers(0, 2 * BT + 3))
    wanted = draw(st.lists(one, min_size=1, max_size=6))
    out, chunks, total = [], 0, 0
    for L in wanted:
        L = min(L, MAX_T - total, (max_chunks - chunks) * BT)
        out.append(L)
        chunks += math.ceil(L / BT)
        total += L
    return out


@st.composite
def cases(draw, backward: bool):
    BT = draw(st.sampled_from([16, 32, 64]))
    mult = draw(st.sampled_from([1, 2, 3]))
    BS = None if mult == 1 and draw(st.booleans()) else mult * BT
    H = draw(st.integers(1, 2))
    G = draw(st.integers(1, 3)) if backward else 1
    K = draw(st.integers(1, 40))
    V = draw(st.integers(1, 40))
    # None: the autotuned path (one 64 x 64 config under the interpreter); else explicit tiles.
    # On a GPU an explicit config avoids timing autotune candidates for every drawn shape.
    tiles = draw(st.sampled_from([None, (16, 16), (16, 32), (32, 16), (32, 32), (64, 64)]))
    if ON_GPU and tiles is None:
        tiles = (64, 64)
    BK, BV = tiles or (64, 64)
    n_tiles = triton.cdiv(K, BK) * triton.cdiv(V, BV)
    # the backward's programs do one dot per query head of their group: count (1 + G) / 2 each
    per_chunk = n_tiles * H * ((1 + G) // 2 if backward else 1)
    budget = max(1, MAX_WORK // per_chunk)  # chunks allowed in all
    varlen = draw(st.booleans())
    if varlen:
        lens = draw(seq_lengths(BT, budget))
        B, T = 1, sum(lens)
        cu = [0]
        for L in lens:
            cu.append(cu[-1] + L)
    else:
        B = draw(st.integers(1, 2))
        per_seq = max(1, budget // B)
        T = draw(st.one_of(st.integers(0, min(MAX_T, per_seq * BT)), st.sampled_from([0, 1, BT - 1, BT, BT + 1])))
        T = min(T, per_seq * BT)
        cu = None
    return dict(
        B=B, T=T, H=H, G=G, K=K, V=V, BT=BT, BS=BS, tiles=tiles, cu=cu,
        cu_dtype=draw(st.sampled_from([torch.int32, torch.int64])),
        gates=tuple(sorted(draw(st.sets(st.sampled_from(GATE_NAMES))))),
        strength=draw(st.sampled_from([0.05, 1.0])),  # largest per-token natural-log decay, per gate
        dtype=draw(st.sampled_from([torch.float32, torch.float32, torch.float16])),
        h0=draw(st.booleans()),
        ht=draw(st.booleans()),
        dht=draw(st.booleans()) if backward else False,
        state_v_first=draw(st.booleans()),
        states_in_fp32=draw(st.booleans()),
        pieces=draw(st.sampled_from([None, 1, 2, 3])) if (not backward or BACKWARD_HAS_PIECES) else None,
        scale=draw(st.one_of(st.just(1), st.floats(0.05, 2.0))) if backward else None,
        seed=draw(st.integers(0, 2 ** 32 - 1)),
    )


def tensors(c):
    """The case's random tensors (from its seed): k, v, q, do in ``dtype``; natural-log gates
    uniform in [-strength, 0]; h0 and dht fp32 in the [K, V] layout."""
    gen = torch.Generator().manual_seed(c["seed"])
    B, T, H, K, V, HQ = c["B"], c["T"], c["H"], c["K"], c["V"], c["H"] * c["G"]
    N = B if c["cu"] is None else len(c["cu"]) - 1
    rnd = lambda *s: torch.randn(*s, generator=gen)  # noqa: E731
    decay = lambda *s: -c["strength"] * torch.rand(*s, generator=gen)  # noqa: E731
    shapes = {"g": (B, T, H), "g_gamma": (H,), "gk": (B, T, H, K), "gv": (B, T, H, V)}
    x = dict(k=rnd(B, T, H, K).to(c["dtype"]), v=rnd(B, T, H, V).to(c["dtype"]),
             q=rnd(B, T, HQ, K).to(c["dtype"]), do=rnd(B, T, HQ, V).to(c["dtype"]),
             nat={n: decay(*shapes[n]) for n in c["gates"]},
             h0=rnd(N, H, K, V) if c["h0"] else None, dht=rnd(N, H, K, V) if c["dht"] else None,
             cu_seqlens=None if c["cu"] is None else torch.tensor(c["cu"], dtype=c["cu_dtype"]))
    dev = chunkstate.DEVICE
    for name in ("k", "v", "q", "do", "h0", "dht", "cu_seqlens"):
        x[name] = None if x[name] is None else x[name].to(dev)
    x["nat"] = {n: t.to(dev) for n, t in x["nat"].items()}
    return x


def tolerance(c, kg) -> float:
    """The module docstring's bound: base rounding plus the fp32 gate-cumsum term."""
    base = TOL_FP32 if c["dtype"] == torch.float32 and not ON_GPU else TOL_LOW
    G_max = 0.0
    for name, t in kg.items():
        # g_gamma's ramp G_i = γ·(i+1) reaches γ·BT inside a chunk
        m = t.abs().max().item() * (c["BT"] if name == "g_gamma" else 1) if t.numel() else 0.0
        G_max += m  # the sides' exponents add (g, g_gamma, gk all act on the key side)
    return base + 4 * math.log(2) * 2.0 ** -24 * G_max


def loop_grads(c, x):
    """``reference.state_grads`` on the case; with no token and no ``dht`` the loss is the constant
    0 (autograd through the loop then raises), so every gradient is zero and no split exists."""
    if c["T"] == 0 and x["dht"] is None:
        N, H, K, V = x["k"].shape[0] if x["cu_seqlens"] is None else len(c["cu"]) - 1, c["H"], c["K"], c["V"]
        z = torch.zeros(N, H, K, V, dtype=torch.float64)
        return torch.zeros(c["B"], 0, H, K, V, dtype=torch.float64), z
    return reference.state_grads(x["q"], x["k"], x["v"], x["do"], **x["nat"], h0=x["h0"], dht=x["dht"],
                                 cu_seqlens=x["cu_seqlens"], scale=c["scale"], chunk_size=c["BT"],
                                 split_size=c["BS"])


def _config(c):
    if c["tiles"] is None:
        return None
    return triton.Config({"BK": c["tiles"][0], "BV": c["tiles"][1]}, num_warps=4, num_stages=2 if ON_GPU else 1)


def _vk(x):
    """[.., K, V] <-> [.., V, K] (contiguous)."""
    return None if x is None else x.transpose(-1, -2).contiguous()


def _describe(c) -> str:
    return ", ".join(f"{k}={v}" for k, v in c.items())


def edge(**over):
    """An explicit case that always runs besides the drawn ones (its tensors' seed is fresh every
    run): together they pin the edges the strategy only reaches by chance."""
    c = dict(B=1, T=0, H=1, G=1, K=1, V=1, BT=16, BS=None, tiles=None, cu=None, cu_dtype=torch.int32,
             gates=(), strength=0.05, dtype=torch.float32, h0=False, ht=False, dht=False, state_v_first=False,
             states_in_fp32=False, pieces=None, scale=None, seed=random.randrange(2 ** 32))
    c.update(over)
    if not BACKWARD_HAS_PIECES and c["scale"] is not None:
        c["pieces"] = None
    return c


VARLEN = [0, 0, 1, 17, 17, 49, 130]  # empty, one-token, BT+1, empty, 2·BT, a long one (BT = 16)
ALL_GATES = tuple(sorted(GATE_NAMES))


# ---------------------------------------------------------------------------------------------
# The properties
# ---------------------------------------------------------------------------------------------

@settings(max_examples=_examples(30, 12), **FUZZ)
@given(c=cases(backward=False))
@example(c=edge(T=130, cu=VARLEN, K=33, V=17, BS=32, gates=ALL_GATES, strength=1.0, h0=True, ht=True,
                state_v_first=True, pieces=3))
@example(c=edge(B=2, T=1, H=2, V=40, BT=64, BS=192, tiles=(16, 32), gates=("g", "g_gamma"), dtype=torch.float16,
                ht=True, pieces=2))
@example(c=edge(B=2, T=0, H=2, K=5, V=7, h0=True, ht=True, pieces=3))
@example(c=edge(T=0, cu=[0, 0, 0], cu_dtype=torch.int64, K=5, V=7, h0=True, ht=True, gates=("gv",)))
def test_forward_matches_the_loop(c):
    x = tensors(c)
    kg = gates.kernel_gates(x["nat"], c["BT"], x["cu_seqlens"])
    vf = c["state_v_first"]
    with nan_poisoned_empty():
        h, ht = chunkstate.chunk_fwd_h(
            x["k"], x["v"], **kg, h0=_vk(x["h0"]) if vf else x["h0"], output_final_state=c["ht"],
            state_v_first=vf, cu_seqlens=x["cu_seqlens"], chunk_size=c["BT"], split_size=c["BS"],
            states_in_fp32=c["states_in_fp32"], pieces=c["pieces"], config=_config(c))
    h_ref, ht_ref = reference.recurrent_states(x["k"], x["v"], **x["nat"], h0=x["h0"], cu_seqlens=x["cu_seqlens"],
                                               chunk_size=c["BT"], split_size=c["BS"])
    what = f"forward [{_describe(c)}]"
    assert h.dtype == (torch.float32 if c["states_in_fp32"] else c["dtype"]), what
    if vf:
        h = h.transpose(-1, -2)
    assert h.shape == h_ref.shape, f"{what}: h shape {tuple(h.shape)} != {tuple(h_ref.shape)}"
    tol = tolerance(c, kg)
    check_close(h, h_ref, f"{what} h", tol)
    if c["ht"]:
        assert ht.dtype == torch.float32, what
        check_close(ht.transpose(-1, -2) if vf else ht, ht_ref, f"{what} ht", tol)
    else:
        assert ht is None, what


@settings(max_examples=_examples(20, 8), **FUZZ)
@given(c=cases(backward=True))
@example(c=edge(T=100, cu=VARLEN[:-1] + [100], G=3, K=33, V=17, BS=32, gates=ALL_GATES, strength=1.0, h0=True,
                dht=True, state_v_first=True, scale=1, pieces=3))
@example(c=edge(B=2, T=63, H=2, G=2, K=40, V=1, tiles=(32, 16), gates=("gk", "gv"), dtype=torch.float16,
                dht=True, scale=0.37))
@example(c=edge(T=0, cu=[0, 0, 0], K=5, V=7, h0=True, dht=True, scale=0.5))
def test_backward_matches_autograd_through_the_loop(c):
    x = tensors(c)
    kg = gates.kernel_gates(x["nat"], c["BT"], x["cu_seqlens"])
    vf = c["state_v_first"]
    kw = dict(pieces=c["pieces"]) if BACKWARD_HAS_PIECES else {}
    with nan_poisoned_empty():
        dh, dh0 = chunk_bwd_dh(
            x["q"], x["k"], x["v"], x["do"], _vk(x["h0"]) if vf else x["h0"], _vk(x["dht"]) if vf else x["dht"],
            c["scale"], **kg, state_v_first=vf, cu_seqlens=x["cu_seqlens"], chunk_size=c["BT"],
            split_size=c["BS"], states_in_fp32=c["states_in_fp32"], config=_config(c), **kw)
    dh_ref, dh0_ref = loop_grads(c, x)
    what = f"backward [{_describe(c)}]"
    assert dh.dtype == (torch.float32 if c["states_in_fp32"] else c["dtype"]), what
    if vf:
        dh = dh.transpose(-1, -2)
    assert dh.shape == dh_ref.shape, f"{what}: dh shape {tuple(dh.shape)} != {tuple(dh_ref.shape)}"
    tol = tolerance(c, kg)
    check_close(dh, dh_ref, f"{what} dh", tol)
    if c["h0"]:
        assert dh0.dtype == torch.float32, what
        check_close(dh0.transpose(-1, -2) if vf else dh0, dh0_ref, f"{what} dh0", tol)
    else:
        assert dh0 is None, what
