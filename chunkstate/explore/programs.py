"""The program map: what each program of a ``chunk_fwd_h`` / ``chunk_bwd_dh`` launch does, computed by
the kernels' own ``@triton.jit`` parts.

``program_map_kernel`` runs over the very grid the state kernels launch, ``cdiv(K, BK)·cdiv(V, BV)·N·H``
programs, and decides its work with the very calls they make: ``kernel_parts.program_tile`` (which
(sequence, head) and which [BK, BV] tile) and ``kernel_parts.sequence_bounds`` (where its sequence
lies and its first state slot). Instead of walking the chunks it stores what it found, one row per
program. So a change to the kernels' indexing changes the map, and ``tests/test_explore.py`` holds
the map to what the real kernels write: every state element the map says a program stores is
exactly an element the NaN-poisoned real output has filled.

With ``pieces > 1`` the map is taken of the programs that store the states (the third step of
``chunkstate.pieces``: in one launch, every program's second walk), over the pieces packed as
``pieces.run`` packs them; the bytes of the walks from zero are counted beside them, as the call
runs them (one launch, or three: ``ProgramMap.first_walk_bytes``).

The bytes of a row follow a simple model (``ProgramMap`` docstring): each program reads each of its
tokens' rows of its tile's columns once. With one tile per (sequence, head) the rows add up to
``chunkstate.bench.model.unique_bytes``; with several V tiles every one of them reads the same k
(and with several K tiles, the same v): the picture's point.
"""
from __future__ import annotations

import numbers
from dataclasses import dataclass, field

import torch
import triton
import triton.language as tl

from .. import _host, launch, tuning
from .. import pieces as _pieces
from ..env import DEVICE, check_interpreter
from ..kernel_parts import program_tile, sequence_bounds

# What each program stores, one int64 per column, in this order.
COLUMNS = ("i_nh", "i_n", "i_h", "i_k", "i_v", "bos", "length", "boh", "chunks", "slots")
GATES = ("g", "g_gamma", "gk", "gv")


@triton.jit(do_not_specialize=["T"])
def program_map_kernel(
    cu_seqlens,  # [N + 1] packed-batch offsets (IS_VARLEN)
    split_offsets,  # [N + 1] first split slot of each packed sequence (IS_VARLEN)
    out,  # [programs, NCOL] int64  out: one row per program, COLUMNS
    T,
    H: tl.constexpr,
    K: tl.constexpr,
    V: tl.constexpr,
    BT: tl.constexpr,
    BS: tl.constexpr,
    BK: tl.constexpr,
    BV: tl.constexpr,
    IS_VARLEN: tl.constexpr,
    NCOL: tl.constexpr,
):
    # the state kernels' first two lines, as they are
    i_nh, i_n, i_h, i_k, i_v = program_tile(H, K, V, BK, BV)
    bos, T, boh = sequence_bounds(i_n, T, cu_seqlens, split_offsets, BS, IS_VARLEN, True)
    # their chunk loop stores a state at every chunk i_t that opens a split (forward; the backward:
    # that closes one), at slot boh + i_t // (BS // BT): one slot per split, cdiv(T, BS) in all
    NT = tl.cdiv(T, BT)
    CHUNKS_PER_SPLIT: tl.constexpr = BS // BT
    n_slots = tl.cdiv(NT, CHUNKS_PER_SPLIT)
    row = out + tl.program_id(0).to(tl.int64) * NCOL
    tl.store(row + 0, i_nh.to(tl.int64))
    tl.store(row + 1, i_n.to(tl.int64))
    tl.store(row + 2, i_h.to(tl.int64))
    tl.store(row + 3, i_k.to(tl.int64))
    tl.store(row + 4, i_v.to(tl.int64))
    tl.store(row + 5, bos.to(tl.int64))
    tl.store(row + 6, T.to(tl.int64))
    tl.store(row + 7, boh.to(tl.int64))
    tl.store(row + 8, NT.to(tl.int64))
    tl.store(row + 9, n_slots.to(tl.int64))


