"""Benchmark chunkstate's ``chunk_fwd_h`` / ``chunk_bwd_dh`` against fla-core 0.6.0 and the memory roof.

Run ``python -m chunkstate.bench [--quick | --full | --sweep | --plan]`` on a CUDA GPU.

Both kernels only stream: the forward reads k, v and the gates once and writes one state per
split; the backward reads q, do and the gates and writes one gradient per split. So the yardstick
is the device's copy bandwidth, measured in the same run (a torch copy of 1 GiB, read + write
bytes / median time)::

    effective TB/s = unique bytes / time        floor = unique bytes / copy bandwidth
    ×floor         = time / floor               (1 = at the copy roof; lower is better)

Unique bytes (``unique_bytes``) count every tensor a kernel must touch exactly once. Forward:
reads k, v (inputs' dtype), the gate (fp32), h0 if any; writes h (the states' dtype) and ht if
any (fp32). Backward: reads q, do, the gate, dht if any; writes dh and dh0 if any; it never reads
k or v (they only carry shapes). This benchmark passes no h0 / ht / dht / dh0.

Modes:
  default   every shape × {fwd, bwd} with gate g, bf16 states, split None; plus, for three shapes
            (B8 T4096 H16, B1 T65536 H32, B1 T65536 H8), gate gk, fp32 states and split 256, each
            varied alone (40 cases).
  --quick   four cases (two shapes × fwd, bwd).
  --full    every shape × {fwd, bwd} × {g, gk} × {bf16, fp32} × {None, 256} (176 cases).
  --sweep   every config of ``_tuning.ALL_CONFIGS`` (through ``config=``, forward with ``pieces=1``)
            on a few shapes, fwd and bwd: the timings ``_tuning.candidates`` is chosen from.
  --plan    print the cases, their bytes and an estimate of the GPU time, then exit (no GPU needed).
Options: ``--out DIR`` (default figures/), ``--keep-cache``, ``--fla-all-configs``, ``--shapes LABEL..``
(only shapes whose label contains one of these), ``--budget S`` (start no new shape after S seconds).

Per case: medians of ``triton.testing.do_bench(warmup=10, rep=50)`` for chunkstate and fla, the
pieces chunkstate chose (``pieces.auto_pieces``, as the wrapper calls it), the first call's wall
time (compile + autotune; a fresh ``TRITON_CACHE_DIR`` unless ``--keep-cache``, so the first case
of each specialization pays its compiles: marked ``*``), and how far ours is from fla's result.
Every shape is autotuned afresh for both: the autotuners' caches are cleared before each shape
(fla's key holds no B, T, H, so otherwise the first shape's winner would serve all). fla's 48
configs cost ~40 s of compiles per specialization, so its list is cut to 8 winners measured on an
H200 (``FLA_CONFIGS``; ``--fla-all-configs`` keeps all 48). fla's backward with split_size >
chunk_size stores the wrong gradient (a known bug): it is timed, marked "fla wrong", and left out
of the comparison; fla's GQA is never used (HQ = H). Outputs: a table on stdout, ``<out>/bench_h200[_quick|_full|_sweep].json``
(rewritten after every case, so an interrupted run keeps what it measured) and a ``.png`` beside
it (``chunkstate.figures.speed``).
"""
from __future__ import annotations

import argparse
import datetime
import importlib.metadata
import inspect
import itertools
import json
import math
import os
import platform
import shutil
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

import torch
import triton

from . import _tuning
from . import pieces as _pieces
from .env import INTERPRET

BT = 64  # chunk size of every case
WARMUP_MS, REP_MS = 10, 50  # do_bench per measurement
COPY_BYTES = 1 << 30  # the copy-bandwidth probe copies 1 GiB (2 GiB moved)
STATE_BYTES = {"bf16": 2, "fp32": 4}
IN_BYTES = 2  # bf16 inputs
GATE_BYTES = 4  # fp32 gates
# fla's autotune space cut to 8 configs (BK, BV, num_warps, num_stages): winners on an H200.
FLA_CONFIGS = [(64, 64, 8, 4), (64, 64, 4, 4), (64, 64, 2, 3), (64, 64, 4, 2),
               (32, 32, 4, 4), (32, 32, 8, 4), (64, 32, 8, 4), (32, 64, 8, 3)]
DEFAULT_OUT = Path(__file__).resolve().parents[1] / "figures"
COPY_TBPS_GUESS = 4.26  # an H200's measured copy bandwidth (NOTES §5): only for --plan's floors


# ---------------------------------------------------------------- shapes and cases

@dataclass(frozen=True)
class Shape:
    """A problem size: B × T tokens, H heads, K = V = D; ``lens``: a packed batch (B = 1, T = Σ lens)."""
    B: int
    T: int
    H: int
    D: int = 128
    lens: tuple[int, ...] | None = None

    def __post_init__(self):
        if self.lens is not None and (self.B != 1 or sum(self.lens) != self.T):
            raise ValueError(f"a packed shape needs B = 1 and T = sum(lens), got B={self.B} T={self.T}")

    @property
    def N(self) -> int:
        return len(self.lens) if self.lens else self.B

    @property
    def lengths(self) -> list[int]:
        return list(self.lens) if self.lens else [self.T] * self.B

    @property
    def label(self) -> str:
        s = f"varlen N{self.N} T{self.T} H{self.H}" if self.lens else f"B{self.B} T{self.T} H{self.H}"
        return s if self.D == 128 else f"{s} D{self.D}"


