"""The benchmark's model, pure: no GPU, no timing. What the exercises, the figures and ``--plan`` use.

- the cases: ``Shape`` (B × T tokens, H heads, K = V = D, or a packed batch), ``Case`` (a shape, a
  direction, a gate, the states' dtype, a split size), the shape lists and ``make_cases``;
- the bytes: ``unique_bytes`` (every tensor a kernel must touch once), and from a case's raw
  timings the derived numbers (``new_result``, ``derive``: floor, TB/s, ×floor, fla / ours);
- the pieces the wrapper would choose on an H200 (``predicted_pieces``, a pure function);
- the estimator behind ``--plan``: the kernel launches of a first call and the configs each tries
  (``ours_launches``), and what a run costs in compiles, autotune timings and seconds
  (``estimate``, ``sweep_estimate``, ``format_plan``).
"""
from __future__ import annotations

import itertools
import math
import random
import re
import statistics
from dataclasses import dataclass

import torch

from .. import pieces, tuning

BT = 64  # chunk size of every case
STATE_BYTES = {"bf16": 2, "fp32": 4}
IN_BYTES = 2  # bf16 inputs
GATE_BYTES = 4  # fp32 gates
# fla's autotune space cut to 8 configs (BK, BV, num_warps, num_stages): winners on an H200.
# The runner restricts fla's autotuners to these; the estimator counts them.
FLA_CONFIGS = [(64, 64, 8, 4), (64, 64, 4, 4), (64, 64, 2, 3), (64, 64, 4, 2),
               (32, 32, 4, 4), (32, 32, 8, 4), (64, 32, 8, 4), (32, 64, 8, 3)]
COPY_TBPS_GUESS = 4.26  # an H200's measured copy bandwidth: only for --plan's floors


# ---------------------------------------------------------------- shapes and cases

@dataclass(frozen=True)
class Shape:
    """A problem size: B × T tokens, H heads, a [K, V] state (V defaults to K); ``lens``: a packed
    batch (B = 1, T = Σ lens)."""
    B: int
    T: int
    H: int
    K: int = 128
    V: int | None = None
    lens: tuple[int, ...] | None = None

    def __post_init__(self):
        if self.V is None:
            object.__setattr__(self, "V", self.K)
        if self.lens is not None and (self.B != 1 or sum(self.lens) != self.T):
            raise ValueError(f"a packed shape needs B = 1 and T = sum(lens), got B={self.B} T={self.T}")

    @property
    def N(self) -> int:
        return len(self.lens) if self.lens else self.B

    @property
    def lengths(self) -> list[int]:
        return list(self.lens) if self.lens else [self.T] * self.B

    @property
    def label(self) -> str:
        s = f"varlen N{self.N} T{self.T} H{self.H}" if self.lens else f"B{self.B} T{self.T} H{self.H}"
        if self.K == self.V:
            return s if self.K == 128 else f"{s} D{self.K}"
        return f"{s} K{self.K} V{self.V}"


GATES = ("none", "g", "gk", "g_gamma")  # the gate a case passes: none, g [B,T,H], gk [B,T,H,K], g_gamma [H]


@dataclass(frozen=True)
class Case:
    shape: Shape
    direction: str  # "fwd" | "bwd"
    gate: str = "g"  # one of GATES
    states: str = "bf16"  # dtype of h / dh: "bf16" | "fp32"
    split: int | None = None  # split_size (None: BT)
    final: bool = False  # forward: also ht; backward: dht given and dh0 stored

    def __post_init__(self):
        if self.gate not in GATES:
            raise ValueError(f"gate must be one of {GATES}, got {self.gate!r}")

    @property
    def BS(self) -> int:
        return BT if self.split is None else self.split

    @property
    def fla_valid(self) -> bool:
        """False where fla-core 0.6.0's result is known wrong: its backward with split > chunk."""
        return not (self.direction == "bwd" and self.BS > BT)

    @property
    def label(self) -> str:
        split = f" split {self.split}" if self.split else ""
        final = (" ht" if self.direction == "fwd" else " dht") if self.final else ""
        return f"{self.shape.label} {self.direction} {self.gate} {self.states}{split}{final}"


