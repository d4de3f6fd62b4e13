"""Bad inputs to ``chunkstate.chunk_fwd_h`` (and the backward's own arguments): each gets a
TypeError / ValueError naming the argument and what was expected, before anything is launched.

Tensors on another device are simulated with the ``meta`` device (no memory, any machine).
"""
from __future__ import annotations

import inspect
import math

import numpy as np
import pytest
import torch
import triton

import chunkstate
from chunkstate import delta, gates, reference

B, T, H, K, V = 2, 40, 3, 20, 24


@pytest.fixture
def ok(device):
    """A valid call's arguments (dense batch, every gate, h0)."""
    return dict(
        k=torch.randn(B, T, H, K, device=device), v=torch.randn(B, T, H, V, device=device),
        g=torch.zeros(B, T, H, device=device), g_gamma=torch.zeros(H, device=device),
        gk=torch.zeros(B, T, H, K, device=device), gv=torch.zeros(B, T, H, V, device=device),
        h0=torch.zeros(B, H, K, V, device=device), chunk_size=16)


def _varlen(ok, cu, device):
    """The same tensors packed into one row of 2·T tokens, with offsets ``cu`` (a list is made an
    int32 tensor), no h0."""
    args = {n: torch.cat([x[0], x[1]])[None] if n in ("k", "v", "g", "gk", "gv") else x
            for n, x in ok.items() if n != "h0"}
    if isinstance(cu, list):
        cu = torch.tensor(cu, dtype=torch.int32, device=device)
    return dict(args, cu_seqlens=cu)


