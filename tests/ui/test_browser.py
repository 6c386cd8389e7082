"""The dashboard in a real browser: headless Debian chromium (Playwright) against ``panel serve app/``.

One page is opened for the whole module and driven like a person would, by the stable labels
and Bokeh model names of :mod:`qatlab.ui`: a long run streams (its ``loss-source-<run id>``
grows in ``Bokeh.documents``) and is stopped, a short run reaches ``finished``, ``Compare STE
kinds`` shows four runs (a screenshot of that is saved to ``assets/screenshot.png``). The
sidebar: each invalid value typed shows its field's error and disables Start until fixed, fields
that do not apply are hidden, a double click on Start makes one run, a bad upload shows only the
data layer's message, and a small .npz uploaded through the page (or chosen from the server's
data directory) trains. Finally the page must have logged no console error or warning, shown no
traceback, and requested nothing from any host but the server (the dashboard works air-gapped),
and the server's log must hold no traceback and no ERROR line.

Skips with a reason when playwright or chromium is missing, unless ``QATLAB_REQUIRE_BROWSER=1``.
"""
from __future__ import annotations

import os
import re
import time
from urllib.parse import urlsplit

import numpy as np
import pytest

from qatlab.bench.browser import _JS_TEXT, ROOT, AppServer, DashboardPage, wait_for, wait_until
from qatlab.ui.config_panel import DEBOUNCE_S

pytestmark = [pytest.mark.browser, pytest.mark.slow]

SCREENSHOT = ROOT / "assets" / "screenshot.png"
# The page's default experiment is the ternary CNN on mnist (ql.dashboard_config(): 63 steps an epoch,
# a row every 5 steps, ~0.7 s an epoch alone on this machine).
LONG_EPOCHS = 2000     # still running while the test watches it stream
SHORT_EPOCHS = 1       # finishes in about a second of training
COMPARE_EPOCHS = 4     # 4 runs x ~50 rows: usually still running when the screenshot is taken
DONE = ("finished", "stopped", "diverged", "failed")




def _tiny_npz(path, seed: int = 0, n: int = 120, d: int = 6, classes: int = 3):
    rng = np.random.default_rng(seed)
    y = rng.integers(0, classes, n)
    X = (rng.normal(size=(n, d)) + 2.0 * np.eye(classes, d)[y]).astype(np.float32)
    np.savez(path, X=X, y=y)
    return path


@pytest.fixture(scope="module")
def data_dir(tmp_path_factory):
    """The served data directory (``QATLAB_DATA_DIR``): one small .npz."""
    d = tmp_path_factory.mktemp("served-data")
    _tiny_npz(d / "served.npz", seed=1)
    return d


@pytest.fixture(scope="module")
def app_server(chromium, data_dir, tmp_path_factory):
    """``panel serve app/`` with a data directory, an upload directory and the inspector
    (this module's runs are counted in the server process)."""
    env = {"QATLAB_DATA_DIR": str(data_dir), "QATLAB_UPLOAD_DIR": str(tmp_path_factory.mktemp("uploads"))}
    old = {k: os.environ.get(k) for k in env}
    os.environ.update(env)
    server = AppServer(root=ROOT, inspect=True)
    try:
        server.start()
    except RuntimeError as exc:
        pytest.fail(str(exc))
    finally:
        for k, v in old.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v
    try:
        yield server
    finally:
        server.stop()


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


def test_page_shows_the_controls(dash):
    for name in ("Start", "Stop", "Compare STE kinds"):
        assert dash.button(name).is_visible(), name
    assert dash.status() == "idle"
    assert dash.source_lengths() == {}


def _new_source(dash, before: set[str], timeout: float = 30.0) -> str:
    """Name of the loss source that appears after ``before`` with at least one row."""
    def find():
        new = {k: n for k, n in dash.source_lengths().items() if k not in before and n > 0}
        return next(iter(new), None)
    return wait_for(find, timeout, "a new loss-source-<run id> with rows")


