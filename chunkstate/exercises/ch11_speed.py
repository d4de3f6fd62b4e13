"""Chapter 11 exercises: the bytes a call must move, and how a long sequence is cut into pieces.

1. ``forward_bytes(B, T, H, D, gate, state_bytes, split_size, lens) -> int``: the unique bytes of
   one ``chunk_fwd_h`` call with K = V = D, no h0 and no ht — every tensor it must touch once:

   - reads ``k`` and ``v`` [B, T, H, D] in bf16 (2 bytes an element);
   - reads the gate in fp32 (4 bytes): ``gate="g"`` is [B, T, H], ``gate="gk"`` is [B, T, H, D];
   - writes one state [D, D] per split of every (sequence, head), ``state_bytes`` an element
     (2: bf16, 4: fp32); a sequence of L tokens has ``ceil(L / split_size)`` splits.

   ``lens`` (a tuple of sequence lengths, or None) makes it a packed batch: B = 1, T = Σ lens,
   and every sequence counts its own splits (an empty one none). The checker compares your count
   with the benchmark's byte model, ``chunkstate.bench.unique_bytes``, on dense and packed shapes.

2. ``piece_plan(lengths, BS, pieces) -> (cu_pieces, seq_pieces)``: the plan of
   ``chunkstate.pieces`` for cutting sequences into pieces that run in parallel. All pieces share
   one length ``P_len``: the longest sequence divided by ``pieces``, rounded up to a whole number
   of splits (a multiple of ``BS``), and at least ``BS``. Each sequence is cut every ``P_len``
   tokens (its last piece may be shorter; an empty sequence gets no piece). Return
   ``cu_pieces``, the offsets of all pieces packed along T (``[0, end of piece 0, ...]``, a list of
   NP + 1 ints), and ``seq_pieces``, the index of each sequence's first piece (N + 1 ints, the
   last one NP). The checker compares with ``chunkstate.pieces.plan`` and checks what the plan
   must guarantee: pieces tile each sequence and start on split boundaries.
"""
from __future__ import annotations

from ..bench.model import Case, Shape, unique_bytes
from ..pieces import plan

BYTES_CASES = [  # (B, T, H, D, gate, state_bytes, split_size, lens)
    (8, 4096, 16, 128, "g", 2, 64, None),          # the chapter's shape: 539 MB
    (1, 65536, 4, 128, "gk", 4, 256, None),         # per-key gate, fp32 states, splits of 256
    (2, 100, 3, 48, "g", 2, 64, None),              # a ragged last split
    (1, 1, 1, 16, "gk", 4, 64, None),               # one token
    (1, 5000, 2, 64, "g", 2, 128, (0, 1, 63, 64, 65, 4807)),   # packed: empty, one-token, ragged
    (1, 700, 5, 32, "gk", 4, 64, (300, 0, 400)),
]
PLAN_CASES = [  # (lengths, BS, pieces)
    ([65536], 64, 17),
    ([131072], 64, 4),
    ([1000, 0, 5000, 64, 1], 64, 3),
    ([100], 64, 8),            # more pieces than splits: pieces of one split
    ([4096, 4096], 256, 5),    # the common length rounds up to whole splits
    ([641, 5], 64, 10),        # 64.1 tokens a piece: rounds up to two splits, not down to one
    ([0, 0], 64, 2),           # nothing to cut
    ([], 64, 3),
]


