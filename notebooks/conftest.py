"""nbval settings for the notebooks (pytest loads this conftest for every notebook collected here).

Cells are run with ``--nbval-lax`` (see pyproject.toml): a cell fails only when it raises. For
the cells that do compare output (``# NBVAL_CHECK_OUTPUT``), stderr is never compared: warnings
and progress messages differ between machines and versions. nbval 0.11.0 reads the output keys it
ignores from the notebook collector's ``skip_compare`` tuple; streams are compared under their
name (``stderr``), so adding that name drops them.
"""


def pytest_collectstart(collector):
    if collector.path.suffix == ".ipynb" and hasattr(collector, "skip_compare"):
        if "stderr" not in collector.skip_compare:
            collector.skip_compare = collector.skip_compare + ("stderr",)
