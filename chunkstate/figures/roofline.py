"""Chapter 11's cost model and figures: the state kernels on the H200's roofline, and the occupancy cliff.

Bytes come from the benchmark's byte model (:func:`chunkstate.bench.unique_bytes`); FLOPs are the
chunk's one matrix product, ``2·K·V`` per (token, head) in either direction (the forward's
``(k ⊙ ·)ᵀ v``, the backward's ``(q ⊙ ·)ᵀ do``); gating and decaying the state add about 1 %
(chapter 03) and are left out. Timings come from ``figures/sweep_fwd_h200.json``: every forward
config of ``chunkstate.tuning.ALL_CONFIGS`` timed on an H200 over 8 shapes, with fla-core 0.6.0
(autotuned over its 48 configs) beside them.

- ``roofline.png``: attainable FLOP/s against arithmetic intensity (FLOP per unique byte), with
  the bf16 tensor-core roof, the HBM roof of the datasheet and the measured copy roof; each sweep
  shape's best chunkstate config and fla as points.
- ``occupancy_h200.png``: time / floor per shape (floor = unique bytes / copy bandwidth), shapes
  ordered by the number of (sequence, head) pairs: the few-program shapes sit far above the floor.

``main(out_dir)`` redraws both from the committed JSON (no GPU needed).
"""
from __future__ import annotations

import json
import math
import re

from . import committed, save

H200_BF16_TFLOPS = 989.0  # dense bf16 tensor-core peak, H200 SXM datasheet
H200_HBM_TBPS = 4.8  # HBM3e bandwidth, H200 SXM datasheet
H200_SMS = 132
SWEEP_FILE = "sweep_fwd_h200.json"
_CONFIG = re.compile(r"(\d+)x(\d+)w(\d+)s(\d+)")


def flops(case) -> int:
    """FLOPs of one call of ``case`` (a :class:`chunkstate.bench.Case`): ``2·K·V`` per token and
    head, the chunk matrix product (gating and the state's decay, ~1 %, left out)."""
    s = case.shape
    return 2 * s.K * s.V * s.B * s.T * s.H


def total_bytes(case) -> int:
    """Unique bytes of one call: the sum of :func:`chunkstate.bench.unique_bytes` (no h0 / ht)."""
    from ..bench.model import unique_bytes

    return sum(unique_bytes(case).values())


def intensity(case) -> float:
    """Arithmetic intensity, FLOP per unique byte: :func:`flops` / :func:`total_bytes`."""
    return flops(case) / total_bytes(case)


def floor_ms(case, tbps: float) -> float:
    """The floor of one call in ms: its unique bytes moved at ``tbps`` TB/s, the bandwidth of the
    GPU it runs on (measured: ``chunkstate.bench.runner.copy_bandwidth()["tbps"]``; the H200's
    copy reached 4.25 TB/s)."""
    return total_bytes(case) / (tbps * 1e12) * 1e3


def ridge(tflops: float = H200_BF16_TFLOPS, tbps: float = H200_HBM_TBPS) -> float:
    """The ridge point in FLOP/byte: below it a kernel is bound by memory, not by math."""
    return tflops / tbps


def load_sweep(path=None) -> dict:
    """The committed H200 sweep: ``{"what", "device", "torch", "triton", "date", "inputs",
    "floor_ms", "copy_bandwidth_TBps", "bad_configs", "rows"}``; each row ``{"shape_BTHKV",
    "gate", "floor_ms", "fla_ms", "ms_by_config": {"BKxBVwWARPSsSTAGES": ms}}``. ``path``: the
    JSON; by default the checkout's ``figures/sweep_fwd_h200.json`` (FileNotFoundError outside a
    checkout, or when it is missing)."""
    return json.loads(committed(SWEEP_FILE, path, "load_sweep(path=...)").read_text())


def parse_config(name: str) -> tuple[int, int, int, int]:
    """``"64x128w4s3"`` -> (BK, BV, num_warps, num_stages)."""
    m = _CONFIG.fullmatch(name)
    if not m:
        raise ValueError(f"config name must look like '64x128w4s3', got {name!r}")
    return tuple(int(x) for x in m.groups())


