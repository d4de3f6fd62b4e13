"""Every kernel, every config, ragged shapes — small enough to run under NVIDIA compute-sanitizer.

The workload (``python -m chunkstate.sanitize``) launches the forward and backward kernels (plain,
as sequence pieces in one launch and, where a batch holds an empty sequence, as the two passes of
sequence pieces) and the pieces' scan kernel (both directions) on ragged cases —
T not a multiple of the chunk, K and V not multiples of any tile, packed batches with empty and
one-token sequences, a batch of only empty sequences, GQA, split sizes of 1, 2 and 4 chunks, both
state layouts and precisions — and, on the sweep case, with *every* config of
``tuning.ALL_CONFIGS`` valid for its shape (through ``config=``, so no autotuning runs). Every
result is checked against the float64 loop (``reference.recurrent_states`` / ``state_grads``,
computed on the CPU so the sanitizer does not slow it), and on the sweep case every launch is
repeated and must give the same bits: a race shows up as a wrong or changing answer even where
the sanitizer misses it. Outputs are allocated NaN-poisoned (``testing.nan_poisoned_empty``) so an
element never written fails the check. Exit status 1 on any mismatch or exception.

Run on a GPU machine. Each tool slows kernels ~10-100x, but the shapes are tiny: compilation
dominates. The full run compiles ~200 kernels (every config for the forward and the backward on
the sweep case, one per tile shape for the pieces' passes), ~1 s each the first time; Triton
caches them on disk, so later runs (the tools after ``--all-tools``' plain run) only load them.
``--quick`` (one config per tile shape, ~60 kernels) is meant to fit a 10-minute slot for all
three tools (not yet timed on the H200)::

    # one command: a plain run (warms Triton's cache), then the three tools in turn, one summary
    # line each; non-zero exit status if any tool reports an error or any check fails
    python -m chunkstate.sanitize --all-tools [--quick] [--parallel] [--timeout 600] [--tools memcheck,initcheck]

    # or each tool by hand (what --all-tools runs):
    PYTORCH_NO_CUDA_MEMORY_CACHING=1 compute-sanitizer --tool memcheck --error-exitcode 1 \\
        --report-api-errors no python -m chunkstate.sanitize [--quick]
    PYTORCH_NO_CUDA_MEMORY_CACHING=1 compute-sanitizer --tool racecheck --error-exitcode 1 \\
        --report-api-errors no python -m chunkstate.sanitize [--quick]
    PYTORCH_NO_CUDA_MEMORY_CACHING=1 compute-sanitizer --tool initcheck --error-exitcode 1 \\
        --report-api-errors no python -m chunkstate.sanitize --no-poison [--quick]

- memcheck: out-of-bounds and misaligned global / shared memory accesses (a missing mask at a
  ragged edge, an int32 offset that wrapped), and leaks.
- racecheck: shared-memory hazards between threads of a block (the pipelined loads and
  ``tl.dot`` staging that Triton generates).
- initcheck: reads of device memory never written. Outputs made by ``torch.empty`` that the kernel
  fully writes are fine; a kernel *reading* a buffer nobody wrote (say ``h0`` where none was
  passed, or an output it has not stored yet) is a bug. Run it with ``--no-poison``: the NaN
  poisoning fills every ``torch.empty``, which would hide such reads from initcheck; copying a
  never-written output element back to the host is then reported too.
  ``PYTORCH_NO_CUDA_MEMORY_CACHING=1`` makes every allocation a fresh ``cudaMalloc``, so memory
  a previous tensor wrote does not count as initialised (and memcheck sees exact bounds).
- ``--report-api-errors no``: torch and Triton probe the driver with calls that fail by design
  (e.g. pointer queries on host memory); those are not kernel errors.

**TMA descriptors and initcheck.** A config with ``USE_TMA`` builds each tensor descriptor on the
device (``kernel_parts.chunk_rows``): Triton fills the 128-byte descriptor in shared memory, then
copies it into a global *scratch* buffer (128 bytes per descriptor per program, from the
allocator set with ``triton.set_allocator``) with ``tensormap.cp_fenceproxy``, and the TMA unit
reads it from there. initcheck does not count that copy as a write, so with scratch from
``torch.empty`` it reports every 4-byte word of every descriptor as an uninitialised read at the
``make_tensor_descriptor`` line. Two checks show those reports are initcheck's blind spot, not a
read of memory nobody wrote, and the workload then runs with zero-filled scratch (``--scratch
zero``, the default: the memset is a write initcheck sees), so any *other* uninitialised read is
still reported:

- on a GPU every TMA launch is repeated with scratch filled with 0xFF bytes and must give the same
  bits as with zeros (``run_case``): the kernel reads no scratch byte it did not write;
- ``--scratch uninitialized`` (``torch.empty``, as the package itself allocates it) reproduces the
  reports; under initcheck with the default they are gone.

Measured on an H200 (``figures/README.md`` has the record): ``--quick --scratch uninitialized``
under initcheck gave 433,920 reports, every printed one a 4-byte read at the descriptor line by
threads 0-31 of a block, with every check right; the full run with the default zero scratch gave
no report from any tool, and every TMA launch gave the same bits with 0xFF scratch.

Without a GPU (Triton's interpreter, CPU tensors; no sanitizer): ``python -m chunkstate.sanitize
--quick --no-sanitizer`` runs the correctness part — configs that differ only in warps or stages
are one run there, so each distinct tile shape runs once (``--quick``: the smallest and the largest).
Options: ``--list`` prints the cases and the configs each would run, ``-v`` prints every check.
"""
from __future__ import annotations