@dataclass(frozen=True)
class Case:
    shape: Shape
    direction: str  # "fwd" | "bwd"
    gate: str = "g"  # "g" [B, T, H] | "gk" [B, T, H, K]
    states: str = "bf16"  # dtype of h / dh: "bf16" | "fp32"
    split: int | None = None  # split_size (None: BT)

    @property
    def BS(self) -> int:
        return BT if self.split is None else self.split

    @property
    def fla_valid(self) -> bool:
        """False where fla-core 0.6.0's result is known wrong: its backward with split > chunk."""
        return not (self.direction == "bwd" and self.BS > BT)

    @property
    def label(self) -> str:
        split = f" split {self.split}" if self.split else ""
        return f"{self.shape.label} {self.direction} {self.gate} {self.states}{split}"


VARLEN_LENS = (8192, 6000, 5000, 4096, 3500, 3000, 2000, 980)  # Σ = 32768, ragged chunk edges
OWN_SHAPES = (Shape(8, 4096, 16), Shape(1, 65536, 32), Shape(1, 65536, 8), Shape(1, 131072, 4),
              Shape(1, sum(VARLEN_LENS), 16, lens=VARLEN_LENS))
FLA_SHAPES = (Shape(1, 8192, 96), Shape(2, 16384, 16), Shape(4, 2048, 16), Shape(4, 4096, 64),
              Shape(8, 2048, 32, 256), Shape(8, 1024, 8, 64))  # fla's own benchmark shapes
SHAPES = OWN_SHAPES + FLA_SHAPES
VARIANT_SHAPES = OWN_SHAPES[:3]
QUICK_SHAPES = (OWN_SHAPES[0], OWN_SHAPES[2])
SWEEP_SHAPES = (OWN_SHAPES[2], OWN_SHAPES[1], OWN_SHAPES[0], FLA_SHAPES[3])  # N·H in grid buckets 0, 1, 2, 3


def select_shapes(shapes, wanted: list[str] | None):
    """The shapes whose label contains one of the ``wanted`` substrings (all when None)."""
    if not wanted:
        return tuple(shapes)
    return tuple(s for s in shapes if any(w in s.label for w in wanted))


def make_cases(mode: str = "default", wanted: list[str] | None = None) -> list[Case]:
    """The cases of a mode ("default", "quick", "full"), shape by shape; ``wanted`` filters shapes
    by label substring (from all shapes)."""
    dirs = ("fwd", "bwd")
    if mode == "quick":
        return [Case(s, d) for s in select_shapes(QUICK_SHAPES if not wanted else SHAPES, wanted) for d in dirs]
    shapes = select_shapes(SHAPES, wanted)
    if mode == "full":
        return [Case(s, d, g, st, sp) for s in shapes
                for d, g, st, sp in itertools.product(dirs, ("g", "gk"), ("bf16", "fp32"), (None, 256))]
    if mode != "default":
        raise ValueError(f"mode must be 'default', 'quick' or 'full', got {mode!r}")
    cases = []
    for s in shapes:
        cases += [Case(s, d) for d in dirs]
        if s in VARIANT_SHAPES:
            cases += [Case(s, d, gate="gk") for d in dirs]
            cases += [Case(s, d, states="fp32") for d in dirs]
            cases += [Case(s, d, split=256) for d in dirs]
    return cases


# ---------------------------------------------------------------- bytes, floors, derived numbers

