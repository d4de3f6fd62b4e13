"""One launch path for both state kernels: the sizes of a call, checked once, where each sequence's
states go, and the choice between the autotuner and an explicit config.

``forward.py`` and ``backward.py`` validate their own tensors, then both do the same three things:

1. ``problem(...)``: the batch, chunk and split sizes and the packed-batch offsets, checked, with
   the sequence lengths, the number of state slots ``NS`` and each packed sequence's first slot;
2. ``check_config(...)``: an explicit ``triton.Config`` is one the kernel can run;
3. ``run(...)``: launch the kernel over a flat grid of (sequence, head, K tile, V tile) programs,
   autotuned (``tuning``) or with that config.

``pieces`` builds on this module, never the other way round.
"""
from __future__ import annotations

import threading
from dataclasses import dataclass

import torch
import triton

from . import _host, _validate, tuning

# One kernel launch at a time from this process's threads. Triton's autotuner keeps the arguments of
# the call in flight on itself (``Autotuner.run`` sets ``self.nargs`` and resets it to None at the
# end), so two threads launching one autotuned kernel at once break each other (seen on the H200:
# "'NoneType' object is not a mapping"); the interpreter likewise keeps per-launch state in module
# globals. The lock is held for the host side of a launch only (the GPU runs it asynchronously).
_LAUNCH_LOCK = threading.RLock()


def serialised():
    """The context every launch of chunkstate's kernels runs in: holds ``_LAUNCH_LOCK``."""
    return _LAUNCH_LOCK


@dataclass(frozen=True)
class Problem:
    """The sizes of one call, checked: B × T tokens (packed: B = 1 and N sequences of ``lengths``),
    H heads, a [K, V] state, chunks of BT and splits of BS tokens, ``NS`` state slots stored."""
    B: int
    T: int
    H: int
    K: int
    V: int
    N: int
    BT: int
    BS: int
    lengths: tuple[int, ...]
    NS: int
    cu_seqlens: torch.Tensor | None  # [N + 1] the validated offsets the kernels read (packed batches)
    split_offsets: torch.Tensor | None  # [N + 1] int64 first state slot of each packed sequence
    state_v_first: bool

    @property
    def state(self) -> tuple[int, int]:
        """The shape of one state: (K, V), or (V, K) with ``state_v_first``."""
        return (self.V, self.K) if self.state_v_first else (self.K, self.V)


def problem(like: torch.Tensor, B: int, T: int, H: int, K: int, V: int, cu_seqlens, chunk_size, split_size,
            state_v_first: bool) -> Problem:
    """Check the sizes and offsets shared by both kernels; ``like`` fixes the device."""
    BT, BS = _validate.sizes(chunk_size, split_size)
    cu_seqlens, cu_host, N = _validate.cu_seqlens(cu_seqlens, B, T, like=like)
    # host offsets are cached per tensor: a repeated packed call waits for nothing on the device
    lengths, NS, split_offsets = _host.splits(cu_host, B, T, BS, like.device)
    return Problem(B, T, H, K, V, N, BT, BS, tuple(lengths), NS, cu_seqlens, split_offsets, state_v_first)


def check_config(config, optional: tuple[str, ...]) -> None:
    """An explicit config must be a ``triton.Config`` naming BK and BV (powers of two from 16 to 128)
    and, of the kernel's other config keys, only ``optional`` ones."""
    if config is None:
        return
    if not isinstance(config, triton.Config):
        raise TypeError(f"config must be a triton.Config (or None to autotune), got {type(config).__name__}")
    unknown = sorted(set(config.kwargs) - {"BK", "BV", *optional})
    if unknown:
        raise ValueError(f"config has keys {unknown} this kernel does not take; it takes BK, BV"
                         + "".join(f", {name}" for name in optional))
    for name in ("BK", "BV"):
        tile = config.kwargs.get(name)
        if isinstance(tile, bool) or not isinstance(tile, int) or tile not in (16, 32, 64, 128):
            raise ValueError(f"config's {name} must be 16, 32, 64 or 128 (a tile width), got {tile!r}")


