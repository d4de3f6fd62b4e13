"""Code that draws the tutorial's figures, one module per topic.

Figures are committed as files in the repository's ``figures/`` folder so a reader sees them
before running anything; ``python -m chunkstate.figures`` redraws every figure that needs no GPU.
Notebooks draw them inline with the same functions.
"""
from __future__ import annotations

from pathlib import Path

FIGURES_DIR = Path(__file__).resolve().parents[2] / "figures"


def save(fig, name: str) -> Path:
    """Save a matplotlib figure as ``figures/<name>`` (PNG, no timestamp metadata); return the path."""
    FIGURES_DIR.mkdir(exist_ok=True)
    path = FIGURES_DIR / name
    fig.savefig(path, dpi=120, bbox_inches="tight", metadata={"Software": None})
    return path
