"""Autotuning shared by the forward and backward kernels: the candidate configs and the key.

fla tunes 48 configs keyed on (BT, gate kinds, layout, K, V) only, so the winner for the first
shape is reused for every later B, T, H, and a first call compiles and times all 48. Here the key
also holds ``OCCUPANCY``: how many (sequence, head) pairs there are relative to the GPU's
multiprocessors, a pair of a state under 128 × 128 counted as its share of one, in five buckets
(``launch_bucket``, ``occupancy_bucket``): a launch far below one wave wants small
tiles and deep prefetch, a full grid wants big tiles. For each key a short candidate list is
pruned from ``ALL_CONFIGS`` by K, V and that bucket (``candidates``, ``prune``), so a first call
compiles and times only a handful of configs; ``Pruner`` compiles that handful side by side in
threads before the autotuner times them, and ``autotune_timing`` times each for 30 ms instead of
Triton's 125.

Candidates depend on the device (``Device``, ``device_limits``): each config's shared memory is
estimated (``shared_memory``, an upper bound that tests/test_compile.py checks against the
compiler for sm_75, sm_80, sm_86, sm_89 and sm_90), and a candidate that would not fit the shared
memory a block may use on this GPU is replaced by its nearest version that does (fewer stages,
then a halved tile: ``fit``). ``CHUNKSTATE_SMEM_LIMIT=<bytes>`` caps that memory (``smem_limit``),
e.g. to see on an H200 what an RTX 4090 (99 KB) or an A100 (163 KB) user gets. The usable shared
memory is part of the autotune key (``SMEM``), so two GPUs of different kinds in one process, or a
changed cap, tune apart.

Under Triton's interpreter ``@triton.autotune`` accepts one config only: ``CONFIGS`` collapses
to a single one there (the tests run every config explicitly through the ``config=`` argument).

The rules below were chosen from timings on an H200; the timings themselves, with their dates
and commands, are in the repository's ``figures/README.md`` (section *Measurements behind the
autotuner's rules*). Nothing here touches the GPU at import time.
"""
from __future__ import annotations

import contextlib
import functools
import os
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, replace

import torch
import triton
import triton.language as tl

from . import _host
from .env import INTERPRET


def _config(BK, BV, warps, stages, tma=False):
    return triton.Config({"BK": BK, "BV": BV, "USE_TMA": tma}, num_warps=warps, num_stages=stages)


def config_tuple(cfg: triton.Config) -> tuple[int, int, int, int, bool]:
    """(BK, BV, num_warps, num_stages, USE_TMA) of a config (USE_TMA False where it is not set)."""
    return (cfg.kwargs["BK"], cfg.kwargs["BV"], cfg.num_warps, cfg.num_stages,
            bool(cfg.kwargs.get("USE_TMA", False)))


def config_label(cfg: triton.Config) -> str:
    """A config as text: ``BK64-BV64-w4-s4`` (``-tma`` when it loads through tensor descriptors)."""
    BK, BV, w, s, tma = config_tuple(cfg)
    return f"BK{BK}-BV{BV}-w{w}-s{s}" + ("-tma" if tma else "")


# Tiles loaded with pointer arithmetic (USE_TMA False).
POINTER_CONFIGS = [_config(BK, BV, w, s)
                   for BK in (32, 64, 128) for BV in (32, 64, 128)
                   for w in (2, 4, 8) for s in (2, 3, 4, 5)
                   if BK * BV <= 64 * 128 and (w >= 4 or BK * BV <= 64 * 64)
                   # 5 stages only for tiles up to 64×64 (the low-occupancy candidates): 128×32 with
                   # 5 stages failed on the H200, its 4 prefetched stages of k, v, g, gk alone
                   # holding ~210 KB of Hopper's 227 KB of shared memory.
                   and (s < 5 or (w >= 4 and BK <= 64 and BV <= 64))]

