"""``python -m chunkstate.sanitize --all-tools``: the driver that runs the workload plainly and
under each compute-sanitizer tool. On CPU the tool runs are faked (``_run_bounded``), so what is
tested is the driver: the order, the parallel mode, and that any failure, report or timeout fails
the whole run. The workload itself runs under the interpreter in ``test_workload_on_cpu``."""
from __future__ import annotations

import threading
import time

import pytest

import chunkstate
from chunkstate import sanitize

OK_OUTPUT = "RESULT: 12 checks, 0 failures on cpu\n========= ERROR SUMMARY: 0 errors\n"


@pytest.fixture
def fake_runs(monkeypatch):
    """Every tool run recorded as (name, start, end); outputs by name (default: clean)."""
    runs, outputs, lock = [], {}, threading.Lock()

    def fake_run_bounded(cmd, env, timeout, log_path):
        name = log_path.rsplit("/", 1)[-1].removesuffix(".log")
        t0 = time.perf_counter()
        time.sleep(0.3)
        with lock:
            runs.append((name, t0, time.perf_counter(), cmd))
        rc, out = outputs.get(name, (0, OK_OUTPUT))
        return rc, out, 0.3

    monkeypatch.setattr(sanitize, "DEVICE", "cuda")
    monkeypatch.setattr(sanitize, "find_sanitizer", lambda: "/opt/cuda/bin/compute-sanitizer")
    monkeypatch.setattr(sanitize, "_run_bounded", fake_run_bounded)
    return runs, outputs


def test_tools_in_turn(fake_runs, tmp_path, capsys):
    runs, _ = fake_runs
    assert sanitize.all_tools(list(sanitize.TOOLS), True, 60, str(tmp_path)) == 0
    assert [r[0] for r in runs] == ["plain", "memcheck", "racecheck", "initcheck"]
    assert all(a[2] <= b[1] for a, b in zip(runs, runs[1:]))  # one after another
    plain, *tools = [r[3] for r in runs]
    assert "--no-sanitizer" in plain and "--quick" in plain
    assert all(cmd[0].endswith("compute-sanitizer") and cmd[cmd.index("--tool") + 1] == name
               for (name, *_), cmd in zip(runs[1:], tools))
    assert "--no-poison" in tools[2] and "--no-poison" not in tools[0]  # initcheck must see unwritten memory
    assert capsys.readouterr().out.count(" OK ") == 4


def test_tools_at_once_after_the_plain_run(fake_runs, tmp_path):
    runs, _ = fake_runs
    assert sanitize.all_tools(list(sanitize.TOOLS), False, 60, str(tmp_path), parallel=True) == 0
    by_name = {r[0]: r for r in runs}
    assert set(by_name) == {"plain", *sanitize.TOOLS}
    plain_end = by_name["plain"][2]
    tools = [by_name[t] for t in sanitize.TOOLS]
    assert all(t[1] >= plain_end for t in tools)  # the plain run warms the cache first
    assert max(t[1] for t in tools) < min(t[2] for t in tools)  # and then all tools overlap


@pytest.mark.parametrize("parallel", [False, True])
@pytest.mark.parametrize("what", ["sanitizer report", "failed check", "timeout", "no result line"])
def test_any_problem_fails_the_run(what, parallel, fake_runs, tmp_path, capsys):
    _, outputs = fake_runs
    outputs["racecheck"] = {
        "sanitizer report": (1, OK_OUTPUT.replace("0 errors", "3 errors")),
        "failed check": (1, "RESULT: 12 checks, 1 failures on cuda\n"),
        "timeout": (None, "RESULT line never printed"),
        "no result line": (0, "Traceback (most recent call last): ...\n"),
    }[what]
    assert sanitize.all_tools(list(sanitize.TOOLS), True, 60, str(tmp_path), parallel=parallel) == 1
    out = capsys.readouterr().out
    assert out.count(" OK ") == 3 and ("TIMEOUT" if what == "timeout" else "FAILED") in out


def test_without_a_gpu_it_says_what_to_run(monkeypatch, capsys):
    monkeypatch.setattr(sanitize, "DEVICE", "cpu")
    assert sanitize.all_tools(list(sanitize.TOOLS), True, 60, None) == 2
    assert "--no-sanitizer" in capsys.readouterr().err


@pytest.mark.skipif(chunkstate.DEVICE == "cuda", reason="on a GPU this workload runs under compute-sanitizer: "
                    "python -m chunkstate.sanitize --all-tools (about 90 s of compiling, too long for the suite)")
def test_workload_on_cpu(capsys):
    """The sanitizer's own workload, quick, under the interpreter: every case passes its checks."""
    assert sanitize.main(["--quick", "--no-sanitizer"]) == 0
    out = capsys.readouterr().out
    assert "RESULT:" in out and " 0 failures" in out


