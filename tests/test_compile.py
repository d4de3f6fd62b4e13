"""Every kernel config the autotuner can pick compiles, without a GPU, for the GPUs learners have,
and fits their shared memory; ``tuning.shared_memory``'s estimate bounds what the compiler uses.

Triton's interpreter accepts things the GPU compiler rejects (dots on blocks under 16, loop
indices cast the wrong way, tiles that need more shared memory than a multiprocessor has), so
this test compiles the kernels to a cubin through ``triton.compile(ASTSource(fn, signature,
constexprs, attrs))`` for each of ``tuning.TARGETS`` (``GPUTarget("cuda", 75 / 80 / 86 / 89 / 90,
32)``) and reads ``metadata.shared``. The pointers are marked 16-byte aligned, as Triton
specialises the aligned tensors of a real launch: the software pipeliner then buffers 16-bit
tiles it cannot buffer for 2-byte aligned ones (without the hint bf16 configs came out up to a
third low). No GPU is needed; under pytest on a CPU machine the kernels are interpreter
functions, so the compiling runs in subprocesses started with ``TRITON_INTERPRET=0`` (chunkstate
keeps an explicitly set value).

Each compiled job checks: it compiles; ``tuning.shared_memory`` is at least ``metadata.shared``
and not far above it (``FlagSet.slack`` times it plus ``SLACK_BYTES``); and a candidate (a config
``tuning.prune`` returns for that target's ``tuning.Device``: its compute capability and shared
memory) fits the target. The bytes ptxas spilled are read from each cubin (``spilled_bytes``), and
the sm_90 candidates of one gate and 4 or more warps must spill none.

What is compiled (about 2 s per config on one core, up to ~15 s for 64×128 tiles at 4 stages):

- sm_90 (the H200 the timings come from): every candidate of the flag sets marked
  ``with_candidates`` for K = V = 128, each grid bucket (or the flag set's), pointer and TMA
  loads, always; plus a rotating subset of ``tuning.ALL_CONFIGS`` for every flag set, ``ROTATING``
  configs each;
- sm_75, sm_80, sm_86, sm_89: a rotating window of ``ROTATING_TARGET`` configs per target out of
  every flag set's candidates for that target (``candidate_pool``), no TMA below sm_90.

The rotating picks come from the session seed (the ids say which; the same ``CHUNKSTATE_SEED``
picks the same ones), so that over many runs every config comes up. ``CHUNKSTATE_COMPILE_ALL=1``
compiles every config of every flag set on sm_90 and every candidate on every target;
``CHUNKSTATE_COMPILE_ROTATION=<int>`` picks the rotation; ``CHUNKSTATE_COMPILE_WORKERS`` sets
the number of compiling processes (default: the CPU count, at most 4);
``CHUNKSTATE_COMPILE_PYTHON=<python>`` the interpreter they run (default: this one), so that a
machine without a GPU can compile with another Triton, e.g. the H200 image's 3.6, which refuses
code that 3.9 accepts: ``python -m venv --system-site-packages /tmp/t36 && /tmp/t36/bin/pip install
triton==3.6.0``, then ``CHUNKSTATE_COMPILE_PYTHON=/tmp/t36/bin/python pytest tests/test_compile.py``.
Compiled kernels land in Triton's cache, so a second run is fast. tests/test_devices.py checks, without compiling, that
``prune`` keeps a candidate within every target's shared memory for every bucket and gate kind.

To add a kernel: one ``KernelSpec`` in ``KERNELS`` — its module and name, and one or more flag
sets mapping *every* kernel argument to a value: ``ptr("bf16")`` for a tensor, ``None`` for an
absent optional tensor, a Python value for a scalar or constexpr. BK / BV and warps / stages come
from the configs. An argument left out (or one the kernel does not have) fails with its name.
"""
from __future__ import annotations

import dataclasses
import inspect
import json
import os
import re
import subprocess
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor

import pytest
import torch
import triton

from chunkstate import tuning

# The estimate may be this far above what the compiler uses (FlagSet.slack times it, plus these bytes):
# with 2 stages the pipeliner often buffers less than it could, and small configs never matter.
SLACK_BYTES = 32 * 1024
ROTATING = 1  # configs per flag set on sm_90 on top of the autotuner's candidates
ROTATING_TARGET = 2  # candidates per run for each target other than sm_90
MAIN_TARGET = "sm_90"  # every candidate compiled on every run
COMPILE_PYTHON = os.environ.get("CHUNKSTATE_COMPILE_PYTHON") or sys.executable  # the compiling processes' Python


def gpu_target(name: str) -> tuple[str, int, int]:
    """``GPUTarget`` arguments (backend, arch, warp size) of a ``tuning.TARGETS`` name."""
    major, minor = tuning.TARGETS[name].capability
    return ("cuda", 10 * major + minor, 32)


@dataclasses.dataclass(frozen=True)
class ptr:
    """A tensor argument of the given Triton dtype ("bf16", "fp16", "fp32", "i32", "i64")."""
    dtype: str


