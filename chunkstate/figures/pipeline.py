"""Chapter 07's figure: a program's chunk loop without and with software pipelining (``num_stages``).

One program walks its chunks n = 0, 1, …, NT − 1 in order: load chunk n's ``k`` and ``v``, then
compute ``h[n+1]`` from ``h[n]`` with one ``tl.dot``. A load waits on memory for several steps; the
product takes one. With ``num_stages = s`` Triton's pipeliner issues the loads of chunks
n+1, …, n+s−1 before it computes chunk n, so up to s − 1 loads are in flight while chunk n is
computed. The figure draws that schedule as a timeline (rows: load, compute; columns: time steps;
boxes: chunk indices) for s = 1 and s = 3 side by side. It is a model of the schedule, not a
measurement: ``schedule`` is the pure function that places the boxes.
"""
from __future__ import annotations

from . import save


def schedule(num_stages: int, n_chunks: int, load_steps: int = 3, compute_steps: int = 1):
    """Start times (in steps) of each chunk's load and compute in one program's loop.

    - ``num_stages = 1``: no pipelining; chunk n's load is issued when chunk n − 1's product ends.
    - ``num_stages = s ≥ 2``: the loads of chunks 0 … s − 2 are issued before the loop (the
      prologue); the load of chunk n + s − 1 is issued when chunk n's product starts, so the loads of
      chunks n + 1 … n + s − 1 are in flight while chunk n is computed.

    A product starts when its chunk's load has arrived (``load_steps`` after it was issued) and the
    previous product has ended (the state ``h[n]`` is needed). Returns ``(load_start, compute_start)``,
    two lists of ``n_chunks`` integers. Raises ``ValueError`` for ``num_stages < 1``, ``n_chunks < 1``
    or non-positive step counts.
    """
    if num_stages < 1 or n_chunks < 1 or load_steps < 1 or compute_steps < 1:
        raise ValueError(f"need num_stages, n_chunks, load_steps, compute_steps >= 1, got "
                         f"{num_stages}, {n_chunks}, {load_steps}, {compute_steps}")
    load, compute = [0] * n_chunks, [0] * n_chunks
    for n in range(n_chunks):
        if num_stages == 1:
            load[n] = 0 if n == 0 else compute[n - 1] + compute_steps
        elif n >= num_stages - 1:
            load[n] = compute[n - num_stages + 1]  # issued as chunk n − s + 1's product starts
        previous_end = 0 if n == 0 else compute[n - 1] + compute_steps
        compute[n] = max(load[n] + load_steps, previous_end)
    return load, compute


def in_flight(load_start, load_steps: int, t: float) -> int:
    """How many loads are on their way at time ``t`` (issued, not yet arrived)."""
    return sum(s <= t < s + load_steps for s in load_start)


def draw(stages=(1, 3), n_chunks: int = 6, load_steps: int = 3, compute_steps: int = 1):
    """The timeline for each ``num_stages`` in ``stages``, side by side with a shared time axis.

    Per panel two rows: ``load k, v`` (one lane per load that can be in flight at once; a box from
    the load's issue to its arrival, labelled with the chunk index n) and ``compute h[n+1]`` (a box
    per chunk's product). The panel's title gives num_stages and the steps the whole loop takes.
    """
    import matplotlib.pyplot as plt
    from matplotlib.patches import Rectangle

    plans = {s: schedule(s, n_chunks, load_steps, compute_steps) for s in stages}
    end = max(c[-1] + compute_steps for _, c in plans.values())
    fig, axes = plt.subplots(1, len(stages), figsize=(5.6 * len(stages), 3.0), sharex=True, squeeze=False)
    for ax, s in zip(axes[0], stages):
        load, compute = plans[s]
        lanes = max(1, s - 1)
        compute_y = lanes + 0.4
        for n in range(n_chunks):
            color = f"C{n % 10}"
            y = lanes - 1 - (n % lanes)  # lane of this load
            ax.add_patch(Rectangle((load[n], y + 0.1), load_steps, 0.8, facecolor=color, alpha=0.35,
                                   edgecolor="k", lw=0.8))
            ax.text(load[n] + load_steps / 2, y + 0.5, f"{n}", ha="center", va="center", fontsize=9)
            ax.add_patch(Rectangle((compute[n], compute_y + 0.1), compute_steps, 0.8, facecolor=color,
                                   alpha=0.8, edgecolor="k", lw=0.8))
            ax.text(compute[n] + compute_steps / 2, compute_y + 0.5, f"{n}", ha="center", va="center",
                    fontsize=9, color="white", fontweight="bold")
        total = compute[-1] + compute_steps
        ax.axvline(total, color="crimson", lw=1, ls="--")
        ax.set_yticks([lanes / 2, compute_y + 0.5])
        ax.set_yticklabels(["load k, v\n(in flight)", "compute\nh[n+1]"], fontsize=9)
        ax.set_ylim(-0.1, compute_y + 1.0)
        ax.set_xlim(0, end + 0.5)
        ax.set_xticks(range(0, end + 1, 2))
        ax.set_xlabel("time step")
        ahead = "no loads ahead" if s == 1 else f"loads of chunks n+1 … n+{s - 1} in flight during chunk n"
        ax.set_title(f"num_stages = {s}: {ahead}\n{n_chunks} chunks in {total} steps", fontsize=9.5)
        ax.grid(True, axis="x", alpha=0.3)
        for side in ("top", "right"):
            ax.spines[side].set_visible(False)
    fig.suptitle(f"One program's chunk loop (box = chunk n; a load takes {load_steps} steps, "
                 f"a product {compute_steps})", fontsize=10)
    fig.tight_layout()
    return fig


def main(out_dir):
    return [save(draw(), "pipelined_loop.png", out_dir)]
