"""WIP diagnostic (branch one-launch-pieces): where a one-launch call in pieces spends its time.

    CHUNKSTATE_PROBE_ONE_LAUNCH=1 python -m chunkstate.bench.probe_one_launch

On the H200 a piece's walk took 1.3-1.6x longer in the first one-launch design (twice the programs,
half publishing, half storing) than in the three launches' passes (figures/README.md, session 18).
With the probe on, every program of a one-launch call records its SM, its ticket, and the GPU's
globaltimer when it starts, when its first walk has published, when its second walk starts (after
folding in the contributions it waits for) and when it ends (``pieces.probe_mark``). This prints,
per shape and direction, the medians of the two walks (per chunk) and of the wait, and how many
programs shared an SM; and,
beside it, the three launches' time for the same call (do_bench) and the one launch's, and the
host's time per call (``runner.host_time_us``) of each and of one pass. Last, on the smallest shape
(host-bound: its GPU work is a few µs), cProfile's top functions for 200 calls of each path, to find
the host work a call in pieces adds to one pass.
"""
from __future__ import annotations

import os
import statistics

SHAPES = [(1, 131072, 2, 4), (1, 65536, 4, 2), (1, 131072, 2, 16), (2, 16384, 4, 4), (1, 4096, 2, 2)]  # B, T, H, pieces; K = V = 128
BT = 64


def main() -> None:
    assert os.environ.get("CHUNKSTATE_PROBE_ONE_LAUNCH") == "1", "set CHUNKSTATE_PROBE_ONE_LAUNCH=1 before import"
    global SHAPES
    import torch
    import torch.nn.functional as F
    from triton.testing import do_bench

    import chunkstate
    from chunkstate import gates, pieces
    from chunkstate.bench.runner import host_time_us

    for B, T, H, P in SHAPES:
        K = V = 128
        k = torch.randn(B, T, H, K, device="cuda", dtype=torch.bfloat16)
        v = torch.randn(B, T, H, V, device="cuda", dtype=torch.bfloat16)
        g = gates.chunk_local_cumsum(F.logsigmoid(torch.randn(B, T, H, device="cuda") + 4), BT)
        dht = torch.randn(B, H, K, V, device="cuda")
        for d in ("fwd", "bwd"):
            def call(one):
                pieces.ONE_LAUNCH = one
                if d == "fwd":
                    return chunkstate.chunk_fwd_h(k, v, g=g, output_final_state=True, pieces=P)
                return chunkstate.chunk_bwd_dh(k, k, v, v, None, dht, 0.088, g=g, pieces=P)
            ms, host = {}, {}
            for one in (False, True):
                call(one)
                ms[one] = do_bench(lambda: call(one), warmup=10, rep=40) * 1e3
                host[one] = host_time_us(lambda: call(one))
            one_pass = (lambda: chunkstate.chunk_fwd_h(k, v, g=g, output_final_state=True, pieces=1)) if d == "fwd" else \
                (lambda: chunkstate.chunk_bwd_dh(k, k, v, v, None, dht, 0.088, g=g, pieces=1))
            one_pass()
            ms[None], host[None] = do_bench(one_pass, warmup=10, rep=40) * 1e3, host_time_us(one_pass)
            if T <= 4096:  # host-bound: where a call in pieces spends the host's time
                profile_host(call, one_pass, d)
            pieces.clear_workspaces()
            call(True)
            torch.cuda.synchronize()
            (key, views), = [(kk, vv) for kk, vv in pieces._WORKSPACES.items() if kk[0] == "look_back"]
            probe = views[4][1:].view(-1, int(pieces.PROBE_SLOTS.value)).cpu().long() & 0xFFFFFFFF
            rows = [r for r in probe.tolist() if r[2] != 0]  # programs launched (the slots are zero beyond)
            if not rows:
                print(f"{d} B{B} T{T} H{H} P{P}: no probe slots written (pieces.PROBE is off?)", flush=True)
                continue
            t0 = min(r[2] for r in rows)
            rows = [[r[0], r[1]] + [(t - t0) % 2 ** 32 for t in r[2:]] for r in rows]  # ns from the first start
            n = len(rows)
            chunks = -(-T // (P * BT))
            line = [f"{d} B{B} T{T} H{H} P{P}: do_bench three launches {ms[False]:.0f} us, one {ms[True]:.0f}, one pass "
                    f"{ms[None]:.0f}; host per call {host[False]:.0f} / {host[True]:.0f} / {host[None]:.0f} us; {n} programs"]
            # slots: 0 SM, 1 ticket, 2 start, 3 first walk published, 4 second walk starts (after the fold), 5 end
            spans = {"first walk": (2, 3), "wait and fold": (3, 4), "second walk": (4, 5)}
            for name, (a, b) in spans.items():
                us = [(r[b] - r[a]) / 1e3 for r in rows]
                line.append(f"  {name}: median {statistics.median(us):.0f} us, max {max(us):.0f}"
                            + (f" ({statistics.median(us) / chunks * 1e3:.0f} ns a chunk)" if "walk" in name else ""))
            line.append(f"  starts {min(r[2] for r in rows) / 1e3:.0f}-{max(r[2] for r in rows) / 1e3:.0f} us, "
                        f"ends up to {max(r[5] for r in rows) / 1e3:.0f} us")
            # programs per SM while walking: for each program, how many others on its SM overlap its life
            share = [sum(1 for o in rows if o is not r and o[0] == r[0] and o[2] < r[5] and o[5] > r[2]) for r in rows]
            line.append(f"  SMs used {len(set(r[0] for r in rows))}; programs overlapping one on its SM: "
                        f"median {statistics.median(share)}, max {max(share)}")
            print("\n".join(line), flush=True)


def profile_host(call, one_pass, direction: str, calls: int = 200) -> None:
    """cProfile's top functions by own time over ``calls`` calls of the three launches, the one
    launch and one pass (the GPU idle before each)."""
    import cProfile
    import io
    import pstats

    import torch

    for name, fn in (("three launches", lambda: call(False)), ("one launch", lambda: call(True)),
                     ("one pass", one_pass)):
        fn()
        torch.cuda.synchronize()
        prof = cProfile.Profile()
        for _ in range(calls):
            torch.cuda.synchronize()
            prof.enable()
            fn()
            prof.disable()
        out = io.StringIO()
        stats = pstats.Stats(prof, stream=out)
        print(f"  {direction} {name}: {stats.total_tt / calls * 1e6:.1f} us of Python per call; top by own time:")
        stats.sort_stats("tottime").print_stats(8)
        print("\n".join("    " + l for l in out.getvalue().splitlines() if l.strip() and "/" in l)[:3000], flush=True)


if __name__ == "__main__":
    main()
