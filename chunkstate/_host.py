"""Host-side offsets of packed batches and piece plans, cached so a repeated call reads nothing
back from the device.

Sizing the outputs of a packed batch needs its sequence lengths on the host, and reading a CUDA
tensor (``.tolist()``, ``int(t[-1])``, or ``torch.tensor(list, device="cuda")`` from pageable
memory) waits for every kernel queued before it. One such wait per call leaves the GPU idle while
Python validates, plans and launches the next call: for a kernel of a few hundred microseconds
that idle time is of the same size. fla does the same (its ``tensor_cache``).

Two caches, both small and both keyed so a stale answer cannot come back:

* ``host_offsets(cu)``: ``cu.tolist()`` per tensor *object*, checked by a weak reference to it,
  its storage address and its version counter (which every in-place torch op bumps). Writes that
  bypass torch's version counter (a raw kernel writing into ``cu``) are not seen.
* ``on_device(values, dtype, device)``: an int tensor made from a host tuple, per
  (values, dtype, device). Kernels only read these tensors; callers must not write to them.
"""
from __future__ import annotations

import weakref
from collections import OrderedDict

import torch

MAX_ENTRIES = 64

_host_cache: OrderedDict[int, tuple] = OrderedDict()  # id(cu) -> (weakref, data_ptr, version, host tuple)
_device_cache: OrderedDict[tuple, torch.Tensor] = OrderedDict()  # (values, dtype, device) -> tensor


def _remember(cache: OrderedDict, key, value) -> None:
    cache[key] = value
    cache.move_to_end(key)
    while len(cache) > MAX_ENTRIES:
        cache.popitem(last=False)


def host_offsets(cu: torch.Tensor) -> tuple[int, ...]:
    """``tuple(cu.tolist())``, read from the device only the first time this tensor is seen (and
    again after it changes in place)."""
    try:
        version = cu._version
    except RuntimeError:  # inference-mode tensors keep no version counter: never cache them
        return tuple(cu.tolist())
    entry = _host_cache.get(id(cu))
    if entry is not None and entry[0]() is cu and entry[1:3] == (cu.data_ptr(), version):
        _host_cache.move_to_end(id(cu))
        return entry[3]
    host = tuple(cu.tolist())
    _remember(_host_cache, id(cu), (weakref.ref(cu), cu.data_ptr(), version, host))
    return host


def on_device(values, dtype: torch.dtype, device) -> torch.Tensor:
    """``torch.tensor(values, dtype=dtype, device=device)``, made once per distinct input."""
    key = (tuple(values), dtype, str(torch.device(device)))
    t = _device_cache.get(key)
    if t is None:
        t = torch.tensor(key[0], dtype=dtype, device=device)
        _remember(_device_cache, key, t)
    else:
        _device_cache.move_to_end(key)
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


def splits(cu_seqlens, B: int, T: int, split_size: int, device) -> tuple[list[int], int, torch.Tensor | None]:
    """What a kernel wrapper needs to size and launch: the sequence lengths, NS, and each packed
    sequence's first split slot (None for a dense batch, whose slots follow from T)."""
    if cu_seqlens is None:
        return [T] * B, -(-T // split_size), None
    lens = lengths(host_offsets(cu_seqlens))
    NS, first_slots = split_slots(lens, split_size, device)
    return lens, NS, first_slots


def cdiv(a: int, b: int) -> int:
    """``ceil(a / b)`` for ints. ``triton.cdiv`` does the same but, being a constexpr function since
    Triton 3.5, costs ~3 µs a call: wrappers that launch several kernels call this instead."""
    return -(-a // b)


def next_power_of_2(n: int) -> int:
    """The smallest power of two >= n for n >= 1 (0 for 0), as ``triton.next_power_of_2``."""
    return 0 if n <= 0 else 1 << (n - 1).bit_length()


def clear() -> None:
    """Forget everything (tests; or after writing into an offsets tensor behind torch's back)."""
    _host_cache.clear()
    _device_cache.clear()
