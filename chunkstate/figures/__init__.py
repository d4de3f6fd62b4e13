"""Code that draws the tutorial's figures, one module per topic.

Figures are committed as files in the repository's ``figures/`` folder so a reader sees them
before running anything; ``python -m chunkstate.figures --out DIR`` redraws every figure that needs
no GPU into ``DIR`` (default: ``figures`` under the current directory, i.e. the repository's own
folder when run from its root). Notebooks draw them inline with the same functions.

Paths are explicit, so an installed chunkstate never reads or writes beside site-packages:

- writers take the output folder: ``save(fig, name, out_dir)``, each module's ``main(out_dir)``;
- readers of the committed measurements (``autotune.load_sweep``, ``roofline.load_sweep``,
  ``speed.main``) take a path; without one they read the repository's ``figures/`` folder
  (``repository_figures()``) when chunkstate runs from a checkout, and otherwise raise
  ``FileNotFoundError`` saying what to pass (a wheel ships no measurements).
"""
from __future__ import annotations

from pathlib import Path


def repository_figures() -> Path | None:
    """The checkout's ``figures/`` folder (committed figures and measurements) when chunkstate is
    imported from a source checkout (``pip install -e .`` or the repository on ``sys.path``);
    None for an installed wheel."""
    root = Path(__file__).resolve().parents[2]
    figures = root / "figures"
    return figures if (root / "pyproject.toml").is_file() and figures.is_dir() else None


# The checkout's figures/ folder, or None (an installed wheel): where notebooks find the committed
# benchmark report. Modules read it through committed() or their own default, never write to it
# unless told to.
FIGURES_DIR = repository_figures()


def committed(name: str, path: str | Path | None = None, how: str = "path=...") -> Path:
    """The path of a committed measurement: ``path`` if given, else ``name`` in the checkout's
    ``figures/``. FileNotFoundError when that file does not exist, naming it and saying how to
    pass one (``how``: the argument that takes it)."""
    if path is not None:
        path = Path(path)
    elif FIGURES_DIR is not None:
        path = FIGURES_DIR / name
    else:
        raise FileNotFoundError(f"{name}: chunkstate is not running from a repository checkout, so there is no "
                                f"figures/ folder to read it from; pass its path ({how})")
    if not path.is_file():
        raise FileNotFoundError(f"{path} does not exist; pass the path of a {name} ({how})")
    return path


def save(fig, name: str | Path, out_dir: str | Path) -> Path:
    """Write a matplotlib figure as PNG into ``out_dir`` (created if missing) and close it; return
    the path. ``name``: a file name, or an absolute path (``out_dir`` is then ignored). No
    timestamp metadata, so the same figure gives the same bytes."""
    import matplotlib.pyplot as plt

    path = Path(out_dir) / name  # an absolute ``name`` stays itself
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=120, bbox_inches="tight", metadata={"Software": None})
    plt.close(fig)
    return path
