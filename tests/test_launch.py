"""Direct launches (``chunkstate.launch``): a launch seen before skips Triton's ``JITFunction.run``
and hands its arguments straight to the compiled kernel's launcher.

That is safe only if the key it is remembered under (``launch.direct_key``) tells apart every two
launches Triton would compile or launch differently. On the CPU that is checked against Triton's
own argument binder (what ``JITFunction.run`` specialises on), the autotune key and the TMA choice,
over launches the wrappers really build. On a GPU, a repeated call must take the direct path (no
``JITFunction.run``) and give bit for bit the first call's result, and a misaligned input, an
explicit config and a cleared autotuner cache must each go through Triton again.
"""
from __future__ import annotations

import itertools

import pytest
import torch
import torch.nn.functional as F
import triton
import triton.runtime.jit as jit
from triton.backends.compiler import BaseBackend

import chunkstate
from chunkstate import backward, forward, gates, launch, reference, tuning
from chunkstate.testing import check_close, nan_poisoned_empty

ON_GPU = chunkstate.DEVICE == "cuda"


def _compiled_twin(kernel):
    """The ``JITFunction`` of a chunkstate kernel: itself on a GPU, a compiled-mode twin of it (same
    function, same ``do_not_specialize``) under the interpreter."""
    if hasattr(kernel, "params"):
        return kernel
    return jit.JITFunction(kernel.fn, **kernel.kwargs)


def _misaligned(shape, dtype):
    """A contiguous tensor whose start is 4 bytes past a 16-byte boundary."""
    n = 1
    for s in shape:
        n *= s
    skip = 4 // torch.tensor([], dtype=dtype).element_size()
    return torch.randn(n + skip, device=chunkstate.DEVICE).to(dtype)[skip:].view(shape)


