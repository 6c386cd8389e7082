"""A new user's first hour, in headless chromium against ``panel serve app/`` on an EMPTY Numba cache.

The server starts with ``NUMBA_CACHE_DIR`` set to a new temporary directory, so its warm-up
(:mod:`qatlab.warmup`, run by app/main.py before the server listens) compiles every kernel. Then:

- the first Start streams its first metrics row without compiling anything: within
  :data:`NOT_COMPILING_S` of the click (a kernel compiled at the click takes 20 s or more). The
  seconds are printed (``pytest -s`` shows them) against the goal, :data:`FIRST_ROW_GOAL_S`; the
  goal is not asserted, since a machine busy with other work misses it by its load alone;
- a run, a phase run, a run with quantized activations and an STE comparison finish, and every
  tab is visited after each: no figure title is cut off or covered by its toolbar, x axes end
  within 5% of the data once the runs have ended, the Phases timeline legend is outside the
  plot area, the Quantization header says activations are quantized, the four STE loss curves
  have four dash styles;
- the page logged no console error and no console warning, and every update went out on Panel's
  write queue (:mod:`qatlab.bench.bokeh_path`).
"""
from __future__ import annotations

import os
import re
import tempfile
import time
from pathlib import Path

import pytest

from qatlab.bench.browser import ROOT, AppServer, DashboardPage, wait_for
from qatlab.ui.dashboard import TAB_NAMES

pytestmark = [pytest.mark.browser, pytest.mark.slow]

FIRST_ROW_GOAL_S = 3.0
NOT_COMPILING_S = 10.0
X_SLACK = 0.05
SHORT_EPOCHS = 2       # of the page's default CNN (~1.5 s alone)
TABS = list(TAB_NAMES)  # every tab the page has
DONE = ("finished", "stopped", "diverged", "failed")
MEASURED: dict[str, float] = {}


def _wait_for(fn, timeout: float, what: str, step: float = 0.05):
    return wait_for(fn, timeout, what, step)


@pytest.fixture(scope="module")
def cold_server(chromium):
    """The app served with an empty Numba cache (its warm-up compiles everything before it listens)."""
    with tempfile.TemporaryDirectory(prefix="qatlab-numba-") as cache:
        server = AppServer(root=ROOT, startup_timeout=900, inspect=True)
        env_before = dict(os.environ)
        os.environ["NUMBA_CACHE_DIR"] = cache     # the server process inherits it
        t0 = time.monotonic()
        try:
            server.start()
        except RuntimeError as exc:
            pytest.fail(str(exc))
        finally:
            os.environ.clear()
            os.environ.update(env_before)
        MEASURED["server ready (s, empty cache)"] = time.monotonic() - t0
        assert any(Path(cache).rglob("*.nbi")), "the warm-up wrote nothing to the empty cache"
        try:
            yield server
        finally:
            server.stop()


class Page(DashboardPage):
    """DashboardPage that also records console warnings, and finds tabs and sidebar items."""

    def __init__(self, page, url):
        super().__init__(page, url)
        page.on("console", lambda m: self.console_errors.append(f"console.warning: {m.text}")
                if m.type == "warning" else None)

    def tab(self, name: str) -> None:
        self.page.locator(".bk-tab").filter(has_text=re.compile(f"^{name}$")).first.click()
        active = self.page.locator(".bk-tab.bk-active")
        # 30 s: on a loaded CI machine the browser once took over 10 s to take the click while it drew a tab
        _wait_for(lambda: name in [t.strip() for t in active.all_inner_texts()], 30, f"tab {name} active")

    def sidebar_text(self, text: str):
        return self.page.locator("#sidebar").get_by_text(text, exact=True).first

    def checkbox(self, label: str):
        return self.page.locator("#sidebar .bk-Checkbox").filter(has_text=re.compile(f"^{label}$")).locator("input").first