def run(tuned, kernel, args: dict, *, N: int, H: int, K: int, V: int, config, tma_inputs: dict) -> None:
    """Launch ``kernel`` (``tuned``: its autotuner) with ``args`` over N·H (sequence, head) pairs,
    each cut into [BK, BV] state tiles; ``config``: run that ``triton.Config`` instead of
    autotuning. ``tma_inputs``: the tensors the kernel may read through TMA descriptors, by name
    (an explicit ``USE_TMA`` config is refused unless all of them can be)."""
    if N * H * K * V == 0:  # no state element to compute
        return
    tma_ok = tuning.tma_usable(*tma_inputs.values())
    if config is not None and config.kwargs.get("USE_TMA", False) and not tma_ok:
        names = ", ".join(name for name, x in tma_inputs.items() if x is not None and not tuning.tma_usable(x))
        raise ValueError(
            f"config asks for TMA loads (USE_TMA=True), but {names} cannot be read through tensor "
            "descriptors here: that needs a GPU of compute capability 9.0 or newer (or the interpreter), "
            "Triton's tl.make_tensor_descriptor, and contiguous tensors whose start and last dimension "
            "(size x element bytes) are multiples of 16 bytes; pass a config with USE_TMA=False")
    if tma_ok and any(x is not None and x.is_cuda for x in tma_inputs.values()):
        tuning.ensure_allocator()
    # SMEM: the shared memory a block may use on this GPU (under a cap, if set), which tuning.prune
    # fits the candidates to; in the autotune key, so each device kind and cap is tuned apart
    smem = tuning.device_limits(next(iter(tma_inputs.values())).device).smem  # k or q: on the kernels' device
    args = dict(args, OCCUPANCY=tuning.launch_bucket(N, H, K, V), TMA_OK=int(tma_ok), SMEM=smem)

    def grid(meta):
        return (_host.cdiv(K, meta["BK"]) * _host.cdiv(V, meta["BV"]) * N * H,)

    with serialised():
        if config is None:
            chosen = tuned_config(tuned, args)
            if chosen is None:  # a new key: the autotuner prunes, compiles and times its candidates
                tuned[grid](**args)
            else:  # tuned before: launch its choice directly (Autotuner.run would only look it up)
                tuned.best_config = chosen
                kernel[grid](**args, **chosen.all_kwargs())
        else:
            kernel[grid](**{**args, **config.kwargs}, num_warps=config.num_warps, num_stages=config.num_stages)


def autotune_key(tuned, args: dict) -> tuple:
    """The key under which Triton's autotuner ``tuned`` caches its choice for a launch with keyword
    arguments ``args``, built as ``Autotuner.run`` builds it: the values of its ``key`` arguments,
    then the dtype of every tensor argument, in the order given."""
    names = _arg_names(tuned)
    key = [args[name] for name in tuned.keys if name in args]
    key += [str(x.dtype) for name, x in args.items() if name in names and hasattr(x, "dtype")]
    return tuple(key)


def tuned_config(tuned, args: dict):
    """The config ``tuned`` chose earlier for this launch's key, or None (a new key, or one config
    only). A repeated call then skips ``Autotuner.run``, which rebuilds the key and re-binds every
    argument before launching the same config: ~20 µs of host time a launch on an H200's host,
    which decides the time of calls of under ~0.1 ms of GPU work. Should Triton ever build its key
    differently, nothing is found here and every call goes through ``Autotuner.run`` as before."""
    if len(tuned.configs) < 2:
        return None
    return tuned.cache.get(autotune_key(tuned, args))


_ARG_NAMES: dict[int, frozenset] = {}


def _arg_names(tuned) -> frozenset:
    names = _ARG_NAMES.get(id(tuned))
    if names is None:
        names = _ARG_NAMES[id(tuned)] = frozenset(tuned.arg_names)
    return names