def _recorded_launches(monkeypatch):
    """Run the wrappers over launches that differ in one thing at a time; record each launch's
    (kernel, args, N) instead of running it."""
    seen = []
    monkeypatch.setattr(launch, "run", lambda tuned, kernel, args, **kw: seen.append((kernel, args, kw["N"])))
    dev = chunkstate.DEVICE

    def rand(*shape, dtype=torch.float32):
        return torch.randn(*shape, device=dev).to(dtype)

    for T, H, K, V, dtype in [(100, 2, 32, 32, torch.float32), (1, 2, 32, 32, torch.float32),
                              (16, 2, 32, 32, torch.float32), (17, 2, 32, 32, torch.float32),
                              (100, 1, 32, 32, torch.float32), (100, 2, 16, 32, torch.float32),
                              (100, 2, 32, 48, torch.float32), (100, 2, 32, 32, torch.float16)]:
        k, v, g = rand(1, T, H, K, dtype=dtype), rand(1, T, H, V, dtype=dtype), rand(1, T, H)
        chunkstate.chunk_fwd_h(k, v, g=g, chunk_size=16)
        chunkstate.chunk_fwd_h(k, v, chunk_size=16, output_final_state=True)
        chunkstate.chunk_fwd_h(k, v, gk=rand(1, T, H, K), h0=rand(1, H, K, V), chunk_size=16, split_size=32)
        chunkstate.chunk_fwd_h(k, v, g=g, chunk_size=16, state_v_first=True, states_in_fp32=True)
        chunkstate.chunk_fwd_h(_misaligned((1, T, H, K), dtype), v, g=g, chunk_size=16)
        chunkstate.chunk_bwd_dh(k, k, v, v, None, None, g=g, scale=0.5, chunk_size=16)
        chunkstate.chunk_bwd_dh(k, k, v, v, None, None, g=g, scale=1.0, chunk_size=16)
        chunkstate.chunk_bwd_dh(k, k, v, _misaligned((1, T, H, V), dtype), None, None, g=g, scale=1.0,
                                chunk_size=16)
        chunkstate.chunk_bwd_dh(k, k, v, v, rand(1, H, K, V), rand(1, H, K, V), gv=rand(1, T, H, V), scale=1.0,
                                chunk_size=16)
        if T > 1:
            cu = torch.tensor([0, T // 2, T], dtype=torch.int32, device=dev)
            chunkstate.chunk_fwd_h(k, v, g=g, cu_seqlens=cu, chunk_size=16)
            chunkstate.chunk_bwd_dh(k, k, v, v, None, None, g=g, scale=1.0, cu_seqlens=cu, chunk_size=16)
    return seen


def _triton_specialisation(twin, args: dict) -> tuple:
    """What ``JITFunction.run`` looks the compiled kernel up by, for ``args`` (the keyed arguments
    and a config's tiles given fixed values: they come from the key and the config)."""
    binder = jit.create_function_from_signature(twin.signature, twin.params, BaseBackend)
    fixed = dict(OCCUPANCY=0, TMA_OK=0, SMEM=0, BK=32, BV=32)
    _, specialisation, _ = binder(**{**args, **fixed})
    return tuple(specialisation)


def test_the_direct_key_separates_what_triton_tells_apart(monkeypatch):
    """Two launches under one ``direct_key`` have the same Triton specialisation, the same
    autotune key's inputs (OCCUPANCY, TMA_OK) and the same grid; and launches that differ only in
    T share a key (T is never specialised), so a stream of packed batches of varying lengths
    stays on the direct path."""
    launches = _recorded_launches(monkeypatch)
    monkeypatch.setattr(launch, "DIRECT", True)
    monkeypatch.setattr(launch._host, "current_device", lambda: 0)
    twins = {id(k): _compiled_twin(k) for k, _, _ in launches}
    rows = []
    for kernel, args, N in launches:
        twin = twins[id(kernel)]
        K, V, H = args["K"], args["V"], args["H"]
        tma = tuning.tma_usable(*(args.get(n) for n in ("k", "v", "q", "do", "gk", "gv")))
        rows.append((launch.direct_key(twin, args, N), _triton_specialisation(twin, args),
                     (tuning.launch_bucket(N, H, K, V), tma, N * H * K * V), args["T"]))
    assert len(rows) > 50
    shared_across_T = 0
    for (key_a, spec_a, keyed_a, T_a), (key_b, spec_b, keyed_b, T_b) in itertools.combinations(rows, 2):
        if key_a == key_b:
            assert spec_a == spec_b, "one direct key, two Triton specialisations"
            assert keyed_a == keyed_b, "one direct key, two autotune keys or grids"
            shared_across_T += T_a != T_b
    assert shared_across_T > 0, "launches differing only in T never shared a key"
    specs = {spec for _, spec, _, _ in rows}
    keys = {key for key, _, _, _ in rows}
    assert len(keys) >= len(specs)


def test_an_explicit_configs_options_are_in_the_direct_key(monkeypatch):
    """Two explicit configs that differ only in their compile options (warps, stages, a register cap
    ``maxnreg``) compile two kernels, so they never share a direct launch; the options handed to
    Triton are the config's."""
    monkeypatch.setattr(launch, "DIRECT", True)
    monkeypatch.setattr(launch._host, "current_device", lambda: 0)
    kernel = _compiled_twin(forward.chunk_fwd_kernel_h)
    launches = _recorded_launches(monkeypatch)
    _, args, N = launches[0]
    configs = [triton.Config({"BK": 32, "BV": 32}, num_warps=4, num_stages=2),
               triton.Config({"BK": 32, "BV": 32}, num_warps=4, num_stages=2, maxnreg=96),
               triton.Config({"BK": 32, "BV": 32}, num_warps=4, num_stages=2, maxnreg=80),
               triton.Config({"BK": 32, "BV": 32}, num_warps=4, num_stages=3),
               triton.Config({"BK": 32, "BV": 32}, num_warps=8, num_stages=2)]
    keys = [launch.direct_key(kernel, args, N, c) for c in configs]
    assert len(set(keys)) == len(configs)
    assert launch.direct_key(kernel, args, N, triton.Config({"BK": 32, "BV": 32}, num_warps=4, num_stages=2,
                                                            maxnreg=96)) == keys[1]
    assert launch.explicit_options(configs[0]) == dict(num_warps=4, num_stages=2)
    assert launch.explicit_options(configs[1]) == dict(num_warps=4, num_stages=2, maxnreg=96)


def test_a_config_with_a_register_cap_gives_the_same_states(device):
    """``maxnreg`` caps the registers a thread may use and changes nothing computed (on a GPU the
    compiler spills instead; the interpreter has no registers to cap)."""
    k, v = torch.randn(1, 70, 2, 32, device=device), torch.randn(1, 70, 2, 24, device=device)
    g = gates.chunk_local_cumsum(F.logsigmoid(torch.randn(1, 70, 2, device=device)), 16)
    out = {}
    for cap in (None, 32):
        config = triton.Config({"BK": 16, "BV": 16}, num_warps=4, num_stages=2, maxnreg=cap)
        with nan_poisoned_empty():
            out[cap] = chunkstate.chunk_fwd_h(k, v, g=g, chunk_size=16, output_final_state=True, config=config)
    tol = 1e-6 if chunkstate.INTERPRET else 2e-3
    for a, b, name in zip(out[None], out[32], ("h", "ht")):
        check_close(b, a, f"{name} with maxnreg=32", tol)


@pytest.mark.gpu(reason="registers are the compiler's: compiled kernels only")
def test_an_explicit_register_cap_is_compiled_in():
    """An explicit config's ``maxnreg`` reaches the compiler: the kernel it launches uses at most that
    many registers a thread, and its states equal the uncapped kernel's."""
    if not launch.DIRECT:
        pytest.skip(f"direct launches are off on Triton {triton.__version__}: the compiled kernel is not kept")
    B, T, H, K, V = 2, 700, 4, 128, 128
    k = torch.randn(B, T, H, K, device="cuda", dtype=torch.bfloat16)
    v = torch.randn(B, T, H, V, device="cuda", dtype=torch.bfloat16)
    g = gates.chunk_local_cumsum(F.logsigmoid(torch.randn(B, T, H, device="cuda")), 64)
    states, regs = {}, {}
    for cap in (None, 80):
        config = triton.Config({"BK": 64, "BV": 64}, num_warps=4, num_stages=2, maxnreg=cap)
        launch.clear_direct()  # then the one launch remembered is this call's
        states[cap] = chunkstate.chunk_fwd_h(k, v, g=g, output_final_state=True, config=config, pieces=1)
        [entry] = launch._direct.values()
        regs[cap] = entry.compiled.n_regs
    assert regs[80] <= 80, regs
    for a, b, name in zip(states[None], states[80], ("h", "ht")):
        check_close(b.float(), a.float(), f"{name} with maxnreg=80", 1e-2)


def test_no_direct_launches_under_the_interpreter():
    """The interpreter runs every launch through Triton (``direct_key`` gives None)."""
    if ON_GPU:
        pytest.skip("on a GPU launches go direct")
    assert launch.direct_key(forward.chunk_fwd_kernel_h, {"T": 1}, 1) is None


class _CountRuns:
    """Counts ``JITFunction.run`` calls (Triton's launch path), whatever the kernel."""

    def __init__(self, monkeypatch):
        self.n = 0
        real = jit.JITFunction.run

        def run(fn, *args, **kwargs):
            self.n += 1
            return real(fn, *args, **kwargs)

        monkeypatch.setattr(jit.JITFunction, "run", run)


@pytest.mark.gpu(reason="direct launches exist only for compiled kernels")
@pytest.mark.parametrize("what", ["fwd g", "fwd gk gv h0 ht", "fwd packed pieces", "bwd g_gamma",
                                  "bwd gk dht dh0 packed", "bwd pieces", "fwd config tma", "bwd config"])
def test_a_repeated_call_launches_directly_with_the_same_result(what, monkeypatch):
    if not launch.DIRECT:
        pytest.skip(f"direct launches are off on Triton {triton.__version__} (launch.DIRECT_TRITON)")
    launch.clear_direct()
    runs = _CountRuns(monkeypatch)
    dev, dt = "cuda", torch.bfloat16
    B, T, H, K, V = (1, 3000, 2, 64, 128) if "packed" in what else (2, 700, 3, 128, 64)
    q, k = (torch.randn(B, T, H, K, device=dev, dtype=dt) * K ** -0.5 for _ in range(2))
    v, do = (torch.randn(B, T, H, V, device=dev, dtype=dt) for _ in range(2))
    cu = torch.tensor([0, 1000, 1001, 1001, 3000], dtype=torch.int32, device=dev) if "packed" in what else None
    N = 4 if cu is not None else B
    kw = dict(cu_seqlens=cu)
    if "g" in what.split():
        kw["g"] = gates.chunk_local_cumsum(F.logsigmoid(torch.randn(B, T, H, device=dev)), 64, cu)
    if "g_gamma" in what:
        kw["g_gamma"] = -torch.rand(H, device=dev) * 0.1
    if "gk" in what:
        kw["gk"] = gates.chunk_local_cumsum(F.logsigmoid(torch.randn(B, T, H, K, device=dev)), 64, cu)
    if "gv" in what:
        kw["gv"] = gates.chunk_local_cumsum(F.logsigmoid(torch.randn(B, T, H, V, device=dev)), 64, cu)
    if "pieces" in what:
        kw["pieces"] = 2
    if "config" in what:
        kw["config"] = tuning._config(64, 64, 4, 2, "tma" in what)
    state = torch.randn(N, H, K, V, device=dev)
    if what.startswith("fwd"):
        kw.update(h0=state if "h0" in what else None, output_final_state="ht" in what)

        def call():
            with nan_poisoned_empty():
                return chunkstate.chunk_fwd_h(k, v, **kw)
    else:
        kw.update(h0=state if "dh0" in what else None, dht=state if "dht" in what else None)

        def call():
            with nan_poisoned_empty():
                return chunkstate.chunk_bwd_dh(q, k, v, do, scale=K ** -0.5, **kw)

    first = call()
    through_triton = runs.n
    assert through_triton > 0
    second = call()
    assert runs.n == through_triton, f"a repeated call went through JITFunction.run {runs.n - through_triton} times"
    for a, b, name in zip(first, second, ("states", "end state")):
        if a is not None:
            assert torch.equal(a, b), f"{what}: {name} launched directly differ from the first call's"


@pytest.mark.gpu(reason="direct launches exist only for compiled kernels")
def test_what_the_direct_path_must_not_reuse_goes_through_triton(monkeypatch):
    """A misaligned input (another specialisation), an explicit config and a cleared autotuner
    cache each go through ``JITFunction.run`` again, with a right answer."""
    if not launch.DIRECT:
        pytest.skip(f"direct launches are off on Triton {triton.__version__} (launch.DIRECT_TRITON)")
    launch.clear_direct()
    runs = _CountRuns(monkeypatch)
    B, T, H, K, V = 1, 500, 2, 64, 64
    k = torch.randn(B, T, H, K, device="cuda") * K ** -0.5
    v = torch.randn(B, T, H, V, device="cuda")
    nat = F.logsigmoid(torch.randn(B, T, H, device="cuda"))
    G = gates.chunk_local_cumsum(nat, 64)
    h_ref, _ = reference.recurrent_states(k, v, g=nat, chunk_size=64)

    def call(k_in, **extra):
        with nan_poisoned_empty():
            h, _ = chunkstate.chunk_fwd_h(k_in, v, g=G, **extra)
        check_close(h, h_ref, "h", 2e-3)
        return h

    call(k)
    n = runs.n
    call(k)
    assert runs.n == n
    k_off = _misaligned(k.shape, k.dtype)
    k_off.copy_(k)
    call(k_off)  # another specialisation, and (no TMA for a misaligned k) another autotune key
    assert runs.n > n, "a misaligned input reused an aligned launch"
    n = runs.n
    call(k, config=tuning._config(32, 64, 4, 2))
    assert runs.n == n + 1, "an explicit config reused the autotuned launch"
    forward._tuned_forward.cache.clear()
    call(k)
    assert runs.n > n + 1, "a cleared autotuner cache still launched the old choice"


def test_a_launch_hook_turns_direct_launches_off():
    """A profiler's launch hook (a function, or one added to Triton's ``HookChain``) must see every
    launch, so direct launches stop while one is set; an empty chain calls nothing."""
    runtime = triton.knobs.runtime
    assert launch._hooks_idle()

    def hook(metadata):
        pass

    chain = runtime.launch_enter_hook
    if hasattr(chain, "add"):
        chain.add(hook)
        try:
            assert not launch._hooks_idle()
        finally:
            chain.remove(hook)
    saved = runtime.launch_exit_hook
    runtime.launch_exit_hook = hook
    try:
        assert not launch._hooks_idle()
    finally:
        runtime.launch_exit_hook = saved
    assert launch._hooks_idle()


@pytest.mark.gpu(reason="direct launches exist only for compiled kernels")
def test_a_hooked_launch_goes_through_triton(monkeypatch):
    """With a launch hook set, a repeated call goes through ``JITFunction.run`` and the hook sees it."""
    if not launch.DIRECT:
        pytest.skip(f"direct launches are off on Triton {triton.__version__} (launch.DIRECT_TRITON)")
    k = torch.randn(1, 300, 2, 64, device="cuda")
    v = torch.randn(1, 300, 2, 64, device="cuda")
    chunkstate.chunk_fwd_h(k, v)
    runs = _CountRuns(monkeypatch)
    seen = []
    chain = triton.knobs.runtime.launch_enter_hook
    if not hasattr(chain, "add"):
        pytest.skip("this Triton has no HookChain")
    chain.add(seen.append)
    try:
        chunkstate.chunk_fwd_h(k, v)
        torch.cuda.synchronize()
    finally:
        chain.remove(seen.append)
    assert runs.n == 1 and len(seen) == 1