# Every drawn Figure: its title's text width against the room its title panel has (the toolbar
# takes the rest of the row when above), the frame and any legend's box, and per auto x range the
# range against the finite x extent of its renderers' data.
_JS_FIGURES = """() => {
  const out = [], seen = new Set();
  const ctx = document.createElement('canvas').getContext('2d');
  const visit = (v) => {
    if (v == null || seen.has(v)) return; seen.add(v);
    if (v.model && v.model.type === 'Figure' && v.bbox && v.bbox.width > 0 && v.el.isConnected) {
      const m = v.model, tv = v.renderer_views.get(m.title);
      ctx.font = tv.visuals.text.font_value();
      const fb = v.frame.bbox;
      const legends = m.renderers.concat(m.center, m.right, m.left, m.above, m.below)
        .filter((r) => r.type === 'Legend').map((r) => v.renderer_views.get(r))
        .filter((lv) => lv != null && lv.bbox != null)
        .map((lv) => ({panel: m.right.includes(lv.model) ? 'right' : 'center', box: [lv.bbox.left, lv.bbox.top, lv.bbox.right, lv.bbox.bottom]}));
      const xs = [];
      for (const r of m.renderers) {
        if (!r.glyph || !r.data_source || !r.visible) continue;
        for (const a of ['x', 'x0', 'x1']) {
          const f = r.glyph[a] && r.glyph[a].field;
          if (f && r.data_source.data[f]) for (const x of r.data_source.data[f]) if (Number.isFinite(x)) xs.push(x);
        }
      }
      out.push({name: m.name, title: m.title.text, text_width: ctx.measureText(m.title.text).width,
                title_room: tv.bbox.width, toolbar: m.toolbar_location,
                frame: [fb.left, fb.top, fb.right, fb.bottom], legends,
                auto_x: m.x_range.tags.includes('qatlab-auto'), x: [m.x_range.start, m.x_range.end],
                data_x: xs.length ? [Math.min(...xs), Math.max(...xs)] : null});
    }
    for (const c of (v.children ? v.children() : [])) visit(c);
  };
  for (const v of Object.values(Bokeh.index)) visit(v);
  return out;
}"""


def figures(dash) -> list[dict]:
    return dash.page.evaluate(_JS_FIGURES)


def check_figures(dash, where: str, ended: bool) -> list[dict]:
    """Titles fit their room; once the runs ended, auto x ranges end within 5% of the data."""
    figs = figures(dash)
    for f in figs:
        assert f["text_width"] <= f["title_room"] + 0.5, f"{where}: title {f['title']!r} cut off or covered: {f}"
        if ended and f["auto_x"] and f["data_x"] is not None and f["data_x"][1] > f["data_x"][0]:
            lo, hi = f["data_x"]
            assert f["x"][0] <= lo and hi <= f["x"][1] <= hi + X_SLACK * (hi - lo), f"{where}: {f['name']} x {f}"
    return figs


def settled_figures(dash, where: str, timeout: float = 10.0) -> list[dict]:
    """:func:`check_figures` once it passes (a tab's figures build, draw and get their range fit
    over a few ticks), or its failure at the deadline."""
    deadline = time.monotonic() + timeout
    while True:
        try:
            return check_figures(dash, where, ended=True)
        except AssertionError:
            if time.monotonic() > deadline:
                raise
            time.sleep(0.2)


def visit_every_tab(dash, where: str) -> None:
    for name in TABS:
        dash.tab(name)
        settled_figures(dash, f"{where} / {name}")
    dash.tab("Overview")


@pytest.fixture(scope="module")
def dash(chromium, cold_server):
    context = chromium.new_context(viewport={"width": 1400, "height": 900})
    page = Page(context.new_page(), cold_server.url)
    page.open(timeout=120)
    yield page
    context.close()
    print("\nfirst hour, measured:", {k: round(v, 2) for k, v in MEASURED.items()})


def start_and_wait(dash, button: str = "Start", runs: int = 1, timeout: float = 180) -> None:
    """Press ``button``, wait for its ``runs`` new runs to stream, then for them all to end."""
    before = set(dash.source_lengths())
    dash.click(button)
    _wait_for(lambda: len([k for k, n in dash.source_lengths().items() if k not in before and n > 0]) >= runs, 60,
              f"{runs} new run(s) streaming")
    dash.wait_status(lambda s: s in DONE, timeout=timeout, what=f"the run(s) of {button} to end")


def _first_row_seconds(dash) -> float:
    before = set(dash.source_lengths())
    t0 = time.monotonic()
    dash.click("Start")
    _wait_for(lambda: any(n > 0 for k, n in dash.source_lengths().items() if k not in before), 60,
              "the first row of the new run", step=0.01)
    return time.monotonic() - t0


