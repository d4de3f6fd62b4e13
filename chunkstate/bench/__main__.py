"""python -m chunkstate.bench: time chunkstate against fla-core 0.6.0 and the copy roof on a CUDA GPU.

Modes:
  default   every shape × {fwd, bwd} with gate g, bf16 states, split None; plus, for three shapes
            (B8 T4096 H16, B1 T65536 H32, B1 T65536 H8), gate gk, fp32 states and split 256, each
            varied alone (40 cases).
  --quick   four cases (two shapes × fwd, bwd).
  --full    every shape × {fwd, bwd} × {g, gk} × {bf16, fp32} × {None, 256} (176 cases).
  --sweep   every config of tuning.ALL_CONFIGS (through config=, with pieces=1; tiles no wider than
            K, V need) on a few shapes, fwd and bwd: the timings tuning.candidates is chosen from.
            --shapes may name whole shapes with a gate: --shapes "B2 T4096 H48 K64 V64 g_gamma".
  --gla     chunkstate.chunk_gla against fla's chunk_gla, forward and forward + backward.
  --random SEED [--n N]
            N shapes (default 30) drawn at random by SEED from realistic model sizes
            (model.RANDOM_DISTRIBUTION: 8k-128k tokens, B 1-256, T 512-128k, H 1-64, K, V in
            {64, 128, 256}, gates none / g / gk / g_gamma, a quarter packed), fwd and bwd with
            final states; where one pass has under two waves of programs, explicit piece counts
            are timed too, to judge chunkstate's own choice. Files: bench_<gpu>_random_s<SEED>.*
  --calibrate
            measure the pieces cost model's constants on this GPU, per direction (a chunk step in
            one pass and in pieces, the fixed cost of a call in pieces), print them beside the
            ones chunkstate.pieces uses, write pieces_calibration_<gpu>.json (bench/calibrate.py).
  --merge FIRST.json SECOND.json
            one --random report from two processes of the same seed: a run stopped by its time
            limit, and a second one (--shapes) timing the shapes it left; each shape whole from one
            process (report.merge_random). Writes bench_<gpu>_random_s<SEED>.json and .png into
            --out (<gpu>: the first report's). No GPU needed.
  --plan    print the cases, their bytes and an estimate of the GPU time, then exit (no GPU needed).

Per case: chunkstate's and fla's calls (and explicit piece counts where the random mode asks) are
each called once, then timed together in 5 interleaved rounds of triton.testing.do_bench (warmup=2,
rep=10 ms), each round in its own shuffled order, each call reported as the median of its rounds'
medians. Reported beside: the pieces chunkstate chose, the first call's wall time (compile +
autotune; a fresh TRITON_CACHE_DIR unless --keep-cache, so the first case of each specialization
pays its compiles: marked *), and how far ours is from fla's result. fla's 48 configs cost ~40 s
of compiles per specialization, so its list is cut to 8 H200 winners (--fla-all-configs keeps all
48); fla's GQA is never used.
Outputs: a table on stdout and, in --out (default: figures/ under the current directory),
bench_<gpu>[_quick|_full|_sweep|_gla].json (rewritten after every case, so an interrupted run keeps
what it measured) and a .png beside it (chunkstate.figures.speed). <gpu> is the GPU's short name
(report.gpu_tag: h200 on an H200, h100 on an H100, rtx4090 on an RTX 4090), so a run on another GPU
never overwrites the H200's files committed in figures/.
--warm only calls each of those calls once (compiles and autotunes) and times and writes nothing:
run side by side in --shard processes with --keep-cache, it fills Triton's cache for a timed run.
"""
from __future__ import annotations

import argparse
import os
import shutil
import sys
import tempfile
from pathlib import Path

import torch
import triton

from ..env import INTERPRET
from .model import (FLA_CONFIGS, RANDOM_DISTRIBUTION, SHAPES, SWEEP_SHAPES, estimate, format_plan, make_cases,
                    parse_shape, random_cases, select_shapes, sweep_estimate)


def select_cases(cases, wanted):
    """The cases whose shape's label contains one of the ``wanted`` substrings (all when None)."""
    kept = set(select_shapes(dict.fromkeys(c.shape for c in cases), wanted))
    return [c for c in cases if c.shape in kept]


