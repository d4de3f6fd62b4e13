"""How a default call (``pieces=None``) chooses its piece count: the cost model proposes, the
counts are timed once per class of calls (``pieces.choose``, ``trial_counts``, ``timed_choice``).

On CPU the timer is a stand-in that returns chosen times (the interpreter's times say nothing of a
GPU's), and ``INTERPRET`` is patched off in ``chunkstate.pieces`` alone so that it decides as on a
GPU, with an H200's SM count; the kernels still run under the interpreter, and one test runs a
default call end to end through them against the float64 loop. On a GPU the real timer times real
launches, and a call captured in a CUDA graph takes the model's count without timing.
"""
from __future__ import annotations

import itertools
import random
import statistics

import pytest
import torch
import torch.nn.functional as F

import chunkstate
from chunkstate import gates, launch, pieces, reference, tuning
from chunkstate.testing import check_close, nan_poisoned_empty

ON_GPU = chunkstate.DEVICE == "cuda"
SMS = tuning.H200_SMS


@pytest.fixture
def as_on_a_gpu(monkeypatch):
    """``pieces`` decides as on a GPU (with a CPU tensor's device: an H200's SM count), its memory of
    timed counts empty before and after."""
    monkeypatch.setattr(pieces, "INTERPRET", False)
    pieces.clear_choices()
    yield
    pieces.clear_choices()


def _problem(B, T, H, K, V, cu=None, BS=None):
    return launch.problem(torch.zeros(0), B, T, H, K, V, cu, 64, BS, False)


class FakeTrial:
    """A ``trial`` that records the counts it ran, and a timer that runs the function it is given
    once, as a timer would, and answers that count's time from ``times`` (µs)."""

    def __init__(self, times):
        self.times, self.ran, self.timed = times, [], []

    def __call__(self, P):
        self.ran.append(P)

    def timer(self, fn):
        fn()  # functools.partial(trial, P)
        self.timed.append(fn.args[0])
        return self.times[fn.args[0]]


def _in_rounds(counts):
    """What the timer is asked, in order, when ``counts`` are timed: each once a round, the rounds'
    orders alternating (``pieces.trial_rounds``)."""
    return [P for order in pieces.trial_rounds(tuple(counts)) for P in order]


def test_counts_are_timed_in_rounds_that_alternate_their_order():
    rounds = pieces.trial_rounds((1, 4, 8))
    assert len(rounds) == pieces.TRIAL_ROUNDS >= 3
    assert rounds[0] == (1, 4, 8) and rounds[1] == (8, 4, 1) and all(sorted(r) == [1, 4, 8] for r in rounds)


def _choose(p, trial, direction="fwd", gate="g", monkeypatch=None):
    monkeypatch.setattr(pieces, "_median_time", trial.timer)
    return pieces.choose(None, p, direction, gate, trial=trial, tag=("t",))


def test_trial_counts_are_the_models_count_its_neighbours_and_one_pass():
    assert pieces.trial_counts(8, 131072, 64) == (1, 4, 8, 16, 32)
    assert pieces.trial_counts(2, 131072, 64) == (1, 2, 4, 8)  # 1 is not a piece count: one pass stands for it
    assert pieces.trial_counts(32, 131072, 64) == (1, 16, 32)  # 64 and 128 are not in PIECE_COUNTS
    assert pieces.trial_counts(1, 131072, 64) == (1, 2, 4, 8)  # the model declined: the first cuts still timed
    # pieces of at least MIN_TRIAL_TOKENS tokens and one split
    assert pieces.MIN_TRIAL_TOKENS == 1024
    assert pieces.trial_counts(4, 8 * 1024, 64) == (1, 2, 4, 8)
    assert pieces.trial_counts(4, 8 * 1024 - 1, 64) == (1, 2, 4)
    assert pieces.trial_counts(1, 2 * 1024 - 1, 64) == (1,)
    assert pieces.trial_counts(2, 8192, 8192) == (1,)  # a split of 8192 tokens: no piece count fits


def test_fit_halves_a_count_until_its_pieces_are_long_enough():
    assert pieces.fit(16, 16 * 1024, 64) == 16
    assert pieces.fit(16, 16 * 1024 - 1, 64) == 8
    assert pieces.fit(4, 2000, 64) == 1
    assert pieces.fit(4, 65536, 32768) == 2


