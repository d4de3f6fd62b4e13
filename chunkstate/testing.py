"""Checks used by the tests, the notebooks and the exercises: they raise, never only print."""
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


def check_close(out: torch.Tensor, ref: torch.Tensor, what: str, tol: float = 1e-6) -> float:
    """Raise ``AssertionError`` naming ``what`` unless rel_err(out, ref) < tol; return the error."""
    if tuple(out.shape) != tuple(ref.shape):
        raise AssertionError(f"{what}: shape {tuple(out.shape)} != reference shape {tuple(ref.shape)}")
    if torch.isnan(out).any() and not torch.isnan(ref).any():
        bad = torch.isnan(out).nonzero()[:3].tolist()
        raise AssertionError(f"{what}: NaN in the result (e.g. at {bad}) — an element never written?")
    err = rel_err(out, ref)
    if not err < tol:
        raise AssertionError(f"{what}: relative error {err:.3e} is not below {tol:.1e}")
    return err


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