import argparse
import dataclasses
import os
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import time

import torch
import torch.nn.functional as F
import triton

from . import reference, tuning
from .backward import chunk_bwd_dh
from .env import DEVICE, INTERPRET
from .forward import chunk_fwd_h
from .gates import RCP_LN2, chunk_local_cumsum
from .testing import nan_poisoned_empty, rel_err

GATE_NAMES = ("g", "g_gamma", "gk", "gv")
TOOLS = ("memcheck", "racecheck", "initcheck")
RESULT_LINE = "RESULT:"


@dataclasses.dataclass(frozen=True)
class Case:
    """One ragged shape and its flags. ``cu``: packed-batch offsets (then B = 1) or None."""
    name: str
    B: int
    T: int
    H: int
    G: int  # query heads per KV head (the backward's GQA)
    K: int
    V: int
    BT: int
    BS: int | None
    cu: tuple[int, ...] | None
    gates: tuple[str, ...]
    h0: bool
    ht: bool
    dht: bool
    state_v_first: bool = False
    states_in_fp32: bool = False
    pieces: tuple[int, ...] = (1,)  # piece counts to run (1: the plain kernel), forward and backward
    fp32: bool = False  # fp32 inputs (tf32 dots on a GPU); else bf16 on a GPU, fp32 on the CPU
    sweep: bool = False  # every config of ALL_CONFIGS valid for the shape
    gpu_only: bool = False


