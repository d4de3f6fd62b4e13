"""Figures of where things live: a time-major tensor in memory (chapter 04), the state's tiles and
the flat grid of programs (chapter 05), a packed batch of ragged sequences and its state slots
(chapter 06). Each ``draw_*`` returns a matplotlib figure; ``main(out_dir)`` saves all three.
"""
from __future__ import annotations

import matplotlib.pyplot as plt
import triton
from matplotlib.patches import FancyArrowPatch, Rectangle

from ..explore import program_map
from . import save

_COLORS = ["#4C72B0", "#DD8452", "#55A868", "#C44E52", "#8172B3", "#937860", "#DA8BC3", "#8C8C8C"]


def _cell(ax, x, y, w, h, color, text="", alpha=1.0, fontsize=7, textcolor="white", **kw):
    ax.add_patch(Rectangle((x, y), w, h, facecolor=color, edgecolor="white", lw=1.0, alpha=alpha, **kw))
    if text:
        ax.text(x + w / 2, y + h / 2, text, ha="center", va="center", fontsize=fontsize, color=textcolor)


def _arrow(ax, a, b, color="black", rad=0.0, **kw):
    ax.add_patch(FancyArrowPatch(a, b, arrowstyle="-|>", mutation_scale=10, color=color,
                                 connectionstyle=f"arc3,rad={rad}", lw=1.2, **kw))


def draw_time_major_layout(B: int = 2, T: int = 3, H: int = 2, K: int = 4):
    """Memory of a contiguous time-major tensor ``k`` [B, T, H, K]: one row of cells per batch
    row, each cell one element (its number is d), coloured by head; arrows mark the stride between
    consecutive tokens of one head (H·K) and between batch rows (T·H·K)."""
    row = T * H * K
    gap = 4.0  # vertical distance between batch rows
    top = gap * (B - 1)
    fig, ax = plt.subplots(figsize=(min(14, 0.32 * row + 3.5), 1.0 + 0.9 * gap * B))
    for b in range(B):
        y = top - b * gap
        ax.text(-0.6, y + 0.5, f"b = {b}", ha="right", va="center", fontsize=9)
        for t in range(T):
            for i_h in range(H):
                for d in range(K):
                    _cell(ax, (t * H + i_h) * K + d, y, 1, 1, _COLORS[i_h % len(_COLORS)], str(d), fontsize=6)
                ax.text((t * H + i_h) * K + K / 2, y + 1.15, f"t={t}, h={i_h}", ha="center", va="bottom", fontsize=7)
        if T > 1:  # stride between tokens t = 0 and t = 1 of head 0
            _arrow(ax, (K / 2, y - 0.1), (H * K + K / 2, y - 0.1), rad=0.4)
            ax.text(H * K + K / 2 + 1.0, y - 0.9, f"next token, same head: +H·K = {H * K}", ha="left", fontsize=8)
    if B > 1:
        _arrow(ax, (row + 0.3, top + 0.5), (row + 0.3, top - gap + 0.5), rad=-0.6)
        ax.text(row + 1.6, top - gap / 2 + 0.5, f"next batch row:\n+T·H·K = {row}", ha="left", va="center", fontsize=8)
    ax.text(row / 2, top + 2.0,
            f"k[b, t, h, d] is at offset ((b·T + t)·H + h)·K + d        (B={B}, T={T}, H={H}, K={K})",
            ha="center", fontsize=9)
    ax.set_xlim(-2.5, row + 8)
    ax.set_ylim(-1.8, top + 2.6)
    ax.set_aspect("equal")
    ax.axis("off")
    return fig


