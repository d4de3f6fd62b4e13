"""The benchmark's report: the table and summary on stdout, one line per case while it runs, the
JSON and the figure. Reads result records (``model.new_result`` filled by the runner); times nothing.
"""
from __future__ import annotations

import json
import math
import statistics
from pathlib import Path

from .model import geomean

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
    """One tuple of cells per result, in ``COLUMNS`` order."""
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
    """The copy bandwidth, per direction the geometric mean of fla / ours and chunkstate's ×floor
    range, how fla was tuned, and the cases that raised."""
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


WIN_AT = 0.97  # a case counts as a win where fla / ours >= this
PIECES_SLACK = 1.03  # auto pieces "as good as the best explicit count" within 3 %


def random_summary(report: dict) -> dict:
    """The random mode's numbers: over the cases with a valid fla timing, how many chunkstate wins
    (fla / ours >= ``WIN_AT``), the geometric mean and the worst of fla / ours; chunkstate's ×floor
    median and worst; auto pieces against the best explicit count where those were timed: as
    timed (``auto_over_best``) and as chosen (``choice_over_best``, the chosen count's explicit
    timing; counted over the cases where it was timed); and both paired by round (``paired_ok``,
    ``paired_choice_ok``: per round over the best count's timing in that round, the median; counted
    over the cases whose calls have every round; fla / ours paired likewise: ``fla_paired_*``); and
    the measurement's own spread: where the chosen count was also timed explicitly, the same launch
    twice, paired by round (``twins``, and how many came out more than ``PIECES_SLACK`` apart either
    way: ``twins_slower``, ``twins_faster``)."""
    results = [r for r in report["cases"] if not r.get("skipped")]

    def named(key):  # (value, case) wherever the case has ``key``
        return [(r[key], r["case"]) for r in results if r.get(key)]

    def against_best(pairs):  # (cases judged, within PIECES_SLACK of the best count, the worst)
        return len(pairs), sum(x <= PIECES_SLACK for x, _ in pairs), max(pairs, default=None)

    ratios = named("fla_over_ours")
    floors = [(r["ours"]["x_floor"], r["case"]) for r in results if (r.get("ours") or {}).get("x_floor")]
    fla_paired = [x for x, _ in named("fla_over_ours_paired")]
    out = {"cases": len(results), "compared": len(ratios), "wins": sum(x >= WIN_AT for x, _ in ratios),
           "geomean": geomean(x for x, _ in ratios), "worst": min(ratios, default=None),
           "x_floor_median": statistics.median(x for x, _ in floors) if floors else None,
           "x_floor_worst": max(floors, default=None),
           "fla_paired_compared": len(fla_paired), "fla_paired_wins": sum(x >= WIN_AT for x in fla_paired),
           "fla_paired_geomean": geomean(fla_paired), "fla_paired_worst": min(fla_paired, default=None)}
    for keys, source in ((("pieces_explored", "pieces_ok", "pieces_worst"), "auto_over_best"),
                         (("choices_explored", "choice_ok", "choice_worst"), "choice_over_best"),
                         (("paired_explored", "paired_ok", "paired_worst"), "auto_over_best_paired"),
                         (("paired_choices_explored", "paired_choice_ok", "paired_choice_worst"),
                          "choice_over_best_paired")):
        out.update(zip(keys, against_best(named(source))))
    twins = [x for x, _ in named("auto_over_twin_paired")]
    out.update(twins=len(twins), twins_slower=sum(x > PIECES_SLACK for x in twins),
               twins_faster=sum(x < 1 / PIECES_SLACK for x in twins))
    return out