CASES = [
    # the sweep: K, V ragged for every tile (72, 80 -> tiles up to 128 fit), split 2 chunks,
    # sequences of 0, 1, 62, 0, 67, 70 tokens with BT 32, every gate, GQA, pieces 3
    Case("varlen-gqa-all-gates", 1, 200, 2, 2, 72, 80, 32, 64, (0, 0, 1, 63, 63, 130, 200), GATE_NAMES,
         h0=True, ht=True, dht=True, pieces=(1, 3), sweep=True),
    Case("dense-vk-fp32states-split4", 2, 100, 3, 3, 20, 36, 16, 64, None, ("g_gamma", "gv"),
         h0=False, ht=True, dht=True, state_v_first=True, states_in_fp32=True, pieces=(1, 2)),
    Case("one-token", 3, 1, 1, 1, 16, 16, 16, None, None, ("g",), h0=True, ht=True, dht=False),
    Case("only-empty-sequences", 1, 0, 2, 1, 24, 40, 16, None, (0, 0, 0), ("gk",), h0=True, ht=True, dht=True),
    Case("pieces-gv-varlen-vk", 1, 300, 2, 1, 64, 48, 16, 32, (0, 0, 150, 151, 300), ("g", "gv"),
         h0=True, ht=True, dht=True, state_v_first=True, pieces=(2, 3)),
    # no empty sequence: the pieces in one launch (pieces.ONE_LAUNCH), one-token sequences between long ones
    Case("pieces-one-launch-varlen", 1, 300, 2, 2, 40, 72, 16, 32, (0, 1, 150, 151, 300), GATE_NAMES,
         h0=True, ht=True, dht=True, pieces=(3, 4)),
    Case("fp32-tf32", 1, 130, 2, 2, 40, 24, 64, None, None, ("gk",), h0=True, ht=True, dht=True,
         pieces=(1, 2), fp32=True, gpu_only=True),
]


# ---------------------------------------------------------------------------------------------
# Configs
# ---------------------------------------------------------------------------------------------

def fits(cfg: triton.Config, K: int, V: int) -> bool:
    """A config is valid for a shape when its tiles are no wider than K, V rounded up to a power
    of two (at least 16) — the rule ``tuning.prune`` applies."""
    return cfg.kwargs["BK"] <= max(16, triton.next_power_of_2(K)) and \
        cfg.kwargs["BV"] <= max(16, triton.next_power_of_2(V))


def fits_device(cfg: triton.Config, case: Case, on_gpu: bool) -> bool:
    """On a GPU, whether the config's shared memory (``tuning.shared_memory`` for the case's gates,
    chunk and input dtype) fits this GPU's (``tuning.device_limits``: an A100 or an RTX 4090 has
    less than the H200); always True under the interpreter."""
    if not on_gpu:
        return True
    device = tuning.device_limits("cuda" if torch.cuda.is_available() else None)
    BK, BV, _, stages, use_tma = tuning.config_tuple(cfg)
    need = tuning.shared_memory(BK, BV, stages, BT=case.BT, in_bytes=input_dtype(case, True).itemsize,
                                g="g" in case.gates, gk="gk" in case.gates, gv="gv" in case.gates, tma=use_tma,
                                device=device)
    return need <= device.smem


def _one_per_tile(configs):
    """One config per (BK, BV) and load kind (pointers or TMA): the deepest pipeline (most stages,
    then most warps)."""
    best = {}
    for c in configs:
        key = (c.kwargs["BK"], c.kwargs["BV"], bool(c.kwargs.get("USE_TMA", False)))
        if key not in best or (c.num_stages, c.num_warps) > (best[key].num_stages, best[key].num_warps):
            best[key] = c
    return [best[k] for k in sorted(best)]


def input_dtype(case: Case, on_gpu: bool) -> torch.dtype:
    """The dtype of k, v, q, do: fp32 for an ``fp32`` case and under the interpreter (which gets
    bf16 wrong), else bf16."""
    return torch.float32 if (case.fp32 or not on_gpu) else torch.bfloat16


def tma_allowed(case: Case, on_gpu: bool) -> bool:
    """Whether the wrappers would let this case's inputs be read through TMA descriptors: the rule
    of ``tuning.tma_usable`` applied to the shapes and dtypes (every row of k, v, q, do in the
    input dtype and of gk, gv in fp32 a whole number of 16-byte units; the tensors the workload
    makes are contiguous and aligned) and, on a GPU, ``tuning.tma_device``. The interpreter reads
    any row through a descriptor, so the rule is applied there too: a config that a GPU would
    refuse is never picked, on any machine."""
    size = input_dtype(case, on_gpu).itemsize
    rows = [(case.K, size), (case.V, size)]
    rows += [(case.K, 4)] if "gk" in case.gates else []
    rows += [(case.V, 4)] if "gv" in case.gates else []
    device_ok = tuning.tma_device("cuda") if on_gpu and torch.cuda.is_available() else True
    return device_ok and all(tuning.tma_rows(D, s) for D, s in rows)