def draw_state_tiles(K: int = 128, V: int = 128, BK: int = 64, BV: int = 64, BT: int = 64, NH: int = 3):
    """Left: one chunk's update ``h += kᵀ v`` with the state cut into [BK, BV] tiles; tile (1, 0)
    reads only its BK columns of k and BV columns of v. Right: the flat 1-D grid — programs of
    one (sequence, head) are neighbours, decoded as ``i_nh = pid // (NK·NV)``,
    ``i_k = (pid // NV) % NK``, ``i_v = pid % NV``: each program's tile as the kernels' own
    ``program_tile`` decodes it (``chunkstate.explore.program_map``)."""
    NK, NV = -(-K // BK), -(-V // BV)
    # each program's tile as the kernels decode it (kernel_parts.program_tile, run by the program
    # map over NH sequences of one head): the pids on the left, the grid on the right
    table = program_map(NH, BT, 1, K, V, chunk_size=BT, config=triton.Config({"BK": BK, "BV": BV}))
    pid_of = {(r["seq"], r["i_k"], r["i_v"]): r["pid"] for r in table.rows}
    fig, (ax, ax2) = plt.subplots(1, 2, figsize=(12, 4.6), gridspec_kw={"width_ratios": [1.5, 1]})
    s = 1.0 / 32  # drawing units per element
    hi_k, hi_v = min(1, NK - 1), 0  # the highlighted tile
    # kᵀ: [K, BT] on the left
    x_k, x_v, x_h = 0.0, BT * s + 0.6, BT * s + 0.6
    ax.add_patch(Rectangle((x_k, 0), BT * s, K * s, facecolor="#dddddd", edgecolor="gray"))
    ax.add_patch(Rectangle((x_k, K * s - (hi_k + 1) * BK * s), BT * s, BK * s, facecolor=_COLORS[0], alpha=0.8))
    ax.text(x_k + BT * s / 2, -0.35, f"kᵀ  [K, BT]\n(chunk of {BT} tokens)", ha="center", va="top", fontsize=8)
    # v: [BT, V] on top of h
    y_v = K * s + 0.6
    ax.add_patch(Rectangle((x_v, y_v), V * s, BT * s, facecolor="#dddddd", edgecolor="gray"))
    ax.add_patch(Rectangle((x_v + hi_v * BV * s, y_v), BV * s, BT * s, facecolor=_COLORS[1], alpha=0.8))
    ax.text(x_v + V * s / 2, y_v + BT * s + 0.15, "v  [BT, V]", ha="center", va="bottom", fontsize=8)
    # h: [K, V] with tiles
    for i_k in range(NK):
        for i_v in range(NV):
            y = K * s - (i_k + 1) * BK * s
            on = (i_k, i_v) == (hi_k, hi_v)
            _cell(ax, x_h + i_v * BV * s, y, BV * s, BK * s, _COLORS[2] if on else "#bbbbbb",
                  f"tile ({i_k}, {i_v})\npid {pid_of[0, i_k, i_v]}", fontsize=8,
                  textcolor="white" if on else "black")
    ax.text(x_h + V * s / 2, -0.35, f"h  [K, V] = [{K}, {V}]\ntiles [BK, BV] = [{BK}, {BV}]",
            ha="center", va="top", fontsize=8)
    ax.set_xlim(-0.3, x_h + V * s + 0.3)
    ax.set_ylim(-1.3, y_v + BT * s + 0.6)
    ax.set_aspect("equal")
    ax.axis("off")
    ax.set_title("a tile needs only its rows of kᵀ and its columns of v", fontsize=10)
    # right: the flat grid
    n = len(table)
    for r in table.rows:
        pid, i_nh, i_k, i_v = r["pid"], r["seq"], r["i_k"], r["i_v"]
        _cell(ax2, 0, n - 1 - pid, 1.2, 1, _COLORS[3 + i_nh % 4], f"pid {pid}", fontsize=8)
        ax2.text(1.4, n - 1 - pid + 0.5, f"(sequence·head {i_nh}, tile ({i_k}, {i_v}))", va="center", fontsize=8)
    ax2.text(0, n + 0.6, f"grid = (NK·NV·N·H,) = ({NK}·{NV}·{NH},)", fontsize=9)
    ax2.set_xlim(-0.2, 7)
    ax2.set_ylim(-0.5, n + 1.5)
    ax2.axis("off")
    ax2.set_title("one flat grid axis: no 65,535 limit on N·H", fontsize=10)
    fig.tight_layout()
    return fig


def draw_varlen_layout(lens=(5, 0, 11, 1, 8), BT: int = 4):
    """A packed batch: sequences of lengths ``lens`` one after another along T (B = 1), their
    chunks of BT tokens (each sequence starts a new chunk), and the state slots ``h[0, s]`` they
    own — sequence n's first slot is ``prepare_chunk_offsets(cu_seqlens, BT)[n]``; an empty
    sequence owns none."""
    cu = [0]
    for L in lens:
        cu.append(cu[-1] + L)
    slots = [0]
    for L in lens:
        slots.append(slots[-1] + -(-L // BT))
    T, NS = cu[-1], slots[-1]
    fig, ax = plt.subplots(figsize=(max(8, 0.42 * T + 2), 3.6))
    y_tok, y_slot = 2.4, 0.0
    for n, L in enumerate(lens):
        c = _COLORS[n % len(_COLORS)]
        for j in range(L):
            _cell(ax, cu[n] + j, y_tok, 1, 1, c, str(j), fontsize=7)
        for i_t in range(-(-L // BT)):  # chunk boundaries and the slot each chunk's state goes to
            x0 = cu[n] + i_t * BT
            ax.plot([x0, x0], [y_tok - 0.15, y_tok + 1.15], color="black", lw=1.5)
            s = slots[n] + i_t
            _cell(ax, s * 1.6, y_slot, 1.4, 1, c, f"h[{s}]", fontsize=7)
            _arrow(ax, (x0 + 0.1, y_tok - 0.15), (s * 1.6 + 0.7, y_slot + 1.05), color=c, alpha=0.8)
        label = f"seq {n}: L={L}" if L else f"seq {n}: empty\n(no slot)"
        ax.text(cu[n] + max(L, 0.001) / 2, y_tok + 1.3, label, ha="center", va="bottom", fontsize=7,
                color=c)
    for x in cu:
        ax.plot([x, x], [y_tok + 1.05, y_tok + 1.25], color="gray", lw=0.8)
    ax.text(-0.4, y_tok + 0.5, "k, v\n[1, T, H, ·]", ha="right", va="center", fontsize=8)
    ax.text(-0.4, y_slot + 0.5, "h\n[1, NS, H, K, V]", ha="right", va="center", fontsize=8)
    ax.text(0, -0.9, f"cu_seqlens = {cu}    slot offsets = prepare_chunk_offsets(cu_seqlens, {BT}) = {slots}"
            f"    (BT = {BT}; thick lines: chunk starts)", fontsize=8)
    ax.set_xlim(-4, max(T, NS * 1.6) + 0.5)
    ax.set_ylim(-1.3, y_tok + 2.3)
    ax.set_aspect("equal")
    ax.axis("off")
    return fig


def main(out_dir) -> list:
    """Draw this module's figures into ``out_dir``; return their paths."""
    return [save(draw(), name, out_dir) for draw, name in ((draw_time_major_layout, "layout_time_major.png"),
                                                  (draw_state_tiles, "layout_state_tiles.png"),
                                                  (draw_varlen_layout, "layout_varlen.png"))]
