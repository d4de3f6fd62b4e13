"""Code that draws the tutorial's figures, one module per topic.

Figures are committed as files in the repository's ``figures/`` folder so a reader sees them
before running anything; ``python -m chunkstate.figures`` redraws every figure that needs no GPU.
Notebooks draw them inline with the same functions.
"""
from __future__ import annotations

from pathlib import Path

FIGURES_DIR = Path(__file__).resolve().parents[2] / "figures"


def save(fig, name: str | Path) -> Path:
    """Write a matplotlib figure as PNG and close it; return the path. ``name``: a file name under
    ``figures/``, or an absolute path. No timestamp metadata, so the same figure gives the same bytes."""
    import matplotlib.pyplot as plt

    path = FIGURES_DIR / name  # an absolute ``name`` stays itself
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=120, bbox_inches="tight", metadata={"Software": None})
    plt.close(fig)
    return path
