"""The config landscape of the forward kernel (chapter 07), drawn from a committed H200 sweep.

``figures/sweep_fwd_h200.json`` (written by ``python -m chunkstate.bench --sweep`` on an H200)
holds, for 8 shapes, the median time of every config of ``tuning.ALL_CONFIGS`` that existed then
(stages 2-4) through ``chunk_fwd_h(..., config=c, pieces=1)``, fla-core 0.6.0's autotuned time for
the same shape and the copy-roof floor. Config names read ``{BK}x{BV}w{num_warps}s{num_stages}``.

- ``draw_landscape(sweep)``: per shape, every config's time / the shape's best, the candidates the
  autotuner would try for that shape (``tuning.prune`` for its K, V and occupancy bucket), fla's time
  and the floor;
- ``draw_reuse(sweep)``: among shapes with the same K, V, the slowdown of running every shape with
  one shape's winner — what a key without B, T, H does (fla's);
- ``main(out_dir)`` redraws ``autotune_landscape.png`` and ``autotune_reuse.png`` into ``out_dir``
  from the JSON (no GPU needed).

Occupancy buckets come from ``tuning.occupancy_bucket``, i.e. from this machine's SM count (132 on a
machine without a GPU, as on the H200 of the sweep).
"""
from __future__ import annotations

import json
import re

from . import committed, save

SWEEP_FILE = "sweep_fwd_h200.json"
_NAME = re.compile(r"^(\d+)x(\d+)w(\d+)s(\d+)$")
ALL_COLOR, CAND_COLOR, BEST_COLOR, FLA_COLOR = "#B0B0B0", "#4C72B0", "#55A868", "#DD8452"


def load_sweep(path=None) -> dict:
    """The sweep report: ``{"device", "rows": [{"shape_BTHKV", "ms_by_config", "fla_ms", "floor_ms"}, ...], ...}``.
    ``path``: the JSON; by default the checkout's ``figures/sweep_fwd_h200.json``
    (FileNotFoundError outside a checkout, or when it is missing)."""
    return json.loads(committed(SWEEP_FILE, path, "load_sweep(path=...)").read_text())


def config_name(config) -> str:
    """``"64x128w8s3"`` for a ``triton.Config`` or a ``(BK, BV, num_warps, num_stages[, USE_TMA])``
    tuple; a config loading through TMA descriptors ends in ``tma`` (``"64x64w4s6tma"``)."""
    if not isinstance(config, tuple):
        from .. import tuning

        config = tuning.config_tuple(config)
    BK, BV, w, s, *tma = config
    return f"{BK}x{BV}w{w}s{s}" + ("tma" if tma and tma[0] else "")


def parse_name(name: str) -> tuple[int, int, int, int]:
    """``"64x128w8s3"`` -> ``(64, 128, 8, 3)``; ValueError for anything else."""
    m = _NAME.match(name)
    if not m:
        raise ValueError(f"config name must look like '64x128w8s3', got {name!r}")
    return tuple(int(x) for x in m.groups())


def shape_of(row: dict) -> tuple[int, int, int, int, int]:
    """``(B, T, H, K, V)`` of a sweep row."""
    return tuple(row["shape_BTHKV"])


def shape_label(row: dict, sep: str = " ") -> str:
    B, T, H, K, V = shape_of(row)
    kv = f"K{K}" if K == V else f"K{K} V{V}"
    return sep.join([f"B{B} T{T}", f"H{H} {kv}"])


def bucket_of(row: dict) -> int:
    """The autotune key's ``OCCUPANCY`` bucket of the row's launch (dense rows: N = B)."""
    from .. import tuning

    B, _, H, K, V = shape_of(row)
    return tuning.launch_bucket(B, H, K, V)


def candidate_names(K: int, V: int, num_heads_total: int) -> list[str]:
    """The configs the package's autotuner benchmarks on a first call for K, V and N·H (sequence, head) pairs:
    ``tuning.prune`` applied to ``tuning.ALL_CONFIGS`` as ``triton.autotune`` would apply it, for
    the sweep's inputs (bf16, the gate g, chunks of 64) and pointer loads (the sweep timed no TMA
    config; on a Hopper GPU bucket 1 adds one), fitted to this machine's GPU (an H200 without one)."""
    import torch

    from .. import tuning

    kept = tuning.prune(tuning.ALL_CONFIGS, {}, K=K, V=V, OCCUPANCY=tuning.launch_bucket(num_heads_total, 1, K, V),
                        BT=64, USE_G=True, k=torch.bfloat16)
    return list(dict.fromkeys(config_name(c) for c in kept))


def row_candidates(row: dict) -> list[str]:
    B, _, H, K, V = shape_of(row)
    return candidate_names(K, V, B * H)


def relative_times(row: dict) -> dict[str, float]:
    """Every swept config's time divided by the row's best time (1 = the fastest config)."""
    ms = row["ms_by_config"]
    best = min(ms.values())
    return {name: t / best for name, t in ms.items()}


def winner(row: dict) -> str:
    """The row's fastest config."""
    ms = row["ms_by_config"]
    return min(ms, key=ms.get)


def reuse_matrix(sweep: dict, K: int = 128, V: int = 128):
    """Rows of ``sweep`` with this K, V; ``M[i][j]`` = time of row i's winner on row j / row j's best.

    Returns ``(rows, M)``; the diagonal is 1. ``M[i][j]`` is what running shape j costs when the key
    cannot tell it from shape i and shape i happened to be tuned first.
    """
    rows = [r for r in sweep["rows"] if shape_of(r)[3:] == (K, V)]
    M = [[relative_times(rj)[winner(ri)] for rj in rows] for ri in rows]
    return rows, M


