"""Chapter 07 exercises: prune autotune configs to the tiles that fit, and pick candidates from a sweep.

1. ``prune_to_fit(configs, named_args, **kwargs) -> list``: an ``early_config_prune`` for
   ``triton.autotune(..., prune_configs_by={"early_config_prune": fn})``. ``configs`` is a list of
   ``triton.Config`` with ``kwargs["BK"]``, ``kwargs["BV"]``; K and V are the launch's arguments,
   found in ``named_args`` (the arguments passed by position) or in ``kwargs`` (those passed by
   keyword — how ``chunk_fwd_h`` launches, so there ``named_args`` is empty). Keep the configs whose
   tiles fit: ``BK <= max(16, next_power_of_2(K))`` and ``BV <= max(16, next_power_of_2(V))`` (a
   wider tile only adds masked lanes). If none fits, keep the configs with the smallest ``BK·BV``
   (Triton needs at least one). Return a list of configs taken from ``configs``, in any order.

2. ``pick_candidates(table, n) -> list[str]``: ``table`` maps a shape's name to
   ``{config name: median ms}`` (a sweep; a config missing from a shape was not run there). Return
   at most ``n`` distinct config names, each present in every shape, that minimise the worst
   slowdown over the shapes::

       worst_slowdown(table, names) = max over shapes s of  min_{c in names} table[s][c] / min(table[s].values())

   i.e. the short list an autotuner would time on a first call, chosen so that no shape of the
   table is far from its best. Any list reaching the minimum is right.
"""
from __future__ import annotations

import itertools
import random

import triton

from .. import tuning


# ---- 1. an early_config_prune ------------------------------------------------------------------

def _fits(config, K: int, V: int) -> bool:
    return (config.kwargs["BK"] <= max(16, triton.next_power_of_2(K))
            and config.kwargs["BV"] <= max(16, triton.next_power_of_2(V)))


def prune_to_fit(configs, named_args, **kwargs) -> list:
    """The shipped solution: K, V from the positional or the keyword arguments; the fitting configs,
    or the smallest tiles when none fits."""
    args = {**named_args, **kwargs}
    K, V = args["K"], args["V"]
    kept = [c for c in configs if _fits(c, K, V)]
    if not kept:
        smallest = min(c.kwargs["BK"] * c.kwargs["BV"] for c in configs)
        kept = [c for c in configs if c.kwargs["BK"] * c.kwargs["BV"] == smallest]
    return kept


def _describe(c) -> str:
    return f"{c.kwargs['BK']}x{c.kwargs['BV']}w{c.num_warps}s{c.num_stages}"


def check_prune(fn=None) -> None:
    """Test ``fn(configs, named_args, **kwargs)`` (default: the shipped solution) as ``triton.autotune``
    calls it: on ``tuning.ALL_CONFIGS`` and on random subsets of it, for K, V powers of two and not,
    below 16 and above 128, with K, V passed by position and by keyword (beside other arguments).

    Raises ``AssertionError`` naming K, V, how they were passed and the configs wrongly kept or
    dropped, or, when ``fn`` raises ``KeyError`` (K looked up where it did not arrive), saying where
    arguments passed by position and by keyword arrive; any other exception raised inside ``fn``
    (such as ``NotImplementedError`` from the stub) propagates unchanged.
    """
    fn = prune_to_fit if fn is None else fn
    name = getattr(fn, "__name__", "your function")
    sizes = [(128, 128), (64, 64), (48, 40), (100, 256), (16, 16), (20, 200), (8, 128), (32, 12),
             (random.randint(1, 300), random.randint(1, 300))]
    lists = [list(tuning.ALL_CONFIGS), random.sample(tuning.ALL_CONFIGS, 12)]
    checked = 0
    for configs in lists:
        for K, V in sizes:
            want = {id(c) for c in prune_to_fit(configs, {"K": K, "V": V})}
            others = dict(T=1000, H=4, BT=64, OCCUPANCY=1, k=None)
            for how, call in [("by position", lambda: fn(list(configs), {"K": K, "V": V, "T": 1000})),
                              ("by keyword", lambda: fn(list(configs), {}, K=K, V=V, **others))]:
                try:
                    got = call()
                except KeyError as e:
                    where = "named_args" if how == "by keyword" else "kwargs"
                    raise AssertionError(
                        f"{name}: K={K}, V={V} passed {how} raised KeyError({e}): it looked the argument up in "
                        f"{where}, where it is not. Arguments passed by position arrive in named_args, those "
                        f"passed by keyword in kwargs (chunk_fwd_h launches by keyword, so named_args is empty "
                        f"there): read K and V from {{**named_args, **kwargs}}") from e
                if not isinstance(got, list):
                    raise AssertionError(f"{name} must return a list of configs, got {type(got).__name__}")
                if not got:
                    raise AssertionError(f"{name}: K={K}, V={V} ({how}) returned no config; "
                                         f"triton.autotune needs at least one")
                foreign = [c for c in got if not any(c is d for d in configs)]
                if foreign:
                    raise AssertionError(f"{name}: return configs taken from the list given, "
                                         f"got {len(foreign)} others")
                ids = {id(c) for c in got}
                extra = sorted(_describe(c) for c in configs if id(c) in ids - want)
                missing = sorted(_describe(c) for c in configs if id(c) in want - ids)
                if extra or missing:
                    raise AssertionError(f"{name}: K={K}, V={V} passed {how}: kept {len(extra)} that should go "
                                         f"{extra[:4]}, dropped {len(missing)} that should stay {missing[:4]}")
                checked += 1
    print(f"{name} prunes like the solution in {checked} calls (K, V by position and by keyword)")