@dataclass
class ProgramMap:
    """One launch's programs, one dict per program in ``rows`` (in program-id order):

    - ``pid``: the program id; ``seq``, ``head``: its (sequence, head) (the KV head in the
      backward); ``i_k``, ``i_v``: its tile; ``piece``: which piece of its sequence (0 without pieces);
    - ``bos``, ``length``: the first token it walks, on the packed token axis (a dense batch's row b
      starting at b·T), and how many; ``chunks``: ``cdiv(length, BT)``;
    - ``first_slot``, ``slots``: the state slots it stores, ``first_slot .. first_slot + slots - 1``
      of ``h.view(B·NS, ...)`` (``dh`` in the backward), each a [BK, BV] tile of head ``head``;
    - ``k0``, ``k1``, ``v0``, ``v1``: the state rows and columns of its tile (clipped to K, V);
    - ``bytes_read``, ``bytes_written``: the model's bytes of the walk that stores the states (below);
    - ``first_walk_read``, ``first_walk_written``: those of the walk from zero over the same piece
      and tile (with pieces; 0 where there is none).

    The bytes model: a program reads each of its tokens once, only its tile's columns: forward
    k [BK] and v [BV] (``dtype``), the gates it is given (``gate_dtype``: g one value, gk [BK],
    gv [BV]; g_gamma's single number is not counted), h0's tile if given; it writes ``slots`` state
    tiles (``states_dtype``) and ht's tile (fp32) if asked. The backward reads q [BK] and do [BV]
    of each of its HQ / H query heads, the gates, dht's tile; writes dh's tiles and dh0's (fp32). The
    re-reads of each chunk's last gate row are not counted (they hit the cache). With
    ``pieces > 1`` the rows' ``bytes_read`` / ``bytes_written`` are the walk that stores the states,
    and the walk from zero, which reads the same inputs again and writes one fp32 tile, the piece's
    contribution (its decays, a row of the tile, not counted), is counted apart
    (``first_walk_read`` / ``first_walk_written``), as the call runs them:

    - **one launch** (``one_launch``: ``pieces.ONE_LAUNCH`` and no empty sequence), each program walks
      twice. Walk 0 is skipped by each sequence's last piece (in the backward, its first): nothing
      reads its contribution. Walk 1 starts from the fold: it reads the contribution tile (fp32) of
      every piece before its own (in the backward, after it; their decays not counted), and the
      sequence's first piece (in the backward, its last) reads h0's (dht's) tile if given; the
      sequence's last piece (backward: first) writes ht's (dh0's) tile if asked.
    - **three launches**: the first pass walks every piece; the storing pass reads each piece's
      start (fp32) that the scan wrote and writes no final state. The scan between them is not
      counted.

    Attributes also hold the launch: ``direction``, B, T, H, HQ, K, V, BT, BS, BK, BV, N, NS,
    ``lengths``, ``pieces`` (1 or the count used), ``piece_offsets`` (the pieces' starts on the
    packed axis, [NP + 1]; the sequences' when not split), ``grid`` (the number of programs),
    ``one_launch`` (the pieces run as one launch; False without pieces).
    """
    direction: str
    B: int
    T: int
    H: int
    HQ: int
    K: int
    V: int
    BT: int
    BS: int
    BK: int
    BV: int
    N: int
    NS: int
    lengths: tuple[int, ...]
    pieces: int
    piece_offsets: tuple[int, ...]
    seq_offsets: tuple[int, ...]
    grid: int
    one_launch: bool = False
    rows: list[dict] = field(default_factory=list)

    def __len__(self) -> int:
        return len(self.rows)

    def __iter__(self):
        return iter(self.rows)

    def column(self, name: str) -> list:
        """One column of the table, in program order."""
        return [r[name] for r in self.rows]

    def total_bytes(self) -> dict[str, int]:
        """The rows' bytes read and written, summed (the walk that stores the states only)."""
        return {"read": sum(r["bytes_read"] for r in self.rows),
                "written": sum(r["bytes_written"] for r in self.rows)}

    def first_walk_bytes(self) -> dict[str, int]:
        """The bytes read and written by the walks from zero (0 without pieces): in one launch the
        walks 0 of all pieces but each sequence's last (backward: first), in three launches the first
        pass over every piece (``ProgramMap``'s docstring)."""
        return {"read": sum(r["first_walk_read"] for r in self.rows),
                "written": sum(r["first_walk_written"] for r in self.rows)}

    def written_slots(self) -> set[tuple[int, int]]:
        """The (slot, head) pairs some program stores a state tile of, slots counted over B·NS."""
        return {(s, r["head"]) for r in self.rows for s in range(r["first_slot"], r["first_slot"] + r["slots"])}

    def waves(self, sms: int) -> int:
        """How many waves of ``sms`` programs the grid is, at one program per multiprocessor."""
        return _host.cdiv(self.grid, sms)

    def to_pandas(self):
        """The rows as a ``pandas.DataFrame`` (pandas is not a dependency: ImportError without it)."""
        import pandas as pd

        return pd.DataFrame(self.rows)

    def summary(self) -> str:
        tot, first = self.total_bytes(), self.first_walk_bytes()
        split = f", {self.pieces} pieces" if self.pieces > 1 else ""
        return (f"{self.direction}: {self.grid} programs = {_host.cdiv(self.K, self.BK)}·{_host.cdiv(self.V, self.BV)}"
                f" tiles x {self.N if self.pieces == 1 else len(self.piece_offsets) - 1}"
                f" {'sequences' if self.pieces == 1 else 'pieces'} x {self.H} heads{split}; "
                f"BT={self.BT} BS={self.BS} BK={self.BK} BV={self.BV}; {self.NS * self.B} state slots per head; "
                f"{tot['read']:,} bytes read, {tot['written']:,} written" + (
                    f" storing; walks from zero ({'one launch' if self.one_launch else 'three launches'}) "
                    f"{first['read']:,} read, {first['written']:,} written" if self.pieces > 1 else ""))

    def __repr__(self) -> str:
        return f"ProgramMap({self.summary()})"


