"""Chapter 11's figures: the three steps of sequence pieces (``chunkstate.pieces``), and how one
launch runs them.

A sequence is cut into pieces of whole splits (here 4 pieces of 4 chunks). Three rows, one per step:

1. every piece runs from a zero state, storing nothing: its final state ``f_p`` and its total decay
   ``d_p`` (log2: its chunks' Γ summed; ``d_{v,p}`` on the value side), all pieces in parallel;
2. a short scan per (sequence, head) hands each piece its true initial state,
   ``h_0 = h0``, ``h_{p+1} = diag(2^{d_p}) h_p diag(2^{d_{v,p}}) + f_p``; the last is ``ht``;
3. every piece runs again from ``h_p``, storing its states h[n] where the unsplit run would.

(``chunkstate.pieces`` writes ``F_p``, ``D_p``, ``S_p`` for ``f_p``, ``d_p``, ``h_p``.) The labels
use the piece index p = 0, 1, …; ``boundaries`` is the pure function that places the pieces.

The second figure is the one launch that runs the three steps (the kernels' ``LOOK_BACK``) as a
timeline of its programs, one per piece: walk 0 from zero, publishing ``f_p`` and ``d_p`` behind a
flag (not the last piece: nothing reads it), the fold of every earlier piece's contribution once its
flag is set, walk 1 from the true start, storing. ``one_launch_schedule`` is the pure function that
times it, in chunk steps, idealised: every step one unit, every program started at once.
"""
from __future__ import annotations

from . import save


def boundaries(n_pieces: int, chunks_per_piece: int) -> list[int]:
    """Where the pieces start and end, in chunks: ``[0, c, 2c, …, n_pieces·c]``. ValueError for a
    count or a length under 1."""
    if n_pieces < 1 or chunks_per_piece < 1:
        raise ValueError(f"need n_pieces, chunks_per_piece >= 1, got {n_pieces}, {chunks_per_piece}")
    return [p * chunks_per_piece for p in range(n_pieces + 1)]


def draw(n_pieces: int = 4, chunks_per_piece: int = 4):
    """The three steps as three rows over one sequence of ``n_pieces · chunks_per_piece`` chunks.

    Row 1: a box per piece, from a zero state to ``f_p``, ``d_p``. Row 2: the scan, a point per
    piece boundary (``h_0 = h0`` … ``h_P = ht``) and an arrow per piece. Row 3: a box per piece
    starting from ``h_p``, with a marker at every stored state h[n], the state entering chunk n (one
    per chunk here: split = BT).
    """
    import matplotlib.pyplot as plt
    from matplotlib.patches import FancyArrowPatch, Rectangle

    edges = boundaries(n_pieces, chunks_per_piece)
    end = edges[-1]
    fig, axes = plt.subplots(3, 1, figsize=(10.5, 6.4), sharex=True)
    titles = ("1. every piece from a zero state, no states stored (all pieces in parallel): "
              "its final state $f_p$ and its decay $d_p$ (log2, its chunks' $\\Gamma$ summed)",
              "2. a short scan, per (sequence, head): "
              "$h_{p+1} = \\mathrm{diag}(2^{d_p})\\, h_p\\, \\mathrm{diag}(2^{d_{v,p}}) + f_p$, "
              "from $h_0$ = h0; the last is ht",
              "3. every piece again from $h_p$ (all in parallel), storing its states h[n] "
              "where the unsplit run would")
    for ax, title in zip(axes, titles):
        ax.set_title(title, fontsize=9, loc="left")
        ax.set_ylim(0, 1)
        ax.set_yticks([])
        for side in ("top", "right", "left"):
            ax.spines[side].set_visible(False)
    step1, step2, step3 = axes
    for p in range(n_pieces):
        a, b = edges[p], edges[p + 1]
        colour = f"C{p % 10}"
        step1.add_patch(Rectangle((a + 0.08, 0.25), b - a - 0.16, 0.5, facecolor=colour, alpha=0.3,
                                  edgecolor="k", lw=0.8))
        step1.text(a + 0.25, 0.5, "0", ha="left", va="center", fontsize=10)
        step1.text(b - 0.25, 0.5, f"$f_{p}$, $d_{p}$", ha="right", va="center", fontsize=10)
        step1.annotate("", xy=(b - 1.3, 0.5), xytext=(a + 0.7, 0.5),
                       arrowprops=dict(arrowstyle="->", color="0.3", lw=1))
        step3.add_patch(Rectangle((a + 0.08, 0.25), b - a - 0.16, 0.5, facecolor=colour, alpha=0.6,
                                  edgecolor="k", lw=0.8))
        step3.text(a + 0.25, 0.6, f"from $h_{p}$", ha="left", va="center", fontsize=10)
        step3.plot(list(range(a, b)), [0.36] * (b - a), "v", color="k", ms=6)  # h[n] enters chunk n
        step2.add_patch(FancyArrowPatch((a + 0.15, 0.45), (b - 0.15, 0.45), connectionstyle="arc3,rad=-0.35",
                                        arrowstyle="-|>", mutation_scale=12, color=colour, lw=1.5))
        step2.text((a + b) / 2, 0.9, f"$+\\,f_{p}$", ha="center", va="center", fontsize=9)
    for p, x in enumerate(edges):
        step2.plot([x], [0.45], "o", color="k", ms=6)
        name = " = h0" if p == 0 else " = ht" if p == n_pieces else ""
        step2.text(x, 0.12, f"$h_{{{p}}}${name}", ha="center", va="center", fontsize=10)
    step3.set_xlim(-0.6, end + 0.6)
    step3.set_xticks(edges)
    step3.set_xlabel(f"chunks of one sequence: {n_pieces} pieces of {chunks_per_piece} chunks "
                     "(each piece a whole number of splits)")
    fig.tight_layout()
    return fig


