"""Chapter 10's figure: how ``gla.intra_attention`` fills the intra-chunk matrix by halving.

Each entry ``P_ij`` (j < i) of a chunk's lower triangle is computed at exactly one level: the
level whose block of 2·half tokens holds both tokens with ``i`` in its second half and ``j`` in its
first, i.e. ``half`` = the highest power of two in ``i XOR j``. Its decay goes through ``r``, the
last token of that first half: ``2^{G_i − G_r} · 2^{G_r − G_j}`` (``G`` the chunk-local cumsum in
log2 units), both factors <= 1. The diagonal needs no decay.
"""
from __future__ import annotations

from . import save


def level_of(i: int, j: int) -> int:
    """The width ``half`` of the level that computes ``P_ij`` (j < i); 0 on the diagonal."""
    return 0 if i == j else 1 << ((i ^ j).bit_length() - 1)


def draw(BT: int = 16):
    """The chunk's BT × BT matrix coloured by level, one reference token marked per quadrant."""
    import matplotlib.pyplot as plt
    import numpy as np
    from matplotlib.colors import ListedColormap

    halves = [1 << n for n in range(BT.bit_length() - 2, -1, -1)]  # BT/2, ..., 1
    code = {0: 0, **{h: n + 1 for n, h in enumerate(halves)}}
    M = np.full((BT, BT), np.nan)
    for i in range(BT):
        for j in range(i + 1):
            M[i, j] = code[level_of(i, j)]
    colors = ["#444444"] + [plt.get_cmap("viridis")(x) for x in np.linspace(0.15, 0.9, len(halves))]
    fig, ax = plt.subplots(figsize=(6.4, 5.6))
    ax.imshow(M, cmap=ListedColormap(colors), vmin=-0.5, vmax=len(halves) + 0.5)
    for h in halves:  # the reference token r of each quadrant at this level: the first half's last token
        for start in range(0, BT, 2 * h):
            r = start + h - 1
            ax.plot(r, start + h - 0.5 + h / 2, marker="v", color="white", ms=5 if h > 1 else 3)
    for n, h in enumerate(halves):
        blocks = BT // (2 * h)
        ax.plot([], [], "s", color=colors[n + 1], ms=10,
                label=f"half = {h}: {blocks} block{'s' if blocks > 1 else ''}, one batched matmul")
    ax.plot([], [], "s", color=colors[0], ms=10, label="diagonal: q_i · k_i, no decay")
    ax.plot([], [], "v", color="gray", ms=6, label="column of r, the first half's last token")
    ax.set(xlabel="key token j", ylabel="query token i", xticks=range(0, BT, 2), yticks=range(0, BT, 2),
           title=f"P inside one chunk (BT = {BT}): each entry at one level of halving")
    ax.legend(loc="upper right", fontsize=7.5, frameon=True)
    fig.tight_layout()
    return fig


def main(out_dir):
    return [save(draw(), "intra_halving.png", out_dir)]