def configs_for(case: Case, quick: bool, on_gpu: bool | None = None) -> tuple[list[triton.Config], list[triton.Config]]:
    """The configs a case runs: (for the plain forward and the backward, for the pieces' passes),
    only ones the wrappers accept for it (tiles that fit K and V, TMA loads only where
    ``tma_allowed``) and, on a GPU, that fit its shared memory (``fits_device``). ``on_gpu``:
    choose as on a GPU (default: whether this machine runs compiled).

    Sweep case on a GPU: every valid config (``--quick``: one per tile shape); the pieces' two
    forward passes (two more specialisations per config) take one config per tile shape. Under
    the interpreter warps and stages change nothing, so one config per tile shape (``--quick``:
    the largest tile only — the interpreter pays per program). Other cases: a small and a large
    tile (``--quick``: the large one)."""
    on_gpu = (DEVICE == "cuda") if on_gpu is None else on_gpu
    tma = tma_allowed(case, on_gpu)
    valid = [c for c in tuning.ALL_CONFIGS if fits(c, case.K, case.V) and (tma or not c.kwargs.get("USE_TMA", False))
             and fits_device(c, case, on_gpu)]
    if not valid:  # K, V <= 16: a 16-wide tile, as prune clips the candidates
        BK = min(32, max(16, triton.next_power_of_2(case.K)))
        BV = min(32, max(16, triton.next_power_of_2(case.V)))
        valid = [triton.Config({"BK": BK, "BV": BV}, num_warps=4, num_stages=2)]
    per_tile = _one_per_tile(valid)
    if case.sweep and not on_gpu:
        chosen = per_tile[-1:] if quick else per_tile
        return chosen, chosen
    if case.sweep:
        return (per_tile, per_tile) if quick else (valid, per_tile)
    chosen = per_tile[-1:] if quick or len(per_tile) == 1 else [per_tile[0], per_tile[-1]]
    return chosen, chosen


# ---------------------------------------------------------------------------------------------
# The workload
# ---------------------------------------------------------------------------------------------

def _inputs(case: Case):
    """Random inputs on the CPU (float for the reference) and their kernel-side copies."""
    B, T, H, K, V, HQ = case.B, case.T, case.H, case.K, case.V, case.H * case.G
    N = B if case.cu is None else len(case.cu) - 1
    dtype = input_dtype(case, DEVICE == "cuda")
    cpu = dict(k=torch.randn(B, T, H, K).to(dtype), v=torch.randn(B, T, H, V).to(dtype),
               q=torch.randn(B, T, HQ, K).to(dtype), do=torch.randn(B, T, HQ, V).to(dtype),
               h0=torch.randn(N, H, K, V) if case.h0 else None, dht=torch.randn(N, H, K, V) if case.dht else None,
               cu=None if case.cu is None else torch.tensor(case.cu, dtype=torch.int32))
    shapes = {"g": (B, T, H), "g_gamma": (H,), "gk": (B, T, H, K), "gv": (B, T, H, V)}
    nat = {}
    for n in case.gates:
        nat[n] = -torch.empty(H).uniform_(0.01, 0.06) if n == "g_gamma" else F.logsigmoid(4 + torch.randn(*shapes[n]))
    kg = {n: x * RCP_LN2 if n == "g_gamma" else chunk_local_cumsum(x, case.BT, cpu["cu"]) for n, x in nat.items()}
    dev = {name: None if x is None else x.to(DEVICE) for name, x in cpu.items()}
    for name in ("h0", "dht"):  # the kernels take [V, K] states with state_v_first
        if dev[name] is not None and case.state_v_first:
            dev[name] = dev[name].transpose(-1, -2).contiguous()
    return cpu, nat, dev, {n: x.to(DEVICE) for n, x in kg.items()}, dtype


