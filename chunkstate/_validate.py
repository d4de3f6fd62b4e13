"""Input checks shared by the kernels' wrappers: every bad argument gets a clear error naming it.

The wrappers never hand Triton something it would read wrongly: shapes, heads, dtypes, devices,
chunk and split sizes and packed-batch offsets are checked here, and inputs are made contiguous.
"""
from __future__ import annotations

import functools
import math
import numbers

import numpy as np
import torch

from . import _host
from .env import INTERPRET, check_interpreter


def tensor(name: str, x, shape: tuple | None = None, *, floating: bool = True, like: torch.Tensor | None = None,
           contiguous: bool = True):
    """Check one tensor argument and return it contiguous (a copy where it is not), or as it is
    with ``contiguous=False``: for a tensor no kernel reads, only its shape and dtype.

    ``shape``: expected sizes, ``None`` entries match anything. ``like``: the tensor that fixes the
    device (the first argument of the call).
    """
    if not isinstance(x, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor, got {type(x).__name__}")
    if floating and not x.is_floating_point():
        raise TypeError(f"{name} must be a floating-point tensor, got dtype {x.dtype}")
    if shape is not None:
        sizes = x.shape
        ok = len(sizes) == len(shape)
        if ok:
            for s, d in zip(shape, sizes):
                if s is not None and s != d:
                    ok = False
                    break
        if not ok:
            want = "[" + ", ".join("*" if s is None else str(s) for s in shape) + "]"
            raise ValueError(f"{name} must have shape {want}, got {list(x.shape)}")
    if like is not None and x.device != like.device:
        raise ValueError(f"{name} is on {x.device} but the other inputs are on {like.device}")
    return x.contiguous() if contiguous else x


def sequence_tensor(name: str, x, dims: str = "B, T, H, K", **kw):
    """A tensor of shape [B, T, heads, D] (``dims`` names them in the message), checked and returned
    as ``tensor`` does (``kw``: its options): the argument that fixes the sizes of the others."""
    x = tensor(name, x, **kw)
    if x.dim() != 4:
        raise ValueError(f"{name} must have shape [{dims}], got {list(x.shape)}")
    return x


def query_heads(HQ: int, H: int) -> None:
    """GQA: q has HQ heads, a positive multiple of k's H (HQ / H query heads per state head); none
    when H = 0."""
    if (HQ != 0) if H == 0 else (HQ == 0 or HQ % H):
        raise ValueError(f"q must have a positive multiple of k's H={H} heads (GQA: HQ / H query heads per "
                         f"state head), got HQ={HQ}")


KERNEL_DTYPES = (torch.float16, torch.bfloat16, torch.float32)


def kernel_input(name: str, x: torch.Tensor) -> None:
    """The tensor a kernel computes in: fp16, bf16 or fp32 (``tl.dot`` takes no fp64), on a
    CUDA GPU when compiled, on the CPU under Triton's interpreter (and there not bf16, which the
    interpreter computes wrongly)."""
    if x.dtype not in KERNEL_DTYPES:
        raise TypeError(f"{name} must be fp16, bf16 or fp32 (what the kernels compute in), got {x.dtype}")
    if INTERPRET and x.dtype == torch.bfloat16:
        raise TypeError(f"{name} is bf16, which Triton's interpreter (TRITON_INTERPRET=1, how kernels run "
                        "without a CUDA GPU) computes wrongly: its bf16 arithmetic and tl.dot treat the bits "
                        "as integers, off by ~1e10. Pass fp32 or fp16 here; bf16 runs on a GPU")
    if INTERPRET and x.device.type != "cpu":
        raise ValueError(f"{name} is on {x.device}, but Triton runs in interpreter mode "
                         "(TRITON_INTERPRET=1): pass CPU tensors")
    check_interpreter()
    if not INTERPRET and x.device.type != "cuda":
        raise ValueError(f"{name} is on {x.device}, but chunkstate's kernels run compiled on a CUDA GPU "
                         "here: pass CUDA tensors (or set TRITON_INTERPRET=1 before importing chunkstate)")


MAX_SPLIT = 2 ** 31 - 1  # the kernels take BS as a 32-bit constant


def sizes(chunk_size, split_size) -> tuple[int, int]:
    """(BT, BS): chunk_size a power of two in [16, 256]; split_size a positive multiple of it,
    below 2^31."""
    if isinstance(chunk_size, bool) or not isinstance(chunk_size, numbers.Integral):
        raise TypeError(f"chunk_size must be an int, got {type(chunk_size).__name__}")
    chunk_size = int(chunk_size)
    if chunk_size < 16 or chunk_size > 256 or chunk_size & (chunk_size - 1):
        raise ValueError(f"chunk_size must be a power of two in [16, 256], got {chunk_size}")
    if split_size is None:
        return chunk_size, chunk_size
    if isinstance(split_size, bool) or not isinstance(split_size, numbers.Integral):
        raise TypeError(f"split_size must be an int or None, got {type(split_size).__name__}")
    split_size = int(split_size)
    if split_size <= 0 or split_size % chunk_size or split_size > MAX_SPLIT:
        raise ValueError(f"split_size must be a positive multiple of chunk_size={chunk_size} below 2^31 "
                         f"(a split longer than any sequence stores one state per sequence), got {split_size}")
    return chunk_size, split_size


def cu_seqlens(cu, B: int, T: int, like: torch.Tensor):
    """Check packed-batch offsets [N+1]; return (the offsets the kernels are to read, the same
    values on the host, N), or (None, None, B) for a dense batch.

    Reads the offsets on the host, as fla does to size the outputs: for a CUDA tensor one device
    sync the first time it is seen, none on later calls with the same tensor
    (``_host.host_offsets``). The returned device tensor is made from the checked host values
    (``_host.on_device``, cached per values, in the caller's dtype), not the caller's tensor: a
    kernel reading it indexes exactly what was validated, whatever becomes of ``cu``.
    """
    if cu is None:
        return None, None, B
    if not isinstance(cu, torch.Tensor):
        raise TypeError(f"cu_seqlens must be a torch.Tensor, got {type(cu).__name__}")
    if cu.dim() != 1 or cu.dtype not in (torch.int32, torch.int64):
        raise TypeError(f"cu_seqlens must be a 1-D int32/int64 tensor, got {cu.dim()}-D {cu.dtype}")
    if cu.device != like.device:
        raise ValueError(f"cu_seqlens is on {cu.device} but the other inputs are on {like.device}")
    if cu.is_meta:
        raise ValueError("cu_seqlens is on the meta device, which holds no values: pass the offsets on a device "
                         "that does")
    if B != 1:
        raise ValueError(f"with cu_seqlens the batch size must be 1 (sequences packed along T), got B={B}")
    if cu.numel() < 2:
        raise ValueError(f"cu_seqlens must hold at least 2 offsets [0, ..., T], got {cu.numel()}")
    host = _host.host_offsets(cu)
    offsets_checked(host, T)
    return _host.on_device(host, cu.dtype, cu.device), host, len(host) - 1


# by the values: a repeated call walks no offsets (errors are not cached)
@functools.lru_cache(maxsize=_host.MAX_ENTRIES)
def offsets_checked(host: tuple[int, ...], T: int) -> bool:
    """Host offsets of a packed batch of T tokens: from 0, non-decreasing, to T (ValueError else)."""
    if host[0] != 0:
        raise ValueError(f"cu_seqlens must start at 0, got {host[0]}")
    if any(b < a for a, b in zip(host, host[1:])):
        raise ValueError("cu_seqlens must be non-decreasing")
    if host[-1] != T:
        raise ValueError(f"cu_seqlens must end at T={T}, got {host[-1]}")
    return True


def gates(B, T, H, K, V, g, g_gamma, gk, gv, like):
    """Check the four optional gates' shapes, dtypes and devices; return them contiguous."""
    if isinstance(g, torch.Tensor) and g.dim() == 4 and tuple(g.shape) == (B, T, H, K):
        # fla's chunk_gla calls its per-key gate g; here g is the scalar one, as in fla's chunk_fwd_h
        raise ValueError(f"g must have shape [{B}, {T}, {H}] (one scalar gate per token and head), got "
                         f"{list(g.shape)}: a per-key gate [B, T, H, K] (what fla's chunk_gla calls g) goes in gk=")
    g = None if g is None else tensor("g", g, (B, T, H), like=like)
    g_gamma = None if g_gamma is None else tensor("g_gamma", g_gamma, (H,), like=like)
    gk = None if gk is None else tensor("gk", gk, (B, T, H, K), like=like)
    gv = None if gv is None else tensor("gv", gv, (B, T, H, V), like=like)
    return g, g_gamma, gk, gv


FP32_MAX = float(torch.finfo(torch.float32).max)


def real(name: str, x, fp32: bool = True) -> float:
    """A real number finite in fp32 (int, float, numpy scalar; not bool, not a tensor) as a Python
    float; with ``fp32=False`` finite in float64 (for PyTorch code, not a kernel).

    Kernels take it as an fp32 scalar argument that is never specialised on its value.
    """
    if isinstance(x, bool) or not isinstance(x, numbers.Real):
        raise TypeError(f"{name} must be a real number (int or float), got {type(x).__name__}")
    x = float(x)
    if not fp32:
        if not math.isfinite(x):
            raise ValueError(f"{name} must be finite, got {x}")
        return x
    if not math.isfinite(x) or abs(x) > FP32_MAX:
        raise ValueError(f"{name} must be finite in fp32 (|{name}| <= {FP32_MAX:.4g}, the kernels take it as "
                         f"fp32), got {x}")
    return x


def flag(name: str, x) -> bool:
    """A bool argument: ``True`` or ``False`` (numpy's bool too), never a truthy string or number."""
    if isinstance(x, (bool, np.bool_)):
        return bool(x)
    raise TypeError(f"{name} must be a bool (True or False), got {x!r} ({type(x).__name__})")


def scale(x, K: int, fp32: bool = True) -> float:
    """The outputs' scale: ``K ** -0.5`` when None (1 when K = 0: every output is 0 whatever the
    scale), else ``real("scale", x, fp32)``."""
    if x is None:
        return K ** -0.5 if K > 0 else 1.0
    return real("scale", x, fp32)


def positive_int(name: str, x) -> int:
    """A positive int (numpy's too; not bool, not a float) as a Python int."""
    if isinstance(x, bool) or not isinstance(x, numbers.Integral):
        raise TypeError(f"{name} must be an int, got {type(x).__name__}")
    if x < 1:
        raise ValueError(f"{name} must be a positive int, got {x}")
    return int(x)


WARPS = (1, 2, 4, 8, 16, 32)
MIN_REGISTERS, MAX_REGISTERS = 16, 255  # what an explicit config's maxnreg may cap a thread's registers at


def config_values(config, flags: tuple[str, ...]) -> None:
    """The values of an explicit ``triton.Config`` that ``launch.check_config`` leaves to Triton: its
    ``flags`` keys (``USE_TMA``, ``NARROW_V``) bools when given, never a truthy string or number, and
    ``num_warps`` / ``num_stages`` Python ints Triton compiles (a bad one fails deep in its compiler
    on a GPU, and is ignored by the interpreter), ``maxnreg`` None or a register count ptxas can
    cap a thread at, and ``num_ctas`` 1."""
    if config is None:
        return
    for name in flags:
        if name in config.kwargs:
            flag(f"config's {name}", config.kwargs[name])
    warps = config.num_warps  # Python ints, as Triton's own configs hold (numpy's are not passed on to Triton)
    if type(warps) is not int or warps not in WARPS:
        raise ValueError(f"config's num_warps must be 1, 2, 4, 8, 16 or 32 (a power of two), got {warps!r}"
                         + python_int_hint(warps))
    stages = config.num_stages
    if type(stages) is not int or stages < 0:
        raise ValueError(f"config's num_stages must be an int >= 0, got {stages!r}" + python_int_hint(stages))
    maxnreg = getattr(config, "maxnreg", None)
    if maxnreg is not None and (type(maxnreg) is not int or not MIN_REGISTERS <= maxnreg <= MAX_REGISTERS):
        raise ValueError(f"config's maxnreg must be None or an int from {MIN_REGISTERS} to {MAX_REGISTERS} (the "
                         f"registers a thread may use), got {maxnreg!r}" + python_int_hint(maxnreg))
    if getattr(config, "num_ctas", 1) != 1:
        raise ValueError(f"config's num_ctas must be 1 (each program of these kernels is one block), got "
                         f"{config.num_ctas!r}")


def python_int_hint(x) -> str:
    """For a numpy int where Triton wants a Python one: what to pass instead."""
    return f" (a Python int: int({x!r}))" if isinstance(x, numbers.Integral) and type(x) is not int else ""