# Tiles loaded by the Tensor Memory Accelerator (Hopper's TMA, through ``tl.make_tensor_descriptor``):
# the copy engine writes them into shared memory, one request a tile instead of per-element
# pointers and masks. Below a full wave, with a key or value gate, they were measured faster
# (figures/README.md, 2026-12-03). Not by registers: compiled for sm_90 with 16-byte-aligned
# inputs, as launches are, neither kind spills with one gate (figures/README.md, session 25;
# tests/test_compile.py checks the candidates).
TMA_CONFIGS = [_config(BK, BV, w, s, True) for BK, BV, w, s in (
    (32, 32, 4, 4), (32, 64, 4, 4), (64, 64, 4, 3), (64, 64, 4, 4), (64, 64, 8, 4), (64, 128, 8, 3),
    (128, 64, 8, 3))]

# Every config that may ever run on a GPU (the compile-only test compiles each one for sm_90).
ALL_CONFIGS = POINTER_CONFIGS + TMA_CONFIGS

# The interpreter's single config: one tile covers K, V <= 64 (few programs: fast on CPU).
INTERPRETER_CONFIG = _config(64, 64, 4, 1)
CONFIGS = [INTERPRETER_CONFIG] if INTERPRET else ALL_CONFIGS


H200_SMS = 132  # the SM count assumed without a GPU and for CPU tensors (the interpreter's): buckets and pieces


def sm_count(index: int | None = None) -> int:
    """The multiprocessor count of CUDA device ``index`` (default: the current device); ``H200_SMS``
    without a GPU and for index -1, a CPU tensor's ``get_device()`` (the interpreter's tensors
    decide as on an H200, as ``device_limits`` does). Asked of each device once, at its first
    launch, never at import: the wrappers ask on every call with their tensors' index
    (``launch.Problem.device``), so that on a machine with two kinds of GPU each decides by its own."""
    if index is None:
        index = torch.cuda.current_device() if torch.cuda.is_available() else -1
    return _sm_count(index)


@functools.lru_cache(maxsize=None)
def _sm_count(index: int) -> int:
    if index < 0 or not torch.cuda.is_available():
        return H200_SMS
    return torch.cuda.get_device_properties(index).multi_processor_count


@dataclass(frozen=True)
class Device:
    """What the choice of configs needs to know of a GPU: its compute ``capability`` (major, minor)
    and ``smem``, the bytes of shared memory one block may opt into
    (``shared_memory_per_block_optin``)."""
    capability: tuple[int, int]
    smem: int

    @property
    def async_copies(self) -> bool:
        """Whether Triton pipelines loads through shared memory here (``cp.async``, sm_80 and newer;
        below, ``num_stages`` buffers nothing)."""
        return self.capability >= (8, 0)


H200 = Device((9, 0), 227 * 1024)  # assumed without a GPU (the interpreter), like H200_SMS
# The GPUs learners have, by the limits that matter here (tests/test_compile.py compiles for each).
TARGETS = {
    "sm_75": Device((7, 5), 64 * 1024),  # T4, RTX 20xx
    "sm_80": Device((8, 0), 163 * 1024),  # A100
    "sm_86": Device((8, 6), 99 * 1024),  # RTX 30xx, A10, A40
    "sm_89": Device((8, 9), 99 * 1024),  # RTX 40xx, L4, L40
    "sm_90": H200,  # H100, H200
}
SMEM_LIMIT_ENV = "CHUNKSTATE_SMEM_LIMIT"


def device_limits(device=None) -> Device:
    """The ``Device`` of a CUDA ``device`` (default: the current one; the H200's without a GPU or
    for a CPU tensor's device), with its shared memory capped by ``CHUNKSTATE_SMEM_LIMIT`` (bytes)
    when that is set. The GPU is asked once per device index, at the first launch, never at import.
    Raises ValueError for a cap that is not a positive integer."""
    if device is None:
        index = torch.cuda.current_device() if torch.cuda.is_available() else None
    else:
        device = torch.device(device)
        index = None if device.type != "cuda" else (
            device.index if device.index is not None else torch.cuda.current_device())
    found = _device_limits(index)
    cap = os.environ.get(SMEM_LIMIT_ENV, "").strip()
    if not cap:
        return found
    try:
        cap_bytes = int(cap, 0)
    except ValueError:
        cap_bytes = 0
    if cap_bytes <= 0:
        raise ValueError(f"{SMEM_LIMIT_ENV} must be a positive number of bytes (e.g. {99 * 1024} for 99 KB), "
                         f"got {cap!r}")
    return replace(found, smem=min(found.smem, cap_bytes))


