"""Every kernel config compiles for Hopper (sm_90) without a GPU, within its shared memory.

Triton's interpreter accepts things the GPU compiler rejects (dots on blocks under 16, loop
indices cast the wrong way, tiles that need more shared memory than a multiprocessor has), so
this test compiles the kernels to a cubin for ``GPUTarget("cuda", 90, 32)`` through
``triton.compile(ASTSource(fn, signature, constexprs))`` and checks ``metadata.shared`` against
Hopper's 227 KB per block. No GPU is needed; under pytest on a CPU machine the kernels are
interpreter functions, so the compiling runs in subprocesses started with ``TRITON_INTERPRET=0``
(chunkstate keeps an explicitly set value).

What is compiled (about 2 s per config on one core, up to ~15 s for 64×128 tiles at 4 stages):
every config the autotuner can try (``tuning.prune`` for K = V = 128 and each grid bucket) for
the main forward flag set, always; plus a rotating subset of ``tuning.ALL_CONFIGS`` for every
flag set, ``ROTATING`` configs each, picked by the session seed (the ids say which; the same
``CHUNKSTATE_SEED`` picks the same ones), so that over many runs every config comes up. ``CHUNKSTATE_COMPILE_ALL=1`` compiles every config of every
flag set; ``CHUNKSTATE_COMPILE_ROTATION=<int>`` picks the rotation; ``CHUNKSTATE_COMPILE_WORKERS``
sets the number of compiling processes (default: the CPU count, at most 4). Compiled kernels
land in Triton's cache, so a second run is fast.

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
import subprocess
import sys
import time

import pytest
import triton

from chunkstate import tuning

HOPPER_SMEM = 227 * 1024  # bytes of shared memory one block may use on sm_90 (opt-in maximum)
ROTATING = 1  # configs per flag set on top of the autotuner's candidates
TARGET = ("cuda", 90, 32)  # GPUTarget(backend, arch, warp size)


@dataclasses.dataclass(frozen=True)
class ptr:
    """A tensor argument of the given Triton dtype ("bf16", "fp16", "fp32", "i32", "i64")."""
    dtype: str


@dataclasses.dataclass(frozen=True)
class FlagSet:
    name: str
    args: dict  # every kernel argument but BK / BV -> ptr(..), None, or a scalar / constexpr value
    with_candidates: bool = False  # also compile every config the autotuner can try for (K, V)
    buckets: tuple = ()  # with_candidates: only the candidates of these grid buckets, for this flag set's gates


@dataclasses.dataclass(frozen=True)
class KernelSpec:
    name: str
    module: str
    attr: str
    flag_sets: tuple


_GATES = dict(g=ptr("fp32"), g_gamma=ptr("fp32"), gk=ptr("fp32"), gv=ptr("fp32"))
_NO_GATES = dict(g=None, g_gamma=None, gk=None, gv=None)

FORWARD = KernelSpec("forward", "chunkstate.forward", "chunk_fwd_kernel_h", (
    FlagSet("bf16-dense-allgates-h0-ht", dict(
        k=ptr("bf16"), v=ptr("bf16"), h=ptr("bf16"), **_GATES, h0=ptr("fp32"), ht=ptr("fp32"),
        cu_seqlens=None, split_offsets=None, decay_k=None, decay_v=None, T=4096, OCCUPANCY=2, TMA_OK=1,
        H=4, K=128, V=128, BT=64, BS=64, USE_G=True, USE_G_GAMMA=True, USE_GK=True, USE_GV=True,
        USE_INITIAL_STATE=True, STORE_FINAL_STATE=True, IS_VARLEN=False, STATE_V_FIRST=False,
        STORE_STATES=True, STORE_DECAY=False), with_candidates=True),
    FlagSet("fp16-varlen-vfirst-g-gv-h32", dict(
        k=ptr("fp16"), v=ptr("fp16"), h=ptr("fp32"), **dict(_NO_GATES, g=ptr("fp32"), gv=ptr("fp32")),
        h0=ptr("fp16"), ht=None, cu_seqlens=ptr("i32"), split_offsets=ptr("i64"), decay_k=None, decay_v=None,
        T=4096, OCCUPANCY=3, TMA_OK=1, H=4, K=128, V=128, BT=64, BS=128, USE_G=True, USE_G_GAMMA=False, USE_GK=False,
        USE_GV=True, USE_INITIAL_STATE=True, STORE_FINAL_STATE=False, IS_VARLEN=True, STATE_V_FIRST=True,
        STORE_STATES=True, STORE_DECAY=False)),
    FlagSet("bf16-dense-g-narrow-v", dict(  # g alone below a quarter wave: v scaled in bf16 (tuning.narrow_v)
        k=ptr("bf16"), v=ptr("bf16"), h=ptr("bf16"), **dict(_NO_GATES, g=ptr("fp32")), h0=None, ht=ptr("fp32"),
        cu_seqlens=None, split_offsets=None, decay_k=None, decay_v=None, T=4096, OCCUPANCY=1, TMA_OK=1,
        H=32, K=128, V=128, BT=64, BS=64, USE_G=True, USE_G_GAMMA=False, USE_GK=False, USE_GV=False,
        USE_INITIAL_STATE=False, STORE_FINAL_STATE=True, IS_VARLEN=False, STATE_V_FIRST=False,
        STORE_STATES=True, STORE_DECAY=False, NARROW_V=True), with_candidates=True, buckets=(0, 1)),
    FlagSet("bf16-pieces-pass-gk-gv-decays", dict(  # the pieces' first pass: ht and decays only
        k=ptr("bf16"), v=ptr("bf16"), h=None, **dict(_NO_GATES, gk=ptr("fp32"), gv=ptr("fp32")),
        h0=None, ht=ptr("fp32"), cu_seqlens=ptr("i32"), split_offsets=None, decay_k=ptr("fp32"),
        decay_v=ptr("fp32"), T=4096, OCCUPANCY=0, TMA_OK=1, H=4, K=128, V=128, BT=64, BS=64, USE_G=False,
        USE_G_GAMMA=False, USE_GK=True, USE_GV=True, USE_INITIAL_STATE=False, STORE_FINAL_STATE=True,
        IS_VARLEN=True, STATE_V_FIRST=False, STORE_STATES=False, STORE_DECAY=True)),
))

BACKWARD = KernelSpec("backward", "chunkstate.backward", "chunk_bwd_kernel_dh", (
    FlagSet("bf16-gqa-allgates-dht-dh0", dict(
        q=ptr("bf16"), do=ptr("bf16"), dh=ptr("bf16"), **_GATES, dht=ptr("fp32"), dh0=ptr("fp32"),
        cu_seqlens=None, split_offsets=None, decay_k=None, decay_v=None, scale=0.088, T=4096, OCCUPANCY=2, TMA_OK=1,
        H=4, NG=2, K=128, V=128, BT=64, BS=64, USE_G=True, USE_G_GAMMA=True, USE_GK=True, USE_GV=True,
        USE_FINAL_STATE_GRADIENT=True, STORE_INITIAL_STATE_GRADIENT=True, IS_VARLEN=False,
        STATE_V_FIRST=False, STORE_STATES=True, STORE_DECAY=False)),
))

KERNELS = [FORWARD, BACKWARD]


# ---------------------------------------------------------------------------------------------
# Which configs: the candidates, plus a rotating subset
# ---------------------------------------------------------------------------------------------

def _fits(key, K, V) -> bool:
    """A config is worth compiling for (K, V) when its tiles are no wider than K, V rounded up."""
    return key[0] <= max(16, triton.next_power_of_2(K)) and key[1] <= max(16, triton.next_power_of_2(V))


def candidate_keys(K: int, V: int, buckets=None, vector_gates=(False, True)) -> list[tuple]:
    """Every config the autotuner may try for (K, V), over all grid buckets (or these), with and
    without TMA loads and vector gates (or these) (``tuning.prune``)."""
    keys = []
    for bucket in buckets or range(tuning.N_BUCKETS):
        for tma in (0, 1):
            for gk in vector_gates:
                args = {"K": K, "V": V, "OCCUPANCY": bucket, "TMA_OK": tma, "USE_GK": gk}
                keys += [tuning.config_tuple(c) for c in tuning.prune(tuning.ALL_CONFIGS, args)]
    return list(dict.fromkeys(keys))


def rotation() -> int:
    """Which rotating configs this run compiles: ``CHUNKSTATE_COMPILE_ROTATION`` if set, else the
    session seed (``CHUNKSTATE_SEED``, printed in pytest's header and set by tests/conftest.py
    before collection, for every xdist worker alike), so a failing pick replays with that seed."""
    if "CHUNKSTATE_COMPILE_ROTATION" in os.environ:
        return int(os.environ["CHUNKSTATE_COMPILE_ROTATION"])
    return int(os.environ.get("CHUNKSTATE_SEED", "0"), 0)


def jobs() -> list[tuple[str, str, tuple, str]]:
    """(kernel, flag set, config key, why) for every compile this run does."""
    every = os.environ.get("CHUNKSTATE_COMPILE_ALL") == "1"
    out, slot = [], 0
    for spec in KERNELS:
        for fs in spec.flag_sets:
            K, V = fs.args["K"], fs.args["V"]
            pool = [tuning.config_tuple(c) for c in tuning.ALL_CONFIGS if _fits(tuning.config_tuple(c), K, V)]
            chosen = {}
            if fs.with_candidates:  # given buckets: only theirs, for this flag set's gates
                vector = (bool(fs.args["USE_GK"] or fs.args["USE_GV"]),) if fs.buckets else (False, True)
                chosen.update({key: "candidate" for key in candidate_keys(K, V, fs.buckets, vector)})
            rest = [key for key in pool if key not in chosen]
            if every:
                chosen.update({key: "all" for key in rest})
            elif rest:
                start = (rotation() + slot) * ROTATING  # consecutive windows: all over many seeds
                for i in range(min(ROTATING, len(rest))):
                    chosen.setdefault(rest[(start + i) % len(rest)], "rotating")
            slot += 1
            out += [(spec.name, fs.name, key, why) for key, why in chosen.items()]
    return out


JOBS = jobs()


def _job_id(job):
    kernel, fs, (BK, BV, w, s, tma), why = job
    return f"{kernel}-{fs}-BK{BK}-BV{BV}-w{w}-s{s}{'-tma' if tma else ''}-{why}"


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


def compile_one(kernel: str, flag_set: str, key: tuple) -> dict:
    """Compile one config; return {"shared": bytes, "seconds": s} or {"error": text} / {"skip": why}."""
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
        src = ASTSource(fn=fn, signature=signature, constexprs=constexprs)
    except KeyError as e:
        return {"error": str(e.args[0])}
    except TypeError as e:
        return {"skip": f"triton {triton.__version__}: ASTSource API differs: {e}"}
    t0 = time.perf_counter()
    try:
        compiled = triton.compile(src, target=GPUTarget(*TARGET), options=dict(num_warps=warps, num_stages=stages))
    except Exception:  # noqa: BLE001  (report the compiler's own message)
        return {"error": traceback.format_exc(limit=3)[-3000:]}
    return {"shared": int(compiled.metadata.shared), "seconds": time.perf_counter() - t0}


def _worker_main() -> None:
    """``python tests/test_compile.py`` reads [[kernel, flag set, key], ...] on stdin and prints
    one JSON result per job."""
    todo = json.load(sys.stdin)
    results = [compile_one(kernel, fs, tuple(key)) for kernel, fs, key in todo]
    print("\n@@RESULTS@@" + json.dumps(results))


# ---------------------------------------------------------------------------------------------
# The tests
# ---------------------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def compiled():
    """Compile every job in a few subprocesses (TRITON_INTERPRET=0); {job: result}."""
    workers = int(os.environ.get("CHUNKSTATE_COMPILE_WORKERS", min(4, os.cpu_count() or 1)))
    todo = [[kernel, fs, list(key)] for kernel, fs, key, _ in JOBS]
    # Deal the expensive configs (large tiles, deep pipelines) round-robin so the workers finish together.
    order = sorted(range(len(todo)), key=lambda i: -todo[i][2][0] * todo[i][2][1] * todo[i][2][3])
    slices = [[order[i] for i in range(w, len(order), workers)] for w in range(workers)]
    env = dict(os.environ, TRITON_INTERPRET="0")
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    env["PYTHONPATH"] = root + os.pathsep + env.get("PYTHONPATH", "")
    procs = [subprocess.Popen([sys.executable, os.path.abspath(__file__)], stdin=subprocess.PIPE,
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env, cwd=root)
             for s in slices if s]
    results = {}
    for proc, s in zip(procs, [s for s in slices if s]):
        out, err = proc.communicate(json.dumps([todo[i] for i in s]))
        if proc.returncode != 0 or "@@RESULTS@@" not in out:
            for i in s:
                results[i] = {"error": f"compile worker exited with {proc.returncode}:\n{err[-3000:]}"}
            continue
        for i, r in zip(s, json.loads(out.rsplit("@@RESULTS@@", 1)[1])):
            results[i] = r
    return {tuple(map(str, JOBS[i][:2])) + (tuple(JOBS[i][2]),): r for i, r in results.items()}


@pytest.mark.parametrize("job", JOBS, ids=[_job_id(j) for j in JOBS])
def test_compiles_for_hopper(job, compiled, record_property):
    kernel, fs, key, _ = job
    r = compiled[(kernel, fs, key)]
    if "skip" in r:
        pytest.skip(r["skip"])
    assert "error" not in r, f"{_job_id(job)} does not compile for sm_90:\n{r['error']}"
    record_property("shared_bytes", r["shared"])  # in --junitxml reports
    assert 0 < r["shared"] <= HOPPER_SMEM, \
        f"{_job_id(job)} needs {r['shared']} B of shared memory; Hopper gives a block at most {HOPPER_SMEM} B"


def test_job_list_holds_every_candidate():
    """The autotuner's candidates for the main flag set are always compiled, and every rotating pick
    is a config of ALL_CONFIGS; over ceil(len / ROTATING) rotations every config comes up."""
    main = FORWARD.flag_sets[0]
    keys = {key for kernel, fs, key, _ in JOBS if kernel == "forward" and fs == main.name}
    assert set(candidate_keys(main.args["K"], main.args["V"])) <= keys
    narrow_set = next(fs for fs in FORWARD.flag_sets if fs.args.get("NARROW_V"))
    narrow_buckets = tuple(b for b in range(tuning.N_BUCKETS) if tuning.narrow_v(b))
    assert narrow_set.buckets == narrow_buckets, "the NARROW_V flag set must follow tuning.narrow_v"
    narrow = {key for kernel, fs, key, _ in JOBS if fs == narrow_set.name}
    for bucket in narrow_buckets:  # every candidate there, TMA or not
        for tma in (0, 1):
            args = {"K": 128, "V": 128, "OCCUPANCY": bucket, "TMA_OK": tma, "USE_GK": False}
            assert {tuning.config_tuple(c) for c in tuning.prune(tuning.ALL_CONFIGS, args)} <= narrow
    every = {tuning.config_tuple(c) for c in tuning.ALL_CONFIGS}
    for kernel, fs, key, why in JOBS:
        assert why == "candidate" or key in every, (kernel, fs, key)
    rest = [k for k in (tuning.config_tuple(c) for c in tuning.ALL_CONFIGS) if k not in set(candidate_keys(128, 128))]
    seen = set()
    env = os.environ.get("CHUNKSTATE_COMPILE_ROTATION")
    try:
        for r in range(-(-len(rest) // ROTATING)):
            os.environ["CHUNKSTATE_COMPILE_ROTATION"] = str(r)
            seen |= {key for kernel, fs, key, why in jobs() if kernel == "forward" and fs == main.name}
    finally:
        if env is None:
            os.environ.pop("CHUNKSTATE_COMPILE_ROTATION", None)
        else:
            os.environ["CHUNKSTATE_COMPILE_ROTATION"] = env
    assert every <= seen, sorted(every - seen)


if __name__ == "__main__":
    _worker_main()