def format_random_summary(report: dict) -> str:
    """One line: ``random_summary`` in words."""
    m, s = report["meta"].get("random", {}), random_summary(report)
    pct = lambda a, b: f"{a}/{b} ({100 * a / b:.0f} %)" if b else "0/0"  # noqa: E731
    def case(key, unit=""):  # "0.93× (its case)", or "-"
        return f"{s[key][0]:.2f}{unit} ({s[key][1]})" if s[key] else "-"

    worst, xfw = case("worst"), case("x_floor_worst")
    pw, cw, pw2 = case("pieces_worst", "×"), case("choice_worst", "×"), case("paired_worst", "×")
    return (f"random seed {m.get('seed')}, {m.get('n')} shapes, {s['cases']} cases: chunkstate >= {WIN_AT}× fla in "
            f"{pct(s['wins'], s['compared'])}; fla/ours geomean {_fmt(s['geomean'], '.2f')}, worst {worst}; "
            f"×floor median {_fmt(s['x_floor_median'], '.2f')}, worst {xfw}; auto pieces within "
            f"{round(100 * (PIECES_SLACK - 1))} % of the best explicit count in {pct(s['pieces_ok'], s['pieces_explored'])}"
            f", worst {pw}; its count, judged by the explicit timings, in {pct(s['choice_ok'], s['choices_explored'])}, worst {cw}"
            + ("" if not (s["fla_paired_compared"] or s["paired_explored"]) else  # runs before the rounds: none
            f"; paired by round: >= {WIN_AT}× fla in {pct(s['fla_paired_wins'], s['fla_paired_compared'])}, "
            f"geomean {_fmt(s['fla_paired_geomean'], '.2f')}, worst {_fmt(s['fla_paired_worst'], '.2f')}; "
            f"auto in {pct(s['paired_ok'], s['paired_explored'])}, worst {pw2}, its count in "
            f"{pct(s['paired_choice_ok'], s['paired_choices_explored'])}")
            + ("" if not s["twins"] else
               f"; the same launch twice (auto and its count, paired): auto > {round(100 * (PIECES_SLACK - 1))} % "
               f"slower in {s['twins_slower']} of {s['twins']}, faster in {s['twins_faster']}"))


BIG_FLOOR_MS = 0.1  # a call whose floor is at least this moves enough bytes that the host's time hides behind it


def readme_random_table(reports: list[dict]) -> str:
    """The README's summary of the random runs ``reports``, in markdown: a table over all their cases
    compared with fla and over those with a floor of ``BIG_FLOOR_MS`` or more (how many chunkstate ran
    at least ``WIN_AT``× as fast as fla, the geometric mean of fla / chunkstate, overall and by
    direction, the worst case with its piece count, chunkstate's worst time over the floor), then
    a line on auto pieces against the best explicit count (as timed, and its count judged by the
    explicit timings: ``random_summary``'s; the worst case of each). ``tests/test_bench.py`` checks
    that the README quotes this for the runs it names."""
    cases = [r for rep in reports for r in rep["cases"] if not r.get("skipped") and r.get("fla_over_ours")]
    sums = [random_summary(rep) for rep in reports]
    lines = ["| cases | count | chunkstate at least 0.97× fla | fla / chunkstate, geometric mean | worst "
             "| chunkstate / floor, worst |", "|---|---|---|---|---|---|"]
    big = [r for r in cases if r["floor_ms"] >= BIG_FLOOR_MS]
    for label, rows in (("all", cases), (f"floor ≥ {BIG_FLOOR_MS} ms", big)):
        g = {d: geomean(r["fla_over_ours"] for r in rows if r["direction"] == d) for d in ("fwd", "bwd")}
        worst = min(rows, key=lambda r: r["fla_over_ours"])
        cut = f"{worst['pieces']} pieces" if worst.get("pieces", 1) > 1 else "one pass"
        over = max(rows, key=lambda r: r["ours"]["x_floor"])
        lines.append(f"| {label} | {len(rows)} | {sum(r['fla_over_ours'] >= WIN_AT for r in rows)} | "
                     f"{geomean(r['fla_over_ours'] for r in rows):.2f} (forward {_fmt(g['fwd'], '.2f')}, backward "
                     f"{_fmt(g['bwd'], '.2f')}) | {worst['fla_over_ours']:.2f}× ({worst['case']}, {cut}) | "
                     f"{over['ours']['x_floor']:.2f}× ({over['case']}) |")
    total = lambda key: sum(s[key] for s in sums)  # noqa: E731

    def worst(key):  # " (worst 1.38×, its case)" over the runs, or nothing
        w = max((s[key] for s in sums if s[key]), default=None)
        return "" if w is None else f" (worst {w[0]:.2f}×, {w[1]})"
    lines += ["", f"Auto pieces, where the runs also timed explicit counts (one pass under two waves of programs): "
                  f"chunkstate's own choice within {round(100 * (PIECES_SLACK - 1))} % of the best "
                  f"count in **{total('pieces_ok')} of {total('pieces_explored')}** cases as timed"
                  f"{worst('pieces_worst')}, its count in {total('choice_ok')} of {total('choices_explored')} judged "
                  f"by the explicit timings{worst('choice_worst')}."]
    return "\n".join(lines)


