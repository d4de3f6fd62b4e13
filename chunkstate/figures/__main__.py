"""Redraw every figure that needs no GPU: ``python -m chunkstate.figures``."""
import importlib
import pkgutil

import matplotlib

matplotlib.use("Agg")

import chunkstate.figures as _pkg  # noqa: E402

for info in pkgutil.iter_modules(_pkg.__path__):
    if info.name.startswith("_"):
        continue
    module = importlib.import_module(f"chunkstate.figures.{info.name}")
    if hasattr(module, "main"):
        for path in module.main():
            print("wrote", path)
