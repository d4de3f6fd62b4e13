"""Chapter 04 exercises: where an element lives, and a kernel that keeps only the final state.

1. ``token_offset(b, t, i_h, d, T, H, D) -> int``: the offset, in elements, of ``x[b, t, i_h, d]``
   in a contiguous time-major tensor ``x`` of shape [B, T, H, D] — the arithmetic every pointer
   in the chapter's kernel is built from.
2. ``final_state(k, v, chunk_size) -> ht``: a Triton kernel (and its launcher) that walks the chunks
   of each (sequence, head) like the chapter's kernel but stores only the state after the last
   token, ``ht`` [B, H, K, V] in fp32. Inputs: ``k`` [B, T, H, K], ``v`` [B, T, H, V] (fp32,
   contiguous, on ``chunkstate.DEVICE``), K and V powers of two >= 16, ``chunk_size`` a power of
   two >= 16. Checked against :func:`chunkstate.reference.chunked_states`.

The chapters compare a kernel's states with the float64 reference within
``chunkstate.testing.state_tolerance(dtype)``.
"""
from __future__ import annotations

import random

import numpy as np
import torch
import triton
import triton.language as tl

from ..env import DEVICE
from ..reference import chunked_states
from ..testing import check_close, nan_poisoned_empty, state_tolerance


# ---- 1. offsets -------------------------------------------------------------------------------

def token_offset(b: int, t: int, i_h: int, d: int, T: int, H: int, D: int) -> int:
    """The shipped solution: ``x[b, t, i_h, d]`` of a contiguous [B, T, H, D] tensor sits at
    ``((b·T + t)·H + i_h)·D + d`` elements from ``x[0, 0, 0, 0]`` (strides T·H·D, H·D, D, 1)."""
    return ((b * T + t) * H + i_h) * D + d


def check_token_offset(fn=None) -> None:
    """Test ``fn(b, t, i_h, d, T, H, D)`` (default: the shipped solution) against where PyTorch
    itself puts each element of fresh tensors with odd shapes.

    Raises ``AssertionError`` naming the shape and index that is wrong; an exception raised inside
    ``fn`` (such as ``NotImplementedError`` from the stub) propagates unchanged.
    """
    fn = token_offset if fn is None else fn
    name = getattr(fn, "__name__", "your function")
    shapes = [(1, 1, 1, 1), (2, 5, 3, 4), (3, 7, 2, 16), (2, 100, 4, 33)]
    for B, T, H, D in shapes:
        x = torch.arange(B * T * H * D).view(B, T, H, D)  # each element holds its own offset
        indices = [(B - 1, T - 1, H - 1, D - 1), (0, 0, 0, 0)]
        indices += [tuple(random.randrange(n) for n in (B, T, H, D)) for _ in range(50)]
        for b, t, i_h, d in indices:
            got = fn(b, t, i_h, d, T, H, D)
            want = int(x[b, t, i_h, d])
            if got != want:
                raise AssertionError(f"{name}: x[{b}, {t}, {i_h}, {d}] of a [B={B}, T={T}, H={H}, D={D}] "
                                     f"tensor is at offset {want}, got {got}")
    print(f"{name} agrees with PyTorch's layout on {len(shapes)} shapes")


# ---- 2. a kernel that stores only the final state ---------------------------------------------

@triton.jit
def final_state_kernel(
    k,  # [B, T, H, K]
    v,  # [B, T, H, V]
    ht,  # [B, H, K, V] fp32  out: the state after the last token
    T,
    H: tl.constexpr,
    K: tl.constexpr,
    V: tl.constexpr,
    BT: tl.constexpr,
):
    i_nh = tl.program_id(0).to(tl.int64)  # one program per (sequence, head)
    i_b, i_h = i_nh // H, i_nh % H  # sequence i_b (in a dense batch, batch row i_b), head i_h
    o_t = tl.arange(0, BT)  # [BT]
    o_k = tl.arange(0, K)  # [K]
    o_v = tl.arange(0, V)  # [V]
    p_k0 = k + (i_b * T * H + i_h) * K  # token t of this (sequence, head): p_k0 + t·H·K
    p_v0 = v + (i_b * T * H + i_h) * V
    b_h = tl.zeros([K, V], dtype=tl.float32)  # [K, V]
    for i_t in range(0, tl.cdiv(T, BT)):
        rows = tl.cast(i_t, tl.int64) * BT + o_t  # [BT]
        m_t = rows < T
        b_k = tl.load(p_k0 + rows[None, :] * (H * K) + o_k[:, None], mask=m_t[None, :], other=0.0)  # [K, BT]
        b_v = tl.load(p_v0 + rows[:, None] * (H * V) + o_v[None, :], mask=m_t[:, None], other=0.0)  # [BT, V]
        b_h = tl.dot(b_k, b_v, b_h)
    tl.store(ht + i_nh * K * V + o_k[:, None] * V + o_v[None, :], b_h)


