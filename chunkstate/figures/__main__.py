"""Redraw every figure that needs no GPU: ``python -m chunkstate.figures [--out DIR]``.

``--out``: the folder to write into, default ``figures`` under the current directory (from the
repository's root: its own ``figures/``). The figures drawn from committed measurements (the
autotune sweep, the roofline, the benchmark) read them from the repository's ``figures/`` folder;
outside a checkout they are skipped, saying why.
"""
import argparse
import importlib
import pkgutil
import sys
from pathlib import Path

import matplotlib

matplotlib.use("Agg")

import chunkstate.figures as _pkg  # noqa: E402


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="python -m chunkstate.figures", description=__doc__.split("\n")[0])
    parser.add_argument("--out", default="figures", type=Path,
                        help="folder to write the figures into (default: figures, relative to the current directory)")
    args = parser.parse_args(argv)
    out = args.out.resolve()
    print(f"writing figures to {out}")
    for info in pkgutil.iter_modules(_pkg.__path__):
        if info.name.startswith("_"):
            continue
        module = importlib.import_module(f"chunkstate.figures.{info.name}")
        if not hasattr(module, "main"):
            continue
        try:
            paths = module.main(out_dir=out)
        except FileNotFoundError as e:
            print(f"skipped chunkstate.figures.{info.name}: {e}")
            continue
        for path in paths:
            print("wrote", path)
    return 0


if __name__ == "__main__":
    sys.exit(main())
