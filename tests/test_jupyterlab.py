"""The quickstart's `jupyter lab` really serves the tutorial: start JupyterLab on a private loopback
port, check through its REST API that every notebook is served and that the /lab page loads,
then stop it. Skipped (saying why) only where JupyterLab is not installed."""
from __future__ import annotations

import json
import urllib.error
import urllib.request
from pathlib import Path

import pytest

import lab_server

pytest.importorskip("jupyterlab", reason="JupyterLab is not installed (pip install -r requirements.txt installs it)")

ROOT = Path(__file__).resolve().parents[1]
def get(url: str, timeout: float = 10.0):
    """(status, body) of a GET; HTTP errors give their status instead of raising."""
    try:
        with urllib.request.urlopen(url, timeout=timeout) as response:
            return response.status, response.read()
    except urllib.error.HTTPError as err:
        return err.code, err.read()


@pytest.fixture
def jupyter_lab(tmp_path):
    """A running JupyterLab rooted at the repository: yields (base url, token); stops it afterwards."""
    with lab_server.running(ROOT, tmp_path) as running:
        yield running


def test_jupyterlab_serves_every_notebook(jupyter_lab):
    base, token = jupyter_lab
    status, body = get(f"{base}/api/contents/notebooks?token={token}")
    assert status == 200, f"GET /api/contents/notebooks answered {status}: {body[:300]!r}"
    served = {item["name"] for item in json.loads(body)["content"] if item["type"] == "notebook"}
    expected = {p.name for p in (ROOT / "notebooks").glob("*.ipynb")}
    assert expected, "no notebooks in notebooks/"
    assert served == expected, f"served {sorted(served)}, but notebooks/ holds {sorted(expected)}"
    for name in sorted(expected):  # each one opens as a notebook model
        status, body = get(f"{base}/api/contents/notebooks/{name}?token={token}&content=1")
        assert status == 200, f"GET {name} answered {status}"
        model = json.loads(body)
        assert model["type"] == "notebook" and model["content"]["cells"], f"{name} has no cells when served"
    status, body = get(f"{base}/lab?token={token}")
    assert status == 200, f"GET /lab answered {status}"
    assert b"jupyter-config-data" in body, "GET /lab did not return the JupyterLab page"
    # Without the token the API refuses: the server is not open to anyone on the machine.
    assert get(f"{base}/api/contents/notebooks")[0] in (401, 403)