def _tolerance(dtype) -> float:
    if dtype == torch.bfloat16:
        return 1e-2  # three 2^-8 roundings (decayed operand, dot inputs, stored state)
    return 1e-5 if INTERPRET else 2e-3  # exact fp32 dots under the interpreter; tf32 on a GPU


SCRATCH_FILLS = {"zero": 0x00, "ones": 0xFF, "uninitialized": None}  # --scratch: byte each scratch buffer holds


def use_scratch(fill: str) -> None:
    """Make Triton's scratch buffers (where TMA descriptors are built) torch tensors filled with the
    byte ``SCRATCH_FILLS[fill]``, or left unwritten (``"uninitialized"``: ``torch.empty``, as
    ``tuning.ensure_allocator`` does). See the module docstring."""
    value = SCRATCH_FILLS[fill]

    def allocate(size: int, alignment: int, stream):
        if value is None:
            return torch.empty(size, dtype=torch.uint8, device="cuda")
        return torch.full((size,), value, dtype=torch.uint8, device="cuda")

    triton.set_allocator(allocate)


class Checker:
    def __init__(self, verbose: bool):
        self.checks, self.failures, self.verbose = 0, [], verbose

    def close(self, what: str, out, ref, tol: float) -> None:
        self.checks += 1
        out = out.detach().cpu()
        err = rel_err(out, ref)
        ok = err < tol  # NaN (an element never written) fails
        if not ok:
            self.failures.append(f"{what}: relative error {err:.3e} (tolerance {tol:.0e})")
            print(f"  MISMATCH {self.failures[-1]}", flush=True)
        elif self.verbose:
            print(f"  ok {what}: {err:.2e}", flush=True)

    def same(self, what: str, a, b) -> None:
        self.checks += 1
        if not torch.equal(a.detach().cpu(), b.detach().cpu()):
            self.failures.append(f"{what}: a repeated launch gave different bits (a race?)")
            print(f"  MISMATCH {self.failures[-1]}", flush=True)

    def fail(self, what: str, e: BaseException) -> None:
        self.checks += 1
        self.failures.append(f"{what}: {type(e).__name__}: {e}")
        print(f"  ERROR {self.failures[-1]}", flush=True)


def _kv(x, case):
    """A kernel state back in the [.., K, V] layout."""
    return None if x is None else (x.transpose(-1, -2) if case.state_v_first else x)


def scratch_check(check: Checker, what: str, launch, first, outs, scratch: str) -> None:
    """Launch again with every scratch byte 0xFF: a kernel that reads only descriptor bytes it wrote
    gives the same bits as with the workload's own scratch (module docstring)."""
    use_scratch("ones")
    try:
        again = launch()
        torch.cuda.synchronize()
    except Exception as e:  # noqa: BLE001
        check.fail(f"{what} (scratch 0xFF)", e)
        return
    finally:
        use_scratch(scratch)
    for name, i, present in outs:
        if present:
            check.same(f"{what} {name} (scratch 0xFF vs {scratch})", first[i], again[i])


