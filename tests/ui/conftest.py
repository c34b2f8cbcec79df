"""Browser tests: the real app (`python app.py`, real bundled model) launched once per test session on a free
port, and Chromium through Playwright's sync API. Every test here is marked `ui`."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from tests.support.local_app import running_app

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


@pytest.fixture(scope="session")
def app_url():
    OUT.mkdir(exist_ok=True)
    # fast heartbeat, so closing a page fires demo.unload at once (sessions live server-side, so gr.State's short
    # e2e lifetime does not matter here)
    with running_app(OUT / "app.log", {"GRADIO_IS_E2E_TEST": "1"}, STARTUP_S) as url:
        yield url


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