def test_a_timing_class_spans_a_factor_of_two_in_chunks():
    lengths = (1, 64, 65, 128, 129, 65472, 65536, 131008, 131072)  # 1, 1, 2, 2, 3, 1023, 1024, 2047, 2048 chunks
    assert [pieces.timing_class(T, 64) for T in lengths] == [1, 1, 2, 2, 2, 10, 11, 11, 12]


def test_the_fastest_count_is_timed_once_and_kept(as_on_a_gpu, monkeypatch):
    """B1 T98304 H2 K = V = 128 (8 programs, far below half a wave): the model's count, its
    neighbours and one pass are run once each, then timed; the fastest is returned and kept, for
    the same call (nothing timed) and for a call of another length in its class (1024-2047 chunks:
    nothing timed either); a length of another class (1023 chunks) is timed again."""
    T = 98304  # 1536 chunks
    p = _problem(1, T, 2, 128, 128)
    model = pieces.auto_pieces(1, 2, 128, 128, T, 64, SMS, 64, direction="fwd", gate="g")
    counts = pieces.trial_counts(model, T, 64)
    assert model > 1 and model in counts and len(counts) >= 3
    times = {P: 100.0 - 10 * i for i, P in enumerate(counts)}  # the most pieces fastest ...
    times[counts[1]] = 50.0  # ... but for the second count: the fastest here
    trial = FakeTrial(times)
    assert _choose(p, trial, monkeypatch=monkeypatch) == counts[1]
    assert trial.ran == list(counts) + _in_rounds(counts) and trial.timed == _in_rounds(counts), \
        "each run once, then timed in rounds"
    assert list(pieces.trial_times().values()) == [times], "what the timing measured, kept beside its choice"

    again = FakeTrial(times)
    assert _choose(p, again, monkeypatch=monkeypatch) == counts[1]
    assert _choose(_problem(1, 65536, 2, 128, 128), again, monkeypatch=monkeypatch) == counts[1]  # 1024 chunks
    assert again.ran == [], "the same call, and one of its class: nothing timed"
    other = FakeTrial({P: 10.0 for P in range(1, 33)})
    assert _choose(_problem(1, 65472, 2, 128, 128), other, monkeypatch=monkeypatch) == 1, \
        "1023 chunks: another class, timed; of equal times the fewest pieces (one pass)"
    assert other.timed == _in_rounds(pieces.trial_counts(
        pieces.auto_pieces(1, 2, 128, 128, 65472, 64, SMS, 64, direction="fwd", gate="g"), 65472, 64))


def test_a_count_timed_on_a_longer_call_is_fitted_to_a_shorter_one(as_on_a_gpu, monkeypatch):
    """A class spans a factor of two in chunks: with splits of 1536 tokens, 32 pieces timed at 1023
    chunks (65472 tokens) are too many at 512 chunks (32768 tokens), where 16 pieces of at least one
    split fit."""
    trial = FakeTrial({1: 90.0, 4: 85.0, 8: 80.0, 16: 60.0, 32: 40.0})
    monkeypatch.setattr(pieces, "auto_pieces", lambda *args, **kw: 8)  # the model's count: 8
    long_ = _problem(1, 65472, 1, 128, 128, BS=1536)
    assert _choose(long_, trial, monkeypatch=monkeypatch) == 32 and trial.timed == _in_rounds([1, 4, 8, 16, 32])
    assert _choose(_problem(1, 49152, 1, 128, 128, BS=1536), trial, monkeypatch=monkeypatch) == 32
    assert _choose(_problem(1, 32768, 1, 128, 128, BS=1536), trial, monkeypatch=monkeypatch) == 16
    assert trial.timed == _in_rounds([1, 4, 8, 16, 32]), "one class: timed once"


