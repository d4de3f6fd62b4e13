"""Host-side offsets (``chunkstate._host``): a repeated call with the same CUDA ``cu_seqlens`` reads
nothing back from the device, yet offsets changed in place are never served stale; the caches are
safe to use from several threads, and kernels read only offsets that were validated.

On CPU the reads are counted by patching ``torch.Tensor.tolist`` and ``torch.tensor``; on a GPU
the repeated calls also run under ``torch.cuda.set_sync_debug_mode("error")``, which raises on any
device synchronisation.
"""
from __future__ import annotations

import contextlib
import random

import pytest
import torch
import torch.nn.functional as F

import chunkstate
from chunkstate import _host, _validate, gates, launch, reference, tuning
from chunkstate.testing import check_close, nan_poisoned_empty

ON_GPU = chunkstate.DEVICE == "cuda"
DTYPE = torch.float32
TOL = 2e-3 if ON_GPU else 1e-5  # fp32: tf32 products on the GPU, numpy fp32 under the interpreter


@pytest.fixture(autouse=True)
def _fresh_caches():
    _host.clear()
    yield
    _host.clear()


class _Reads:
    """Counts ``Tensor.tolist`` calls and ``torch.tensor`` constructions inside ``_host``."""

    def __init__(self, monkeypatch):
        self.tolist = self.tensor = 0
        real_tolist, real_tensor = torch.Tensor.tolist, torch.tensor

        def tolist(t):
            self.tolist += 1
            return real_tolist(t)

        def tensor(*args, **kwargs):
            self.tensor += 1
            return real_tensor(*args, **kwargs)

        monkeypatch.setattr(torch.Tensor, "tolist", tolist)
        monkeypatch.setattr(_host.torch, "tensor", tensor)


def _cu(lens, device):
    return torch.tensor([0, *torch.tensor(lens).cumsum(0).tolist()], dtype=torch.int32, device=device)


def test_host_offsets_read_once_per_tensor(monkeypatch, device):
    """The cache behind ``host_offsets`` for CUDA tensors (``cached_host_offsets``), on any device."""
    cu = _cu([5, 0, 7], device)
    reads = _Reads(monkeypatch)
    assert _host.cached_host_offsets(cu) == (0, 5, 5, 12)
    assert _host.cached_host_offsets(cu) == (0, 5, 5, 12)
    assert reads.tolist == 1
    same_values = cu.clone()  # another tensor: read again, never confused with the first
    assert _host.cached_host_offsets(same_values) == (0, 5, 5, 12) and reads.tolist == 2
    assert _host.host_offsets(cu) == (0, 5, 5, 12)
    assert reads.tolist == (2 if ON_GPU else 3)  # host_offsets reads a CPU tensor every time


def test_host_offsets_see_in_place_changes(device):
    cu = _cu([5, 0, 7], device)
    for read in (_host.host_offsets, _host.cached_host_offsets):
        assert read(cu) == (0, 5, 5, 12)
        cu[1] = 3  # bumps the version counter
        assert read(cu) == (0, 3, 5, 12)
        cu.add_(1)
        assert read(cu) == (1, 4, 6, 13)
        cu.copy_(_cu([5, 0, 7], device))


def test_cpu_offsets_see_writes_behind_torchs_back():
    """A CPU tensor changed through the numpy array it shares memory with (no version bump) is
    read as it is now."""
    import numpy as np

    arr = np.array([0, 10, 40], dtype=np.int32)
    cu = torch.from_numpy(arr)
    assert _host.host_offsets(cu) == (0, 10, 40)
    arr[:] = [0, 39, 40]
    assert _host.host_offsets(cu) == (0, 39, 40)


def test_inference_tensors_are_read_every_time(monkeypatch, device):
    with torch.inference_mode():
        cu = _cu([4, 4], device)
    reads = _Reads(monkeypatch)
    assert _host.cached_host_offsets(cu) == _host.cached_host_offsets(cu) == (0, 4, 8)
    assert reads.tolist == 2