def test_first_start_on_an_empty_cache_streams_at_once(dash):
    assert "compiling" not in dash.text_of(".qatlab-progress-text")   # the warm-up ended before "ready"
    first = MEASURED["click to first row (s, empty cache)"] = _first_row_seconds(dash)
    dash.wait_status(lambda s: s in DONE, timeout=120, what="the first run to end")
    MEASURED["click to first row (s, warm)"] = _first_row_seconds(dash)
    dash.wait_status(lambda s: s in DONE, timeout=120, what="the second run to end")
    print(f"\nclick to first row: {first:.2f} s on an empty cache, "
          f"{MEASURED['click to first row (s, warm)']:.2f} s warm (goal {FIRST_ROW_GOAL_S:.0f} s; load average "
          f"{os.getloadavg()[0]:.1f} on {os.cpu_count()} cores)")
    assert first <= NOT_COMPILING_S


def test_a_finished_run_has_x_axes_ending_at_its_data(dash):
    dash.set_input("Epochs", SHORT_EPOCHS)
    start_and_wait(dash)
    _wait_for(lambda: (lambda f: f and f["x"][1] <= f["data_x"][1] * (1 + X_SLACK))(
        next((f for f in figures(dash) if f["name"] == "fig-loss" and f["data_x"]), None)), 10,
        "fig-loss's x range to end at the data")
    visit_every_tab(dash, "after a run")


def test_phase_run_timeline_legend_outside_and_titles_clear(dash):
    dash.select("Architecture", "mlp")          # phase training is MLP-only: the digits MLP
    dash.select("Dataset", "digits")
    dash.sidebar_text("Phase training").click()
    dash.checkbox("Enabled").click()
    _wait_for(lambda: dash.page.locator("#sidebar").get_by_text("Predictor", exact=True).first.is_visible(), 10,
              "the phase fields shown")
    start_and_wait(dash)
    dash.tab("Phases")
    phase_figures = {"fig-phase-timeline", "fig-phase-backward", "fig-phase-pred", "fig-phase-lengths"}
    # (every tab is in the page: the other tabs' figures are there too)
    _wait_for(lambda: phase_figures <= {f["name"] for f in figures(dash)}, 10, "the four phase figures")
    figs = {f["name"]: f for f in settled_figures(dash, "Phases")}
    assert phase_figures <= set(figs)
    tl = figs["fig-phase-timeline"]
    fl, ft, fr, fb = tl["frame"]
    for legend in tl["legends"]:
        l, t, r, b = legend["box"]
        assert legend["panel"] == "right" and (l >= fr or r <= fl or t >= fb or b <= ft), tl
    for name in ("fig-phase-backward", "fig-phase-pred", "fig-phase-lengths"):
        assert figs[name]["toolbar"] == "right", figs[name]
    visit_every_tab(dash, "after a phase run")
    dash.checkbox("Enabled").click()          # phase training off again, back to the default CNN
    dash.select("Dataset", "mnist")
    dash.select("Architecture", "cnn")


def test_quantization_header_names_quantized_activations(dash):
    dash.select("Activations", "fake")
    start_and_wait(dash)
    dash.tab("Quantization")
    _wait_for(lambda: re.search(r"activations: fake \(8 bit\), STE clipped_identity", dash.body_text()), 10,
              "the Quantization header to say activations are quantized")
    dash.tab("Overview")   # Start keeps the current tab; start_and_wait reads the Overview's loss sources
    dash.select("Activations", "off")
    start_and_wait(dash)
    dash.tab("Quantization")
    _wait_for(lambda: "activations: not quantized" in dash.body_text(), 10, "the header to say not quantized")
    dash.tab("Overview")


def test_comparison_curves_are_told_apart(dash):
    start_and_wait(dash, "Compare STE kinds", runs=4)
    dash.tab("STE comparison")
    dashes = dash.page.evaluate("""() => { const out = {};
      for (const d of Bokeh.documents) for (const m of d.all_models)
        if (typeof m.name === 'string' && m.name.startsWith('ste-loss-') && m.glyph)
          out[m.name] = JSON.stringify([m.glyph.line_dash, m.glyph.line_width]);
      return out; }""")
    assert len(dashes) == 4 and len(set(dashes.values())) == 4, dashes
    settled_figures(dash, "STE comparison")
    visit_every_tab(dash, "after a comparison")


def test_no_console_errors_or_warnings(dash, cold_server):
    assert dash.console_errors == [], "\n".join(dash.console_errors)
    assert "Traceback" not in dash.body_text()
    # an update sent on Bokeh's own path can overtake one Panel queued and refer to a model the
    # browser has not been sent yet ("reference ... isn't known": that update is lost)
    sent = cold_server.inspect("/patches")
    assert sent["count"] == 0, sent
