"""``python -m chunkstate.bench --calibrate``: measure the constants of the pieces cost model
(``chunkstate.pieces.predicted_us``) on this GPU, per direction, and print them beside the ones in
use (``pieces.COSTS``). The model charges

    one pass:   max(one-pass fixed, chunks × step × waves)
    P pieces:   max(fixed, 2 · ⌈chunks / P⌉ × piece step × waves + carry)

and this mode measures each term where the others vanish, with few programs (one wave), gate ``g``,
bf16, final states, BT = 64 (``CALIBRATION``):

- **step**: one pass at T = ``T_SHORT`` and ``T_LONG``; the difference over the difference in chunks
  (the host's time per call and the launch drop out);
- **piece step**: the same with ``PIECES_FOR_STEP`` pieces at ``T_PIECES_SHORT`` and ``T_PIECES_LONG``
  (each piece is walked ⌈chunks / P⌉ chunks twice), lengths at which both calls are bound by their
  GPU work, not by the host's time for the call;
- **fixed**: the time of a call in pieces at T = ``T_TINY``, whose GPU work (a few chunks per
  piece, under 25 µs) is far less than the host's time for the call: the floor the model's
  max() puts under every call in pieces (its GPU work runs while the host launches, so it is not
  subtracted);
- **one-pass fixed**: the same for one pass at T = ``T_TINY``: the host's time for one launch;
- **overlap**: on the first shape, the piece step again with ``PIECES_FOR_OVERLAP`` pieces, about two
  programs per multiprocessor: ``waves`` = (programs / sms) / overlap, so the overlap is the programs
  per multiprocessor over how much longer the step got (at most the programs per multiprocessor
  launched: a step no longer than with one wave says the overlap is at least that).

Beside them, the two steps of the other gate kinds (``GATE_KINDS``, ``fit_gate_steps``), with their
ratios to g's: the model's ``pieces.GATE_STEPS``.

``fit`` is pure (tests/test_bench.py checks it on made-up timings); ``run`` needs a CUDA GPU.
"""
from __future__ import annotations

import json
import statistics
from pathlib import Path

from .. import pieces as _pieces
from .._host import cdiv
from ..tuning import H200_SMS
from .model import BT, HOST_PROBE, Case, Shape

T_SHORT, T_LONG, T_TINY = 32768, 131072, HOST_PROBE.T
T_PIECES_SHORT, T_PIECES_LONG = 262144, 524288
PIECES_FOR_STEP = 4
PIECES_FOR_FIXED = (2, 4)
PIECES_FOR_OVERLAP = 32  # 256 programs on the first shape: about two per multiprocessor of an H200
# T set per measurement: 8 and 4 programs of 64×64; the first is HOST_PROBE's at T_TINY
CALIBRATION = (Shape(1, 0, HOST_PROBE.H, HOST_PROBE.K, HOST_PROBE.V), Shape(1, 0, 4, 64))


def out_name(gpu: str) -> str:
    """The file ``run`` writes on the GPU ``gpu`` (``report.gpu_tag``): ``pieces_calibration_h200.json``
    on an H200."""
    return f"pieces_calibration_{gpu}.json"


# The chunk steps measured beside g's for the other gate kinds, on the first calibration shape: the
# model scales g's by their ratios (pieces.GATE_STEPS).
GATE_KINDS = ("none", "g_gamma", "gk")
# (T, pieces) of the two steps: one pass at T_SHORT and T_LONG, PIECES_FOR_STEP pieces at the longer T's
STEP_POINTS = ((T_SHORT, 1), (T_LONG, 1), (T_PIECES_SHORT, PIECES_FOR_STEP), (T_PIECES_LONG, PIECES_FOR_STEP))


def measurements() -> list[tuple[str, Shape, int]]:
    """Every (direction, shape, pieces) to time: per direction and calibration shape, one pass at
    ``T_SHORT`` and ``T_LONG``, ``PIECES_FOR_STEP`` pieces at ``T_PIECES_SHORT`` and ``T_PIECES_LONG``,
    one pass and each of ``PIECES_FOR_FIXED`` at ``T_TINY``; on the first shape, ``PIECES_FOR_OVERLAP``
    pieces at ``T_PIECES_SHORT`` and ``T_PIECES_LONG`` (the only launches past one wave)."""
    out = []
    for direction in ("fwd", "bwd"):
        for s in CALIBRATION:
            for T, P in STEP_POINTS:
                out.append((direction, Shape(s.B, T, s.H, s.K, s.V), P))
            for P in (1, *PIECES_FOR_FIXED):
                out.append((direction, Shape(s.B, T_TINY, s.H, s.K, s.V), P))
        s = CALIBRATION[0]
        out += [(direction, Shape(s.B, T, s.H, s.K, s.V), PIECES_FOR_OVERLAP) for T in (T_PIECES_SHORT, T_PIECES_LONG)]
    return out