def parse_args(argv=None):
    first, rest = __doc__.split("\n\n", 1)
    p = argparse.ArgumentParser(prog="python -m chunkstate.bench", description=first.split(": ", 1)[1],
                                epilog=rest, formatter_class=argparse.RawDescriptionHelpFormatter)
    mode = p.add_mutually_exclusive_group()
    mode.add_argument("--quick", action="store_true", help="a handful of cases")
    mode.add_argument("--full", action="store_true", help="every shape × direction × gate × states × split")
    mode.add_argument("--sweep", action="store_true", help="time every config of tuning.ALL_CONFIGS")
    mode.add_argument("--gla", action="store_true", help="time chunk_gla against fla's chunk_gla")
    mode.add_argument("--random", type=int, metavar="SEED", help="time N random realistic shapes drawn by SEED")
    mode.add_argument("--calibrate", action="store_true", help="measure the pieces cost model's constants")
    mode.add_argument("--merge", nargs=2, metavar=("FIRST", "SECOND"),
                      help="merge two --random reports of one seed (a run cut short, and the shapes it left)")
    p.add_argument("--n", type=int, default=30, metavar="N", help="shapes drawn by --random (default 30)")
    p.add_argument("--plan", action="store_true", help="print the cases and a time estimate; no GPU needed")
    p.add_argument("--out", default="figures",
                   help="folder for the JSON and PNG (default: figures, relative to the current directory)")
    p.add_argument("--keep-cache", action="store_true",
                   help="keep Triton's cache dir (first-call times then miss compiles cached before)")
    p.add_argument("--fla-all-configs", action="store_true", help="let fla tune its full 48-config list")
    p.add_argument("--shapes", nargs="+", metavar="LABEL",
                   help="only shapes whose label contains one of these, e.g. 'B8 T4096 H16' varlen")
    p.add_argument("--budget", type=float, metavar="S", help="start no new shape after S seconds")
    p.add_argument("--warm", action="store_true",
                   help="only first-call every call the run would time (compiles and autotunes each): time nothing "
                   "and write nothing; then a timed run with --keep-cache finds every kernel in Triton's cache")
    p.add_argument("--shard", metavar="I/K", help="time only the shapes I, I+K, I+2K, .. of the run (0 <= I < K): "
                   "K processes can fill Triton's cache side by side before one timed run with --keep-cache")
    return p.parse_args(argv)


def _fresh_triton_cache(keep: bool) -> tuple[dict, str | None]:
    """Point Triton at a new, empty cache dir (unless ``keep``), so first calls pay (and show) every
    compile. Triton reads TRITON_CACHE_DIR when it compiles (triton.knobs reads the environment
    lazily), and nothing has compiled yet: importing chunkstate only decorates kernels; fla is
    imported after this. Returns what the report records, and the dir to remove afterwards."""
    if keep:
        return {"fresh": False, "dir": os.environ.get("TRITON_CACHE_DIR")}, None
    tmp = tempfile.mkdtemp(prefix="chunkstate-bench-triton-")
    os.environ["TRITON_CACHE_DIR"] = tmp
    knobs = getattr(triton, "knobs", None)
    seen = getattr(getattr(knobs, "cache", None), "dir", tmp)
    if seen != tmp:
        print(f"warning: Triton's cache dir is {seen}, not the fresh {tmp}: first-call times may "
              "miss compiles", file=sys.stderr)
    return {"fresh": seen == tmp, "dir": tmp}, tmp


