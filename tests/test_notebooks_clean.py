"""The notebooks are committed clean, their images exist, and the README's chapter table is honest.

A notebook stored with outputs shows a reader stale results and makes diffs unreadable; one with
execution counts hides the order its cells were really run in. Clear them with
``jupyter nbconvert --clear-output --inplace notebooks/NN_x.ipynb``.
"""
from __future__ import annotations

import re
import subprocess
from pathlib import Path

import nbformat
import pytest

ROOT = Path(__file__).resolve().parents[1]
NOTEBOOK_DIR = ROOT / "notebooks"
NOTEBOOKS = sorted(NOTEBOOK_DIR.glob("*.ipynb"))
# Markdown images ![alt](path "title") and HTML <img src="path">.
IMAGE = re.compile(r"!\[[^\]]*\]\(\s*<?([^)\s>]+)>?(?:\s+\"[^\"]*\")?\s*\)|<img\s[^>]*src=[\"']([^\"']+)[\"']")


def test_there_are_notebooks():
    assert NOTEBOOKS, f"no notebooks found in {NOTEBOOK_DIR}"


@pytest.mark.parametrize("path", NOTEBOOKS, ids=[p.name for p in NOTEBOOKS])
def test_notebook_is_valid_and_has_no_outputs(path):
    nb = nbformat.read(path, as_version=4)
    nbformat.validate(nb)
    dirty = [i for i, cell in enumerate(nb.cells)
             if cell.cell_type == "code" and (cell.outputs or cell.execution_count is not None)]
    assert not dirty, (f"{path.name}: code cells {dirty} carry outputs or execution counts; clear them with "
                       f"`jupyter nbconvert --clear-output --inplace {path.relative_to(ROOT)}`")
    attached = [i for i, cell in enumerate(nb.cells) if cell.get("attachments")]
    assert not attached, f"{path.name}: cells {attached} embed attachments; put figures in figures/ instead"


@pytest.mark.parametrize("path", NOTEBOOKS, ids=[p.name for p in NOTEBOOKS])
def test_notebook_images_exist(path):
    nb = nbformat.read(path, as_version=4)
    missing = []
    for i, cell in enumerate(nb.cells):
        if cell.cell_type != "markdown":
            continue
        for match in IMAGE.finditer(cell.source):
            target = match.group(1) or match.group(2)
            if re.match(r"[a-z]+:", target):  # http:, https:, data: — not a repository file
                continue
            if not (path.parent / target).resolve().is_file():
                missing.append(f"cell {i}: {target}")
    assert not missing, f"{path.name}: images that do not exist: {missing}"


def test_image_pattern_finds_links():
    """The pattern above must see the links it checks (else the test above passes vacuously)."""
    text = '![a](../figures/x.png) ![b](../figures/y.png "title") <img src="../figures/z.png" width=3>'
    assert [m.group(1) or m.group(2) for m in IMAGE.finditer(text)] == \
        ["../figures/x.png", "../figures/y.png", "../figures/z.png"]


def committed_notebooks() -> set[str]:
    """Notebooks git tracks (all of notebooks/ when this is not a git checkout): a chapter still
    being written, not committed yet, is not expected in the README."""
    try:
        out = subprocess.run(["git", "ls-files", "--", "notebooks/*.ipynb"], cwd=ROOT, capture_output=True,
                             text=True, check=True, timeout=30).stdout
    except (OSError, subprocess.SubprocessError):
        return {p.relative_to(ROOT).as_posix() for p in NOTEBOOKS}
    return set(out.split())


def test_readme_chapter_table_matches_notebooks():
    """Every committed notebook is linked from the README, and every notebook the README links exists."""
    readme = (ROOT / "README.md").read_text()
    linked = set(re.findall(r"\]\((notebooks/[^)\s]+\.ipynb)\)", readme))
    present = {p.relative_to(ROOT).as_posix() for p in NOTEBOOKS}
    assert not linked - present, f"README.md links notebooks that do not exist: {sorted(linked - present)}"
    unlisted = committed_notebooks() - linked
    assert not unlisted, (f"notebooks missing from README.md's chapter table: {sorted(unlisted)} "
                          f"(link them there: [notebooks/NN_x.ipynb](notebooks/NN_x.ipynb))")