def gate_measurements() -> list[tuple[str, Shape, int, str]]:
    """Every (direction, shape, pieces, gate) of the two steps per gate kind, on the first calibration
    shape for each of ``GATE_KINDS``: one pass at ``T_SHORT`` and ``T_LONG``, ``PIECES_FOR_STEP``
    pieces at ``T_PIECES_SHORT`` and ``T_PIECES_LONG`` (g's own are ``measurements()``'s)."""
    s = CALIBRATION[0]
    return [(direction, Shape(s.B, T, s.H, s.K, s.V), P, gate)
            for direction in ("fwd", "bwd") for T, P in STEP_POINTS for gate in GATE_KINDS]


def every_measurement() -> list[tuple[str, Shape, int, str]]:
    """What ``run`` times, in its order, as (direction, shape, pieces, gate): ``measurements()`` with
    gate g, then ``gate_measurements()``."""
    return [(direction, shape, P, "g") for direction, shape, P in measurements()] + gate_measurements()


def _chunks(T: int) -> int:
    return cdiv(T, BT)


def _step_us(ms_short: float, ms_long: float) -> float:
    """µs per chunk step of one pass: the difference of its times at ``T_SHORT`` and ``T_LONG`` (ms)
    over the difference in chunks (the host's time per call and the launch drop out)."""
    return (ms_long - ms_short) * 1e3 / (_chunks(T_LONG) - _chunks(T_SHORT))


def _piece_steps(T: int, P: int) -> int:
    """Chunk steps a call in P pieces walks over its two passes."""
    return 2 * cdiv(_chunks(T), P)


def _piece_step_us(ms_short: float, ms_long: float, P: int = PIECES_FOR_STEP) -> float:
    """µs per chunk step of a call in P pieces: the difference of its times at ``T_PIECES_SHORT`` and
    ``T_PIECES_LONG`` (ms) over the difference in chunk steps of both passes."""
    return (ms_long - ms_short) * 1e3 / (_piece_steps(T_PIECES_LONG, P) - _piece_steps(T_PIECES_SHORT, P))


def fit(timings: dict[tuple[str, str, int], float], sms: int = H200_SMS) -> dict[str, dict[str, float]]:
    """The model's constants per direction, in µs (the overlap in programs per multiprocessor), from
    ``timings``: (direction, shape label, pieces) → median ms, for every entry of ``measurements()``,
    on a GPU of ``sms`` multiprocessors. Each constant but the overlap is the median over the
    calibration shapes."""
    out = {}
    for direction in ("fwd", "bwd"):
        steps, piece_steps, fixed, one_pass_fixed = [], [], [], []
        for s in CALIBRATION:
            def ms(T, P):
                return timings[(direction, Shape(s.B, T, s.H, s.K, s.V).label, P)]

            steps.append(_step_us(ms(T_SHORT, 1), ms(T_LONG, 1)))
            one_pass_fixed.append(ms(T_TINY, 1) * 1e3)
            piece_steps.append(_piece_step_us(ms(T_PIECES_SHORT, PIECES_FOR_STEP), ms(T_PIECES_LONG, PIECES_FOR_STEP)))
            for P in PIECES_FOR_FIXED:
                fixed.append(ms(T_TINY, P) * 1e3)
        s, P = CALIBRATION[0], PIECES_FOR_OVERLAP
        wide_step = _piece_step_us(*(timings[(direction, Shape(s.B, T, s.H, s.K, s.V).label, P)]
                                     for T in (T_PIECES_SHORT, T_PIECES_LONG)), P)
        per_sm = _pieces.programs_64(s.N, s.H, s.K, s.V) * P / sms
        one_wave_step = piece_steps[0]  # the same shape's piece step at PIECES_FOR_STEP: one wave
        out[direction] = {"step_us": statistics.median(steps), "piece_step_us": statistics.median(piece_steps),
                          "fixed_us": statistics.median(fixed), "one_pass_fixed_us": statistics.median(one_pass_fixed),
                          "overlap": per_sm / max(1.0, wide_step / one_wave_step)}
    return out


