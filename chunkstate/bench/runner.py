"""The benchmark's GPU side: inputs, timings, fla-core's handling, the run loops.

Per case: each call (chunkstate's, in one pass or in explicit pieces where asked, and fla's) is
first called once, synchronised and timed on the wall clock (compiles and autotuning included;
``compiled`` counts the kernels it compiled); then all are timed together in ``ROUNDS``
interleaved rounds of ``triton.testing.do_bench`` (``interleaved``), each reported as the median
of its rounds' medians; and how far ours is from fla's result. Every shape is autotuned afresh
for both: the autotuners' caches are cleared before
each shape (fla's key holds no B, T, H, so otherwise the first shape's winner would serve all).
fla's list is cut to the 8 configs of ``model.FLA_CONFIGS`` unless asked for all 48.

Only the benchmark imports this module: the exercises, figures and notebooks read ``model``.
"""
from __future__ import annotations

import datetime
import hashlib
import importlib.metadata
import itertools
import os
import platform
import random
import statistics
import subprocess
import sys
import time
import types
from pathlib import Path

import torch
import triton

from .. import _host, pieces, tuning
from ..testing import find_autotuners, find_jit_functions, n_compiled, rel_err
from .model import (BT, FLA_CONFIGS, HOST_PROBE, Case, Shape, case_pieces, derive, explicit_pieces, new_result,
                    tried_configs, unique_bytes)
from .report import (case_line, format_random_summary, format_summary, format_sweep, format_table, gpu_tag,
                     output_paths, write_json, write_png)

WARMUP_MS, REP_MS = 10, 50  # do_bench per single measurement (host probes, sweeps, --calibrate)
# A case's calls are timed in rounds, interleaved (``interleaved``): five rounds of 2 + 10 ms take
# what one 10 + 50 ms measurement took. A call under ~0.1 ms of GPU work is timed at the host's pace,
# and on the H200 machines that pace moved by up to 2x between measurements a second apart
# (figures/README.md, "2026-12-04, session 16"): timed one after the other, two libraries can be
# timed in different host states; interleaved, each sees the same ones.
ROUNDS = 5
ROUND_WARMUP_MS, ROUND_REP_MS = 2, 10
ROUND_HOST_CALLS = 10  # per round, after its do_bench, the host's time per call of each call (host_time_us)
COPY_BYTES = 1 << 30  # the copy-bandwidth probe copies 1 GiB (2 GiB moved)


# ---------------------------------------------------------------- measuring

def do_bench(fn, warmup: float = WARMUP_MS, rep: float = REP_MS) -> dict:
    """Median, 20th and 80th percentile milliseconds of ``fn`` (``triton.testing.do_bench`` with
    ``warmup`` and ``rep`` ms)."""
    q = triton.testing.do_bench(fn, warmup=warmup, rep=rep, quantiles=(0.5, 0.2, 0.8))
    return {"ms": q[0], "p20": q[1], "p80": q[2]}


def round_orders(names: list, rounds: int, seed: str = "") -> list[list]:
    """The order of ``names`` in each of ``rounds`` rounds: a shuffle per round, seeded by ``seed``
    (a case's label) and the round, so the same case is timed in the same orders in every process.

    Not a rotation: rotating keeps every call behind the same neighbour in all but one round, so
    whatever a neighbour does to the next call's time lands in every round of a case, and its
    medians cannot wash it out. In the four stored random runs timed in rotated rounds, a call the
    default kept in one pass ran behind fla-core, and its explicit twin (``pieces=1``, the same
    launch) right behind it, in most rounds (four of five with four calls); paired by round
    (``model.twin_ratio``), the twin came out more than 3 % faster in 23 of 76 cases and more than
    3 % slower in none, where two identical launches should differ either way alike (still 3 of 19
    and none in the run made after ``pieces.choose`` stopped asking its cached model for a full
    grid; figures/README.md, "session 20"). Shuffled, every call meets every neighbour by chance,
    and a neighbour's effect is noise the median over the rounds absorbs.
    """
    out = []
    for r in range(rounds):
        order = list(names)
        random.Random(f"{seed}|{r}").shuffle(order)  # a str seed is hashed by sha512: the same in every process
        out.append(order)
    return out