def final_state(k: torch.Tensor, v: torch.Tensor, chunk_size: int = 64) -> torch.Tensor:
    """The shipped solution: ``ht`` [B, H, K, V] fp32, the state after each sequence's last token."""
    B, T, H, K = k.shape
    V = v.shape[-1]
    ht = torch.empty(B, H, K, V, dtype=torch.float32, device=k.device)
    final_state_kernel[(B * H,)](k.contiguous(), v.contiguous(), ht, T, H=H, K=K, V=V, BT=chunk_size)
    return ht


def _with_guard(shape, guard: int, fill: float):
    """A contiguous fresh ``torch.randn(shape)`` on DEVICE followed in memory by ``guard`` elements
    set to ``fill``: what a load past the end of the tensor reads. Returns (tensor, guard)."""
    n = 1
    for d in shape:
        n *= d
    flat = torch.empty(n + guard, device=DEVICE)
    x = flat[:n].view(shape)
    x.copy_(torch.randn(shape, device=DEVICE))
    tail = flat[n:]
    tail.fill_(fill)
    return x, tail


def _same(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Equal, NaN in the same places counting as equal."""
    return torch.equal(a.isnan(), b.isnan()) and torch.equal(a.nan_to_num(0.0), b.nan_to_num(0.0))


def _call(fn, *args):
    """Run the reader's function with outputs NaN-filled. A kernel that reads past the end of the
    sequence multiplies whatever lies there: numpy's overflow warnings under the interpreter say
    nothing the checker's message does not, so they are silenced here."""
    with nan_poisoned_empty(), np.errstate(over="ignore", invalid="ignore"):
        return fn(*args)


def check_final_state(fn=None) -> None:
    """Test ``fn(k, v, chunk_size) -> ht`` (default: the shipped solution) on fresh random inputs:
    one token, a ragged last chunk, an exact number of chunks, K != V.

    Outputs are allocated NaN-filled (``torch.empty`` is poisoned during the call), so an element
    the kernel never writes fails. The memory right after ``k`` and ``v`` holds NaN; when the check
    fails and the result changes once that memory holds zeros instead, the kernel read past the end
    of the sequence (the ragged last chunk's loads are not masked), and the message says so.
    Raises ``AssertionError`` naming the shape; an exception raised inside ``fn`` propagates
    unchanged.
    """
    fn = final_state if fn is None else fn
    name = getattr(fn, "__name__", "your function")
    cases = [(1, 1, 1, 16, 16, 16), (2, 50, 2, 16, 32, 16), (1, 64, 3, 32, 16, 32), (2, 37, 1, 32, 32, 16)]
    for B, T, H, K, V, BT in cases:
        guard = BT * H * max(K, V)  # more than an unmasked last chunk can reach past the end
        k, k_tail = _with_guard((B, T, H, K), guard, float("nan"))
        v, v_tail = _with_guard((B, T, H, V), guard, float("nan"))
        ht = _call(fn, k, v, BT)
        if not isinstance(ht, torch.Tensor):
            raise AssertionError(f"{name} must return a tensor ht, got {type(ht).__name__}")
        _, ht_ref = chunked_states(k, v, chunk_size=BT)
        what = f"{name}: ht (B={B}, T={T}, H={H}, K={K}, V={V}, BT={BT})"
        try:
            check_close(ht, ht_ref, what, tol=state_tolerance(torch.float32))
        except AssertionError as e:
            k_tail.zero_(), v_tail.zero_()
            if ht.shape == ht_ref.shape and not _same(ht, _call(fn, k, v, BT)):
                raise AssertionError(
                    f"{what}: the result depends on the memory after the last token of k and v — the kernel "
                    f"reads past the end of the sequence. Mask the loads of the last, ragged chunk"
                    + (f" (T = {T} is not a multiple of BT = {BT})" if T % BT else "")
                    + ": mask=rows < T, other=0.0") from None
            raise
    print(f"{name} agrees with the chunked reference on {len(cases)} shapes")
