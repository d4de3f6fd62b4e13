"""The explorer's views: plain functions returning matplotlib figures, computed by
``chunkstate.reference`` (the float64 token loop) and the real ``chunk_fwd_h`` (Triton's interpreter
on CPU, compiled on a GPU).

Every view takes the same settings, the explorer's sliders:

- ``lengths``: the sequences' lengths, packed along T (B = 1, ``cu_seqlens``; one length: one
  sequence); ``position``: a token on that packed axis, which picks the sequence and chunk shown;
- ``gate`` ("g", "g_gamma", "gk" or "gv") and ``strength``: every token decays the state by about
  e^{-strength} (natural log); ``gk`` / ``gv`` decay key (value) dimension d at a rate rising
  from ~0 to ~2× that along the dimensions, so the rows (columns) of the state fade apart;
- ``chunk_size``, ``split_size``, ``tile`` (BK = BV), ``pieces``: the kernel launch;
- ``K``, ``V``, ``seed``: the state's size and the random k, v (uniform in [0, 1): a positive
  state, whose fading is easy to see).

Inputs and kernel results are cached per setting, so moving ``position`` only redraws.
Keep T ≤ 128 and K, V ≤ 32 under the interpreter: each redraw then takes well under a second.
"""
from __future__ import annotations

import functools
import itertools
import numbers

import torch
import triton

from .. import gates as _gates
from .. import reference
from ..env import DEVICE
from ..forward import chunk_fwd_h
from .programs import draw_program_map, program_map

GATE_KINDS = ("g", "g_gamma", "gk", "gv")
MAX_TOKENS = 512  # a guard against settings that would take minutes under the interpreter


def _check(lengths, gate, strength, position, K, V):
    if isinstance(lengths, numbers.Integral):
        lengths = (lengths,)
    lengths = tuple(lengths)
    if not lengths or any(isinstance(L, bool) or not isinstance(L, numbers.Integral) or L < 0 for L in lengths):
        raise ValueError(f"lengths must be a non-empty list of ints >= 0, got {lengths!r}")
    T = sum(lengths)
    if not 1 <= T <= MAX_TOKENS:
        raise ValueError(f"the lengths must add up to between 1 and {MAX_TOKENS} tokens, got {T}")
    if gate not in GATE_KINDS:
        raise ValueError(f"gate must be one of {GATE_KINDS}, got {gate!r}")
    if not isinstance(strength, numbers.Real) or not 0 <= strength <= 50:
        raise ValueError(f"strength must be a number in [0, 50], got {strength!r}")
    if isinstance(position, bool) or not isinstance(position, numbers.Integral) or not 0 <= position < T:
        raise ValueError(f"position must be a token in [0, {T}), got {position!r}")
    for name, d in (("K", K), ("V", V)):
        if isinstance(d, bool) or not isinstance(d, numbers.Integral) or not 1 <= d <= 128:
            raise ValueError(f"{name} must be an int in [1, 128], got {d!r}")
    return tuple(int(L) for L in lengths), int(position)