VARLEN_LENS = (8192, 6000, 5000, 4096, 3500, 3000, 2000, 980)  # Σ = 32768, ragged chunk edges
OWN_SHAPES = (Shape(8, 4096, 16), Shape(1, 65536, 32), Shape(1, 65536, 8), Shape(1, 131072, 4),
              Shape(1, sum(VARLEN_LENS), 16, lens=VARLEN_LENS))
FLA_SHAPES = (Shape(1, 8192, 96), Shape(2, 16384, 16), Shape(4, 2048, 16), Shape(4, 4096, 64),
              Shape(8, 2048, 32, 256), Shape(8, 1024, 8, 64))  # fla's own benchmark shapes
SHAPES = OWN_SHAPES + FLA_SHAPES
VARIANT_SHAPES = OWN_SHAPES[:3]
QUICK_SHAPES = (OWN_SHAPES[0], OWN_SHAPES[2])
SWEEP_SHAPES = (OWN_SHAPES[2], OWN_SHAPES[1], OWN_SHAPES[0], FLA_SHAPES[3])  # N·H in occupancy buckets 0, 1, 2, 3
# A call of a few µs of GPU work, bound by the host's time: --calibrate's floors, --random's host probe
HOST_PROBE = Shape(1, 4096, 2, 128)


_LABEL = re.compile(r"B(\d+) T(\d+) H(\d+)(?: D(\d+)| K(\d+) V(\d+))?(?: (none|g_gamma|gk|g))?")


def parse_shape(label: str) -> tuple[Shape, str | None] | None:
    """A dense shape written as its label, ``"B2 T4096 H48 K64 V128"`` (or ``D64``; K = V = 128 when
    neither is given), optionally followed by a gate (``none``, ``g``, ``gk``, ``g_gamma``): the
    shape and the gate (None when not given); None when ``label`` is not such a text."""
    m = _LABEL.fullmatch(label.strip())
    if not m:
        return None
    B, T, H, D, K, V, gate = m.groups()
    K = int(D or K or 128)
    return Shape(int(B), int(T), int(H), K, int(V) if V else K), gate


def select_shapes(shapes, wanted: list[str] | None):
    """The shapes whose label contains one of the ``wanted`` substrings (all when None)."""
    if not wanted:
        return tuple(shapes)
    return tuple(s for s in shapes if any(w in s.label for w in wanted))


def make_cases(mode: str = "default", wanted: list[str] | None = None) -> list[Case]:
    """The cases of a mode ("default", "quick", "full"), shape by shape; ``wanted`` filters shapes
    by label substring (from all shapes)."""
    dirs = ("fwd", "bwd")
    if mode == "quick":
        return [Case(s, d) for s in select_shapes(QUICK_SHAPES if not wanted else SHAPES, wanted) for d in dirs]
    shapes = select_shapes(SHAPES, wanted)
    if mode == "full":
        return [Case(s, d, g, st, sp) for s in shapes
                for d, g, st, sp in itertools.product(dirs, ("g", "gk"), ("bf16", "fp32"), (None, 256))]
    if mode != "default":
        raise ValueError(f"mode must be 'default', 'quick' or 'full', got {mode!r}")
    cases = []
    for s in shapes:
        cases += [Case(s, d) for d in dirs]
        if s in VARIANT_SHAPES:
            cases += [Case(s, d, gate="gk") for d in dirs]
            cases += [Case(s, d, states="fp32") for d in dirs]
            cases += [Case(s, d, split=256) for d in dirs]
    return cases


# ---------------------------------------------------------------- random shapes (--random SEED)

RANDOM_HEADS = (1, 2, 3, 4, 6, 8, 12, 16, 20, 24, 32, 40, 48, 64)
RANDOM_DIMS = (64, 128, 256)
RANDOM_PACKED = 0.25  # the share of packed batches
RANDOM_MAX_STATE_BYTES = 16 << 30  # a draw whose stored bf16 states would exceed this is drawn again
RANDOM_DISTRIBUTION = (
    "per shape, independently: total tokens 2^U(13, 17) (8k-128k); H uniform over "
    f"{RANDOM_HEADS}; K and V each uniform over {RANDOM_DIMS}; the gate uniform over {GATES}; "
    f"with probability {RANDOM_PACKED} a packed batch of N ~ U{{2..64}} sequences whose lengths share "
    "the tokens in proportion to lognormal(0, 1) weights (each at least 1), else a dense batch with "
    "T = 2^U(9, log2 min(tokens, 2^17)), rounded to a power of two half the time, and "
    "B = round(tokens / T) clipped to 1..256 (drawn again if B·T leaves 8k-128k); both directions, bf16 inputs and states, BT = 64, "
    "split = BT, final states (ht; dht in, dh0 out); draws storing over 16 GiB of states are redrawn")