def run_case(case: Case, configs, piece_configs, check: Checker, poison: bool, scratch: str = "zero") -> None:
    cpu, nat, dev, kg, dtype = _inputs(case)
    tol = _tolerance(dtype)
    h_ref, ht_ref = reference.recurrent_states(cpu["k"], cpu["v"], **nat, h0=cpu["h0"], cu_seqlens=cpu["cu"],
                                               chunk_size=case.BT, split_size=case.BS)
    scale = case.K ** -0.5
    if case.T == 0 and cpu["dht"] is None:  # no output and no dht: every gradient is zero
        dh_ref, dh0_ref = h_ref.clone(), torch.zeros_like(ht_ref)
    else:
        dh_ref, dh0_ref = reference.state_grads(cpu["q"], cpu["k"], cpu["v"], cpu["do"], **nat, h0=cpu["h0"],
                                                dht=cpu["dht"], cu_seqlens=cpu["cu"], scale=scale,
                                                chunk_size=case.BT, split_size=case.BS)
    poisoned = nan_poisoned_empty if poison else _no_poison
    repeats = 2 if case.sweep and not INTERPRET else 1  # the interpreter has no races to repeat
    common = dict(state_v_first=case.state_v_first, cu_seqlens=dev["cu"], chunk_size=case.BT,
                  split_size=case.BS, states_in_fp32=case.states_in_fp32)

    def forward(cfg, P):
        return chunk_fwd_h(dev["k"], dev["v"], **kg, h0=dev["h0"], output_final_state=case.ht, pieces=P,
                           config=cfg, **common)

    def backward(cfg, P):
        return chunk_bwd_dh(dev["q"], dev["k"], dev["v"], dev["do"], dev["h0"], dev["dht"], scale, **kg,
                            config=cfg, pieces=P, **common)

    kernels = [("forward", forward, ("h", "ht"), (h_ref, ht_ref), case.ht),
               ("backward", backward, ("dh", "dh0"), (dh_ref, dh0_ref), case.h0)]
    for cfg in configs:
        for direction, run, names, refs, second in kernels:
            for P in case.pieces:
                if P > 1 and cfg not in piece_configs:
                    continue
                what = f"{case.name} {tuning.config_label(cfg)} {direction} pieces={P}"
                try:
                    runs = []
                    for _ in range(repeats):
                        with poisoned():
                            runs.append(run(cfg, P))
                        if DEVICE == "cuda":
                            torch.cuda.synchronize()
                except Exception as e:  # a launch error, or a CUDA error the sanitizer provoked
                    check.fail(what, e)
                    continue
                outs = [(names[0], 0, True), (names[1], 1, second)]  # (name, index, returned?)
                for name, i, present in outs:
                    if not present:
                        continue
                    check.close(f"{what} {name}", _kv(runs[0][i], case), refs[i], tol)
                    for again in runs[1:]:
                        check.same(f"{what} {name}", runs[0][i], again[i])
                if DEVICE == "cuda" and cfg.kwargs.get("USE_TMA", False):
                    scratch_check(check, what, lambda: run(cfg, P), runs[0], outs, scratch)


class _no_poison:
    def __enter__(self):
        return self

    def __exit__(self, *exc):
        return False


def selected_cases(quick: bool) -> list[Case]:
    cases = [c for c in CASES if DEVICE == "cuda" or not c.gpu_only]
    if quick and INTERPRET:  # the interpreter costs ~10 ms per program per chunk: the big case once
        cases = [c for c in cases if c.name != "pieces-gv-varlen-vk"]
    return cases


def workload(quick: bool, poison: bool, verbose: bool, seed: int, scratch: str = "zero") -> int:
    """Run every selected case with its configs; print one line per case and a RESULT line.
    Returns the exit status (1 on any mismatch or error)."""
    if DEVICE == "cuda":
        use_scratch(scratch)
    check = Checker(verbose)
    start = time.time()
    for case in selected_cases(quick):
        configs, piece_configs = configs_for(case, quick)
        t0, f0, c0 = time.time(), len(check.failures), check.checks
        run_case(case, configs, piece_configs, check, poison, scratch)
        status = "ok" if len(check.failures) == f0 else f"{len(check.failures) - f0} FAILED"
        print(f"{case.name}: {len(configs)} configs, pieces {case.pieces}, {check.checks - c0} checks: {status} "
              f"({time.time() - t0:.1f} s)", flush=True)
    print(f"{RESULT_LINE} {check.checks} checks, {len(check.failures)} failures on {DEVICE} "
          f"({'interpreter' if INTERPRET else 'compiled'}, {'quick' if quick else 'full'}, seed {seed}, "
          f"scratch {scratch}) in "
          f"{time.time() - start:.0f} s", flush=True)
    return 1 if check.failures else 0


