"""Benchmark chunkstate's ``chunk_fwd_h`` / ``chunk_bwd_dh`` against fla-core 0.6.0 and the memory roof.

Run ``python -m chunkstate.bench`` on a CUDA GPU (``--help`` lists the modes; ``--plan`` needs no GPU).

Both kernels only stream: the forward reads k, v and the gates once and writes one state per
split; the backward reads q, do and the gates and writes one gradient per split. So the yardstick
is the device's copy bandwidth, measured in the same run (a torch copy of 1 GiB, read + write
bytes / median time)::

    effective TB/s = unique bytes / time        floor = unique bytes / copy bandwidth
    ×floor         = time / floor               (1 = at the copy roof; lower is better)

Unique bytes (``unique_bytes``) count every tensor a kernel must touch exactly once; the benchmark
passes no h0 / ht / dht / dh0. fla's backward with split_size > chunk_size stores the wrong
gradient (a known bug): it is timed, marked "fla wrong", and left out of the comparison.

The parts:

- ``model``: cases, shapes, bytes, derived numbers, predicted pieces, the ``--plan`` estimate.
  Pure (no GPU): what the exercises, figures and notebooks use; re-exported here.
- ``report``: the table, the summary, the JSON and the figure; re-exported here.
- ``runner``: the GPU side (inputs, timings, fla-core's autotuners, the run loops). Only the
  benchmark imports it; a notebook's GPU cell does ``from chunkstate.bench import runner``.
- ``gla``: ``--gla``, ``chunkstate.chunk_gla`` against fla's op.
- ``calibrate``: ``--calibrate``, the pieces cost model's constants measured on this GPU.
- ``__main__``: the command line.
"""
from .model import (BT, FLA_CONFIGS, FLA_SHAPES, GATES, OWN_SHAPES, QUICK_SHAPES, RANDOM_DIMS, RANDOM_DISTRIBUTION,
                    RANDOM_HEADS, RANDOM_MAX_STATE_BYTES, SHAPES, SWEEP_SHAPES, VARIANT_SHAPES, VARLEN_LENS, Case,
                    Shape, case_pieces, derive, estimate, explicit_pieces, fla_key, format_plan, geomean, make_cases,
                    n_splits, new_result, ours_launches, paired_ratio, parse_shape, predicted_pieces, programs_64,
                    random_cases, random_shapes, select_shapes, sweep_estimate, tried_configs, twin_ratio, unique_bytes)
from .report import (COLUMNS, case_line, format_random_summary, format_summary, format_sweep, format_table,
                     gpu_tag, output_paths, random_summary, readme_random_table, readme_suite_table, write_json,
                     write_png)

__all__ = ["BT", "COLUMNS", "FLA_CONFIGS", "FLA_SHAPES", "GATES", "OWN_SHAPES", "QUICK_SHAPES", "RANDOM_DIMS",
           "RANDOM_DISTRIBUTION", "RANDOM_HEADS", "RANDOM_MAX_STATE_BYTES", "SHAPES", "SWEEP_SHAPES",
           "VARIANT_SHAPES", "VARLEN_LENS", "Case", "Shape", "case_line", "case_pieces", "derive", "estimate",
           "explicit_pieces", "fla_key", "format_plan", "format_random_summary", "format_summary", "format_sweep",
           "format_table", "geomean", "gpu_tag", "make_cases", "n_splits", "new_result", "ours_launches",
           "output_paths", "paired_ratio", "parse_shape", "predicted_pieces", "programs_64", "random_cases",
           "random_shapes", "random_summary", "readme_random_table", "readme_suite_table", "select_shapes",
           "sweep_estimate", "tried_configs", "twin_ratio", "unique_bytes", "write_json", "write_png"]
