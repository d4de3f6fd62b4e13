"""Sequence pieces: the answer to the occupancy cliff at small batch × heads.

One program walks one (sequence, head)'s chunks serially and streams only ~30 GB/s, so with
fewer programs than the GPU's multiprocessors (B·H·tiles ≪ #SM, e.g. B1 H4 T128k) the kernel
starves however fast the memory is. The recurrence is linear in the state, so a sequence can be
cut into P pieces (each a whole number of splits) and the pieces run in parallel:

1. every piece runs the kernel from a zero state: its final state ``f_p`` and its total decay,
   log2, ``d_p`` on the key side [K] and ``d_{v,p}`` on the value side [V] (the sums of its chunks'
   Γ and Γ_v), no states stored (the buffers ``F``, ``decay_k``, ``decay_v`` below);
2. a short scan per (sequence, head) hands each piece its true initial state ``h_p``:
   ``h_0 = h0``, ``h_{p+1} = diag(2^{d_p}) h_p diag(2^{d_{v,p}}) + f_p``; the last one is ``ht``
   (the buffer ``S``);
3. every piece runs the kernel again from ``h_p``, storing its states where the unsplit run
   would have stored them (pieces are whole splits, so the state slots line up).

The backward runs the same three steps in reverse time (``dht`` in, ``dh0`` out). The pieces read
their inputs twice (1.5× the unsplit bytes). By default (``ONE_LAUNCH``) the three steps are one
launch of one program per piece and tile (the kernels' ``LOOK_BACK``), each walking its piece
twice: first from zero (step 1), publishing ``f_p`` and the decays behind a flag; then from its
true start, storing its states (step 3), after folding in the contributions of the pieces before
its own (in reverse: after it) as step 2's scan would, in the scan's order and arithmetic. A
program publishes before it waits, and waits only on programs that took earlier tickets, so have
started: no deadlock whatever the schedule (``piece_role``, ``fold_contributions``,
``publish_contribution``). As three launches a call in pieces cost an H200's host 90-320 µs
whatever its size; as one, about 10-40 µs more than one pass (figures/README.md, sessions 19 and
23). A batch with an empty sequence, which owns no piece and so no program to store its end state, takes
the three launches. The pieces pay only for long sequences far below one wave of programs:
a default call (``pieces=None``, ``choose``) asks a cost model measured per direction (``COSTS``,
``predicted_us``, ``auto_pieces``) for a count, then times the caller's whole call with that count,
its neighbours and one pass (``trial_counts``) on its first call and keeps the fastest, as the
autotuner keeps a config (``timed_choice``); ``chunk_fwd_h(..., pieces=P)`` lets the caller choose
(``pieces=1``: never split).

This module sits above the launch path (``launch``): ``forward.py`` and ``backward.py`` hand
``dispatch`` one function that launches their kernel over a packed batch; it calls that function
over the batch (one pass) or hands it to ``run``, which calls it once (one launch) or twice (three
launches, with ``scan`` between).
"""
from __future__ import annotations

import functools
import statistics
from collections import OrderedDict
from typing import NamedTuple

import torch
import triton
import triton.language as tl

from . import _host, tuning
from .env import INTERPRET
from .kernel_parts import load_state, load_state_cached, program_tile, store_state, tile_of
from .launch import Problem, launch_plain, serialised

ONE_LAUNCH = True  # a call in pieces is one launch (the kernels' LOOK_BACK); False: the three launches
MIN_PIECE_TOKENS = 2048  # shorter pieces do too little work to repay the extra pass
PIECE_COUNTS = (2, 4, 8, 16, 32)  # what auto_pieces chooses from


class Cost(NamedTuple):
    """The constants of the cost model behind ``auto_pieces`` for one direction, in µs."""
    step_us: float  # one pass: one chunk step of a program's walk, far below one wave (latency-bound)
    piece_step_us: float  # a call in pieces: one chunk step of a piece, either pass
    fixed_us: float  # a call in pieces however little it holds: the host's time for its one launch
    one_pass_fixed_us: float  # a one-pass call however little it holds: the host's time for one launch
    overlap: float  # programs per multiprocessor whose chunk steps overlap: past sms × overlap programs,
    # a step takes longer in proportion


# Measured on an H200. The steps by ``python -m chunkstate.bench --calibrate``
# (figures/pieces_calibration_h200.json), each where the others vanish, with few programs (one wave),
# gate g, bf16, final states; the piece steps are the one launch's (session 19; the three launches'
# passes measured 0.326 and 0.376 µs, session 15, and the one-pass steps came out the same to 1 ns).
# The two fixed costs are the host's, and hosts and processes differ. One pass: the same host-bound
# call (``bench.model.HOST_PROBE``) timed five times on two machines (figures/README.md, "2026-12-04, at
# 936fe33"), the medians. In pieces, one launch: the same call in 2 pieces timed in three processes
# on two H200 machines (figures/README.md, session 19): 37, 49 and 68 µs forward, 39, 50 and 56
# backward, the medians; the three launches had cost 90 and 179 µs by the same measure. The overlap:
# a program waits on memory most of its step, so two on one multiprocessor take little longer than
# one. It is fitted to the explicit piece counts timed in the three random runs of 2026-12-04 (62
# cases; figures/README.md, "2026-12-04, session 15"): with 2 the model's count was within 3 % of the
# best in 59 of 62, with 1 (or less) in 55. ``--calibrate``'s own measurement (32 pieces of B1 H2
# K = V = 128, 256 programs) gave 0.63-0.66: there a step moves 2-4 TB/s and is bound by memory
# bandwidth, which the model has no term for; the model keeps the value that decides best on the
# random shapes.
COSTS = {"fwd": Cost(step_us=0.372, piece_step_us=0.339, fixed_us=49.0, one_pass_fixed_us=29.0, overlap=2.0),
         "bwd": Cost(step_us=0.418, piece_step_us=0.374, fixed_us=50.0, one_pass_fixed_us=33.0, overlap=2.0)}
