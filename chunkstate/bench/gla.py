"""``python -m chunkstate.bench --gla``: ``chunkstate.chunk_gla`` against fla-core's op, on a GPU.

``chunk_gla``'s intra-chunk part is plain PyTorch written to be read; fla fuses it into Triton
kernels. This times both, forward and forward + backward, on the same inputs: the median of
``triton.testing.do_bench`` (``WARMUP_MS``, ``REP_MS``; gradients reset between calls) and the
first call's wall seconds (compiling and autotuning included). ``run_gla`` prints a table and
writes ``<out>/bench_<gpu>_gla.json`` (``report.gpu_tag``: ``bench_h200_gla.json`` on an H200).
"""
from __future__ import annotations

import time

import torch

from ..env import INTERPRET
from ..gla import chunk_gla

WARMUP_MS, REP_MS = 25, 100  # do_bench per measurement (Triton's defaults)
GLA_CASE = {"B": 8, "T": 4096, "H": 16, "K": 128, "V": 128, "gate": "gk", "chunk_size": 64}  # --gla, in bf16


def time_chunk_gla(B: int = 8, T: int = 4096, H: int = 16, K: int = 128, V: int = 128,
                   dtype: torch.dtype = torch.bfloat16, gate: str = "gk", chunk_size: int = 64) -> dict:
    """Median times (ms) of the forward and of forward + backward of :func:`chunkstate.chunk_gla`
    and of fla's op on the same inputs, and each one's first-call seconds (``"fwd first s"``),
    printed as they are measured (fla's first call can take minutes) and returned as
    ``{"chunkstate": {...}, "fla": {...} or a string saying why not}``.

    ``gate="gk"`` compares with ``fla.ops.gla.chunk_gla`` (per-key gate), ``gate="g"`` with
    ``fla.ops.simple_gla.chunk_simple_gla`` (scalar gate). Gates are ``logsigmoid`` of N(0, 1) in
    fp32 (natural log); ``do`` is a fixed random gradient; every input needs a gradient. fla's
    entry is a string where fla is not importable, and says so where it refuses to run (fla 0.6.0
    raises for the gated simple-GLA backward on Hopper with Triton < 3.7.1). Raises RuntimeError
    without a CUDA GPU (or under the interpreter), ValueError for another ``gate``.
    """
    if not torch.cuda.is_available() or INTERPRET:
        raise RuntimeError("timing chunk_gla needs a CUDA GPU (chunkstate's kernels compiled, not interpreted)")
    if gate not in ("g", "gk"):
        raise ValueError(f'gate must be "g" or "gk", got {gate!r}')
    from triton.testing import do_bench

    dev = "cuda"
    q, k = (torch.randn(B, T, H, K, device=dev, dtype=dtype, requires_grad=True) for _ in range(2))
    v = torch.randn(B, T, H, V, device=dev, dtype=dtype, requires_grad=True)
    shape = (B, T, H) if gate == "g" else (B, T, H, K)
    a = torch.nn.functional.logsigmoid(torch.randn(*shape, device=dev)).requires_grad_()
    do = torch.randn(B, T, H, V, device=dev, dtype=dtype)
    leaves = [q, k, v, a]

    def ours():
        return chunk_gla(q, k, v, **{gate: a}, chunk_size=chunk_size)[0]

    try:
        if gate == "gk":
            from fla.ops.gla import chunk_gla as fla_op
        else:
            from fla.ops.simple_gla import chunk_simple_gla as fla_op

        def theirs():
            return fla_op(q, k, v, g=a)[0]
    except ImportError as e:
        theirs = f"fla not importable ({e})"

    print(f"chunk_gla B{B} T{T} H{H} K{K} V{V} {str(dtype).replace('torch.', '')} gate={gate} BT={chunk_size} "
          "(median ms; 'first': the first call's seconds, compiling and autotuning included):", flush=True)
    results = {}
    for name, f in (("chunkstate", ours), ("fla", theirs)):
        if isinstance(f, str):
            results[name] = f
            print(f"  {name:10s} {f}", flush=True)
            continue
        results[name] = {}
        for what, fn in (("fwd", f), ("fwd+bwd", lambda f=f: f().backward(do))):
            try:
                torch.cuda.synchronize()
                t0 = time.perf_counter()
                fn()
                torch.cuda.synchronize()
                first = time.perf_counter() - t0
                results[name][what] = do_bench(fn, warmup=WARMUP_MS, rep=REP_MS, grad_to_none=leaves,
                                                   return_mode="median")
                results[name][what + " first s"] = first
                print(f"  {name:10s} {what:8s} {results[name][what]:.3f} ms (first {first:.1f} s)", flush=True)
            except RuntimeError as e:
                if name == "chunkstate":
                    raise
                results[name][what] = f"fla raised: {e}"
                print(f"  {name:10s} {what:8s} fla raised: {e}", flush=True)
    return results


def format_gla(results: dict) -> str:
    """The timings of ``time_chunk_gla`` as a small table, with fla / chunkstate where both ran."""
    ours, fla = results.get("chunkstate"), results.get("fla")
    lines = [f"{'':10s} {'fwd ms':>9s} {'fwd+bwd ms':>11s}"]
    for name, r in (("chunkstate", ours), ("fla", fla)):
        if isinstance(r, dict):
            cells = [f"{r[w]:.3f}" if isinstance(r.get(w), float) else "-" for w in ("fwd", "fwd+bwd")]
            lines.append(f"{name:10s} {cells[0]:>9s} {cells[1]:>11s}")
        else:
            lines.append(f"{name:10s} {r}")
    if isinstance(ours, dict) and isinstance(fla, dict):
        ratios = [f"{fla[w] / ours[w]:.2f}" if isinstance(fla.get(w), float) and ours.get(w) else "-"
                  for w in ("fwd", "fwd+bwd")]
        lines.append(f"{'fla/ours':10s} {ratios[0]:>9s} {ratios[1]:>11s}  (<1: fla faster)")
    return "\n".join(lines)


def run_gla(args, cache: dict) -> dict:
    """Time ``chunk_gla`` against fla's at ``GLA_CASE`` (bf16), print the table and write the
    report into ``args.out`` (``cache``: Triton's cache dir, as the other modes record it)."""
    from . import runner
    from .report import output_paths, write_json

    results = time_chunk_gla(**GLA_CASE)
    meta = {**runner.run_info("gla", cache),
            "do_bench": {"warmup_ms": WARMUP_MS, "rep_ms": REP_MS, "statistic": "median"}}
    report = {"meta": meta, "gla": {**GLA_CASE, "dtype": "bfloat16", "results": results}}
    json_path, _ = output_paths(args.out, "gla", runner.gpu_here())
    write_json(report, json_path)
    print(format_gla(results))
    print(f"wrote {json_path}")
    return report