def test_the_valid_call_runs(ok):
    """The fixture itself is valid, so every failure below comes from the one change it makes."""
    h, ht = chunkstate.chunk_fwd_h(**ok, output_final_state=True)
    assert h.shape == (B, T // 16 + 1, H, K, V) and ht.shape == (B, H, K, V)


# ------------------------------------------------------------------ k and v

@pytest.mark.parametrize("change,exc,match", [
    (lambda a: dict(a, k=a["k"].tolist()), TypeError, r"k must be a torch\.Tensor"),
    (lambda a: dict(a, k=a["k"][0]), ValueError, r"k must have shape \[B, T, H, K\]"),
    (lambda a: dict(a, k=a["k"][..., None]), ValueError, r"k must have shape \[B, T, H, K\]"),
    (lambda a: dict(a, k=a["k"].to(torch.int32)), TypeError, r"k must be a floating-point tensor"),
    (lambda a: dict(a, v=a["v"].to(torch.int64)), TypeError, r"v must be a floating-point tensor"),
    (lambda a: dict(a, v=None), TypeError, r"v must be a torch\.Tensor"),
    (lambda a: dict(a, v=a["v"][:1]), ValueError, r"v must have shape \[2, 40, 3, \*\]"),
    (lambda a: dict(a, v=a["v"][:, :-1]), ValueError, r"v must have shape \[2, 40, 3, \*\]"),
    (lambda a: dict(a, v=a["v"][:, :, :-1]), ValueError, r"v must have shape \[2, 40, 3, \*\]"),
    (lambda a: dict(a, v=a["v"][0]), ValueError, r"v must have shape"),
    (lambda a: dict(a, v=a["v"].half()), TypeError, r"v must have k's dtype torch\.float32"),
    (lambda a: dict(a, k=a["k"].double(), v=a["v"].double()), TypeError, r"k must be fp16, bf16 or fp32"),
], ids=["k-list", "k-3d", "k-5d", "k-int", "v-int", "v-none", "v-batch", "v-time", "v-heads", "v-3d",
        "v-dtype", "k-fp64"])
def test_keys_and_values(ok, change, exc, match):
    with pytest.raises(exc, match=match):
        chunkstate.chunk_fwd_h(**change(ok))


# ------------------------------------------------------------------ gates

@pytest.mark.parametrize("change,exc,match", [
    (lambda a: dict(a, g=a["g"][..., :-1]), ValueError, r"g must have shape \[2, 40, 3\]"),
    (lambda a: dict(a, g=a["g"][..., None]), ValueError, r"g must have shape \[2, 40, 3\]"),
    (lambda a: dict(a, g=a["g"][:, :-1]), ValueError, r"g must have shape \[2, 40, 3\]"),
    (lambda a: dict(a, g=a["g"].long()), TypeError, r"g must be a floating-point tensor"),
    (lambda a: dict(a, g=0.5), TypeError, r"g must be a torch\.Tensor"),
    (lambda a: dict(a, g_gamma=a["g_gamma"][:-1]), ValueError, r"g_gamma must have shape \[3\]"),
    (lambda a: dict(a, g_gamma=a["g_gamma"][None]), ValueError, r"g_gamma must have shape \[3\]"),
    (lambda a: dict(a, g_gamma=-0.1), TypeError, r"g_gamma must be a torch\.Tensor"),
    (lambda a: dict(a, g_gamma=a["g_gamma"].int()), TypeError, r"g_gamma must be a floating-point"),
    (lambda a: dict(a, gk=a["gk"][..., :-1]), ValueError, r"gk must have shape \[2, 40, 3, 20\]"),
    (lambda a: dict(a, gk=a["gv"]), ValueError, r"gk must have shape \[2, 40, 3, 20\]"),
    (lambda a: dict(a, gk=a["g"]), ValueError, r"gk must have shape \[2, 40, 3, 20\]"),
    (lambda a: dict(a, gk=a["gk"].bool()), TypeError, r"gk must be a floating-point"),
    (lambda a: dict(a, gv=a["gk"]), ValueError, r"gv must have shape \[2, 40, 3, 24\]"),
    (lambda a: dict(a, gv=a["gv"][:, :, :1]), ValueError, r"gv must have shape \[2, 40, 3, 24\]"),
    (lambda a: dict(a, gv=a["gv"].to(torch.int16)), TypeError, r"gv must be a floating-point"),
], ids=["g-heads", "g-4d", "g-time", "g-int", "g-float", "gamma-heads", "gamma-2d", "gamma-float",
        "gamma-int", "gk-K", "gk-is-gv", "gk-is-g", "gk-bool", "gv-is-gk", "gv-heads", "gv-int"])
def test_gates(ok, change, exc, match):
    with pytest.raises(exc, match=match):
        chunkstate.chunk_fwd_h(**change(ok))


# ------------------------------------------------------------------ initial state

@pytest.mark.parametrize("change,exc,match", [
    (lambda a: dict(a, h0=a["h0"][:1]), ValueError, r"h0 must have shape \[2, 3, 20, 24\]"),
    (lambda a: dict(a, h0=a["h0"][:, :2]), ValueError, r"h0 must have shape \[2, 3, 20, 24\]"),
    (lambda a: dict(a, h0=a["h0"].transpose(-1, -2)), ValueError, r"h0 must have shape \[2, 3, 20, 24\]"),
    (lambda a: dict(a, state_v_first=True), ValueError, r"h0 must have shape \[2, 3, 24, 20\]"),
    (lambda a: dict(a, h0=a["h0"][0]), ValueError, r"h0 must have shape"),
    (lambda a: dict(a, h0=a["h0"].int()), TypeError, r"h0 must be a floating-point"),
    (lambda a: dict(a, h0=a["h0"].numpy() if a["h0"].device.type == "cpu" else 0), TypeError,
     r"h0 must be a torch\.Tensor"),
], ids=["N", "heads", "transposed", "v-first-needs-VK", "3d", "int", "not-tensor"])
def test_initial_state(ok, change, exc, match):
    with pytest.raises(exc, match=match):
        chunkstate.chunk_fwd_h(**change(ok))


# ------------------------------------------------------------------ packed batches

@pytest.mark.parametrize("cu,exc,match", [
    ([0, 40, 80], None, None),  # valid: the control
    ([1, 40, 80], ValueError, r"cu_seqlens must start at 0, got 1"),
    ([0, 50, 40, 80], ValueError, r"cu_seqlens must be non-decreasing"),
    ([0, 40, 79], ValueError, r"cu_seqlens must end at T=80, got 79"),
    ([0, 40, 81], ValueError, r"cu_seqlens must end at T=80, got 81"),
    ([0], ValueError, r"cu_seqlens must hold at least 2 offsets"),
    ("2d", TypeError, r"cu_seqlens must be a 1-D int32/int64 tensor"),
    ("float", TypeError, r"cu_seqlens must be a 1-D int32/int64 tensor"),
    ("list", TypeError, r"cu_seqlens must be a torch\.Tensor"),
], ids=["valid", "start", "decreasing", "end-short", "end-long", "one-offset", "2d", "float", "list"])
def test_cu_seqlens(ok, device, cu, exc, match):
    if cu == "2d":
        cu = torch.tensor([[0, 40, 80]], dtype=torch.int32, device=device)
    elif cu == "float":
        cu = torch.tensor([0.0, 40.0, 80.0], device=device)
    args = _varlen(ok, cu, device)
    if cu == "list":
        args["cu_seqlens"] = [0, 40, 80]
    if exc is None:
        h, _ = chunkstate.chunk_fwd_h(**args)
        assert h.shape[:2] == (1, 6)
        return
    with pytest.raises(exc, match=match):
        chunkstate.chunk_fwd_h(**args)


def test_cu_seqlens_needs_batch_of_one(ok, device):
    cu = torch.tensor([0, 20, 40], dtype=torch.int32, device=device)
    no_h0 = {n: x for n, x in ok.items() if n != "h0"}
    with pytest.raises(ValueError, match=r"with cu_seqlens the batch size must be 1.*got B=2"):
        chunkstate.chunk_fwd_h(**no_h0, cu_seqlens=cu)


def test_varlen_h0_has_one_state_per_sequence(ok, device):
    args = _varlen(ok, [0, 10, 10, 80], device)  # N = 3 sequences, one empty
    with pytest.raises(ValueError, match=r"h0 must have shape \[3, 3, 20, 24\]"):
        chunkstate.chunk_fwd_h(**args, h0=torch.zeros(1, H, K, V, device=device))


# ------------------------------------------------------------------ chunk and split sizes

@pytest.mark.parametrize("chunk_size,exc", [
    (8, ValueError), (512, ValueError), (48, ValueError), (0, ValueError), (-16, ValueError),
    (16.0, TypeError), (True, TypeError), ("64", TypeError), (None, TypeError)])
def test_chunk_size(ok, chunk_size, exc):
    with pytest.raises(exc, match=r"chunk_size must be"):
        chunkstate.chunk_fwd_h(**dict(ok, chunk_size=chunk_size))


@pytest.mark.parametrize("split_size,exc", [
    (0, ValueError), (-32, ValueError), (24, ValueError), (8, ValueError), (40, ValueError),
    (32.0, TypeError), (True, TypeError)])
def test_split_size(ok, split_size, exc):
    with pytest.raises(exc, match=r"split_size must be"):
        chunkstate.chunk_fwd_h(**dict(ok, split_size=split_size))


@pytest.mark.parametrize("pieces", [0, -2, 1.5, True, "2"])
def test_pieces(ok, pieces):
    with pytest.raises(ValueError, match=r"pieces must be None or a positive int"):
        chunkstate.chunk_fwd_h(**ok, pieces=pieces)


# ------------------------------------------------------------------ devices

@pytest.mark.parametrize("name", ["v", "g", "g_gamma", "gk", "gv", "h0"])
def test_tensor_on_another_device(ok, name):
    args = dict(ok, **{name: ok[name].to("meta")})
    with pytest.raises(ValueError, match=rf"{name} is on meta but the other inputs are on {ok['k'].device}"):
        chunkstate.chunk_fwd_h(**args)


def test_cu_seqlens_on_another_device(ok, device):
    args = _varlen(ok, torch.tensor([0, 40, 80], dtype=torch.int32, device="meta"), device)
    with pytest.raises(ValueError, match=r"cu_seqlens is on meta but the other inputs are on"):
        chunkstate.chunk_fwd_h(**args)


def test_inputs_on_a_device_the_kernels_cannot_use(ok):
    """All on one device, but not the one Triton runs on here (interpreter: CPU; compiled: CUDA)."""
    args = {n: x.to("meta") if isinstance(x, torch.Tensor) else x for n, x in ok.items()}
    want = "interpreter mode" if chunkstate.INTERPRET else "run compiled on a CUDA GPU"
    with pytest.raises(ValueError, match=rf"k is on meta, but .*{want}"):
        chunkstate.chunk_fwd_h(**args)


# ------------------------------------------------------------------ flags, scale, config, bf16

@pytest.mark.parametrize("name", ["output_final_state", "state_v_first", "states_in_fp32"])
@pytest.mark.parametrize("value", ["no", "False", 1, 0, None, torch.tensor(True)], ids=["str-no", "str-False", "one",
                                                                                        "zero", "none", "tensor"])
def test_flags_must_be_bools(ok, name, value):
    """A flag is True or False: ``"no"`` or ``"False"`` would be silently truthy."""
    with pytest.raises(TypeError, match=rf"{name} must be a bool \(True or False\)"):
        chunkstate.chunk_fwd_h(**dict(ok, **{name: value}))


@pytest.mark.parametrize("name", ["state_v_first", "states_in_fp32"])
def test_backward_flags_must_be_bools(device, name):
    q, k = torch.randn(1, 20, 2, 16, device=device), torch.randn(1, 20, 2, 16, device=device)
    with pytest.raises(TypeError, match=rf"{name} must be a bool \(True or False\)"):
        chunkstate.chunk_bwd_dh(q, k, k, k, None, None, 0.25, chunk_size=16, **{name: "False"})


@pytest.mark.parametrize("scale", [1e39, -4e38, float("inf"), float("nan")])
def test_scale_must_be_finite_in_fp32(device, scale):
    """The kernels take ``scale`` as fp32: 1e39 would become inf there, and the gradients NaN."""
    q, k = torch.randn(1, 20, 2, 16, device=device), torch.randn(1, 20, 2, 16, device=device)
    with pytest.raises(ValueError, match=r"scale must be finite in fp32"):
        chunkstate.chunk_bwd_dh(q, k, k, k, None, None, scale, chunk_size=16)


def test_split_size_below_2_to_the_31(ok):
    with pytest.raises(ValueError, match=r"split_size must be a positive multiple of chunk_size=16 below 2\^31"):
        chunkstate.chunk_fwd_h(**dict(ok, split_size=2 ** 31))


@pytest.mark.parametrize("config,exc,match", [
    ({"BK": 32, "BV": 32}, TypeError, r"config must be a triton\.Config"),
    ("BK32-BV32", TypeError, r"config must be a triton\.Config"),
    (triton.Config({"BK": 0, "BV": 32}), ValueError, r"config's BK must be 16, 32, 64 or 128"),
    (triton.Config({"BK": 48, "BV": 32}), ValueError, r"config's BK must be 16, 32, 64 or 128"),
    (triton.Config({"BK": 32, "BV": 256}), ValueError, r"config's BV must be 16, 32, 64 or 128"),
    (triton.Config({"BK": 32.0, "BV": 32}), ValueError, r"config's BK must be"),
    (triton.Config({"BV": 32}), ValueError, r"config's BK must be 16, 32, 64 or 128 \(a tile width\), got None"),
    (triton.Config({"BK": 32, "BV": 32, "BT": 64}), ValueError, r"config has keys \['BT'\] this kernel does not take"),
    (triton.Config({"BK": 32, "BV": 32, "use_tma": True}), ValueError, r"config has keys \['use_tma'\]"),
    (triton.Config({"BK": 32, "BV": 32, "USE_TMA": "no"}), TypeError, r"config's USE_TMA must be a bool"),
    (triton.Config({"BK": 32, "BV": 32, "USE_TMA": 1}), TypeError, r"config's USE_TMA must be a bool"),
    (triton.Config({"BK": 32, "BV": 32, "NARROW_V": 0}), TypeError, r"config's NARROW_V must be a bool"),
    (triton.Config({"BK": 32, "BV": 32}, num_warps=3), ValueError, r"config's num_warps must be 1, 2, 4, 8, 16 or 32"),
    (triton.Config({"BK": 32, "BV": 32}, num_warps=0), ValueError, r"config's num_warps must be"),
    (triton.Config({"BK": 32, "BV": 32}, num_stages=-1), ValueError, r"config's num_stages must be an int >= 0"),
    (triton.Config({"BK": 32, "BV": 32}, num_warps=np.int64(4)), ValueError, r"num_warps .* \(a Python int: int\("),
    (triton.Config({"BK": np.int64(32), "BV": 32}), ValueError, r"config's BK .* \(a Python int: int\("),
    (triton.Config({"BK": 32, "BV": 32}, maxnreg=8), ValueError,
     r"config's maxnreg must be None or an int from 16 to 255"),
    (triton.Config({"BK": 32, "BV": 32}, maxnreg=256), ValueError, r"config's maxnreg must be None or an int from 16"),
    (triton.Config({"BK": 32, "BV": 32}, maxnreg=96.0), ValueError, r"config's maxnreg must be .*, got 96\.0"),
    (triton.Config({"BK": 32, "BV": 32}, maxnreg=np.int64(96)), ValueError, r"maxnreg .* \(a Python int: int\("),
    (triton.Config({"BK": 32, "BV": 32}, num_ctas=2), ValueError, r"config's num_ctas must be 1"),
], ids=["dict", "str", "BK0", "BK48", "BV256", "BK-float", "no-BK", "BT", "misspelt", "tma-str", "tma-int",
        "narrow-int", "warps3", "warps0", "stages-negative", "warps-numpy", "BK-numpy", "maxnreg8", "maxnreg256",
        "maxnreg-float", "maxnreg-numpy", "ctas2"])
def test_malformed_configs(ok, config, exc, match):
    with pytest.raises(exc, match=match):
        chunkstate.chunk_fwd_h(**ok, config=config)


@pytest.mark.parametrize("config,exc,match", [
    (triton.Config({"BK": 16, "BV": 16, "USE_TMA": "False"}), TypeError, r"config's USE_TMA must be a bool"),
    (triton.Config({"BK": 16, "BV": 16}, num_warps=6), ValueError, r"config's num_warps must be"),
    (triton.Config({"BK": 16, "BV": 16, "NARROW_V": True}), ValueError,
     r"config has keys \['NARROW_V'\] this kernel does not take; it takes BK, BV, USE_TMA"),
    (triton.Config({"BK": 16, "BV": 16}, maxnreg=300), ValueError, r"config's maxnreg must be None or an int"),
], ids=["tma-str", "warps6", "narrow-v", "maxnreg300"])
def test_backward_config_values(device, config, exc, match):
    q, k = torch.randn(1, 20, 2, 16, device=device), torch.randn(1, 20, 2, 16, device=device)
    with pytest.raises(exc, match=match):
        chunkstate.chunk_bwd_dh(q, k, k, k, None, None, 0.25, chunk_size=16, config=config)


# ------------------------------------------------------------------ no state element: empty outputs, not a crash

@pytest.mark.parametrize("pieces", [1, 2])
@pytest.mark.parametrize("H,K,V", [(0, 16, 16), (2, 0, 16), (2, 16, 0)], ids=["H0", "K0", "V0"])
def test_empty_states_run(device, H, K, V, pieces):
    """H, K or V = 0 is valid (every state is empty): both kernels return empty outputs, also when
    asked for pieces (which once crashed on the empty state tensor, and the backward on HQ / H)."""
    k, v = torch.randn(2, 20, H, K, device=device), torch.randn(2, 20, H, V, device=device)
    h, ht = chunkstate.chunk_fwd_h(k, v, chunk_size=16, output_final_state=True, pieces=pieces)
    assert h.shape == (2, 2, H, K, V) and ht.shape == (2, H, K, V)
    q, do = torch.randn(2, 20, 2 * H, K, device=device), torch.randn(2, 20, 2 * H, V, device=device)
    dh, dh0 = chunkstate.chunk_bwd_dh(q, k, v, do, torch.zeros(2, H, K, V, device=device), None, 1.0, chunk_size=16,
                                      pieces=pieces)
    assert dh.shape == (2, 2, H, K, V) and dh0.shape == (2, H, K, V)


def test_gla_with_no_heads_differentiates(device):
    q, k, v = (torch.randn(1, 20, 0, 16, device=device, requires_grad=True) for _ in range(3))
    o, _ = chunkstate.chunk_gla(q, k, v, chunk_size=16)
    o.sum().backward()
    assert o.shape == (1, 20, 0, 16) and q.grad.shape == q.shape


def test_numpy_scalars_are_taken(ok):
    """numpy's bools and ints are taken wherever chunkstate's own arguments take a bool or an int
    (flags, sizes, a config's USE_TMA), with the same result as Python's. A ``triton.Config``'s tiles,
    warps and stages go to Triton as they are: there only Python ints (test_malformed_configs)."""
    h, ht = chunkstate.chunk_fwd_h(**ok, output_final_state=True, split_size=16,
                                   config=triton.Config({"BK": 16, "BV": 16, "USE_TMA": False}, num_warps=4))
    config = triton.Config({"BK": 16, "BV": 16, "USE_TMA": np.False_}, num_warps=4)
    h_np, ht_np = chunkstate.chunk_fwd_h(**dict(ok, chunk_size=np.int64(16)), split_size=np.int32(16),
                                         output_final_state=np.True_, state_v_first=np.False_, config=config)
    assert torch.equal(h_np, h) and torch.equal(ht_np, ht)
    assert torch.equal(gates.chunk_local_cumsum(_gate, 16, reverse=np.True_), gates.chunk_local_cumsum(_gate, 16,
                                                                                                       reverse=True))


def test_delta_default_scale_with_no_key_dims(device):
    """K = 0: every output is 0 whatever the scale; the default (K ** -0.5) is then 1, not a
    ZeroDivisionError, as in reference and chunk_gla (one rule: _validate.scale)."""
    q, k = torch.randn(1, 8, 2, 0, device=device), torch.randn(1, 8, 2, 0, device=device)
    v, beta = torch.randn(1, 8, 2, 4, device=device), torch.rand(1, 8, 2, device=device)
    for fn in (delta.recurrent_delta, delta.chunked_delta):
        o = fn(q, k, v, beta, chunk_size=4)[0]
        assert o.shape == (1, 8, 2, 4) and not o.any()


# ------------------------------------------------------------------ gates helpers (plain PyTorch, any device)

_gate = torch.zeros(1, 20, 2)
_cu = torch.tensor([0, 8, 20])


@pytest.mark.parametrize("call,exc,match", [
    (lambda: gates.chunk_local_cumsum(_gate.tolist(), 16), TypeError, r"gate must be a torch\.Tensor"),
    (lambda: gates.chunk_local_cumsum(_gate.to(torch.complex64), 16), TypeError, r"gate must be real"),
    (lambda: gates.chunk_local_cumsum(_gate > 0, 16), TypeError, r"gate must be real numbers .* torch\.bool"),
    (lambda: gates.chunk_local_cumsum(_gate.to("meta"), 16), ValueError, r"gate is on the meta device"),
    (lambda: gates.chunk_local_cumsum(_gate, 16, _cu.to("meta")), ValueError, r"cu_seqlens is on the meta device"),
    (lambda: gates.chunk_local_cumsum(_gate, 16, dtype=torch.int32), TypeError,
     r"dtype must be a floating-point torch\.dtype"),
    (lambda: gates.chunk_local_cumsum(_gate, 16, dtype="float32"), TypeError, r"dtype must be a floating-point"),
    (lambda: gates.chunk_local_cumsum(_gate, 16, scale=None), TypeError, r"scale must be a real number"),
    (lambda: gates.chunk_local_cumsum(_gate, 16, scale=float("nan")), ValueError, r"scale must be finite"),
    (lambda: gates.chunk_local_cumsum(_gate, 16, floor=float("nan")), ValueError, r"floor must not be NaN"),
    (lambda: gates.chunk_local_cumsum(_gate, 16, floor=torch.tensor(-1.0)), TypeError,
     r"floor must be None or a real number"),
    (lambda: gates.chunk_local_cumsum(_gate, 16, reverse="no"), TypeError, r"reverse must be a bool"),
    (lambda: gates.kernel_gates(_gate, 16), TypeError, r"gates must be a dict of gate tensors by name"),
    (lambda: gates.kernel_gates({"g": None}, 16), TypeError, r"gates\['g'\] must be a torch\.Tensor, got NoneType"),
    (lambda: gates.kernel_gates({"g_gamma": [-0.1, -0.2]}, 16), TypeError, r"gates\['g_gamma'\] must be a torch"),
    (lambda: gates.prepare_chunk_offsets([0, 8, 20], 16), TypeError, r"cu_seqlens must be a torch\.Tensor"),
    (lambda: gates.prepare_chunk_offsets(_cu.float(), 16), TypeError, r"cu_seqlens must be a 1-D int tensor"),
    (lambda: gates.prepare_chunk_indices(_cu[None], 16), TypeError, r"cu_seqlens must be a 1-D int tensor"),
], ids=["gate-list", "gate-complex", "gate-bool", "gate-meta", "cu-meta", "dtype-int", "dtype-str", "scale-none",
        "scale-nan", "floor-nan", "floor-tensor", "reverse-str", "gates-tensor", "gate-none", "gamma-list",
        "offsets-list", "offsets-float", "indices-2d"])
def test_gates_helpers(call, exc, match):
    with pytest.raises(exc, match=match):
        call()


# ------------------------------------------------------------------ delta rule (plain PyTorch): no broadcasting

_D = dict(q=torch.randn(2, 20, 2, 8), k=torch.randn(2, 20, 2, 8), v=torch.randn(2, 20, 2, 6),
          beta=torch.rand(2, 20, 2), h0=torch.randn(2, 2, 8, 6))


@pytest.mark.parametrize("fn", [delta.recurrent_delta, delta.chunked_delta], ids=["recurrent", "chunked"])
@pytest.mark.parametrize("change,exc,match", [
    (dict(k=_D["k"][:1]), ValueError, r"k must have shape \[2, 20, 2, 8\], got \[1, 20, 2, 8\]"),
    (dict(q=_D["q"][0]), ValueError, r"q must have shape \[B, T, H, K\], got \[20, 2, 8\]"),
    (dict(v=_D["v"][:, :, :1]), ValueError, r"v must have shape \[2, 20, 2, \*\]"),
    (dict(h0=_D["h0"][:1]), ValueError, r"h0 must have shape \[2, 2, 8, 6\]"),
    (dict(h0=_D["h0"][0]), ValueError, r"h0 must have shape \[2, 2, 8, 6\]"),
    (dict(beta=_D["beta"][..., None]), ValueError, r"beta must have shape \[2, 20, 2\]"),
    (dict(k=_D["k"][:, :10]), ValueError, r"k must have shape \[2, 20, 2, 8\]"),
    (dict(k=_D["k"].int()), TypeError, r"k must be a floating-point tensor"),
    (dict(k=_D["k"].tolist()), TypeError, r"k must be a torch\.Tensor"),
    (dict(k=_D["k"].to("meta")), ValueError, r"k is on meta but the other inputs are on cpu"),
    (dict(chunk_size=0), ValueError, r"chunk_size must be a positive int"),
    (dict(chunk_size=16.0), TypeError, r"chunk_size must be an int"),
    (dict(scale=torch.tensor(0.5)), TypeError, r"scale must be a real number"),
    (dict(scale=float("nan")), ValueError, r"scale must be finite"),
], ids=["k-batch", "q-3d", "v-heads", "h0-batch", "h0-3d", "beta-4d", "k-time", "k-int", "k-list", "k-meta", "chunk0",
        "chunk-float", "scale-tensor", "scale-nan"])
def test_delta_inputs(fn, change, exc, match):
    with pytest.raises(exc, match=match):
        fn(**{**_D, "chunk_size": 8, **change})


@pytest.mark.parametrize("k,beta,match", [
    (torch.randn(16, 4), torch.rand(8), r"beta must have shape \[16\], got \[8\]"),
    (torch.randn(16, 4), torch.rand(16, 1), r"beta must have shape \[16\]"),
    (torch.randn(4), torch.rand(4), r"k must have shape \[\.\.\., L, K\]"),
], ids=["beta-L", "beta-2d", "k-1d"])
def test_ut_transform_inputs(k, beta, match):
    with pytest.raises(ValueError, match=match):
        delta.ut_transform(k, beta)


# ------------------------------------------------------------------ the float64 oracle (reference.py): no broadcasting

# A dense batch (B=2, T=20, H=2, HQ=4: GQA, K=8, V=6) and the same tokens packed in one row as two
# sequences of 15 and 25 tokens (N=2). Each row below changes one argument, for every reference
# function that takes it (chunk_size=4 where taken).
_R = dict(q=torch.randn(2, 20, 4, 8), k=torch.randn(2, 20, 2, 8), v=torch.randn(2, 20, 2, 6),
          do=torch.randn(2, 20, 4, 6), g=-torch.rand(2, 20, 2), g_gamma=-torch.rand(2),
          gk=-torch.rand(2, 20, 2, 8), gv=-torch.rand(2, 20, 2, 6), h0=torch.randn(2, 2, 8, 6),
          dht=torch.randn(2, 2, 8, 6), chunk_size=4)
_RP = dict({n: x.reshape(1, 40, *x.shape[2:]) if x.dim() > 2 and n not in ("h0", "dht") else x
            for n, x in _R.items() if n != "chunk_size"}, cu_seqlens=torch.tensor([0, 15, 40]), chunk_size=4)
_REF_FNS = (reference.recurrent_states, reference.recurrent_outputs, reference.state_grads,
            reference.chunked_states, reference.parallel_outputs)


def _ref_rows(rows, args):
    """(fn, arguments, exception, match) for every row and every function taking all it changes."""
    out = []
    for change, exc, match, rid in rows:
        for fn in _REF_FNS:
            takes = inspect.signature(fn).parameters
            if set(change) <= set(takes) and ("cu_seqlens" in takes or "cu_seqlens" not in args):
                call = {n: x for n, x in {**args, **change}.items() if n in takes}
                out.append(pytest.param(fn, call, exc, match, id=f"{fn.__name__}-{rid}"))
    return out


_REF_DENSE = [
    (dict(v=_R["v"][:, :, :1]), ValueError, r"v must have shape \[2, 20, 2, \*\], got \[2, 20, 1, 6\]", "v-H1"),
    (dict(q=_R["q"][:1]), ValueError, r"q must have shape \[2, 20, \*, 8\], got \[1, 20, 4, 8\]", "q-B1"),
    (dict(q=_R["q"][..., :1]), ValueError, r"q must have shape \[2, 20, \*, 8\]", "q-K1"),
    (dict(q=_R["q"][:, :, :3]), ValueError, r"q must have a positive multiple of k's H=2 heads.*got HQ=3",
     "q-HQ3"),
    (dict(q=None), TypeError, r"q must be a torch\.Tensor", "q-none"),
    (dict(do=_R["do"][:, :, :2]), ValueError, r"do must have shape \[2, 20, 4, 6\]", "do-H"),
    (dict(h0=_R["h0"][0]), ValueError, r"h0 must have shape \[2, 2, 8, 6\], got \[2, 8, 6\]", "h0-no-N"),
    (dict(h0=_R["h0"][:1]), ValueError, r"h0 must have shape \[2, 2, 8, 6\]", "h0-N1"),
    (dict(dht=_R["dht"][:1]), ValueError, r"dht must have shape \[2, 2, 8, 6\]", "dht-N1"),
    (dict(gk=_R["gk"][..., :1]), ValueError, r"gk must have shape \[2, 20, 2, 8\], got \[2, 20, 2, 1\]", "gk-K1"),
    (dict(gv=_R["gv"][..., :1]), ValueError, r"gv must have shape \[2, 20, 2, 6\]", "gv-V1"),
    (dict(g=_R["g"][..., :1]), ValueError, r"g must have shape \[2, 20, 2\]", "g-H1"),
    (dict(g=_R["gk"]), ValueError, r"g must have shape \[2, 20, 2\].*goes in gk=", "g-per-key"),
    (dict(g_gamma=_R["g_gamma"][:1]), ValueError, r"g_gamma must have shape \[2\]", "gamma-H1"),
    (dict(k=_R["k"][0]), ValueError, r"k must have shape \[B, T, H, K\], got \[20, 2, 8\]", "k-3d"),
    (dict(k=_R["k"].int()), TypeError, r"k must be a floating-point tensor", "k-int"),
    (dict(v=_R["v"].tolist()), TypeError, r"v must be a torch\.Tensor", "v-list"),
    (dict(v=_R["v"].to("meta")), ValueError, r"v is on meta but the other inputs are on cpu", "v-meta"),
    (dict(chunk_size=0), ValueError, r"chunk_size must be a positive int, got 0", "chunk0"),
    (dict(chunk_size=4.0), TypeError, r"chunk_size must be an int", "chunk-float"),
    (dict(chunk_size=None), TypeError, r"chunk_size must be an int", "chunk-none"),
    (dict(split_size=6), ValueError, r"split_size must be a positive multiple of chunk_size=4, got 6", "split6"),
    (dict(split_size=0), ValueError, r"split_size must be a positive int, got 0", "split0"),
    (dict(scale=float("nan")), ValueError, r"scale must be finite", "scale-nan"),
    (dict(scale=float("inf")), ValueError, r"scale must be finite", "scale-inf"),
    (dict(scale=torch.tensor(0.5)), TypeError, r"scale must be a real number", "scale-tensor"),
    (dict(cu_seqlens=torch.tensor([0, 10, 20])), ValueError, r"with cu_seqlens the batch size must be 1.*got B=2",
     "cu-B2"),
]
_REF_PACKED = [
    (dict(cu_seqlens=torch.tensor([0, 30, 20, 40])), ValueError, r"cu_seqlens must be non-decreasing", "cu-decreasing"),
    (dict(cu_seqlens=torch.tensor([0, 15, 39])), ValueError, r"cu_seqlens must end at T=40, got 39", "cu-last"),
    (dict(cu_seqlens=torch.tensor([1, 15, 40])), ValueError, r"cu_seqlens must start at 0, got 1", "cu-first"),
    (dict(cu_seqlens=torch.tensor([[0, 15, 40]])), TypeError, r"cu_seqlens must be a 1-D int32/int64", "cu-2d"),
    (dict(cu_seqlens=torch.tensor([0.0, 15.0, 40.0])), TypeError, r"cu_seqlens must be a 1-D int32/int64", "cu-float"),
    (dict(cu_seqlens=[0, 15, 40]), TypeError, r"cu_seqlens must be a torch\.Tensor", "cu-list"),
    (dict(cu_seqlens=torch.tensor([0, 15, 15, 40])), ValueError, r"h0 must have shape \[3, 2, 8, 6\]", "h0-N2-of-3"),
    (dict(h0=_R["h0"][:1]), ValueError, r"h0 must have shape \[2, 2, 8, 6\], got \[1, 2, 8, 6\]", "h0-N1"),
]


@pytest.mark.parametrize("fn,args,exc,match", _ref_rows(_REF_DENSE, _R) + _ref_rows(_REF_PACKED, _RP))
def test_reference_inputs(fn, args, exc, match):
    with pytest.raises(exc, match=match):
        fn(**args)


@pytest.mark.parametrize("fn", _REF_FNS, ids=lambda fn: fn.__name__)
def test_reference_takes_what_it_should(fn):
    """The controls: every reference function takes the fixtures above (dense, and packed where it
    takes cu_seqlens), and any float dtype, strides and numpy sizes / scale."""
    takes = inspect.signature(fn).parameters
    for args in (_R, _RP) if "cu_seqlens" in takes else (_R,):
        fn(**{n: x for n, x in args.items() if n in takes})
    odd = dict(_R, k=_R["k"].double(), v=_R["v"].half(), q=_R["q"].transpose(0, 1).contiguous().transpose(0, 1),
               h0=_R["h0"].transpose(-1, -2).contiguous().transpose(-1, -2), chunk_size=np.int64(4),
               split_size=np.int32(8), scale=np.float32(0.5))
    fn(**{n: x for n, x in odd.items() if n in takes})


@pytest.mark.parametrize("Bn,Tn,Hn,Kn,Vn", [(2, 10, 0, 4, 4), (2, 10, 2, 0, 4), (2, 10, 2, 4, 0), (2, 0, 2, 4, 4),
                                          (0, 10, 2, 4, 4), (0, 0, 2, 4, 4)],
                         ids=["H0", "K0", "V0", "T0", "B0", "B0-T0"])
@pytest.mark.parametrize("fn", _REF_FNS, ids=lambda fn: fn.__name__)
def test_reference_empty_shapes_run(fn, Bn, Tn, Hn, Kn, Vn):
    """No state element, no token or no sequence is valid, as for the kernels: results of the
    kernels' shapes, empty or zero, not a ZeroDivisionError (H = 0 in HQ // H, K = 0 in K ** -0.5),
    a reshape error (state_grads) or a stack of nothing (B = 0)."""
    args = dict(q=torch.randn(Bn, Tn, 2 * Hn, Kn), k=torch.randn(Bn, Tn, Hn, Kn), v=torch.randn(Bn, Tn, Hn, Vn),
                do=torch.randn(Bn, Tn, 2 * Hn, Vn), h0=torch.randn(Bn, Hn, Kn, Vn), chunk_size=4)
    takes = inspect.signature(fn).parameters
    out = fn(**{n: x for n, x in args.items() if n in takes})
    first = out[0] if isinstance(out, tuple) else out
    outputs = fn.__name__ in ("recurrent_outputs", "parallel_outputs")
    assert first.shape == ((Bn, Tn, 2 * Hn, Vn) if outputs else (Bn, math.ceil(Tn / 4), Hn, Kn, Vn)), first.shape
    assert first.dtype == torch.float64 and not first.isnan().any()
    if isinstance(out, tuple):  # ht, or dh0: one state per sequence
        assert out[1].shape == (Bn, Hn, Kn, Vn) and not out[1].isnan().any()


@pytest.mark.skipif(not chunkstate.INTERPRET, reason="bf16 is refused only under Triton's interpreter")
def test_bf16_refused_under_the_interpreter(ok):
    """The interpreter computes bf16 wrongly (relative error ~1e10): refused, saying what to use."""
    args = dict(ok, k=ok["k"].bfloat16(), v=ok["v"].bfloat16())
    with pytest.raises(TypeError, match=r"k is bf16, which Triton's interpreter .* computes wrongly.*fp32 or fp16"):
        chunkstate.chunk_fwd_h(**args)
    q = ok["k"].bfloat16()
    with pytest.raises(TypeError, match=r"q is bf16, which Triton's interpreter"):
        chunkstate.chunk_bwd_dh(q, q, args["v"], args["v"], None, None, 0.25, chunk_size=16)


TRITON_FIRST = """
import warnings
import triton  # before chunkstate: Triton's helpers are made for a GPU
with warnings.catch_warnings(record=True) as caught:
    warnings.simplefilter("always")
    import chunkstate
    import chunkstate.explore
import torch
assert any("Import chunkstate before triton" in str(w.message) for w in caught), [str(w.message) for w in caught]
k = torch.randn(1, 32, 1, 16)
for call in (lambda: chunkstate.chunk_fwd_h(k, k, chunk_size=16),
             lambda: chunkstate.explore.program_map(1, 32, 1, 16, 16, chunk_size=16)):
    try:
        call()
    except RuntimeError as e:
        assert "Import chunkstate before triton" in str(e), e
    else:
        raise AssertionError("a kernel call ran with Triton imported before the interpreter mode")
print("refused")
"""


@pytest.mark.skipif(torch.cuda.is_available(), reason="only without a CUDA GPU does chunkstate set TRITON_INTERPRET")
def test_triton_imported_first_gets_a_clear_error():
    """On a machine without a GPU, ``import triton`` before ``import chunkstate`` leaves Triton's own
    helpers made for a GPU, so the interpreter cannot run the kernels: the import warns, and a kernel
    call raises RuntimeError saying to import chunkstate first (not an InterpreterError from inside
    Triton)."""
    import os
    import subprocess
    import sys
    from pathlib import Path

    env = {n: v for n, v in os.environ.items() if n != "TRITON_INTERPRET"}
    done = subprocess.run([sys.executable, "-c", TRITON_FIRST], capture_output=True, text=True, timeout=300,
                          cwd=Path(__file__).resolve().parents[1], env=env)
    assert done.returncode == 0 and "refused" in done.stdout, done.stderr[-3000:]