def _share(total: int, weights: list[float]) -> list[int]:
    """``total`` tokens cut in proportion to ``weights``, every part at least 1 (``total`` >= 64·len)."""
    s = sum(weights)
    lens = [max(1, int(total * w / s)) for w in weights]
    longest = max(range(len(lens)), key=lens.__getitem__)
    lens[longest] += total - sum(lens)
    return lens


def random_shapes(seed: int, n: int) -> list[tuple[Shape, str]]:
    """``n`` (shape, gate) pairs drawn from ``RANDOM_DISTRIBUTION`` by ``random.Random(seed)``: the same
    seed gives the same draws on every machine."""
    rng = random.Random(seed)
    out = []
    while len(out) < n:
        tokens = int(round(2 ** rng.uniform(13, 17)))
        H = rng.choice(RANDOM_HEADS)
        K, V = rng.choice(RANDOM_DIMS), rng.choice(RANDOM_DIMS)
        gate = rng.choice(GATES)
        if rng.random() < RANDOM_PACKED:
            lens = _share(tokens, [rng.lognormvariate(0, 1) for _ in range(rng.randint(2, 64))])
            shape = Shape(1, tokens, H, K, V, lens=tuple(lens))
        else:
            T = 2 ** rng.uniform(9, math.log2(min(tokens, 1 << 17)))
            T = 2 ** round(math.log2(T)) if rng.random() < 0.5 else int(round(T))
            shape = Shape(min(256, max(1, round(tokens / T))), T, H, K, V)
        if not (1 << 13) <= shape.B * shape.T <= (1 << 17):  # B's rounding left the token range
            continue
        if n_splits(shape, BT) * H * K * V * STATE_BYTES["bf16"] <= RANDOM_MAX_STATE_BYTES:
            out.append((shape, gate))
    return out


def random_cases(seed: int, n: int) -> list[Case]:
    """The cases of ``--random SEED --n N``: each drawn shape forward and backward, with final states."""
    return [Case(shape, d, gate=gate, final=True) for shape, gate in random_shapes(seed, n) for d in ("fwd", "bwd")]


def programs_64(shape: Shape) -> int:
    """``pieces.programs_64`` of a shape: its one-pass launch's programs with 64×64 state tiles."""
    return pieces.programs_64(shape.N, shape.H, shape.K, shape.V)


def explicit_pieces(case: Case, sms: int) -> list[int]:
    """The piece counts the random mode times beside chunkstate's own choice: where one pass keeps
    under two waves of 64×64 programs busy (``pieces.busy_programs`` < 2 ``sms``: for a dense batch
    ``programs_64``), 1 and each of 2, 4, .., 32 leaving pieces of at least 1,024 tokens of the
    longest sequence; elsewhere none (a second pass cannot pay once the GPU is full)."""
    s = case.shape
    longest = max(s.lengths, default=0)
    if pieces.busy_programs(s.H, s.K, s.V, sum(s.lengths), longest) >= 2 * sms:
        return []
    return [1] + [P for P in (2, 4, 8, 16, 32) if longest >= P * max(1024, case.BS)]


# ---------------------------------------------------------------- bytes, floors, derived numbers