def test_start_streams_the_loss_source(dash):
    dash.set_input("Epochs", LONG_EPOCHS)
    before = set(dash.source_lengths())
    dash.click("Start")
    name = _new_source(dash, before)
    first = dash.source_lengths()[name]
    # read the length again a little later: the periodic callback keeps streaming new rows
    grown = wait_for(lambda: dash.source_lengths()[name] > first and dash.source_lengths()[name], 10,
                      f"{name} to grow beyond {first} rows")
    assert grown > first
    assert dash.status() == "running"
    dash.click("Stop")
    assert dash.wait_status(lambda s: s in DONE, timeout=30, what="stopped") == "stopped"


def test_short_run_reaches_finished(dash):
    dash.set_input("Epochs", SHORT_EPOCHS)
    before = set(dash.source_lengths())
    dash.click("Start")
    name = _new_source(dash, before)
    assert dash.wait_status(lambda s: s in DONE, timeout=60, what="finished") == "finished"
    run_id = name.removeprefix("loss-source-")
    alert = wait_for(lambda: "finished" in dash.text_of(".qatlab-run-alert") and dash.text_of(".qatlab-run-alert"),
                      10, "the Overview alert to say finished")
    assert run_id[:8] in alert                     # (a run is named by the first 8 characters of its id)


FIGURE_ID_JS = "(name) => Bokeh.documents[0].get_model_by_name(name)?.id ?? null"


def test_compare_ste_kinds_shows_four_runs(dash):
    # the overlays are in the page before the first comparison (built once the page loaded), and the
    # comparison draws on them instead of sending new figures
    loss_fig = wait_for(lambda: dash.page.evaluate(FIGURE_ID_JS, "fig-ste-loss"), 10, "the prepared loss figure")
    dash.set_input("Epochs", COMPARE_EPOCHS)
    before = set(dash.source_lengths())
    dash.click("Compare STE kinds")

    def four_streaming():
        new = {k: n for k, n in dash.source_lengths().items() if k not in before}
        return new if len(new) == 4 and all(n >= 20 for n in new.values()) else None

    sources = wait_for(four_streaming, 60, "four new loss sources with rows")
    ids = sorted(k.removeprefix("loss-source-") for k in sources)
    lines = dash.model_names("ste-loss-")
    assert sorted(n.removeprefix("ste-loss-") for n in lines) == ids      # one overlaid line per kind
    assert dash.page.evaluate(FIGURE_ID_JS, "fig-ste-loss") == loss_fig
    # the summary table catches up within its 1 s throttle: every kind shows a test accuracy
    wait_for(lambda: "–%" not in dash.text_of(".qatlab-ste-summary"), 10, "test accuracies in the summary table")

    def evaluated() -> bool:
        rows = {k.removeprefix("eval-source-"): n for k, n in dash.source_lengths("eval-source-").items()}
        return all(rows.get(i, 0) > 0 for i in ids)
    wait_for(evaluated, 10, "test accuracies in the accuracy figure")
    mid = dash.status()
    SCREENSHOT.parent.mkdir(parents=True, exist_ok=True)
    dash.page.screenshot(path=str(SCREENSHOT))          # the runs may have finished by now (printed below)
    print(f"screenshot saved to {SCREENSHOT} (status then: {mid})")

    assert dash.wait_status(lambda s: s in DONE, timeout=120, what="finished") == "finished"
    wait_for(lambda: all(i in dash.body_text() for i in ids), 15, "the four run ids in the summary table")
    # the small multiples are built when their card is opened, from the runs' rows so far
    assert not dash.model_names("fig-ste-grad_norm")
    dash.page.locator(".qatlab-ste-detail").get_by_text("Per-layer detail").click()
    wait_for(lambda: dash.model_names("ste-active_grad_fraction-"), 30, "the small multiples' lines")
    assert sorted(n.removeprefix("ste-active_grad_fraction-") for n in dash.model_names("ste-active_grad_fraction-")) == ids
    per_layer = dash.model_names("ste-sqnr_db_0-")                # one line per layer and kind
    assert sorted(n.removeprefix("ste-sqnr_db_0-") for n in per_layer) == ids
    assert dash.page.locator(".qatlab-ste-detail canvas").count() >= 4


