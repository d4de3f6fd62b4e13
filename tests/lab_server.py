"""A JupyterLab server for the tests that use one (test_jupyterlab.py, test_browser.py): started on
a private loopback port with a token and its own config, runtime, workspace and settings folders
under ``tmp_path``, waited for until its REST API answers, and stopped afterwards."""
from __future__ import annotations

import contextlib
import os
import secrets
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from pathlib import Path

import pytest

START_TIMEOUT_S = 90  # a cold start on a loaded 2-core machine takes 5-20 s
STOP_TIMEOUT_S = 15


def free_loopback_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@contextlib.contextmanager
def running(root_dir: Path, tmp_path: Path, env: dict | None = None):
    """JupyterLab serving ``root_dir``: yields (base url, token). ``env``: more environment variables
    for the server (and so for its kernels). Fails the test, with the server's log, if it exits or
    does not answer within ``START_TIMEOUT_S``."""
    port, token = free_loopback_port(), secrets.token_hex(16)
    env = {**os.environ, **(env or {}),
           "JUPYTER_CONFIG_DIR": str(tmp_path / "config"), "JUPYTER_RUNTIME_DIR": str(tmp_path / "runtime"),
           "JUPYTERLAB_WORKSPACES_DIR": str(tmp_path / "workspaces"),
           "JUPYTERLAB_SETTINGS_DIR": str(tmp_path / "settings")}
    log_path = tmp_path / "jupyter.log"
    log = open(log_path, "wb")
    cmd = [sys.executable, "-m", "jupyterlab", "--no-browser", "--allow-root", f"--port={port}", "--port-retries=0",
           "--ServerApp.ip=127.0.0.1", f"--ServerApp.token={token}", f"--ServerApp.root_dir={root_dir}"]
    proc = subprocess.Popen(cmd, cwd=root_dir, env=env, stdout=log, stderr=subprocess.STDOUT)
    base = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + START_TIMEOUT_S
        while True:
            if proc.poll() is not None:
                pytest.fail(f"jupyter lab exited with code {proc.returncode}:\n"
                            f"{log_path.read_text(errors='replace')[-3000:]}")
            try:
                with urllib.request.urlopen(f"{base}/api/status?token={token}", timeout=5) as r:
                    if r.status == 200:
                        break
            except (urllib.error.URLError, ConnectionError, TimeoutError, OSError):
                pass
            if time.monotonic() > deadline:
                pytest.fail(f"jupyter lab did not answer within {START_TIMEOUT_S} s:\n"
                            f"{log_path.read_text(errors='replace')[-3000:]}")
            time.sleep(0.5)
        yield base, token
    finally:
        proc.terminate()
        try:
            proc.wait(timeout=STOP_TIMEOUT_S)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(timeout=STOP_TIMEOUT_S)
        log.close()
