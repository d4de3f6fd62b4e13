"""Property-based fuzzing of bad input: one thing wrong in a valid call gets an error naming it.

test_errors.py lists the bad inputs someone thought of; this draws them. From a valid call of each
public entry point (the two kernels, ``chunk_gla``, the float64 oracle's ``recurrent_states`` and
``state_grads``, ``chunk_local_cumsum``), dense or packed, Hypothesis changes exactly one argument
in a way that is never valid — a size off by one or cut to 1 (a silent broadcast's favourite), a
dimension added or dropped, an int / bool / complex / meta tensor, a list or a number in place of a
tensor, a bad scale, chunk or split size, flag or piece count, malformed ``cu_seqlens`` — and
requires a ``TypeError`` or ``ValueError`` whose message names the argument. Never a result, never
an error from deep inside torch or Triton (an ``IndexError``, ``RuntimeError``, ...).

Where one argument fixes a size that the others are checked against (``k`` B, T, H and K; ``v`` V;
``q`` the backward's and the oracle's query heads), a change to it may be reported as another
argument's mismatch: then naming any argument of the call is enough (as a word: "g" is not the g of
"got").

The checks run before any kernel launches, so a drawn case costs microseconds even under the
interpreter; seeded like every test (tests/conftest.py).
"""
from __future__ import annotations

import chunkstate  # first: it sets TRITON_INTERPRET on a CPU machine before Triton is imported

import math
import os
import re

import torch
import pytest
from hypothesis import HealthCheck, event, given, settings
from hypothesis import strategies as st

from chunkstate import gates, reference
from chunkstate.testing import random_gates

DEVICE = chunkstate.DEVICE
B, T, H, K, V, BT = 1, 40, 2, 16, 16, 16
LENS = [7, 0, 33]  # the packed batch: an empty sequence, and none chunk-aligned


def calls(packed: bool):
    """Each entry point: (the function, its valid keyword arguments, the arguments that fix sizes)."""
    Bx = 1 if packed else 2
    cu = torch.tensor([0, *torch.tensor(LENS).cumsum(0).tolist()], device=DEVICE) if packed else None
    N = len(LENS) if packed else Bx
    r = lambda *shape: torch.randn(*shape, device=DEVICE)  # noqa: E731
    q, k, v, do = r(Bx, T, H, K), r(Bx, T, H, K), r(Bx, T, H, V), r(Bx, T, H, V)
    nat = random_gates(Bx, T, H, K, V, device=DEVICE)
    kg = gates.kernel_gates(nat, BT, cu)
    h0, dht = r(N, H, K, V), r(N, H, K, V)
    sizes = dict(cu_seqlens=cu, chunk_size=BT)
    return {
        "chunk_fwd_h": (chunkstate.chunk_fwd_h, dict(k=k, v=v, **kg, h0=h0, output_final_state=True, **sizes,
                                                     split_size=2 * BT, state_v_first=False, pieces=1), {"k", "v"}),
        "chunk_bwd_dh": (chunkstate.chunk_bwd_dh, dict(q=q, k=k, v=v, do=do, h0=h0, dht=dht, scale=K ** -0.5, **kg,
                                                       **sizes, split_size=2 * BT, states_in_fp32=True, pieces=1),
                         {"q", "k", "v"}),
        "chunk_gla": (chunkstate.chunk_gla, dict(q=q, k=k, v=v, g=nat["g"], gk=nat["gk"], scale=0.25,
                                                 initial_state=h0, output_final_state=True, **sizes), {"q", "k", "v"}),
        "reference.recurrent_states": (reference.recurrent_states, dict(k=k, v=v, **nat, h0=h0, **sizes,
                                                                        split_size=2 * BT), {"k", "v"}),
        "reference.state_grads": (reference.state_grads, dict(q=q, k=k, v=v, do=do, **nat, h0=h0, dht=dht,
                                                              scale=0.25, **sizes), {"q", "k", "v"}),
        "gates.chunk_local_cumsum": (gates.chunk_local_cumsum, dict(gate=nat["gk"], chunk_size=BT, cu_seqlens=cu),
                                     {"gate"}),
    }