def fit_gate_steps(timings: dict[tuple[str, str, int], float],
                   gate_timings: dict[tuple[str, str, int, str], float]) -> dict[str, dict[str, dict[str, float]]]:
    """The two chunk steps in µs (``step_us``: one pass, ``piece_step_us``: in pieces) per direction
    and gate kind on the first calibration shape: g's from ``timings`` (as ``fit`` reads them), the
    others' from ``gate_timings``: (direction, shape label, pieces, gate) → median ms, for every entry
    of ``gate_measurements()``."""
    s = CALIBRATION[0]
    short, long, p_short, p_long = (Shape(s.B, T, s.H, s.K, s.V).label
                                    for T in (T_SHORT, T_LONG, T_PIECES_SHORT, T_PIECES_LONG))
    P = PIECES_FOR_STEP
    out = {}
    for direction in ("fwd", "bwd"):
        def ms(label, pieces, gate):
            return timings[(direction, label, pieces)] if gate == "g" else gate_timings[(direction, label, pieces, gate)]

        out[direction] = {gate: {"step_us": _step_us(ms(short, 1, gate), ms(long, 1, gate)),
                                 "piece_step_us": _piece_step_us(ms(p_short, P, gate), ms(p_long, P, gate))}
                          for gate in ("g", *GATE_KINDS)}
    return out


def format_gate_steps(steps: dict[str, dict[str, dict[str, float]]]) -> str:
    lines = [f"chunk steps by gate, µs (× g's), {CALIBRATION[0].label}: one pass | in pieces"]
    for direction, by_gate in steps.items():
        g = by_gate["g"]
        lines.append(f"  {direction}: " + ", ".join(
            f"{gate} {c['step_us']:.3f} ({c['step_us'] / g['step_us']:.2f}×) | {c['piece_step_us']:.3f} "
            f"({c['piece_step_us'] / g['piece_step_us']:.2f}×)" for gate, c in by_gate.items()))
    return "\n".join(lines)


def in_use() -> dict[str, dict[str, float]]:
    """The constants ``chunkstate.pieces`` uses now, per direction (``pieces.COSTS``)."""
    return {direction: c._asdict() for direction, c in _pieces.COSTS.items()}


def format_fit(fitted: dict[str, dict[str, float]]) -> str:
    rows = [(f"{direction} measured", c) for direction, c in fitted.items()]
    rows += [(f"{direction} in use", c) for direction, c in in_use().items()]
    lines = [f"{'':12s} {'step µs':>10s} {'piece step µs':>14s} {'fixed µs':>10s} {'one-pass fixed µs':>18s} "
             f"{'overlap':>8s}"]
    for name, c in rows:
        lines.append(f"{name:12s} {c['step_us']:10.3f} {c['piece_step_us']:14.3f} {c['fixed_us']:10.1f} "
                     f"{c['one_pass_fixed_us']:18.1f} {c['overlap']:8.2f}")
    return "\n".join(lines) + "\n(in use: chunkstate.pieces.COSTS)"


def run(args, cache: dict) -> dict:
    """Time every entry of ``every_measurement()`` on this GPU
    (``runner.bench_call``: a first call, then ``do_bench``), fit, print, and write ``out_name`` of
    this GPU into ``args.out``."""
    import torch

    import chunkstate
    from chunkstate import tuning

    from . import runner

    timings, gate_timings, rows, inp = {}, {}, [], None
    for direction, shape, P, gate in every_measurement():
        if inp is None or inp.shape != shape:  # one shape's inputs at a time
            inp = None
            torch.cuda.empty_cache()
            inp = runner.Inputs(shape)
        t = runner.bench_call(chunkstate, Case(shape, direction, gate=gate, final=True), inp, pieces=P)
        if gate == "g":
            timings[(direction, shape.label, P)] = t["ms"]
        else:
            gate_timings[(direction, shape.label, P, gate)] = t["ms"]
        rows.append({"direction": direction, "shape": shape.label, "T": shape.T, "pieces": P, "gate": gate, **t})
        print(f"{direction} {shape.label:22s} pieces={P:<3d} {gate:8s} {t['ms']:.4f} ms", flush=True)
    fitted = fit(timings, tuning.sm_count())
    gate_steps = fit_gate_steps(timings, gate_timings)
    print(format_fit(fitted))
    print(format_gate_steps(gate_steps))
    report = {"meta": runner.run_info("calibrate", cache), "timings": rows, "fitted": fitted,
              "gate_steps_us": gate_steps, "in_use": in_use()}
    path = Path(args.out) / out_name(runner.gpu_here())
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(report, indent=1) + "\n")
    print(f"wrote {path}")
    return report
