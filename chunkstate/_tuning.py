"""Autotuning shared by the forward and backward kernels: the candidate configs and the key.

fla tunes 48 configs keyed on (BT, gate kinds, layout, K, V) only, so the winner for the first
shape is reused for every later B, T, H — and a first call costs 34-49 s on an H200. Here the key
also holds ``GRID``: how many (sequence, head) pairs there are relative to the GPU's
multiprocessors, bucketed (a one-wave launch wants small tiles and deep prefetch; a full grid
wants big tiles). For each key a short candidate list is pruned from ``CONFIGS`` by K, V and that
bucket, so a first call compiles and times only a handful of configs.

Under Triton's interpreter ``@triton.autotune`` accepts one config only: ``CONFIGS`` collapses
to a single one there (the tests run every config explicitly through the ``config=`` argument).
"""
from __future__ import annotations

import functools

import torch
import triton

from . import _host
from .env import INTERPRET


def _config(BK, BV, warps, stages):
    return triton.Config({"BK": BK, "BV": BV}, num_warps=warps, num_stages=stages)


# Every config that may ever run on a GPU (the compile-only test compiles each one for sm_90).
ALL_CONFIGS = [_config(BK, BV, w, s)
               for BK in (32, 64, 128) for BV in (32, 64, 128)
               for w in (2, 4, 8) for s in (2, 3, 4, 5)
               if BK * BV <= 64 * 128 and (w >= 4 or BK * BV <= 64 * 64)
               # 5 stages only for tiles up to 64×64 (the low-occupancy candidates). 128×32 with 5
               # stages failed the every-config test on the H200 (bf16, gates g and gk; the cause
               # was not captured): by count its 4 prefetched stages of k, v, g, gk alone hold
               # ~210 KB of Hopper's 227 KB of shared memory.
               and (s < 5 or (w >= 4 and BK <= 64 and BV <= 64))]

# The interpreter's single config: one tile covers K, V <= 64 (few programs: fast on CPU).
INTERPRETER_CONFIG = _config(64, 64, 4, 1)
CONFIGS = [INTERPRETER_CONFIG] if INTERPRET else ALL_CONFIGS


@functools.lru_cache(maxsize=None)
def sm_count() -> int:
    if not torch.cuda.is_available():
        return 132  # an H200's count: only used to bucket the key on CPU
    return torch.cuda.get_device_properties(torch.cuda.current_device()).multi_processor_count


def bucket_limits() -> tuple[int, ...]:
    """Where the ``GRID`` buckets end, in (sequence, head) pairs N·H: an eighth of the SM count, a
    quarter, one, four (with 64×64 tiles at K = V = 128 one pair is 4 programs)."""
    sms = sm_count()
    return sms // 8, sms // 4, sms, 4 * sms


N_BUCKETS = len(bucket_limits()) + 1


def grid_bucket(num_heads_total: int) -> int:
    """Bucket N·H against the SM count: 0 < 1/8 wave, 1 < 1/4 wave, 2 < 1 wave, 3 < 4 waves,
    4 beyond."""
    for bucket, limit in enumerate(bucket_limits()):
        if num_heads_total < limit:
            return bucket
    return len(bucket_limits())


def candidates(K: int, V: int, bucket: int) -> list[tuple[int, int, int, int]]:
    """The short list (BK, BV, num_warps, num_stages) tried for one key.

    Chosen from a sweep of every config on an H200 (bf16, K = V = 128 and 64/256, g and gk gates;
    ``python -m chunkstate.bench --sweep``): under an eighth of a wave the winners are small tiles
    with deep prefetch (32×32, 4 stages: a program streams slowly, so more programs and more bytes
    in flight per program win; N·H = 4 and 8); between an eighth and a quarter, 64×64 with deep
    prefetch (N·H = 32: 32×32 re-reads k and v four times and was 1.8× slower); around one wave
    64×128 or 64×64; beyond, 128×64 / 64×128. In bucket 1, 32×64 with 8 warps and 3 stages is
    there for the backward: at B1 T65536 H32 it ran in 0.907 ms against 1.130 ms for the best
    64×64 config and 0.954 ms for fla's autotuned kernel (H200, bf16, g).
    """
    if bucket == 0:
        return [(32, 32, 4, 4), (32, 32, 8, 4), (32, 32, 4, 5), (64, 64, 8, 4), (64, 64, 8, 5)]
    if bucket == 1:
        return [(64, 64, 8, 4), (64, 64, 4, 4), (64, 64, 8, 5), (32, 32, 4, 4), (32, 64, 8, 3)]
    if bucket == 2:
        return [(64, 128, 8, 3), (64, 128, 4, 3), (64, 64, 2, 3), (64, 64, 2, 4), (64, 64, 4, 2)]
    return [(128, 64, 8, 3), (64, 128, 4, 4), (128, 64, 8, 4), (64, 64, 2, 3)]


def prune(configs, named_args, **kwargs):
    """``early_config_prune`` for ``triton.autotune``: keep the key's candidates that fit K, V."""
    if len(configs) == 1:
        return configs
    args = {**named_args, **kwargs}
    K, V, bucket = args["K"], args["V"], args["GRID"]
    want = []
    for BK, BV, w, s in candidates(K, V, bucket):
        BK = min(BK, max(16, _host.next_power_of_2(K)))
        BV = min(BV, max(16, _host.next_power_of_2(V)))
        want.append((BK, BV, w, s))
    kept = [c for c in configs if (c.kwargs["BK"], c.kwargs["BV"], c.num_warps, c.num_stages) in want]
    missing = [t for t in want if t not in {(c.kwargs["BK"], c.kwargs["BV"], c.num_warps, c.num_stages) for c in kept}]
    kept += [_config(*t) for t in dict.fromkeys(missing)]
    return kept