def interleaved(fns: dict, rounds: int = ROUNDS, seed: str = "") -> dict:
    """Time each of ``fns`` (name -> a no-argument function, each called once before) in ``rounds``
    rounds of ``do_bench(ROUND_WARMUP_MS, ROUND_REP_MS)``, every function once per round, in the
    orders ``round_orders(names, rounds, seed)`` gives. Returns, by name, ``ms``, ``p20`` and
    ``p80``: the medians over the rounds of each round's; ``rounds``: each round's median; ``after``:
    per round, the function timed just before it (None: first in its round); ``host_us``: the median
    over the rounds of the host's time per call (``host_time_us`` of ``ROUND_HOST_CALLS`` calls,
    right after the round's ``do_bench``), and ``host_rounds`` each round's. Host time beyond what
    ``do_bench``'s cache clear hides (``cache_clear_us``) is timed as the call's. A function that
    raises is timed no more and gets ``{"error": ...}``."""
    names = list(fns)
    per = {n: [] for n in names}
    host = {n: [] for n in names}
    after = {n: [] for n in names}
    errors = {}
    for order in round_orders(names, rounds, seed):
        previous = None
        for n in order:
            if n in errors:
                continue
            try:
                timing = do_bench(fns[n], warmup=ROUND_WARMUP_MS, rep=ROUND_REP_MS)
                host_us = host_time_us(fns[n], calls=ROUND_HOST_CALLS)
            except Exception as e:
                errors[n] = f"{type(e).__name__}: {str(e)[:500]}"
                continue
            per[n].append(timing)
            host[n].append(host_us)
            after[n].append(previous)
            previous = n
    out = {}
    for n in names:
        if n in errors:
            out[n] = {"error": errors[n]}
            continue
        out[n] = {q: statistics.median(t[q] for t in per[n]) for q in ("ms", "p20", "p80")}
        out[n]["rounds"] = [t["ms"] for t in per[n]]
        out[n]["after"] = after[n]
        out[n]["host_us"] = statistics.median(host[n])
        out[n]["host_rounds"] = host[n]
    return out


def bench_call(lib, case, inp, **extra) -> dict:
    """``do_bench`` of ``case`` through ``lib`` after one untimed call (compiles and autotunes):
    ``call``'s function, timed as every measurement here is."""
    fn = call(lib, case, inp, **extra)
    fn()
    return do_bench(fn)