def merge(paths, out) -> int:
    """``--merge``: read two --random reports, write their merge (``report.merge_random``)."""
    import json

    from .report import format_random_summary, gpu_tag, merge_random, output_paths, write_json, write_png

    reports = []
    for path in paths:
        try:
            reports.append(json.loads(Path(path).read_text()))
        except (OSError, ValueError) as e:
            print(f"--merge: cannot read {path}: {e}", file=sys.stderr)
            return 2
    meta = (reports[0].get("meta") or {}).get("random") or {}
    try:
        expected = [(c.label, c.shape.label) for c in random_cases(meta["seed"], meta["n"])] if meta else []
        merged = merge_random(*reports, expected)
    except ValueError as e:
        print(f"--merge: {e}", file=sys.stderr)
        return 2
    device = (reports[0].get("meta") or {}).get("device") or {}
    json_path, png_path = output_paths(out, f"random_s{meta['seed']}", gpu_tag(device.get("name", "gpu")))
    write_json(merged, json_path)
    write_png(merged, png_path)
    print(f"{len(merged['cases'])} cases ({len(merged['meta']['second_process']['cases'])} from the second "
          f"process) -> {json_path}, {png_path}")
    print(format_random_summary(merged))
    return 0


def main(argv=None) -> int:
    args = parse_args(argv)
    if args.merge:
        return merge(args.merge, args.out)
    mode = ("quick" if args.quick else "full" if args.full else "sweep" if args.sweep else
            "gla" if args.gla else "random" if args.random is not None else
            "calibrate" if args.calibrate else "default")
    if args.warm and mode in ("sweep", "gla", "calibrate"):
        print(f"--warm is for the modes that time cases (the default, --quick, --full, --random), not --{mode}",
              file=sys.stderr)
        return 2
    random_meta = None
    if mode == "calibrate":
        if args.plan:
            from .calibrate import every_measurement

            print("\n".join(f"{d} {s.label} pieces={P} {gate}" for d, s, P, gate in every_measurement()))
            return 0
    elif mode == "gla":
        if args.plan:
            from .gla import GLA_CASE

            print(f"chunk_gla and fla's chunk_gla, bf16, {GLA_CASE}: forward and forward + backward, "
                  "one first call and one do_bench each")
            return 0
    elif mode == "sweep":
        # a --shapes entry written as a whole label (B.. T.. H.. [K.. V..] [gate]) is that shape;
        # any other picks the suite's shapes whose label contains it
        parsed = [parse_shape(w) for w in args.shapes or []]
        named = [x for x in parsed if x]
        filters = [w for w, x in zip(args.shapes or [], parsed) if not x]
        picked = select_shapes(SHAPES, filters) if filters else () if named else SWEEP_SHAPES
        shapes = [s for s, _ in named] + list(picked)
        gates = [g or "g" for _, g in named] + ["g"] * len(picked)
        if args.plan:
            print("\n".join(f"{s.label} {g}" for s, g in zip(shapes, gates)))
            print(f"estimate: {sweep_estimate(shapes)}")
            return 0
    else:
        if mode == "random":
            if args.n < 1:
                print(f"--n must be a positive number of shapes, got {args.n}", file=sys.stderr)
                return 2
            cases = select_cases(random_cases(args.random, args.n), args.shapes)
            random_meta = {"seed": args.random, "n": args.n, "distribution": RANDOM_DISTRIBUTION}
        else:
            cases = make_cases(mode, args.shapes)
        if args.shard:
            try:
                i, k = (int(x) for x in args.shard.split("/"))
                assert 0 <= i < k
            except (ValueError, AssertionError):
                print(f"--shard must be I/K with 0 <= I < K, got {args.shard!r}", file=sys.stderr)
                return 2
            shapes = list(dict.fromkeys(c.shape for c in cases))[i::k]
            cases = [c for c in cases if c.shape in shapes]
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
    if (mode == "sweep" and not shapes) or (mode not in ("sweep", "gla", "calibrate") and not cases):
        print(f"no shape matches --shapes {args.shapes}; shapes: {[s.label for s in SHAPES]}", file=sys.stderr)
        return 2
    from . import runner

    cache, tmp = _fresh_triton_cache(args.keep_cache)
    try:
        if mode == "calibrate":
            from . import calibrate

            calibrate.run(args, cache)
        elif mode == "gla":
            from .gla import run_gla

            run_gla(args, cache)
        elif mode == "sweep":
            runner.run_sweep(shapes, args, cache, gates)
        elif args.warm:
            runner.warm_cases(cases, args, random_meta)
        else:
            runner.run_cases(cases, args, mode, cache, random_meta)
    finally:
        if tmp:
            shutil.rmtree(tmp, ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