def readme_suite_table(report: dict) -> str:
    """The README's summary of a fixed-suite run ``report``, in markdown: per direction, over the cases
    where fla's result is right, how many chunkstate ran at least as fast as fla, the geometric mean
    of fla / chunkstate and the worst case (with its floor); then fla / chunkstate's range over the
    cases cut into pieces and over the packed batches. ``tests/test_bench.py`` checks that the README
    quotes this for the committed run."""
    cases = [r for r in report["cases"] if r.get("fla_over_ours") and (r.get("fla") or {}).get("valid", True)]
    lines = ["| direction | cases (fla right) | chunkstate at least as fast | fla / chunkstate, geometric mean "
             "| worst |", "|---|---|---|---|---|"]
    for direction, name in (("fwd", "forward"), ("bwd", "backward")):
        rows = [r for r in cases if r["direction"] == direction]
        worst = min(rows, key=lambda r: r["fla_over_ours"])
        lines.append(f"| {name} | {len(rows)} | {sum(r['fla_over_ours'] >= 1 for r in rows)} | "
                     f"{geomean(r['fla_over_ours'] for r in rows):.2f} | {worst['fla_over_ours']:.2f}× "
                     f"({worst['case']}; floor {worst['floor_ms'] * 1e3:.0f} µs) |")

    def span(rows):
        ratios = [r["fla_over_ours"] for r in rows]
        n = len(ratios)
        return f"{min(ratios):.2f}-{max(ratios):.2f}× fla over {n} case{'s' * (n != 1)}" if ratios else "none"
    below = sorted(r["fla_over_ours"] for r in cases if r["fla_over_ours"] < 1)
    lines += ["", f"Below fla in {len(below)} of {len(cases)}: " + ", ".join(f"{x:.2f}×" for x in below)
              + f". Cut into pieces: {span([r for r in cases if r.get('pieces', 1) > 1])}; packed batches: "
              f"{span([r for r in cases if r.get('lens')])}."]
    return "\n".join(lines)


def format_sweep(report: dict) -> str:
    """Per swept case, its fastest configs (``*``: among those the autotuner tries)."""
    lines = []
    for s in report["sweep"]:
        lines.append(f"{s['case']} (occupancy bucket {s['occupancy_bucket']}; * = tried by the autotuner):")
        for t in s["top"]:
            lines.append(f"  BK={t['config'][0]:3d} BV={t['config'][1]:3d} warps={t['config'][2]} "
                         f"stages={t['config'][3]}{' tma' if t['config'][4:5] == [True] else ''}"
                         f"  {t['ms']:.4f} ms  {t['tbps']:.2f} TB/s {'*' if t['candidate'] else ''}")
    return "\n".join(lines)


def case_line(r: dict) -> str:
    """One case's result on one line (the progress output while the run goes)."""
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


# ---------------------------------------------------------------- files

_VENDOR_WORDS = {"nvidia", "geforce", "tesla", "quadro", "amd", "radeon", "instinct"}


def gpu_tag(name: str) -> str:
    """A device's short name in the benchmark's file names, from its name as torch gives it (a run's
    ``meta["device"]["name"]``): the words after the vendor's, up to the first with a digit, each up
    to its first hyphen, lower case, letters and digits only. "NVIDIA H200" -> "h200", "NVIDIA H100
    80GB HBM3" -> "h100", "NVIDIA GeForce RTX 4090" -> "rtx4090", "NVIDIA A100-SXM4-80GB" -> "a100",
    "CPU" -> "cpu". So a run on another GPU never overwrites the H200's committed files."""
    tag = ""
    for word in name.split():
        if word.lower() in _VENDOR_WORDS:
            continue
        word = word.split("-")[0]
        tag += "".join(ch for ch in word.lower() if ch.isascii() and ch.isalnum())
        if any(ch.isdigit() for ch in word):
            break
    return tag or "gpu"