def _title(sweep: dict) -> str:
    return f"{sweep.get('device', '?')}, triton {sweep.get('triton', '?')}, {sweep.get('date', '?')}"


def draw_landscape(sweep: dict):
    """Per shape: every config (grey), the autotuner's candidates (blue; the fastest green), fla's
    autotuned time (orange) and the copy-roof floor (dashed), all relative to the shape's best."""
    import matplotlib.pyplot as plt
    from matplotlib.ticker import NullFormatter

    rows = sweep["rows"]
    fig, ax = plt.subplots(figsize=(11, 5.2))
    for i, row in enumerate(rows):
        rel = relative_times(row)
        names = sorted(rel)
        # a deterministic horizontal spread: each config at its own offset inside the shape's slot
        for j, name in enumerate(names):
            ax.plot(i - 0.3 + 0.6 * j / max(1, len(names) - 1), rel[name], "o", ms=3.5, color=ALL_COLOR,
                    label="every swept config" if i == 0 and j == 0 else None)
        cands = row_candidates(row)
        swept = [c for c in cands if c in rel]
        best_cand = min(swept, key=rel.get)
        for c in swept:
            color = BEST_COLOR if c == best_cand else CAND_COLOR
            ax.plot(i, rel[c], "o", ms=9, mfc="none", mec=color, mew=2)
        unswept = len(cands) - len(swept)
        if unswept:
            ax.annotate(f"+{unswept} not swept\n(5 stages)", (i, 0.92), ha="center", va="top", fontsize=7,
                        color=CAND_COLOR)
        fla = row.get("fla_ms")
        if fla:
            ax.plot(i, fla / min(row["ms_by_config"].values()), "D", ms=8, color=FLA_COLOR)
        floor = row.get("floor_ms")
        if floor:
            ax.hlines(floor / min(row["ms_by_config"].values()), i - 0.4, i + 0.4, colors="black", lw=1,
                      linestyles="--")
    ax.plot([], [], "o", ms=9, mfc="none", mec=CAND_COLOR, mew=2, label="candidates for the shape's key")
    ax.plot([], [], "o", ms=9, mfc="none", mec=BEST_COLOR, mew=2, label="fastest candidate (what tuning picks)")
    ax.plot([], [], "D", ms=8, color=FLA_COLOR, label="fla-core 0.6.0, autotuned over its 48 configs")
    ax.plot([], [], "--", color="black", lw=1, label="floor: unique bytes / copy bandwidth")
    ax.set_yscale("log")
    ax.yaxis.set_minor_formatter(NullFormatter())
    ax.set_yticks([0.25, 0.5, 1, 1.5, 2, 3, 4])
    ax.set_yticklabels(["0.25", "0.5", "1", "1.5", "2", "3", "4"])
    ax.set_ylim(0.12, 5)
    ax.set_xticks(range(len(rows)))
    ax.set_xticklabels([f"{shape_label(r, chr(10))}\nbucket {bucket_of(r)}" for r in rows], fontsize=8)
    ax.set_xlim(-0.6, len(rows) - 0.4)
    ax.set_ylabel("time / fastest config of the shape  (log)")
    ax.grid(True, axis="y", alpha=0.3)
    ax.legend(fontsize=8, loc="upper left", ncol=3)
    ax.set_title(f"chunk_fwd_h, every config on 8 shapes (bf16, gate g, BT = 64): {_title(sweep)}", fontsize=9)
    fig.tight_layout()
    return fig


def draw_reuse(sweep: dict, K: int = 128, V: int = 128):
    """Heat map of ``reuse_matrix``: the slowdown on each shape (column) of each shape's winner (row)."""
    import matplotlib.pyplot as plt

    rows, M = reuse_matrix(sweep, K, V)
    n = len(rows)
    fig, ax = plt.subplots(figsize=(1.1 * n + 3.5, 0.8 * n + 2.2))
    im = ax.imshow(M, cmap="Reds", vmin=1.0, vmax=max(3.0, max(max(r) for r in M)))
    for i in range(n):
        for j in range(n):
            ax.text(j, i, f"{M[i][j]:.2f}", ha="center", va="center", fontsize=8,
                    color="white" if M[i][j] > 2.2 else "black")
    labels = [shape_label(r, chr(10)) for r in rows]
    ax.set_xticks(range(n))
    ax.set_xticklabels(labels, fontsize=7)
    ax.set_yticks(range(n))
    ax.set_yticklabels([f"{winner(r)}\n(wins {shape_label(r)})" for r in rows], fontsize=7)
    ax.set_xlabel("shape it runs on")
    ax.set_ylabel("config reused (the winner of one shape)")
    fig.colorbar(im, ax=ax, shrink=0.8, label="time / that shape's best")
    ax.set_title(f"One winner for every shape (a key without B, T, H), K = {K}, V = {V}\n{_title(sweep)}",
                 fontsize=9)
    fig.tight_layout()
    return fig


def main(out_dir, sweep_path=None) -> list:
    """Redraw ``autotune_landscape.png`` and ``autotune_reuse.png`` into ``out_dir`` from the sweep
    (``load_sweep(sweep_path)``: FileNotFoundError without one)."""
    sweep = load_sweep(sweep_path)
    return [save(draw(sweep), name, out_dir)
            for draw, name in ((draw_landscape, "autotune_landscape.png"), (draw_reuse, "autotune_reuse.png"))]