def _size(name: str, x, least: int = 0) -> int:
    if isinstance(x, bool) or not isinstance(x, numbers.Integral) or x < least:
        raise ValueError(f"{name} must be an int >= {least}, got {x!r}")
    return int(x)


def _offsets(cu_seqlens, device):
    """``cu_seqlens`` as the kernels take it: a list or tuple of ints becomes an int32 tensor."""
    if cu_seqlens is None or isinstance(cu_seqlens, torch.Tensor):
        return cu_seqlens if cu_seqlens is None else cu_seqlens.to(device)
    if isinstance(cu_seqlens, (list, tuple)) and all(isinstance(c, numbers.Integral) and not isinstance(c, bool)
                                                     for c in cu_seqlens):
        return torch.tensor(list(cu_seqlens), dtype=torch.int32, device=device)
    raise TypeError(f"cu_seqlens must be None, a 1-D int tensor or a list of ints, got {type(cu_seqlens).__name__}")


def _element_size(name: str, dtype) -> int:
    if not isinstance(dtype, torch.dtype):
        raise TypeError(f"{name} must be a torch.dtype, got {dtype!r}")
    return torch.empty((), dtype=dtype).element_size()


def program_map(B: int, T: int, H: int, K: int, V: int, *, cu_seqlens=None, chunk_size: int = 64,
                split_size: int | None = None, pieces: int | None = 1, config: triton.Config | None = None,
                direction: str = "fwd", HQ: int | None = None, gates=(), dtype: torch.dtype = torch.bfloat16,
                gate_dtype: torch.dtype = torch.float32, states_in_fp32: bool = False, h0: bool = False,
                output_final_state: bool = False, one_launch: bool | None = None, device=None) -> ProgramMap:
    """The program map of one ``chunk_fwd_h`` (``direction="fwd"``) or ``chunk_bwd_dh`` ("bwd")
    launch, computed by ``program_map_kernel`` (module docstring).

    Args:
        B, T, H, K, V: the sizes of k [B, T, H, K] and v [B, T, H, V] (ints, no tensors needed).
        cu_seqlens, chunk_size, split_size, pieces, config: as the kernels take them; ``cu_seqlens``
            may also be a list of ints. ``pieces=None`` takes the count the kernels start from
            (``pieces.choose`` without a trial: 1 under the interpreter, the cost model's
            ``auto_pieces`` on a GPU, where a call also times the counts either side and may keep
            one of those). ``config``: the ``triton.Config`` whose
            BK, BV cut the state; default ``tuning.INTERPRETER_CONFIG`` (64 × 64; what the autotuner
            would pick on a GPU is not known without timing it).
        HQ: the backward's query heads (GQA: a multiple of H, HQ / H query heads per state head; default H).
        gates: names of the gates given, of "g", "g_gamma", "gk", "gv" (bytes only).
        dtype: the inputs' dtype; ``gate_dtype`` the gates'; ``states_in_fp32``: h / dh in fp32
            (else ``dtype``); ``h0`` / ``output_final_state``: whether h0 (backward: dh0 wanted) and
            ht (backward: dht given) are read / written (bytes only).
        one_launch: with pieces, count the bytes of the one launch (True) or of the three (False);
            default ``pieces.ONE_LAUNCH``, as the kernels run. A batch with an empty sequence takes
            the three launches either way, as ``pieces.run`` does.
        device: where the map kernel runs (default ``chunkstate.DEVICE``).
    Returns:
        a ``ProgramMap``.
    Raises:
        the kernels' own errors for bad sizes, offsets, ``pieces`` and ``config`` (``launch.problem``,
        ``pieces.choose``, ``launch.check_config``); ValueError / TypeError naming the argument
        for the rest.
    """
    if direction not in ("fwd", "bwd"):
        raise ValueError(f"direction must be 'fwd' or 'bwd', got {direction!r}")
    B, T, H, K, V = (_size(n, x) for n, x in (("B", B), ("T", T), ("H", H), ("K", K), ("V", V)))
    HQ = H if HQ is None else _size("HQ", HQ)
    if (H == 0 and HQ != 0) or (H > 0 and (HQ == 0 or HQ % H)):
        raise ValueError(f"HQ must be a positive multiple of H={H} (GQA: HQ / H query heads per state head), got HQ={HQ}")
    if isinstance(gates, str):
        gates = (gates,)
    unknown = sorted(set(gates) - set(GATES))
    if unknown:
        raise ValueError(f"gates must name some of {GATES}, got {unknown}")
    in_bytes, gate_bytes = _element_size("dtype", dtype), _element_size("gate_dtype", gate_dtype)
    state_bytes = 4 if states_in_fp32 else in_bytes
    device = torch.device(DEVICE if device is None else device)
    like = torch.zeros(0, device=device)
    p = launch.problem(like, B, T, H, K, V, _offsets(cu_seqlens, device), chunk_size, split_size, False)
    launch.check_config(config, ("USE_TMA", "NARROW_V") if direction == "fwd" else ("USE_TMA",))
    config = tuning.INTERPRETER_CONFIG if config is None else config
    BK, BV = config.kwargs["BK"], config.kwargs["BV"]
    P = _pieces.choose(pieces, p, direction, _pieces.gate_kind(**{name: True for name in gates}))

    seq_offsets = [0]
    for L in p.lengths:
        seq_offsets.append(seq_offsets[-1] + L)
    if P == 1:
        cu, first_slots, N, piece_offsets, seq_of = p.cu_seqlens, p.split_offsets, p.N, seq_offsets, list(range(p.N))
        kernel_T, varlen = T, p.cu_seqlens is not None
    else:  # as pieces.run: the pieces packed along T (a dense batch as one row), their split slots
        piece_offsets, seq_pieces = _pieces.plan(p.lengths, p.BS, P)
        cu = _host.on_device(piece_offsets, torch.int32, device)
        _, first_slots = _host.split_slots(_host.lengths(piece_offsets), p.BS, device)
        N, kernel_T, varlen = len(piece_offsets) - 1, B * T, True
        seq_of = [n for n in range(p.N) for _ in range(seq_pieces[n], seq_pieces[n + 1])]
    one = _pieces.ONE_LAUNCH if one_launch is None else bool(one_launch)
    one = P > 1 and one and min(p.lengths, default=0) > 0  # as pieces.run: an empty sequence takes three

    NK, NV = _host.cdiv(K, BK), _host.cdiv(V, BV)
    grid = NK * NV * N * H if N * H * K * V else 0
    out = torch.full((grid, len(COLUMNS)), -1, dtype=torch.int64, device=device)
    if grid:
        check_interpreter()
        with launch.serialised():
            program_map_kernel[(grid,)](cu, first_slots, out, kernel_T, H=H, K=K, V=V, BT=p.BT, BS=p.BS, BK=BK, BV=BV,
                                        IS_VARLEN=varlen, NCOL=len(COLUMNS))
    raw = out.cpu().tolist()

    group = HQ // H if H else 1
    table = ProgramMap(direction, B, T, H, HQ, K, V, p.BT, p.BS, BK, BV, p.N, p.NS, p.lengths, P,
                       tuple(piece_offsets), tuple(seq_offsets), grid, one)
    first_piece, last_piece = {}, {}
    for i_p, seq in enumerate(seq_of):
        first_piece.setdefault(seq, i_p)
        last_piece[seq] = i_p
    for pid, values in enumerate(raw):
        r = dict(zip(COLUMNS, values))
        seq = seq_of[r["i_n"]]
        k0, v0 = r["i_k"] * BK, r["i_v"] * BV
        k1, v1 = min(k0 + BK, K), min(v0 + BV, V)
        row = dict(pid=pid, seq=seq, head=r["i_h"], i_k=r["i_k"], i_v=r["i_v"], piece=r["i_n"] - first_piece[seq],
                   bos=r["bos"], length=r["length"], chunks=r["chunks"], first_slot=r["boh"], slots=r["slots"],
                   k0=k0, k1=k1, v0=v0, v1=v1)
        sizes = (group, gates, in_bytes, gate_bytes, state_bytes)
        given, wanted = (h0, output_final_state) if direction == "fwd" else (output_final_state, h0)  # h0/dht, ht/dh0
        row["first_walk_read"] = row["first_walk_written"] = 0
        if P == 1:  # h0 (dht) read, ht (dh0) written by the program itself
            row["bytes_read"], row["bytes_written"] = _bytes(direction, row, *sizes, start=given, end=wanted,
                                                             slots=True)
        elif one:  # walk 0 unless nothing reads its contribution; walk 1 from the fold of the pieces walked before
            earlier, later = r["i_n"] - first_piece[seq], last_piece[seq] - r["i_n"]
            folded, readers = (earlier, later) if direction == "fwd" else (later, earlier)  # the backward walks back
            read, written = _bytes(direction, row, *sizes, start=given and folded == 0, end=wanted and readers == 0,
                                   slots=True)
            row["bytes_read"], row["bytes_written"] = read + folded * _tile_bytes(row), written
            if readers:
                row["first_walk_read"], row["first_walk_written"] = _bytes(direction, row, *sizes, start=False,
                                                                           end=True, slots=False)
        else:  # three launches: the first pass walks every piece; the storing pass reads the scan's start
            row["bytes_read"], row["bytes_written"] = _bytes(direction, row, *sizes, start=True, end=False, slots=True)
            row["first_walk_read"], row["first_walk_written"] = _bytes(direction, row, *sizes, start=False, end=True,
                                                                       slots=False)
        table.rows.append(row)
    return table