@pytest.mark.parametrize("on_gpu", [True, False], ids=["as-on-gpu", "interpreter"])
@pytest.mark.parametrize("quick", [True, False], ids=["quick", "full"])
def test_every_picked_config_is_one_the_wrappers_accept(on_gpu, quick):
    """The workload picks, for each case, only configs the wrappers accept on the machine it runs
    on: tiles that fit K and V, and TMA loads only where every input row (k, v, q, do in the case's
    input dtype, gk and gv in fp32) is a whole number of 16-byte units. Checked as a GPU would
    choose, on any machine: the interpreter reads any row through a descriptor and would hide a
    wrong pick (it did: ``BK32-BV64-w4-s4-tma`` for bf16 rows of K = 20 refused on the H200)."""
    import torch

    from chunkstate import tuning

    def accepted(case, cfg):
        if not sanitize.fits(cfg, case.K, case.V):
            return False
        if not cfg.kwargs.get("USE_TMA", False):
            return True
        size = (torch.float32 if case.fp32 or not on_gpu else torch.bfloat16).itemsize
        rows = [(case.K, size), (case.V, size)] + [(case.K, 4)] * ("gk" in case.gates) + [(case.V, 4)] * ("gv" in case.gates)
        return all(tuning.tma_rows(D, s) for D, s in rows)

    for case in sanitize.CASES:
        plain, pieces = sanitize.configs_for(case, quick, on_gpu)
        assert plain and pieces, case.name
        bad = [tuning.config_label(c) for c in plain + pieces if not accepted(case, c)]
        assert not bad, f"{case.name}: configs the wrappers would refuse: {bad}"
    odd = next(c for c in sanitize.CASES if c.name == "dense-vk-fp32states-split4")
    assert not sanitize.tma_allowed(odd, on_gpu=True)  # bf16 rows of 20 and 36 elements: 40 and 72 bytes
    assert sanitize.tma_allowed(odd, on_gpu=False)  # fp32 under the interpreter: 80 and 144 bytes


def test_scratch_fill_reaches_every_run(fake_runs, tmp_path):
    """``--scratch`` (what TMA descriptor scratch holds before a launch) is passed to the plain run
    and to every tool, so ``--all-tools --scratch uninitialized`` reproduces initcheck's reports."""
    runs, _ = fake_runs
    assert sanitize.all_tools(list(sanitize.TOOLS), True, 60, str(tmp_path), scratch="uninitialized") == 0
    for name, *_, cmd in runs:
        assert cmd[cmd.index("--scratch") + 1] == "uninitialized", name


@pytest.mark.gpu
def test_tma_kernels_read_no_scratch_byte_they_did_not_write():
    """The descriptors a TMA config builds live in Triton's scratch buffers: the same launch with
    every scratch byte 0x00 and 0xFF gives the same bits (so initcheck's reports there are about
    the descriptor copy it cannot see, not about memory nobody wrote; sanitize's docstring)."""
    import torch
    import triton

    from chunkstate import tuning
    from chunkstate.gates import chunk_local_cumsum

    if not tuning.tma_device("cuda"):
        pytest.skip("this GPU has no TMA (compute capability < 9.0)")
    B, T, H, K, V = 2, 300, 3, 64, 64
    k, v = (torch.randn(B, T, H, D, device="cuda", dtype=torch.bfloat16) for D in (K, V))
    q, do = torch.randn_like(k), torch.randn_like(v)
    gk = chunk_local_cumsum(torch.nn.functional.logsigmoid(torch.randn(B, T, H, K, device="cuda")), 64)
    cfg = triton.Config({"BK": 64, "BV": 64, "USE_TMA": True}, num_warps=4, num_stages=3)
    outs = {}
    try:
        for fill in ("zero", "ones"):
            sanitize.use_scratch(fill)
            h, ht = chunkstate.chunk_fwd_h(k, v, gk=gk, output_final_state=True, config=cfg, pieces=1)
            dh, _ = chunkstate.chunk_bwd_dh(q, k, v, do, None, None, 0.125, gk=gk, config=cfg, pieces=1)
            outs[fill] = (h, ht, dh)
    finally:
        triton.set_allocator(tuning._torch_allocator)
    for a, b, name in zip(outs["zero"], outs["ones"], ("h", "ht", "dh")):
        assert torch.equal(a, b), f"{name} depends on what the scratch held"


def test_summary_reads_the_error_count_not_the_unprinted_count():
    """compute-sanitizer ends a noisy log with the count and then how many it did not print: the
    summary line must quote the first (it quoted the second, 433,820 for 433,920, on the H200)."""
    out = ("RESULT: 290 checks, 0 failures on cuda\n========= ERROR SUMMARY: 433920 errors\n"
           "========= ERROR SUMMARY: 433820 errors were not printed. Use --print-limit option to adjust\n")
    ok, line = sanitize._summary("initcheck", 1, out, 172.0, 400.0, "/tmp/initcheck.log")
    assert not ok and "sanitizer errors 433920" in line
    ok, line = sanitize._summary("memcheck", 0, OK_OUTPUT, 70.0, 400.0, "/tmp/memcheck.log")
    assert ok and "sanitizer errors 0" in line