def locate(lengths, position: int, chunk_size: int, split_size: int | None = None) -> dict:
    """Where token ``position`` of the packed axis lies: its sequence ``seq`` (first token ``bos``,
    length ``L``), its chunk (``chunk``, tokens ``t0 .. t1 - 1``) and split (``split``, the slot
    ``slot`` of h that holds the state entering it)."""
    BS = split_size or chunk_size
    bos, slot0 = 0, 0
    for n, L in enumerate(lengths):
        if position < bos + L:
            i = position - bos
            c = i // chunk_size
            return dict(seq=n, bos=bos, L=L, chunk=c, t0=bos + c * chunk_size, t1=bos + min((c + 1) * chunk_size, L),
                        split=i // BS, slot=slot0 + i // BS, first_slot=slot0, slots=-(-L // BS))
        bos, slot0 = bos + L, slot0 + -(-L // BS)
    raise ValueError(f"position {position} lies past the last token ({bos - 1})")


@functools.lru_cache(maxsize=16)
def inputs(lengths: tuple, gate: str, strength: float, K: int, V: int, seed: int = 0) -> dict:
    """Random k [1, T, 1, K], v [1, T, 1, V] (uniform in [0, 1)) and the natural-log gate of kind
    ``gate`` at ``strength`` (module docstring), on the CPU, float64 (cached: do not modify)."""
    T = sum(lengths)
    gen = torch.Generator().manual_seed(seed)
    k = torch.rand(1, T, 1, K, generator=gen, dtype=torch.float64)
    v = torch.rand(1, T, 1, V, generator=gen, dtype=torch.float64)
    u = lambda *shape: 0.5 + torch.rand(*shape, generator=gen, dtype=torch.float64)  # noqa: E731  mean 1
    rate = lambda D: (torch.arange(D, dtype=torch.float64) + 0.5) * (2.0 / D)  # noqa: E731  ~0 .. ~2, mean 1
    nat = {"g": lambda: -strength * u(1, T, 1),
           "g_gamma": lambda: torch.full((1,), -float(strength), dtype=torch.float64),
           "gk": lambda: -strength * u(1, T, 1, K) * rate(K),
           "gv": lambda: -strength * u(1, T, 1, V) * rate(V)}[gate]()
    cu = torch.tensor([0, *itertools.accumulate(lengths)], dtype=torch.int32)
    return dict(k=k, v=v, gate={gate: nat}, cu_seqlens=cu, lengths=lengths)


def kernel_gate(gate: str, nat: torch.Tensor, chunk_size: int, cu_seqlens) -> torch.Tensor:
    """One gate as the kernels take it (``gates.kernel_gates``), fp32: the chunk-local cumulative sum
    in log2 units (g, gk, gv), or the per-step decay in log2 units (g_gamma)."""
    return _gates.kernel_gates({gate: nat}, chunk_size, cu_seqlens)[gate].float()


def states(lengths=(64,), gate: str = "g", strength: float = 0.1, chunk_size: int = 16, split_size: int | None = None,
           K: int = 32, V: int = 32, tile: int = 32, pieces: int = 1, seed: int = 0, **_ignored) -> dict:
    """The states entering every split, by the float64 token loop (``reference.recurrent_states``)
    and by ``chunk_fwd_h`` (fp32, with a [tile, tile] config and ``pieces``): ``h_loop``,
    ``h_kernel`` [NS, K, V] and the final states ``ht_loop``, ``ht_kernel`` [N, K, V], float64 on
    the CPU, for the views' settings (module docstring; cached: do not modify)."""
    lengths, _ = _check(lengths, gate, strength, 0, K, V)
    return _states(lengths, gate, float(strength), K, V, seed, chunk_size, split_size, tile, pieces)


@functools.lru_cache(maxsize=16)
def _states(lengths: tuple, gate: str, strength: float, K: int, V: int, seed: int, chunk_size: int,
            split_size: int | None, tile: int, pieces: int) -> dict:
    x = inputs(lengths, gate, strength, K, V, seed)
    nat = x["gate"][gate]
    h_loop, ht_loop = reference.recurrent_states(x["k"], x["v"], **{gate: nat}, cu_seqlens=x["cu_seqlens"],
                                                 chunk_size=chunk_size, split_size=split_size)
    dev = DEVICE
    cu = x["cu_seqlens"].to(dev)
    kg = kernel_gate(gate, nat.to(dev), chunk_size, cu)
    config = triton.Config({"BK": tile, "BV": tile}, num_warps=4, num_stages=1)
    h, ht = chunk_fwd_h(x["k"].float().to(dev), x["v"].float().to(dev), **{gate: kg}, output_final_state=True,
                        cu_seqlens=cu, chunk_size=chunk_size, split_size=split_size, states_in_fp32=True,
                        pieces=pieces, config=config)
    return dict(h_loop=h_loop[0, :, 0], ht_loop=ht_loop[:, 0], h_kernel=h[0, :, 0].double().cpu(),
                ht_kernel=ht[:, 0].double().cpu())


def _frame(ax, color="red", lw=2.5):
    for side in ax.spines.values():
        side.set_edgecolor(color)
        side.set_linewidth(lw)


def _settings(gate, strength, chunk_size, split_size, position) -> str:
    return (f"gate {gate}, strength {strength:g}, BT = {chunk_size}, BS = {split_size or chunk_size}, "
            f"token {position}")


def state_heatmaps(lengths=(64,), gate: str = "g", strength: float = 0.1, chunk_size: int = 16,
                   split_size: int | None = None, position: int = 0, K: int = 32, V: int = 32, tile: int = 32,
                   pieces: int = 1, seed: int = 0, max_slots: int = 6):
    """The state ``h`` entering each split of the sequence that holds token ``position`` (head 0),
    as [K, V] heatmaps: the token loop (top) and the kernel (bottom), up to ``max_slots`` splits
    around the position's (framed red), then the final state ``ht``. The title gives the largest
    difference between the two over the whole batch, relative to the largest state entry."""
    import matplotlib.pyplot as plt

    lengths, position = _check(lengths, gate, strength, position, K, V)
    s = _states(lengths, gate, float(strength), K, V, seed, chunk_size, split_size, tile, pieces)
    where = locate(lengths, position, chunk_size, split_size)
    first = max(0, min(where["split"] - max_slots // 2, where["slots"] - max_slots))
    shown = list(range(first, min(where["slots"], first + max_slots)))
    cols = len(shown) + 1
    fig, axes = plt.subplots(2, cols, figsize=(1.9 * cols + 0.8, 4.4), squeeze=False)
    top = max(float(s["h_loop"].abs().max()) if s["h_loop"].numel() else 0.0, float(s["ht_loop"].abs().max()), 1e-12)
    err = max(float((s["h_kernel"] - s["h_loop"]).abs().max()) if s["h_loop"].numel() else 0.0,
              float((s["ht_kernel"] - s["ht_loop"]).abs().max())) / top
    BS = split_size or chunk_size
    for row, (who, h, ht) in enumerate((("token loop", s["h_loop"], s["ht_loop"]),
                                        ("chunk_fwd_h", s["h_kernel"], s["ht_kernel"]))):
        for j, split in enumerate(shown):
            ax = axes[row, j]
            image = ax.imshow(h[where["first_slot"] + split].numpy(), vmin=0, vmax=top, cmap="viridis")
            a = split * BS
            ax.set_title(f"h[{where['first_slot'] + split}]: before token {a}", fontsize=7)
            if split == where["split"]:
                _frame(ax)
        ax = axes[row, -1]
        image = ax.imshow(ht[where["seq"]].numpy(), vmin=0, vmax=top, cmap="viridis")
        ax.set_title(f"ht: after token {where['L'] - 1}", fontsize=7)
        axes[row, 0].set_ylabel(f"{who}\nK", fontsize=8)
        for ax in axes[row]:
            ax.set_xticks([])
            ax.set_yticks([])
    fig.colorbar(image, ax=axes, shrink=0.8, pad=0.02)
    fig.suptitle(f"h entering each split of sequence {where['seq']} (L = {where['L']}, tokens counted from its "
                 f"start), head 0\n{_settings(gate, strength, chunk_size, split_size, position)}; "
                 f"tiles {tile}×{tile}, {pieces} piece(s);  max |kernel − loop| / max |loop| = {err:.1e}",
                 fontsize=8)
    return fig


def chunk_decays(lengths, gate: str, strength: float, chunk_size: int, position: int, K: int = 32, V: int = 32,
                 seed: int = 0) -> dict:
    """Inside the chunk that holds token ``position``: the log2 gate sums ``G`` the kernel reads,
    ``Γ`` (G at the chunk's last token), and the weights ``W = 2^{Γ−G}`` [L] (g, g_gamma) or
    [L, K] / [L, V] (gk, gv) by which each token's k (gk) or v (the others) enters the state at the
    chunk's end; with the chunk's token range ``t0 .. t1 - 1``."""
    lengths, position = _check(lengths, gate, strength, position, K, V)
    x = inputs(lengths, gate, float(strength), K, V, seed)
    where = locate(lengths, position, chunk_size)
    t0, t1 = where["t0"], where["t1"]
    nat = x["gate"][gate]
    if gate == "g_gamma":  # the kernel's ramp: G_i = γ̃·(i + 1) over the chunk's tokens
        G = float(nat[0]) * _gates.RCP_LN2 * torch.arange(1, t1 - t0 + 1, dtype=torch.float64)
    else:
        G = kernel_gate(gate, nat, chunk_size, x["cu_seqlens"]).double()[0, t0:t1, 0]
    Gamma = G[-1]
    return dict(G=G, Gamma=Gamma, W=torch.exp2(Gamma - G), t0=t0, t1=t1, where=where)


def decay_weights(lengths=(64,), gate: str = "g", strength: float = 0.1, chunk_size: int = 16,
                  split_size: int | None = None, position: int = 0, K: int = 32, V: int = 32, seed: int = 0,
                  **_ignored):
    """The weights ``2^{Γ−G_i}`` inside the chunk that holds token ``position``: how much of token
    i's ``k_i v_iᵀ`` is left at the chunk's end (``chunk_decays``). Scalar gates: one bar per token;
    ``gk`` / ``gv``: one row per token, one column per key (value) dimension. The position's token
    is marked red. Settings as in ``state_heatmaps`` (``split_size`` and the launch do not matter here)."""
    import matplotlib.pyplot as plt

    d = chunk_decays(lengths, gate, strength, chunk_size, position, K, V, seed)
    t0, t1, W = d["t0"], d["t1"], d["W"]
    tokens = list(range(t0, t1))
    fig, (ax, ax2) = plt.subplots(1, 2, figsize=(9.5, 3.8), gridspec_kw={"width_ratios": [1.4, 1]})
    if W.dim() == 1:
        colors = ["#C44E52" if t == position else "#4C72B0" for t in tokens]
        ax.bar(tokens, W.numpy(), color=colors)
        ax.set_ylim(0, 1.05)
        ax.set_xlabel("token")
        ax.set_ylabel("2^(Γ − G_i)")
        ax2.plot(tokens, d["G"].numpy(), marker="o", ms=3, color="#4C72B0")
        ax2.axvline(position, color="#C44E52", lw=1)
        ax2.set_ylabel("G_i (log2, chunk-local cumsum)")
        ax2.set_xlabel("token")
    else:
        image = ax.imshow(W.numpy(), vmin=0, vmax=1, cmap="magma", aspect="auto",
                          extent=(-0.5, W.shape[1] - 0.5, t1 - 0.5, t0 - 0.5))
        ax.axhline(position - 0.5, color="#4CC3FF", lw=1.5)
        ax.axhline(position + 0.5, color="#4CC3FF", lw=1.5)
        ax.set_xlabel("key dimension" if gate == "gk" else "value dimension")
        ax.set_ylabel("token")
        fig.colorbar(image, ax=ax, shrink=0.85)
        ax2.plot(d["Gamma"].numpy() if d["Gamma"].dim() else [float(d["Gamma"])], color="#4C72B0")
        ax2.set_ylabel("Γ per dimension (log2)")
        ax2.set_xlabel("key dimension" if gate == "gk" else "value dimension")
    side = {"g": "v's rows", "g_gamma": "v's rows", "gk": "k's entries", "gv": "v's entries"}[gate]
    ax.set_title(f"weights 2^(Γ−G) inside chunk {d['where']['chunk']} of sequence {d['where']['seq']} "
                 f"(tokens {t0}–{t1 - 1}): they scale {side}",
                 fontsize=8)
    total = float(torch.exp2(d["Gamma"]).mean())
    ax2.set_title(f"the chunk's total decay 2^Γ: {total:.3g}" + (" (mean over dimensions)" if W.dim() > 1 else ""),
                  fontsize=8)
    fig.suptitle(_settings(gate, strength, chunk_size, split_size, position), fontsize=8)
    fig.tight_layout()
    return fig


def gate_effects(lengths=(64,), strength: float = 0.1, chunk_size: int = 16, position: int = 0, K: int = 32,
                 V: int = 32, seed: int = 0, **_ignored):
    """The same k, v under each gate kind (columns g, g_gamma, gk, gv, at the same ``strength``):
    top, the factor ``2^Γ`` by which the chunk holding ``position`` multiplies the state entering
    it, as a [K, V] map (g, g_gamma: every entry alike; gk: row by row; gv: column by column);
    bottom, the state right after token ``position`` (the float64 token loop)."""
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(2, 4, figsize=(10.5, 5.2))
    after = []
    for j, gate in enumerate(GATE_KINDS):
        lengths_, position_ = _check(lengths, gate, strength, position, K, V)
        d = chunk_decays(lengths_, gate, strength, chunk_size, position_, K, V, seed)
        factor = torch.exp2(d["Gamma"]) * torch.ones(K, V, dtype=torch.float64)
        if gate == "gk":
            factor = torch.exp2(d["Gamma"])[:, None].expand(K, V)
        elif gate == "gv":
            factor = torch.exp2(d["Gamma"])[None, :].expand(K, V)
        image = axes[0, j].imshow(factor.numpy(), vmin=0, vmax=1, cmap="magma")
        axes[0, j].set_title(f"{gate}: 2^Γ on h\n(chunk {d['where']['chunk']})", fontsize=8)
        x = inputs(lengths_, gate, float(strength), K, V, seed)
        w = d["where"]
        sl = slice(w["bos"], position_ + 1)  # the sequence up to the position
        nat = x["gate"][gate] if gate == "g_gamma" else x["gate"][gate][:, sl]  # g_gamma: [H], no tokens
        _, ht = reference.recurrent_states(x["k"][:, sl], x["v"][:, sl], **{gate: nat})
        after.append(ht[0, 0])
    fig.colorbar(image, ax=axes[0].tolist(), shrink=0.8, pad=0.02)
    top = max(float(a.max()) for a in after) or 1.0
    for j, (gate, a) in enumerate(zip(GATE_KINDS, after)):
        image = axes[1, j].imshow(a.numpy(), vmin=0, vmax=top, cmap="viridis")
        axes[1, j].set_title(f"{gate}: state after token {position}", fontsize=8)
    fig.colorbar(image, ax=axes[1].tolist(), shrink=0.8, pad=0.02)
    for ax in axes.flat:
        ax.set_xticks([])
        ax.set_yticks([])
    axes[0, 0].set_ylabel("K (rows)", fontsize=8)
    axes[1, 0].set_ylabel("K (rows)", fontsize=8)
    fig.suptitle(f"one gate at a time, strength {strength:g}, BT = {chunk_size}: g and g_gamma scale the whole "
                 f"state, gk its rows (keys), gv its columns (values)", fontsize=8)
    return fig


def launch_map(lengths=(64,), chunk_size: int = 16, split_size: int | None = None, position: int | None = None,
               K: int = 32, V: int = 32, tile: int = 32, pieces: int = 1, sms: int | None = None, **_ignored):
    """The program map (``programs.draw_program_map``) of the explorer's launch: one head, the
    packed ``lengths``, [tile, tile] tiles, ``pieces``; token ``position`` marked."""
    lengths = tuple(lengths) if not isinstance(lengths, numbers.Integral) else (lengths,)
    T = sum(lengths)
    table = program_map(1, T, 1, K, V, cu_seqlens=[0, *itertools.accumulate(lengths)], chunk_size=chunk_size,
                        split_size=split_size, pieces=pieces,
                        config=triton.Config({"BK": tile, "BV": tile}, num_warps=4, num_stages=1))
    return draw_program_map(table, sms=sms, mark_token=position)


VIEWS = {"states": state_heatmaps, "decay weights": decay_weights, "gates side by side": gate_effects,
         "program map": launch_map}


def render(view: str, **settings):
    """The figure of one view (a key of ``VIEWS``) for the explorer's ``settings``."""
    if view not in VIEWS:
        raise ValueError(f"view must be one of {list(VIEWS)}, got {view!r}")
    return VIEWS[view](**settings)


def png(fig, dpi: int = 90) -> bytes:
    """A figure as PNG bytes (closed afterwards): what the explorer's image widget shows."""
    import io

    import matplotlib.pyplot as plt

    buffer = io.BytesIO()
    fig.savefig(buffer, format="png", dpi=dpi, bbox_inches="tight", metadata={"Software": None})
    plt.close(fig)
    return buffer.getvalue()