def _bytes(direction, row, group, gates, in_bytes, gate_bytes, state_bytes, *, start, end, slots):
    """(read, written) of one program under the model of ``ProgramMap``'s docstring: its tokens'
    rows of its tile's columns, a starting state tile read (``start``, fp32), its ``slots`` state
    tiles and a final state tile (``end``, fp32) written."""
    L, bk, bv = row["length"], row["k1"] - row["k0"], row["v1"] - row["v0"]
    heads = group if direction == "bwd" else 1  # the backward's program reads its group's query heads
    read = L * heads * (bk + bv) * in_bytes
    read += L * gate_bytes * (("g" in gates) + bk * ("gk" in gates) + bv * ("gv" in gates))
    tile = _tile_bytes(row)
    written = row["slots"] * bk * bv * state_bytes if slots else 0
    return read + start * tile, written + end * tile


def _tile_bytes(row) -> int:
    """One fp32 state tile of the program's (a start, an end state, a contribution)."""
    return (row["k1"] - row["k0"]) * (row["v1"] - row["v0"]) * 4


# ---------------------------------------------------------------------------------------------
# The picture
# ---------------------------------------------------------------------------------------------

MAX_LABELS = 48  # slot numbers are written beside their markers up to this many markers


def slot_tokens(table: ProgramMap, row: dict) -> list[tuple[int, int]]:
    """(token, slot) of each state a program stores, on the packed token axis: the forward stores
    the state *entering* each split at the split's first token, the backward the gradient
    *leaving* it after the split's last token."""
    out = []
    for j in range(row["slots"]):
        if table.direction == "fwd":
            token = row["bos"] + j * table.BS
        else:
            token = row["bos"] + min((j + 1) * table.BS, row["length"])
        out.append((token, row["first_slot"] + j))
    return out