@functools.lru_cache(maxsize=None)
def _device_limits(index: int | None) -> Device:
    if index is None or not torch.cuda.is_available():
        return H200
    props = torch.cuda.get_device_properties(index)
    # what a block may opt into; where a torch build lacks that, the default per block (less, safe)
    smem = getattr(props, "shared_memory_per_block_optin", 0) or getattr(props, "shared_memory_per_block", 0)
    return Device(tuple(torch.cuda.get_device_capability(index)), int(smem) or H200.smem)


@contextlib.contextmanager
def smem_limit(limit: int | None):
    """Within the block, kernels choose configs as if a block had at most ``limit`` bytes of shared
    memory (``CHUNKSTATE_SMEM_LIMIT``; None: no cap); the previous value is restored after. The
    autotuner keys on the usable shared memory, so configs tuned under one cap are not reused
    under another. Not thread-safe: it sets a process-wide environment variable."""
    before = os.environ.get(SMEM_LIMIT_ENV)
    if limit is None:
        os.environ.pop(SMEM_LIMIT_ENV, None)
    else:
        os.environ[SMEM_LIMIT_ENV] = str(int(limit))
    try:
        yield
    finally:
        if before is None:
            os.environ.pop(SMEM_LIMIT_ENV, None)
        else:
            os.environ[SMEM_LIMIT_ENV] = before


N_BUCKETS = 5  # occupancy buckets: 0 .. 4


def bucket_limits(sms: int | None = None) -> tuple[int, ...]:
    """Where the occupancy buckets end, in (sequence, head) pairs N·H: an eighth of the SM count, a
    quarter, one, four (with 64×64 tiles at K = V = 128 one pair is 4 programs). ``sms``: the SM
    count (default ``sm_count()``)."""
    sms = sm_count() if sms is None else sms
    return sms // 8, sms // 4, sms, 4 * sms