def output_paths(out_dir, mode: str, gpu: str) -> tuple[Path, Path]:
    """The JSON and PNG a run of ``mode`` on the GPU ``gpu`` (``gpu_tag``) writes into ``out_dir``:
    ``bench_<gpu>[_mode].json`` / ``.png``, e.g. ``bench_h200_random_s7.json``."""
    stem = f"bench_{gpu}" if mode == "default" else f"bench_{gpu}_{mode}"
    return Path(out_dir) / f"{stem}.json", Path(out_dir) / f"{stem}.png"


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
    """Draw ``report`` (``chunkstate.figures.speed``) into ``path``, a PNG."""
    import matplotlib

    matplotlib.use("Agg")
    from ..figures import speed

    return speed.save_png(report, path)


SECOND_PROCESS_WHY = ("the first process's run was stopped by its time limit before these shapes (or their second "
                      "direction); they were timed in a second process, both directions of each such shape together")


def merge_random(first: dict, second: dict, expected: list[tuple[str, str]]) -> dict:
    """One random run's report from two processes of the same seed: a first run cut short by its
    time limit (``--budget``, or the call's), and a second timing the shapes left (``--shapes``).

    ``expected`` holds the seed's (case label, shape label) pairs in its order (from
    ``model.random_cases``). A shape comes whole from one process, both directions together: from
    the first where it holds both, else from the second, which must then hold both (a shape with
    one direction in each is an error, not a mix); the merged cases follow the seed's order. The
    cases keep their own process's derived numbers (×floor, TB/s by that process's copy
    bandwidth); ``meta`` is the first's, with ``meta.second_process`` naming the second's cases, its
    date, host probe and copy bandwidth. Raises ValueError naming what does
    not fit: another mode or seed, a case the seed does not draw, a shape neither holds whole."""
    seeds = [(r.get("meta") or {}).get("random") or {} for r in (first, second)]
    for name, meta in zip(("first", "second"), seeds):
        if "seed" not in meta:
            raise ValueError(f"the {name} report is not a --random run (no meta.random)")
    if (seeds[0]["seed"], seeds[0].get("n")) != (seeds[1]["seed"], seeds[1].get("n")):
        raise ValueError(f"the reports are of different runs: seed {seeds[0]['seed']} n {seeds[0].get('n')} "
                         f"and seed {seeds[1]['seed']} n {seeds[1].get('n')}")
    by_shape: dict[str, list[str]] = {}  # the seed's shapes and their cases, in its order
    for label, shape in expected:
        by_shape.setdefault(shape, []).append(label)
    seed_cases = {label for label, _ in expected}
    held = []
    for name, report in (("first", first), ("second", second)):
        cases = {}
        for r in report.get("cases", []):
            if r["case"] not in seed_cases:
                raise ValueError(f"the {name} report's case {r['case']!r} is not one of seed {seeds[0]['seed']}'s")
            if r["case"] in cases:
                raise ValueError(f"the {name} report holds case {r['case']!r} twice")
            cases[r["case"]] = r
        held.append(cases)
    merged, from_second = [], []
    for shape, labels in by_shape.items():
        whole = [i for i, cases in enumerate(held) if all(label in cases for label in labels)]
        if whole:
            merged += [held[whole[0]][label] for label in labels]
            from_second += labels if whole[0] == 1 else []
        elif any(label in cases for cases in held for label in labels):
            raise ValueError(f"shape {shape!r}: neither report holds all of {labels}; a shape's directions "
                             "come from one process")
    meta = json.loads(json.dumps(first["meta"]))  # a copy
    meta["second_process"] = {"cases": from_second, "why": SECOND_PROCESS_WHY,
                              "host_probe": second["meta"].get("host_probe"), "copy": second["meta"].get("copy"),
                              "date": second["meta"].get("date")}
    return {"meta": meta, "cases": merged}
