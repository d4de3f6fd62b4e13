"""Chapter 03's figure: a sequence cut into chunks, the states stored between them, and the
chunk-local weights ``2^(Γ − G_t)`` (G in log2 units) that scale each token's key before the
chunk's matmul.

Figure data come from a fixed generator so the committed file does not change between redraws.
"""
from __future__ import annotations

import torch

from . import save
from ..gates import chunk_local_cumsum


def draw(T: int = 200, BT: int = 64):
    """Top: chunks and the states h[n] entering them (and ht). Bottom: 2^(Γ − G_t) per token."""
    import matplotlib.pyplot as plt
    from matplotlib.patches import FancyArrowPatch, Rectangle

    starts = list(range(0, T, BT))
    fig, (ax1, ax2) = plt.subplots(2, 1, figsize=(11, 5.6), sharex=True,
                                   gridspec_kw=dict(height_ratios=[1.1, 1]))
    for n, s in enumerate(starts):
        e = min(s + BT, T)
        ax1.add_patch(Rectangle((s, 0), e - s, 1, facecolor=f"C{n % 10}", alpha=0.25, edgecolor="k"))
        ax1.text((s + e) / 2, 0.5, f"chunk {n}\n{e - s} tokens", ha="center", va="center", fontsize=8)
        ax1.plot([s], [1.9], "o", color="k", ms=7)
        ax1.text(s, 2.25, f"h[{n}]", ha="center", fontsize=9)
        end = e if e < T else T
        arrow = FancyArrowPatch((s + 2, 1.9), (end - 2, 1.9), arrowstyle="-|>", mutation_scale=10,
                                color="gray", connectionstyle="arc3,rad=-0.35")
        ax1.add_patch(arrow)
    ax1.plot([T], [1.9], "s", color="crimson", ms=7)
    ax1.text(T, 2.25, "ht", ha="center", fontsize=9, color="crimson")
    ax1.text(starts[0] + BT / 2, 2.95,
             r"$h[n+1] = \mathrm{diag}(2^{\Gamma})\,h[n]\,\mathrm{diag}(2^{\Gamma_v})"
             r" + (\mathbf{k}_n \odot 2^{\Gamma - G})^\top (\mathbf{v}_n \odot 2^{\Gamma_v - G_v})$",
             ha="left", fontsize=9)
    ax1.set_ylim(-0.2, 3.4)
    ax1.set_yticks([])
    ax1.set_title(f"T = {T} tokens in chunks of BT = {BT}: one state stored per chunk, "
                  "one K×V matmul per chunk", fontsize=10)
    for side in ("top", "right", "left"):
        ax1.spines[side].set_visible(False)

    gen = torch.Generator().manual_seed(0)
    g = torch.nn.functional.logsigmoid(torch.randn(1, T, 1, generator=gen)) / 8
    G = chunk_local_cumsum(g, BT, dtype=torch.float64)[0, :, 0]  # log2 units
    w = torch.empty(T, dtype=torch.float64)
    for s in starts:
        e = min(s + BT, T)
        w[s:e] = torch.exp2(G[e - 1] - G[s:e])  # 2^(Γ − G_t): 1 for the chunk's last token
    ax2.bar(torch.arange(T).numpy(), w.numpy(), width=1.0, color="C0")
    for s in starts[1:]:
        ax2.axvline(s, color="gray", lw=0.6, ls=":")
    ax2.set(xlabel="token t", ylabel=r"$2^{\Gamma - G_t}$", ylim=(0, 1.05),
            title=r"weight of token t's key in its chunk's update (scalar gate): all in (0, 1]")
    ax2.grid(True, axis="y", alpha=0.3)
    ax2.set_xlim(-2, T + 4)
    fig.tight_layout()
    return fig


def main(out_dir):
    return [save(draw(), "chunking.png", out_dir)]