def pair_equivalents(N: int, H: int, K: int, V: int) -> int:
    """How many (sequence, head) pairs of a K = V = 128 state a launch's work is worth, for the
    occupancy bucket: N·H scaled by the state's share of a 128 × 128 one, ``min(K, 128)·min(V, 128)
    / 128²``, rounded up. A smaller state has fewer 64 × 64 tiles to spread over the SMs (K = V = 64:
    a quarter), so it meets the GPU's occupancy cliff at four times the pairs; states of 128 and
    more count as one pair each, as the buckets were measured on them."""
    return -(-N * H * min(K, 128) * min(V, 128) // (128 * 128))


def launch_bucket(N: int, H: int, K: int, V: int, sms: int | None = None) -> int:
    """The autotune key's ``OCCUPANCY`` for a launch over N sequences (or pieces), H heads and a
    [K, V] state: ``occupancy_bucket(pair_equivalents(N, H, K, V))``."""
    return occupancy_bucket(pair_equivalents(N, H, K, V), sms)


def occupancy_bucket(pairs: int, sms: int | None = None) -> int:
    """The autotune key's ``OCCUPANCY``: N·H (sequence, head) ``pairs`` against the SM count,
    0 under 1/8 wave, 1 under 1/4, 2 under one wave, 3 under four waves, 4 beyond."""
    for bucket, limit in enumerate(bucket_limits(sms)):
        if pairs < limit:
            return bucket
    return N_BUCKETS - 1


def narrow_v(bucket: int) -> bool:
    """Whether the forward scales v by its scalar gate (``g`` or ``g_gamma``, one of them alone) in
    v's own dtype (the product rounded at once, as fla-core does, the kernel's ``NARROW_V``) rather
    than in fp32 until the dot. Both round once, at the same place in the arithmetic, so the states
    are the same bits; only what the compiler keeps alive and how it schedules the chunk step
    differ. Up to a quarter wave of programs (buckets 0 and 1), where each SM runs one program whose
    chunk step is bound by latency, the narrow form was faster on an H200 (with ``g``, and with
    ``g_gamma`` by 10-11 %: figures/README.md); around a full wave some configs were slower."""
    return bucket <= 1


def candidates(K: int, V: int, bucket: int, tma: bool = False,
               vector_gates: bool = False) -> list[tuple[int, int, int, int, bool]]:
    """The short list (BK, BV, num_warps, num_stages, USE_TMA) tried for one key.

    ``tma``: the inputs can be loaded through tensor descriptors (``tma_usable``);
    ``vector_gates``: a key or value gate (gk / gv) is given.

    Chosen from a sweep of every config on an H200 (bf16, K = V = 128 and 64/256, g and gk gates;
    ``python -m chunkstate.bench --sweep``): under an eighth of a wave the winners are small tiles
    with deep prefetch (32×32, 4 stages: a program streams slowly, so more programs and more bytes
    in flight per program win); between an eighth and a quarter, 64×64 with deep prefetch (32×32
    re-reads k and v four times); around one wave 64×128 or 64×64; beyond, 128×64 / 64×128. In
    bucket 1, 32×64 with 8 warps and 3 stages is there for the backward. The last entries of each
    list came from a second sweep over K, V ∈ {64, 128, 256} with K ≠ V (``figures/README.md``):
    half-tiles (32×64, 64×32) where K or V is 64, 64×64 with 4 warps and 3 stages, and 64×128 with
    2 stages for the backward at K = 64, V = 128; and 64×64 with 2 warps and 4 stages in bucket 1,
    the first sweep's winner at B8 T1024 H8 K = V = 64, which counting states by their size moved
    there from bucket 2. A third sweep, on the random benchmark's shapes where fla stayed ahead
    (2026-12-04): with K > V in bucket 2, 128×64 in place of 64×128 (which V would cut to 64×64)
    and 128×64 with 2 stages (B30 T4096 H6 K256 V64); with a vector gate, pointer 64×64 with 2
    stages from bucket 2 on (gk at D64 and K256 V64; in the TMA list), and in bucket 1 the wide TMA tile along the
    longer side of a state past 128 × 128 (B1 T18840 H20 K = V = 256: 0.54 ms against 0.68). And
    in bucket 2, 64×64 with 4 warps and 4 stages: fla's winner where its constant-gate forward beat
    chunkstate's 3 stages on random shapes. A fourth, on K ≠ V drawn at random in bucket 1 with gk
    (``figures/sweep_kv_bucket1_h100.json``): where K is four times V, pointer 64×64 with 8 warps and
    4 stages beat every TMA tile by more than 3 % in 9 of 12 cases (K256 V64), and lost in all 10 at
    K128 V64 and K256 V128, so only there.

    With a vector gate and TMA: TMA configs and one pointer config. Without TMA (before sm_90, or
    inputs a descriptor cannot read) a vector gate takes the scalar gates' lists below. Below a full
    wave the TMA loads win; from a full wave on they tie with the best pointer config, which stays in
    the list. With scalar gates the pointer configs tie with TMA or win,
    except between an eighth and a quarter of a wave. Deeper TMA pipelines (6 stages) do not fit
    the 227 KB of shared memory once gk and gv are both given. A TMA candidate for scalar gates
    around one wave won at some shapes of bucket 2 and lost at others, and shapes of one bucket
    share one tuned config, so it is not offered. The timings are in ``figures/README.md``.
    """
    if tma and vector_gates:
        if bucket == 0:
            return [(32, 32, 4, 4, True), (64, 64, 4, 4, True)]
        if bucket == 1:
            out = [(64, 64, 4, 4, True), (32, 64, 4, 4, True), (64, 64, 4, 3, True)]
            if K * V > 128 * 128:  # a state past 128×128 fills more of the GPU than its pair count says
                out.append((64, 128, 8, 3, True) if V >= K else (128, 64, 8, 3, True))
            if K >= 4 * V:  # pointer 64×64, 8 warps: ahead of the TMA tiles at K256 V64 (not K128 V64)
                out.append((64, 64, 8, 4, False))
            return out
        if bucket == 2:  # pointer 64×128 won here with gk at B8 T4096 H16
            out = [(64, 64, 4, 3, True), (128, 64, 8, 3, True), (64, 128, 8, 3, True), (64, 128, 4, 3, False)]
        else:  # pointer 64×128 with 4 warps won the backward at B4 T4096 H64
            out = [(64, 128, 8, 3, True), (128, 64, 8, 3, True), (64, 64, 4, 3, True), (64, 128, 4, 3, False)]
        # and pointer 64×64 with 2 stages: the full-grid gk winner at K or V = 64 and at K256 V64
        return out + [(64, 64, 4, 2, False)]
    if bucket == 0:
        out = [(32, 32, 4, 4), (32, 32, 8, 4), (32, 32, 4, 5), (64, 64, 8, 4), (64, 64, 8, 5),
               (32, 64, 4, 5), (32, 64, 8, 4), (64, 32, 8, 3)]
    elif bucket == 1:
        out = [(64, 64, 8, 4), (64, 64, 4, 4), (64, 64, 8, 5), (32, 32, 4, 4), (32, 64, 8, 3),
               (64, 64, 4, 3), (64, 32, 8, 4), (64, 64, 2, 4)]
    elif bucket == 2:
        out = [(64, 128, 8, 3), (64, 128, 4, 3), (64, 64, 2, 3), (64, 64, 2, 4), (64, 64, 4, 2),
               (64, 64, 4, 3), (32, 64, 4, 3), (64, 64, 4, 4)]
        if K > V:  # the long tile along K (V would cut 64×128 to 64×64), and 128×64 with 2 stages
            out = [(128, 64, w, s) if (BK, BV) == (64, 128) else (BK, BV, w, s) for BK, BV, w, s in out]
            out.append((128, 64, 4, 2))
    else:
        out = [(128, 64, 8, 3), (64, 128, 4, 4), (128, 64, 8, 4), (64, 64, 2, 3), (64, 128, 4, 2)]
    out = [(*t, False) for t in out]
    if tma and bucket == 1:
        out.append((64, 64, 4, 4, True))
    return out


def shared_memory(BK: int, BV: int, stages: int, *, BT: int = 64, in_bytes: int = 2, g: bool = False,
                  gk: bool = False, gv: bool = False, tma: bool = False, device: Device = H200) -> int:
    """Bytes of shared memory one program of either kernel needs with this config, an upper bound.

    ``in_bytes``: the size of an element of k, v (q, do); ``g``, ``gk``, ``gv``: which gates are
    given (``g_gamma`` loads nothing per chunk); ``tma``: the config loads through TMA descriptors.

    Per chunk a program loads a [BK, BT] tile of k (q) and a [BT, BV] tile of v (do), fp32 tiles of
    the same shapes of gk and gv, and a few vectors (g's BT values and Γ, the last rows of gk and gv).
    From sm_80 on, Triton's software pipeliner copies the loads of the next ``stages - 1`` chunks
    into shared memory ahead of use (``cp.async`` or TMA; below sm_80 it buffers nothing). On top of
    that, the operands of the chunk's ``tl.dot`` are staged in shared memory in the inputs' dtype,
    the scaled one (v, by a gate) sometimes in two copies, or, where that is larger, the fp32
    [BK, BV] state is, converted between layouts: ::

        (stages − 1) · loaded  +  max((BK + BV + max(BK, BV))·BT·in_bytes, 4·BK·BV)  (+ TMA barriers)

    Every term is the most the compiler was seen to use: with 16-byte aligned inputs it pipelines
    every load (misaligned ones less). The bound is loosest for the backward with several query
    heads per KV head and a vector gate (up to 3.3× there: its inner loop over the heads buffers q and
    do only), where a config may get fewer stages than would fit. tests/test_compile.py
    checks the bound against ``triton.compile``'s ``metadata.shared`` for every config it compiles,
    on each of ``TARGETS``."""
    tiles = (BK + BV) * BT * in_bytes  # k (q) and v (do)
    loaded = tiles + (4 * (BT + 1) if g else 0)  # g's values and Γ
    loaded += (4 * BK * (BT + 1)) if gk else 0  # gk's tile and its last row
    loaded += (4 * BV * (BT + 1)) if gv else 0
    buffered = (stages - 1) * loaded if device.async_copies and stages > 1 else 0
    staged = (BK + BV + max(BK, BV)) * BT * in_bytes  # the dot's operands, one of them twice
    barriers = 64 * stages if tma else 0  # the TMA copies' mbarriers (measured 64·(stages − 2) bytes)
    return buffered + max(staged, 4 * BK * BV) + barriers


def fit(config: tuple[int, int, int, int, bool], device: Device, **shape) -> tuple[int, int, int, int, bool]:
    """``config`` (BK, BV, num_warps, num_stages, USE_TMA) if its ``shared_memory`` (``shape``: the
    keyword arguments BT, in_bytes, g, gk, gv) fits ``device``, else its nearest version that does:
    the same tile with fewer stages (down to 2), then the tile's longer side halved (down to 16),
    from the original stages again; one stage (no prefetch) only where even 16×16 with 2 does not fit."""
    BK, BV, warps, stages, tma = config
    tile = (BK, BV)
    while True:
        for s in range(stages, 1, -1):
            if shared_memory(*tile, s, tma=tma, device=device, **shape) <= device.smem:
                return (*tile, warps, s, tma)
        if max(tile) <= 16:
            return (*tile, warps, 1, tma)
        tile = (tile[0] // 2, tile[1]) if tile[0] >= tile[1] else (tile[0], tile[1] // 2)


def tma_device(device) -> bool:
    """Whether kernels on ``device`` can build TMA descriptors: this Triton has
    ``tl.make_tensor_descriptor``, and the device is an NVIDIA GPU of compute capability 9 or newer
    (or the CPU, where the interpreter emulates the TMA). Answered once per device: every launch
    asks, for each input."""
    device = torch.device(device)
    index = device.index
    if device.type == "cuda" and index is None:
        index = torch.cuda.current_device()
    return _tma_device(device.type, index)


@functools.lru_cache(maxsize=None)
def _tma_device(kind: str, index: int | None) -> bool:
    if not hasattr(tl, "make_tensor_descriptor"):
        return False
    if kind != "cuda":
        return True
    return torch.version.hip is None and torch.cuda.get_device_capability(index)[0] >= 9  # ROCm: gfx9 reads 9.x


def tma_rows(D: int, element_size: int) -> bool:
    """Whether rows of D elements are a whole number of 16-byte units (a descriptor's strides must be)."""
    return (D * element_size) % 16 == 0


def tma_usable(*tensors) -> bool:
    """Whether every given tensor (None skipped) can be read through a TMA tensor descriptor of
    rows [T, heads, D]: ``tma_device``, and each tensor contiguous with its start and its rows
    16-byte aligned (``tma_rows``)."""
    for t in tensors:
        if t is None:
            continue
        if not (tma_device(t.device) and t.is_contiguous() and t.data_ptr() % 16 == 0
                and tma_rows(t.shape[-1], t.element_size())):
            return False
    return True


def ensure_allocator() -> None:
    """Kernels that build tensor descriptors on the device need a scratch allocator (128 bytes per
    descriptor per program); set one backed by torch's caching allocator unless the caller (or a
    library such as fla) has set their own."""
    try:
        from triton.runtime import _allocation
        unset = isinstance(_allocation._allocator.get(), _allocation.NullAllocator)
    except (ImportError, AttributeError):
        unset = True
    if unset:
        triton.set_allocator(_torch_allocator)


def _torch_allocator(size: int, alignment: int, stream):
    return torch.empty(size, dtype=torch.int8, device="cuda")


# Compile a new key's candidates side by side before the autotuner times them (it compiles them one
# after another, ~0.5 s each on an H200 host; Triton's compiler releases the GIL in its MLIR and
# LLVM passes and in ptxas, so threads overlap). False: leave compiling to the autotuner.
PARALLEL_COMPILE = not INTERPRET


def compile_configs(kernel, args: dict, configs) -> int:
    """Compile ``kernel`` (a ``@triton.jit`` function) for each config on these keyword arguments,
    in threads, without launching it; the kernels land in its cache, where the autotuner's launches
    find them. Returns how many compiles were started (0 with one config, ``PARALLEL_COMPILE`` off,
    or a Triton without ``AsyncCompileMode``, before 3.5). A config that fails to compile is left
    for the autotuner to compile again and report or skip."""
    if not PARALLEL_COMPILE or len(configs) < 2:
        return 0
    try:
        from triton.runtime._async_compile import AsyncCompileMode
    except ImportError:
        return 0
    try:
        with ThreadPoolExecutor(min(len(configs), os.cpu_count() or 1)) as pool, AsyncCompileMode(pool):
            for cfg in configs:
                kernel.warmup(grid=(1,), **args, **cfg.all_kwargs())
    except Exception:  # noqa: BLE001  the autotuner compiles what is missing and reports real errors
        return 0
    return len(configs)


class Pruner:
    """The ``early_config_prune`` of ``kernel``'s autotuner: ``prune``, then ``compile_configs`` on
    what is kept. The autotuner calls it once per new key, just before timing the candidates, so
    the compiling costs nothing on later calls."""

    def __init__(self, kernel):
        self.kernel = kernel

    def __call__(self, configs, named_args, **kwargs):
        kept = prune(configs, named_args, **kwargs)
        given = {**named_args, **kwargs}  # also holds the launch's grid and warmup flag: drop them
        compile_configs(self.kernel, {name: given[name] for name in self.kernel.arg_names if name in given}, kept)
        return kept


def autotune_timing(kernel_call, quantiles):
    """How the autotuner times one candidate: ``triton.testing.do_bench`` with 5 ms of warm-up and
    25 ms of repeats (Triton's default, 25 and 100 ms, costs ~0.15 s per candidate; on an H200 the
    shorter timing picked the same configs)."""
    return triton.testing.do_bench(kernel_call, warmup=5, rep=25, quantiles=quantiles)


def prune(configs, named_args, device: Device | None = None, **kwargs):
    """``early_config_prune`` for ``triton.autotune``: the key's ``candidates``, their tiles no wider
    than K, V need, each one that would not fit the device's shared memory replaced by its nearest
    version that does (``fit``). ``device``: the ``Device`` to choose for (default: ``device_limits``
    of k's or q's device, its shared memory the key's ``SMEM`` where that is given; the tests pass
    each of ``TARGETS``). The estimate reads the key's BT and gates and the dtype of k or q (a tensor
    or a ``torch.dtype``; 2-byte inputs where neither is given)."""
    if len(configs) == 1:
        return configs
    args = {**named_args, **kwargs}
    K, V, bucket = args["K"], args["V"], args["OCCUPANCY"]
    tma = bool(args.get("TMA_OK", False))
    vector_gates = bool(args.get("USE_GK", False) or args.get("USE_GV", False))
    inputs = args.get("k", args.get("q"))
    if device is None:
        device = device_limits(inputs.device if isinstance(inputs, torch.Tensor) else None)
        if "SMEM" in args:  # the launch's key: prune for exactly what the tuned configs are stored under
            device = replace(device, smem=args["SMEM"])
    shape = dict(BT=args.get("BT", 64), in_bytes=_element_size(inputs), g=bool(args.get("USE_G", False)),
                 gk=bool(args.get("USE_GK", False)), gv=bool(args.get("USE_GV", False)))
    want = []
    for BK, BV, w, s, use_tma in candidates(K, V, bucket, tma, vector_gates):
        BK = min(BK, max(16, _host.next_power_of_2(K)))
        BV = min(BV, max(16, _host.next_power_of_2(V)))
        want.append(fit((BK, BV, w, s, use_tma), device, **shape))
    want = list(dict.fromkeys(want))
    kept = [c for c in configs if config_tuple(c) in want]
    have = {config_tuple(c) for c in kept}
    kept += [_config(*t) for t in want if t not in have]
    return kept


def _element_size(x) -> int:
    """Bytes per element of a tensor or a ``torch.dtype``; 2 (bf16 / fp16) for None."""
    if isinstance(x, torch.Tensor):
        return x.element_size()
    if isinstance(x, torch.dtype):
        return x.itemsize
    return 2
