"""The explorer as a reader uses it: JupyterLab on a private loopback port, chapter 03a opened in
headless Chromium (driven by Playwright), every cell run from the Run menu, the explorer's picture
waited for, the token slider moved with the keyboard, and the picture checked to change.

Skipped, saying why, where Chromium (Debian's ``chromium`` package: ``.ci/run`` installs it where it
can), Playwright's Python package, JupyterLab or ipywidgets is missing. Playwright drives the
system's Chromium (``executable_path``); it never downloads a browser of its own.

JupyterLab serves a copy of the chapter from a temporary folder (with autosave off), so nothing the
browser does can write outputs into the repository's notebook. ``CHUNKSTATE_SAVE_SCREENSHOT=1`` also
writes the final page to ``figures/explorer_browser.png``.
"""
from __future__ import annotations

import json
import os
import shutil
import time
import urllib.error
import urllib.request
from pathlib import Path

import pytest

import lab_server

ROOT = Path(__file__).resolve().parents[1]
NOTEBOOK = "notebooks/03a_explorer.ipynb"
SCREENSHOT = ROOT / "figures" / "explorer_browser.png"
RUN_TIMEOUT_S = 150  # every cell of the chapter, the interpreter on a loaded 2-core machine included
CHROMIUM_FLAGS = ["--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
                  "--disable-background-networking", "--disable-component-update", "--disable-sync",
                  "--disable-dev-shm-usage"]
# JupyterLab settings of the test's server: no autosave (the copy stays as it was), no toasts
SETTINGS = {"docmanager-extension/plugin": {"autosave": False},
            "apputils-extension/notification": {"fetchNews": "false", "checkForUpdates": False,
                                                 "doNotDisturbMode": True}}


def chromium_path() -> str | None:
    for name in ("chromium", "chromium-browser"):
        path = shutil.which(name)
        if path:
            return path
    return "/usr/bin/chromium" if os.path.exists("/usr/bin/chromium") else None


CHROMIUM = chromium_path()
pytestmark = pytest.mark.skipif(CHROMIUM is None, reason="no Chromium installed (Debian: apt-get install chromium; "
                                                         ".ci/run installs it where it runs as root)")


def api(base: str, token: str, path: str, body: dict | None = None):
    """GET (or POST ``body`` to) the server's REST API; the decoded JSON answer."""
    data = None if body is None else json.dumps(body).encode()
    request = urllib.request.Request(f"{base}{path}?token={token}", data=data, method="GET" if body is None else "POST",
                                     headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(request, timeout=30) as r:
        return json.loads(r.read())


@pytest.fixture
def jupyter_lab(tmp_path):
    """JupyterLab on loopback with a token, serving a copy of the chapter: yields (base url, token)."""
    pytest.importorskip("jupyterlab", reason="JupyterLab is not installed (pip install -r requirements.txt)")
    pytest.importorskip("ipywidgets", reason="ipywidgets is not installed (pip install -r requirements.txt)")
    pytest.importorskip("jupyterlab_widgets", reason="jupyterlab_widgets (the widgets' front end) is not installed")
    served = tmp_path / "served"
    (served / "notebooks").mkdir(parents=True)
    shutil.copy(ROOT / NOTEBOOK, served / NOTEBOOK)
    for name, values in SETTINGS.items():
        path = tmp_path / "settings" / "@jupyterlab" / f"{name}.jupyterlab-settings"
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps(values))
    env = {  # TRITON_INTERPRET as chunkstate set it here: the notebook's kernel runs the same way
        "PYTHONPATH": os.pathsep.join([str(ROOT), *filter(None, [os.environ.get("PYTHONPATH")])])}
    with lab_server.running(served, tmp_path, env) as running:
        yield running


def wait_for(predicate, timeout: float, what: str, page):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if predicate():
            return
        page.wait_for_timeout(250)
    raise AssertionError(f"timed out after {timeout:.0f} s waiting for {what}")


def kernel_settled(page, base: str, token: str, quiet_s: float = 3.0, timeout: float = 90.0) -> None:
    """Wait until the notebook's kernel is idle and has stayed the same kernel for ``quiet_s``: a
    freshly opened notebook may replace the kernel it started a few seconds later (seen with
    JupyterLab 4.6), and cells sent before that are lost."""
    indicator = page.locator(".jp-NotebookPanel .jp-Notebook-ExecutionIndicator").first
    deadline, last, since = time.monotonic() + timeout, None, time.monotonic()
    while time.monotonic() < deadline:
        kernels = sorted(s["kernel"]["id"] for s in api(base, token, "/api/sessions") if s.get("kernel"))
        idle = indicator.count() > 0 and indicator.get_attribute("data-status") == "idle"
        now = (tuple(kernels), idle)
        if now != last:
            last, since = now, time.monotonic()
        elif idle and len(kernels) == 1 and time.monotonic() - since >= quiet_s:
            return
        page.wait_for_timeout(250)
    raise AssertionError(f"the notebook's kernel did not settle within {timeout:.0f} s (last seen: {last})")


