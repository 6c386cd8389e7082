"""A CNN on mnist trained from the page: headless chromium against ``panel serve app/``.

The sidebar is set the way a person would (Dataset mnist, Architecture cnn, small conv channels,
one epoch), Start is pressed, and the run must finish with a loss curve in the page and the
Quantization tab's model summary (``.qatlab-model-summary``) showing its conv rows with the
numbers of ``ql.summary`` for that config, and a weight histogram per conv and dense layer. The
page must log no console error or warning, and the server no traceback or ERROR line.

Skips with a reason when playwright or chromium is missing, unless ``QATLAB_REQUIRE_BROWSER=1``.
"""
from __future__ import annotations

import re

import pytest

import qatlab as ql
from qatlab.bench.browser import DashboardPage, wait_for
from qatlab.ui.summary_view import config_summary

pytestmark = [pytest.mark.browser, pytest.mark.slow]

DONE = ("finished", "stopped", "diverged", "failed")
CONV_CHANNELS = [4, 8]
HIDDEN = [16]
KERNEL, POOL = 5, 2




@pytest.fixture(scope="module")
def dash(chromium, app_server):
    context = chromium.new_context(viewport={"width": 1400, "height": 900})
    page = DashboardPage(context.new_page(), app_server.url)
    page.console_warnings = []
    page.page.on("console", lambda m: page.console_warnings.append(f"console.{m.type}: {m.text}")
                 if m.type == "warning" else None)
    page.open(timeout=90)
    yield page
    context.close()


def expected_summary() -> ql.ModelSummary:
    cfg = ql.ExperimentConfig()
    cfg.data.dataset = "mnist"
    cfg.model.architecture = "cnn"
    cfg.model.conv_channels = CONV_CHANNELS
    cfg.model.hidden = HIDDEN
    cfg.model.kernel_size, cfg.model.pool = KERNEL, POOL
    cfg.quant.weights = "ternary"
    return config_summary(cfg)


def test_cnn_on_mnist_trains_from_the_page(dash):
    dash.select("Dataset", "mnist")
    dash.select("Architecture", "cnn")
    dash.set_input("Conv channels", ", ".join(map(str, CONV_CHANNELS)))
    dash.set_input("Kernel size", KERNEL)
    dash.set_input("Pool", POOL)
    dash.select("Weights", "ternary")
    dash.set_input("Hidden sizes (list)", ", ".join(map(str, HIDDEN)))
    dash.set_input("Epochs", 1)
    before = set(dash.source_lengths())
    dash.click("Start")
    status = dash.wait_status(lambda s: s in DONE, timeout=180, what="finished")
    assert status == "finished", dash.text_of(".qatlab-status")
    new = wait_for(lambda: {k: n for k, n in dash.source_lengths().items() if k not in before and n > 0}, 10,
                    "a new loss-source-<run id> with rows")
    assert len(new) == 1 and min(new.values()) >= 2, new

    dash.page.locator(".bk-tab").filter(has_text=re.compile("^Quantization$")).first.click()
    rows = dash.page.locator(".qatlab-model-summary tr.qatlab-summary-conv")
    wait_for(lambda: rows.count() == len(CONV_CHANNELS), 15, "the summary table's conv rows")
    table = dash.text_of(".qatlab-model-summary")
    s = expected_summary()
    for r in s.layers:
        assert r["name"] in table and f"{r['macs']:,}" in table, (r["name"], table)
    assert f"{s.totals['params']:,}" in table and f"{s.totals['compression']:.2f}" in table, table
    assert "ternary" in table
    n_weight_layers = len(CONV_CHANNELS) + len(HIDDEN) + 1
    assert dash.model_names("fig-hist-latent-") == [f"fig-hist-latent-{i}" for i in range(n_weight_layers)]


def test_page_and_server_stayed_clean(dash, app_server):
    assert dash.console_errors == [], "\n".join(dash.console_errors)
    assert dash.console_warnings == [], "\n".join(dash.console_warnings)
    assert "Traceback" not in dash.body_text()
    lines = app_server.log_path.read_text(errors="replace").splitlines()
    bad = [line for line in lines if re.search(r"Traceback|\bERROR\b", line)]
    assert not bad, f"Traceback/ERROR in the server log:\n{app_server.log_tail(60)}"
