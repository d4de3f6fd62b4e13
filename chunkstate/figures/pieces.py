"""Chapter 11's figure: the three steps of sequence pieces (``chunkstate.pieces``).

A sequence is cut into pieces of whole splits (here 4 pieces of 4 chunks). Three rows, one per step:

1. every piece runs from a zero state, storing nothing: its final state ``f_p`` and its total decay
   ``d_p`` (log2: its chunks' Γ summed; ``d_{v,p}`` on the value side), all pieces in parallel;
2. a short scan per (sequence, head) hands each piece its true initial state,
   ``h_0 = h0``, ``h_{p+1} = diag(2^{d_p}) h_p diag(2^{d_{v,p}}) + f_p``; the last is ``ht``;
3. every piece runs again from ``h_p``, storing its states h[n] where the unsplit run would.

(``chunkstate.pieces`` writes ``F_p``, ``D_p``, ``S_p`` for ``f_p``, ``d_p``, ``h_p``.) The labels
use the piece index p = 0, 1, …; ``boundaries`` is the pure function that places the pieces.
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


def main(out_dir):
    return [save(draw(), "pieces_steps.png", out_dir)]
