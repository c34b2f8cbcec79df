"""Browser tests: the real app (`python app.py`, real bundled model) launched once per test session on a free
port, and Chromium through Playwright's sync API. Every test here is marked `ui`."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
OUT = ROOT / "test-output"
CHROMIUM = os.environ.get("CHROMIUM", "/usr/bin/chromium")
CHROMIUM_ARGS = ["--no-sandbox", "--disable-gpu", "--disable-background-networking",
                 "--disable-component-update", "--disable-sync", "--no-first-run"]
STARTUP_S = 240  # first start converts the GGUF (~25 s on a quiet machine)
TURN_MS = 120_000  # generous: a 2-core CPU, maybe shared with other jobs


def pytest_collection_modifyitems(items):
    here = Path(__file__).parent
    for item in items:
        if here in Path(str(item.fspath)).parents:
            item.add_marker(pytest.mark.ui)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="session")
def app_url():
    OUT.mkdir(exist_ok=True)
    port = _free_port()
    env = dict(os.environ, GRADIO_SERVER_NAME="127.0.0.1", GRADIO_SERVER_PORT=str(port),
               GRADIO_ANALYTICS_ENABLED="False",
               # fast heartbeat, so closing a page fires demo.unload at once (sessions live server-side,
               # so gr.State's short e2e lifetime does not matter here)
               GRADIO_IS_E2E_TEST="1")
    log = open(OUT / "app.log", "w")
    proc = subprocess.Popen([sys.executable, "app.py"], cwd=ROOT, env=env, stdout=log, stderr=subprocess.STDOUT)
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + STARTUP_S
    try:
        while True:
            if proc.poll() is not None:
                raise RuntimeError(f"app.py exited with {proc.returncode}; see {OUT / 'app.log'}")
            try:
                urllib.request.urlopen(f"{url}/gradio_api/info", timeout=5).read()
                break
            except OSError:
                if time.monotonic() > deadline:
                    raise RuntimeError(f"app.py did not start in {STARTUP_S} s; see {OUT / 'app.log'}")
                time.sleep(0.5)
        yield url
    finally:
        proc.terminate()
        try:
            proc.wait(timeout=20)
        except subprocess.TimeoutExpired:
            proc.kill()
        log.close()


@pytest.fixture(scope="session")
def browser():
    from playwright.sync_api import sync_playwright

    with sync_playwright() as p:
        browser = p.chromium.launch(executable_path=CHROMIUM, args=CHROMIUM_ARGS)
        yield browser
        browser.close()


@pytest.fixture
def open_page(app_url, browser):
    """open_page() -> a new page in its own browser context (its own Gradio session), loaded and ready."""
    from playwright.sync_api import expect

    contexts = []

    def open_():
        context = browser.new_context(viewport={"width": 1400, "height": 1100})
        contexts.append(context)
        page = context.new_page()
        page.set_default_timeout(30_000)
        page.goto(app_url)
        expect(page.locator("#stats")).to_contain_text("Server:", timeout=60_000)
        return page

    yield open_
    for context in contexts:
        context.close()
