"""One launch path for both state kernels: the sizes of a call, checked once, where each sequence's
states go, and the choice between the autotuner and an explicit config.

``forward.py`` and ``backward.py`` validate their own tensors, then both do the same three things:

1. ``problem(...)``: the batch, chunk and split sizes and the packed-batch offsets, checked, with
   the sequence lengths, the number of state slots ``NS`` and each packed sequence's first slot;
2. ``check_config(...)``: an explicit ``triton.Config`` is one the kernel can run;
3. ``run(...)``: launch the kernel over a flat grid of (sequence, head, K tile, V tile) programs,
   autotuned (``tuning``) or with that config; a launch seen before goes straight to the compiled
   kernel (``direct``).

``pieces`` builds on this module, never the other way round.
"""
from __future__ import annotations

import os
import threading
from collections import OrderedDict
from dataclasses import dataclass
from operator import itemgetter
from typing import NamedTuple

import torch
import triton

from . import _host, _validate, tuning
from .env import INTERPRET

# One kernel launch at a time from this process's threads. Triton's autotuner keeps the arguments of
# the call in flight on itself (``Autotuner.run`` sets ``self.nargs`` and resets it to None at the
# end), so two threads launching one autotuned kernel at once break each other (seen on the H200:
# "'NoneType' object is not a mapping"); the interpreter likewise keeps per-launch state in module
# globals. The lock is held for the host side of a launch only (the GPU runs it asynchronously).
_LAUNCH_LOCK = threading.RLock()


def serialised():
    """The context every launch of chunkstate's kernels runs in: holds ``_LAUNCH_LOCK``."""
    return _LAUNCH_LOCK


class Problem(NamedTuple):
    """The sizes of one call, checked: B × T tokens (packed: B = 1 and N sequences of ``lengths``),
    H heads, a [K, V] state, chunks of BT and splits of BS tokens, ``NS`` state slots stored.
    (A named tuple: read-only, and made in a fraction of a frozen dataclass's time, once per call.)"""
    B: int
    T: int
    H: int
    K: int
    V: int
    N: int
    BT: int
    BS: int
    lengths: tuple[int, ...]
    longest: int  # the longest sequence's length (0 for none): its walk sets the time of a launch
    NS: int
    cu_seqlens: torch.Tensor | None  # [N + 1] the validated offsets the kernels read (packed batches)
    split_offsets: torch.Tensor | None  # [N + 1] int64 first state slot of each packed sequence
    state_v_first: bool
    device: int  # the CUDA index of the call's tensors (``like.get_device()``), -1 on CPU: whose SM count decides
    # the pieces and the occupancy bucket (``tuning.sm_count``)

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
    lengths, longest, NS, split_offsets = _host.splits(cu_host, B, T, BS, like.device)
    return Problem(B, T, H, K, V, N, BT, BS, tuple(lengths), longest, NS, cu_seqlens, split_offsets, state_v_first,
                   like.get_device())


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
        if type(tile) is not int or tile not in (16, 32, 64, 128):
            raise ValueError(f"config's {name} must be 16, 32, 64 or 128 (a tile width), got {tile!r}"
                             + _validate.python_int_hint(tile))


def explicit_options(config) -> dict:
    """The compile options an explicit ``triton.Config`` sets beside its keywords: its warps and
    stages, and ``maxnreg`` (a cap on the registers a thread may use) where it sets one."""
    options = dict(num_warps=config.num_warps, num_stages=config.num_stages)
    if getattr(config, "maxnreg", None) is not None:
        options["maxnreg"] = config.maxnreg
    return options


def run(tuned, kernel, args: dict, *, N: int, H: int, K: int, V: int, config, tma_inputs: dict) -> None:
    """Launch ``kernel`` (``tuned``: its autotuner) with ``args`` over N·H (sequence, head) pairs,
    each cut into [BK, BV] state tiles; ``config``: run that ``triton.Config`` instead of
    autotuning. ``tma_inputs``: the tensors the kernel may read through TMA descriptors, by name
    (an explicit ``USE_TMA`` config is refused unless all of them can be). A launch seen before
    goes straight to the compiled kernel (``direct``)."""
    if N * H * K * V == 0:  # no state element to compute
        return
    key = direct_key(kernel, args, N, config)
    if key is not None:
        with serialised():
            if direct(key, args):
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
    first = next(iter(tma_inputs.values()))  # k or q: on the kernels' device
    smem = tuning.device_limits(first.device).smem
    keyed = dict(OCCUPANCY=tuning.launch_bucket(N, H, K, V, tuning.sm_count(first.get_device())), TMA_OK=int(tma_ok),
                 SMEM=smem)
    call_args, args = args, {**args, **keyed}

    def grid(meta):
        return (_host.cdiv(K, meta["BK"]) * _host.cdiv(V, meta["BV"]) * N * H,)

    with serialised():
        if config is None:
            tune_key = autotune_key(tuned, args)
            chosen = tuned_config(tuned, tune_key)
            if chosen is None:  # a new key: the autotuner prunes, compiles and times its candidates
                compiled = tuned[grid](**args)
                chosen = tuned.best_config
            else:  # tuned before: launch its choice directly (Autotuner.run would only look it up)
                tuned.best_config = chosen
                compiled = kernel[grid](**args, **chosen.all_kwargs())
        else:
            tune_key, chosen = None, config
            compiled = kernel[grid](**{**args, **config.kwargs}, **explicit_options(config))
        if key is not None and chosen is not None:
            remember_direct(key, kernel, compiled, call_args, {**keyed, **chosen.kwargs}, grid(chosen.kwargs),
                            tuned=tuned if config is None else None, tune_key=tune_key, chosen=chosen)