def test_grids_of_half_a_wave_and_short_sequences_are_never_timed(as_on_a_gpu, monkeypatch):
    """Half a wave of programs or more: 1, asking nothing, timing nothing. Under it but too short for
    any count of pieces (2047 tokens: 2 pieces would be under ``MIN_TRIAL_TOKENS``): 1 untimed, kept
    as a timed count is, so the next such call finds it without asking the model again."""
    trial = FakeTrial({})
    assert _choose(_problem(8, 65536, 16, 128, 128), trial, monkeypatch=monkeypatch) == 1  # 512 programs
    assert pieces._CHOSEN == {}
    short = _problem(1, 2047, 2, 128, 128)
    assert pieces.trial_counts(pieces.auto_pieces(1, 2, 128, 128, 2047, 64, SMS, direction="fwd", gate="g"),
                               2047, 64) == (1,)
    assert _choose(short, trial, monkeypatch=monkeypatch) == 1  # one count open: 1
    assert trial.ran == [] and pieces._TIMED == {} and list(pieces._CHOSEN.values()) == [1]

    def asked(*args, **kw):
        raise AssertionError("the model asked again")
    monkeypatch.setattr(pieces, "auto_pieces", asked)
    assert _choose(short, trial, monkeypatch=monkeypatch) == 1 and trial.ran == []


def test_a_repeated_default_call_is_answered_by_one_lookup(as_on_a_gpu, monkeypatch):
    """Every answer kept (a grid never cut: 1; a count timed; one pass where no count fits) is found
    again without the rule being asked, by the call's own key: its direction, gate, tag and sizes.
    A call differing in any of them, or after ``clear_choices``, is answered anew; the model's count
    untimed (no trial) is not kept, so the next call with a trial times it."""
    never, short = _problem(8, 65536, 16, 128, 128), _problem(1, 2047, 2, 128, 128)
    open_ = _problem(1, 65536, 2, 128, 128)
    counts = pieces.trial_counts(pieces.auto_pieces(1, 2, 128, 128, 65536, 64, SMS, 64, direction="fwd", gate="g"),
                                 65536, 64)
    trial = FakeTrial({P: 100.0 - P for P in counts})  # the most pieces fastest
    answers = [_choose(p, trial, monkeypatch=monkeypatch) for p in (never, short, open_)]
    assert answers == [1, 1, max(counts)] and max(counts) > 1
    asked = []

    def answer(*args):
        asked.append(args[0])
        return 3, False
    monkeypatch.setattr(pieces, "_answer", answer)
    assert [_choose(p, trial, monkeypatch=monkeypatch) for p in (never, short, open_)] == answers and asked == []
    assert len(trial.ran) == len(counts) * (1 + pieces.TRIAL_ROUNDS), "timed once, on the first call"
    different = [pieces.choose(None, open_, "bwd", "g", trial=trial, tag=("t",)),  # direction
                 pieces.choose(None, open_, "fwd", "gk", trial=trial, tag=("t",)),  # gate kind
                 pieces.choose(None, open_, "fwd", "g", trial=trial, tag=("u",)),  # dtypes, optional states
                 _choose(_problem(1, 65536, 2, 128, 64), trial, monkeypatch=monkeypatch),  # V
                 _choose(_problem(1, 65536, 2, 128, 128, BS=128), trial, monkeypatch=monkeypatch),  # split size
                 _choose(_problem(1, 65536, 2, 128, 128, torch.tensor([0, 32768, 65536])), trial,
                         monkeypatch=monkeypatch)]  # packed
    assert different == [3] * 6 and len(asked) == 6
    pieces.clear_choices()
    assert _choose(open_, trial, monkeypatch=monkeypatch) == 3 and len(asked) == 7, "after clear_choices: asked"
    assert _choose(open_, trial, monkeypatch=monkeypatch) == 3 and len(asked) == 8, "not kept: asked again"


def _open_call(fastest_us):
    """B1 T65536 H2 K = V = 128 forward, where the cut is open: the problem, the counts a default call
    times, the most pieces of them, and each count's time (µs): 100, the most pieces ``fastest_us``."""
    p = _problem(1, 65536, 2, 128, 128)
    counts = pieces.trial_counts(pieces.auto_pieces(1, 2, 128, 128, 65536, 64, SMS, direction="fwd", gate="g"),
                                 65536, 64)
    times = {P: 100.0 for P in counts}
    times[counts[-1]] = fastest_us
    return p, counts, counts[-1], times