def draw_program_map(table: ProgramMap, sms: int | None = None, ax=None, title: str | None = None,
                     mark_token: int | None = None):
    """Draw a ``ProgramMap``: one horizontal bar per program (program id down, tokens across) over
    the tokens it walks, one colour per (sequence, head); black ticks where it stores a state slot
    (numbered when few); solid lines at sequence starts, dashed at piece starts; programs of an
    empty sequence (launched, walking nothing) as grey crosses. ``sms``: the GPU's multiprocessor
    count: the programs are cut into waves of ``sms`` (one program per multiprocessor at a time;
    the real number resident per multiprocessor depends on occupancy) and the title says how full
    the first wave is. ``mark_token``: a token to mark with a red line. Returns the matplotlib
    figure (``ax``'s, when given)."""
    import matplotlib.pyplot as plt
    from matplotlib.patches import Patch

    n = len(table.rows)
    if ax is None:
        fig, ax = plt.subplots(figsize=(10, min(9.0, 1.6 + 0.17 * max(n, 4))))
    else:
        fig = ax.figure
    cmap = plt.get_cmap("tab20")
    colour = lambda r: cmap((r["seq"] * table.H + r["head"]) % 20)  # noqa: E731
    busy = [r for r in table.rows if r["length"] > 0]
    ax.barh([r["pid"] for r in busy], [r["length"] for r in busy], left=[r["bos"] for r in busy], height=0.8,
            color=[colour(r) for r in busy], edgecolor="none")
    idle = [r for r in table.rows if r["length"] == 0]
    if idle:
        ax.scatter([r["bos"] for r in idle], [r["pid"] for r in idle], marker="x", color="grey", s=18, zorder=3,
                   label="program of an empty sequence")
    marks = [(tok, r["pid"], slot) for r in table.rows for tok, slot in slot_tokens(table, r)]
    if marks:
        ax.scatter([m[0] for m in marks], [m[1] for m in marks], marker="|", color="black", s=90, zorder=4,
                   linewidths=1.6)
        if len(marks) > MAX_LABELS:  # too many to number: number the first tile's programs only
            first_tile = {r["pid"] for r in table.rows if r["i_k"] == 0 and r["i_v"] == 0}
            marks = [m for m in marks if m[1] in first_tile]
        if len(marks) <= MAX_LABELS:
            for tok, pid, slot in marks:
                ax.annotate(str(slot), (tok, pid), xytext=(2, -1), textcoords="offset points", fontsize=6,
                            va="center")
    top = max(table.seq_offsets[-1], 1)
    for x in table.seq_offsets:
        ax.axvline(x, color="black", lw=0.8, alpha=0.6)
    if table.pieces > 1:
        for x in set(table.piece_offsets) - set(table.seq_offsets):
            ax.axvline(x, color="black", lw=0.8, ls="--", alpha=0.6)
    if mark_token is not None:
        ax.axvline(mark_token + 0.5, color="#C44E52", lw=1.2, ls=":")
    ax.set_xlim(-0.01 * top, top * 1.01)
    ax.set_ylim(n - 0.5, -0.5)
    ax.set_xlabel("token (packed axis: a dense batch's row b starts at b·T)")
    ax.set_ylabel("program id")
    if n <= 48:
        ax.set_yticks(range(n))
        ax.set_yticklabels([f"{r['pid']}: s{r['seq']} h{r['head']} ({r['i_k']},{r['i_v']})" for r in table.rows],
                           fontsize=6)
    wave_note = ""
    if sms:
        for w in range(1, table.waves(sms)):
            ax.axhline(w * sms - 0.5, color="red", lw=1.0)
            ax.text(top * 1.005, w * sms - 0.5, f"wave {w}", color="red", fontsize=7, va="bottom", ha="right")
        if n:
            wave_note = (f"\n{n} programs on {sms} SMs: {table.waves(sms)} wave(s)" if n > sms else
                         f"\n{n} programs on {sms} SMs: {n / sms:.0%} of one wave")
    what = "state slots stored (h entering each split)" if table.direction == "fwd" else \
        "gradients stored (dh leaving each split)"
    ax.set_title((title or f"{'chunk_fwd_h' if table.direction == 'fwd' else 'chunk_bwd_dh'}: "
                  f"{n} programs, BT={table.BT}, BS={table.BS}, tiles {table.BK}×{table.BV}"
                  + (f", {table.pieces} pieces" if table.pieces > 1 else "")) + wave_note, fontsize=9, pad=14)
    if table.N <= 12:  # each sequence named above its tokens
        for i, L in enumerate(table.lengths):
            ax.text(table.seq_offsets[i] + L / 2, 1.005, f"seq {i}" + ("" if L else " (empty)"), fontsize=7,
                    ha="center", va="bottom", transform=ax.get_xaxis_transform())
    handles = [Patch(color="black", label=f"| {what}")]
    if idle:
        handles.append(plt.Line2D([], [], marker="x", color="grey", ls="none", label="program of an empty sequence"))
    pairs = sorted({(r["seq"], r["head"]) for r in table.rows})
    if len(pairs) <= 8:
        handles += [Patch(color=cmap((s * table.H + h) % 20), label=f"sequence {s}, head {h}") for s, h in pairs]
    ax.legend(handles=handles, fontsize=7, loc="upper left", bbox_to_anchor=(1.01, 1.0), framealpha=0.9)
    return fig