@dataclasses.dataclass(frozen=True)
class FlagSet:
    name: str
    args: dict  # every kernel argument but BK / BV -> ptr(..), None, or a scalar / constexpr value
    with_candidates: bool = False  # on sm_90 also compile every config the autotuner can try for it
    buckets: tuple = ()  # the grid buckets whose candidates count (default: all)
    slack: float = 2.0  # tuning.shared_memory may be this many times what the compiler uses (+ SLACK_BYTES)


@dataclasses.dataclass(frozen=True)
class KernelSpec:
    name: str
    module: str
    attr: str
    flag_sets: tuple


_GATES = dict(g=ptr("fp32"), g_gamma=ptr("fp32"), gk=ptr("fp32"), gv=ptr("fp32"))
_NO_GATES = dict(g=None, g_gamma=None, gk=None, gv=None)
_NO_LOOK_BACK = dict(counter=None, flags=None, contributions=None, piece_seq=None, seq_pieces=None)
_LOOK_BACK = dict(counter=ptr("i32"), flags=ptr("i32"), contributions=ptr("fp32"), piece_seq=ptr("i32"),
                  seq_pieces=ptr("i32"), LOOK_BACK=True)

FORWARD = KernelSpec("forward", "chunkstate.forward", "chunk_fwd_kernel_h", (
    FlagSet("bf16-dense-allgates-h0-ht", dict(
        k=ptr("bf16"), v=ptr("bf16"), h=ptr("bf16"), **_GATES, h0=ptr("fp32"), ht=ptr("fp32"),
        cu_seqlens=None, split_offsets=None, decay_k=None, decay_v=None, **_NO_LOOK_BACK, T=4096, OCCUPANCY=2, TMA_OK=1, SMEM=0,
        H=4, K=128, V=128, BT=64, BS=64, USE_G=True, USE_G_GAMMA=True, USE_GK=True, USE_GV=True,
        USE_INITIAL_STATE=True, STORE_FINAL_STATE=True, IS_VARLEN=False, STATE_V_FIRST=False,
        STORE_STATES=True, STORE_DECAY=False), with_candidates=True),
    FlagSet("fp16-varlen-vfirst-g-gv-h32", dict(
        k=ptr("fp16"), v=ptr("fp16"), h=ptr("fp32"), **dict(_NO_GATES, g=ptr("fp32"), gv=ptr("fp32")),
        h0=ptr("fp16"), ht=None, cu_seqlens=ptr("i32"), split_offsets=ptr("i64"), decay_k=None, decay_v=None, **_NO_LOOK_BACK,
        T=4096, OCCUPANCY=3, TMA_OK=1, SMEM=0, H=4, K=128, V=128, BT=64, BS=128, USE_G=True, USE_G_GAMMA=False,
        USE_GK=False, USE_GV=True, USE_INITIAL_STATE=True, STORE_FINAL_STATE=False, IS_VARLEN=True, STATE_V_FIRST=True,
        STORE_STATES=True, STORE_DECAY=False)),
    FlagSet("bf16-dense-g-narrow-v", dict(  # g alone below a quarter wave: v scaled in bf16 (tuning.narrow_v)
        k=ptr("bf16"), v=ptr("bf16"), h=ptr("bf16"), **dict(_NO_GATES, g=ptr("fp32")), h0=None, ht=ptr("fp32"),
        cu_seqlens=None, split_offsets=None, decay_k=None, decay_v=None, **_NO_LOOK_BACK, T=4096, OCCUPANCY=1, TMA_OK=1, SMEM=0,
        H=32, K=128, V=128, BT=64, BS=64, USE_G=True, USE_G_GAMMA=False, USE_GK=False, USE_GV=False,
        USE_INITIAL_STATE=False, STORE_FINAL_STATE=True, IS_VARLEN=False, STATE_V_FIRST=False,
        STORE_STATES=True, STORE_DECAY=False, NARROW_V=True), with_candidates=True, buckets=(0, 1)),
    FlagSet("bf16-varlen-g_gamma-narrow-v", dict(  # g_gamma alone below a quarter wave: v scaled in bf16
        k=ptr("bf16"), v=ptr("bf16"), h=ptr("bf16"), **dict(_NO_GATES, g_gamma=ptr("fp32")), h0=ptr("fp32"),
        ht=ptr("fp32"), cu_seqlens=ptr("i32"), split_offsets=ptr("i64"), decay_k=None, decay_v=None, **_NO_LOOK_BACK, T=4096,
        OCCUPANCY=0, TMA_OK=1, SMEM=0, H=4, K=128, V=128, BT=64, BS=64, USE_G=False, USE_G_GAMMA=True, USE_GK=False,
        USE_GV=False, USE_INITIAL_STATE=True, STORE_FINAL_STATE=True, IS_VARLEN=True, STATE_V_FIRST=False,
        STORE_STATES=True, STORE_DECAY=False, NARROW_V=True), buckets=(0, 1)),
    FlagSet("bf16-dense-g-h0", dict(  # g alone from a quarter wave on: v scaled in fp32
        k=ptr("bf16"), v=ptr("bf16"), h=ptr("bf16"), **dict(_NO_GATES, g=ptr("fp32")), h0=ptr("fp32"), ht=None,
        cu_seqlens=None, split_offsets=None, decay_k=None, decay_v=None, **_NO_LOOK_BACK, T=4096, OCCUPANCY=3, TMA_OK=1, SMEM=0,
        H=32, K=128, V=128, BT=64, BS=64, USE_G=True, USE_G_GAMMA=False, USE_GK=False, USE_GV=False,
        USE_INITIAL_STATE=True, STORE_FINAL_STATE=False, IS_VARLEN=False, STATE_V_FIRST=False,
        STORE_STATES=True, STORE_DECAY=False, NARROW_V=False), with_candidates=True, buckets=(2, 3, 4)),
    FlagSet("bf16-pieces-pass-gk-gv-decays", dict(  # the pieces' first pass: ht and decays only
        k=ptr("bf16"), v=ptr("bf16"), h=None, **dict(_NO_GATES, gk=ptr("fp32"), gv=ptr("fp32")),
        h0=None, ht=ptr("fp32"), cu_seqlens=ptr("i32"), split_offsets=None, decay_k=ptr("fp32"),
        decay_v=ptr("fp32"), **_NO_LOOK_BACK, T=4096, OCCUPANCY=0, TMA_OK=1, SMEM=0, H=4, K=128, V=128, BT=64, BS=64, USE_G=False,
        USE_G_GAMMA=False, USE_GK=True, USE_GV=True, USE_INITIAL_STATE=False, STORE_FINAL_STATE=True,
        IS_VARLEN=True, STATE_V_FIRST=False, STORE_STATES=False, STORE_DECAY=True)),
    FlagSet("bf16-pieces-one-launch-allgates-h0-ht", dict(  # pieces in one launch (pieces.run): look-back
        k=ptr("bf16"), v=ptr("bf16"), h=ptr("bf16"), **_GATES, h0=ptr("fp32"), ht=ptr("fp32"),
        cu_seqlens=ptr("i32"), split_offsets=ptr("i64"), decay_k=ptr("fp32"), decay_v=ptr("fp32"), **_LOOK_BACK,
        T=4096, OCCUPANCY=1, TMA_OK=1, SMEM=0, H=4, K=128, V=128, BT=64, BS=64, USE_G=True, USE_G_GAMMA=True,
        USE_GK=True, USE_GV=True, USE_INITIAL_STATE=True, STORE_FINAL_STATE=True, IS_VARLEN=True,
        STATE_V_FIRST=False, STORE_STATES=True, STORE_DECAY=False), with_candidates=True, buckets=(0, 1)),
    FlagSet("bf16-dense-gk-ht", dict(  # the key gate alone: every candidate (chapter 11: none spills)
        k=ptr("bf16"), v=ptr("bf16"), h=ptr("bf16"), **dict(_NO_GATES, gk=ptr("fp32")), h0=None, ht=ptr("fp32"),
        cu_seqlens=None, split_offsets=None, decay_k=None, decay_v=None, **_NO_LOOK_BACK, T=4096, OCCUPANCY=2, TMA_OK=1, SMEM=0,
        H=32, K=128, V=128, BT=64, BS=64, USE_G=False, USE_G_GAMMA=False, USE_GK=True, USE_GV=False,
        USE_INITIAL_STATE=False, STORE_FINAL_STATE=True, IS_VARLEN=False, STATE_V_FIRST=False,
        STORE_STATES=True, STORE_DECAY=False), with_candidates=True),
    FlagSet("fp32-dense-gk-bt128", dict(  # fp32 inputs, long chunks: the most shared memory per stage
        k=ptr("fp32"), v=ptr("fp32"), h=ptr("fp32"), **dict(_NO_GATES, gk=ptr("fp32")), h0=None, ht=ptr("fp32"),
        cu_seqlens=None, split_offsets=None, decay_k=None, decay_v=None, **_NO_LOOK_BACK, T=4096, OCCUPANCY=2, TMA_OK=1, SMEM=0,
        H=4, K=128, V=128, BT=128, BS=256, USE_G=False, USE_G_GAMMA=False, USE_GK=True, USE_GV=False,
        USE_INITIAL_STATE=False, STORE_FINAL_STATE=True, IS_VARLEN=False, STATE_V_FIRST=False,
        STORE_STATES=True, STORE_DECAY=False)),
))

