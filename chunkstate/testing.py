"""Checks used by the tests, the notebooks and the exercises: they raise, never only print.

Also the introspection of Triton's autotuners and compiled kernels (``find_autotuners``,
``find_jit_functions``, ``n_compiled``): ``fla_one_config`` needs it, and so does the benchmark's
runner, which imports it from here (imports flow towards the benchmark, never out of it).
"""
from __future__ import annotations

import contextlib

import torch

from .env import INTERPRET


def rel_err(out: torch.Tensor, ref: torch.Tensor) -> float:
    """‖out − ref‖ / ‖ref‖ in float64 (‖·‖ the Frobenius norm); 0 when both are zero.

    NaN anywhere in ``out`` gives NaN, which fails every ``<`` comparison.
    """
    out, ref = out.detach().to(torch.float64).cpu(), ref.detach().to(torch.float64).cpu()
    if out.shape != ref.shape:
        raise AssertionError(f"shape {tuple(out.shape)} != reference shape {tuple(ref.shape)}")
    num, den = (out - ref).norm().item(), ref.norm().item()
    if den == 0.0:
        return 0.0 if num == 0.0 else float("inf")
    return num / den


def random_gates(B: int, T: int, H: int, K: int, V: int, *, mild: bool = False, device=None) -> dict:
    """Fresh natural-log per-token gates for checks, all four kinds (``g``, ``g_gamma``, ``gk``,
    ``gv``; ``gates.kernel_gates`` turns them into what the kernels take).

    ``g = logsigmoid(x)`` with x ~ N(0, 1) (a decay of about e^-0.8 per token), ``gk`` and ``gv`` a
    quarter of that (several key and value gates compound); ``mild``: ``logsigmoid(x + 3)`` for all
    three (about e^-0.07 per token), so a state or gradient still carries the chunks before it and
    a check sees them. ``g_gamma[h] = log(1 − 2^(−5−h))``: RetNet's per-head decays."""
    def decay(*shape, share=1.0):
        x = torch.randn(*shape, device=device)
        return torch.nn.functional.logsigmoid(x + 3) if mild else torch.nn.functional.logsigmoid(x) * share

    return dict(g=decay(B, T, H), g_gamma=torch.log(1 - 2.0 ** (-5.0 - torch.arange(H, device=device))),
                gk=decay(B, T, H, K, share=0.25), gv=decay(B, T, H, V, share=0.25))


def _short(x: float, digits: int) -> str:
    """``x`` to ``digits`` significant digits in few characters: 0, 3.3e-17, 1e-12, 0.005."""
    mantissa, _, exponent = f"{x:.{digits}g}".partition("e")
    if not exponent:
        return mantissa
    return f"{mantissa}e{exponent[0].replace('+', '')}{exponent[1:].lstrip('0') or '0'}"


class Check(float):
    """The relative error a passed check measured, labelled.

    A ``float`` in every use (arithmetic, comparisons and ``f"{err:.1e}"`` see the number), whose
    ``repr`` and ``str`` are one line naming what was compared, the error and the tolerance::

        h: chunked form vs token loop: rel. error 3.3e-17 < 1e-12 ✓

    so a notebook cell that ends in ``check_close(...)`` shows that line, not a bare number.
    """

    what: str
    tol: float

    def __new__(cls, err: float, what: str, tol: float) -> "Check":
        self = super().__new__(cls, err)
        self.what, self.tol = what, tol
        return self

    def __repr__(self) -> str:
        return f"{self.what}: rel. error {_short(float(self), 2)} < {_short(self.tol, 3)} ✓"

    __str__ = __repr__

    def __format__(self, spec: str) -> str:
        return str(self) if not spec else format(float(self), spec)

    def __reduce__(self):
        return (Check, (float(self), self.what, self.tol))


def check_close(out: torch.Tensor, ref: torch.Tensor, what: str, tol: float = 1e-6) -> Check:
    """Raise ``AssertionError`` naming ``what`` unless rel_err(out, ref) < tol; return the error.

    The error comes back as a :class:`Check`: a float that shows itself as a labelled line
    (``what: rel. error 3.3e-17 < 1e-12 ✓``). Name both sides in ``what`` ("h: chunked form vs
    token loop"), since that is the line a reader sees.
    """
    if tuple(out.shape) != tuple(ref.shape):
        raise AssertionError(f"{what}: shape {tuple(out.shape)} != reference shape {tuple(ref.shape)}")
    if torch.isnan(out).any() and not torch.isnan(ref).any():
        bad = torch.isnan(out).nonzero()[:3].tolist()
        raise AssertionError(f"{what}: NaN in the result (e.g. at {bad}) — an element never written?")
    err = rel_err(out, ref)
    if not err < tol:
        raise AssertionError(f"{what}: relative error {err:.3e} is not below {tol:.1e}")
    return Check(err, what, tol)