RANGES_JS = """(name) => {
  const doc = Bokeh.documents[0];
  const fig = doc.get_model_by_name(name);
  const lines = fig.renderers.filter((r) => r.name && r.name.startsWith("ste-loss-"));
  const xs = [], ys = [];
  for (const r of lines) {
    const data = r.data_source.data;
    const x = Array.from(data[r.glyph.x.field]), y = Array.from(data[r.glyph.y.field]);
    x.forEach((v, i) => { if (Number.isFinite(v) && Number.isFinite(y[i])) { xs.push(v); ys.push(y[i]); } });
  }
  return {x: [fig.x_range.start, fig.x_range.end], y: [fig.y_range.start, fig.y_range.end],
          data_x: [Math.min(...xs), Math.max(...xs)], data_y: [Math.min(...ys), Math.max(...ys)], n: xs.length};
}"""


def test_plot_ranges_follow_the_data(dash):
    """The server fits the plots' Range1d ranges (qatlab.ui.ranges): every drawn point is inside."""
    wait_for(lambda: dash.page.evaluate(RANGES_JS, "fig-ste-loss")["n"] > 0, 10, "points in fig-ste-loss")
    seen = []

    def every_point_inside() -> bool:
        r = dash.page.evaluate(RANGES_JS, "fig-ste-loss")
        seen.append(r)
        return (r["x"][0] <= r["data_x"][0] and r["data_x"][1] <= r["x"][1]
                and r["y"][0] <= r["data_y"][0] and r["data_y"][1] <= r["y"][1])
    # the ranges are refitted on a streaming tick after the last points arrived: poll, not a fixed wait
    assert wait_until(every_point_inside, 10), f"a drawn point is outside the ranges: {seen[-1]}"


def test_render_patch_skips_only_same_text_stylesheet_writes(dash):
    """qatlab.ui.internals' BokehJS patch: a same-text write leaves the <style> element alone, a new text is written."""
    out = dash.page.evaluate("""() => {
      const sheet = new (Bokeh.require("core/dom").InlineStyleSheet)(":host { color: red; }");
      const node = sheet.el.firstChild;
      sheet.replace(":host { color: red; }");
      const kept = sheet.el.firstChild === node;
      sheet.replace(":host { color: blue; }");
      return {installed: window.qatlab_render_patch, kept, text: sheet.el.textContent};
    }""")
    assert out == {"installed": "installed", "kept": True, "text": ":host { color: blue; }"}


def test_render_patch_keeps_streaming_lines_spatial_index_lazy(dash):
    """qatlab.ui.internals' BokehJS patch: while rows stream in, the line glyphs' spatial indexes are not rebuilt
    (their plots have no DataRange1d and nothing hit-tests them); reading ``index`` builds it."""
    out = dash.page.evaluate("""() => {
      const views = [], seen = new Set();
      const visit = (v) => {
        if (v == null || seen.has(v)) return;
        seen.add(v);
        if (v.glyph != null && v.model?.glyph?.type === "Line") views.push(v.glyph);
        for (const c of (v.children ? v.children() : [])) visit(c);
      };
      for (const v of Object.values(Bokeh.index)) visit(v);
      const stale = views.filter((g) => g._qatlab_index_stale).length;
      const g = views.find((g) => g._qatlab_index_stale && g.data_size > 1);
      const bb = g == null ? null : g.index.bbox;
      const built = bb != null && Number.isFinite(bb.x0) && bb.x0 < bb.x1 && bb.y0 <= bb.y1;
      return {lines: views.length, stale, built, after: g?._qatlab_index_stale};
    }""")
    assert out["lines"] > 20 and out["stale"] > out["lines"] // 2, out
    assert out["built"] is True and out["after"] is False, out


# ----------------------------------------------------------------------------- the sidebar

INVALID = [("Learning rate", "0"), ("Learning rate", "1e6"), ("Batch size", "100000"), ("Epochs", "1e6"),
           ("Hidden sizes (list)", "abc"), ("Hidden sizes (list)", "64, 0"), ("Metrics every (steps)", "0")]