# The chunk step depends on the gate: what a step loads and multiplies besides k and v. The steps above
# are gate g's; ``GATE_STEPS`` scales them for the other gate kinds (``gate_kind``), the ratios of the
# steps ``--calibrate`` measured for each kind to g's on its first shape (one pass | in pieces, one
# launch): fwd none 0.235 | 0.232, g 0.372 | 0.336, g_gamma 0.312 | 0.310, gk 0.538 | 0.558 µs;
# bwd none 0.345 | 0.328, g 0.391 | 0.379, g_gamma 0.326 | 0.330, gk 0.818 | 0.602 µs
# (figures/pieces_calibration_h200.json, session 19; the one-pass ratios are session 15's, which
# these match to 0.06). gk's step is 1.5-2× g's: the key gate is a [BT, BK] tile loaded and
# exponentiated every chunk, where g is a [BT] vector.
GATE_STEPS = {"fwd": {"none": (0.63, 0.69), "g": (1.0, 1.0), "g_gamma": (0.84, 0.92), "gk": (1.46, 1.66)},
              "bwd": {"none": (0.87, 0.87), "g": (1.0, 1.0), "g_gamma": (0.82, 0.87), "gk": (2.04, 1.59)}}
SCAN_US = 5.0  # the carry between a piece's walks: in one launch its wait and fold (medians 1-8 µs on
# the H200 with the walks in step, figures/README.md, session 19); in three, the scan kernel (3 µs)
PIECES_MARGIN = 0.85  # pieces only where the model saves at least 15 %: it is a model


def gate_kind(g=None, g_gamma=None, gk=None, gv=None) -> str:
    """The gate kind whose chunk step a call pays (``GATE_STEPS``): a vector gate (gk or gv, each a
    [BT, BK] or [BT, BV] tile a chunk) over a scalar one (g) over a constant one (g_gamma) over none."""
    if gk is not None or gv is not None:
        return "gk"
    if g is not None:
        return "g"
    return "none" if g_gamma is None else "g_gamma"


def programs_64(N: int, H: int, K: int, V: int) -> int:
    """Programs of a one-pass launch with 64×64 state tiles, N·H·ceil(K/64)·ceil(V/64): the grid
    size the occupancy is judged by."""
    return N * H * _host.cdiv(K, 64) * _host.cdiv(V, 64)


def busy_programs(H: int, K: int, V: int, tokens: int, longest: int) -> float:
    """The programs a one-pass launch over ``tokens`` tokens, its longest sequence ``longest`` long,
    keeps busy on average while the longest one walks: ``programs_64`` of one sequence × tokens /
    longest. For a dense batch of N sequences that is ``programs_64`` (N·T / T = N); for a packed one
    it is less by the longest length over the mean, since the programs of the short sequences are done
    long before the longest's: at H1 K64 V256, one sequence of 8,192 tokens and 51 of 512 keep 16.75
    programs busy (4 × 34,304 / 8,192), not 208, and the longest walk sets the time as it would for
    about 4 sequences of 8,192."""
    return programs_64(1, H, K, V) * tokens / longest if longest else 0.0


def waves(programs: int, sms: int, overlap: float) -> float:
    """How many times one chunk step a step of ``programs`` programs takes on ``sms`` multiprocessors
    that each overlap ``overlap`` programs' steps: 1 up to ``sms · overlap`` programs, then in
    proportion."""
    return max(1.0, programs / (sms * overlap))


def predicted_us(pieces: int, programs: int, chunks: int, sms: int, direction: str, gate: str = "g") -> float:
    """The cost model's time of one call in ``direction`` ("fwd" or "bwd") with gate kind ``gate``
    (``gate_kind``) whose launch has ``programs`` programs, each walking ``chunks`` chunks (the
    longest sequence's), cut into ``pieces`` (1: one pass) on ``sms`` multiprocessors:
    latency-bound chunk steps, each as long as ``waves`` says for the programs launched, and for
    pieces twice over (each piece walked twice) on ``pieces`` times the programs, plus the carry
    between the walks (``SCAN_US``); never under the host's time for the call (``COSTS``). Each step
    is g's scaled by the gate's ratios (``GATE_STEPS``)."""
    c = COSTS[direction]
    step_ratio, piece_step_ratio = GATE_STEPS[direction][gate]
    if pieces == 1:
        return max(c.one_pass_fixed_us, chunks * c.step_us * step_ratio * waves(programs, sms, c.overlap))
    walk = 2 * _host.cdiv(chunks, pieces) * c.piece_step_us * piece_step_ratio
    return max(c.fixed_us, walk * waves(programs * pieces, sms, c.overlap) + SCAN_US)


@functools.lru_cache(maxsize=1024)  # asked on every call with pieces=None: a repeated call pays a lookup
def auto_pieces(N: int, H: int, K: int, V: int, max_len: int, BS: int, sms: int, BT: int = 64, *,
                direction: str, gate: str = "g", tokens: int | None = None) -> int:
    """How many pieces to cut each sequence of a call in ``direction`` ("fwd" or "bwd": each has its
    own ``COSTS``) with gate kind ``gate`` (``gate_kind``) into on a GPU of ``sms`` multiprocessors:
    1 unless one pass keeps under half a wave of programs busy (64×64 tiles; a packed batch of
    uneven lengths, under five quarters of a wave: ``never_cut``) and the cost model
    (``predicted_us``) says some count in ``PIECE_COUNTS`` (pieces of at least ``MIN_PIECE_TOKENS``
    tokens and one split) saves ``1 − PIECES_MARGIN`` of one pass; then the count the model finds
    fastest (of equals, as where the host's time floors them all, the fewest pieces: the least scan
    and workspace). ``tokens``: the batch's tokens, for a packed batch of uneven lengths (default
    N · ``max_len``, a dense batch): the programs are those the longest walk keeps busy
    (``busy_programs``). Answers are cached per argument tuple: after changing ``COSTS`` or
    ``GATE_STEPS``, call ``auto_pieces.cache_clear()``."""
    tokens = N * max_len if tokens is None else tokens
    programs = busy_programs(H, K, V, tokens, max_len)
    if programs == 0 or batch_never_cut(N, H, K, V, tokens, max_len, sms):
        return 1
    chunks = _host.cdiv(max_len, BT)
    best, best_us = 1, PIECES_MARGIN * predicted_us(1, programs, chunks, sms, direction, gate)
    for P in PIECE_COUNTS:  # ascending: of equals, the first
        if max_len < P * max(MIN_PIECE_TOKENS, BS):
            break
        t = predicted_us(P, programs, chunks, sms, direction, gate)
        if t < best_us:
            best, best_us = P, t
    return best