def n_splits(shape: Shape, BS: int) -> int:
    """State slots stored: ``Σ_n ceil(L_n / BS)`` (dense: B · ceil(T / BS))."""
    return sum(-(-L // BS) for L in shape.lengths)


def unique_bytes(case: Case, h0: bool = False, final: bool = False) -> dict[str, int]:
    """Bytes a kernel must move at least once, per tensor.

    Forward: reads k [B,T,H,K], v [B,T,H,V] (bf16), the gate (fp32: g [B,T,H], gk [B,T,H,K] or
    g_gamma [H]; nothing without a gate), h0 [N,H,K,V] (fp32) if ``h0``; writes h [NS,H,K,V] (the
    states' dtype) and ht [N,H,K,V] (fp32) if ``final`` or ``case.final``. Backward: reads q, do
    (bf16), the gate, dht (fp32) if ``final``; writes dh and dh0 (fp32) if ``h0`` (``case.final``
    sets both). The backward never reads k or v. NS = ``n_splits``.
    """
    s = case.shape
    K, V = s.K, s.V
    tokens = s.B * s.T * s.H
    gate = {"none": 0, "g": tokens * GATE_BYTES, "gk": tokens * GATE_BYTES * K, "g_gamma": s.H * GATE_BYTES}[case.gate]
    states = n_splits(s, case.BS) * s.H * K * V * STATE_BYTES[case.states]
    one_state = s.N * s.H * K * V * 4
    final = final or case.final
    h0 = h0 or (case.final and case.direction == "bwd")
    x1, x2 = ("k", "v") if case.direction == "fwd" else ("q", "do")
    parts = {x1: tokens * K * IN_BYTES, x2: tokens * V * IN_BYTES}
    if case.gate != "none":
        parts[case.gate] = gate
    if case.direction == "fwd":
        if h0:
            parts["h0"] = one_state
        parts["h"] = states
        if final:
            parts["ht"] = one_state
    else:
        if final:
            parts["dht"] = one_state
        parts["dh"] = states
        if h0:
            parts["dh0"] = one_state
    return parts


def _finite_or_none(x):
    return float(x) if x is not None and math.isfinite(x) else None


def derive(result: dict, copy_tbps: float) -> dict:
    """Fill a case's derived numbers from its raw timings: floor_ms, and per library
    tbps (= total bytes / ms), x_floor (= ms / floor_ms); fla_over_ours where fla's result is right,
    also paired by round (``paired_ratio``); where piece counts were timed explicitly, chunkstate's
    own choice against the best of them, as timed and paired by round."""
    total = result["total_bytes"]
    result["floor_ms"] = total / (copy_tbps * 1e12) * 1e3
    for who in ("ours", "ours_one_pass", "fla"):
        entry = result.get(who)
        if not entry:
            continue
        ms = _finite_or_none(entry.get("ms"))
        entry["ms"] = ms
        entry["tbps"] = total / (ms * 1e-3) / 1e12 if ms else None
        entry["x_floor"] = ms / result["floor_ms"] if ms else None
    ours, fla = result.get("ours") or {}, result.get("fla") or {}
    ok = fla.get("valid", False) and ours.get("ms") and fla.get("ms")
    result["fla_over_ours"] = fla["ms"] / ours["ms"] if ok else None
    result["fla_over_ours_paired"] = paired_ratio(fla.get("rounds"), ours.get("rounds")) if ok else None
    timed = {P: ms for P, ms in (result.get("pieces_ms") or {}).items() if _finite_or_none(ms)}  # "P" -> ms
    best = min(timed, key=timed.get) if timed else None  # the explicit count with the lowest median
    chosen = str(result.get("pieces"))
    # chunkstate's own choice against the best explicit piece count (1.0: it chose as well as the best)
    result["auto_over_best"] = ours["ms"] / timed[best] if best and ours.get("ms") else None
    # the same choice judged by the explicit timings alone: the chosen count's own timing over the best.
    # Where chunkstate chose a count that was also timed explicitly, this compares two timings of one
    # run rather than two timings of one call (which differ by up to 3x on calls of ~0.05 ms: noise)
    result["choice_over_best"] = timed[chosen] / timed[best] if best and chosen in timed else None
    # the same two, paired by round: per round, ours (or the chosen count) over the best count's timing in
    # that round, then the median. The calls of a round are timed within a few tens of ms of each other,
    # so a drift of the host's pace between rounds cancels
    rounds = result.get("pieces_rounds") or {}
    result["auto_over_best_paired"] = paired_ratio(ours.get("rounds"), rounds.get(best))
    result["choice_over_best_paired"] = paired_ratio(rounds.get(chosen), rounds.get(best))
    result["auto_over_twin_paired"] = twin_ratio(result)
    return result


def twin_ratio(result: dict) -> float | None:
    """The default call over its twin, the count it chose timed explicitly, paired by round
    (``paired_ratio``): the same launch twice, so how far apart they come out is the measurement's own
    spread, the floor under the 3 % criterion on auto pieces. None where the chosen count was not
    timed explicitly in every round."""
    twin = (result.get("pieces_rounds") or {}).get(str(result.get("pieces")))
    return paired_ratio((result.get("ours") or {}).get("rounds"), twin)


def paired_ratio(a, b) -> float | None:
    """The median over rounds of ``a[r] / b[r]`` (two calls' per-round timings from the same rounds);
    None unless both have every round."""
    if not a or not b or len(a) != len(b) or not all(_finite_or_none(x) for x in (*a, *b)):
        return None
    return statistics.median(x / y for x, y in zip(a, b))


def new_result(case: Case, n_pieces: int) -> dict:
    """The JSON record of one case before timing (``n_pieces``: what chunkstate's wrapper cuts it into)."""
    s = case.shape
    parts = unique_bytes(case)
    return {"case": case.label, "shape": s.label, "B": s.B, "T": s.T, "H": s.H, "K": s.K, "V": s.V,
            "lens": list(s.lens) if s.lens else None, "direction": case.direction, "gate": case.gate,
            "states": case.states, "split": case.split, "final": case.final, "BT": BT, "bytes": parts,
            "total_bytes": sum(parts.values()), "pieces": n_pieces, "ours": None, "fla": None}


def geomean(xs) -> float | None:
    """The geometric mean of the truthy ``xs`` (None where there are none)."""
    xs = [x for x in xs if x]
    return math.exp(sum(math.log(x) for x in xs) / len(xs)) if xs else None


# ---------------------------------------------------------------- what a first call launches

def predicted_pieces(N: int, H: int, K: int, V: int, max_len: int, BS: int, direction: str, gate: str = "g",
                     tokens: int | None = None) -> int:
    """``pieces.auto_pieces`` as the wrapper calls it on this machine's GPU (``tuning.sm_count()``),
    and without a GPU as an H200 would (``tuning.H200_SMS``): a pure function of its arguments
    (``gate``: the case's gate, a ``pieces.gate_kind``; ``tokens``: a packed batch's, default N ·
    ``max_len``)."""
    return pieces.auto_pieces(N, H, K, V, max_len, BS, tuning.sm_count(), BT, direction=direction, gate=gate,
                              tokens=tokens)


def case_pieces(case: Case) -> int:
    """The pieces chunkstate's wrapper's cost model proposes for ``case`` (``predicted_pieces``)."""
    s = case.shape
    return predicted_pieces(s.N, s.H, s.K, s.V, max(s.lengths, default=0), case.BS, case.direction, case.gate,
                            tokens=sum(s.lengths))


def tried_configs(K: int, V: int, bucket: int, gate: str) -> list[tuple]:
    """The configs (``tuning.config_tuple``) chunkstate's autotuner tries for one key of the
    benchmark's bf16 inputs: TMA configs too where this machine's GPU has a TMA, none without a GPU;
    fitted to this GPU's shared memory (an H200's without a GPU). Asks the device only for its
    compute capability and shared memory."""
    tma = (torch.cuda.is_available() and tuning.tma_device("cuda")
           and tuning.tma_rows(K, IN_BYTES) and tuning.tma_rows(V, IN_BYTES))
    args = {"K": K, "V": V, "OCCUPANCY": bucket, "TMA_OK": int(tma), "BT": BT, "k": torch.bfloat16}
    if gate != "none":
        args["USE_" + gate.upper()] = True
    return [tuning.config_tuple(c) for c in tuning.prune(tuning.ALL_CONFIGS, args)]


def ours_launches(case: Case) -> list[tuple[tuple, list]]:
    """The kernel launches of chunkstate's first call of ``case``: (what its compile depends on,
    the configs its autotuner tries; ``[None]``: launched untuned). A case cut into pieces
    launches the kernel twice (pieces from zero, then pieces storing their states) and the scan
    between them (``chunkstate.pieces``), in either direction."""
    s = case.shape
    K, V = s.K, s.V
    P = case_pieces(case)
    sequences = s.N if P == 1 else len(pieces.plan(s.lengths, case.BS, P)[0]) - 1  # or pieces
    bucket = tuning.launch_bucket(sequences, s.H, K, V)
    # the forward's NARROW_V is a constexpr chosen by the bucket (one scalar gate: g or g_gamma)
    narrow = case.direction == "fwd" and case.gate in ("g", "g_gamma") and tuning.narrow_v(bucket)
    base = (case.direction, case.gate, case.BS, K, V, narrow)
    configs = tried_configs(K, V, bucket, case.gate)
    if P == 1:
        return [((*base, case.states, s.lens is not None, "states"), configs)]
    return [((*base, "pieces: final states and decays"), configs),
            (("pieces: scan", case.direction, K, V), [None]),
            ((*base, case.states, "pieces: states"), configs)]


def fla_key(case: Case) -> tuple:
    """What one fla-core compile depends on (its autotune key holds no B, T, H)."""
    return ("fla", case.direction, case.gate, case.states, case.BS, case.shape.K, case.shape.V, case.final,
            case.shape.lens is not None)


# ---------------------------------------------------------------- the estimate behind --plan

# Per-item costs on an H200 (a first call tuning 48 configs took 34-49 s, 12 configs ~7 s:
# 0.6-1.0 s per config compiled and benchmarked).
COMPILE_S = 0.7  # one (specialization, config) compile
TUNE_S = 0.2  # the autotuner's do_bench of one candidate (25 ms warmup + 100 ms reps + L2 flushes)
MEASURE_S = 0.15  # five rounds of do_bench(warmup=2, rep=10) plus the first call and the agreement check
SHAPE_S = 1.0  # inputs and gates of one shape
STARTUP_S = 20.0  # imports, the copy probe, fla's import


def estimate(cases: list[Case], fla_configs: int | None = len(FLA_CONFIGS)) -> dict:
    """Compiles, autotune benchmarks and measurements a run of ``cases`` costs, and the seconds
    that makes with the per-item costs above (``fla_configs`` None: fla not run)."""
    seen = set()
    compiles = {"ours": 0, "fla": 0}
    tunes = {"ours": 0, "fla": 0}
    for case in cases:
        for key, configs in ours_launches(case):
            tunes["ours"] += len(configs) if len(configs) > 1 else 0
            for c in configs:
                if (key, c) not in seen:
                    seen.add((key, c))
                    compiles["ours"] += 1
        if fla_configs:
            tunes["fla"] += fla_configs
            for c in range(fla_configs):
                if (fla_key(case), c) not in seen:
                    seen.add((fla_key(case), c))
                    compiles["fla"] += 1
    measures = len(cases) * (2 if fla_configs else 1)
    shapes = len({c.shape for c in cases})
    seconds = (STARTUP_S + COMPILE_S * sum(compiles.values()) + TUNE_S * sum(tunes.values())
               + MEASURE_S * measures + SHAPE_S * shapes)
    return {"cases": len(cases), "shapes": shapes, "compiles": compiles, "tune_benchmarks": tunes,
            "measurements": measures, "seconds": seconds}


def sweep_estimate(shapes) -> dict:
    """The same for ``--sweep``: every config compiled per specialization (K, V, and the forward's
    ``NARROW_V``), timed per shape and direction."""
    n = len(tuning.ALL_CONFIGS)
    fwd_keys = {(s.K, s.V, tuning.narrow_v(tuning.launch_bucket(s.N, s.H, s.K, s.V))) for s in shapes}
    bwd_keys = {(s.K, s.V) for s in shapes}
    compiles = n * (len(fwd_keys) + len(bwd_keys))
    measures = 2 * n * len(shapes)
    return {"configs": n, "compiles": compiles, "measurements": measures,
            "seconds": STARTUP_S + COMPILE_S * compiles + MEASURE_S * measures + SHAPE_S * len(shapes)}


def format_plan(cases: list[Case], est: dict) -> str:
    """The cases with their unique bytes, floors at ``COPY_TBPS_GUESS`` and pieces, then ``est``."""
    lines = [f"{'case':58s} {'MB':>8s} {'floor ms':>9s} {'pieces':>6s}"]
    for c in cases:
        total = sum(unique_bytes(c).values())
        lines.append(f"{c.label:58s} {total / 1e6:8.1f} {total / (COPY_TBPS_GUESS * 1e9):9.3f} {case_pieces(c):6d}")
    lines.append(f"(floors at {COPY_TBPS_GUESS} TB/s, an H200's copy bandwidth; the run measures its own)")
    lines.append(f"estimate: {est}")
    return "\n".join(lines)