# ---------------------------------------------------------------- direct launches
#
# Triton's ``JITFunction.run`` binds and specialises every argument again on every launch (which
# dtype each tensor has, whether its address is 16-byte aligned, whether an int is 1 or a multiple
# of 16) and looks the compiled kernel up by that: ~29 µs of an H200 host's time for these
# kernels' ~40 arguments, where the compiled kernel's own launcher takes ~7 µs. For a call of
# under ~0.1 ms of GPU work that host time is the call's time. So the first launch of a kind goes
# through Triton as usual, and ``remember_direct`` keeps what it resolved: the compiled kernel, the
# grid, and the arguments every such launch adds (OCCUPANCY, TMA_OK, SMEM, the config's tiles). A
# later launch with the same ``direct_key`` (everything Triton specialises on, and everything the
# grid, the autotune key and the TMA choice depend on) hands its arguments to that compiled
# kernel's launcher, in the kernel's order, as ``JITFunction.run`` does. Where the autotuner's
# cache no longer holds the config remembered (cleared, or tuned again), the launch goes through
# Triton again. Only on Triton versions whose launch convention was checked (``DIRECT_TRITON``),
# never under the interpreter, and never while a launch hook (a profiler's) is set.

DIRECT_TRITON = ("3.6.",)  # Triton versions whose JITFunction.run this imitates (checked on the H200)
DIRECT = not INTERPRET and triton.__version__.startswith(DIRECT_TRITON)
MAX_DIRECT = 256  # launches remembered, the least recently used dropped first


@dataclass(frozen=True)
class _Direct:
    compiled: object  # Triton's CompiledKernel
    in_order: itemgetter  # the kernel's arguments in its signature's order, from all the keywords
    constants: dict  # what every launch of this key adds: OCCUPANCY, TMA_OK, SMEM, the config's, defaults
    grid: tuple  # (programs, 1, 1)
    tuned: object = None  # the autotuner that chose the config (None: an explicit config or kernel)
    tune_key: tuple | None = None  # the autotuner's key for this launch: its cache must still hold ``chosen``
    chosen: object = None
    uses_tma: bool = False


_direct: OrderedDict[tuple, _Direct] = OrderedDict()
_plans: dict[tuple, tuple] = {}  # (id(kernel), argument names) -> how direct_key reads each argument


def direct_key(kernel, args: dict, N: int, config=None) -> tuple | None:
    """Everything a launch of ``kernel`` with ``args`` over N sequences depends on beyond the
    tensors' contents and T: each tensor's dtype, 16-byte alignment and contiguity, each flag and
    size (a ``tl.constexpr``) as it is, a scalar Triton never specialises (T, ``scale``) by its
    type only; N, the current device, the shared-memory cap and an explicit config. (Every tensor
    of a launch is on the current device: the wrappers check their inputs are on one device and
    make it current, ``_host.on_inputs_device``, and allocate on it.) None where launches are
    never direct (``DIRECT``). Every call asks, so it is built in one expression from a plan made
    once per kernel and argument names (``_key_plan``)."""
    if not DIRECT:
        return None
    names = tuple(args)
    plan = _plans.get((id(kernel), names))
    if plan is None:
        plan = _plans[id(kernel), names] = _key_plan(kernel, names)
    constants, tensors, widths = plan
    return (id(plan), N, _host.current_device(), os.environ.get(tuning.SMEM_LIMIT_ENV),
            None if config is None else (tuple(sorted(config.kwargs.items())), *explicit_options(config).values()),
            constants(args),
            # tensors, None, or a scalar Triton specialises on its value (None asked first: most of a
            # launch's optional tensors are None, and isinstance of a non-tensor is the slow answer)
            tuple([x if x is None else (x.dtype, x.data_ptr() % 16 == 0, x.is_contiguous())
                   if isinstance(x, torch.Tensor) else x for x in tensors(args)]),
            # scalars never specialised: an int by whether it fits in 32 bits, a float by its type
            tuple([type(x) is float or -2 ** 31 <= x < 2 ** 31 for x in widths(args)]))


def _getter(names: list[str]):
    """``itemgetter(*names)`` that always returns a tuple (one name, or none, included)."""
    if len(names) > 1:
        return itemgetter(*names)
    return lambda args: tuple(args[n] for n in names)