UNEVEN_LINE_WAVES = 1.25  # a packed batch of uneven lengths is never cut from this many waves of busy programs


def never_cut(programs: float, sms: int, uneven: bool = False) -> bool:
    """``auto_pieces``' first rule: a launch that keeps ``programs`` 64×64-tile programs busy
    (``busy_programs``; ``programs_64`` for a dense batch) with half a wave or more on ``sms``
    multiprocessors is never cut; a packed batch of ``uneven`` lengths, with ``UNEVEN_LINE_WAVES``
    (five quarters of a wave) or more.

    Its busy programs are an average: at the start all its sequences' programs queue for the
    multiprocessors, at the end only the longest's walk. In the random runs up to session 31, a cut
    was more than 3 % faster between half a wave and three quarters in 11 of 26 such batches (3 of
    74 dense ones), between three quarters and one in none of 4 (none of 40), so the line moved from
    half a wave to one. Up to session 32, between one wave and five quarters in 3 of 12 (1 of 57
    dense), from five quarters to two waves in none of 18 (none of 106), so it moved on to five
    quarters (figures/README.md, sessions 31 and 32); below it the counts are timed (``choose``)."""
    return programs >= (UNEVEN_LINE_WAVES * sms if uneven else sms // 2)


def batch_never_cut(N: int, H: int, K: int, V: int, tokens: int, longest: int, sms: int) -> bool:
    """``never_cut`` for a batch of N sequences holding ``tokens`` tokens, the longest ``longest``:
    of its ``busy_programs``, uneven where the tokens fall short of N longest sequences."""
    return never_cut(busy_programs(H, K, V, tokens, longest), sms, uneven=tokens != N * longest)


def choose(pieces, p: Problem, direction: str, gate: str, trial=None, tag: tuple = ()) -> int:
    """Validate the caller's ``pieces`` and return the count to use. ``None`` decides for this device,
    ``direction`` and gate kind (``gate_kind``): 1 under the interpreter (nothing runs in parallel)
    and where the programs busy are half a wave or more, five quarters of a wave for a packed batch
    of uneven lengths (``busy_programs``, ``never_cut``); else the
    cut is open, and the answer is the fastest of ``trial_counts`` (the cost model's count, its
    neighbours and one pass), timed once per ``timing_key`` by calling ``trial(P)``
    (``timed_choice``) and fitted to this call's length (``fit``), where a ``trial`` is given, more
    than one count is open, ``TIME_PIECES`` is set and no CUDA graph is being captured; otherwise
    ``auto_pieces``, the model's count, untimed and not kept. ``tag``: what else the timing depends
    on (dtypes, optional states), from the wrapper. An answer kept (every one but the model's
    untimed count) is found again by one dictionary lookup (``_ANSWERS``)."""
    if pieces is None:
        if INTERPRET:
            return 1
        # A repeated default call: one key, one lookup, no function called. The rule (``_answer``) costs
        # six Python calls, which inside a whole call took an H100's host 2.5 µs more than an explicit
        # count's check (figures/README.md, session 30): 6-9 % of a host-bound call's measured time.
        exact = (direction, gate, tag, p.N, p.H, p.K, p.V, p.B * p.T, p.longest, p.BS, p.BT, p.state_v_first,
                 p.device)
        answer = _ANSWERS.get(exact)
        if answer is None:
            answer, keep = _answer(p, exact, direction, gate, trial)
            if keep:
                if len(_ANSWERS) >= MAX_CHOSEN:
                    _ANSWERS.clear()
                _ANSWERS[exact] = answer
        return answer
    if isinstance(pieces, bool) or not isinstance(pieces, int) or pieces < 1:
        raise ValueError(f"pieces must be None or a positive int, got {pieces!r}")
    return pieces


def _answer(p: Problem, exact: tuple, direction: str, gate: str, trial) -> tuple[int, bool]:
    """``choose``'s answer to a default call it has not answered before (``exact``: its key), and
    whether to keep it: not where it is the model's count untimed (more than one count open, and no
    ``trial``, ``TIME_PIECES`` off or a CUDA graph being captured), which a later call with a trial
    times. An answer where the cut was open is also recorded in ``_CHOSEN`` (``choices``)."""
    sms, tokens, longest = tuning.sm_count(p.device), p.B * p.T, p.longest
    if batch_never_cut(p.N, p.H, p.K, p.V, tokens, longest, sms):
        return 1, True
    model = auto_pieces(p.N, p.H, p.K, p.V, longest, p.BS, sms, p.BT, direction=direction, gate=gate, tokens=tokens)
    counts = trial_counts(model, longest, p.BS)
    if len(counts) == 1:  # no piece count fits this length: one pass, whatever a timing would say
        chosen = 1
    elif trial is None or not TIME_PIECES or _capturing(p.device):
        return model, False
    else:  # timed once per class of calls (``timing_key``): a call of a class timed before times nothing
        chosen = fit(timed_choice(trial, counts, timing_key(exact, p.BT)), longest, p.BS)
    if len(_CHOSEN) >= MAX_CHOSEN:
        _CHOSEN.clear()
    _CHOSEN[exact] = chosen
    return chosen, True


# ---------------------------------------------------------------------------------------------
# The count timed, not only modelled
# ---------------------------------------------------------------------------------------------
#
# The model's constants are medians over hosts and shapes, and the host's time of a launch in pieces
# (10-80 µs more than one pass, figures/README.md, sessions 19-23) is as large as the gain the model
# weighs it against below ~0.2 ms; so where a cut is open, the count a default call uses is timed,
# as the autotuner times configs: the model proposes (``trial_counts``: its count, half, twice and
# four times it, and one pass), each count's whole call (``dispatch``'s ``call``) is run once
# (compiling and tuning its launch), then timed in interleaved rounds (``trial_rounds``), and the
# fastest by its median is kept (of equals, the fewest pieces). This rule was chosen on the explicit
# counts timed in the earlier random runs (figures/README.md, session 27) and judged on three seeds
# drawn after it, which it timed by the launch alone (session 28), then on three more by the whole
# call, in one timing (session 29); runs after the rounds judge it again. Where no count but one
# pass fits the longest sequence, the answer is kept as a timed one is, so such a call too pays one
# dictionary lookup.
#
# A timing is kept per ``timing_key``: the call's sizes with the longest sequence's chunk count by its
# bit length (``timing_class``) and its tokens over the longest by theirs, so a training run whose
# packed batches of N sequences differ in lengths every step times each class once, not every step.
# Each exact call's answer is kept apart (``_ANSWERS``), so a repeated call pays one dictionary lookup.

TIME_PIECES = True  # False: a default call takes the model's count untimed (``auto_pieces``)
# Each count is timed in rounds, interleaved, as the benchmark times calls: calls of under ~0.1 ms
# are timed at the host's pace, which on the lent machines jumps by tens of µs for moments, and one
# timing in one moment can make a count look twice as slow as it is (the first calls of session 29's
# runs, figures/README.md: 1.5-2.9x for some counts, against the benchmark's later rounds). The
# median of five short rounds costs what one 30 ms timing did. (The host's pace can also move over
# longer spans than the rounds take: seen on an H200 in the same session.)
TRIAL_ROUNDS = 5
TRIAL_WARMUP_MS, TRIAL_REP_MS = 1, 5
# A slow spell of the host can also last the whole timing (~0.1 s): on an H100's host, 88 of 90 timings
# of nine shapes' counts had every count's rounds within 3.2 % of each other, and two, in spells, 1.74x
# and 2.0x apart, one of which kept one pass where 8 pieces were 1.38x faster (figures/README.md,
# session 31). A timing whose rounds disagree by more than ``STEADY_SPREAD`` is done again, up to
# ``TRIAL_ATTEMPTS`` times in all, and the steadiest decides.
TRIAL_ATTEMPTS = 3
STEADY_SPREAD = 1.15  # a count's slowest round over its fastest, at most, in a timing that decides at once
MIN_TRIAL_TOKENS = 1024  # the shortest pieces a default call times (the model's own: MIN_PIECE_TOKENS);
# the benchmark's explicit counts reach down as far (bench.explicit_pieces)
WHOLE_CALL_BYTES = 256 << 20  # states up to this are timed in the whole call (``dispatch``): 50 µs of writes
# on an H200, about the host's time of a call
MAX_CHOSEN = 4096  # exact calls remembered (``_ANSWERS``, ``_CHOSEN``); past it each memory is cleared
_ANSWERS: dict[tuple, int] = {}  # exact call -> count, every answer kept (never cut: 1): ``choose``'s lookup
_CHOSEN: dict[tuple, int] = {}  # the same, only where the cut was open: what ``choices`` reports
_TIMED: dict[tuple, int] = {}  # ``timing_key`` -> the count its timing chose
_TRIAL_MS: dict[tuple, dict[int, float]] = {}  # ``timing_key`` -> each count's timed ms (what it chose by)
_TRIAL_ATTEMPTS: dict[tuple, int] = {}  # ``timing_key`` -> how many timings it took (``TRIAL_ATTEMPTS``)


def trial_counts(model: int, longest: int, BS: int) -> tuple[int, ...]:
    """The counts a default call times, ascending: one pass, and of ``PIECE_COUNTS`` the model's
    count ``model``, half of it, twice and four times it (for a model's 1: 2, 4 and 8), each where
    its pieces of the longest sequence hold at least ``MIN_TRIAL_TOKENS`` tokens and one split
    (``fit``). Up the counts reach further than down: the counts more than 3 % faster than the
    model's lay above it in the earlier runs (figures/README.md, session 27)."""
    near = (model // 2, model, 2 * model, 4 * model) if model > 1 else (2, 4, 8)
    return tuple(sorted({1, *(P for P in near if P in PIECE_COUNTS and fit(P, longest, BS) == P)}))


def fit(P: int, longest: int, BS: int) -> int:
    """``P``, halved until each piece of the longest sequence holds at least ``MIN_TRIAL_TOKENS``
    tokens and one split (1 if none does): a count timed on one length of a ``timing_key``'s class,
    used on another."""
    while P > 1 and longest < P * max(MIN_TRIAL_TOKENS, BS):
        P //= 2
    return P


def timing_class(longest: int, BT: int) -> int:
    """The class of lengths that share one timing: the bit length of the longest sequence's chunk
    count (1 chunk: 1; 2-3: 2; 4-7: 3; ...), so each class spans a factor of two."""
    return _host.cdiv(longest, BT).bit_length()


def timing_key(exact: tuple, BT: int) -> tuple:
    """The key of the calls that share one timing: ``choose``'s exact key with the longest
    sequence's length replaced by its ``timing_class``, and the tokens by the bit length of how many
    longest sequences they fill (a dense batch: N, already in the key; a packed one: between 1 and N)."""
    direction, gate, tag, N, H, K, V, tokens, longest, *rest = exact
    filled = tokens // longest if longest else 0
    return (direction, gate, tag, N, H, K, V, filled.bit_length(), timing_class(longest, BT), *rest)


def trial_rounds(counts: tuple[int, ...]) -> list[tuple[int, ...]]:
    """The order in which ``timed_choice`` times ``counts`` in each of its ``TRIAL_ROUNDS`` rounds:
    every count once a round, ascending in the even rounds and descending in the odd ones, so no
    count is always timed first, or always behind the same neighbour."""
    return [counts if r % 2 == 0 else counts[::-1] for r in range(TRIAL_ROUNDS)]


def timed_choice(trial, counts: tuple[int, ...], key: tuple) -> int:
    """The fastest of ``counts`` for ``key``'s class: kept from an earlier timing, or now: each count
    run once by ``trial(P)`` (its compile and autotuning), then timed in interleaved rounds
    (``trial_rounds``; each round's time ``_median_time``), holding the launch lock. A timing whose
    rounds disagree (``spread`` over ``STEADY_SPREAD``: the host's pace moved) is done again, up to
    ``TRIAL_ATTEMPTS`` in all; the steadiest decides, each count by the median of its rounds. Of
    equal times, the fewest pieces."""
    chosen = _TIMED.get(key)
    if chosen is not None:
        return chosen
    attempts = []
    with serialised():
        for P in counts:
            trial(P)
        for _ in range(TRIAL_ATTEMPTS):
            rounds = {P: [] for P in counts}
            for order in trial_rounds(counts):
                for P in order:
                    rounds[P].append(_median_time(functools.partial(trial, P)))
            attempts.append(rounds)
            if spread(rounds) <= STEADY_SPREAD:
                break
    chosen, times = by_median(min(attempts, key=spread))  # the steadiest timing (of equals, the first)
    if len(_TIMED) >= MAX_CHOSEN:
        _TIMED.clear()
        _TRIAL_MS.clear()
        _TRIAL_ATTEMPTS.clear()
    _TIMED[key] = chosen
    _TRIAL_MS[key] = times
    _TRIAL_ATTEMPTS[key] = len(attempts)
    return chosen


def by_median(rounds: dict[int, list[float]]) -> tuple[int, dict[int, float]]:
    """What one timing decides: the count whose rounds' median is least (of equal medians, the fewest
    pieces), and each count's median."""
    times = {P: statistics.median(t) for P, t in rounds.items()}
    return min(times, key=lambda P: (times[P], P)), times


def spread(rounds: dict[int, list[float]]) -> float:
    """How far one timing's rounds disagree: of every count, its slowest round over its fastest, the
    largest (1.0: all agree)."""
    return max(max(t) / min(t) if min(t) > 0 else float("inf") for t in rounds.values())


def _median_time(fn) -> float:
    """One round's time of ``fn``: the median ms of ``triton.testing.do_bench`` with
    ``TRIAL_WARMUP_MS`` of warm-up and ``TRIAL_REP_MS`` of repeats."""
    median = triton.testing.do_bench(fn, warmup=TRIAL_WARMUP_MS, rep=TRIAL_REP_MS, quantiles=(0.5,))
    return median[0] if isinstance(median, (list, tuple)) else median


def _capturing(device: int) -> bool:
    """A CUDA graph is being captured on the current stream: nothing may be timed (or synchronised)."""
    return device >= 0 and torch.cuda.is_current_stream_capturing()


def choices() -> dict[tuple, int]:
    """The counts default calls have used where a cut was open, by their exact key (a copy): what the
    benchmark reads to record the count a call ran in."""
    return dict(_CHOSEN)


def trial_times() -> dict[tuple, dict[int, float]]:
    """What each timing measured, by its ``timing_key``: each count's median in ms (a copy), the
    numbers the kept count was chosen by; the benchmark records them beside its own timings."""
    return {key: dict(times) for key, times in _TRIAL_MS.items()}


def trial_attempts() -> dict[tuple, int]:
    """How many timings each ``timing_key``'s choice took (1: its first was steady), a copy."""
    return dict(_TRIAL_ATTEMPTS)


def clear_choices() -> None:
    """Forget every timed count (tests; or to time again after the GPU's load changed)."""
    with serialised():
        _CHOSEN.clear()
        _ANSWERS.clear()
        _TIMED.clear()
        _TRIAL_MS.clear()
        _TRIAL_ATTEMPTS.clear()


def dispatch(pieces, p: Problem, run_pass, states: torch.Tensor, start, end, *, direction: str, gate: str,
             use_gv: bool, tag: tuple = (), call=None) -> None:
    """A wrapper's launch: ``run_pass`` over the whole batch (one pass) or ``run`` in the count
    ``choose`` returns; both fill ``states`` and ``end`` in place (``run_pass`` is what ``run`` takes).
    Where ``choose`` times the counts it weighs, it times ``call(P)``: the wrapper's whole call with
    ``pieces=P``, its checks and allocations included, since that is what a caller pays, and where a
    call's host time exceeds its GPU time a count that costs the host more is slower though its
    launch alone is faster (figures/README.md, session 28). Without ``call``, or where ``states``
    outgrow ``WHOLE_CALL_BYTES`` (each timed call would hold a second set of them, and writing them
    takes longer than the host's part anyway), this launch alone."""
    def launch_in(P: int) -> None:
        if P == 1 or p.H * p.K * p.V == 0:  # (no state element, states and end empty: no launch, nothing to cut)
            run_pass(cu_seqlens=p.cu_seqlens, split_offsets=p.split_offsets, N=p.N, states=states, start=start,
                     end=end)
        else:  # the pieces are packed along T, and a dense batch's rows already lie in memory as one packed row
            # [1, B·T, ...]: a packed launch finds each piece's rows from its offsets alone, so nothing is reshaped
            run(run_pass, p, P, states, start, end, use_gv, reverse=direction == "bwd")

    whole = call is not None and states.nbytes <= WHOLE_CALL_BYTES
    launch_in(choose(pieces, p, direction, gate, trial=call if whole else launch_in, tag=tag))


def plan(lengths, BS: int, pieces: int) -> tuple[list[int], list[int]]:
    """Cut each sequence into pieces of a common length (a multiple of BS).

    Returns ``cu_pieces`` (offsets of all pieces packed along T, [NP + 1]) and ``seq_pieces``
    (the first piece of each sequence, [N + 1]). An empty sequence owns no piece.
    """
    longest = max(lengths, default=0)
    piece_len = max(BS, _host.cdiv(_host.cdiv(longest, max(pieces, 1)), BS) * BS)
    cu_pieces, seq_pieces, pos = [0], [0], 0
    for L in lengths:
        for start in range(0, L, piece_len):
            cu_pieces.append(pos + min(start + piece_len, L))
        pos += L
        seq_pieces.append(len(cu_pieces) - 1)
    return cu_pieces, seq_pieces


@functools.lru_cache(maxsize=64)
def _plan_on_device(lengths: tuple[int, ...], BS: int, pieces: int, device: torch.device):
    """``plan`` and the offsets the kernels read, made once per (lengths, BS, pieces, device): a
    repeated call plans nothing, copies nothing to the device and waits for nothing. Returns NP,
    ``cu_pieces`` [NP + 1] int32, ``seq_pieces`` [N + 1] int32, each piece's first state slot
    [NP + 1] int64 and each piece's sequence [NP] int32. Kernels only read these tensors."""
    cu_host, seq_host = plan(lengths, BS, pieces)
    cu_pieces = torch.tensor(cu_host, dtype=torch.int32, device=device)
    seq_pieces = torch.tensor(seq_host, dtype=torch.int32, device=device)
    _, piece_splits = _host.split_slots(_host.lengths(cu_host), BS, device)
    piece_seq = torch.tensor([n for n in range(len(seq_host) - 1) for _ in range(seq_host[n], seq_host[n + 1])],
                             dtype=torch.int32, device=device)
    return len(cu_host) - 1, cu_pieces, seq_pieces, piece_splits, piece_seq


@triton.jit
def piece_scan_kernel(
    F,  # [NP, H, K, V] fp32  each piece's contribution f_p, started from zero
    decay_k,  # [NP, H, K] fp32  each piece's total key-side log2 decay
    decay_v,  # [NP, H, V] fp32  value side (USE_DECAY_V)
    s0,  # [N, H, K, V]  the state before the first piece (h0; dht in reverse)
    S,  # [NP, H, K, V] fp32 out: the state h_p entering each piece (leaving it, in reverse)
    s_end,  # [N, H, K, V] fp32 out: after the last piece (ht; dh0 in reverse)
    seq_pieces,  # [N + 1] first piece of each sequence
    H: tl.constexpr,
    K: tl.constexpr,
    V: tl.constexpr,
    BK: tl.constexpr,
    BV: tl.constexpr,
    USE_DECAY_V: tl.constexpr,
    USE_S0: tl.constexpr,
    STORE_END: tl.constexpr,
    REVERSE: tl.constexpr,
    STATE_V_FIRST: tl.constexpr,
):
    i_nh, i_n, i_h, i_k, i_v = program_tile(H, K, V, BK, BV)
    p_first = tl.load(seq_pieces + i_n).to(tl.int64)
    n_pieces = tl.load(seq_pieces + i_n + 1).to(tl.int32) - p_first.to(tl.int32)
    o_k = i_k * BK + tl.arange(0, BK)  # [BK]
    o_v = i_v * BV + tl.arange(0, BV)  # [BV]
    b_s = tl.zeros([BK, BV], dtype=tl.float32)  # [BK, BV]
    if USE_S0:
        b_s = load_state(s0 + i_nh * K * V, o_k, o_v, K, V, STATE_V_FIRST)
    for j in range(0, n_pieces):
        if REVERSE:
            i_p = p_first + n_pieces - 1 - tl.cast(j, tl.int64)
        else:
            i_p = p_first + tl.cast(j, tl.int64)
        o_p = i_p * H + i_h
        store_state(S + o_p * K * V, b_s, o_k, o_v, K, V, STATE_V_FIRST)
        b_s *= tl.math.exp2(tl.load(decay_k + o_p * K + o_k, mask=o_k < K, other=0.0))[:, None]
        if USE_DECAY_V:
            b_s *= tl.math.exp2(tl.load(decay_v + o_p * V + o_v, mask=o_v < V, other=0.0))[None, :]
        b_s += load_state(F + o_p * K * V, o_k, o_v, K, V, STATE_V_FIRST)
    if STORE_END:
        store_state(s_end + i_nh * K * V, b_s, o_k, o_v, K, V, STATE_V_FIRST)


# ---------------------------------------------------------------------------------------------
# Pieces in one launch (the kernels' LOOK_BACK): the three steps in one grid, each program walking twice
# ---------------------------------------------------------------------------------------------
#
# One program per piece and tile, as in one of the three launches' passes. Each walks its piece from
# zero and publishes its contribution f_p and decays d_p, as step 1 does (not the last piece: nothing
# after it reads one; in reverse, the first); then folds in the contributions of the pieces before
# its own (in reverse: after it) as step 2's scan does, in the scan's order and arithmetic, so the
# same bits; then walks its piece again from that true start, storing its states, as step 3 does.
# Tickets, in the order programs start, hand out the tiles piece by piece (in reverse for the
# backward), so a program waits only on programs that started before it; each of those publishes
# after a walk that waits on nothing, so no schedule of the programs can deadlock. Each
# contribution's flag holds how many pieces will still read it; each reader counts itself off, and
# the last ticket resets the counter, so a launch leaves both at zero for the next one (also when a
# CUDA graph replays it). (A first version launched twice the programs, one half publishing and the
# other storing: on the H200 its walks ran 1.3-1.6x slower than the passes', figures/README.md,
# session 18.)

@triton.jit
def piece_role(counter, piece_seq, seq_pieces, H: tl.constexpr, K: tl.constexpr, V: tl.constexpr,
               BK: tl.constexpr, BV: tl.constexpr, REVERSE: tl.constexpr):
    """Which piece and tile this program of a one-launch call in pieces walks, from the order programs
    started: a ticket from ``counter`` (the last ticket sets it back to 0), the tiles taken in order
    (in reverse order with ``REVERSE``), so that the pieces a program waits on (before its own; after
    it, in reverse) took earlier tickets and have started. Returns the tile as ``program_tile`` does,
    its sequence index being the piece's; the piece's sequence, and that sequence's first and last
    pieces."""
    n = tl.num_programs(0)
    ticket = tl.atomic_add(counter, 1)
    if ticket == n - 1:  # every program holds its ticket: the next launch starts at 0
        tl.atomic_xchg(counter, 0)
    order = ticket
    if REVERSE:
        order = n - 1 - ticket
    i_nh, i_p, i_h, i_k, i_v = tile_of(order.to(tl.int64), H, K, V, BK, BV)
    i_seq = tl.load(piece_seq + i_p).to(tl.int64)
    p_first = tl.load(seq_pieces + i_seq).to(tl.int64)
    p_last = tl.load(seq_pieces + i_seq + 1).to(tl.int64) - 1
    return i_nh, i_p, i_h, i_k, i_v, i_seq, p_first, p_last


@triton.jit
def fold_contributions(b_s, contributions, decay_k, decay_v, flags, i_h, i_k, i_v, p_from, count, o_k, o_v,
                       H: tl.constexpr, K: tl.constexpr, V: tl.constexpr, BK: tl.constexpr, BV: tl.constexpr,
                       USE_DECAY_V: tl.constexpr, STATE_V_FIRST: tl.constexpr, REVERSE: tl.constexpr):
    """``b_s`` [BK, BV] carried across ``count`` pieces from piece ``p_from`` (up; down with
    ``REVERSE``), as ``piece_scan_kernel`` carries it: per piece, once its flag says its contribution
    is published (an acquire), decayed by its total decays and added to; then this read is counted
    off its flag."""
    NK: tl.constexpr = (K + BK - 1) // BK
    NV: tl.constexpr = (V + BV - 1) // BV
    for j in range(0, count):
        if REVERSE:
            i_p = p_from - tl.cast(j, tl.int64)
        else:
            i_p = p_from + tl.cast(j, tl.int64)
        o_p = i_p * H + i_h
        flag = flags + (o_p * NK + i_k) * NV + i_v
        ready = tl.atomic_add(flag, 0, sem="acquire")
        while ready == 0:
            ready = tl.atomic_add(flag, 0, sem="acquire")
        d_k = tl.load(decay_k + o_p * K + o_k, mask=o_k < K, other=0.0, cache_modifier=".cg")  # [BK]
        b_s *= tl.math.exp2(d_k)[:, None]
        if USE_DECAY_V:
            d_v = tl.load(decay_v + o_p * V + o_v, mask=o_v < V, other=0.0, cache_modifier=".cg")  # [BV]
            b_s *= tl.math.exp2(d_v)[None, :]
        b_s += load_state_cached(contributions + o_p * K * V, o_k, o_v, K, V, STATE_V_FIRST, ".cg")
        tl.atomic_add(flag, -1, sem="relaxed")
    return b_s


@triton.jit
def publish_contribution(contributions, decay_k, decay_v, flags, b_s, b_decay_k, b_decay_v, i_nh, i_k, i_v, readers,
                         o_k, o_v, K: tl.constexpr, V: tl.constexpr, BK: tl.constexpr, BV: tl.constexpr,
                         USE_DECAY_V: tl.constexpr, STATE_V_FIRST: tl.constexpr):
    """Store a piece's contribution tile ``b_s`` and its total decays (every tile those of its own
    rows and columns: the copies agree), then, once every thread's stores are done, set its flag to
    ``readers``, the pieces that will read it (a release)."""
    NK: tl.constexpr = (K + BK - 1) // BK
    NV: tl.constexpr = (V + BV - 1) // BV
    store_state(contributions + i_nh * K * V, b_s, o_k, o_v, K, V, STATE_V_FIRST)
    tl.store(decay_k + i_nh * K + o_k, b_decay_k, mask=o_k < K)
    if USE_DECAY_V:
        tl.store(decay_v + i_nh * V + o_v, b_decay_v, mask=o_v < V)
    tl.debug_barrier()
    tl.atomic_xchg(flags + (i_nh * NK + i_k) * NV + i_v, readers.to(tl.int32), sem="release")


# Workspaces kept between calls: a call in pieces would otherwise allocate one and take four views
# of it every time, ~25 µs of an H200 host's time (figures/README.md, "The pieces path: where its
# time goes"). One is reused only by a later call on the same device and stream, which the GPU runs
# after this one's kernels have finished with it; ``run`` holds the launch lock, so two threads
# never interleave their passes over one workspace. Never while a CUDA graph is being captured.
_WORKSPACES: OrderedDict[tuple, tuple] = OrderedDict()
MAX_WORKSPACES = 4  # kept, the least recently used dropped first
MAX_KEPT_BYTES = 64 << 20  # a larger workspace is allocated per call, as before


def _kept(kind: str, NP: int, p: Problem, use_gv: bool, device, make):
    """The views ``make()`` allocates for a call in ``NP`` pieces of ``p``, kept in ``_WORKSPACES``
    for the next call of the same ``kind`` and sizes on this device and stream (the least recently
    used dropped past ``MAX_WORKSPACES``); made anew, and not kept, while a CUDA graph is being
    captured or when the first view's allocation is over ``MAX_KEPT_BYTES``."""
    cuda = device.type == "cuda"
    if cuda and torch.cuda.is_current_stream_capturing():
        return make()
    # the raw stream, not torch.cuda.current_stream(device), which took ~13 µs of an H200 host's time under cProfile
    key = (kind, device, _host.current_raw_stream(device.index) if cuda else None, NP, p.H, p.K, p.V,
           p.state_v_first, use_gv)
    views = _WORKSPACES.get(key)
    if views is None:
        views = make()
        if views[0].untyped_storage().nbytes() > MAX_KEPT_BYTES:
            return views
        _WORKSPACES[key] = views
        while len(_WORKSPACES) > MAX_WORKSPACES:
            _WORKSPACES.popitem(last=False)
    _WORKSPACES.move_to_end(key)
    return views


def _workspace(NP: int, p: Problem, use_gv: bool, device):
    """The three launches' buffers: F and S [NP, H, *state], decay_k [NP, H, K] and decay_v [NP, H, V]
    (None without gv), fp32, as views of one allocation (each part starting on a 128-byte
    boundary), kept between calls (``_kept``)."""
    return _kept("passes", NP, p, use_gv, device, lambda: _new_workspace(NP, p, use_gv, device))


MIN_TILE = 16  # the narrowest BK, BV of any config: the most tiles, and flags, a state can have


def _look_back_workspace(NP: int, p: Problem, use_gv: bool, device):
    """A one-launch call's buffers: the contributions [NP, H, *state], decay_k [NP, H, K] and decay_v
    [NP, H, V] (None without gv), fp32, as ``_workspace``'s F and decays; and the flags (one per
    piece, head and tile of the narrowest tiles) and the ticket counter, int32, zero. A launch
    leaves them zero, so they are kept for the next call (``_kept``); inside a CUDA graph capture
    they are made anew, their zeroing captured."""
    def make():
        F, _, decay_k, decay_v = _new_workspace(NP, p, use_gv, device, with_S=False)
        n_flags = NP * p.H * _host.cdiv(p.K, MIN_TILE) * _host.cdiv(p.V, MIN_TILE)
        sync = torch.zeros(n_flags + 1, dtype=torch.int32, device=device)
        return F, decay_k, decay_v, sync[:n_flags], sync[n_flags:]  # the flags, then the counter

    return _kept("look_back", NP, p, use_gv, device, make)


def clear_workspaces() -> None:
    """Drop the workspaces kept between calls (their memory goes back to torch's allocator)."""
    with serialised():
        _WORKSPACES.clear()


def _new_workspace(NP: int, p: Problem, use_gv: bool, device, with_S: bool = True):
    state = NP * p.H * p.K * p.V
    sizes = [state, state if with_S else 0, NP * p.H * p.K, NP * p.H * p.V if use_gv else 0]
    starts, total = [], 0
    for n in sizes:
        starts.append(total)
        total += _host.cdiv(n, 32) * 32
    buf = torch.empty(max(total, 1), dtype=torch.float32, device=device)
    F, S, decay_k, decay_v = (buf[a:a + n] for a, n in zip(starts, sizes))
    return (F.view(NP, p.H, *p.state), S.view(NP, p.H, *p.state) if with_S else None, decay_k.view(NP, p.H, p.K),
            decay_v.view(NP, p.H, p.V) if use_gv else None)


def scan(F, decay_k, decay_v, s0, s_end, seq_pieces, N, H, K, V, reverse, state_v_first, S):
    """Run ``piece_scan_kernel``, writing into ``S`` [NP, H, K, V] fp32 (layout as ``F``); returns ``S``."""
    if N * H * K * V == 0:
        return S
    BK, BV = min(64, _host.next_power_of_2(K)), min(64, _host.next_power_of_2(V))
    grid = (_host.cdiv(K, BK) * _host.cdiv(V, BV) * N * H,)
    launch_plain(piece_scan_kernel, grid, dict(
        F=F, decay_k=decay_k, decay_v=decay_v, s0=s0, S=S, s_end=s_end, seq_pieces=seq_pieces, H=H, K=K, V=V,
        BK=BK, BV=BV, USE_DECAY_V=decay_v is not None, USE_S0=s0 is not None, STORE_END=s_end is not None,
        REVERSE=reverse, STATE_V_FIRST=state_v_first, num_warps=4))
    return S


def run(run_pass, p: Problem, pieces: int, states: torch.Tensor, start, end, use_gv: bool, reverse: bool) -> None:
    """The three steps (module docstring) for the sequences of ``p``, filling ``states`` (h or dh)
    and ``end`` (ht or dh0, if given) in place: in one launch (``ONE_LAUNCH``, unless a sequence is
    empty) or three.

    ``run_pass(cu_seqlens=, split_offsets=, N=, states=, start=, end=, decay_k=, decay_v=,
    look_back=)`` launches the kernel over pieces packed along T (a dense batch's [B, T] rows, and
    its states' [B, NS] slots, lie in memory as one packed row, and the kernel reads them through the
    offsets only); ``start`` is h0 (forward) or dht (backward), ``reverse`` walks the pieces from the
    last; ``look_back``: the one launch's buffers, by the kernels' argument names."""
    dev = states.device
    NP, cu_pieces, seq_pieces, piece_splits, piece_seq = _plan_on_device(p.lengths, p.BS, pieces, dev)
    if ONE_LAUNCH and min(p.lengths, default=0) > 0:  # an empty sequence owns no piece, so no program: its
        # end state (h0, or dht) is the scan's to store, in the three launches
        with serialised():  # the workspace is this call's until its launch is queued
            contributions, decay_k, decay_v, flags, counter = _look_back_workspace(NP, p, use_gv, dev)
            run_pass(cu_seqlens=cu_pieces, split_offsets=piece_splits, N=NP,
                     states=states, start=start, end=end, decay_k=decay_k,
                     decay_v=decay_v, look_back=dict(counter=counter, flags=flags, contributions=contributions,
                                                     piece_seq=piece_seq, seq_pieces=seq_pieces))
        return
    with serialised():  # the workspace is this call's until its three launches are queued
        F, S, decay_k, decay_v = _workspace(NP, p, use_gv, dev)
        # 1. each piece from zero: its contribution f_p and its total decays d_p, d_{v,p}
        run_pass(cu_seqlens=cu_pieces, split_offsets=None, N=NP, states=None, start=None, end=F,
                 decay_k=decay_k, decay_v=decay_v)
        # 2. the true state entering each piece (leaving it, in reverse), and the end state
        scan(F, decay_k, decay_v, start, end, seq_pieces, p.N, p.H, p.K, p.V, reverse, p.state_v_first, S)
        # 3. each piece again from its true start, storing its states in place
        run_pass(cu_seqlens=cu_pieces, split_offsets=piece_splits, N=NP,
                 states=states, start=S, end=None)
