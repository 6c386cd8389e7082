"""Browser test of the Sweeps tab: define a sweep, start it, watch the table fill, select a row and see
its run highlighted in the charts (a served app on a temporary run store, headless chromium)."""
from __future__ import annotations

import re

import pytest

from qatlab.bench.browser import ROOT, AppServer, DashboardPage, wait_for

SCREENSHOT = ROOT / "assets" / "sweeps.png"      # the README's picture of the Sweeps tab

# The page's state as the browser holds it: rows of the sweep table's source, the runs source's
# selection (the charts' highlight), and the heatmap's selected cells.
_JS_STATE = """() => {
  const out = {rows: null, table_selected: null, chart_selected: null, heat_selected: null, statuses: []};
  for (const doc of Bokeh.documents)
    for (const m of doc.all_models) {
      if (m.name === 'sweep-runs') out.chart_selected = [...m.selected.indices];
      if (m.name === 'sweep-heat') out.heat_selected = [...m.selected.indices];
      if (m.css_classes && m.css_classes.includes('qatlab-sweep-table') && m.source) {
        out.rows = m.source.get_length();
        out.table_selected = [...m.source.selected.indices];
        out.statuses = m.source.data.status ? [...m.source.data.status] : [];
      }
    }
  return out;
}"""


@pytest.fixture(scope="module")
def sweep_server(chromium, tmp_path_factory):
    """``panel serve app/`` on a temporary run store (``QATLAB_STORE``), killed at teardown."""
    store = tmp_path_factory.mktemp("store") / "runs.sqlite"
    server = AppServer(root=ROOT, inspect=True)
    with pytest.MonkeyPatch.context() as mp:          # the server process inherits it
        mp.setenv("QATLAB_STORE", str(store))
        try:
            server.start()
        except RuntimeError as exc:
            pytest.fail(str(exc))
    try:
        yield server
    finally:
        server.stop()


def _tab(dash, name: str) -> None:
    dash.page.locator(".bk-tab").filter(has_text=re.compile(f"^{name}$")).first.click()
    wait_for(lambda: " ".join(dash.page.locator(".bk-tab.bk-active").first.inner_text().split()) == name, 10,
             f"tab {name} active")


@pytest.mark.browser
@pytest.mark.slow
def test_define_start_fill_and_select_in_the_sweeps_tab(chromium, sweep_server):
    context = chromium.new_context(viewport={"width": 1400, "height": 1600})   # (tall: the screenshot shows the charts)
    try:
        dash = DashboardPage(context.new_page(), sweep_server.url)
        dash.open(timeout=90)
        dash.select("Dataset", "digits")                 # a tiny base config in the sidebar
        dash.select("Architecture", "mlp")
        dash.set_input("Hidden sizes (list)", "16")
        dash.set_input("Epochs", 2)
        _tab(dash, "Sweeps")
        axes = dash.page.get_by_label("Axes", exact=True)
        axes.fill("quant.ste = identity, bogus")         # a bad value: named on the page, nothing starts
        axes.press("Tab")
        dash.click("Start sweep")
        wait_for(lambda: "bogus" in dash.body_text(), 20, "the bad value named on the page")
        assert dash.page.evaluate(_JS_STATE)["rows"] == 0
        axes.fill("quant.ste = identity, hard_tanh\nquant.weight_bits = [2, 4]")
        axes.press("Tab")
        dash.page.get_by_label("Weights", exact=True).select_option("fake")
        dash.set_input("Seeds", "0, 1")
        dash.click("Start sweep")
        state = lambda: dash.page.evaluate(_JS_STATE)   # noqa: E731
        wait_for(lambda: (state()["rows"] or 0) >= 1, 120, "the first row in the sweep table")
        wait_for(lambda: state()["rows"] == 8 and set(state()["statuses"]) == {"finished"}, 240,
                 "eight finished runs in the table")
        assert "8 finished" in dash.body_text()
        dash.page.locator(".qatlab-sweep-table .tabulator-row").nth(2).locator("input[type=checkbox]").click()
        wait_for(lambda: state()["chart_selected"] == [2], 10, "the ticked row highlighted in the charts")
        s = state()
        assert s["table_selected"] == [2] and len(s["heat_selected"]) == 1
        dash.page.screenshot(path=str(SCREENSHOT))
        dash.click("Open these runs")
        wait_for(lambda: dash.model_names("fig-sweep-loss") == ["fig-sweep-loss"], 20, "the run's curves")
        assert dash.console_errors == []
        sent = sweep_server.inspect("/patches")      # every update on Panel's write queue (bokeh_path)
        assert sent["count"] == 0, sent
    finally:
        context.close()