BACKWARD = KernelSpec("backward", "chunkstate.backward", "chunk_bwd_kernel_dh", (
    FlagSet("bf16-gqa-allgates-dht-dh0", dict(
        q=ptr("bf16"), do=ptr("bf16"), dh=ptr("bf16"), **_GATES, dht=ptr("fp32"), dh0=ptr("fp32"),
        cu_seqlens=None, split_offsets=None, decay_k=None, decay_v=None, **_NO_LOOK_BACK, scale=0.088, T=4096, OCCUPANCY=2,
        TMA_OK=1, SMEM=0, H=4, NG=2, K=128, V=128, BT=64, BS=64, USE_G=True, USE_G_GAMMA=True, USE_GK=True, USE_GV=True,
        USE_FINAL_STATE_GRADIENT=True, STORE_INITIAL_STATE_GRADIENT=True, IS_VARLEN=False,
        STATE_V_FIRST=False, STORE_STATES=True, STORE_DECAY=False),
        slack=3.5),  # with GQA and a vector gate only q and do are buffered: the estimate is up to 3.3x high
    FlagSet("bf16-dense-g-dht-dh0", dict(  # the scalar gate alone, from a quarter wave on
        q=ptr("bf16"), do=ptr("bf16"), dh=ptr("bf16"), **dict(_NO_GATES, g=ptr("fp32")), dht=ptr("fp32"),
        dh0=ptr("fp32"), cu_seqlens=None, split_offsets=None, decay_k=None, decay_v=None, **_NO_LOOK_BACK, scale=0.088,
        T=4096, OCCUPANCY=3, TMA_OK=1, SMEM=0, H=32, NG=1, K=128, V=128, BT=64, BS=64, USE_G=True, USE_G_GAMMA=False,
        USE_GK=False, USE_GV=False, USE_FINAL_STATE_GRADIENT=True, STORE_INITIAL_STATE_GRADIENT=True, IS_VARLEN=False,
        STATE_V_FIRST=False, STORE_STATES=True, STORE_DECAY=False), with_candidates=True, buckets=(2, 3, 4)),
    FlagSet("bf16-pieces-one-launch-g-gv-dht-dh0", dict(  # pieces in one launch (pieces.run): look-back
        q=ptr("bf16"), do=ptr("bf16"), dh=ptr("bf16"), **dict(_NO_GATES, g=ptr("fp32"), gv=ptr("fp32")),
        dht=ptr("fp32"), dh0=ptr("fp32"), cu_seqlens=ptr("i32"), split_offsets=ptr("i64"), decay_k=ptr("fp32"),
        decay_v=ptr("fp32"), **_LOOK_BACK, scale=0.088, T=4096, OCCUPANCY=1, TMA_OK=1, SMEM=0, H=4, NG=1, K=128,
        V=128, BT=64, BS=64, USE_G=True, USE_G_GAMMA=False, USE_GK=False, USE_GV=True, USE_FINAL_STATE_GRADIENT=True,
        STORE_INITIAL_STATE_GRADIENT=True, IS_VARLEN=True, STATE_V_FIRST=False, STORE_STATES=True,
        STORE_DECAY=False), with_candidates=True, buckets=(0, 1)),
))