# ---------------------------------------------------------------------------------------------
# The changes: each returns the bad value, or None where it does not apply to this argument


def size_off_by_one(x, data):
    if not isinstance(x, torch.Tensor) or x.dim() == 0 or x.numel() == 0:
        return None
    d = data.draw(st.integers(0, x.dim() - 1), label="dim")
    shape = list(x.shape)
    shape[d] = shape[d] + 1 if shape[d] == 1 or data.draw(st.booleans(), label="grow") else 1
    return torch.randn(*shape, device=x.device).to(x.dtype) if x.is_floating_point() else None


def one_dim_more(x, data):
    if not isinstance(x, torch.Tensor) or not x.is_floating_point():
        return None
    return x.unsqueeze(data.draw(st.integers(0, x.dim()), label="at"))


def one_dim_less(x, data):
    if not isinstance(x, torch.Tensor) or not x.is_floating_point() or x.dim() == 0:
        return None
    return x.select(data.draw(st.integers(0, x.dim() - 1), label="at"), 0)


def wrong_dtype(x, data):
    if not isinstance(x, torch.Tensor) or not x.is_floating_point():
        return None
    dtype = data.draw(st.sampled_from([torch.int32, torch.int64, torch.bool, torch.complex64]), label="dtype")
    return x.to(dtype)


def meta_device(x, data):
    return x.to("meta") if isinstance(x, torch.Tensor) else None


def not_a_tensor(x, data):
    if not isinstance(x, torch.Tensor):
        return None
    kind = data.draw(st.sampled_from(["list", "number", "string"]), label="as")
    return {"list": x.tolist(), "number": 1.0, "string": "x"}[kind]


def bad_scale(x, data):
    return data.draw(st.sampled_from([math.nan, math.inf, -math.inf, "0.25", True, torch.tensor(0.25), 1e39]),
                     label="scale")


def bad_size(x, data):
    return data.draw(st.sampled_from([0, -16, 24, 16.0, "16", True, None, 2 ** 40]), label="size")


def bad_flag(x, data):
    return data.draw(st.sampled_from(["yes", "False", 1, 0, None, 1.0, torch.tensor(True)]), label="flag")


def bad_pieces(x, data):
    return data.draw(st.sampled_from([0, -1, 1.5, "2", True, torch.tensor(2)]), label="pieces")


def bad_offsets(x, data):
    if x is None:
        return None
    values = x.tolist()
    kind = data.draw(st.sampled_from(["decreasing", "short", "long", "not from 0", "float", "2-D", "list"]),
                     label="offsets")
    if kind == "decreasing":
        values[1], values[2] = values[2] + 5, values[2]
    elif kind == "short":
        values[-1] -= 1
    elif kind == "long":
        values[-1] += 1
    elif kind == "not from 0":
        values[0] = 1
    elif kind == "float":
        return x.float()
    elif kind == "2-D":
        return x[None]
    elif kind == "list":
        return values
    return torch.tensor(values, dtype=x.dtype, device=x.device)


PYTORCH = ("reference.recurrent_states", "reference.state_grads", "gates.chunk_local_cumsum")
TENSOR_CHANGES = [size_off_by_one, one_dim_more, one_dim_less, wrong_dtype, meta_device, not_a_tensor]
BY_ARGUMENT = {"scale": [bad_scale], "chunk_size": [bad_size], "split_size": [bad_size],
               "cu_seqlens": [bad_offsets], "pieces": [bad_pieces], "output_final_state": [bad_flag],
               "state_v_first": [bad_flag], "states_in_fp32": [bad_flag]}
