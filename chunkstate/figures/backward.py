"""Chapters 08–09's figure: the backward scan beside the forward one.

Top: a sequence in chunks grouped into splits; the forward stores ``h[m]`` where split m *starts*,
the backward walks from ``dht`` to ``dh0`` and stores ``dh[m]`` where it *ends* — and where
fla-core 0.6.0 stores it instead when ``split_size > chunk_size`` (the end of the split's first
chunk). Bottom: the weight a token gets inside its chunk: ``2^{Γ − G_t}`` on its key in the
forward, ``2^{G_t}`` on its query in the backward (``G`` the chunk-local cumsum in log2 units).

Figure data come from a fixed generator so the committed file does not change between redraws.
"""
from __future__ import annotations

import torch

from . import save
from ..gates import chunk_local_cumsum


def draw(T: int = 160, BT: int = 32, BS: int = 64):
    """Both panels (see the module docstring); returns the matplotlib figure."""
    import matplotlib.pyplot as plt
    from matplotlib.patches import FancyArrowPatch, Rectangle

    starts = list(range(0, T, BT))
    split_starts = list(range(0, T, BS))
    fig, (ax1, ax2) = plt.subplots(2, 1, figsize=(11, 6.4), sharex=True,
                                   gridspec_kw=dict(height_ratios=[1.5, 1]))
    for n, s in enumerate(starts):
        e = min(s + BT, T)
        ax1.add_patch(Rectangle((s, 0), e - s, 1, facecolor=f"C{(n * BT // BS) % 10}", alpha=0.22, edgecolor="k"))
        ax1.text((s + e) / 2, 0.5, f"chunk {n}", ha="center", va="center", fontsize=8)
    for m, s in enumerate(split_starts):
        e = min(s + BS, T)
        ax1.plot([s], [1.55], "o", color="C0", ms=7)  # forward: stored where the split starts
        ax1.text(s, 1.85, f"h[{m}]", ha="center", fontsize=9, color="C0")
        ax1.add_patch(FancyArrowPatch((s + 2, 1.55), (e - 2, 1.55), arrowstyle="-|>", mutation_scale=10,
                                      color="C0", connectionstyle="arc3,rad=-0.3"))
        ax1.plot([e], [-0.55], "o", color="C1", ms=7)  # backward: stored where the split ends
        ax1.text(e, -1.0, f"dh[{m}]", ha="center", fontsize=9, color="C1")
        ax1.add_patch(FancyArrowPatch((e - 2, -0.55), (s + 2, -0.55), arrowstyle="-|>", mutation_scale=10,
                                      color="C1", connectionstyle="arc3,rad=-0.3"))
        first_end = min(s + BT, T)
        if first_end < e:  # fla 0.6.0 stores dh leaving the split's *first* chunk
            ax1.plot([first_end], [-0.55], "x", color="crimson", ms=9, mew=2)
    ax1.text(T + 3, -0.55, "dht", va="center", fontsize=9, color="C1")
    ax1.text(-3, -0.55, "dh0", va="center", ha="right", fontsize=9, color="C1")
    ax1.plot([], [], "x", color="crimson", ms=9, mew=2, label="where fla-core 0.6.0 stores dh[m] (wrong)")
    ax1.plot([], [], "o", color="C0", label="forward: h[m], the state entering split m")
    ax1.plot([], [], "o", color="C1", label="backward: dh[m], the gradient leaving split m")
    ax1.legend(loc="lower center", fontsize=8, ncol=3, frameon=False)
    ax1.set_ylim(-1.9, 2.5)
    ax1.set_yticks([])
    ax1.set_title(f"T = {T}, chunks of BT = {BT}, splits of BS = {BS}: slot m serves split m from both sides",
                  fontsize=10)
    for side in ("top", "right", "left"):
        ax1.spines[side].set_visible(False)

    gen = torch.Generator().manual_seed(0)
    g = torch.nn.functional.logsigmoid(torch.randn(1, T, 1, generator=gen)) / 6
    G = chunk_local_cumsum(g, BT, dtype=torch.float64)[0, :, 0]  # log2 units
    w_fwd = torch.empty(T, dtype=torch.float64)
    for s in starts:
        e = min(s + BT, T)
        w_fwd[s:e] = torch.exp2(G[e - 1] - G[s:e])
    t = torch.arange(T).numpy()
    ax2.step(t, w_fwd.numpy(), where="mid", color="C0", label=r"forward: key $k_t$ weighted by $2^{\Gamma - G_t}$")
    ax2.step(t, torch.exp2(G).numpy(), where="mid", color="C1",
             label=r"backward: query $q_t$ weighted by $2^{G_t}$")
    for s in starts[1:]:
        ax2.axvline(s, color="gray", lw=0.6, ls=":")
    ax2.set(xlabel="token t", ylabel="weight", ylim=(0, 1.35), yticks=[0, 0.25, 0.5, 0.75, 1],
            title="inside a chunk (scalar gate): each token's weight in the chunk's matmul, all in (0, 1]")
    ax2.legend(loc="upper center", fontsize=8, ncol=2, frameon=False)
    ax2.grid(True, axis="y", alpha=0.3)
    ax2.set_xlim(-8, T + 10)
    fig.tight_layout()
    return fig


def main(out_dir):
    return [save(draw(), "backward_scan.png", out_dir)]