KERNELS = [FORWARD, BACKWARD]


# ---------------------------------------------------------------------------------------------
# Which configs: the candidates, plus a rotating subset
# ---------------------------------------------------------------------------------------------

def _fits(key, K, V) -> bool:
    """A config is worth compiling for (K, V) when its tiles are no wider than K, V rounded up."""
    return key[0] <= max(16, triton.next_power_of_2(K)) and key[1] <= max(16, triton.next_power_of_2(V))


_DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}


def prune_args(fs: FlagSet, bucket: int, tma: int) -> dict:
    """What ``tuning.prune`` reads of a launch with this flag set's arguments: the key's values
    (OCCUPANCY = ``bucket``, TMA_OK = ``tma``) and the input dtype (k or q, as a torch dtype)."""
    args = {name: value for name, value in fs.args.items() if not isinstance(value, ptr) and name != "SMEM"}
    for name in ("k", "q"):
        if isinstance(fs.args.get(name), ptr):
            args[name] = _DTYPES[fs.args[name].dtype]
    return dict(args, OCCUPANCY=bucket, TMA_OK=tma)


def candidate_keys(fs: FlagSet, target: str) -> list[tuple]:
    """Every config the autotuner may try for this flag set's K, V, gates and dtype on ``target``
    (``tuning.prune`` with that target's ``tuning.Device``), over the flag set's grid buckets (default
    all), with pointer loads and, from sm_90 on, TMA loads."""
    device = tuning.TARGETS[target]
    keys = []
    for bucket in fs.buckets or range(tuning.N_BUCKETS):
        for tma in ((0, 1) if device.capability >= (9, 0) else (0,)):
            kept = tuning.prune(tuning.ALL_CONFIGS, prune_args(fs, bucket, tma), device=device)
            keys += [tuning.config_tuple(c) for c in kept]
    return list(dict.fromkeys(keys))


def candidate_pool(target: str) -> list[tuple[str, str, tuple]]:
    """(kernel, flag set, config) for every candidate of every flag set on ``target``."""
    return [(spec.name, fs.name, key)
            for spec in KERNELS for fs in spec.flag_sets for key in candidate_keys(fs, target)]