def n_splits(shape: Shape, BS: int) -> int:
    """State slots stored: ``Σ_n ceil(L_n / BS)`` (dense: B · ceil(T / BS))."""
    return sum(-(-L // BS) for L in shape.lengths)


def unique_bytes(case: Case, h0: bool = False, final: bool = False) -> dict[str, int]:
    """Bytes a kernel must move at least once, per tensor.

    Forward: reads k [B,T,H,K], v [B,T,H,V] (bf16), the gate (fp32: g [B,T,H] or gk [B,T,H,K]),
    h0 [N,H,K,V] (fp32) if ``h0``; writes h [NS,H,K,V] (the states' dtype) and ht [N,H,K,V] (fp32)
    if ``final``. Backward: reads q, do (bf16), the gate, dht (fp32) if ``final``; writes dh and
    dh0 (fp32) if ``h0``. The backward never reads k or v. NS = ``n_splits``; K = V = D.
    """
    s = case.shape
    K = V = s.D
    tokens = s.B * s.T * s.H
    gate = tokens * GATE_BYTES * (K if case.gate == "gk" else 1)
    states = n_splits(s, case.BS) * s.H * K * V * STATE_BYTES[case.states]
    one_state = s.N * s.H * K * V * 4
    if case.direction == "fwd":
        parts = {"k": tokens * K * IN_BYTES, "v": tokens * V * IN_BYTES, case.gate: gate}
        if h0:
            parts["h0"] = one_state
        parts["h"] = states
        if final:
            parts["ht"] = one_state
    else:
        parts = {"q": tokens * K * IN_BYTES, "do": tokens * V * IN_BYTES, case.gate: gate}
        if final:
            parts["dht"] = one_state
        parts["dh"] = states
        if h0:
            parts["dh0"] = one_state
    return parts


def _finite_or_none(x):
    return float(x) if x is not None and math.isfinite(x) else None


def derive(result: dict, copy_tbps: float) -> dict:
    """Fill a case's derived numbers from its raw timings: floor_ms, and per library
    tbps (= total bytes / ms), x_floor (= ms / floor_ms); fla_over_ours where fla's result is right."""
    total = result["total_bytes"]
    result["floor_ms"] = total / (copy_tbps * 1e12) * 1e3
    for who in ("ours", "ours_one_pass", "fla"):
        entry = result.get(who)
        if not entry:
            continue
        ms = _finite_or_none(entry.get("ms"))
        entry["ms"] = ms
        entry["tbps"] = total / (ms * 1e-3) / 1e12 if ms else None
        entry["x_floor"] = ms / result["floor_ms"] if ms else None
    ours, fla = result.get("ours") or {}, result.get("fla") or {}
    ok = fla.get("valid", False) and ours.get("ms") and fla.get("ms")
    result["fla_over_ours"] = fla["ms"] / ours["ms"] if ok else None
    return result


def new_result(case: Case, pieces: int) -> dict:
    """The JSON record of one case before timing."""
    s = case.shape
    parts = unique_bytes(case)
    return {"case": case.label, "shape": s.label, "B": s.B, "T": s.T, "H": s.H, "K": s.D, "V": s.D,
            "lens": list(s.lens) if s.lens else None, "direction": case.direction, "gate": case.gate,
            "states": case.states, "split": case.split, "BT": BT, "bytes": parts,
            "total_bytes": sum(parts.values()), "pieces": pieces, "ours": None, "fla": None}


def geomean(xs) -> float | None:
    xs = [x for x in xs if x]
    return math.exp(sum(math.log(x) for x in xs) / len(xs)) if xs else None


# ---------------------------------------------------------------- table

COLUMNS = ("shape", "dir", "gate", "states", "split", "ours ms", "TB/s", "×floor", "fla ms", "fla/ours",
           "pieces (1 pass ms)", "first s (ours/fla)")


def _fmt(x, spec):
    return "-" if x is None else format(x, spec)


def _first(entry):
    if not entry or entry.get("first_call_s") is None:
        return "-"
    return f"{entry['first_call_s']:.1f}" + ("*" if entry.get("compiled") else "")


def _pieces_cell(r: dict) -> str:
    """The pieces chosen, and where there were several, the same call's time in one pass."""
    one_pass = r.get("ours_one_pass") or {}
    if not one_pass:
        return str(r.get("pieces", "-"))
    return f"{r['pieces']} ({'error' if one_pass.get('error') else _fmt(one_pass.get('ms'), '.3f')})"


def table_rows(results: list[dict]) -> list[tuple[str, ...]]:
    rows = []
    for r in results:
        ours, fla = r.get("ours") or {}, r.get("fla") or {}
        if r.get("skipped"):
            ratio, ours_ms = "skipped", "-"
        else:
            ours_ms = _fmt(ours.get("ms"), ".3f") if not ours.get("error") else "error"
            if not fla:
                ratio = "-"
            elif fla.get("error"):
                ratio = "fla error"
            elif not fla.get("valid", True):
                ratio = "fla wrong"
            else:
                ratio = _fmt(r.get("fla_over_ours"), ".2f")
        rows.append((r["shape"], r["direction"], r["gate"], r["states"], str(r["split"] or "-"), ours_ms,
                     _fmt(ours.get("tbps"), ".2f"), _fmt(ours.get("x_floor"), ".2f"), _fmt(fla.get("ms"), ".3f"),
                     ratio, _pieces_cell(r), f"{_first(ours)}/{_first(fla)}"))
    return rows


def format_table(results: list[dict]) -> str:
    """A fixed-width table, one row per case (``*`` after a first-call time: it compiled kernels)."""
    rows = [COLUMNS] + table_rows(results)
    widths = [max(len(row[i]) for row in rows) for i in range(len(COLUMNS))]
    lines = ["  ".join(c.ljust(w) if i < 5 else c.rjust(w) for i, (c, w) in enumerate(zip(row, widths)))
             for row in rows]
    lines.insert(1, "  ".join("-" * w for w in widths))
    return "\n".join(lines)


def format_summary(report: dict) -> str:
    meta, results = report["meta"], report["cases"]
    lines = []
    copy = meta.get("copy") or {}
    if copy.get("tbps"):
        lines.append(f"copy bandwidth {copy['tbps']:.3f} TB/s (torch copy of {copy['bytes'] / 2**30:.0f} GiB, "
                     "read + write bytes / median time)")
    for d in ("fwd", "bwd"):
        g = geomean(r.get("fla_over_ours") for r in results if r["direction"] == d)
        xf = [r["ours"]["x_floor"] for r in results if r["direction"] == d and r.get("ours")
              and r["ours"].get("x_floor")]
        if g or xf:
            lo, hi = _fmt(min(xf, default=None), ".2f"), _fmt(max(xf, default=None), ".2f")
            lines.append(f"{d}: fla/ours geometric mean {_fmt(g, '.2f')} (>1: chunkstate faster); "
                         f"chunkstate ×floor {lo}..{hi}")
    fla = meta.get("fla") or {}
    lines.append("fla-core: " + (fla.get("configs_note") or "") if fla.get("available") else
                 f"fla-core not run: {fla.get('error', 'not importable')}")
    errors = [r["case"] for r in results if (r.get("ours") or {}).get("error") or (r.get("fla") or {}).get("error")]
    if errors:
        lines.append(f"errors in {len(errors)} case(s): " + "; ".join(errors) + " (see the JSON)")
    return "\n".join(lines)


# ---------------------------------------------------------------- JSON, figure

def _json_safe(x):
    if isinstance(x, float) and not math.isfinite(x):
        return None
    if isinstance(x, dict):
        return {k: _json_safe(v) for k, v in x.items()}
    if isinstance(x, (list, tuple)):
        return [_json_safe(v) for v in x]
    return x


def write_json(report: dict, path) -> Path:
    """Write ``report`` as JSON (non-finite numbers as null), atomically."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(".json.tmp")
    tmp.write_text(json.dumps(_json_safe(report), indent=1) + "\n")
    tmp.replace(path)
    return path


def write_png(report: dict, path) -> Path:
    import matplotlib

    matplotlib.use("Agg")
    from .figures import speed

    return speed.save_png(report, path)


def output_paths(out_dir, mode: str) -> tuple[Path, Path]:
    stem = "bench_h200" if mode == "default" else f"bench_h200_{mode}"
    return Path(out_dir) / f"{stem}.json", Path(out_dir) / f"{stem}.png"


# ---------------------------------------------------------------- plan: what compiles, an estimate

# Per-item costs on an H200 (NOTES §5: a first call tuning 48 configs took 34-49 s, 12 configs ~7 s:
# 0.6-1.0 s per config compiled and benchmarked).
COMPILE_S = 0.7  # one (specialization, config) compile
TUNE_S = 0.2  # the autotuner's do_bench of one candidate (25 ms warmup + 100 ms reps + L2 flushes)
MEASURE_S = 0.15  # one do_bench(warmup=10, rep=50) plus the first call and the agreement check
SHAPE_S = 1.0  # inputs and gates of one shape
STARTUP_S = 20.0  # imports, the copy probe, fla's import


def predicted_pieces(N: int, H: int, K: int, V: int, max_len: int, BS: int) -> int:
    """``pieces.auto_pieces`` as a GPU sees it (on CPU, as an H200 with 132 SMs would)."""
    if not INTERPRET:
        return _pieces.auto_pieces(N, H, K, V, max_len, BS)
    saved, _pieces.INTERPRET = _pieces.INTERPRET, False
    try:
        return _pieces.auto_pieces(N, H, K, V, max_len, BS)
    finally:
        _pieces.INTERPRET = saved


def _candidates(K: int, V: int, bucket: int, gate: str) -> list[tuple]:
    """The configs chunkstate's autotuner tries for one key of the benchmark's bf16 inputs (with TMA
    configs where this machine's GPU has a TMA; none without a GPU)."""
    tma = (torch.cuda.is_available() and _tuning.tma_device("cuda")
           and _tuning.tma_rows(K, 2) and _tuning.tma_rows(V, 2))
    args = {"K": K, "V": V, "GRID": bucket, "TMA_OK": int(tma), "USE_GK": gate == "gk"}
    return [_tuning.key(c) for c in _tuning.prune(_tuning.ALL_CONFIGS, args)]


def _backward_grid_specialised() -> bool:
    """Whether the backward kernel's GRID is a constexpr (each occupancy bucket compiles anew)."""
    try:
        from . import backward

        fn = backward.chunk_bwd_kernel_dh
        while not inspect.isfunction(fn):
            fn = fn.fn
        return "constexpr" in str(inspect.signature(fn).parameters["GRID"].annotation)
    except Exception:
        return True


def _backward_takes_pieces() -> bool:
    try:
        from .backward import chunk_bwd_dh
    except Exception:
        return False
    return "pieces" in inspect.signature(chunk_bwd_dh).parameters


def case_pieces(case: Case) -> int:
    """The pieces chunkstate's wrapper chooses for ``case`` (1 where the call takes no ``pieces``)."""
    s = case.shape
    if case.direction == "bwd" and not _backward_takes_pieces():
        return 1
    return predicted_pieces(s.N, s.H, s.D, s.D, max(s.lengths), case.BS)


def ours_launches(case: Case) -> list[tuple[tuple, list[tuple]]]:
    """The kernel launches of chunkstate's first call: (specialization key, configs it tries)."""
    s = case.shape
    K = V = s.D
    varlen = s.lens is not None
    if case.direction == "bwd":
        bucket = _tuning.grid_bucket(s.N * s.H)
        key = ("bwd", case.gate, case.states, case.BS, K, V, varlen)
        key += (bucket,) if _backward_grid_specialised() else ()
        return [(key, _candidates(K, V, bucket, case.gate))]
    P = case_pieces(case)
    base = ("fwd", case.gate, case.BS, K, V)
    if P == 1:
        return [((*base, case.states, varlen, "states"), _candidates(K, V, _tuning.grid_bucket(s.N * s.H), case.gate))]
    cu, _ = _pieces.plan(s.lengths, case.BS, P)
    bucket = _tuning.grid_bucket((len(cu) - 1) * s.H)
    return [((*base, "pieces: final states and decays"), _candidates(K, V, bucket, case.gate)),
            (("pieces: scan", K, V), [None]),
            ((*base, case.states, "pieces: states"), _candidates(K, V, bucket, case.gate))]


def fla_key(case: Case) -> tuple:
    return ("fla", case.direction, case.gate, case.states, case.BS, case.shape.D, case.shape.lens is not None)


def estimate(cases: list[Case], fla_configs: int | None = len(FLA_CONFIGS)) -> dict:
    """Compiles, autotune benchmarks and measurements a run of ``cases`` costs, and the seconds
    that makes with the per-item costs above (``fla_configs`` None: fla not run)."""
    seen = set()
    compiles = {"ours": 0, "fla": 0}
    tunes = {"ours": 0, "fla": 0}
    for case in cases:
        for key, configs in ours_launches(case):
            tunes["ours"] += len(configs) if len(configs) > 1 else 0
            for c in configs:
                if (key, c) not in seen:
                    seen.add((key, c))
                    compiles["ours"] += 1
        if fla_configs:
            tunes["fla"] += fla_configs
            for c in range(fla_configs):
                if (fla_key(case), c) not in seen:
                    seen.add((fla_key(case), c))
                    compiles["fla"] += 1
    measures = len(cases) * (2 if fla_configs else 1)
    shapes = len({c.shape for c in cases})
    seconds = (STARTUP_S + COMPILE_S * sum(compiles.values()) + TUNE_S * sum(tunes.values())
               + MEASURE_S * measures + SHAPE_S * shapes)
    return {"cases": len(cases), "shapes": shapes, "compiles": compiles, "tune_benchmarks": tunes,
            "measurements": measures, "seconds": seconds}


def sweep_estimate(shapes) -> dict:
    """The same for ``--sweep``: every config compiled per specialization, timed per shape."""
    n = len(_tuning.ALL_CONFIGS)
    fwd_keys = {s.D for s in shapes}
    bwd_keys = {(s.D, _tuning.grid_bucket(s.N * s.H) if _backward_grid_specialised() else 0) for s in shapes}
    compiles = n * (len(fwd_keys) + len(bwd_keys))
    measures = 2 * n * len(shapes)
    return {"configs": n, "compiles": compiles, "measurements": measures,
            "seconds": STARTUP_S + COMPILE_S * compiles + MEASURE_S * measures + SHAPE_S * len(shapes)}


def format_plan(cases: list[Case], est: dict) -> str:
    lines = [f"{'case':58s} {'MB':>8s} {'floor ms':>9s} {'pieces':>6s}"]
    for c in cases:
        total = sum(unique_bytes(c).values())
        lines.append(f"{c.label:58s} {total / 1e6:8.1f} {total / (COPY_TBPS_GUESS * 1e9):9.3f} {case_pieces(c):6d}")
    lines.append(f"(floors at {COPY_TBPS_GUESS} TB/s, an H200's copy bandwidth; the run measures its own)")
    lines.append(f"estimate: {est}")
    return "\n".join(lines)


# ---------------------------------------------------------------- GPU plumbing

def _unwrap(obj, cls):
    """Follow ``.fn`` (triton.heuristics / autotune wrappers) until an instance of ``cls``."""
    for _ in range(6):
        if isinstance(obj, cls):
            return obj
        obj = getattr(obj, "fn", None)
        if obj is None:
            return None
    return None


def _find(modules, cls) -> list:
    """Every distinct instance of ``cls`` reachable from the modules' globals (through wrappers)."""
    found = {}
    for module in modules:
        for obj in vars(module).values():
            x = _unwrap(obj, cls)
            if x is not None:
                found[id(x)] = x
    return list(found.values())


def find_autotuners(*modules) -> list:
    """Every ``triton.runtime.Autotuner`` of the modules."""
    from triton.runtime.autotuner import Autotuner

    return _find(modules, Autotuner)


def find_jit_functions(*modules) -> list:
    """Every ``triton.JITFunction`` of the modules (the kernels under any autotune wrapper)."""
    from triton.runtime.jit import JITFunction

    return _find(modules, JITFunction)


def n_compiled(jit_functions) -> int | None:
    """Kernels compiled so far by these JIT functions (None where Triton keeps them elsewhere)."""
    try:
        return sum(len(cache[0]) for fn in jit_functions for cache in fn.device_caches.values())
    except Exception:
        return None


def restrict_configs(autotuner, wanted=FLA_CONFIGS) -> list[tuple]:
    """Keep only ``wanted`` (BK, BV, warps, stages) among an autotuner's own configs; return the kept."""
    kept = [c for c in autotuner.configs if _tuning.key(c)[:4] in wanted]
    if kept:
        autotuner.configs = kept
    return [_tuning.key(c)[:4] for c in autotuner.configs]


def do_bench(fn) -> dict:
    q = triton.testing.do_bench(fn, warmup=WARMUP_MS, rep=REP_MS, quantiles=(0.5, 0.2, 0.8))
    return {"ms": q[0], "p20": q[1], "p80": q[2]}


def copy_bandwidth(nbytes: int = COPY_BYTES) -> dict:
    """Read + write bytes / median time of a torch copy of ``nbytes``."""
    src = torch.ones(nbytes // 4, dtype=torch.float32, device="cuda")
    dst = torch.empty_like(src)
    t = do_bench(lambda: dst.copy_(src))
    del src, dst
    torch.cuda.empty_cache()
    return {"bytes": nbytes, "ms": t["ms"], "tbps": 2 * nbytes / (t["ms"] * 1e-3) / 1e12}


class Inputs:
    """One shape's tensors: x1, x2 are k, v (forward) and q, do (backward); gates made on demand."""

    def __init__(self, shape: Shape, device: str = "cuda", dtype: torch.dtype = torch.bfloat16):
        from .gates import chunk_local_cumsum

        self._cumsum = chunk_local_cumsum
        B, T, H, D = shape.B, shape.T, shape.H, shape.D
        self.shape, self.device = shape, device
        self.x1 = (torch.randn(B, T, H, D, device=device) * D ** -0.5).to(dtype)
        self.x2 = torch.randn(B, T, H, D, device=device).to(dtype)
        self.cu = None
        if shape.lens:
            self.cu = torch.tensor([0, *itertools.accumulate(shape.lens)], dtype=torch.int32, device=device)
        self._gates = {}

    def gate(self, name: str) -> torch.Tensor:
        """Chunk-local cumsums (log2, fp32) of natural-log gates logsigmoid(N(0, 1)): g or gk."""
        if name not in self._gates:
            s = self.shape
            size = (s.B, s.T, s.H) if name == "g" else (s.B, s.T, s.H, s.D)
            nat = torch.nn.functional.logsigmoid(torch.randn(size, device=self.device))
            self._gates[name] = self._cumsum(nat, BT, self.cu)
        return self._gates[name]


def _kwargs(case: Case, inp: Inputs) -> dict:
    return {case.gate: inp.gate(case.gate), "cu_seqlens": inp.cu, "chunk_size": BT, "split_size": case.split,
            "states_in_fp32": case.states == "fp32"}


def call(lib, case: Case, inp: Inputs, **extra):
    """A no-argument function running ``case`` through ``lib`` (a module with chunk_fwd_h and
    chunk_bwd_dh), returning h / dh. The backward gets q as k and do as v: it reads their shapes only.
    ``extra``: more keyword arguments for the call (``pieces=1``)."""
    kw = {**_kwargs(case, inp), **extra}
    if case.direction == "fwd":
        return lambda: lib.chunk_fwd_h(inp.x1, inp.x2, **kw)[0]
    scale = case.shape.D ** -0.5
    return lambda: lib.chunk_bwd_dh(inp.x1, inp.x1, inp.x2, inp.x2, h0=None, dht=None, scale=scale, **kw)[0]


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
    from .testing import rel_err

    step = max(1, ours.numel() >> 22)
    return rel_err(ours.reshape(-1)[::step], ref.reshape(-1)[::step])


class Libraries:
    """chunkstate and (if importable) fla-core: the entry points, autotuners and JIT functions."""

    def __init__(self, fla_all_configs: bool, with_fla: bool = True):
        from . import forward, pieces

        mods = [forward, pieces]
        self.ours = _Namespace(chunk_fwd_h=forward.chunk_fwd_h, chunk_bwd_dh=None)
        self.ours_error = None
        try:
            from . import backward

            mods.append(backward)
            self.ours.chunk_bwd_dh = backward.chunk_bwd_dh
        except Exception as e:  # the backward not written yet / broken: forward cases still run
            self.ours_error = f"chunkstate.backward: {type(e).__name__}: {e}"
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
            name = getattr(getattr(at, "base_fn", None), "__name__", f"autotuner {len(kept)}")
            kept[name] = [_tuning.key(c)[:4] for c in at.configs] if fla_all_configs else restrict_configs(at)
        counts = sorted({len(v) for v in kept.values()})
        note = (f"all of fla's own configs ({'/'.join(map(str, counts))})" if fla_all_configs else
                f"restricted to {'/'.join(map(str, counts))} of its 48 configs (H200 winners; "
                "--fla-all-configs keeps all)")
        self.fla_info = {"available": True, "all_configs": fla_all_configs, "configs": kept,
                         "configs_note": note + "; its autotune disk cache off, tuned per shape",
                         "autotuners_found": len(self.fla_autotuners)}

    def clear_autotune_caches(self):
        for at in self.ours_autotuners + self.fla_autotuners:
            at.cache.clear()


class _Namespace:
    def __init__(self, **kw):
        self.__dict__.update(kw)


def _timed(lib, jit, case, inp, **extra) -> tuple[dict, torch.Tensor | None]:
    """First call and do_bench of one library on one case; errors are recorded, not raised."""
    try:
        out, seconds, compiled = first_call(call(lib, case, inp, **extra), jit)
        entry = {"first_call_s": seconds, "compiled": compiled}
        entry.update(do_bench(call(lib, case, inp, **extra)))
        return entry, out
    except Exception as e:
        return {"error": f"{type(e).__name__}: {str(e)[:500]}"}, None


def _configs_run(autotuners, timed):
    """Run ``timed()`` (a ``_timed`` call) and add to its entry, under ``"configs"``, the config
    each of these autotuners ran last, by kernel name: (BK, BV, warps, stages). With pieces the
    forward's autotuner runs twice (two keys); the entry holds the storing pass's config."""
    for at in autotuners:
        at.best_config = None
    entry, out = timed()
    chosen = {getattr(getattr(at, "base_fn", None), "__name__", "kernel"): list(_tuning.key(at.best_config))
              for at in autotuners if getattr(at, "best_config", None) is not None}
    if chosen and "error" not in entry:
        entry["configs"] = chosen
    return entry, out


def run_case(case: Case, inp: Inputs, libs: Libraries, copy_tbps: float) -> dict:
    r = new_result(case, case_pieces(case))
    out = None
    ours_at, fla_at = getattr(libs, "ours_autotuners", []), getattr(libs, "fla_autotuners", [])
    if case.direction == "bwd" and libs.ours.chunk_bwd_dh is None:
        r["ours"] = {"error": libs.ours_error}
    else:
        r["ours"], out = _configs_run(ours_at, lambda: _timed(libs.ours, libs.ours_jit, case, inp))
        if r["pieces"] > 1 and r["ours"].get("ms"):  # what the pieces bought (or cost): one pass too
            r["ours_one_pass"], _ = _configs_run(
                ours_at, lambda: _timed(libs.ours, libs.ours_jit, case, inp, pieces=1))
    if libs.fla is not None:
        r["fla"], ref = _configs_run(fla_at, lambda: _timed(libs.fla, libs.fla_jit, case, inp))
        r["fla"]["valid"] = case.fla_valid
        if not case.fla_valid:
            r["fla"]["note"] = "fla wrong: its backward with split_size > chunk_size stores the wrong gradient"
        if out is not None and ref is not None:
            try:
                r["agree_rel_err"] = agreement(out, ref)
            except Exception as e:  # e.g. different shapes: recorded, the timings stand
                r["agree_error"] = f"{type(e).__name__}: {str(e)[:300]}"
        del ref
    del out
    return derive(r, copy_tbps)


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


def case_line(r: dict) -> str:
    ours, fla = r.get("ours") or {}, r.get("fla") or {}
    parts = [r["case"] + ":"]
    parts.append(f"ours {ours['error']}" if ours.get("error") else
                 f"ours {_fmt(ours.get('ms'), '.3f')} ms ({_fmt(ours.get('x_floor'), '.2f')}× floor, "
                 f"first {_first(ours)} s)")
    if fla:
        parts.append(f"fla {fla['error']}" if fla.get("error") else
                     f"fla {_fmt(fla.get('ms'), '.3f')} ms (first {_first(fla)} s)"
                     + ("" if fla.get("valid", True) else " [fla wrong]"))
    if r.get("agree_rel_err") is not None:
        parts.append(f"rel diff {r['agree_rel_err']:.1e}")
    return " ".join(parts)


def _versions() -> dict:
    v = {"python": platform.python_version(), "torch": torch.__version__, "triton": triton.__version__}
    for name, dist in (("fla", "fla-core"), ("chunkstate", "chunkstate")):
        try:
            v[name] = importlib.metadata.version(dist)
        except importlib.metadata.PackageNotFoundError:
            v[name] = None
    try:
        v["git"] = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=Path(__file__).parent,
                                  capture_output=True, text=True, timeout=10).stdout.strip() or None
    except Exception:
        v["git"] = None
    return v


def _device() -> dict:
    if not torch.cuda.is_available():
        return {"name": "CPU"}
    props = torch.cuda.get_device_properties(torch.cuda.current_device())
    return {"name": props.name, "sms": props.multi_processor_count, "memory_gib": round(props.total_memory / 2**30, 1)}


def _meta(args, mode: str, copy: dict | None, libs: Libraries | None, cache: dict) -> dict:
    return {"date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
            "mode": mode, "argv": sys.argv[1:], "device": _device(),
            "versions": _versions(), "copy": copy,
            "do_bench": {"warmup_ms": WARMUP_MS, "rep_ms": REP_MS, "statistic": "median (p20, p80 kept)"},
            "BT": BT, "inputs": "bf16 k, v / q, do; fp32 gates (chunk-local log2 cumsums); no h0, ht, dht",
            "bytes_model": " ".join(unique_bytes.__doc__.split()),
            "fla": libs.fla_info if libs else None, "chunkstate_error": libs.ours_error if libs else None,
            "triton_cache": cache}


# ---------------------------------------------------------------- runs

def run_cases(cases: list[Case], args, mode: str, cache: dict) -> dict:
    copy = copy_bandwidth()
    libs = Libraries(args.fla_all_configs)
    if libs.fla is None:
        print(f"fla-core is not importable ({libs.fla_info['error']}): timing chunkstate alone", file=sys.stderr)
    report = {"meta": _meta(args, mode, copy, libs, cache), "cases": []}
    json_path, png_path = output_paths(args.out, mode)
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
                r = run_case(case, inp, libs, copy["tbps"])
                report["cases"].append(r)
                write_json(report, json_path)
                progress.finish(case_line(r))
            del inp
            torch.cuda.empty_cache()
    finally:
        progress.close()
        report["meta"]["wall_s"] = time.perf_counter() - t0
        write_json(report, json_path)
    print(format_table(report["cases"]))
    print(format_summary(report))
    try:
        write_png(report, png_path)
    except Exception as e:  # the numbers are in the JSON; a plotting problem must not lose them
        print(f"could not draw {png_path}: {type(e).__name__}: {e}", file=sys.stderr)
    print(f"wrote {json_path} and {png_path}")
    return report


def run_sweep(shapes, args, cache: dict) -> dict:
    """Time every config of ``_tuning.ALL_CONFIGS`` (g gate, bf16 states, split None) per shape and
    direction; the JSON keeps all timings and the top 8 with the current candidates marked."""
    from . import forward

    copy = copy_bandwidth()
    libs = Libraries(fla_all_configs=False, with_fla=False)
    report = {"meta": _meta(args, "sweep", copy, None, cache), "sweep": []}
    json_path, _ = output_paths(args.out, "sweep")
    configs = _tuning.ALL_CONFIGS
    takes_pieces = _backward_takes_pieces()
    progress = Progress(len(shapes) * 2, "chunkstate.bench sweep")
    try:
        for shape in shapes:
            inp = Inputs(shape)
            for direction in ("fwd", "bwd"):
                case = Case(shape, direction)
                progress.start(case.label)
                kw = _kwargs(case, inp)
                bucket = _tuning.grid_bucket(shape.N * shape.H)
                total = sum(unique_bytes(case).values())
                timings = []
                for cfg in configs:
                    if direction == "fwd":
                        fn = lambda c=cfg: forward.chunk_fwd_h(  # noqa: E731
                            inp.x1, inp.x2, **kw, pieces=1, config=c)[0]
                    elif libs.ours.chunk_bwd_dh is None:
                        timings.append({"config": list(_tuning.key(cfg)), "ms": None, "error": libs.ours_error})
                        continue
                    else:
                        extra = {"pieces": 1} if takes_pieces else {}
                        fn = lambda c=cfg: libs.ours.chunk_bwd_dh(  # noqa: E731
                            inp.x1, inp.x1, inp.x2, inp.x2, None, None, shape.D ** -0.5, **kw, config=c, **extra)[0]
                    entry = {"config": list(_tuning.key(cfg))}
                    try:
                        fn()
                        entry.update(do_bench(fn))
                        entry["tbps"] = total / (entry["ms"] * 1e-3) / 1e12
                    except Exception as e:
                        entry.update(ms=None, error=f"{type(e).__name__}: {str(e)[:300]}")
                    timings.append(entry)
                ranked = sorted((t for t in timings if t.get("ms")), key=lambda t: t["ms"])
                chosen = [list(t) for t in _candidates(shape.D, shape.D, bucket, case.gate)]
                for t in ranked[:8]:
                    t["candidate"] = t["config"] in chosen
                report["sweep"].append({"case": case.label, "shape": shape.label, "direction": direction,
                                        "grid_bucket": bucket, "total_bytes": total, "candidates": chosen,
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
    for s in report["sweep"]:
        print(f"{s['case']} (grid bucket {s['grid_bucket']}; * = in _tuning.candidates):")
        for t in s["top"]:
            print(f"  BK={t['config'][0]:3d} BV={t['config'][1]:3d} warps={t['config'][2]} stages={t['config'][3]}"
                  f"{' tma' if t['config'][4:5] == [True] else ''}"
                  f"  {t['ms']:.4f} ms  {t['tbps']:.2f} TB/s {'*' if t['candidate'] else ''}")
    print(f"wrote {json_path}")
    return report


def parse_args(argv=None):
    p = argparse.ArgumentParser(prog="python -m chunkstate.bench", description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    mode = p.add_mutually_exclusive_group()
    mode.add_argument("--quick", action="store_true", help="a handful of cases")
    mode.add_argument("--full", action="store_true", help="every shape × direction × gate × states × split")
    mode.add_argument("--sweep", action="store_true", help="time every config of _tuning.ALL_CONFIGS")
    p.add_argument("--plan", action="store_true", help="print the cases and a time estimate; no GPU needed")
    p.add_argument("--out", default=str(DEFAULT_OUT), help="folder for the JSON and PNG (default: figures/)")
    p.add_argument("--keep-cache", action="store_true",
                   help="keep Triton's cache dir (first-call times then miss compiles cached before)")
    p.add_argument("--fla-all-configs", action="store_true", help="let fla tune its full 48-config list")
    p.add_argument("--shapes", nargs="+", metavar="LABEL",
                   help="only shapes whose label contains one of these, e.g. 'B8 T4096 H16' varlen")
    p.add_argument("--budget", type=float, metavar="S", help="start no new shape after S seconds")
    return p.parse_args(argv)


def main(argv=None) -> int:
    args = parse_args(argv)
    mode = "quick" if args.quick else "full" if args.full else "sweep" if args.sweep else "default"
    if mode == "sweep":
        shapes = select_shapes(SHAPES if args.shapes else SWEEP_SHAPES, args.shapes)
        if args.plan:
            print("\n".join(s.label for s in shapes))
            print(f"estimate: {sweep_estimate(shapes)}")
            return 0
    else:
        cases = make_cases(mode, args.shapes)
        if args.plan:
            print(format_plan(cases, estimate(cases, 48 if args.fla_all_configs else len(FLA_CONFIGS))))
            return 0
    if INTERPRET or not torch.cuda.is_available():
        why = ("TRITON_INTERPRET=1 is set" if INTERPRET and torch.cuda.is_available() else
               f"no CUDA device is visible (torch {torch.__version__}, CUDA {torch.version.cuda})")
        print(f"chunkstate.bench needs a CUDA GPU and compiled Triton: {why}. Nothing was timed.\n"
              "On a CPU, `python -m chunkstate.bench --plan` lists the cases and estimates the GPU time, "
              "and tests/test_bench.py checks the byte counts, table, JSON and figure.", file=sys.stderr)
        return 2
    if (mode != "sweep" and not cases) or (mode == "sweep" and not shapes):
        print(f"no shape matches --shapes {args.shapes}; shapes: {[s.label for s in SHAPES]}", file=sys.stderr)
        return 2
    # A fresh Triton cache, so first calls pay (and show) every compile. Triton reads
    # TRITON_CACHE_DIR when it compiles (triton.knobs reads the environment lazily), and nothing
    # has compiled yet: importing chunkstate only decorates kernels; fla is imported after this.
    cache = {"fresh": False, "dir": os.environ.get("TRITON_CACHE_DIR")}
    tmp = None
    if not args.keep_cache:
        tmp = tempfile.mkdtemp(prefix="chunkstate-bench-triton-")
        os.environ["TRITON_CACHE_DIR"] = tmp
        knobs = getattr(triton, "knobs", None)
        seen = getattr(getattr(knobs, "cache", None), "dir", tmp)
        cache = {"fresh": seen == tmp, "dir": tmp}
        if seen != tmp:
            print(f"warning: Triton's cache dir is {seen}, not the fresh {tmp}: first-call times may "
                  "miss compiles", file=sys.stderr)
    try:
        if mode == "sweep":
            run_sweep(shapes, args, cache)
        else:
            run_cases(cases, args, mode, cache)
    finally:
        if tmp:
            shutil.rmtree(tmp, ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
