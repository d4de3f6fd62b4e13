"""Chapter 07's checkers reject wrong answers (the shipped solutions and a stub: tests/test_exercises.py)."""
import pytest
import triton

from chunkstate import tuning
from chunkstate.exercises import ch07_autotuning as ex


# ---- prune_to_fit ----

def test_prune_solution_on_known_sizes():
    """Independent of the checker: K = V = 64 keeps exactly the configs of ALL_CONFIGS with tiles
    up to 64; K = V = 16 keeps the 32x32 ones (nothing fits; smallest tiles); K = 200 allows 256."""
    def tiles(K, V):
        return {(c.kwargs["BK"], c.kwargs["BV"]) for c in ex.prune_to_fit(tuning.ALL_CONFIGS, {}, K=K, V=V)}

    assert tiles(64, 64) == {(32, 32), (32, 64), (64, 32), (64, 64)}
    assert tiles(16, 16) == {(32, 32)}
    assert tiles(200, 200) == {(c.kwargs["BK"], c.kwargs["BV"]) for c in tuning.ALL_CONFIGS}
    assert tiles(48, 20) == {(32, 32), (64, 32)}


def _ignores_v(configs, named_args, **kwargs):
    K = {**named_args, **kwargs}["K"]
    return [c for c in configs if c.kwargs["BK"] <= max(16, triton.next_power_of_2(K))] or configs[:1]


def _not_rounded_up(configs, named_args, **kwargs):  # BK <= K: drops 64 for K = 48
    a = {**named_args, **kwargs}
    return [c for c in configs if c.kwargs["BK"] <= a["K"] and c.kwargs["BV"] <= a["V"]] or configs[:1]


def _empty_when_nothing_fits(configs, named_args, **kwargs):
    a = {**named_args, **kwargs}
    return [c for c in configs if c.kwargs["BK"] <= max(16, triton.next_power_of_2(a["K"]))
            and c.kwargs["BV"] <= max(16, triton.next_power_of_2(a["V"]))]


def _keeps_everything(configs, named_args, **kwargs):
    return list(configs)


def _copies_configs(configs, named_args, **kwargs):  # right tiles, but new Config objects
    return [triton.Config(dict(c.kwargs), num_warps=c.num_warps, num_stages=c.num_stages)
            for c in ex.prune_to_fit(configs, named_args, **kwargs)]


def _returns_generator(configs, named_args, **kwargs):
    return (c for c in ex.prune_to_fit(configs, named_args, **kwargs))


@pytest.mark.parametrize("wrong", [_ignores_v, _not_rounded_up, _empty_when_nothing_fits, _keeps_everything,
                                   _copies_configs, _returns_generator])
def test_prune_wrong_answer_rejected(wrong):
    with pytest.raises(AssertionError):
        ex.check_prune(wrong)


def test_prune_reading_only_named_args_fails():
    """chunk_fwd_h launches with keyword arguments, so K is not in named_args: the checker says
    where K arrives instead of letting a bare KeyError: 'K' out."""
    def positional_only(configs, named_args, **kwargs):
        return ex.prune_to_fit(configs, named_args)

    with pytest.raises(AssertionError, match="passed by keyword raised KeyError") as e:
        ex.check_prune(positional_only)
    assert "looked the argument up in named_args" in str(e.value)
    assert "{**named_args, **kwargs}" in str(e.value)


def test_prune_reading_only_kwargs_fails():
    """The other way round: K passed by position is in named_args, not in kwargs."""
    def keyword_only(configs, named_args, **kwargs):
        return ex.prune_to_fit(configs, {}, **kwargs)

    with pytest.raises(AssertionError, match="passed by position raised KeyError") as e:
        ex.check_prune(keyword_only)
    assert "looked the argument up in kwargs" in str(e.value)


# ---- pick_candidates ----

def test_pick_solution_on_a_small_table():
    """By hand: a alone is 2x off on s2, b alone 2x on s1; {a, b} is exact; c is never best."""
    table = {"s1": {"a": 1.0, "b": 2.0, "c": 1.5}, "s2": {"a": 2.0, "b": 1.0, "c": 1.5}}
    assert ex.pick_candidates(table, 1) == ["c"]  # 1.5x everywhere beats 2x somewhere
    assert sorted(ex.pick_candidates(table, 2)) == ["a", "b"]
    assert ex.worst_slowdown(table, ["a", "b"]) == 1.0


def _first_shape_fastest(table, n):  # what a key without the shape does: tune on the first shape only
    first = next(iter(table.values()))
    common = set.intersection(*(set(r) for r in table.values()))
    return sorted((c for c in first if c in common), key=first.get)[:n]


def _best_on_average(table, n):  # minimises the mean slowdown, not the worst
    common = sorted(set.intersection(*(set(r) for r in table.values())))
    mean = {c: sum(r[c] / min(r.values()) for r in table.values()) for c in common}
    return sorted(common, key=mean.get)[:n]


def _one_too_many(table, n):
    common = sorted(set.intersection(*(set(r) for r in table.values())))
    return ex.pick_candidates(table, n) + [c for c in common if c not in ex.pick_candidates(table, n)][:1]


def _each_shapes_winner(table, n):  # may name configs missing from other shapes, and more than n
    return list(dict.fromkeys(min(r, key=r.get) for r in table.values()))


@pytest.mark.parametrize("wrong", [_first_shape_fastest, _best_on_average, _one_too_many, _each_shapes_winner])
def test_pick_wrong_answer_rejected(wrong):
    with pytest.raises(AssertionError):
        ex.check_pick_candidates(wrong)