def rotation() -> int:
    """Which rotating configs this run compiles: ``CHUNKSTATE_COMPILE_ROTATION`` if set, else the
    session seed (``CHUNKSTATE_SEED``, printed in pytest's header and set by tests/conftest.py
    before collection, for every xdist worker alike), so a failing pick replays with that seed."""
    if "CHUNKSTATE_COMPILE_ROTATION" in os.environ:
        return int(os.environ["CHUNKSTATE_COMPILE_ROTATION"])
    return int(os.environ.get("CHUNKSTATE_SEED", "0"), 0)


def jobs() -> list[tuple[str, str, str, tuple, str]]:
    """(target, kernel, flag set, config key, why) for every compile this run does."""
    every = os.environ.get("CHUNKSTATE_COMPILE_ALL") == "1"
    out, slot = [], 0
    for spec in KERNELS:  # sm_90: the candidates and a rotating window of ALL_CONFIGS
        for fs in spec.flag_sets:
            K, V = fs.args["K"], fs.args["V"]
            pool = [tuning.config_tuple(c) for c in tuning.ALL_CONFIGS if _fits(tuning.config_tuple(c), K, V)]
            chosen = {}
            if fs.with_candidates:
                chosen.update({key: "candidate" for key in candidate_keys(fs, MAIN_TARGET)})
            rest = [key for key in pool if key not in chosen]
            if every:
                chosen.update({key: "all" for key in rest})
            elif rest:
                start = (rotation() + slot) * ROTATING  # consecutive windows: all over many seeds
                for i in range(min(ROTATING, len(rest))):
                    chosen.setdefault(rest[(start + i) % len(rest)], "rotating")
            slot += 1
            out += [(MAIN_TARGET, spec.name, fs.name, key, why) for key, why in chosen.items()]
    for i, target in enumerate(tuning.TARGETS):  # the other targets: a rotating window of their candidates
        if target == MAIN_TARGET:
            continue
        pool = candidate_pool(target)
        if every:
            picked = pool
        else:
            start = (rotation() + 7 * i) * ROTATING_TARGET  # targets at different places of similar pools
            picked = [pool[(start + i) % len(pool)] for i in range(min(ROTATING_TARGET, len(pool)))]
        out += [(target, kernel, fs, key, "candidate") for kernel, fs, key in picked]
    return out


JOBS = jobs()


def _job_id(job):
    target, kernel, fs, (BK, BV, w, s, tma), why = job
    return f"{target}-{kernel}-{fs}-BK{BK}-BV{BV}-w{w}-s{s}{'-tma' if tma else ''}-{why}"


# ---------------------------------------------------------------------------------------------
# The compiling side (runs in subprocesses with TRITON_INTERPRET=0)
# ---------------------------------------------------------------------------------------------

def _scalar_type(x) -> str:
    if isinstance(x, bool):
        return "i1"
    if isinstance(x, int):
        return "i32" if -2 ** 31 <= x < 2 ** 31 else "i64"
    if isinstance(x, float):
        return "fp32"
    raise TypeError(f"no Triton scalar type for {x!r}")


def signature_and_constexprs(fn, args: dict) -> tuple[dict, dict]:
    """ASTSource's ``signature`` (every argument name -> Triton type or "constexpr") and
    ``constexprs`` (name -> value) for a kernel called with ``args``."""
    params = {p.name: p for p in fn.params}
    unknown = sorted(set(args) - set(params))
    if unknown:
        raise KeyError(f"{fn.__name__} has no argument(s) {unknown}: update its KernelSpec")
    signature, constexprs = {}, {}
    missing = []
    for name, p in params.items():
        if name not in args:
            if p.is_constexpr and p.default is not inspect.Parameter.empty:
                signature[name], constexprs[name] = "constexpr", p.default
                continue
            missing.append(name)
            continue
        value = args[name]
        if p.is_constexpr or value is None:
            signature[name], constexprs[name] = "constexpr", value
        elif isinstance(value, ptr):
            signature[name] = "*" + value.dtype
        else:
            signature[name] = _scalar_type(value)
    if missing:
        raise KeyError(f"{fn.__name__}'s argument(s) {missing} are not in its KernelSpec")
    return signature, constexprs


def aligned_pointers(fn, signature: dict) -> dict:
    """ASTSource's ``attrs``: every pointer argument 16-byte aligned (``tt.divisibility``), as Triton
    specialises the aligned tensors of a launch (torch's allocations are)."""
    return {(fn.arg_names.index(name),): [["tt.divisibility", 16]]
            for name, kind in signature.items() if kind.startswith("*")}