# ---------------------------------------------------------------------------------------------
# --all-tools: compute-sanitizer driven from Python
# ---------------------------------------------------------------------------------------------

def find_sanitizer() -> str | None:
    found = shutil.which("compute-sanitizer")
    if found:
        return found
    for root in (os.environ.get("CUDA_HOME"), os.environ.get("CUDA_PATH"), "/usr/local/cuda"):
        if root and os.path.exists(os.path.join(root, "bin", "compute-sanitizer")):
            return os.path.join(root, "bin", "compute-sanitizer")
    return None


def sanitizer_command(exe: str, tool: str, quick: bool, scratch: str = "zero") -> list[str]:
    """The exact command for one tool (the module docstring shows it as shell)."""
    cmd = [exe, "--tool", tool, "--error-exitcode", "1", "--report-api-errors", "no",
           sys.executable, "-m", "chunkstate.sanitize", "--scratch", scratch]
    if quick:
        cmd.append("--quick")
    if tool == "initcheck":
        cmd.append("--no-poison")
    return cmd


def _run_bounded(cmd, env, timeout, log_path) -> tuple[int | None, str, float]:
    """Run ``cmd`` in its own process group, output to ``log_path``; kill that group on timeout.
    Returns (exit status or None on timeout, the output, seconds)."""
    t0 = time.time()
    with open(log_path, "w") as log:
        proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=env, start_new_session=True)
        try:
            rc = proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)  # the group this call started: the sanitizer and python
            proc.wait()
            rc = None
    with open(log_path) as log:
        return rc, log.read(), time.time() - t0


def _summary(name: str, rc, out: str, secs: float, timeout: float, log_path: str) -> tuple[bool, str]:
    # "ERROR SUMMARY: N errors", not the "ERROR SUMMARY: M errors were not printed" that follows it
    errors = re.findall(r"ERROR SUMMARY: (\d+) errors?$", out, re.MULTILINE)
    result = [line for line in out.splitlines() if line.startswith(RESULT_LINE)]
    ok = rc == 0 and bool(result) and all(e == "0" for e in errors)
    state = "OK" if ok else ("TIMEOUT" if rc is None else "FAILED")
    parts = [f"{name:<9} {state:<7}", f"exit {rc}" if rc is not None else f"killed after {timeout:.0f} s"]
    if errors:
        parts.append(f"sanitizer errors {errors[-1]}")
    parts.append(result[-1][len(RESULT_LINE):].strip().split(" on ")[0] if result else "no RESULT line")
    parts.append(f"{secs:.0f} s, log {log_path}")
    return ok, " | ".join(parts)


def all_tools(tools, quick: bool, timeout: float, log_dir: str | None, parallel: bool = False,
              scratch: str = "zero") -> int:
    """A plain run (warms Triton's on-disk cache, checks results), then each tool in turn, or,
    with ``parallel``, all tools at once (each in its own process, on the same GPU)."""
    if DEVICE != "cuda":
        print("--all-tools needs a CUDA GPU and compute-sanitizer; without one run "
              "`python -m chunkstate.sanitize --quick --no-sanitizer`", file=sys.stderr)
        return 2
    exe = find_sanitizer()
    if exe is None:
        print("compute-sanitizer not found (PATH, $CUDA_HOME/bin, /usr/local/cuda/bin)", file=sys.stderr)
        return 2
    log_dir = log_dir or tempfile.mkdtemp(prefix="chunkstate-sanitize-")
    os.makedirs(log_dir, exist_ok=True)
    env = dict(os.environ, PYTORCH_NO_CUDA_MEMORY_CACHING="1")
    plain = [sys.executable, "-m", "chunkstate.sanitize", "--no-sanitizer", "--scratch", scratch]
    plain += ["--quick"] if quick else []
    tool_runs = [(tool, sanitizer_command(exe, tool, quick, scratch)) for tool in tools]

    def run(name, cmd) -> bool:
        log_path = os.path.join(log_dir, f"{name}.log")
        print(f"running {name}: {' '.join(cmd)}", flush=True)
        rc, out, secs = _run_bounded(cmd, env, timeout, log_path)
        ok, line = _summary(name, rc, out, secs, timeout, log_path)
        print(line + ("" if ok else "\n" + "\n".join("    " + s for s in out.splitlines()[-25:])), flush=True)
        return ok

    all_ok = run("plain", plain)  # compiles every kernel once: the tools then load them from disk
    if parallel and len(tool_runs) > 1:
        from concurrent.futures import ThreadPoolExecutor

        with ThreadPoolExecutor(len(tool_runs)) as pool:
            all_ok &= all(list(pool.map(lambda r: run(*r), tool_runs)))
    else:
        for name, cmd in tool_runs:
            all_ok &= run(name, cmd)
    return 0 if all_ok else 1