def run_all_cells(page) -> None:
    """Run → Run All Cells, and wait until a cell shows that it runs ([*] or a count)."""
    accept = page.locator(".jp-Dialog .jp-mod-accept")
    if accept.count():  # a "Select Kernel" dialog all the same: take the notebook's own kernel
        accept.first.click()
    page.locator(".lm-MenuBar-itemLabel", has_text="Run").first.click()
    page.locator(".lm-Menu-item[data-command='runmenu:run-all']").first.click()


def cells_running(page) -> bool:
    return page.locator(".jp-NotebookPanel .jp-InputPrompt").evaluate_all(
        "els => els.some(e => e.innerText.includes('[*]'))")


def test_explorer_slider_redraws_in_chromium(jupyter_lab, tmp_path):
    sync_api = pytest.importorskip("playwright.sync_api", reason="Playwright is not installed (pip install playwright; "
                                                                  "no browser download needed: it drives Chromium)")
    base, token = jupyter_lab
    started = time.monotonic()
    with sync_api.sync_playwright() as pw:
        context = pw.chromium.launch_persistent_context(
            str(tmp_path / "chromium-profile"), executable_path=CHROMIUM, headless=True, args=CHROMIUM_FLAGS,
            viewport={"width": 1280, "height": 1100})
        page = None
        try:
            page = context.new_page()
            page.set_default_timeout(60_000)
            page.goto(f"{base}/lab/tree/{NOTEBOOK}?token={token}", wait_until="domcontentloaded")
            page.locator(".jp-NotebookPanel .jp-Cell").first.wait_for()
            kernel_settled(page, base, token)
            run_all_cells(page)

            # Wait for the explorer's picture. Should the run stop early (the kernel is idle, no cell
            # runs, and still no picture), run every cell again, at most twice.
            image = page.locator("img.chunkstate-view")
            deadline, reruns, stalled = time.monotonic() + RUN_TIMEOUT_S, 0, 0.0
            while image.count() == 0:
                assert time.monotonic() < deadline, f"no explorer picture after {RUN_TIMEOUT_S} s ({reruns} re-runs)"
                page.wait_for_timeout(500)
                idle = page.locator(".jp-Notebook-ExecutionIndicator[data-status='idle']").count() > 0
                stalled = stalled + 0.5 if idle and not cells_running(page) else 0.0
                if stalled >= 10 and reruns < 2:
                    reruns, stalled = reruns + 1, 0.0
                    kernel_settled(page, base, token)
                    run_all_cells(page)
            image.scroll_into_view_if_needed()
            wait_for(lambda: (image.evaluate("el => el.complete && el.naturalWidth") or 0) > 0, 60,
                     "the explorer's first picture", page)
            status = page.locator(".chunkstate-status")
            wait_for(lambda: "drawn in" in status.inner_text(), 30, "the explorer's status line", page)
            before_src, before_png = image.get_attribute("src"), image.screenshot()

            handle = page.locator(".chunkstate-position .noUi-handle")
            handle.focus()
            handle.press("ArrowRight")
            handle.press("ArrowRight")  # token 50 -> 52: the states view names and marks the token

            wait_for(lambda: image.get_attribute("src") != before_src, 60, "the picture to be redrawn", page)
            wait_for(lambda: (image.evaluate("el => el.complete && el.naturalWidth") or 0) > 0, 30,
                     "the new picture to load", page)
            readout = page.locator(".chunkstate-position .widget-readout").inner_text().strip()
            after_png = image.screenshot()
            assert readout == "52", f"the slider reads {readout!r} after two steps right from 50"
            assert after_png != before_png, "moving the token slider left the picture unchanged"
            assert "drawn in" in status.inner_text()
            if os.environ.get("CHUNKSTATE_SAVE_SCREENSHOT") == "1":
                page.evaluate("document.querySelector('img.chunkstate-view').scrollIntoView({block: 'end'})")
                page.wait_for_timeout(500)
                page.screenshot(path=str(SCREENSHOT), full_page=True)
        except Exception:
            if page is not None:  # what the page showed, for the failure report
                page.screenshot(path=str(tmp_path / "failure.png"))
                outputs = page.locator(".jp-OutputArea-output").evaluate_all(
                    "els => els.map(e => e.innerText.slice(0, 300))")
                print(f"screenshot of the failure: {tmp_path / 'failure.png'}; the cells' outputs: {outputs}")
            raise
        finally:
            context.close()
    print(f"browser test: {time.monotonic() - started:.1f} s from opening the notebook to the redrawn picture")