def test_a_slow_moment_in_one_round_does_not_decide(as_on_a_gpu, monkeypatch):
    """The host's pace jumps for moments: a count timed 3x slower in one round of five (its first)
    still wins, where one timing would have lost it (the rounds disagree, so the timing is done
    again, and the steady second decides)."""
    p, counts, fastest, times = _open_call(40.0)
    seen = []

    def timer(fn):
        P = fn.args[0]
        seen.append(P)
        return 3 * times[P] if seen.count(P) == 1 and P == fastest else times[P]
    monkeypatch.setattr(pieces, "_median_time", timer)
    assert pieces.choose(None, p, "fwd", "g", trial=lambda P: None, tag=("t",)) == fastest
    assert list(pieces.trial_times().values()) == [times]
    assert list(pieces.trial_attempts().values()) == [2]


def _spell_timer(counts, times, slowed):
    """A timer answering ``times[P]`` (µs), but for ``slowed(attempt, P, round)``: a factor it is
    slowed by in that round of that attempt (attempts of ``TRIAL_ROUNDS`` rounds of every count)."""
    seen = []

    def timer(fn):
        P = fn.args[0]
        seen.append(P)
        n = len(seen) - 1
        attempt, in_attempt = divmod(n, len(counts) * pieces.TRIAL_ROUNDS)
        return times[P] * slowed(attempt, P, in_attempt // len(counts))
    return timer, seen


def test_a_timing_whose_rounds_disagree_is_done_again(as_on_a_gpu, monkeypatch):
    """A slow spell of the host through a whole timing: the fastest count (more host work) timed
    1.3-2x slower in every round of the first timing, one pass not. By its median it would lose; its
    rounds disagree (2 / 1.3 > ``STEADY_SPREAD``), so the counts are timed again, and the second
    timing, steady, decides. A steady first timing decides at once (one timing)."""
    p, counts, fastest, times = _open_call(60.0)
    spell = (1.3, 2.0, 1.8, 1.9, 1.7)
    assert statistics.median(spell) * times[fastest] > times[1] and 2.0 / 1.3 > pieces.STEADY_SPREAD
    timer, seen = _spell_timer(counts, times, lambda a, P, r: spell[r] if a == 0 and P == fastest else 1.0)
    monkeypatch.setattr(pieces, "_median_time", timer)
    assert pieces.choose(None, p, "fwd", "g", trial=lambda P: None, tag=("t",)) == fastest
    assert seen == _in_rounds(counts) * 2 and list(pieces.trial_attempts().values()) == [2]
    assert list(pieces.trial_times().values()) == [times], "the steady timing's medians"

    pieces.clear_choices()
    timer, seen = _spell_timer(counts, times, lambda a, P, r: 1.1 if r == 2 else 1.0)  # 10 %: steady enough
    monkeypatch.setattr(pieces, "_median_time", timer)
    assert pieces.choose(None, p, "fwd", "g", trial=lambda P: None, tag=("t",)) == fastest
    assert seen == _in_rounds(counts) and list(pieces.trial_attempts().values()) == [1]


def test_a_host_never_steady_is_timed_at_most_trial_attempts_times(as_on_a_gpu, monkeypatch):
    """Every timing's rounds disagree: the counts are timed ``TRIAL_ATTEMPTS`` times, no more, and the
    steadiest timing (here the second: its rounds 1.3x apart, the others' 2x) decides by its medians."""
    p, counts, fastest, times = _open_call(60.0)

    def slowed(attempt, P, r):
        if attempt == 1:  # the steadiest: the fastest count 1.3x slower in its first round only
            return 1.3 if P == fastest and r == 0 else 1.0
        return 2.0 if P == fastest and r < 3 else 1.0  # the others: the fastest 2x slower by its median
    timer, seen = _spell_timer(counts, times, slowed)
    monkeypatch.setattr(pieces, "_median_time", timer)
    assert pieces.TRIAL_ATTEMPTS == 3
    assert pieces.choose(None, p, "fwd", "g", trial=lambda P: None, tag=("t",)) == fastest
    assert seen == _in_rounds(counts) * pieces.TRIAL_ATTEMPTS
    assert list(pieces.trial_attempts().values()) == [pieces.TRIAL_ATTEMPTS]
    assert list(pieces.trial_times().values()) == [times]


def test_a_timing_decides_by_its_medians_of_equals_the_fewest_pieces():
    assert pieces.by_median({1: [10.0, 30.0, 11.0], 8: [12.0, 12.0, 12.0]}) == (1, {1: 11.0, 8: 12.0})
    assert pieces.by_median({8: [5.0, 5.0], 2: [5.0, 6.0, 5.0]})[0] == 2


def test_a_batch_is_never_cut_by_its_busy_programs_uneven_where_tokens_fall_short():
    assert pieces.batch_never_cut(33, 2, 64, 64, 33 * 8192, 8192, SMS)  # dense: half a wave
    assert not pieces.batch_never_cut(33, 2, 64, 64, 33 * 8192 - 1, 8192, SMS)  # one token short: uneven
    assert not pieces.batch_never_cut(67, 2, 64, 64, 66 * 8192, 8192, SMS)  # uneven at a whole wave: open
    assert pieces.batch_never_cut(84, 2, 64, 64, 82 * 8192 + 4096, 8192, SMS)  # at five quarters: 165 busy
    assert not pieces.batch_never_cut(84, 2, 64, 64, 82 * 8192 + 4095, 8192, SMS)


def test_spread_is_the_largest_ratio_of_a_counts_rounds():
    assert pieces.spread({1: [10.0, 10.0], 8: [5.0, 5.0]}) == 1.0
    assert pieces.spread({1: [10.0, 12.0, 11.0], 8: [5.0, 7.5, 6.0]}) == 1.5
    assert pieces.spread({1: [0.0, 1.0]}) == float("inf")


def test_a_packed_batch_is_judged_by_the_programs_its_longest_walk_keeps_busy(as_on_a_gpu, monkeypatch):
    """52 sequences at H1 K64 V256 are 208 programs of 64×64 tiles, over half a wave of an H200's 132
    SMs. All 8,192 tokens long (dense) they keep 208 busy to the end: never cut, nothing timed. Packed,
    one 8,192 long and 51 of 512, the short ones end a sixteenth into the longest's walk, and the
    programs busy on average are 4 × 34,304 / 8,192 = 16.75: the cut is open, the counts are timed."""
    assert pieces.programs_64(52, 1, 64, 256) == 208 and pieces.never_cut(208, SMS)
    for N, H, K, V, T in ((52, 1, 64, 256, 8192), (3, 20, 100, 128, 777), (1, 4, 256, 256, 1)):
        assert pieces.busy_programs(H, K, V, N * T, T) == pieces.programs_64(N, H, K, V), "dense: programs_64"
    lens = [8192] + [512] * 51
    assert pieces.busy_programs(1, 64, 256, sum(lens), max(lens)) == 16.75
    dense = FakeTrial({})
    assert _choose(_problem(52, 8192, 1, 64, 256), dense, monkeypatch=monkeypatch) == 1 and dense.ran == []
    packed = _problem(1, sum(lens), 1, 64, 256, torch.tensor([0, *itertools.accumulate(lens)]))
    model = pieces.auto_pieces(52, 1, 64, 256, 8192, 64, SMS, 64, direction="bwd", gate="gk", tokens=sum(lens))
    counts = pieces.trial_counts(model, 8192, 64)
    assert counts == (1, 2, 4, 8)
    trial = FakeTrial({1: 158.0, 2: 143.0, 4: 124.0, 8: 125.0})
    assert _choose(packed, trial, "bwd", "gk", monkeypatch) == 4 and trial.timed == _in_rounds(counts)
    # and the model itself weighs the busy programs: without them (tokens = 52 × 8192) it never cuts
    assert pieces.auto_pieces(52, 1, 64, 256, 8192, 64, SMS, 64, direction="bwd", gate="gk") == 1


def test_a_packed_batch_of_uneven_lengths_is_never_cut_only_from_five_quarters_of_a_wave(as_on_a_gpu, monkeypatch):
    """The line is half a wave of busy programs, five quarters of a wave for a packed batch of uneven
    lengths: one sequence of 8,192 tokens and 54 of 512 at H12 K128 V64 keep 24 × 35,840 / 8,192 = 105
    busy, between the two: timed where 55 sequences of 8,192 are never cut; and one of 8,192 with 63
    of 4,096 at H8 K128 V64 keep 16 × 266,240 / 8,192 = 520 busy, past five quarters: never cut."""
    assert pieces.UNEVEN_LINE_WAVES == 1.25
    assert pieces.never_cut(SMS // 2, SMS) and not pieces.never_cut(SMS // 2 - 0.01, SMS)
    assert not pieces.never_cut(SMS // 2, SMS, uneven=True) and not pieces.never_cut(SMS, SMS, uneven=True)
    assert not pieces.never_cut(1.25 * SMS - 0.01, SMS, uneven=True) and pieces.never_cut(1.25 * SMS, SMS, uneven=True)
    lens = [8192] + [512] * 54
    assert pieces.busy_programs(12, 128, 64, sum(lens), 8192) == 105
    dense = FakeTrial({})
    assert _choose(_problem(55, 8192, 12, 128, 64), dense, monkeypatch=monkeypatch) == 1 and dense.ran == []
    packed = _problem(1, sum(lens), 12, 128, 64, torch.tensor([0, *itertools.accumulate(lens)]))
    trial = FakeTrial({1: 92.0, 2: 103.0, 4: 77.0, 8: 80.0})
    assert _choose(packed, trial, monkeypatch=monkeypatch) == 4 and trial.timed[:4] == [1, 2, 4, 8]
    lens = [8192] + [4096] * 63
    assert pieces.busy_programs(8, 128, 64, sum(lens), 8192) == 520 > 1.25 * SMS
    past = FakeTrial({})
    packed = _problem(1, sum(lens), 8, 128, 64, torch.tensor([0, *itertools.accumulate(lens)]))
    assert _choose(packed, past, monkeypatch=monkeypatch) == 1 and past.ran == []


def test_choose_never_cuts_exactly_where_never_cut_of_the_busy_programs_says(as_on_a_gpu, monkeypatch):
    """``choose`` answers a default call by ``batch_never_cut`` with the longest sequence
    the ``Problem`` carries, on random dense and packed batches (empty sequences among them) and on
    shapes right at the line (busy programs of exactly half a wave, and just under; for a packed
    batch of uneven lengths, five quarters of a wave, and just under). Past the line it
    asks the model, here a stand-in answering 7 with 7 open, untimed (``TIME_PIECES`` off); at or over
    it, it answers 1 asking nothing. A batch with no tokens keeps no program busy: the real model
    answers it 1."""
    empty = _problem(1, 0, 2, 64, 64, torch.tensor([0, 0, 0]))
    assert empty.longest == 0 and pieces.choose(None, empty, "fwd", "g") == 1
    pieces.clear_choices()
    rng = random.Random()
    shapes = []
    for _ in range(300):
        H, K, V = rng.choice([1, 2, 3, 5, 8, 20]), rng.choice([16, 64, 100, 128, 256]), rng.choice([32, 64, 130, 256])
        if rng.random() < 0.5:
            shapes.append(_problem(rng.randint(1, 12), rng.randint(1, 40000), H, K, V))
        else:
            lens = [rng.choice([0, rng.randint(1, 3000), rng.randint(1, 40000)]) for _ in range(rng.randint(1, 40))]
            shapes.append(_problem(1, sum(lens), H, K, V, torch.tensor([0, *itertools.accumulate(lens)])))
    # 2 programs a sequence at H2 K = V = 64: 33 sequences of the longest's length are half of 132 SMs, the
    # line of a dense batch (and of a packed one of equal lengths); a packed batch of uneven lengths: 82.5,
    # five quarters of a wave
    shapes += [_problem(33, 8192, 2, 64, 64), _problem(32, 8192, 2, 64, 64),
               _problem(1, 33 * 8192, 2, 64, 64, torch.tensor([0, *itertools.accumulate([8192] * 33)])),
               _problem(1, 32 * 8192, 2, 64, 64, torch.tensor([0, *itertools.accumulate([8192] * 32)])),
               _problem(1, 82 * 8192 + 4096, 2, 64, 64,
                        torch.tensor([0, *itertools.accumulate([8192] * 82 + [2048] * 2)])),
               _problem(1, 82 * 8192 + 4095, 2, 64, 64,
                        torch.tensor([0, *itertools.accumulate([8192] * 82 + [2048, 2047])])),
               _problem(1, 33 * 8192, 2, 64, 64, torch.tensor([0, *itertools.accumulate([8192] * 32 + [4096] * 2)]))]
    assert pieces.busy_programs(2, 64, 64, 33 * 8192, 8192) == 66 == SMS // 2
    assert pieces.busy_programs(2, 64, 64, 82 * 8192 + 4096, 8192) == 165 == 1.25 * SMS
    monkeypatch.setattr(pieces, "TIME_PIECES", False)
    monkeypatch.setattr(pieces, "auto_pieces", lambda *args, **kw: 7)
    monkeypatch.setattr(pieces, "trial_counts", lambda model, longest, BS: (1, model))  # open: the model's, untimed
    seen = {1: 0, 7: 0}
    for p in shapes:
        longest = max(p.lengths, default=0)
        assert p.longest == longest
        never = pieces.batch_never_cut(p.N, p.H, p.K, p.V, p.B * p.T, longest, SMS)
        chosen = pieces.choose(None, p, "fwd", "g")
        assert chosen == (1 if never else 7), (p.lengths[:5], p.H, p.K, p.V)
        seen[chosen] += 1
    assert seen[1] > 20 and seen[7] > 20, seen
    assert [pieces.choose(None, p, "fwd", "g") for p in shapes[-7:]] == [1, 7, 1, 7, 1, 7, 7], \
        "half a wave: dense, packed evenly; five quarters: packed unevenly (half a wave of it: open)"
    assert pieces._CHOSEN == {}


@pytest.mark.parametrize("direction", ["fwd", "bwd"])
def test_a_default_call_times_the_whole_call_with_each_count(direction, as_on_a_gpu, monkeypatch):
    """What a default call times for each count is its wrapper's whole call with ``pieces=P`` (checks,
    allocations and launch: what a caller pays), not the launch alone: where the host's time shows,
    a count whose launch is faster can be the slower call (figures/README.md, session 28). Each
    count's whole call runs once, then once more inside the timer, with the caller's arguments."""
    from chunkstate import backward, forward

    module, name = (forward, "chunk_fwd_h") if direction == "fwd" else (backward, "chunk_bwd_dh")
    wrapper, calls = getattr(module, name), []

    def recorded(*args, **kwargs):
        calls.append((kwargs["pieces"], kwargs["config"], args[-1]))  # states_in_fp32, last either way
        return wrapper(*args, **kwargs)
    monkeypatch.setattr(module, name, recorded)
    monkeypatch.setattr(pieces, "_median_time", lambda fn: (fn(), 10.0 * fn.args[0])[1])  # one pass fastest
    B, T, H, K, V = 1, 4096, 1, 32, 32
    device = chunkstate.DEVICE
    k, v, q, do = (torch.randn(B, T, H, D, device=device) for D in (K, V, K, V))
    dht = torch.randn(B, H, K, V, device=device)
    g = gates.chunk_local_cumsum(F.logsigmoid(torch.randn(B, T, H, device=device) + 3), 64)

    def run():
        if direction == "fwd":
            return wrapper(k, v, g=g, output_final_state=True, states_in_fp32=True)
        return wrapper(q, k, v, do, None, dht, 0.5, g=g, states_in_fp32=True)
    want, _ = run()
    assert [P for P, _, _ in calls] == [1, 2, 4] + _in_rounds([1, 2, 4]), \
        "each count's whole call: run once, then timed in rounds"
    assert all(config is None and fp32 is True for _, config, fp32 in calls), "with the caller's arguments"
    assert list(pieces._CHOSEN.values()) == [1]
    # states past WHOLE_CALL_BYTES: the launch alone is timed (a second set of them is not allocated)
    assert want.nbytes == B * (T // 64) * H * K * V * 4 <= pieces.WHOLE_CALL_BYTES
    monkeypatch.setattr(pieces, "WHOLE_CALL_BYTES", want.nbytes - 1)
    pieces.clear_choices()
    calls.clear()
    got, _ = run()
    assert calls == [] and list(pieces._CHOSEN.values()) == [1], "timed, by the launch alone"
    torch.testing.assert_close(got, want, rtol=0, atol=0)


def test_without_a_trial_or_while_capturing_the_models_count_untimed(as_on_a_gpu, monkeypatch):
    """The explorer asks with no trial, and a CUDA graph's capture may not synchronise: both get
    ``auto_pieces``' count, and nothing is kept, so a later call with a trial times it."""
    p = _problem(1, 65536, 2, 128, 128)
    model = pieces.auto_pieces(1, 2, 128, 128, 65536, 64, SMS, 64, direction="bwd", gate="gk")
    assert pieces.choose(None, p, "bwd", "gk") == model
    trial = FakeTrial({})
    monkeypatch.setattr(pieces, "_capturing", lambda device: True)
    assert _choose(p, trial, "bwd", "gk", monkeypatch) == model
    monkeypatch.setattr(pieces, "TIME_PIECES", False)
    monkeypatch.setattr(pieces, "_capturing", lambda device: False)
    assert _choose(p, trial, "bwd", "gk", monkeypatch) == model
    assert trial.ran == [] and pieces._CHOSEN == {} and pieces._TIMED == {}


def test_directions_gates_and_tags_are_timed_apart(as_on_a_gpu, monkeypatch):
    p = _problem(1, 65536, 2, 128, 128)
    seen = []
    for direction, gate, tag in (("fwd", "g", ("a",)), ("bwd", "g", ("a",)), ("fwd", "gk", ("a",)),
                                 ("fwd", "g", ("b",))):
        trial = FakeTrial({P: float(P) for P in range(1, 33)})  # one pass fastest
        monkeypatch.setattr(pieces, "_median_time", trial.timer)
        assert pieces.choose(None, p, direction, gate, trial=trial, tag=tag) == 1
        seen.append(bool(trial.timed))
    assert seen == [True] * 4


def test_a_default_call_times_its_counts_and_returns_the_loops_states(as_on_a_gpu, monkeypatch):
    """End to end under the interpreter (on a GPU, for real): B1 T4096 H1 K = V = 32, gate g; the
    counts (1, 2, 4) each launched, the fastest by the timer kept; every state, and ht, as the loop
    has them, whichever count ran last."""
    device = chunkstate.DEVICE
    B, T, H, K, V, BT = 1, 4096, 1, 32, 32, 64
    k, v = (torch.randn(B, T, H, D, device=device) / D ** 0.5 for D in (K, V))
    g = F.logsigmoid(torch.randn(B, T, H, device=device) + 3)  # per token, natural log: the loop's
    timed = []
    if not ON_GPU:
        def timer(fn):  # fn: functools.partial(launch, P)
            fn()
            timed.append(fn.args[0])
            return {1: 20.0, 2: 10.0, 4: 15.0}[fn.args[0]]  # 2 pieces the fastest
        monkeypatch.setattr(pieces, "_median_time", timer)
    with nan_poisoned_empty():
        h, ht = chunkstate.chunk_fwd_h(k, v, g=gates.chunk_local_cumsum(g, BT), output_final_state=True,
                                       chunk_size=BT)
    chosen = list(pieces._CHOSEN.values())
    assert len(chosen) == 1 and chosen[0] in (1, 2, 4)
    if not ON_GPU:
        assert timed == _in_rounds([1, 2, 4]) and chosen == [2]
    h_ref, ht_ref = reference.recurrent_states(k, v, g=g, chunk_size=BT)
    tol = 2e-3 if ON_GPU else 1e-5  # tf32 on a GPU
    check_close(h, h_ref, f"h of a default call in {chosen[0]} piece(s)", tol)
    check_close(ht, ht_ref, "ht", tol)


@pytest.mark.gpu(reason="CUDA graphs exist only on a GPU")
def test_gpu_a_default_call_captured_in_a_graph_is_not_timed(as_on_a_gpu):
    B, T, H, K, V, BT = 1, 16384, 2, 64, 64, 64
    k, v = (torch.randn(B, T, H, D, device="cuda", dtype=torch.bfloat16) for D in (K, V))
    g = gates.chunk_local_cumsum(F.logsigmoid(torch.randn(B, T, H, device="cuda") + 3), BT)
    p = launch.problem(k, B, T, H, K, V, None, BT, None, False)
    model = pieces.choose(None, p, "fwd", "g")
    assert model > 1, "a shape the model cuts"
    want, _ = chunkstate.chunk_fwd_h(k, v, g=g, pieces=model, states_in_fp32=True)
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        with torch.cuda.graph(graph):
            h, _ = chunkstate.chunk_fwd_h(k, v, g=g, states_in_fp32=True)
    graph.replay()
    torch.cuda.synchronize()
    assert pieces._CHOSEN == {} and pieces._TIMED == {}, "nothing timed inside the capture"
    check_close(h, want, "the graph's replay against pieces=model", 1e-6)
