"""``python -m chunkstate.bench --calibrate``: measure the constants of the pieces cost model
(``chunkstate.pieces.predicted_us``) on this GPU, per direction, and print them beside the ones in
use. The model charges

    one pass:   chunks × step × waves
    P pieces:   max(fixed, 2 · ⌈chunks / P⌉ × piece step × waves + scan)

and this mode measures each term where the others vanish, with few programs (one wave), gate ``g``,
bf16, final states, BT = 64 (``CALIBRATION``):

- **step**: one pass at T = ``T_SHORT`` and ``T_LONG``; the difference over the difference in chunks
  (the host's time per call and the launch drop out);
- **piece step**: the same with ``PIECES_FOR_STEP`` pieces (each pass walks ⌈chunks / P⌉ chunks,
  and there are two passes);
- **fixed**: a call in pieces at T = ``T_TINY``, whose GPU work is a few chunks, less that work
  (taken at the piece step just measured): what a call in pieces costs however little it holds —
  the host's time for three launches and the workspace, when that is the larger;
- **one-pass fixed**: the same for one pass at T = ``T_TINY`` (the model has no such term yet: it
  tells how far a one-pass call is from the host's time per call).

``fit`` is pure (tests/test_bench.py checks it on made-up timings); ``run`` needs a CUDA GPU.
"""
from __future__ import annotations

import json
import statistics
from pathlib import Path

from .. import pieces as _pieces
from .._host import cdiv
from .model import BT, Case, Shape

T_SHORT, T_LONG, T_TINY = 32768, 131072, 4096
PIECES_FOR_STEP = 8
PIECES_FOR_FIXED = (2, 4)
CALIBRATION = (Shape(1, 0, 2, 128), Shape(1, 0, 4, 64))  # T set per measurement: 8 and 4 programs of 64×64
OUT_NAME = "pieces_calibration_h200.json"


def measurements() -> list[tuple[str, Shape, int]]:
    """Every (direction, shape, pieces) to time: per direction and calibration shape, one pass and
    ``PIECES_FOR_STEP`` pieces at ``T_SHORT`` and ``T_LONG``, one pass and each of ``PIECES_FOR_FIXED``
    at ``T_TINY``."""
    out = []
    for direction in ("fwd", "bwd"):
        for s in CALIBRATION:
            for T in (T_SHORT, T_LONG):
                for P in (1, PIECES_FOR_STEP):
                    out.append((direction, Shape(s.B, T, s.H, s.K, s.V), P))
            for P in (1, *PIECES_FOR_FIXED):
                out.append((direction, Shape(s.B, T_TINY, s.H, s.K, s.V), P))
    return out


def _chunks(T: int) -> int:
    return cdiv(T, BT)


def _piece_steps(T: int, P: int) -> int:
    """Chunk steps a call in P pieces walks over its two passes."""
    return 2 * cdiv(_chunks(T), P)


def fit(timings: dict[tuple[str, str, int], float]) -> dict[str, dict[str, float]]:
    """The model's constants per direction, in µs, from ``timings``: (direction, shape label, pieces)
    → median ms, for every entry of ``measurements()``. Each constant is the median over the
    calibration shapes."""
    out = {}
    for direction in ("fwd", "bwd"):
        steps, piece_steps, fixed, one_pass_fixed = [], [], [], []
        for s in CALIBRATION:
            def ms(T, P):
                return timings[(direction, Shape(s.B, T, s.H, s.K, s.V).label, P)]

            step = (ms(T_LONG, 1) - ms(T_SHORT, 1)) * 1e3 / (_chunks(T_LONG) - _chunks(T_SHORT))
            steps.append(step)
            one_pass_fixed.append(ms(T_TINY, 1) * 1e3 - _chunks(T_TINY) * step)
            P = PIECES_FOR_STEP
            piece_step = ((ms(T_LONG, P) - ms(T_SHORT, P)) * 1e3
                          / (_piece_steps(T_LONG, P) - _piece_steps(T_SHORT, P)))
            piece_steps.append(piece_step)
            for P in PIECES_FOR_FIXED:
                fixed.append(ms(T_TINY, P) * 1e3 - _piece_steps(T_TINY, P) * piece_step)
        out[direction] = {"step_us": statistics.median(steps), "piece_step_us": statistics.median(piece_steps),
                          "fixed_us": statistics.median(fixed), "one_pass_fixed_us": statistics.median(one_pass_fixed)}
    return out


def in_use() -> dict[str, float]:
    """The constants ``chunkstate.pieces`` uses now (the same for both directions)."""
    return {"step_us": _pieces.CHUNK_STEP_US, "piece_step_us": _pieces.CHUNK_STEP_US,
            "fixed_us": _pieces.PIECES_FIXED_US, "one_pass_fixed_us": 0.0}


def format_fit(fitted: dict[str, dict[str, float]]) -> str:
    now = in_use()
    lines = [f"{'':4s} {'step µs':>10s} {'piece step µs':>14s} {'fixed µs':>10s} {'one-pass fixed µs':>18s}"]
    for direction, c in [*fitted.items(), ("now", now)]:
        lines.append(f"{direction:4s} {c['step_us']:10.3f} {c['piece_step_us']:14.3f} {c['fixed_us']:10.1f} "
                     f"{c['one_pass_fixed_us']:18.1f}")
    lines[-1] += "   (chunkstate.pieces: CHUNK_STEP_US, CHUNK_STEP_US, PIECES_FIXED_US, none)"
    return "\n".join(lines)


def run(args, cache: dict) -> dict:
    """Time every entry of ``measurements()`` on this GPU (first call, then ``runner.do_bench``),
    fit, print, and write ``OUT_NAME`` into ``args.out``."""
    import torch

    import chunkstate

    from . import runner

    timings, rows, inp = {}, [], None
    for direction, shape, P in measurements():
        if inp is None or inp.shape != shape:  # one shape's inputs at a time
            inp = None
            torch.cuda.empty_cache()
            inp = runner.Inputs(shape)
        fn = runner.call(chunkstate, Case(shape, direction, final=True), inp, pieces=P)
        fn()
        t = runner.do_bench(fn)
        timings[(direction, shape.label, P)] = t["ms"]
        rows.append({"direction": direction, "shape": shape.label, "T": shape.T, "pieces": P, **t})
        print(f"{direction} {shape.label:22s} pieces={P:<3d} {t['ms']:.4f} ms", flush=True)
    fitted = fit(timings)
    print(format_fit(fitted))
    report = {"meta": runner.run_info("calibrate", cache), "timings": rows, "fitted": fitted, "in_use": in_use()}
    path = Path(args.out) / OUT_NAME
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(report, indent=1) + "\n")
    print(f"wrote {path}")
    return report