# ---------------------------------------------------------------------------------------------

def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="python -m chunkstate.sanitize", description=__doc__.split("\n")[0])
    p.add_argument("--quick", action="store_true", help="a subset of configs and cases")
    p.add_argument("--no-sanitizer", action="store_true",
                   help="run the checks directly (CPU/interpreter, or a GPU outside compute-sanitizer)")
    p.add_argument("--no-poison", action="store_true",
                   help="do not NaN-fill torch.empty (for initcheck, which must see unwritten memory)")
    p.add_argument("--all-tools", action="store_true",
                   help="run compute-sanitizer memcheck, racecheck and initcheck over this workload")
    p.add_argument("--tools", default=",".join(TOOLS), help="with --all-tools: which tools (comma-separated)")
    p.add_argument("--timeout", type=float, default=600, help="with --all-tools: seconds per tool run")
    p.add_argument("--parallel", action="store_true",
                   help="with --all-tools: run the tools at once after the plain run (wall time of the slowest)")
    p.add_argument("--log-dir", default=None, help="with --all-tools: where the full logs go (default: a temp dir)")
    p.add_argument("--list", action="store_true", help="print the cases and their configs, run nothing")
    p.add_argument("--seed", type=int, default=None, help="seed the inputs (default: fresh every run, printed)")
    p.add_argument("--scratch", choices=sorted(SCRATCH_FILLS), default="zero",
                   help="what Triton's scratch buffers (TMA descriptors) hold before a launch: zero (default), "
                        "ones (0xFF) or uninitialized (torch.empty: initcheck then reports the descriptor "
                        "copies it cannot see; module docstring)")
    p.add_argument("-v", "--verbose", action="store_true", help="print every check")
    args = p.parse_args(argv)
    if args.list:
        for case in selected_cases(args.quick):
            configs, piece_configs = configs_for(case, args.quick)
            print(f"{case.name}: {len(configs)} configs {[tuning.config_label(c) for c in configs]}; pieces {case.pieces} "
                  f"with {len(piece_configs)} of them")
        return 0
    if args.all_tools:
        tools = [t for t in args.tools.split(",") if t]
        bad = [t for t in tools if t not in TOOLS]
        if bad:
            p.error(f"--tools takes {', '.join(TOOLS)}; got {bad}")
        return all_tools(tools, args.quick, args.timeout, args.log_dir, args.parallel, args.scratch)
    if DEVICE != "cuda" and not args.no_sanitizer:
        p.error("no CUDA GPU here, so no compute-sanitizer: pass --no-sanitizer to run the checks under "
                "Triton's interpreter (add --quick for a short run)")
    seed = int.from_bytes(os.urandom(4), "little") if args.seed is None else args.seed  # fresh inputs by default
    torch.manual_seed(seed)
    return workload(args.quick, not args.no_poison, args.verbose, seed, args.scratch)


if __name__ == "__main__":
    sys.exit(main())