def test_on_device_makes_each_tensor_once(monkeypatch, device):
    reads = _Reads(monkeypatch)
    a = _host.on_device((0, 3, 9), torch.int64, device)
    assert a is _host.on_device([0, 3, 9], torch.int64, device)
    b = _host.on_device((0, 3, 9), torch.int32, device)
    assert b is not a and b.dtype == torch.int32 and a.tolist() == b.tolist() == [0, 3, 9]
    assert reads.tensor == 2


def test_cache_is_bounded(device):
    for n in range(3 * _host.MAX_ENTRIES):
        _host.on_device((0, n), torch.int64, device)
        _host.cached_host_offsets(_cu([n], device))
    assert len(_host._device_cache) == len(_host._host_cache) == _host.MAX_ENTRIES


@pytest.mark.parametrize("split_size", [1, 16, 64, 100])
def test_split_offsets_match_the_device_version(split_size, device):
    lens = [random.choice([0, 1, random.randint(2, 300)]) for _ in range(random.randint(1, 12))]
    cu = _cu(lens, device)
    want = gates.prepare_chunk_offsets(cu, split_size).tolist()
    assert list(_host.split_offsets(_host.lengths(_host.host_offsets(cu)), split_size)) == want


def test_what_follows_from_the_offsets_is_made_once_per_values(device):
    """``splits`` of a packed batch: its lengths, the longest, NS and first split slots made once per (offsets,
    split size, device) (``packed_splits``), equal to the dense computation's, with a tuple of
    lengths; equal offsets in another tuple find the same entry; ``_host.clear`` forgets them. The
    offsets' checks are cached by value too, but a bad set raises on every call."""
    lens = [random.randint(0, 90) for _ in range(random.randint(2, 40))]
    host = _host.host_offsets(_cu(lens, device))
    split = random.choice([16, 64])
    first = _host.splits(host, 1, sum(lens), split, torch.device(device))
    assert first[0] == tuple(lens) and first[1] == max(lens) and first[2] == sum(-(-L // split) for L in lens)
    assert first[3].tolist() == list(_host.split_offsets(lens, split))
    assert first[3].device.type == torch.device(device).type
    again = _host.splits(tuple(list(host)), 1, sum(lens), split, torch.device(device))  # equal values, another tuple
    assert again is first
    _host.clear()
    assert _host.splits(host, 1, sum(lens), split, torch.device(device)) is not first
    assert _host.splits(None, 3, 100, 64, None) == ((100, 100, 100), 100, 2, None)  # dense: nothing cached
    assert _host.splits(None, 0, 100, 64, None) == ((), 0, 2, None)  # no sequence: none the longest
    bad = (0, 5, 3, sum(lens))
    for _ in range(2):  # never cached: every call with these offsets raises
        with pytest.raises(ValueError, match="non-decreasing"):
            _validate.offsets_checked(bad, sum(lens))
    assert _validate.offsets_checked(host, sum(lens)) is True


def _inputs(lens, K, V, device):
    T = sum(lens)
    k, v = torch.randn(1, T, 2, K, device=device), torch.randn(1, T, 2, V, device=device)
    g = F.logsigmoid(torch.randn(1, T, 2, device=device))
    return k, v, g


def _forward(k, v, g, cu, **kw):
    with nan_poisoned_empty():
        return chunkstate.chunk_fwd_h(k, v, g=gates.chunk_local_cumsum(g, 16, cu), cu_seqlens=cu, chunk_size=16,
                                      output_final_state=True, **kw)


@pytest.mark.parametrize("pieces", [1, 3])
def test_offsets_changed_in_place_give_the_new_answer(pieces, device):
    """The same cu_seqlens tensor, rewritten in place between two calls: the second call must
    use the new boundaries (checked against the loop), not the cached ones."""
    k, v, g = _inputs([40, 0, 23], 24, 20, device)
    cu = _cu([40, 0, 23], device)
    _forward(k, v, g, cu, pieces=pieces)
    cu.copy_(_cu([17, 30, 16], device))
    h, ht = _forward(k, v, g, cu, pieces=pieces)
    h_ref, ht_ref = reference.recurrent_states(k, v, g=g, cu_seqlens=cu, chunk_size=16)
    check_close(h, h_ref, "h after cu_seqlens changed in place", TOL)
    check_close(ht, ht_ref, "ht after cu_seqlens changed in place", TOL)


@pytest.mark.parametrize("pieces", [1, 3])
def test_a_repeated_call_reads_nothing_back(pieces, monkeypatch, device):
    """Forward and backward, packed batch (and explicit pieces): the second call with the same
    cu_seqlens neither reads a tensor on the host nor copies a list to the device, and gives the
    same result. On a GPU it runs under sync debug mode "error" as well."""
    lens = [40, 0, 23, 1]
    k, v, g = _inputs(lens, 24, 20, device)
    q, do = torch.randn_like(k), torch.randn_like(v)
    cu = _cu(lens, device)
    G = gates.chunk_local_cumsum(g, 16, cu)

    def both():
        with nan_poisoned_empty():
            h, ht = chunkstate.chunk_fwd_h(k, v, g=G, cu_seqlens=cu, chunk_size=16, output_final_state=True,
                                           pieces=pieces)
            dh, _ = chunkstate.chunk_bwd_dh(q, k, v, do, None, None, 0.5, g=G, cu_seqlens=cu, chunk_size=16,
                                            pieces=pieces)
        return h, ht, dh

    first = both()
    reads = _Reads(monkeypatch)
    if ON_GPU:
        torch.cuda.synchronize()
        torch.cuda.set_sync_debug_mode("error")
    try:
        second = both()
    finally:
        if ON_GPU:
            torch.cuda.set_sync_debug_mode("default")
    # a CPU tensor's offsets are read again on each call (forward, backward): no device wait, and
    # a write through numpy is seen; the tensors made from them are not made again
    assert (reads.tolist, reads.tensor) == ((0, 0) if ON_GPU else (2, 0))
    for a, b, name in zip(first, second, ("h", "ht", "dh")):
        assert torch.equal(a, b), name


@pytest.mark.gpu(reason="device synchronisation exists only on a GPU")
def test_dense_pieces_never_synchronise():
    """A dense batch cut into pieces (the small-batch path): after the first call, forward and
    backward launch without one device synchronisation."""
    k, v = (torch.randn(1, 4096, 2, 64, device="cuda", dtype=torch.bfloat16) for _ in range(2))
    G = gates.chunk_local_cumsum(F.logsigmoid(torch.randn(1, 4096, 2, device="cuda")), 64)

    def both():
        h, _ = chunkstate.chunk_fwd_h(k, v, g=G, pieces=4)
        dh, _ = chunkstate.chunk_bwd_dh(k, k, v, v, None, None, 0.125, g=G, pieces=4)
        return h, dh

    first = both()
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        second = both()
    finally:
        torch.cuda.set_sync_debug_mode("default")
    assert all(torch.equal(a, b) for a, b in zip(first, second))


def test_cdiv_and_next_power_of_2_match_triton():
    """The wrappers' plain-Python ``cdiv`` / ``next_power_of_2`` give Triton's answers."""
    import triton
    for a in range(0, 300):
        assert _host.next_power_of_2(a) == triton.next_power_of_2(a), a
        for b in (1, 2, 3, 16, 63, 64, 100, 256):
            assert _host.cdiv(a, b) == triton.cdiv(a, b), (a, b)
    for a in (2**31 - 1, 2**31, 2**40 + 3):
        assert _host.next_power_of_2(a) == triton.next_power_of_2(a)
        assert _host.cdiv(a, 64) == triton.cdiv(a, 64)


@pytest.mark.gpu
@pytest.mark.parametrize("packed", [False, True])
@pytest.mark.parametrize("pieces", [1, 3])
def test_calls_replay_in_a_cuda_graph(pieces, packed):
    """Calls bound by the host (small shapes) can be captured in a CUDA graph: the
    calls launch without reading anything back, so after a first, tuning call, a captured forward
    and backward replayed on new inputs (copied into the captured tensors) give bitwise what eager
    calls on those inputs give — packed batches and pieces included."""
    lens = [300, 0, 1, 211] if packed else None
    B, T = (1, sum(lens)) if packed else (2, 384)
    H, K, V, BT = 2, 64, 48, 64
    cu = _cu(lens, "cuda") if packed else None
    N = len(lens) if packed else B

    def fresh():
        k, v, q, do = (torch.randn(B, T, H, D, device="cuda", dtype=torch.bfloat16) for D in (K, V, K, V))
        g = gates.chunk_local_cumsum(F.logsigmoid(torch.randn(B, T, H, device="cuda")), BT, cu)
        h0, dht = (torch.randn(N, H, K, V, device="cuda") for _ in range(2))
        return dict(k=k, v=v, q=q, do=do, g=g, h0=h0, dht=dht)

    def both(x):
        h, ht = chunkstate.chunk_fwd_h(x["k"], x["v"], g=x["g"], h0=x["h0"], output_final_state=True,
                                       cu_seqlens=cu, chunk_size=BT, pieces=pieces)
        dh, dh0 = chunkstate.chunk_bwd_dh(x["q"], x["k"], x["v"], x["do"], x["h0"], x["dht"], 0.125, g=x["g"],
                                          cu_seqlens=cu, chunk_size=BT, pieces=pieces)
        return h, ht, dh, dh0

    static = fresh()
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):  # first calls (autotuning) outside the capture
        both(static)
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        captured = both(static)
    new = fresh()
    for name, x in new.items():
        static[name].copy_(x)
    graph.replay()
    eager = both(new)
    torch.cuda.synchronize()
    for a, b, name in zip(captured, eager, ("h", "ht", "dh", "dh0")):
        assert not a.isnan().any(), name
        assert torch.equal(a, b), f"{name}: graph replay differs from an eager call on the same inputs"


@pytest.mark.gpu
@pytest.mark.parametrize("direction", ["fwd", "bwd"])
def test_candidates_compile_side_by_side(direction, monkeypatch):
    """The first call of a new autotune key compiles every candidate config in threads
    (``tuning.Pruner`` calls ``tuning.compile_configs``) before the autotuner times them: the
    autotuner itself then compiles nothing, and the tuned result is still the float64 loop's. The
    key (K = 40, V = 24, BT = 16, BS = 48) is used by no other test."""
    from chunkstate import tuning
    from chunkstate.testing import n_compiled
    from chunkstate.backward import _tuned_backward
    from chunkstate.forward import _tuned_forward

    tuner = _tuned_forward if direction == "fwd" else _tuned_backward
    assert isinstance(tuner.early_config_prune, tuning.Pruner) and tuner.early_config_prune.kernel is tuner.fn
    B, T, H, K, V, BT, BS = 2, 100, 3, 40, 24, 16, 48
    k, q = (torch.randn(B, T, H, K, device="cuda") for _ in range(2))
    v, do = (torch.randn(B, T, H, V, device="cuda") for _ in range(2))
    g = F.logsigmoid(torch.randn(B, T, H, device="cuda"))
    G = gates.chunk_local_cumsum(g, BT)
    started, counts = [], []
    real = tuning.compile_configs

    def counting(kernel, args, configs):
        started.append(real(kernel, args, configs))
        counts.append(n_compiled([tuner.fn]))
        return started[-1]

    monkeypatch.setattr(tuning, "compile_configs", counting)
    tuner.cache.clear()
    with nan_poisoned_empty():
        if direction == "fwd":
            out, _ = chunkstate.chunk_fwd_h(k, v, g=G, chunk_size=BT, split_size=BS, pieces=1)
            ref, _ = reference.recurrent_states(k, v, g=g, chunk_size=BT, split_size=BS)
        else:
            out, _ = chunkstate.chunk_bwd_dh(q, k, v, do, None, None, 0.3, g=G, chunk_size=BT, split_size=BS,
                                             pieces=1)
            ref, _ = reference.state_grads(q, k, v, do, g=g, scale=0.3, chunk_size=BT, split_size=BS)
    torch.cuda.synchronize()
    candidates = tuning.prune(tuner.configs, dict(K=K, V=V, OCCUPANCY=tuning.launch_bucket(B, H, K, V), TMA_OK=1))
    assert started == [len(candidates)] and len(candidates) >= 2, (started, len(candidates))
    assert n_compiled([tuner.fn]) == counts[0], "the autotuner compiled a config the threads had not"
    check_close(out, ref, f"{direction} after compiling side by side", TOL)


# ---------------------------------------------------------------------------------------------
# Offsets changed behind torch's back, and threads
# ---------------------------------------------------------------------------------------------

STALE_OFFSETS = """
import numpy as np, torch, chunkstate
k, v = torch.randn(1, 40, 1, 16), torch.randn(1, 40, 1, 16)
arr = np.array([0, 10, 40], dtype=np.int32); cu = torch.from_numpy(arr)
chunkstate.chunk_fwd_h(k, v, cu_seqlens=cu, chunk_size=16)
arr[:] = [0, 39, 4000]
try:
    chunkstate.chunk_fwd_h(k, v, cu_seqlens=cu, chunk_size=16)
except ValueError as e:
    print("refused:", e)
"""


@pytest.mark.skipif(ON_GPU, reason="numpy can write behind a CPU cu_seqlens only, and the kernels take CPU "
                    "tensors only under the interpreter (the CUDA twin: the .data test below)")
def test_offsets_changed_through_numpy_never_reach_a_kernel_unchecked():
    """Issue 22's reproducer, in a fresh interpreter process (it used to abort with "double free or
    corruption"): offsets changed through the numpy array behind a CPU ``cu_seqlens`` are checked
    again, so the second call is refused naming the argument, and the process exits cleanly."""
    import os
    import subprocess
    import sys

    env = dict(os.environ, TRITON_INTERPRET="1")
    done = subprocess.run([sys.executable, "-c", STALE_OFFSETS], capture_output=True, text=True, env=env,
                          timeout=300)
    assert done.returncode == 0, done.stderr[-2000:]
    assert "refused: cu_seqlens must end at T=40, got 4000" in done.stdout, done.stdout


def test_offsets_changed_through_numpy_in_range_are_used(device):
    """In-range offsets changed through numpy: the next call computes with them, every state slot
    written (the NaN-poisoned outputs would show one left out)."""
    if device != "cpu":
        pytest.skip("numpy shares memory with CPU tensors only")
    import numpy as np

    k, v = torch.randn(1, 40, 1, 16), torch.randn(1, 40, 1, 16)
    arr = np.array([0, 10, 40], dtype=np.int32)
    cu = torch.from_numpy(arr)
    chunkstate.chunk_fwd_h(k, v, cu_seqlens=cu, chunk_size=16)
    arr[:] = [0, 39, 40]
    with nan_poisoned_empty():
        h, ht = chunkstate.chunk_fwd_h(k, v, cu_seqlens=cu, chunk_size=16, output_final_state=True)
    h_ref, ht_ref = reference.recurrent_states(k, v, cu_seqlens=torch.tensor([0, 39, 40]), chunk_size=16)
    check_close(h, h_ref, "h after the offsets changed", TOL)
    check_close(ht, ht_ref, "ht after the offsets changed", TOL)


@pytest.mark.gpu(reason="a CUDA tensor's offsets are cached; numpy cannot write a CPU one behind the cache")
def test_cuda_offsets_changed_behind_the_version_counter_stay_memory_safe():
    """``cu.data`` writes bypass the version counter, so the cached host offsets go stale: the
    kernels still read the validated copy, so every slot of the old plan is written, nothing
    outside it, and the result is the first call's."""
    k, v = torch.randn(1, 40, 1, 16, device="cuda"), torch.randn(1, 40, 1, 16, device="cuda")
    cu = torch.tensor([0, 10, 40], dtype=torch.int32, device="cuda")
    with nan_poisoned_empty():
        first = chunkstate.chunk_fwd_h(k, v, cu_seqlens=cu, chunk_size=16, output_final_state=True)
    cu.data.copy_(torch.tensor([0, 39, 4000], dtype=torch.int32, device="cuda"))
    with nan_poisoned_empty():
        second = chunkstate.chunk_fwd_h(k, v, cu_seqlens=cu, chunk_size=16, output_final_state=True)
    torch.cuda.synchronize()
    for a, b in zip(first, second):
        assert torch.equal(a, b)


def _hammer(fn, threads: int, calls: int) -> list[BaseException]:
    """Run ``fn(thread, i)`` ``calls`` times in each of ``threads`` threads; the exceptions raised."""
    import threading

    errors, start = [], threading.Barrier(threads)

    def work(t):
        start.wait()
        for i in range(calls):
            try:
                fn(t, i)
            except BaseException as e:  # noqa: BLE001  collected, reported by the test
                errors.append(e)

    pool = [threading.Thread(target=work, args=(t,)) for t in range(threads)]
    for th in pool:
        th.start()
    for th in pool:
        th.join()
    return errors


def test_host_caches_are_thread_safe(device):
    """Four threads making and evicting cache entries at once (more distinct keys than the caches
    hold): no error, and every answer right. Unguarded, ``get`` then ``move_to_end`` / ``popitem``
    raised thousands of KeyErrors in 400,000 calls."""
    tensors = [_cu([n, 3], device) for n in range(2 * _host.MAX_ENTRIES)]

    def call(t, i):
        n = (7 * i + t) % len(tensors)
        assert _host.on_device((0, n), torch.int64, device).tolist() == [0, n]
        assert _host.cached_host_offsets(tensors[n]) == (0, n, n + 3)

    errors = _hammer(call, threads=4, calls=20_000)
    assert not errors, f"{len(errors)} errors, e.g. {errors[0]!r}"


def test_chunk_local_cumsum_from_threads(device):
    lens = [5, 0, 7, 12]
    cus = [_cu([n, *lens], device) for n in range(2 * _host.MAX_ENTRIES)]
    g = F.logsigmoid(torch.randn(1, 24 + 2 * _host.MAX_ENTRIES, 2, device=device))

    def call(t, i):
        cu = cus[(3 * i + t) % len(cus)]
        T = int(cu[-1])
        out = gates.chunk_local_cumsum(g[:, :T], 4, cu)
        assert out.shape == (1, T, 2)

    errors = _hammer(call, threads=4, calls=300)
    assert not errors, f"{len(errors)} errors, e.g. {errors[0]!r}"


def test_kernels_from_threads(device):
    """Several threads calling the kernels at once get right answers: launches take one lock
    (``launch.serialised``), since Triton's autotuner keeps the call in flight on itself and the
    interpreter keeps launch state in globals (unguarded, 5 of 12 calls failed on the H200)."""
    lens = [9, 0, 20]
    k, v, g = _inputs(lens, 16, 16, device)
    cu = _cu(lens, device)
    G = gates.chunk_local_cumsum(g, 16, cu)
    h_ref, ht_ref = reference.recurrent_states(k, v, g=g, cu_seqlens=cu, chunk_size=16)

    def call(t, i):
        h, ht = chunkstate.chunk_fwd_h(k, v, g=G, cu_seqlens=cu, chunk_size=16, output_final_state=True,
                                       pieces=1 + (t % 2))
        check_close(h, h_ref, f"thread {t} call {i}: h", TOL)
        check_close(ht, ht_ref, f"thread {t} call {i}: ht", TOL)

    errors = _hammer(call, threads=4, calls=3)
    assert not errors, f"{len(errors)} errors, e.g. {errors[0]!r}"


def test_a_tuned_key_skips_the_autotuner(monkeypatch, device):
    """``launch.autotune_key`` builds the very key Triton's ``Autotuner.run`` looks up (checked
    against the key Triton itself asks its cache for, on this Triton), and once the autotuner's
    cache holds that key a call launches the cached config directly, never entering
    ``Autotuner.run``, with the same result."""
    from chunkstate import forward

    tuned = forward._tuned_forward
    chosen, other = tuning._config(32, 32, 4, 2), tuning._config(16, 16, 4, 2)
    monkeypatch.setattr(tuned, "configs", [chosen, other])
    asked = []

    class Recording(dict):  # Triton's lookups: "tuned before", always the chosen config
        def __contains__(self, key):
            asked.append(key)
            return True

        def __getitem__(self, key):
            return chosen

        def get(self, key, default=None):  # chunkstate's lookup: not tuned yet
            return None

    monkeypatch.setattr(tuned, "cache", Recording())
    built = []
    real_key = launch.autotune_key
    monkeypatch.setattr(launch, "autotune_key", lambda t, a: built.append(real_key(t, a)) or built[-1])
    k, v = (torch.randn(1, 100, 2, 32, device=device, dtype=DTYPE) for _ in range(2))
    nat = F.logsigmoid(torch.randn(1, 100, 2, device=device))
    G = gates.chunk_local_cumsum(nat, 16)

    def call():
        with nan_poisoned_empty():
            return chunkstate.chunk_fwd_h(k, v, g=G, chunk_size=16, output_final_state=True, pieces=1)

    first = call()
    assert asked and built and asked[-1] == built[-1], (asked, built)

    monkeypatch.setattr(tuned, "cache", {built[-1]: chosen})
    entered = []
    real_run = tuned.run
    monkeypatch.setattr(tuned, "run", lambda *a, **kw: entered.append(1) or real_run(*a, **kw))
    tuned.best_config = None
    second = call()
    assert entered == [] and tuned.best_config is chosen
    for a, b, name in zip(first, second, ("h", "ht")):
        assert torch.equal(a, b), name
    h_ref, ht_ref = reference.recurrent_states(k, v, g=nat, chunk_size=16)
    check_close(second[0], h_ref, "h, launched from the autotuner's cache", TOL)
    check_close(second[1], ht_ref, "ht, launched from the autotuner's cache", TOL)


def test_calls_run_on_their_inputs_device(monkeypatch):
    """Triton launches on the current CUDA device: a call whose first tensor is on another one runs
    with that device made current (``_host.on_inputs_device``), whether the tensor is passed by
    position or by name; a tensor on the current device, or on the CPU, switches nothing. On CPU the
    CUDA side is stood in for: tensors claim to be on ``cuda:1`` while ``cuda:0`` is current."""
    current, entered = [0], []

    @contextlib.contextmanager
    def switch(device):  # stands in for torch.cuda.device: makes ``device`` current inside
        entered.append(device)
        current.append(device)
        try:
            yield
        finally:
            current.pop()

    monkeypatch.setattr(_host, "current_device", lambda: current[-1])  # what the wrapper asks
    monkeypatch.setattr(torch.cuda, "device", switch)
    ran_on = []

    @_host.on_inputs_device
    def kernel_call(k, v=None):
        ran_on.append(current[-1])
        return k

    x = torch.zeros(2)
    kernel_call(x)  # a CPU tensor
    assert entered == [] and ran_on == [0]
    monkeypatch.setattr(torch.Tensor, "is_cuda", property(lambda self: True))
    for on in (0, 1, 2):
        monkeypatch.setattr(torch.Tensor, "get_device", lambda self, on=on: on)
        kernel_call(x, v=x)
        kernel_call(k=x)
    assert ran_on == [0, 0, 0, 1, 1, 2, 2] and entered == [1, 1, 2, 2] and current == [0]
    for fn in (chunkstate.chunk_fwd_h, chunkstate.chunk_bwd_dh):  # (chunk_gla launches through these two)
        assert fn.__code__.co_filename == _host.__file__ and hasattr(fn, "__wrapped__"), \
            f"{fn.__name__} does not switch to its inputs' device (_host.on_inputs_device)"


@pytest.mark.skipif(not ON_GPU or torch.cuda.device_count() < 2, reason="needs two CUDA GPUs")
def test_kernels_on_a_second_gpu():
    """Tensors on cuda:1 while cuda:0 is current: both kernels run there and match the loop."""
    B, T, H, K, V, BT = 2, 200, 2, 32, 48, 64
    dev = torch.device("cuda", 1)
    assert torch.cuda.current_device() == 0
    q, k, do = (torch.randn(B, T, H, d, device=dev) for d in (K, K, V))
    v = torch.randn(B, T, H, V, device=dev)
    nat = {"g": F.logsigmoid(torch.randn(B, T, H, device=dev) + 2)}
    kg = gates.kernel_gates(nat, BT)
    h0, dht = torch.randn(B, H, K, V, device=dev), torch.randn(B, H, K, V, device=dev)
    with nan_poisoned_empty():
        h, ht = chunkstate.chunk_fwd_h(k, v, **kg, h0=h0, output_final_state=True, chunk_size=BT)
        dh, dh0 = chunkstate.chunk_bwd_dh(q, k, v, do, h0, dht, 0.5, **kg, chunk_size=BT)
    assert h.device == dev and dh.device == dev and torch.cuda.current_device() == 0
    h_ref, ht_ref = reference.recurrent_states(k, v, **nat, h0=h0, chunk_size=BT)
    dh_ref, dh0_ref = reference.state_grads(q, k, v, do, **nat, h0=h0, dht=dht, scale=0.5, chunk_size=BT)
    for out, ref, what in ((h, h_ref, "h"), (ht, ht_ref, "ht"), (dh, dh_ref, "dh"), (dh0, dh0_ref, "dh0")):
        check_close(out, ref, f"{what} on cuda:1", TOL)


@pytest.mark.gpu(reason="the current device and stream are CUDA's")
def test_current_device_and_stream_are_torchs():
    """``_host.current_device`` and ``current_raw_stream`` (torch's C functions, without the Python
    layers) answer what ``torch.cuda.current_device()`` and ``current_stream(i).cuda_stream`` do,
    on the default stream and inside another one."""
    index = torch.cuda.current_device()
    assert _host.current_device() == index
    assert _host.current_raw_stream(index) == torch.cuda.current_stream(index).cuda_stream
    side = torch.cuda.Stream()
    with torch.cuda.stream(side):
        assert _host.current_raw_stream(index) == side.cuda_stream != torch.cuda.default_stream(index).cuda_stream
    assert _host.current_raw_stream(index) == torch.cuda.current_stream(index).cuda_stream


@pytest.mark.gpu(reason="a CUDA tensor's device and SM count")
def test_a_call_decides_by_its_tensors_device():
    """A call's ``Problem`` holds its tensors' CUDA index, and ``tuning.sm_count`` of it is that GPU's
    multiprocessor count (the current device's, as the wrappers make it current)."""
    k = torch.zeros(1, 8, 1, 16, device="cuda")
    p = launch.problem(k, 1, 8, 1, 16, 16, None, 64, None, False)
    assert p.device == k.get_device() == torch.cuda.current_device()
    sms = torch.cuda.get_device_properties(p.device).multi_processor_count
    assert tuning.sm_count(p.device) == tuning.sm_count() == sms