def one_launch_schedule(n_pieces: int, chunks_per_piece: int, reverse: bool = False,
                        fold_steps: float = 0.5) -> list[dict]:
    """The one launch's programs, one per piece (in time order), in chunk steps: every step one unit,
    a fold ``fold_steps`` long, every program started at step 0 (the tickets hand the pieces out in
    order, in reverse for the backward). Per piece a dict: ``walk0`` (start, end), or None for the
    piece whose contribution nothing reads (the last; with ``reverse``, the first); ``folds``, the
    pieces whose contributions it folds into its start, in the fold's order (those before it; after
    it, nearest last, with ``reverse``); ``wait`` (start, end): from the end of its walk 0 (or step
    0) until every piece it folds has published; ``fold`` (start, end), empty where it folds none;
    ``walk1`` (start, end), from its true start, storing its states."""
    boundaries(n_pieces, chunks_per_piece)  # the same checks
    c = chunks_per_piece
    reads = [p > 0 if reverse else p < n_pieces - 1 for p in range(n_pieces)]  # someone folds piece p
    published = {p: c for p in range(n_pieces) if reads[p]}  # every walk 0 runs from step 0
    rows = []
    for p in range(n_pieces):
        folds = list(range(n_pieces - 1, p, -1)) if reverse else list(range(p))
        ready = c if reads[p] else 0
        start = max([ready] + [published[q] for q in folds])
        fold_end = start + (fold_steps if folds else 0)
        rows.append(dict(piece=p, walk0=(0, c) if reads[p] else None, folds=folds, wait=(ready, start),
                         fold=(start, fold_end), walk1=(fold_end, fold_end + c)))
    return rows