@contextlib.contextmanager
def nan_poisoned_empty():
    """Within the block, ``torch.empty`` / ``torch.empty_like`` return NaN-filled float tensors,
    so an output element a kernel forgot to write shows up as NaN (as fla's test suite does)."""
    empty, empty_like = torch.empty, torch.empty_like

    def poison(t):
        return t.fill_(float("nan")) if t.is_floating_point() else t

    torch.empty = lambda *a, **kw: poison(empty(*a, **kw))
    torch.empty_like = lambda *a, **kw: poison(empty_like(*a, **kw))
    try:
        yield
    finally:
        torch.empty, torch.empty_like = empty, empty_like


def one_config(configs: list) -> object:
    """The config an autotuner limited to one should keep: the fewest pipeline stages (the least
    shared memory), 4 warps where the list offers them (else the nearest count), then the first in
    the list's own order."""
    fewest = min(c.num_stages for c in configs)
    staged = [c for c in configs if c.num_stages == fewest]
    nearest = min(abs(c.num_warps - 4) for c in staged)
    return next(c for c in staged if abs(c.num_warps - 4) == nearest)


def _unwrap(obj, cls):
    """Follow ``.fn`` (triton.heuristics / autotune wrappers) until an instance of ``cls``."""
    for _ in range(6):
        if isinstance(obj, cls):
            return obj
        obj = getattr(obj, "fn", None)
        if obj is None:
            return None
    return None


def _find(modules, cls) -> list:
    """Every distinct instance of ``cls`` reachable from the modules' globals (through wrappers)."""
    found = {}
    for module in modules:
        for obj in vars(module).values():
            x = _unwrap(obj, cls)
            if x is not None:
                found[id(x)] = x
    return list(found.values())


def find_autotuners(*modules) -> list:
    """Every ``triton.runtime.Autotuner`` of the modules (under any ``triton.heuristics`` wrapper)."""
    from triton.runtime.autotuner import Autotuner

    return _find(modules, Autotuner)


def find_jit_functions(*modules) -> list:
    """Every ``triton.JITFunction`` of the modules (the kernels under any autotune wrapper)."""
    from triton.runtime.jit import JITFunction

    return _find(modules, JITFunction)


def n_compiled(jit_functions) -> int | None:
    """Kernels compiled so far by these JIT functions (None where Triton keeps them elsewhere)."""
    try:
        return sum(len(cache[0]) for fn in jit_functions for cache in fn.device_caches.values())
    except Exception:
        return None


@contextlib.contextmanager
def fla_one_config():
    """Within the block, every autotuned fla-core kernel imported so far runs one config
    (:func:`one_config` of its list) instead of compiling and timing its whole list.

    For correctness comparisons with fla, where its speed does not matter: fla 0.6.0 tunes each
    kernel over up to 48 configs, and the first call of its ``chunk_gla`` forward and backward
    compiles them all (minutes on an H200). The ops chunkstate compares with (``chunk_h``,
    ``gla``, ``simple_gla``) are imported first, where fla is installed; without fla nothing
    changes. Yields how many autotuners were limited; their lists are restored on exit, and
    nothing chosen inside is cached (a single config is never timed)."""
    import importlib
    import sys

    for name in ("fla.ops.common.chunk_h", "fla.ops.gla", "fla.ops.simple_gla"):
        try:
            importlib.import_module(name)
        except Exception:  # not installed, or fails to import on this machine
            pass
    fla_modules = [m for name, m in list(sys.modules.items())
                   if m is not None and (name == "fla" or name.startswith("fla."))]
    saved = [(tuner, tuner.configs) for tuner in find_autotuners(*fla_modules) if len(tuner.configs) > 1]
    try:
        for tuner, configs in saved:
            tuner.configs = [one_config(configs)]
        yield len(saved)
    finally:
        for tuner, configs in saved:
            tuner.configs = configs


def state_tolerance(dtype: torch.dtype) -> float:
    """Bound on ‖h − h_ref‖/‖h_ref‖ for states a kernel computes from ``dtype`` inputs.

    fp32: the interpreter's ``tl.dot`` is exact fp32 (rounding only: 1e-5); a GPU's ``tl.dot`` on
    fp32 runs in tf32 (10 mantissa bits, each input off by up to 2^-10 relative): 5e-3.
    fp16 (inputs and stored states; products exact, sums in fp32): 5e-3. bf16 (GPU only): 2e-2.
    """
    if dtype == torch.float32:
        return 1e-5 if INTERPRET else 5e-3
    if dtype == torch.float16:
        return 5e-3
    if dtype == torch.bfloat16:
        return 2e-2
    raise TypeError(f"dtype must be float32, float16 or bfloat16, got {dtype}")