def forward_bytes(B, T, H, D, gate="g", state_bytes=2, split_size=64, lens=None):
    """The shipped solution of exercise 1 (module docstring)."""
    tokens = B * T * H
    kv = 2 * tokens * D * 2  # k and v, bf16
    gate_bytes = tokens * 4 * (D if gate == "gk" else 1)
    lengths = list(lens) if lens is not None else [T] * B
    splits = sum(-(-L // split_size) for L in lengths)
    return kv + gate_bytes + splits * H * D * D * state_bytes


# The shipped solution of exercise 2 is the package's own plan: read it in chunkstate/pieces.py.
piece_plan = plan


def check_forward_bytes(fn=None) -> None:
    """Compare ``fn`` (default: the shipped solution) with ``bench.unique_bytes`` on every case.

    Raises ``AssertionError`` naming the case and both counts; an exception raised inside ``fn``
    (such as ``NotImplementedError``) propagates unchanged.
    """
    fn = forward_bytes if fn is None else fn
    name = getattr(fn, "__name__", "your function")
    for B, T, H, D, gate, state_bytes, split, lens in BYTES_CASES:
        case = Case(Shape(B, T, H, D, lens=lens), "fwd", gate=gate, states={2: "bf16", 4: "fp32"}[state_bytes],
                    split=split)
        parts = unique_bytes(case)
        want = sum(parts.values())
        got = fn(B, T, H, D, gate=gate, state_bytes=state_bytes, split_size=split, lens=lens)
        if isinstance(got, bool) or not isinstance(got, int):
            raise AssertionError(f"{name} must return an int (bytes), got {type(got).__name__} for {case.label}")
        if got != want:
            raise AssertionError(f"{name}: {got:,} bytes for {case.label} (split {split}), expected {want:,} "
                                 f"= " + " + ".join(f"{k} {v:,}" for k, v in parts.items()))
    print(f"{name} agrees with the benchmark's byte model on {len(BYTES_CASES)} cases")


def check_piece_plan(fn=None) -> None:
    """Compare ``fn`` (default: the shipped solution) with ``chunkstate.pieces.plan`` on every
    case, and check that the pieces tile each sequence on split boundaries.

    Raises ``AssertionError`` naming the case; an exception raised inside ``fn`` (such as
    ``NotImplementedError``) propagates unchanged.
    """
    fn = piece_plan if fn is None else fn
    name = getattr(fn, "__name__", "your function")
    for lengths, BS, P in PLAN_CASES:
        where = f"lengths={lengths}, BS={BS}, pieces={P}"
        out = fn(list(lengths), BS, P)
        if not (isinstance(out, tuple) and len(out) == 2):
            raise AssertionError(f"{name} must return a tuple (cu_pieces, seq_pieces), got {type(out).__name__}")
        try:
            cu, seq = ([int(x) for x in part] for part in out)
        except (TypeError, ValueError):
            raise AssertionError(f"{name} must return two lists of ints (cu_pieces, seq_pieces), got {out!r:.80}") \
                from None
        starts = [0]
        for L in lengths:
            starts.append(starts[-1] + L)
        if seq[:1] != [0] or len(seq) != len(lengths) + 1 or seq[-1] != len(cu) - 1:
            raise AssertionError(f"{name}: seq_pieces {seq} must have N + 1 = {len(lengths) + 1} entries from 0 "
                                 f"to the number of pieces ({where})")
        for n, L in enumerate(lengths):  # the pieces of sequence n tile its tokens on split boundaries
            ends = cu[seq[n]:seq[n + 1] + 1]
            if L == 0 and len(ends) > 1:
                raise AssertionError(f"{name}: the empty sequence {n} owns pieces {ends} ({where})")
            if L and (ends[0] != starts[n] or ends[-1] != starts[n + 1]):
                raise AssertionError(f"{name}: the pieces of sequence {n} span {ends[0]}..{ends[-1]}, "
                                     f"its tokens are {starts[n]}..{starts[n + 1]} ({where})")
            if any((a - starts[n]) % BS for a in ends[:-1]):
                raise AssertionError(f"{name}: a piece of sequence {n} starts off a split boundary: {ends} ({where})")
        want_cu, want_seq = plan(list(lengths), BS, P)
        if (cu, seq) != (want_cu, want_seq):
            raise AssertionError(f"{name}: got cu_pieces={cu}, seq_pieces={seq}; chunkstate.pieces.plan gives "
                                 f"{want_cu}, {want_seq} ({where})")
    print(f"{name} agrees with chunkstate.pieces.plan on {len(PLAN_CASES)} cases")