# ---- 2. candidates from a sweep table ----------------------------------------------------------

def worst_slowdown(table: dict, names) -> float:
    """max over shapes of (fastest of ``names`` on the shape) / (the shape's fastest config)."""
    return max(min(row[c] for c in names) / min(row.values()) for row in table.values())


def _common(table: dict) -> list[str]:
    rows = list(table.values())
    return sorted(set(rows[0]).intersection(*rows[1:])) if rows else []


def pick_candidates(table: dict, n: int) -> list[str]:
    """The shipped solution: try every set of ``n`` configs present in all shapes (sweep tables are
    small: 66 configs, n <= 3 is at most 45,760 sets) and keep the one with the smallest worst
    slowdown."""
    common = _common(table)
    rel = [{c: row[c] / min(row.values()) for c in common} for row in table.values()]
    best, best_names = float("inf"), []
    for names in itertools.combinations(common, min(n, len(common))):
        w = max(min(r[c] for c in names) for r in rel)
        if w < best:
            best, best_names = w, list(names)
    return best_names


def _sweep_tables() -> list[tuple[str, dict]]:
    """The committed H200 sweep, grouped by the autotune key's occupancy bucket (one table per bucket)."""
    from ..figures import autotune as fig

    try:
        sweep = fig.load_sweep()
    except FileNotFoundError:
        return []
    by_bucket: dict[int, dict] = {}
    for row in sweep["rows"]:
        by_bucket.setdefault(fig.bucket_of(row), {})[fig.shape_label(row)] = dict(row["ms_by_config"])
    return [(f"H200 sweep, bucket {b}", t) for b, t in sorted(by_bucket.items())]


def _random_table(shapes: int, configs: int) -> dict:
    names = [f"c{i}" for i in range(configs)]
    table = {}
    for s in range(shapes):
        row = {c: random.uniform(1.0, 4.0) for c in names}
        if s % 3 == 2:  # some configs were not run on some shapes
            for c in random.sample(names[1:], 2):
                del row[c]
        table[f"shape{s}"] = row
    return table


def check_pick_candidates(fn=None) -> None:
    """Test ``fn(table, n) -> list of names`` (default: the shipped solution) on the committed H200
    sweep (one table per occupancy bucket) and on fresh random tables, for n = 1, 2, 3.

    The list must hold at most ``n`` distinct names present in every shape, and reach the smallest
    worst slowdown possible (found here by trying every set). Raises ``AssertionError`` naming the
    table and n; an exception raised inside ``fn`` propagates unchanged.
    """
    fn = pick_candidates if fn is None else fn
    name = getattr(fn, "__name__", "your function")
    # Eight random tables: alone (without the sweep file) three let a wrong rule through about
    # once in 1,700 calls; eight, about three in a billion.
    tables = _sweep_tables() + [(f"random table {i}", _random_table(5, 9)) for i in range(8)]
    for label, table in tables:
        common = set(_common(table))
        for n in (1, 2, 3):
            got = fn({s: dict(row) for s, row in table.items()}, n)
            if not isinstance(got, (list, tuple)):
                raise AssertionError(f"{name} must return a list of config names, got {type(got).__name__}")
            got = list(got)
            if len(got) > n or len(set(got)) != len(got) or not got:
                raise AssertionError(f"{name}: {label}, n={n}: need 1 to {n} distinct names, got {got}")
            absent = [c for c in got if c not in common]
            if absent:
                raise AssertionError(f"{name}: {label}, n={n}: {absent} not run on every shape")
            best = worst_slowdown(table, pick_candidates(table, n))
            mine = worst_slowdown(table, got)
            if mine > best * (1 + 1e-12):
                raise AssertionError(f"{name}: {label}, n={n}: {got} leaves a shape {mine:.3f}x from its best; "
                                     f"the best {n} can do {best:.3f}x")
    print(f"{name} reaches the smallest worst slowdown on {len(tables)} tables, n = 1, 2, 3")
