"""Chapter 02's figures: what each gate multiplies, and why cumulative gates restart every chunk.

- ``gates_decays.png``: the factor one token's decay applies to a K×V state, for each gate kind.
- ``gates_cumsum.png``: the cumulative log2-decay ``G`` over a long sequence, summed from the
  sequence start against chunk-local, next to the exponent where ``exp2(-G)`` overflows in float32.

Figure data come from a fixed generator so the committed files do not change between redraws.
"""
from __future__ import annotations

import math

import torch

from . import save
from ..gates import RCP_LN2, chunk_local_cumsum

FP32_MAX_EXP2 = math.log2(torch.finfo(torch.float32).max)  # ≈ 128: exp2(x) is inf in fp32 above it

GATE_KINDS = {  # name: (shape, models that use it, what it decays)
    "g": ("[B,T,H]", "Mamba-2 (SSD), simple GLA", "one scalar per token and head"),
    "g_gamma": ("[H]", "RetNet, Lightning Attention", "one constant per head"),
    "gk": ("[B,T,H,K]", "GLA, RWKV-6", "one value per key row"),
    "gv": ("[B,T,H,V]", "GSA", "one value per value column"),
}


def decay_factor(kind: str, K: int, V: int, gen: torch.Generator | None = None) -> torch.Tensor:
    """The K×V factor a single token's gate multiplies the state by (``S ← factor ⊙ S``)."""
    if kind == "g":
        return torch.full((K, V), math.exp(-0.3 * torch.rand((), generator=gen).item() - 0.05))
    if kind == "g_gamma":
        return torch.full((K, V), 1 - 2.0 ** -5)  # RetNet's first head: γ = 1 − 2^-5
    if kind == "gk":
        return torch.exp(-torch.rand(K, 1, generator=gen)).expand(K, V)
    if kind == "gv":
        return torch.exp(-torch.rand(1, V, generator=gen)).expand(K, V)
    raise ValueError(f"kind must be one of {list(GATE_KINDS)}, got {kind!r}")


def draw_decays(K: int = 8, V: int = 8):
    """Four heatmaps: the per-token factor on the K×V state for g, g_gamma, gk and gv."""
    import matplotlib.pyplot as plt

    gen = torch.Generator().manual_seed(0)
    fig, axes = plt.subplots(1, 4, figsize=(12, 3.4))
    for ax, (kind, (shape, users, what)) in zip(axes, GATE_KINDS.items()):
        im = ax.imshow(decay_factor(kind, K, V, gen).numpy(), vmin=0, vmax=1, cmap="viridis")
        ax.set_title(f"{kind} {shape}\n{what}\n{users}", fontsize=8)
        ax.set_xlabel("V (value columns)", fontsize=8)
        ax.set_ylabel("K (key rows)", fontsize=8)
        ax.set_xticks([])
        ax.set_yticks([])
    fig.colorbar(im, ax=axes, shrink=0.8, label="factor on S for one token")
    fig.suptitle(r"$S_t = \mathrm{diag}(e^{a_t})\, S_{t-1}\, \mathrm{diag}(e^{b_t}) + k_t v_t^\top$:"
                 " what one token's decay multiplies", fontsize=10, y=1.04)
    return fig


def draw_cumsum(T: int = 4096, BT: int = 64):
    """The cumulative log2-decay G of a GLA-like scalar gate: summed from the sequence start
    (chapter 02) against chunk-local (restarting every BT tokens, chapter 03 on)."""
    import matplotlib.pyplot as plt

    gen = torch.Generator().manual_seed(0)
    g = torch.nn.functional.logsigmoid(torch.randn(1, T, 1, generator=gen)) / 16  # ≈ -0.05 per token
    G_seq = RCP_LN2 * g[0, :, 0].double().cumsum(0)  # from the sequence start, log2 units
    G = chunk_local_cumsum(g, BT, dtype=torch.float64)[0, :, 0]  # chunk-local, log2 units
    t = torch.arange(T)
    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(11, 3.6), gridspec_kw=dict(width_ratios=[2, 1]))
    ax1.plot(t, G_seq, label=r"from the sequence start: $G_t = \log_2 e \sum_{s \leq t} g_s$")
    ax1.plot(t, G, label=r"chunk-local $G_t$ (restarts every BT)")
    ax1.axhline(-FP32_MAX_EXP2, color="crimson", ls="--", lw=1)
    ax1.annotate(r"below $-128$: $2^{-G_t}$ is inf in fp32", (0, -FP32_MAX_EXP2), xytext=(4, -12),
                 textcoords="offset points", color="crimson", fontsize=8)
    ax1.set(xlabel="token t", ylabel="cumulative log2-decay", title=f"T = {T}, BT = {BT}")
    ax1.legend(fontsize=8, loc="lower left")
    n = 4 * BT
    ax2.plot(t[:n], G[:n], color="C1", drawstyle="steps-post")
    for c in range(0, n + 1, BT):
        ax2.axvline(c, color="gray", lw=0.6, ls=":")
    ax2.set(xlabel="token t", title=r"first 4 chunks: $\Gamma \leq G_t \leq 0$ in each")
    for ax in (ax1, ax2):
        ax.grid(True, alpha=0.3)
    fig.tight_layout()
    return fig


def main(out_dir):
    return [save(draw_decays(), "gates_decays.png", out_dir), save(draw_cumsum(), "gates_cumsum.png", out_dir)]