def compile_one(target: str, kernel: str, flag_set: str, key: tuple, asm: str | None = None) -> dict:
    """Compile one config for one of ``tuning.TARGETS``; return {"shared": bytes, "seconds": s}
    (and {asm: text}, e.g. "ptx", when asked) or {"error": text} / {"skip": why}."""
    import importlib
    import traceback

    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    spec = next(s for s in KERNELS if s.name == kernel)
    fs = next(f for f in spec.flag_sets if f.name == flag_set)
    if "constexprs" not in inspect.signature(ASTSource.__init__).parameters:
        return {"skip": f"triton {triton.__version__}: ASTSource takes no constexprs= (API before 3.2)"}
    try:
        fn = getattr(importlib.import_module(spec.module), spec.attr)
    except Exception as e:  # noqa: BLE001  (a kernel module still being written)
        return {"skip": f"{spec.module}.{spec.attr} is not importable: {type(e).__name__}: {e}"}
    if not hasattr(fn, "params"):
        return {"error": f"{spec.attr} is a {type(fn).__name__}, not a JITFunction: TRITON_INTERPRET must be 0"}
    BK, BV, warps, stages, tma = key
    try:
        signature, constexprs = signature_and_constexprs(fn, dict(fs.args, BK=BK, BV=BV, USE_TMA=tma))
        src = ASTSource(fn=fn, signature=signature, constexprs=constexprs, attrs=aligned_pointers(fn, signature))
    except KeyError as e:
        return {"error": str(e.args[0])}
    except TypeError as e:
        return {"skip": f"triton {triton.__version__}: ASTSource API differs: {e}"}
    t0 = time.perf_counter()
    try:
        compiled = triton.compile(src, target=GPUTarget(*gpu_target(target)),
                                  options=dict(num_warps=warps, num_stages=stages))
    except Exception:  # noqa: BLE001  (report the compiler's own message)
        return {"error": traceback.format_exc(limit=3)[-3000:]}
    out = {"shared": int(compiled.metadata.shared), "seconds": time.perf_counter() - t0,
           "spilled": spilled_bytes(compiled.asm.get("cubin"))}
    if asm:
        out[asm] = compiled.asm[asm]
    return out


def spilled_bytes(cubin: bytes | None) -> int | None:
    """The bytes a thread keeps on its stack or in local memory: what ptxas spilled, read from the
    cubin by the ``cuobjdump`` that ships with Triton (``-res-usage``'s STACK and LOCAL); None where
    it cannot be read."""
    tool = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin", "cuobjdump")
    if not cubin or not os.path.exists(tool):
        return None
    with tempfile.NamedTemporaryFile(suffix=".cubin") as f:
        f.write(cubin)
        f.flush()
        usage = subprocess.run([tool, "-res-usage", f.name], capture_output=True, text=True).stdout
    found = [re.search(rf"{name}:(\d+)", usage) for name in ("STACK", "LOCAL")]
    return sum(int(m.group(1)) for m in found) if all(found) else None


def _worker_main() -> None:
    """``python tests/test_compile.py`` reads [[target, kernel, flag set, key], ...] on stdin and
    prints one JSON result per job."""
    todo = json.load(sys.stdin)
    results = [dict(compile_one(target, kernel, fs, tuple(key)), triton=triton.__version__)
               for target, kernel, fs, key in todo]
    print("\n@@RESULTS@@" + json.dumps(results))


# ---------------------------------------------------------------------------------------------
# The tests
# ---------------------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def compiled():
    """Compile every job in a few subprocesses (TRITON_INTERPRET=0); {job: result}."""
    workers = int(os.environ.get("CHUNKSTATE_COMPILE_WORKERS", min(4, os.cpu_count() or 1)))
    todo = [[target, kernel, fs, list(key)] for target, kernel, fs, key, _ in JOBS]
    # Deal the expensive configs (large tiles, deep pipelines) round-robin so the workers finish together.
    order = sorted(range(len(todo)), key=lambda i: -todo[i][3][0] * todo[i][3][1] * todo[i][3][3])
    slices = [[order[i] for i in range(w, len(order), workers)] for w in range(workers)]
    env = dict(os.environ, TRITON_INTERPRET="0")
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    env["PYTHONPATH"] = root + os.pathsep + env.get("PYTHONPATH", "")
    slices = [s for s in slices if s]
    procs = [subprocess.Popen([COMPILE_PYTHON, os.path.abspath(__file__)], stdin=subprocess.PIPE,
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env, cwd=root)
             for _ in slices]

    def feed_and_drain(proc_and_slice):
        proc, s = proc_and_slice
        return proc.communicate(json.dumps([todo[i] for i in s]))

    with ThreadPoolExecutor(max(1, len(procs))) as pool:  # every worker at once: they compile side by side
        outputs = list(pool.map(feed_and_drain, zip(procs, slices)))
    results = {}
    for proc, s, (out, err) in zip(procs, slices, outputs):
        if proc.returncode != 0 or "@@RESULTS@@" not in out:
            for i in s:
                results[i] = {"error": f"compile worker exited with {proc.returncode}:\n{err[-3000:]}"}
            continue
        for i, r in zip(s, json.loads(out.rsplit("@@RESULTS@@", 1)[1])):
            results[i] = r
    return {tuple(JOBS[i][:3]) + (tuple(JOBS[i][3]),): r for i, r in results.items()}