def draw_one_launch(n_pieces: int = 4, chunks_per_piece: int = 4):
    """The forward's one launch over one sequence of ``n_pieces · chunks_per_piece`` chunks, as the
    timeline of ``one_launch_schedule``: a row per piece's program (walk 0 and the flag it sets, the
    wait, the fold naming the contributions it reads, walk 1 with a marker per stored state), and
    below, one pass over the whole sequence for scale."""
    import matplotlib.pyplot as plt
    from matplotlib.patches import Rectangle

    rows = one_launch_schedule(n_pieces, chunks_per_piece)
    whole = n_pieces * chunks_per_piece
    fig, ax = plt.subplots(figsize=(10.5, 0.95 * n_pieces + 2.2))
    y_of = {r["piece"]: n_pieces - r["piece"] for r in rows}  # piece 0 on top; one pass at y = 0
    for r in rows:
        p, y, colour = r["piece"], y_of[r["piece"]], f"C{r['piece'] % 10}"
        if r["walk0"]:
            a, b = r["walk0"]
            ax.add_patch(Rectangle((a, y - 0.3), b - a, 0.6, facecolor=colour, alpha=0.3, edgecolor="k", lw=0.8))
            ax.text(a + 0.15, y, f"walk 0: from 0 to $f_{p}$, $d_{p}$", ha="left", va="center", fontsize=9)
            ax.plot([b], [y + 0.3], "v", color="k", ms=7)  # its flag, set after the stores
            if p == rows[0]["piece"]:
                ax.text(b, y + 0.42, "its flag", ha="center", va="bottom", fontsize=8)
        a, b = r["wait"]
        if b > a:
            ax.add_patch(Rectangle((a, y - 0.3), b - a, 0.6, facecolor="none", edgecolor="0.5", hatch="///", lw=0.8))
            ax.text((a + b) / 2, y, f"waits for the flags of {', '.join(f'$f_{q}$' for q in r['folds'])}",
                    ha="center", va="center", fontsize=9, color="0.2", backgroundcolor="w")
        a, b = r["fold"]
        if b > a:
            ax.add_patch(Rectangle((a, y - 0.3), b - a, 0.6, facecolor="0.3", edgecolor="k", lw=0.8))
            ax.text(a, y - 0.36, f"fold: $h_{p}$ = h0 carried through {', '.join(f'$f_{q}$' for q in r['folds'])}",
                    ha="left", va="top", fontsize=8)
        a, b = r["walk1"]
        ax.add_patch(Rectangle((a, y - 0.3), b - a, 0.6, facecolor=colour, alpha=0.65, edgecolor="k", lw=0.8))
        start = "$h_0$ = h0" if not r["folds"] else f"$h_{p}$"
        ax.text(a + 0.15, y + 0.1, f"walk 1: from {start}, storing", ha="left", va="center", fontsize=9)
        ax.plot([a + i + 0.5 for i in range(int(b - a))], [y - 0.18] * int(b - a), "|", color="k", ms=6)
    ax.add_patch(Rectangle((0, -0.3), whole, 0.6, facecolor="0.85", edgecolor="k", lw=0.8))
    ax.text(0.15, 0, "one pass over the whole sequence, for scale", ha="left", va="center", fontsize=9)
    end = max(r["walk1"][1] for r in rows)
    ax.axvline(end, color="k", ls=":", lw=1)
    ax.set_yticks([0] + [y_of[p] for p in range(n_pieces)])
    ax.set_yticklabels(["one pass"] + [f"piece {p} (ticket {p})" for p in range(n_pieces)])
    ax.set_ylim(-0.7, n_pieces + 0.8)
    ax.set_xlim(0, whole + 0.5)
    ax.set_xlabel(f"time, in chunk steps (schematic: every step one unit, every program started at once; dark: the "
                  f"fold): {n_pieces} pieces end after two walks and a fold, one pass after {whole}")
    ax.set_title("The three steps in one launch (forward, one head, one state tile; the backward mirrors it, the first "
                 "piece skipping walk 0)", fontsize=9, loc="left")
    for side in ("top", "right"):
        ax.spines[side].set_visible(False)
    fig.tight_layout()
    return fig


def main(out_dir):
    return [save(draw(), "pieces_steps.png", out_dir), save(draw_one_launch(), "pieces_one_launch.png", out_dir)]
