"""Host-side offsets of packed batches and piece plans, cached so a repeated call reads nothing
back from the device.

Sizing the outputs of a packed batch needs its sequence lengths on the host, and reading a CUDA
tensor (``.tolist()``, ``int(t[-1])``, or ``torch.tensor(list, device="cuda")`` from pageable
memory) waits for every kernel queued before it. One such wait per call leaves the GPU idle while
Python validates, plans and launches the next call: for a kernel of a few hundred microseconds
that idle time is of the same size. fla does the same (its ``tensor_cache``).

Two caches, both small, both safe to use from several threads (one lock), and keyed so a stale
answer cannot come back:

* ``host_offsets(cu)``: ``cu.tolist()``. For a CUDA tensor it is cached per tensor *object*
  (``cached_host_offsets``),
  checked by a weak reference to it, its storage address and its version counter (which every
  in-place torch op bumps); a write that bypasses the version counter (``cu.data``, a raw kernel)
  is not seen. A CPU tensor is read every time: that costs no device wait, and it sees writes
  through numpy too.
* ``on_device(values, dtype, device)``: an int tensor made from a host tuple, per
  (values, dtype, device). Kernels only read these tensors; callers must not write to them.

What follows from the offsets (the lengths, the split slots: ``packed_splits``; the checks:
``_validate.offsets_checked``) is cached by the values too, so a repeated call of many sequences
walks them in Python no more.

The kernels read their offsets from ``on_device`` copies of the very values that were validated
(``_validate.cu_seqlens``), never from the caller's tensor: whatever happens to that tensor, a
kernel cannot index outside its buffers.
"""
from __future__ import annotations

import functools
import inspect
import threading
import weakref
from collections import OrderedDict

import torch

MAX_ENTRIES = 64

_lock = threading.Lock()  # guards both caches
_host_cache: OrderedDict[int, tuple] = OrderedDict()  # id(cu) -> (weakref, data_ptr, version, host tuple)
_device_cache: OrderedDict[tuple, torch.Tensor] = OrderedDict()  # (values, dtype, device) -> tensor


def _remember(cache: OrderedDict, key, value) -> None:
    """Put ``key`` last (most recent) and drop the oldest entries beyond ``MAX_ENTRIES``; hold ``_lock``."""
    cache[key] = value
    cache.move_to_end(key)
    while len(cache) > MAX_ENTRIES:
        cache.popitem(last=False)


def host_offsets(cu: torch.Tensor) -> tuple[int, ...]:
    """``tuple(cu.tolist())``: read every time from a CPU tensor, through ``cached_host_offsets``
    from any other."""
    if cu.device.type == "cpu":
        return tuple(cu.tolist())
    return cached_host_offsets(cu)


def cached_host_offsets(cu: torch.Tensor) -> tuple[int, ...]:
    """``tuple(cu.tolist())``, read only the first time this tensor is seen (and again after it
    changes in place)."""
    try:
        version = cu._version
    except RuntimeError:  # inference-mode tensors keep no version counter: never cache them
        return tuple(cu.tolist())
    with _lock:
        entry = _host_cache.get(id(cu))
        if entry is not None and entry[0]() is cu and entry[1:3] == (cu.data_ptr(), version):
            _host_cache.move_to_end(id(cu))
            return entry[3]
    host = tuple(cu.tolist())  # the device wait, outside the lock
    with _lock:
        _remember(_host_cache, id(cu), (weakref.ref(cu), cu.data_ptr(), version, host))
    return host


def on_device(values, dtype: torch.dtype, device) -> torch.Tensor:
    """``torch.tensor(values, dtype=dtype, device=device)``, made once per distinct input."""
    key = (tuple(values), dtype, str(torch.device(device)))
    with _lock:
        t = _device_cache.get(key)
        if t is not None:
            _device_cache.move_to_end(key)
            return t
    t = torch.tensor(key[0], dtype=dtype, device=device)
    with _lock:
        _remember(_device_cache, key, t)
    return t


