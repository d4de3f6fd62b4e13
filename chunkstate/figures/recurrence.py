"""Chapter 01's cost model and figure: the recurrence's O(T·K·V) against attention's O(T²).

Counts are per (sequence, head), one multiply-add = 2 FLOPs:

- the recurrence ``S_t = S_{t-1} + k_t v_tᵀ``, ``o_t = S_tᵀ q_t``: ``2KV + 2KV`` per token;
- the causal masked form ``(𝐪𝐤ᵀ ⊙ M) 𝐯`` (bold: a sequence's rows stacked): one ``2K`` dot and one ``2V`` weighted sum for each of
  the ``T(T+1)/2`` pairs ``j <= i``.

Memory kept while decoding, for a whole model: a KV cache grows with T, the state does not.
"""
from __future__ import annotations

from . import save


def flops_recurrent(T: int, K: int, V: int) -> int:
    """FLOPs of the token loop over T tokens, one head: ``4·T·K·V``."""
    return 4 * T * K * V


def flops_masked(T: int, K: int, V: int) -> int:
    """FLOPs of the causal masked form over T tokens, one head: ``T(T+1)·(K+V)``."""
    return T * (T + 1) * (K + V)


def crossover_T(K: int, V: int) -> float:
    """The T where both counts are equal (``T + 1 = 4KV / (K+V)``): beyond it the loop is cheaper."""
    return 4 * K * V / (K + V) - 1


def kv_cache_bytes(T: int, layers: int, heads: int, K: int, V: int, bytes_per: int = 2) -> int:
    """Bytes of a KV cache holding T tokens (keys and values of every layer and head)."""
    return T * layers * heads * (K + V) * bytes_per


def state_bytes(layers: int, heads: int, K: int, V: int, bytes_per: int = 4) -> int:
    """Bytes of the recurrent states ``h ∈ R^{K×V}`` of every layer and head (fp32 by default)."""
    return layers * heads * K * V * bytes_per


# Llama-2-7B's attention shape: 32 layers, 32 heads, head dim 128 (no GQA).
MODEL_7B = dict(layers=32, heads=32, K=128, V=128)


def draw(K: int = 128, V: int = 128, model: dict = MODEL_7B):
    """Two panels: FLOPs per head vs T, and decode-time memory of a 7B-shaped model vs T."""
    import matplotlib.pyplot as plt
    import numpy as np

    T = np.unique(np.logspace(0, 17, 69, base=2).astype(np.int64))
    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(10, 3.8))
    ax1.loglog(T, [flops_masked(int(t), K, V) for t in T], label=r"masked form $(\mathbf{q}\mathbf{k}^\top\odot M)\,\mathbf{v}$: $T(T+1)(K+V)$")
    ax1.loglog(T, [flops_recurrent(int(t), K, V) for t in T], label=r"recurrence: $4\,TKV$")
    tc = crossover_T(K, V)
    ax1.axvline(tc, color="gray", ls=":", lw=1)
    ax1.annotate(f"equal at T ≈ {tc:.0f}", (tc, flops_recurrent(int(tc), K, V)), xytext=(8, -30),
                 textcoords="offset points", fontsize=8, color="gray")
    ax1.set(xlabel="sequence length T", ylabel="FLOPs per head", title=f"Work (K = {K}, V = {V})")
    ax1.legend(fontsize=8, loc="upper left")
    GiB = 2 ** 30
    kv = [kv_cache_bytes(int(t), **model) / GiB for t in T]
    st = state_bytes(**model) / GiB
    ax2.loglog(T, kv, label="KV cache (bf16)")
    ax2.loglog(T, [st] * len(T), label="linear-attention state (fp32)")
    tb = state_bytes(**model) / kv_cache_bytes(1, **model)  # tokens of cache the state is worth
    ax2.axvline(tb, color="gray", ls=":", lw=1)
    ax2.annotate(f"equal at T = {tb:.0f}", (tb, st), xytext=(8, 20), textcoords="offset points",
                 fontsize=8, color="gray")
    ax2.set(xlabel="tokens held T", ylabel="GiB (whole model)",
            title=f"Decoding memory: {model['layers']} layers × {model['heads']} heads × {model['K']}")
    ax2.legend(fontsize=8, loc="upper left")
    for ax in (ax1, ax2):
        ax.grid(True, which="major", alpha=0.3)
    fig.tight_layout()
    return fig


def main(out_dir):
    return [save(draw(), "recurrence_cost.png", out_dir)]