def field_errors(dash) -> list[str]:
    """Texts of the visible field errors (``qatlab-field-error``) in the page."""
    errors = dash.page.locator(".qatlab-field-error")
    return [" ".join(errors.nth(i).evaluate(_JS_TEXT).split()) for i in range(errors.count())
            if errors.nth(i).is_visible()]


def _start_enabled(dash, enabled: bool) -> bool:
    return all(dash.button(b).is_enabled() == enabled for b in ("Start", "Compare STE kinds"))


def test_invalid_values_show_their_field_error_and_disable_start(dash):
    for label, text in INVALID:
        good = dash.page.evaluate("""(t) => { for (const d of Bokeh.documents) for (const m of d.all_models)
                                       if (m.title === t && 'value' in m) return m.value; return null; }""", label)
        dash.set_input(label, text)
        err = wait_for(lambda: next((e for e in field_errors(dash) if e.startswith(label + ":")), None), 10,
                        f"the error of {label!r} after typing {text!r}")
        assert "must be" in err, err
        wait_for(lambda: _start_enabled(dash, False), 10, f"Start and Compare disabled after {label}={text!r}")
        assert "Start is disabled" in dash.text_of(".qatlab-config-error")
        dash.set_input(label, good)
        wait_for(lambda: not field_errors(dash) and _start_enabled(dash, True), 10,
                  f"Start enabled again after {label}={good!r}")


def test_fields_that_do_not_apply_are_hidden(dash):
    label = dash.page.get_by_label
    assert not label("Weight bits", exact=True).is_visible() and not label("Momentum", exact=True).is_visible()
    dash.select("Weights", "fake")
    wait_for(lambda: label("Weight bits", exact=True).is_visible(), 10, "Weight bits shown for fake weights")
    dash.select("Optimizer", "momentum")
    wait_for(lambda: label("Momentum", exact=True).is_visible(), 10, "Momentum shown for the momentum optimizer")
    dash.select("Optimizer", "adam")
    dash.select("Weights", "ternary")
    wait_for(lambda: not label("Weight bits", exact=True).is_visible() and not label("Momentum", exact=True).is_visible(),
              10, "Weight bits and Momentum hidden again")


def _run_ids(app_server) -> set[str]:
    return set(app_server.runs())


def _one_new_run(app_server, before: set[str], timeout: float = 60) -> dict:
    new = wait_for(lambda: _run_ids(app_server) - before, 30, "a new run in the server")
    run_id = next(iter(new))
    return wait_for(lambda: (lambda r: r if r["status"] in DONE else None)(app_server.runs([run_id], config=True)[run_id]),
                     timeout, f"run {run_id} to end")


def test_double_click_on_start_makes_one_run(dash, app_server):
    dash.set_input("Epochs", SHORT_EPOCHS)
    before = _run_ids(app_server)
    dash.button("Start").dblclick()
    run = _one_new_run(app_server, before)
    assert run["status"] == "finished", run["message"]
    # the server handles a session's events in order: once an edit typed after the double click has
    # its answer in the page, the second click has been handled too
    dash.set_input("Epochs", "x")
    wait_for(lambda: any(e.startswith("Epochs:") for e in field_errors(dash)), 10, "the Epochs error")
    dash.set_input("Epochs", SHORT_EPOCHS)
    wait_for(lambda: not field_errors(dash), 10, "no field error")
    assert len(_run_ids(app_server) - before) == 1