def sweep_rows(sweep: dict) -> list[dict]:
    """One record per sweep shape, with the chunkstate config that was fastest and fla beside it.

    Keys: ``case`` (a forward :class:`chunkstate.bench.Case`, gate g, bf16 states), ``label``,
    ``heads`` (N·H), ``NT`` (chunks of 64 per sequence), ``floor_ms``, ``best_ms``,
    ``best_config`` (BK, BV, warps, stages), ``programs`` (launched by that config), ``fla_ms``,
    ``x_floor`` / ``fla_x_floor`` (time / floor), ``flops``, ``bytes``, ``intensity``.
    """
    from ..bench.model import BT, Case, Shape

    rows = []
    for r in sweep["rows"]:
        B, T, H, K, V = r["shape_BTHKV"]
        if K != V:
            raise ValueError(f"the byte model takes K = V, got K={K} V={V}")
        case = Case(Shape(B, T, H, K), "fwd", gate=r["gate"])
        timed = {name: ms for name, ms in r["ms_by_config"].items() if ms is not None and math.isfinite(ms)}
        best = min(timed, key=timed.get)
        BK, BV, _, _ = parse_config(best)
        rows.append({
            "case": case, "label": case.shape.label, "heads": case.shape.N * H, "NT": -(-T // BT),
            "floor_ms": r["floor_ms"], "best_ms": timed[best], "best_config": parse_config(best),
            "programs": case.shape.N * H * -(-K // BK) * -(-V // BV), "fla_ms": r.get("fla_ms"),
            "x_floor": timed[best] / r["floor_ms"],
            "fla_x_floor": r["fla_ms"] / r["floor_ms"] if r.get("fla_ms") else None,
            "flops": flops(case), "bytes": total_bytes(case), "intensity": intensity(case),
        })
    return rows


def draw_roofline(sweep: dict, peak_tflops: float = H200_BF16_TFLOPS, hbm_tbps: float = H200_HBM_TBPS):
    """Log-log roofline: attainable TFLOP/s against FLOP/byte, with each sweep shape's points.
    ``peak_tflops`` / ``hbm_tbps``: the datasheet roofs of the sweep's GPU (an H200's by default);
    the copy roof is the sweep's measured ``copy_bandwidth_TBps``."""
    import matplotlib.pyplot as plt

    copy = sweep["copy_bandwidth_TBps"]
    rows = sweep_rows(sweep)
    fig, ax = plt.subplots(figsize=(9, 5.6))
    x = [2.0 ** (e / 16) for e in range(2 * 16, 10 * 16 + 1)]  # 4 .. 1024, dense: the knees are exact
    ax.plot(x, [min(peak_tflops, hbm_tbps * i) for i in x], color="black", lw=1.5,
            label=f"datasheet: {peak_tflops:.0f} TFLOP/s bf16, {hbm_tbps} TB/s HBM")
    ax.plot(x, [min(peak_tflops, copy * i) for i in x], color="gray", lw=1.2, ls="--",
            label=f"measured copy roof {copy:.2f} TB/s")
    low, high = ridge(0.9 * peak_tflops, hbm_tbps), ridge(peak_tflops, hbm_tbps)
    ax.axvline(high, color="gray", lw=0.8, ls=":")
    ax.axvline(low, color="gray", lw=0.8, ls=":")
    ax.text(low * 0.97, 1.3, f"ridge {low:.0f}–{high:.0f} FLOP/byte\n(90–100 % of peak)",
            fontsize=8, color="dimgray", ha="right")
    for i, r in enumerate(rows):
        color = f"C{i % 10}"
        ax.plot(r["intensity"], r["flops"] / (r["best_ms"] * 1e-3) / 1e12, "o", color=color, ms=7,
                label=f"{r['label']}: chunkstate best config / fla")
        if r["fla_ms"]:
            ax.plot(r["intensity"], r["flops"] / (r["fla_ms"] * 1e-3) / 1e12, "^", color=color, ms=7,
                    markerfacecolor="none")
        if r["x_floor"] > 2:  # far below the roof: name it on the plot
            ax.annotate(f"{r['label']}: {r['x_floor']:.1f}× the floor", (r["intensity"],
                        r["flops"] / (r["best_ms"] * 1e-3) / 1e12), xytext=(8, -3), textcoords="offset points",
                        fontsize=7, color=color)
    ax.set_xscale("log", base=2)
    ax.set_yscale("log", base=10)
    ax.set_xlim(4, 1024)
    ax.set_ylim(1, 2000)
    ax.xaxis.set_major_formatter(lambda v, _: f"{v:g}")
    ax.set_xlabel("arithmetic intensity (FLOP per unique byte)")
    ax.set_ylabel("TFLOP/s (2·K·V per token and head / time)")
    ax.set_title(f"chunk_fwd_h on the roofline: {sweep['device']}, {sweep['date']}, torch {sweep['torch']}, "
                 f"triton {sweep['triton']}\n● chunkstate (fastest config of the sweep)   △ fla-core 0.6.0 "
                 "(autotuned); bf16 k, v, g gate, bf16 states, BT = 64", fontsize=9)
    ax.grid(True, which="both", alpha=0.25)
    ax.legend(fontsize=7, loc="upper left")
    fig.tight_layout()
    return fig


def draw_occupancy(sweep: dict, sms: int = H200_SMS):
    """Bars of time / floor per shape (chunkstate's best config, fla), shapes by N·H; ``sms``: the
    sweep's GPU's multiprocessors (an H200's 132 by default), named in the title."""
    import matplotlib.pyplot as plt

    rows = sorted(sweep_rows(sweep), key=lambda r: (r["heads"], r["label"]))
    fig, ax = plt.subplots(figsize=(11, 5.2))
    w = 0.4
    xs = range(len(rows))
    ax.bar([i - w / 2 for i in xs], [r["x_floor"] for r in rows], w, color="#4C72B0",
           label="chunkstate, fastest config of the sweep")
    ax.bar([i + w / 2 for i in xs], [r["fla_x_floor"] or 0.0 for r in rows], w, color="#DD8452",
           label="fla-core 0.6.0, autotuned")
    ax.axhline(1.0, color="black", lw=1, ls="--", label="floor: unique bytes / copy bandwidth")
    ax.set_xticks(list(xs))
    ax.set_xticklabels([f"{r['label']}\nN·H = {r['heads']}\n{r['NT']} chunks\nfloor {r['floor_ms'] * 1e3:.0f} µs"
                        for r in rows], fontsize=7)
    ax.set_ylabel("time / floor (1 = copy roof)")
    ax.set_title(f"The occupancy cliff: few (sequence, head) pairs leave most of the {sms} SMs idle "
                 f"({sweep['device']}, {sweep['date']})", fontsize=9)
    ax.grid(True, axis="y", alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    return fig


def main(out_dir, sweep_path=None):
    """Redraw ``roofline.png`` and ``occupancy_h200.png`` into ``out_dir`` from the sweep
    (``load_sweep(sweep_path)``: FileNotFoundError without one)."""
    sweep = load_sweep(sweep_path)
    return [save(draw(sweep), name, out_dir) for draw, name in ((draw_roofline, "roofline.png"),
                                                       (draw_occupancy, "occupancy_h200.png"))]