def copy_bandwidth(nbytes: int = COPY_BYTES) -> dict:
    """Read + write bytes / median time of a torch copy of ``nbytes``."""
    src = torch.ones(nbytes // 4, dtype=torch.float32, device="cuda")
    dst = torch.empty_like(src)
    t = do_bench(lambda: dst.copy_(src))
    src = dst = None  # give the 2 GiB back before the cases run
    torch.cuda.empty_cache()
    return {"bytes": nbytes, "ms": t["ms"], "tbps": 2 * nbytes / (t["ms"] * 1e-3) / 1e12}


class Inputs:
    """One shape's tensors: x1 [B,T,H,K], x2 [B,T,H,V] are k, v (forward) and q, do (backward);
    gates, and the fp32 states of a case with ``final``, made on demand."""

    def __init__(self, shape: Shape, device: str = "cuda", dtype: torch.dtype = torch.bfloat16):
        from ..gates import chunk_local_cumsum

        self._cumsum = chunk_local_cumsum
        B, T, H, K, V = shape.B, shape.T, shape.H, shape.K, shape.V
        self.shape, self.device = shape, device
        self.x1 = (torch.randn(B, T, H, K, device=device) * K ** -0.5).to(dtype)
        self.x2 = torch.randn(B, T, H, V, device=device).to(dtype)
        self.cu = None
        if shape.lens:
            self.cu = torch.tensor([0, *itertools.accumulate(shape.lens)], dtype=torch.int32, device=device)
        self._gates = {}
        self._state = None

    def gate(self, name: str) -> dict:
        """The gate keyword argument of a case: ``{}`` for "none"; g or gk: chunk-local cumsums (log2,
        fp32) of natural-log gates logsigmoid(N(0, 1)); g_gamma: per-head log2 decays of
        log(1 − 2^−u), u uniform in [5, 10) (RetNet's per-head rates)."""
        if name == "none":
            return {}
        if name not in self._gates:
            s = self.shape
            if name == "g_gamma":
                u = torch.rand(s.H, device=self.device) * 5 + 5
                self._gates[name] = torch.log2(1 - torch.exp2(-u))
            else:
                size = (s.B, s.T, s.H) if name == "g" else (s.B, s.T, s.H, s.K)
                nat = torch.nn.functional.logsigmoid(torch.randn(size, device=self.device))
                self._gates[name] = self._cumsum(nat, BT, self.cu)
        return {name: self._gates[name]}

    def state(self) -> torch.Tensor:
        """A random fp32 [N, H, K, V] state: dht of a backward case with ``final``."""
        if self._state is None:
            s = self.shape
            self._state = torch.randn(s.N, s.H, s.K, s.V, device=self.device)
        return self._state


def call(lib, case: Case, inp: Inputs, **extra):
    """A no-argument function running ``case`` through ``lib`` (a module with chunk_fwd_h and
    chunk_bwd_dh), returning h / dh. The backward gets q as k and do as v: it reads their shapes only.
    ``case.final``: the forward returns ht too; the backward gets dht and an h0 (read for its presence
    only), so it stores dh0. ``extra``: more keyword arguments for the call (``pieces=1``, ``config=``)."""
    kw = {**inp.gate(case.gate), "cu_seqlens": inp.cu, "chunk_size": BT, "split_size": case.split,
          "states_in_fp32": case.states == "fp32", **extra}
    if case.direction == "fwd":
        if case.final:
            kw["output_final_state"] = True
        return lambda: lib.chunk_fwd_h(inp.x1, inp.x2, **kw)[0]
    scale = float(case.shape.K) ** -0.5
    state = inp.state() if case.final else None
    return lambda: lib.chunk_bwd_dh(inp.x1, inp.x1, inp.x2, inp.x2, h0=state, dht=state, scale=scale, **kw)[0]


def _sync():
    if torch.cuda.is_available():
        torch.cuda.synchronize()


def first_call(fn, jit_functions):
    """Run ``fn`` once, synchronised: (output, wall seconds, kernels compiled during it)."""
    before = n_compiled(jit_functions)
    _sync()
    t0 = time.perf_counter()
    out = fn()
    _sync()
    seconds = time.perf_counter() - t0
    after = n_compiled(jit_functions)
    return out, seconds, (after - before if before is not None and after is not None else None)


def agreement(ours: torch.Tensor, ref: torch.Tensor) -> float:
    """‖ours − ref‖ / ‖ref‖ on an evenly strided sample of at most 2^22 elements."""
    step = max(1, ours.numel() >> 22)
    return rel_err(ours.reshape(-1)[::step], ref.reshape(-1)[::step])


# ---------------------------------------------------------------- the two libraries

def restrict_configs(autotuner, wanted=FLA_CONFIGS) -> list[tuple]:
    """Keep only ``wanted`` (BK, BV, warps, stages) among an autotuner's own configs; return the kept."""
    kept = [c for c in autotuner.configs if tuning.config_tuple(c)[:4] in wanted]
    if kept:
        autotuner.configs = kept
    return [tuning.config_tuple(c)[:4] for c in autotuner.configs]


class Libraries:
    """chunkstate and (if importable) fla-core: the entry points, autotuners and JIT functions."""

    def __init__(self, fla_all_configs: bool, with_fla: bool = True):
        from .. import backward, forward

        mods = [forward, backward, pieces]
        self.ours = types.SimpleNamespace(chunk_fwd_h=forward.chunk_fwd_h, chunk_bwd_dh=backward.chunk_bwd_dh)
        self.ours_autotuners = find_autotuners(*mods)
        self.ours_jit = find_jit_functions(*mods)
        for at in self.ours_autotuners:
            at.cache_results = False  # tune in memory only: each shape afresh

        self.fla = None
        self.fla_info = {"available": False}
        self.fla_autotuners, self.fla_jit = [], []
        if not with_fla:
            self.fla_info["error"] = "not asked for"
            return
        # fla caches autotune results on disk (keyed without B, T, H): off, so every shape is tuned.
        os.environ["FLA_CACHE_RESULTS"] = "0"
        try:
            from fla.ops.common import chunk_h

            self.fla = chunk_h
        except Exception as e:
            self.fla_info["error"] = f"{type(e).__name__}: {e}"
            return
        self.fla_autotuners = find_autotuners(chunk_h)
        self.fla_jit = find_jit_functions(chunk_h)
        kept = {}
        for at in self.fla_autotuners:
            at.cache_results = False
            if hasattr(at, "_do_bench"):  # time fla's candidates as chunkstate's autotuner times its own
                at._do_bench = tuning.autotune_timing
            name = getattr(getattr(at, "base_fn", None), "__name__", f"autotuner {len(kept)}")
            kept[name] = ([tuning.config_tuple(c)[:4] for c in at.configs] if fla_all_configs
                          else restrict_configs(at))
        counts = sorted({len(v) for v in kept.values()})
        note = (f"all of fla's own configs ({'/'.join(map(str, counts))})" if fla_all_configs else
                f"restricted to {'/'.join(map(str, counts))} of its 48 configs (H200 winners; "
                "--fla-all-configs keeps all)")
        self.fla_info = {"available": True, "all_configs": fla_all_configs, "configs": kept,
                         "configs_note": note + "; its autotune disk cache off, tuned per shape, each candidate "
                         "timed as chunkstate's (tuning.autotune_timing)",
                         "autotuners_found": len(self.fla_autotuners)}

    def clear_autotune_caches(self):
        for at in self.ours_autotuners + self.fla_autotuners:
            at.cache.clear()


# ---------------------------------------------------------------- one case

def _first(lib, jit, case, inp, **extra) -> tuple[dict, torch.Tensor | None, object]:
    """The first call of one library on one case (it compiles and autotunes): its entry (wall
    seconds, kernels compiled), its output and the call to time after (None where it failed: the
    error is recorded, not raised)."""
    try:
        fn = call(lib, case, inp, **extra)
        out, seconds, compiled = first_call(fn, jit)
        return {"first_call_s": seconds, "compiled": compiled}, out, fn
    except Exception as e:
        return {"error": f"{type(e).__name__}: {str(e)[:500]}"}, None, None


def _configs_run(autotuners, first):
    """Run ``first()`` (a ``_first`` call) and add to its entry, under ``"configs"``, the config
    each of these autotuners ran last, by kernel name: (BK, BV, warps, stages, USE_TMA). With
    pieces a kernel's autotuner runs twice (two keys); the entry holds the storing pass's config."""
    for at in autotuners:
        at.best_config = None
    entry, out, fn = first()
    chosen = {getattr(getattr(at, "base_fn", None), "__name__", "kernel"): list(tuning.config_tuple(at.best_config))
              for at in autotuners if getattr(at, "best_config", None) is not None}
    if chosen and "error" not in entry:
        entry["configs"] = chosen
    return entry, out, fn


def one_pass_too(case: Case, explore) -> bool:
    """Whether ``run_case`` times a case's call in one pass beside chunkstate's own: chunkstate cuts
    it into pieces and the explicit counts ``explore`` hold no 1."""
    return case_pieces(case) > 1 and 1 not in explore


def run_case(case: Case, inp: Inputs, libs: Libraries, copy_tbps: float, explore: list[int] = ()) -> dict:
    """Time ``case`` for chunkstate (and in one pass too where it is cut into pieces) and fla;
    ``explore``: piece counts to time too, explicitly (``pieces=P``; the random mode). Every call
    is first called once, then all are timed together in interleaved rounds (``interleaved``).
    Returns the result record with its derived numbers (``model.derive``)."""
    r = new_result(case, case_pieces(case))
    ours_at, fla_at = getattr(libs, "ours_autotuners", []), getattr(libs, "fla_autotuners", [])
    calls = {}  # what to time: the result's slot (or "pieces=P") -> the call
    pieces.clear_choices()  # each case's first call chooses its count as a new process's would
    r["ours"], out, calls["ours"] = _configs_run(ours_at, lambda: _first(libs.ours, libs.ours_jit, case, inp))
    kept = list(pieces.choices().values())
    if kept:  # the cut was open to the first call (pieces.choose): it runs in the count it kept
        r["pieces_model"], r["pieces"] = r["pieces"], kept[0]
    trials = list(pieces.trial_times().values())
    if trials:  # that count was timed (not the one pass too short to cut): what the timing measured
        r["pieces_trial_ms"] = {str(P): ms for P, ms in trials[0].items()}
        r["pieces_trial_attempts"] = next(iter(pieces.trial_attempts().values()), None)  # 1: its first was steady
    ours_ran = calls["ours"] is not None
    if one_pass_too(case, explore) and ours_ran:  # what the pieces bought (or cost)
        r["ours_one_pass"], _, calls["ours_one_pass"] = _configs_run(
            ours_at, lambda: _first(libs.ours, libs.ours_jit, case, inp, pieces=1))
    explicit = {}
    if explore and ours_ran:
        for P in explore:  # each count's configs too: its tiles set how many programs its pieces launch
            explicit[P], _, calls[f"pieces={P}"] = _configs_run(
                ours_at, lambda P=P: _first(libs.ours, libs.ours_jit, case, inp, pieces=P))
    ref = None
    if libs.fla is not None:
        r["fla"], ref, calls["fla"] = _configs_run(fla_at, lambda: _first(libs.fla, libs.fla_jit, case, inp))
        r["fla"]["valid"] = case.fla_valid
        if not case.fla_valid:
            r["fla"]["note"] = "fla wrong: its backward with split_size > chunk_size stores the wrong gradient"
        if out is not None and ref is not None:
            try:
                r["agree_rel_err"] = agreement(out, ref)
            except Exception as e:  # e.g. different shapes: recorded, the timings stand
                r["agree_error"] = f"{type(e).__name__}: {str(e)[:300]}"
    del out, ref
    timed = interleaved({name: fn for name, fn in calls.items() if fn is not None}, seed=case.label)
    for slot in ("ours", "ours_one_pass", "fla"):
        if slot in timed:
            r[slot].update(timed[slot])
    if explicit:
        r["pieces_ms"], r["pieces_rounds"], r["pieces_after"], r["pieces_configs"] = {}, {}, {}, {}
        r["pieces_host_us"] = {}
        for P, entry in explicit.items():
            entry.update(timed.get(f"pieces={P}", {}))
            r["pieces_ms"][str(P)] = entry.get("ms")
            r["pieces_rounds"][str(P)] = entry.get("rounds")
            r["pieces_after"][str(P)] = entry.get("after")
            r["pieces_configs"][str(P)] = entry.get("configs")
            r["pieces_host_us"][str(P)] = entry.get("host_us")
            if P == 1:
                r["ours_one_pass"] = entry
    return derive(r, copy_tbps)


# ---------------------------------------------------------------- progress and metadata

class Progress:
    """A tqdm bar on stderr when tqdm is importable, else one counter line per case."""

    def __init__(self, total: int, desc: str):
        try:
            from tqdm import tqdm
        except ImportError:
            tqdm = None
        self.bar = tqdm(total=total, desc=desc, unit="case", file=sys.stderr, dynamic_ncols=True) if tqdm else None
        self.total, self.done, self.t0 = total, 0, time.perf_counter()

    def start(self, label: str):
        if self.bar is not None:
            self.bar.set_postfix_str(label)
        else:
            print(f"[{self.done + 1}/{self.total}] {label} ...", file=sys.stderr, flush=True)

    def finish(self, line: str):
        self.done += 1
        if self.bar is not None:
            self.bar.write(line, file=sys.stderr)
            self.bar.update(1)
        else:
            print(f"[{self.done}/{self.total}] {line} ({time.perf_counter() - self.t0:.0f} s)", file=sys.stderr,
                  flush=True)

    def close(self):
        if self.bar is not None:
            self.bar.close()


def _versions() -> dict:
    v = {"python": platform.python_version(), "torch": torch.__version__, "triton": triton.__version__}
    for name, dist in (("fla", "fla-core"), ("chunkstate", "chunkstate")):
        try:
            v[name] = importlib.metadata.version(dist)
        except importlib.metadata.PackageNotFoundError:
            v[name] = None
    try:  # the commit of the checkout this package was imported from, if it is one ("-dirty": files changed since)
        v["git"] = subprocess.run(["git", "describe", "--always", "--dirty", "--abbrev=7"], cwd=Path(__file__).parent,
                                  capture_output=True, text=True, timeout=10).stdout.strip() or None
    except Exception:
        v["git"] = None
    v["source"] = source_digest()
    return v


def source_digest(package: Path = Path(__file__).parents[1]) -> str:
    """The first 12 hex digits of a SHA-256 over the package's Python sources (relative paths and
    contents, in path order): which code a report measured, also where the checkout's ``.git`` is
    missing or lags its files (as on a machine the tree was copied to)."""
    h = hashlib.sha256()
    for path in sorted(package.rglob("*.py")):
        if "__pycache__" in path.parts:
            continue
        h.update(path.relative_to(package).as_posix().encode() + b"\0" + path.read_bytes() + b"\0")
    return h.hexdigest()[:12]


def _device() -> dict:
    if not torch.cuda.is_available():
        return {"name": "CPU"}
    props = torch.cuda.get_device_properties(torch.cuda.current_device())
    return {"name": props.name, "sms": props.multi_processor_count, "memory_gib": round(props.total_memory / 2**30, 1)}


def gpu_here() -> str:
    """This machine's GPU as the benchmark's file names call it (``report.gpu_tag``): "h200" on an
    H200, "cpu" without a GPU."""
    return gpu_tag(_device()["name"])


def _host_cpu() -> dict:
    """The host's CPU: calls of under ~0.1 ms of GPU work take the host's time per call, which differs
    between machines that hold the same GPU."""
    name = platform.processor() or None
    try:
        with open("/proc/cpuinfo") as f:
            name = next((line.split(":", 1)[1].strip() for line in f if line.startswith("model name")), name)
    except OSError:
        pass
    return {"cpu": name, "cores": os.cpu_count()}


def run_info(mode: str, cache: dict) -> dict:
    """What every report records about its run: date, mode, command line, device, host CPU, versions
    and Triton's cache dir (``cache``: ``{"fresh", "dir"}``)."""
    return {"date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
            "mode": mode, "argv": sys.argv[1:], "device": _device(), "host": _host_cpu(), "versions": _versions(),
            "triton_cache": cache}


def metadata(mode: str, copy: dict | None, libs: Libraries | None, cache: dict) -> dict:
    """``run_info``, and the copy probe, how each case is timed, its inputs and bytes, and fla's tuning."""
    return {**run_info(mode, cache), "copy": copy,
            "do_bench": {"rounds": ROUNDS, "warmup_ms": ROUND_WARMUP_MS, "rep_ms": ROUND_REP_MS,
                         "statistic": "per call, the median over the rounds of each round's median (p20, p80 "
                                      "likewise); a case's calls interleaved, each round in its own shuffled "
                                      "order (round_orders, seeded by the case)",
                         "host_us": f"per call, the median over the rounds of the host's time per call (a sync "
                                    f"before each, {ROUND_HOST_CALLS} calls right after the round's do_bench)"},
            "BT": BT, "inputs": "bf16 k, v / q, do; fp32 gates (chunk-local log2 cumsums); no h0, ht, dht",
            "bytes_model": " ".join(unique_bytes.__doc__.split()),
            "fla": libs.fla_info if libs else None}


HOST_CALLS = 100  # calls per host-time measurement (host_time_us)


def host_time_us(fn, calls: int | None = None) -> float:
    """The host's time per call of ``fn`` (called once before): the median, over ``calls`` calls
    (default ``HOST_CALLS``), of the wall µs from the call to its return, the GPU idle before each
    (a sync). Unlike ``do_bench``, nothing the GPU does overlaps it."""
    times = []
    for _ in range(HOST_CALLS if calls is None else calls):
        _sync()
        t0 = time.perf_counter()
        fn()
        times.append((time.perf_counter() - t0) * 1e6)
    _sync()
    return statistics.median(times)


def cache_clear_us() -> float | None:
    """The GPU time of the L2 clear ``do_bench`` runs before each timed call (Triton's 256 MB
    buffer, zeroed): host time before a call's launch hides behind it, and beyond it is timed as the
    call's (figures/README.md, session 23). None where Triton has no GPU driver (the interpreter)."""
    try:
        cache = triton.runtime.driver.active.get_empty_cache_for_benchmark()
    except RuntimeError:  # "0 active drivers": no GPU
        return None
    return do_bench(cache.zero_)["ms"] * 1e3


def host_probe(lib, fla=None) -> dict:
    """On a shape whose GPU work is a few µs (``HOST_PROBE``, also ``--calibrate``'s: host-bound
    calls), in this process, per direction: ``do_bench`` µs of one pass and of a call in 2 pieces (the
    fixed costs of the pieces model as this run pays them, beside ``pieces.COSTS``, which
    ``--calibrate`` measured in a process of its own), and under ``host_us`` the host's own time per
    call (``host_time_us``); with ``fla`` (a library), the same two for its call under ``"fla"``;
    and ``cache_clear_us``, how much host time ``do_bench`` hides (``cache_clear_us()``). Errors
    are recorded, not raised."""
    s = HOST_PROBE
    out = {"shape": s.label, "model_us": {d: {"pieces=1": c.one_pass_fixed_us, "pieces=2": c.fixed_us}
                                          for d, c in pieces.COSTS.items()}}
    try:
        out["cache_clear_us"] = cache_clear_us()
        inp = Inputs(s)

        def both(library, direction, **extra):  # (do_bench µs, the host's µs) of one call
            fn = call(library, Case(s, direction, final=True), inp, **extra)
            fn()
            return do_bench(fn)["ms"] * 1e3, host_time_us(fn)

        out["host_us"] = {}
        for direction in ("fwd", "bwd"):
            out[direction], out["host_us"][direction] = {}, {}
            for P in (1, 2):
                out[direction][f"pieces={P}"], out["host_us"][direction][f"pieces={P}"] = both(lib, direction, pieces=P)
        if fla is not None:
            out["fla"] = {d: dict(zip(("do_bench_us", "host_us"), both(fla, d))) for d in ("fwd", "bwd")}
    except Exception as e:
        out["error"] = f"{type(e).__name__}: {str(e)[:300]}"
    return out


def format_host_probe(probe: dict, when: str) -> str:
    if "error" in probe:
        return f"host probe ({when}): {probe['error']}"
    parts = [f"{d} one pass {probe[d]['pieces=1']:.0f} µs, 2 pieces {probe[d]['pieces=2']:.0f} µs "
             f"(pieces.COSTS: {probe['model_us'][d]['pieces=1']:.0f}, {probe['model_us'][d]['pieces=2']:.0f})"
             for d in ("fwd", "bwd")]
    line = f"host probe ({when}, {probe['shape']}): " + "; ".join(parts)
    if "host_us" in probe:
        host = probe["host_us"]
        line += "; the host's time per call, one pass / 2 pieces: " + ", ".join(
            f"{d} {host[d]['pieces=1']:.0f} / {host[d]['pieces=2']:.0f} µs" for d in ("fwd", "bwd"))
    if "fla" in probe:
        line += "; fla, do_bench / host: " + ", ".join(
            f"{d} {probe['fla'][d]['do_bench_us']:.0f} / {probe['fla'][d]['host_us']:.0f} µs" for d in ("fwd", "bwd"))
    if probe.get("cache_clear_us") is not None:
        line += f"; do_bench's cache clear {probe['cache_clear_us']:.0f} µs"
    return line


# ---------------------------------------------------------------- runs

def run_cases(cases: list[Case], args, mode: str, cache: dict, random_meta: dict | None = None) -> dict:
    """Time ``cases`` shape by shape (``args``: ``out``, ``budget``, ``fla_all_configs``), writing
    the JSON after every case, then the table, the summary and the figure. ``random_meta`` (the
    random mode: seed, n, distribution): also time explicit piece counts (``explicit_pieces``) and
    name the files after the seed."""
    copy = copy_bandwidth()
    libs = Libraries(args.fla_all_configs)
    if libs.fla is None:
        print(f"fla-core is not importable ({libs.fla_info['error']}): timing chunkstate alone", file=sys.stderr)
    report = {"meta": metadata(mode, copy, libs, cache), "cases": []}
    if random_meta:  # what this process pays per small call, before and after the cases
        report["meta"]["random"] = random_meta
        report["meta"]["host_probe"] = {"start": host_probe(libs.ours, libs.fla)}
        print(format_host_probe(report["meta"]["host_probe"]["start"], "start"), flush=True)
    json_path, png_path = output_paths(args.out, f"random_s{random_meta['seed']}" if random_meta else mode,
                                       gpu_here())
    sms = tuning.sm_count()
    progress = Progress(len(cases), f"chunkstate.bench {mode}")
    t0 = time.perf_counter()
    try:
        for shape, group in itertools.groupby(cases, key=lambda c: c.shape):
            group = list(group)
            if args.budget and time.perf_counter() - t0 > args.budget:
                for case in group:
                    r = new_result(case, case_pieces(case))
                    r["skipped"] = f"budget {args.budget:.0f} s spent"
                    report["cases"].append(r)
                    progress.finish(f"{case.label}: skipped (budget)")
                continue
            libs.clear_autotune_caches()  # every shape tuned afresh, for both libraries
            inp = Inputs(shape)
            for case in group:
                progress.start(case.label)
                explore = explicit_pieces(case, sms) if random_meta else []
                r = run_case(case, inp, libs, copy["tbps"], explore)
                report["cases"].append(r)
                write_json(report, json_path)
                progress.finish(case_line(r))
            del inp
            torch.cuda.empty_cache()
    finally:
        progress.close()
        report["meta"]["wall_s"] = time.perf_counter() - t0
        if random_meta:
            libs.clear_autotune_caches()
            report["meta"]["host_probe"]["end"] = host_probe(libs.ours, libs.fla)
            print(format_host_probe(report["meta"]["host_probe"]["end"], "end"), flush=True)
        write_json(report, json_path)
    print(format_table(report["cases"]))
    print(format_summary(report))
    if random_meta:
        print(format_random_summary(report))
    try:
        write_png(report, png_path)
    except Exception as e:  # the numbers are in the JSON; a plotting problem must not lose them
        print(f"could not draw {png_path}: {type(e).__name__}: {e}", file=sys.stderr)
    print(f"wrote {json_path} and {png_path}")
    return report


def warm_cases(cases: list[Case], args, random_meta: dict | None = None) -> list[str]:
    """First-call every call ``run_cases`` would time for ``cases`` — chunkstate's, the random mode's
    explicit piece counts (``explicit_pieces``) or one pass where a case is cut, and fla's — so that
    each compiles and autotunes, and do nothing else: no copy or host probe, no timed rounds, no
    files (``--warm``: run before a timed run with ``--keep-cache``, it fills Triton's cache, and
    several can run side by side, each on a ``--shard``). ``args.budget`` stops it between shapes,
    as it stops ``run_cases``. Returns one line per case, also printed: its calls, and their errors."""
    libs = Libraries(args.fla_all_configs)
    sms = tuning.sm_count()
    lines, t0 = [], time.perf_counter()
    for shape, group in itertools.groupby(cases, key=lambda c: c.shape):
        if args.budget and time.perf_counter() - t0 > args.budget:
            break
        libs.clear_autotune_caches()  # as run_cases: each shape tuned afresh
        inp = Inputs(shape)
        for case in group:
            counts = explicit_pieces(case, sms) if random_meta else []
            if one_pass_too(case, counts):
                counts = [1] + counts
            calls = [(libs.ours, libs.ours_jit, {})] + [(libs.ours, libs.ours_jit, {"pieces": P}) for P in counts]
            if libs.fla is not None:
                calls.append((libs.fla, libs.fla_jit, {}))
            errors = [entry["error"] for entry in (_first(lib, jit, case, inp, **kw)[0] for lib, jit, kw in calls)
                      if "error" in entry]
            lines.append(f"warm {case.label}: {len(calls)} calls"
                         + (f"; errors: {'; '.join(errors)}" if errors else ""))
            print(lines[-1], flush=True)
        del inp
        torch.cuda.empty_cache()
    return lines


def sweep_configs(K: int, V: int) -> list:
    """The configs of ``tuning.ALL_CONFIGS`` a sweep times for a [K, V] state: tiles no wider than
    K and V need (a wider one only computes masked zeros)."""
    k, v = max(16, _host.next_power_of_2(K)), max(16, _host.next_power_of_2(V))
    return [c for c in tuning.ALL_CONFIGS if c.kwargs["BK"] <= k and c.kwargs["BV"] <= v]


def run_sweep(shapes, args, cache: dict, gates=None) -> dict:
    """Time every config of ``sweep_configs`` (bf16 states, split None, ``pieces=1``) per shape and
    direction, each shape with its gate of ``gates`` (default g); the JSON keeps all timings and
    the top 8 with the autotuner's candidates marked."""
    gates = list(gates) if gates is not None else ["g"] * len(shapes)
    copy = copy_bandwidth()
    libs = Libraries(fla_all_configs=False, with_fla=False)
    report = {"meta": metadata("sweep", copy, None, cache), "sweep": []}
    json_path, _ = output_paths(args.out, "sweep", gpu_here())
    progress = Progress(len(shapes) * 2, "chunkstate.bench sweep")
    try:
        for shape, gate in zip(shapes, gates):
            inp = Inputs(shape)
            for direction in ("fwd", "bwd"):
                case = Case(shape, direction, gate=gate)
                progress.start(case.label)
                bucket = tuning.launch_bucket(shape.N, shape.H, shape.K, shape.V)
                total = sum(unique_bytes(case).values())
                timings = []
                for cfg in sweep_configs(shape.K, shape.V):
                    fn = call(libs.ours, case, inp, pieces=1, config=cfg)
                    entry = {"config": list(tuning.config_tuple(cfg))}
                    try:
                        fn()
                        entry.update(do_bench(fn))
                        entry["tbps"] = total / (entry["ms"] * 1e-3) / 1e12
                    except Exception as e:
                        entry.update(ms=None, error=f"{type(e).__name__}: {str(e)[:300]}")
                    timings.append(entry)
                ranked = sorted((t for t in timings if t.get("ms")), key=lambda t: t["ms"])
                chosen = [list(t) for t in tried_configs(shape.K, shape.V, bucket, case.gate)]
                for t in ranked[:8]:
                    t["candidate"] = t["config"] in chosen
                report["sweep"].append({"case": case.label, "shape": shape.label, "direction": direction, "gate": gate,
                                        "occupancy_bucket": bucket, "total_bytes": total, "candidates": chosen,
                                        "top": ranked[:8], "timings": timings})
                write_json(report, json_path)
                best = ", ".join(f"{tuple(t['config'])}{'*' if t['candidate'] else ''} {t['ms']:.3f}"
                                 for t in ranked[:5])
                progress.finish(f"{case.label} (bucket {bucket}): {best}")
            del inp
            torch.cuda.empty_cache()
    finally:
        progress.close()
        write_json(report, json_path)
    print(format_sweep(report))
    print(f"wrote {json_path}")
    return report
