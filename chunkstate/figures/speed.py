"""The benchmark's figure (chapter 11): each case's time against the copy roof, chunkstate and fla.

``draw(report)`` takes a report written by ``python -m chunkstate.bench`` (the JSON in
``figures/bench_h200.json``: ``{"meta": ..., "cases": [...]}``) and returns a two-panel figure:

- top: time / floor per case (floor = the case's unique bytes / the measured copy bandwidth), so
  1 is the copy roof and lower is better;
- bottom: effective bandwidth per case (unique bytes / time) against the copy bandwidth.

A case where fla's result is known to be wrong (its backward with split_size > chunk_size) is
drawn hatched. ``main()`` redraws ``figures/bench_*.png`` from the JSON files committed beside
them (no GPU needed; ``out_dir`` and ``reports_dir`` choose other folders); it draws nothing when
there are none.
"""
from __future__ import annotations

import json
from pathlib import Path

from . import FIGURES_DIR, save

OURS_COLOR, FLA_COLOR = "#4C72B0", "#DD8452"


def _finite(x):
    return x is not None and x == x and x not in (float("inf"), float("-inf"))


def _value(result: dict, who: str, key: str):
    entry = result.get(who) or {}
    x = entry.get(key)
    return x if _finite(x) else None


def draw(report: dict):
    """Two panels (time / floor, effective TB/s) with one pair of bars per case; returns the figure."""
    import matplotlib.pyplot as plt

    meta, cases = report.get("meta", {}), [c for c in report.get("cases", []) if c.get("ours")]
    n = len(cases)
    fig, (ax1, ax2) = plt.subplots(2, 1, figsize=(max(8.0, 0.34 * n + 2.5), 8.5), sharex=True)
    x = list(range(n))
    w = 0.4
    copy = (meta.get("copy") or {}).get("tbps")
    for ax, key in ((ax1, "x_floor"), (ax2, "tbps")):
        ours = [_value(c, "ours", key) for c in cases]
        ax.bar([i - w / 2 for i in x], [v or 0.0 for v in ours], w, color=OURS_COLOR, label="chunkstate")
        fla_ok = [i for i, c in enumerate(cases) if c.get("fla") and c["fla"].get("valid", True)]
        fla_bad = [i for i, c in enumerate(cases) if c.get("fla") and not c["fla"].get("valid", True)]
        if fla_ok:
            ax.bar([i + w / 2 for i in fla_ok], [_value(cases[i], "fla", key) or 0.0 for i in fla_ok], w,
                   color=FLA_COLOR, label="fla-core 0.6.0")
        if fla_bad:
            ax.bar([i + w / 2 for i in fla_bad], [_value(cases[i], "fla", key) or 0.0 for i in fla_bad], w,
                   color="white", edgecolor=FLA_COLOR, hatch="///",
                   label="fla-core 0.6.0, wrong result (bwd with split > chunk)")
        ax.grid(True, axis="y", alpha=0.3)
    ax1.axhline(1.0, color="black", lw=1, ls="--", label="floor: unique bytes / copy bandwidth")
    ax1.set_ylabel("time / floor  (1 = copy roof, lower is better)")
    if copy:
        ax2.axhline(copy, color="black", lw=1, ls="--", label=f"copy bandwidth {copy:.2f} TB/s")
    ax2.set_ylabel("effective TB/s  (unique bytes / time)")
    ax2.set_xticks(x)
    ax2.set_xticklabels([c["case"] for c in cases], rotation=90, fontsize=7)
    for ax in (ax1, ax2):  # head room for the legend
        ax.set_ylim(0, ax.get_ylim()[1] * 1.3)
        ax.legend(fontsize=8, loc="upper left", ncol=2)
    versions = meta.get("versions", {})
    title = (f"chunk_fwd_h / chunk_bwd_dh on {meta.get('device', {}).get('name', '?')}"
             f" ({meta.get('date', '?')}): torch {versions.get('torch', '?')}, triton {versions.get('triton', '?')},"
             f" fla-core {versions.get('fla', 'n/a')}")
    fla_note = (meta.get("fla") or {}).get("configs_note")
    if fla_note:
        title += f"\nfla autotune: {fla_note}"
    ax1.set_title(title, fontsize=9)
    fig.tight_layout()
    return fig