def estimate(kernel: str, flag_set: str, key: tuple, target: str) -> int:
    """``tuning.shared_memory`` of one job, as ``tuning.prune`` computes it for a launch."""
    spec = next(s for s in KERNELS if s.name == kernel)
    fs = next(f for f in spec.flag_sets if f.name == flag_set)
    inputs = fs.args.get("k", fs.args.get("q"))
    BK, BV, _, stages, tma = key
    return tuning.shared_memory(BK, BV, stages, BT=fs.args["BT"], in_bytes=_DTYPES[inputs.dtype].itemsize,
                                g=fs.args["USE_G"], gk=fs.args["USE_GK"], gv=fs.args["USE_GV"], tma=tma,
                                device=tuning.TARGETS[target])


@pytest.mark.parametrize("job", JOBS, ids=[_job_id(j) for j in JOBS])
def test_compiles_and_fits(job, compiled, record_property):
    target, kernel, fs, key, why = job
    r = compiled[(target, kernel, fs, key)]
    if "skip" in r:
        pytest.skip(r["skip"])
    assert "error" not in r, f"{_job_id(job)} does not compile for {target}:\n{r['error']}"
    shared, bound = r["shared"], estimate(kernel, fs, key, target)
    record_property("triton", r.get("triton"))  # the compiling Triton (CHUNKSTATE_COMPILE_PYTHON)
    record_property("shared_bytes", shared)  # in --junitxml reports
    record_property("estimated_bytes", bound)
    record_property("spilled_bytes", r.get("spilled"))
    assert 0 < shared <= bound, (f"{_job_id(job)} uses {shared} B of shared memory, more than "
                                 f"tuning.shared_memory's {bound} B: the estimate must bound it")
    slack = next(f.slack for s in KERNELS for f in s.flag_sets if f.name == fs)
    assert bound <= slack * shared + SLACK_BYTES, (
        f"{_job_id(job)}: tuning.shared_memory gives {bound} B for {shared} B used: more than {slack}x + "
        f"{SLACK_BYTES} B, too far above to keep configs that fit")
    if why == "candidate":  # the autotuner tries it on this target: it must fit there
        limit = tuning.TARGETS[target].smem
        assert bound <= limit, f"{_job_id(job)}: a candidate estimated at {bound} B; {target} has {limit} B"


def test_one_gate_candidates_spill_nothing_on_hopper(compiled):
    """Every sm_90 candidate of four or more warps of a flag set with one gate (the usual call: g or
    gk alone) keeps its values in registers: ptxas spills nothing to the stack or local memory, read
    from the cubin (``spilled_bytes``). A spill would sit in the chunk loop, the one serial chain a
    program has (chapter 11, section 7). Not held to it: calls with several gates at once, which may
    spill a little at some tiles, and 2 warps, where a 64×64 fp32 state alone is 64 registers a
    thread (Triton 3.9 spills 16 bytes there with ``gk``; 3.6, which the H200 runs, none)."""
    checked, spilled = 0, []
    for target, kernel, fs, key, why in JOBS:
        spec = next(s for s in KERNELS if s.name == kernel)
        args = next(f for f in spec.flag_sets if f.name == fs).args
        gates = sum(bool(args.get(name)) for name in ("USE_G", "USE_G_GAMMA", "USE_GK", "USE_GV"))
        r = compiled[(target, kernel, fs, key)]
        if target != MAIN_TARGET or why != "candidate" or gates != 1 or key[2] < 4 or r.get("spilled") is None:
            continue
        checked += 1
        if r["spilled"]:
            spilled.append(f"{_job_id((target, kernel, fs, key, why))}: {r['spilled']} B")
    if not checked:
        pytest.skip("no cubin's resource usage could be read (Triton without cuobjdump?)")
    assert not spilled, f"{len(spilled)} of {checked} one-gate sm_90 candidates spill: {spilled}"