def test_uploaded_npz_trains_and_a_bad_file_shows_no_contents(dash, app_server, tmp_path):
    dash.select("Architecture", "mlp")      # these files hold flat features: the default CNN cannot take them
    dash.select("Dataset", "file")
    wait_for(lambda: _start_enabled(dash, False), 10, "Start disabled while no file is chosen")
    files = dash.page.locator("input[type=file]")
    big = tmp_path / "big.npz"              # over the cap: refused in the browser, never sent
    with open(big, "wb") as f:
        f.truncate(21 * 2**20)
    files.set_input_files(str(big))
    wait_for(lambda: any(e.startswith("Data file: big.npz is 21.0 MB; uploads up to 20.0 MB") for e in field_errors(dash)),
              15, "the oversized upload refused")
    secret = tmp_path / "passwd.csv"
    secret.write_text("root:x:0:0:root:/root:/bin/bash\ndaemon:x:1:1:daemon:/usr/sbin:/usr/sbin/nologin\n")
    files.set_input_files(str(secret))
    err = wait_for(lambda: next((e for e in field_errors(dash) if e.startswith("Data file:")), None), 15,
                    "the upload's error")
    assert "daemon" not in dash.body_text() and "/bin/bash" not in dash.body_text(), err
    assert _start_enabled(dash, False)

    files.set_input_files(str(_tiny_npz(tmp_path / "tiny.npz")))
    wait_for(lambda: "Using upload tiny.npz" in dash.text_of(".qatlab-data-file"), 15, "the upload in use")
    wait_for(lambda: _start_enabled(dash, True) and not field_errors(dash), 10, "Start enabled with the upload")
    assert str(tmp_path) not in dash.body_text()
    dash.set_input("Epochs", 3)
    before = _run_ids(app_server)
    time.sleep(DEBOUNCE_S)       # spaces the clicks: the previous test's Start may be that recent, not a double click
    dash.click("Start")
    run = _one_new_run(app_server, before)
    assert run["status"] == "finished", run["message"]
    data = run["config"]["data"]
    assert data["dataset"] == "file" and os.path.basename(data["path"]) == "tiny.npz"
    assert run["steps_done"] > 0


def test_a_file_of_the_servers_data_directory_trains(dash, app_server):
    dash.select("Server data directory", "served.npz")
    wait_for(lambda: "Using server file served.npz" in dash.text_of(".qatlab-data-file"), 15, "the server file in use")
    wait_for(lambda: _start_enabled(dash, True), 10, "Start enabled")
    before = _run_ids(app_server)
    time.sleep(DEBOUNCE_S)       # the previous test's Start may be that recent: not a double click
    dash.click("Start")
    run = _one_new_run(app_server, before)
    assert run["status"] == "finished", run["message"]
    assert run["config"]["data"]["path"].endswith("served.npz")
    dash.select("Dataset", "mnist")         # back to the page's default experiment
    dash.select("Architecture", "cnn")
    wait_for(lambda: _start_enabled(dash, True), 20, "Start enabled for the default CNN")


def test_page_stayed_clean_and_local(dash, app_server):
    assert dash.console_errors == [], "\n".join(dash.console_errors)
    assert dash.console_warnings == [], "\n".join(dash.console_warnings)
    assert "Traceback" not in dash.body_text()
    server = urlsplit(app_server.url).netloc
    assert dash.requests, "no request recorded"
    foreign = sorted({u for u in dash.requests + dash.websockets
                      if urlsplit(u).scheme in ("http", "https", "ws", "wss") and urlsplit(u).netloc != server})
    assert not foreign, f"requests to hosts other than {server}: {foreign}"


LOG_PROBLEM = re.compile(r"Traceback|\bERROR\b")


def test_server_log_has_no_traceback_or_error(app_server):
    """Every line the served app logged during this module's browser session."""
    lines = app_server.log_path.read_text(errors="replace").splitlines()
    bad = [i for i, line in enumerate(lines) if LOG_PROBLEM.search(line)]
    context = "\n---\n".join("\n".join(lines[max(0, i - 2): i + 12]) for i in bad[:3])
    assert not bad, f"{len(bad)} Traceback/ERROR lines in {app_server.log_path}:\n{context}"


def test_every_page_update_went_through_panels_write_queue(app_server):
    """No document patch went out on Bokeh's own path, where it can overtake a message Panel queued
    and refer to a model the browser has not been sent yet (:mod:`qatlab.bench.bokeh_path`)."""
    sent = app_server.inspect("/patches")
    assert sent["count"] == 0, sent