def split_offsets(lengths, split_size: int) -> tuple[int, ...]:
    """Where each sequence's split slots start, [N + 1]: sequence n of length L owns
    ``ceil(L / split_size)`` slots (none when empty). The host twin of
    ``gates.prepare_chunk_offsets``."""
    out = [0]
    for L in lengths:
        out.append(out[-1] + -(-L // split_size))
    return tuple(out)


def lengths(cu_host) -> list[int]:
    """Sequence lengths from host offsets."""
    return [b - a for a, b in zip(cu_host, cu_host[1:])]


def split_slots(lengths, split_size: int, device) -> tuple[int, torch.Tensor]:
    """The number of split slots NS and each sequence's first slot, [N + 1] int64 on ``device``
    (made once per distinct plan)."""
    offsets = split_offsets(lengths, split_size)
    return offsets[-1], on_device(offsets, torch.int64, device)


def splits(cu_host, B: int, T: int, split_size: int, device) -> tuple[tuple[int, ...], int, int, torch.Tensor | None]:
    """What a kernel wrapper needs to size and launch, from validated host offsets ``cu_host`` (None
    for a dense batch): the sequence lengths, the longest of them (0 for none), NS, and each packed
    sequence's first split slot (None for a dense batch, whose slots follow from T)."""
    if cu_host is None:
        return (T,) * B, T if B else 0, -(-T // split_size), None
    return packed_splits(tuple(cu_host), split_size, device)


@functools.lru_cache(maxsize=MAX_ENTRIES)
def packed_splits(cu_host: tuple[int, ...], split_size: int, device) -> tuple[tuple[int, ...], int, int, torch.Tensor]:
    """``splits`` of a packed batch, made once per (offsets, split size, device): by the values, so
    never stale. A repeated call of N sequences would otherwise walk them in Python several times,
    ~8 µs at N = 64 on this project's CPU machine, several times that on an H200's slower host
    (figures/README.md, session 23)."""
    lens = tuple(lengths(cu_host))
    NS, first_slots = split_slots(lens, split_size, device)
    return lens, max(lens, default=0), NS, first_slots


# The current CUDA device's index and stream, as ``torch.cuda.current_device()`` and
# ``torch.cuda.current_stream(index).cuda_stream`` give them, without their Python layers (the lazy
# CUDA initialisation's check, a ``Stream`` object): a call asks for them up to four times, and on an
# H200's host those layers took ~2 and ~13 µs a time under cProfile (figures/README.md, session 23). Only asked once
# CUDA is in use (a CUDA tensor exists, so it is initialised). A CPU-only torch has neither function.
_cuda_device = getattr(torch._C, "_cuda_getDevice", None)
_cuda_raw_stream = getattr(torch._C, "_cuda_getCurrentRawStream", None)


def current_device() -> int:
    """The current CUDA device's index (CUDA already initialised)."""
    return _cuda_device() if _cuda_device is not None else torch.cuda.current_device()


def current_raw_stream(index: int) -> int:
    """The address of the current CUDA stream of device ``index`` (CUDA already initialised)."""
    if _cuda_raw_stream is not None:
        return _cuda_raw_stream(index)
    return torch.cuda.current_stream(index).cuda_stream


def on_inputs_device(fn):
    """Run ``fn`` with the CUDA device of its first argument made current.

    Triton launches (and its autotuner times) on the *current* CUDA device, whatever device the
    tensors are on: a call with tensors on ``cuda:1`` while ``cuda:0`` is current would run on the
    wrong GPU (an illegal address, or a slow read over the link). fla's ops switch devices the same
    way (its ``input_guard``). A CPU tensor costs one attribute read (0.2 µs with the wrapper's call,
    measured on CPU); a CUDA tensor on the current device two more calls, its device index and the
    current device's.
    """
    name = next(iter(inspect.signature(fn).parameters))  # k, or q: what the wrapper checks first

    @functools.wraps(fn)
    def wrapper(*args, **kwargs):
        first = args[0] if args else kwargs.get(name)
        if isinstance(first, torch.Tensor) and first.is_cuda:
            index = first.get_device()
            if index != current_device():
                with torch.cuda.device(index):
                    return fn(*args, **kwargs)
        return fn(*args, **kwargs)
    return wrapper


def cdiv(a: int, b: int) -> int:
    """``ceil(a / b)`` for ints. ``triton.cdiv`` does the same but, being a constexpr function since
    Triton 3.5, costs ~3 µs a call: wrappers that launch several kernels call this instead."""
    return -(-a // b)


def next_power_of_2(n: int) -> int:
    """The smallest power of two >= n for n >= 1 (0 for 0), as ``triton.next_power_of_2``."""
    return 0 if n <= 0 else 1 << (n - 1).bit_length()


def clear() -> None:
    """Forget everything (tests; or after writing into an offsets tensor behind torch's back)."""
    with _lock:
        _host_cache.clear()
        _device_cache.clear()
    packed_splits.cache_clear()