# sizes a function accepts for these arguments, where the generic changes would draw a valid one
ANY_SIZE = {24, 2 ** 40}  # no power of two, or past the kernels' 256: one chunk longer than every sequence
ACCEPTED = {**{(fn, "chunk_size"): ANY_SIZE for fn in PYTORCH},  # PyTorch code takes any positive chunk size
            **{(fn, "split_size"): {None} for fn in ("chunk_fwd_h", "chunk_bwd_dh")},  # the default
            **{(fn, "split_size"): {None, 2 ** 40} for fn in PYTORCH},  # and any multiple of the chunk
            **{(fn, "scale"): {1e39} for fn in PYTORCH}}  # float64


def valid_anyway(name: str, arg: str, bad, packed: bool) -> bool:
    """A change that happens to make a valid call: a value the function takes (``ACCEPTED``), or a
    gate of any [B, T, H] or [B, T, H, D] shape and real dtype for the cumulative sum (B = 1, T
    tokens in a packed batch)."""
    if not isinstance(bad, torch.Tensor):
        return any(bad is a or (type(bad) is type(a) and bad == a) for a in ACCEPTED.get((name, arg), ()))
    return name == "gates.chunk_local_cumsum" and arg == "gate" and bad.dim() in (3, 4) \
        and (not packed or tuple(bad.shape[:2]) == (1, T)) and bad.device.type == DEVICE \
        and not bad.is_complex() and bad.dtype != torch.bool  # int gates are summed as any others


@settings(max_examples=int(os.environ.get("CHUNKSTATE_FUZZ_EXAMPLES", "0")) or 300, deadline=None, database=None,
          suppress_health_check=[HealthCheck.too_slow])
@given(data=st.data())
def test_one_bad_argument_is_named(data):
    packed = data.draw(st.booleans(), label="packed")
    entries = calls(packed)
    name = data.draw(st.sampled_from(sorted(entries)), label="function")
    fn, kwargs, leaders = entries[name]
    arg = data.draw(st.sampled_from(sorted(a for a, x in kwargs.items() if x is not None or a == "cu_seqlens")),
                    label="argument")
    changes = BY_ARGUMENT.get(arg, TENSOR_CHANGES)
    change = data.draw(st.sampled_from(changes), label="change")
    bad = change(kwargs[arg], data)
    if bad is None and change not in (bad_size, bad_flag) or valid_anyway(name, arg, bad, packed):
        event("skipped: not applicable, or valid")
        return  # this change does not apply to this argument, or makes another valid call
    try:
        fn(**{**kwargs, arg: bad})
    except (TypeError, ValueError) as e:
        said = str(e)
        named = names(said, arg) or (arg in leaders and any(names(said, a) for a in kwargs))
        assert named, f"{name}: {change.__name__} of {arg} raised {type(e).__name__} not naming it: {said}"
        event(f"refused: {change.__name__}")
        return
    except Exception as e:  # noqa: BLE001  anything else is a crash deep inside torch or Triton
        raise AssertionError(f"{name}: {change.__name__} of {arg} crashed with {type(e).__name__}: {e}") from e
    raise AssertionError(f"{name}: {change.__name__} of {arg} ({_show(bad)}) was accepted")


def names(message: str, arg: str) -> bool:
    """The message names ``arg`` as a word ("g must", "gates['g']", not the g of "got")."""
    return re.search(rf"(?<![\w]){re.escape(arg)}(?![\w])", message) is not None


@pytest.mark.parametrize("packed", [False, True], ids=["dense", "packed"])
def test_the_valid_calls_run(packed):
    """The control: every call above is valid as it stands, so each refusal comes from its one change."""
    for name, (fn, kwargs, _) in calls(packed).items():
        fn(**kwargs)


def test_names_matches_words():
    assert names("g must have shape [2, 40, 2]", "g") and names("gates['gk'] must be", "gk")
    assert not names("h0 must have shape [2, 2, 16, 16], got [1]", "g")  # the g of "got", "shape"
    assert not names("gk must be", "g") and names("config's USE_TMA must be a bool", "USE_TMA")


def _show(x):
    return f"tensor {list(x.shape)} {x.dtype} on {x.device}" if isinstance(x, torch.Tensor) else repr(x)[:60]
