"""Fixtures of the browser tests: a ``panel serve app/`` subprocess and headless Debian chromium.

Both skip with a reason when the browser stack is missing (no ``playwright`` python package,
no ``/usr/bin/chromium``), unless ``QATLAB_REQUIRE_BROWSER=1`` is set (CI sets it): then they
fail instead. Playwright's own browser downloads are never used (``executable_path`` is
Debian's chromium); see :mod:`qatlab.bench.dashboard` for the shared helpers.
"""
from __future__ import annotations

import os

import pytest

from qatlab.bench.browser import ROOT, AppServer, DashboardPage, browser_unavailable, launch_chromium


def _require_browser() -> None:
    reason = browser_unavailable()
    if reason is None:
        return
    if os.environ.get("QATLAB_REQUIRE_BROWSER") == "1":
        pytest.fail(f"QATLAB_REQUIRE_BROWSER=1 but the browser cannot run: {reason}")
    pytest.skip(f"browser test skipped: {reason}")


@pytest.fixture(scope="module")
def chromium():
    """A launched headless chromium (Playwright sync API), closed at teardown."""
    _require_browser()
    from playwright.sync_api import sync_playwright

    with sync_playwright() as pw:
        browser = launch_chromium(pw)
        try:
            yield browser
        finally:
            browser.close()


@pytest.fixture(scope="module")
def app_server(chromium):
    """``panel serve app/ --port <free port>`` started from the repository root; killed at teardown.

    Depends on ``chromium`` so that a missing browser skips before a server is started.
    """
    server = AppServer(root=ROOT)
    try:
        server.start()
    except RuntimeError as exc:
        pytest.fail(str(exc))
    try:
        yield server
    finally:
        server.stop()


@pytest.fixture
def open_app(chromium):
    """``open_app(**env)`` -> (server, page): ``panel serve app/`` with these environment variables
    (its process only) and an opened :class:`DashboardPage` on it; both closed at teardown."""
    opened = []

    def open_(**env):
        server = AppServer(root=ROOT, env=env)
        try:
            server.start()
        except RuntimeError as exc:
            pytest.fail(str(exc))
        opened.append(server.stop)
        context = chromium.new_context(viewport={"width": 1400, "height": 900})
        opened.append(context.close)
        return server, DashboardPage(context.new_page(), server.url).open(timeout=90)
    yield open_
    for close in reversed(opened):
        close()