def _key_plan(kernel, names: tuple) -> tuple:
    """For ``direct_key``: getters of the ``tl.constexpr`` arguments (taken as they are), of the
    arguments that may be tensors, and of those Triton never specialises. The plan object's id
    stands for ``names`` in the key (plans are never dropped)."""
    params = {p.name: p for p in kernel.params}
    constants = [n for n in names if n not in params or params[n].is_constexpr]
    widths = [n for n in names if n in params and not params[n].is_constexpr and params[n].do_not_specialize]
    tensors = [n for n in names if n not in constants and n not in widths]
    return _getter(constants), _getter(tensors), _getter(widths)


def remember_direct(key: tuple, kernel, compiled, call_args: dict, added: dict, grid: tuple, *, tuned=None,
                    tune_key=None, chosen=None) -> None:
    """Keep what the launch of ``key`` resolved: ``compiled``, what ``kernel[grid](**call_args,
    **added)`` returned (``added``: the autotune key's arguments and the config's constants, the same
    for every launch of this key). Hold the launch lock."""
    if not hasattr(compiled, "packed_metadata"):  # not a CompiledKernel: leave this key to Triton
        return
    constants = {}
    for p in kernel.params:
        if p.name in added:
            constants[p.name] = added[p.name]
        elif p.name not in call_args:
            if not p.has_default:
                return
            constants[p.name] = p.default
    entry = _Direct(compiled, itemgetter(*(p.name for p in kernel.params)), constants, (*grid, 1, 1)[:3],
                    tuned, tune_key, chosen, bool(added.get("USE_TMA", False)))
    _direct[key] = entry
    _direct.move_to_end(key)
    while len(_direct) > MAX_DIRECT:
        _direct.popitem(last=False)


def direct(key: tuple, call_args: dict) -> bool:
    """Launch ``key``'s compiled kernel with ``call_args`` if remembered and, for an autotuned
    launch, still the autotuner's choice. Returns whether it launched. Hold the launch lock."""
    entry = _direct.get(key)
    if entry is None:
        return False
    if entry.tuned is not None and entry.tuned.cache.get(entry.tune_key) is not entry.chosen:
        del _direct[key]  # the autotuner's cache was cleared or tuned again: through Triton again
        return False
    if not _hooks_idle():
        return False  # a profiler's launch hooks: Triton's own path calls them
    if entry.uses_tma:
        tuning.ensure_allocator()
    if entry.tuned is not None:
        entry.tuned.best_config = entry.chosen
    _direct.move_to_end(key)
    compiled = entry.compiled
    stream = _host.current_raw_stream(_host.current_device())  # what Triton's driver asks torch for
    compiled.run(*entry.grid, stream, compiled.function, compiled.packed_metadata, None, None, None,
                 *entry.in_order({**call_args, **entry.constants}))
    return True


def _hooks_idle() -> bool:
    """No launch hook is set: Triton's ``knobs.runtime.launch_enter_hook`` / ``launch_exit_hook`` are
    None or (Triton 3.5 and later) a ``HookChain`` holding no hook, which calls nothing."""
    runtime = triton.knobs.runtime
    for hook in (runtime.launch_enter_hook, runtime.launch_exit_hook):
        if hook is not None and getattr(hook, "calls", True):
            return False
    return True


def launch_plain(kernel, grid: tuple, args: dict) -> None:
    """``kernel[grid](**args)`` for a kernel without an autotuner (``args`` with ``num_warps``, if
    any), direct after the first launch of a kind (``direct``)."""
    key = direct_key(kernel, args, grid[0])
    with serialised():
        if key is not None and direct(key, args):
            return
        compiled = kernel[grid](**args)
        if key is not None:
            remember_direct(key, kernel, compiled, args, {}, grid)


def clear_direct() -> None:
    """Forget every remembered launch (tests)."""
    with serialised():
        _direct.clear()


def autotune_key(tuned, args: dict) -> tuple:
    """The key under which Triton's autotuner ``tuned`` caches its choice for a launch with keyword
    arguments ``args``, built as ``Autotuner.run`` builds it: the values of its ``key`` arguments,
    then the dtype of every tensor argument, in the order given."""
    names = _arg_names(tuned)
    key = [args[name] for name in tuned.keys if name in args]
    key += [str(x.dtype) for name, x in args.items() if name in names and hasattr(x, "dtype")]
    return tuple(key)


def tuned_config(tuned, key: tuple):
    """The config ``tuned`` chose earlier for a launch of this ``autotune_key``, or None (a new key,
    or one config only). A repeated call then skips ``Autotuner.run``, which rebuilds the key and re-binds every
    argument before launching the same config: ~20 µs of host time a launch on an H200's host,
    which decides the time of calls of under ~0.1 ms of GPU work. Should Triton ever build its key
    differently, nothing is found here and every call goes through ``Autotuner.run`` as before."""
    if len(tuned.configs) < 2:
        return None
    return tuned.cache.get(key)


_ARG_NAMES: dict[int, frozenset] = {}


def _arg_names(tuned) -> frozenset:
    names = _ARG_NAMES.get(id(tuned))
    if names is None:
        names = _ARG_NAMES[id(tuned)] = frozenset(tuned.arg_names)
    return names