def draw_random(report: dict):
    """A random-shape report (``--random SEED``): fla / ours per case against the launch's 64×64
    programs per SM (left; above 1: chunkstate faster) and chunkstate's time / floor (right), each
    case coloured by its tokens per sequence, forward as circles and backward as triangles, packed
    batches hollow. Returns the figure."""
    import matplotlib.pyplot as plt
    from matplotlib.colors import LogNorm

    from ..pieces import programs_64

    meta = report.get("meta", {})
    sms = (meta.get("device") or {}).get("sms") or 132
    cases = [c for c in report.get("cases", []) if _value(c, "ours", "ms")]
    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(13, 5.2))
    norm = LogNorm(vmin=256, vmax=131072)
    sc = None
    for c in cases:
        N = len(c["lens"]) if c.get("lens") else c["B"]
        programs = programs_64(N, c["H"], c["K"], c["V"])
        per_seq = c["B"] * c["T"] / N
        x = programs / sms
        marker = "o" if c["direction"] == "fwd" else "^"
        packed = bool(c.get("lens"))
        colour = plt.get_cmap("viridis")(norm(per_seq))
        face = "none" if packed else colour
        for ax, y in ((ax1, c.get("fla_over_ours")), (ax2, _value(c, "ours", "x_floor"))):
            if y is not None:
                sc = ax.scatter([x], [y], marker=marker, facecolors=[face], edgecolors=[colour], s=42)
    for ax in (ax1, ax2):
        ax.set_xscale("log")
        ax.set_xlabel("programs per SM (N·H·⌈K/64⌉·⌈V/64⌉ / SMs)")
        ax.grid(True, alpha=0.3, which="both")
    ax1.set_yscale("log")
    ax1.axhline(1.0, color="black", lw=1)
    ax1.axhline(0.97, color="black", lw=1, ls=":")
    ax1.set_ylabel("fla time / chunkstate time  (> 1: chunkstate faster)")
    ax2.axhline(1.0, color="black", lw=1, ls="--")
    ax2.set_ylabel("chunkstate time / floor  (1 = copy roof)")
    mappable = plt.cm.ScalarMappable(norm=norm, cmap="viridis")
    fig.colorbar(mappable, ax=[ax1, ax2], label="tokens per sequence (mean)", pad=0.01)
    from matplotlib.lines import Line2D
    handles = [Line2D([], [], marker="o", ls="", color="grey", label="forward"),
               Line2D([], [], marker="^", ls="", color="grey", label="backward"),
               Line2D([], [], marker="o", ls="", markerfacecolor="none", color="grey", label="packed batch")]
    ax1.legend(handles=handles, fontsize=8, loc="lower right")
    rnd = meta.get("random", {})
    versions = meta.get("versions", {})
    fig.suptitle(f"random shapes, seed {rnd.get('seed', '?')} ({rnd.get('n', '?')} shapes) on "
                 f"{(meta.get('device') or {}).get('name', '?')} ({meta.get('date', '?')}): torch "
                 f"{versions.get('torch', '?')}, triton {versions.get('triton', '?')}, fla-core "
                 f"{versions.get('fla', 'n/a')}", fontsize=9)
    return fig


def save_png(report: dict, path) -> Path:
    """Draw ``report`` (``draw_random`` for a random-shape report, else ``draw``) and write it to
    ``path`` (PNG, no timestamp metadata: same report, same bytes)."""
    path = Path(path).resolve()
    fig = draw_random(report) if (report.get("meta") or {}).get("random") else draw(report)
    return save(fig, path.name, path.parent)


def main(out_dir=None, reports_dir=None):
    """Redraw ``bench_*.png`` from the benchmark reports ``bench_*.json`` (any GPU's) in ``reports_dir``
    (default: the checkout's ``figures/``; FileNotFoundError outside a checkout) into ``out_dir``
    (default: beside each report, as the benchmark writes them). Sweeps have no figure."""
    reports = FIGURES_DIR if reports_dir is None else Path(reports_dir)
    if reports is None:
        raise FileNotFoundError("bench_*.json: chunkstate is not running from a repository checkout, so there "
                                "is no figures/ folder to read the benchmark reports from; pass main(reports_dir=...)")
    paths = []
    for report_path in sorted(reports.glob("bench_*.json")):
        report = json.loads(report_path.read_text())
        if "cases" in report:
            png = report_path.with_suffix(".png")
            paths.append(save_png(report, png if out_dir is None else Path(out_dir) / png.name))
    return paths