def test_bf16_dots_below_sm80_compile_to_fp32_fmas():
    """bf16 needs no refusal on a T4 (sm_75): Triton has no tensor-core dot below sm_80 for any
    dtype and compiles the chunk's ``tl.dot`` to fp32 FMAs on the bf16 values widened exactly (no
    ``mma``), so the states are as exact as fp32 products allow, only slower. On sm_80 the same dot
    is a bf16 ``mma``."""
    code = ("import sys, json; sys.path.insert(0, 'tests'); import test_compile as t; "
            "print(json.dumps([t.compile_one(a, 'forward', 'bf16-dense-g-narrow-v', (32, 32, 4, 2, False), 'ptx') "
            "for a in ('sm_75', 'sm_80')]))")
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    env = dict(os.environ, TRITON_INTERPRET="0", PYTHONPATH=root + os.pathsep + os.environ.get("PYTHONPATH", ""))
    done = subprocess.run([COMPILE_PYTHON, "-c", code], capture_output=True, text=True, env=env, cwd=root, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    t4, a100 = json.loads(done.stdout.strip().splitlines()[-1])
    for r in (t4, a100):
        if "skip" in r:
            pytest.skip(r["skip"])
        assert "error" not in r, r["error"]
    assert "mma" not in t4["ptx"] and "fma.rn.f32" in t4["ptx"]
    assert "mma.sync.aligned" in a100["ptx"] and ".bf16" in a100["ptx"]


def test_job_list_holds_every_candidate():
    """The autotuner's candidates for the flag sets marked ``with_candidates`` are always compiled
    on sm_90, every rotating pick is a config of ALL_CONFIGS or a candidate, and over enough
    rotations every config of ALL_CONFIGS comes up on sm_90 and every candidate on each target."""
    main = FORWARD.flag_sets[0]
    keys = {key for target, kernel, fs, key, _ in JOBS if target == MAIN_TARGET and fs == main.name}
    assert set(candidate_keys(main, MAIN_TARGET)) <= keys
    narrow_set = next(fs for fs in FORWARD.flag_sets if fs.args.get("NARROW_V"))
    narrow_buckets = tuple(b for b in range(tuning.N_BUCKETS) if tuning.narrow_v(b))
    assert narrow_set.buckets == narrow_buckets, "the NARROW_V flag set must follow tuning.narrow_v"
    wide_set = next(fs for fs in FORWARD.flag_sets if fs.with_candidates and fs.args.get("NARROW_V") is False)
    assert set(wide_set.buckets) == set(range(tuning.N_BUCKETS)) - set(narrow_buckets)
    for fs in (narrow_set, wide_set):
        compiled_keys = {key for target, kernel, name, key, _ in JOBS if target == MAIN_TARGET and name == fs.name}
        for bucket in fs.buckets:  # every candidate there, TMA or not
            for tma in (0, 1):
                kept = tuning.prune(tuning.ALL_CONFIGS, prune_args(fs, bucket, tma), device=tuning.TARGETS[MAIN_TARGET])
                assert {tuning.config_tuple(c) for c in kept} <= compiled_keys
    every = {tuning.config_tuple(c) for c in tuning.ALL_CONFIGS}
    for target, kernel, fs, key, why in JOBS:
        assert why == "candidate" or key in every, (target, kernel, fs, key)
    rest = [k for k in every if k not in set(candidate_keys(main, MAIN_TARGET))]
    longest = max([-(-len(rest) // ROTATING)]
                  + [-(-len(candidate_pool(t)) // ROTATING_TARGET) for t in tuning.TARGETS if t != MAIN_TARGET])
    seen = set()
    env = os.environ.get("CHUNKSTATE_COMPILE_ROTATION")
    try:
        for r in range(longest):
            os.environ["CHUNKSTATE_COMPILE_ROTATION"] = str(r)
            seen |= {(target, kernel, fs, key) for target, kernel, fs, key, why in jobs()}
    finally:
        if env is None:
            os.environ.pop("CHUNKSTATE_COMPILE_ROTATION", None)
        else:
            os.environ["CHUNKSTATE_COMPILE_ROTATION"] = env
    assert every <= {key for target, kernel, fs, key in seen if target == MAIN_TARGET and fs == main.name}
    for target in tuning.TARGETS:
        if target != MAIN_TARGET:
            assert set(candidate_pool(target)) <= {(k, f, key) for t, k, f, key in seen if t == target}, target




def test_no_jit_function_has_a_default_string():
    """A ``@triton.jit`` helper whose ``tl.constexpr`` parameter defaults to a string (say
    ``CACHE: tl.constexpr = ""``) compiles under Triton 3.9 and the interpreter, but Triton 3.6 (the
    H200 image's) passes the bare ``str`` on and fails every kernel that leans on the default
    ("'str' object has no attribute 'type'"). Pass such a value explicitly instead. Read from the
    source, so it holds whichever Triton is installed here."""
    import ast
    import pathlib

    import chunkstate

    found = []
    for path in sorted(pathlib.Path(chunkstate.__file__).parent.rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if not isinstance(node, ast.FunctionDef):
                continue
            if not any("jit" in ast.unparse(d) for d in node.decorator_list):
                continue
            args = node.args
            defaults = list(zip(args.args[len(args.args) - len(args.defaults):], args.defaults))
            defaults += [(a, d) for a, d in zip(args.kwonlyargs, args.kw_defaults) if d is not None]
            found += [f"{path.name}:{node.lineno} {node.name}({a.arg}={ast.unparse(d)})" for a, d in defaults
                      if isinstance(d, ast.Constant) and isinstance(d.value, str)]
    assert found == [], f"@triton.jit functions with a default string (Triton 3.6 fails on them): {found}"


if __name__ == "__main__":
    _worker_main()
