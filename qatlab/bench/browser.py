"""Browser helpers of the dashboard bench and the browser tests: the app served in a subprocess, a page driven.

:class:`AppServer` runs ``panel serve app/`` (optionally with the bench's inspector, see
:mod:`qatlab.bench.dashboard`); :class:`DashboardPage` drives one page through its stable labels;
:func:`launch_chromium` starts Debian's headless chromium through Playwright.
"""
from __future__ import annotations

import http.client
import json
import math
import os
import socket
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]     # the repository (app/ is served from there)
CHROMIUM = os.environ.get("QATLAB_CHROMIUM", "/usr/bin/chromium")
CHROMIUM_ARGS = ["--no-sandbox", "--disable-gpu", "--disable-background-networking",
                 "--disable-component-update", "--disable-sync"]
VIEWPORT = {"width": 1400, "height": 900}
INSPECT_ENV = "QATLAB_INSPECT_PORT"



def free_port() -> int:
    """A TCP port that was free a moment ago on localhost."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def browser_unavailable() -> str | None:
    """Why the browser cannot run here (None when Playwright and chromium are both present)."""
    try:
        import playwright.sync_api  # noqa: F401
    except ImportError as exc:
        return f"playwright (python) is not importable: {exc}"
    if not (os.path.isfile(CHROMIUM) and os.access(CHROMIUM, os.X_OK)):
        return f"chromium not found at {CHROMIUM} (apt-get install chromium, or set QATLAB_CHROMIUM)"
    return None


def launch_chromium(playwright):
    """Headless Debian chromium through Playwright (never Playwright's own downloaded browsers)."""
    return playwright.chromium.launch(executable_path=CHROMIUM, args=CHROMIUM_ARGS, headless=True)


def http_status(url: str, timeout: float = 5.0) -> int | None:
    try:
        with urllib.request.urlopen(url, timeout=timeout) as resp:
            resp.read()
            return resp.status
    except urllib.error.HTTPError as exc:
        return exc.code
    except (urllib.error.URLError, OSError, http.client.HTTPException):   # (not an HTTP server there)
        return None


class _PortTaken(Exception):
    """The server could not bind its port."""


class AppServer:
    """``panel serve app/ --port <free port> --warm`` in a subprocess started from the repository root.

    ``url`` is ``http://localhost:<port>/app``; ``probe_url`` a small static file of the same
    server. :meth:`start` waits until the app answers 200 (or raises ``RuntimeError`` with the
    server's log tail); :meth:`stop` terminates it (``kill`` after ``grace`` seconds), :meth:`kill`
    sends it SIGKILL (a crash: nothing of it runs after). With ``inspect=True`` the server also runs
    the inspector (see the module doc) on ``inspect_port``. ``env``: variables set for the server
    on top of this process's environment (e.g. ``QATLAB_STORE``). Usable as a context manager.
    """

    def __init__(self, root: Path = ROOT, port: int | None = None, extra_args=(), inspect: bool = False,
                 startup_timeout: float = 120.0, env: dict | None = None):
        self.root = Path(root)
        self._any_port = port is None        # (a port picked here may be retried on another)
        self._use_ports(port or free_port(), free_port() if inspect else None)
        self.extra_args = list(extra_args)
        self.startup_timeout = startup_timeout
        self.env = {str(k): str(v) for k, v in (env or {}).items()}
        self.proc: subprocess.Popen | None = None
        self._log = tempfile.NamedTemporaryFile(prefix="qatlab-serve-", suffix=".log", delete=False)
        self.log_path = Path(self._log.name)
        self._setup: Path | None = None

    def start(self, attempts: int = 3) -> "AppServer":
        """Start and wait until the app answers. A port taken between :func:`free_port` and the
        server's bind (a Dask process of this or another server can get it) is retried on new ports."""
        for attempt in range(attempts):
            try:
                return self._start_once()
            except _PortTaken:
                if attempt == attempts - 1 or not self._any_port:
                    raise RuntimeError(f"panel serve: port {self.port} was taken:\n{self.log_tail()}") from None
                self._use_ports(free_port(), free_port() if self.inspect_port else None)
                self._log.seek(0)
                self._log.truncate()
        raise AssertionError("unreachable")

    def _use_ports(self, port: int, inspect_port: int | None) -> None:
        self.port, self.inspect_port = port, inspect_port
        self.url = f"http://localhost:{port}/app"
        self.probe_url = f"http://localhost:{port}/static/extensions/panel/css/button.css"

    def _start_once(self) -> "AppServer":
        cmd = [sys.executable, "-m", "panel", "serve", "app/", "--port", str(self.port), "--warm",
               "--allow-websocket-origin", f"localhost:{self.port}",
               "--allow-websocket-origin", f"127.0.0.1:{self.port}", *self.extra_args]
        env = {**os.environ, **self.env}
        env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(self.root), env.get("PYTHONPATH")]))
        if self.inspect_port:
            fd, name = tempfile.mkstemp(prefix="qatlab-inspector-", suffix=".py")
            with os.fdopen(fd, "w") as f:
                f.write("from qatlab.bench.dashboard import serve_inspector\nserve_inspector()\n")
            self._setup = Path(name)
            cmd += ["--setup", name]
            env[INSPECT_ENV] = str(self.inspect_port)
        self.proc = subprocess.Popen(cmd, cwd=self.root, stdout=self._log, stderr=subprocess.STDOUT, env=env)
        deadline = time.monotonic() + self.startup_timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                # ("Cannot start Bokeh server, port N is ..."), anywhere in the log: the local
                # cluster's shutdown can log tracebacks after it
                if "already in use" in self.log_tail(lines=None):
                    raise _PortTaken()
                raise RuntimeError(f"panel serve exited with {self.proc.returncode}:\n{self.log_tail()}")
            if http_status(self.url, timeout=5.0) == 200:
                return self
            time.sleep(0.3)
        self.stop()
        raise RuntimeError(f"panel serve did not answer {self.url} within {self.startup_timeout:.0f} s:\n"
                           f"{self.log_tail()}")

    def log_tail(self, lines: int | None = 40) -> str:
        """The server log's last ``lines`` lines (None: all of it)."""
        try:
            return "\n".join(self.log_path.read_text(errors="replace").splitlines()[-lines if lines else 0:])
        except OSError:
            return "(no log)"

    def kill(self, timeout: float = 10.0) -> None:
        """SIGKILL the server (``kill -9``: no shutdown hook, no atexit) and reap it."""
        if self.proc is not None and self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait(timeout)

    def stop(self, grace: float = 10.0) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(grace)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(grace)
        self._log.close()
        if self._setup is not None:
            self._setup.unlink(missing_ok=True)

    # ---------------------------------------------------------------- inspector client
    def inspect(self, path: str = "/state", timeout: float = 30.0) -> dict:
        """GET the inspector's JSON (``/state`` or ``/headless?epochs=N``)."""
        if not self.inspect_port:
            raise RuntimeError("AppServer: started without inspect=True")
        for attempt in range(3):   # a snapshot can race a run or session being created: ask again
            try:
                with urllib.request.urlopen(f"http://127.0.0.1:{self.inspect_port}{path}", timeout=timeout) as resp:
                    return json.loads(resp.read())
            except urllib.error.HTTPError as exc:
                if exc.code != 500 or attempt == 2:
                    raise RuntimeError(f"inspector {path}: HTTP {exc.code}: {exc.read()[:300]!r}") from None
                time.sleep(0.2)

    def runs(self, ids=None, config: bool = False) -> dict[str, dict]:
        """``{run id: run dict}`` of the server process's runs (every RemoteRun its pages or the
        inspector started that the inspector has seen, see :class:`_RunTracker`; only ``ids``, when
        given); with their config dicts only when ``config``."""
        query = f"?config={int(config)}" + (f"&ids={','.join(ids)}" if ids is not None else "")
        return {r["id"]: r for r in self.inspect("/state" + query)["runs"]}

    def __enter__(self) -> "AppServer":
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()


_JS_SOURCES = """(prefix) => {
  const out = {};
  for (const doc of Bokeh.documents) {
    for (const m of doc.all_models) {
      if (typeof m.name === 'string' && m.name.startsWith(prefix) && m.data != null) {
        const cols = Object.keys(m.data);
        out[m.name] = cols.length ? m.data[cols[0]].length : 0;
      }
    }
  }
  return out;
}"""

_JS_MODEL_NAMES = """(prefix) => {
  const out = [];
  for (const doc of Bokeh.documents)
    for (const m of doc.all_models)
      if (typeof m.name === 'string' && m.name.startsWith(prefix)) out.push(m.name);
  return out.sort();
}"""

_JS_INPUT_VALUE = """(title) => {
  for (const doc of Bokeh.documents)
    for (const m of doc.all_models)
      if (m.title === title && 'value' in m) return m.value;
  return null;
}"""

_JS_TEXT_WALK = """const parts = [];
  const walk = (n) => {
    if (n.shadowRoot) walk(n.shadowRoot);
    for (const c of n.childNodes) {
      if (c.nodeType === 3) parts.push(c.textContent);
      else if (c.nodeType === 1 && c.tagName === 'BR') parts.push('\\n');
      else if (c.nodeType === 1 && !['STYLE', 'SCRIPT', 'LINK', 'TEMPLATE'].includes(c.tagName)) walk(c);
      else if (c.nodeType === 11) walk(c);
    }
  };"""

_JS_TEXT = "(el) => { " + _JS_TEXT_WALK + " walk(el); return parts.join(' '); }"
_JS_BODY_TEXT = "() => { " + _JS_TEXT_WALK + " walk(document.body); return parts.join(' '); }"

_JS_POLL_START = """(prefix) => {
  window.__qatlab_poll && clearInterval(window.__qatlab_poll);
  const seen = {}, changes = {};
  let sources = [], tick = 0;
  window.__qatlab_changes = changes;
  window.__qatlab_poll = setInterval(() => {
    if (tick++ % 25 === 0) {   // find the sources every 0.5 s; read their lengths every 20 ms
      sources = [];
      for (const doc of Bokeh.documents) for (const m of doc.all_models) {
        if (typeof m.name === 'string' && m.name.startsWith(prefix) && m.data != null) sources.push(m);
      }
    }
    const now = performance.now();
    for (const m of sources) {
      const cols = Object.keys(m.data);
      const n = cols.length ? m.data[cols[0]].length : 0;
      if (seen[m.name] !== n) {
        if (seen[m.name] !== undefined || n > 0) (changes[m.name] = changes[m.name] || []).push([now, n]);
        seen[m.name] = n;
      }
    }
  }, 20);
  return true;
}"""

_JS_POLL_STOP = """() => { clearInterval(window.__qatlab_poll); window.__qatlab_poll = null;
  return window.__qatlab_changes || {}; }"""

# Click-to-response: the next click anywhere in the page (captured on the way down) starts the clock;
# the page's tabs model switching away from the active tab (Compare STE kinds opens the STE tab once
# its runs are started on the server) stops it. Polled every 5 ms in the page.
_JS_ARM_RESPONSE = """() => {
  let tabs = null;
  for (const doc of Bokeh.documents) for (const m of doc.all_models)
    if (Array.isArray(m.tabs) && m.tabs.some((t) => t.title === 'STE comparison')) tabs = m;
  if (tabs === null) return false;
  const first = tabs.active;
  window.__qatlab_click = null; window.__qatlab_response = null;
  document.addEventListener('click', () => {
    if (window.__qatlab_click === null) window.__qatlab_click = performance.now();
  }, {capture: true});
  const poll = setInterval(() => {
    if (window.__qatlab_click !== null && tabs.active !== first) {
      window.__qatlab_response = performance.now();
      clearInterval(poll);
    }
  }, 5);
  return true;
}"""

_JS_RESPONSE = """() => (window.__qatlab_click === null || window.__qatlab_response == null) ? null
  : (window.__qatlab_response - window.__qatlab_click) / 1000"""


class DashboardPage:
    """One dashboard page driven through its stable labels (see ``qatlab.ui``'s docstrings).

    Records console errors, page errors and every request URL / websocket URL, so a test can
    assert the page stayed error-free and air-gapped.
    """

    def __init__(self, page, url: str):
        self.page = page
        self.url = url
        self.console_errors: list[str] = []
        self.requests: list[str] = []
        self.websockets: list[str] = []
        page.on("console", lambda m: self.console_errors.append(f"console.{m.type}: {m.text}")
                if m.type == "error" else None)
        page.on("pageerror", lambda e: self.console_errors.append(f"pageerror: {e}"))
        page.on("request", lambda r: self.requests.append(r.url))
        page.on("requestfailed", lambda r: self.console_errors.append(f"request failed: {r.url} ({r.failure})"))
        page.on("websocket", lambda ws: self.websockets.append(ws.url))

    def open(self, timeout: float = 60.0) -> "DashboardPage":
        """Navigate and wait until the Bokeh document is rendered and ``Start`` is visible."""
        self.page.goto(self.url, timeout=timeout * 1000)
        return self.wait_ready(timeout)

    def wait_ready(self, timeout: float = 60.0) -> "DashboardPage":
        self.page.wait_for_function("() => window.Bokeh && Bokeh.documents && Bokeh.documents.length > 0",
                                    timeout=timeout * 1000)
        self.button("Start").wait_for(state="visible", timeout=timeout * 1000)
        return self

    # --------------------------------------------------------------------- widgets
    def button(self, name: str):
        return self.page.get_by_role("button", name=name, exact=True)

    def click(self, name: str) -> None:
        self.button(name).click()

    def set_input(self, label: str, value, timeout: float = 10.0) -> None:
        """Type ``value`` into the numeric/text input labelled ``label`` and commit it (Enter).

        Typed again while the page does not hold it: a card re-laid out by the server between the
        typing and the Enter (a select just before, under load) renders the input anew, empty."""
        deadline = time.monotonic() + timeout
        box = self.page.get_by_label(label, exact=True)
        while True:
            box.fill(str(value))
            box.press("Enter")
            try:
                return self._wait_value(label, value, min(2.0, max(0.1, deadline - time.monotonic())))
            except AssertionError:
                if time.monotonic() >= deadline:
                    raise

    def select(self, label: str, option: str, timeout: float = 10.0) -> None:
        """Choose ``option`` in the select labelled ``label``."""
        self.page.get_by_label(label, exact=True).select_option(option)
        self._wait_value(label, option, timeout)

    def _wait_value(self, label: str, value, timeout: float) -> None:
        deadline = time.monotonic() + timeout
        got = None
        while time.monotonic() < deadline:
            got = self.page.evaluate(_JS_INPUT_VALUE, label)
            if got is not None and (str(got) == str(value) or _close(got, value)):
                return
            time.sleep(0.05)
        raise AssertionError(f"widget {label!r}: value is {got!r} in the page, expected {value!r}")

    # --------------------------------------------------------------------- reading
    def text_of(self, css: str) -> str:
        """Text of the first element matching ``css`` (shadow roots included), whitespace collapsed."""
        return " ".join(self.page.locator(css).first.evaluate(_JS_TEXT).split())

    def status(self) -> str:
        """The sidebar status without its ``Status:`` prefix or messages, e.g. ``running (2 running, 2 finished)``."""
        first = " ".join(self.page.locator(".qatlab-status").first.evaluate(_JS_TEXT).split("\n")[0].split())
        return first.split("Status:", 1)[1].strip() if "Status:" in first else first

    def wait_status(self, predicate, timeout: float = 60.0, what: str = "") -> str:
        deadline = time.monotonic() + timeout
        status = ""
        while time.monotonic() < deadline:
            status = self.status()
            if predicate(status):
                return status
            time.sleep(0.1)
        raise AssertionError(f"status did not become {what or predicate} within {timeout:.0f} s: {status!r}")

    def source_lengths(self, prefix: str = "loss-source-") -> dict[str, int]:
        """``{model name: rows}`` of every ColumnDataSource in ``Bokeh.documents`` named ``prefix...``."""
        return self.page.evaluate(_JS_SOURCES, prefix)

    def model_names(self, prefix: str) -> list[str]:
        return self.page.evaluate(_JS_MODEL_NAMES, prefix)

    def start_update_counter(self, prefix: str = "loss-source-") -> None:
        """Poll source lengths every 20 ms in the page, recording each change."""
        self.page.evaluate(_JS_POLL_START, prefix)

    def stop_update_counter(self) -> dict[str, list]:
        """``{source name: [[t_ms, rows], ...]}`` recorded since :meth:`start_update_counter`."""
        return self.page.evaluate(_JS_POLL_STOP)

    def arm_click_response(self) -> None:
        """Start timing the next click until the page switches tabs (see ``_JS_ARM_RESPONSE``)."""
        if not self.page.evaluate(_JS_ARM_RESPONSE):
            raise AssertionError("no tabs model with an 'STE comparison' tab in the page")

    def click_response_s(self) -> float | None:
        """Seconds from the armed click to the tab switch, None until both happened."""
        return self.page.evaluate(_JS_RESPONSE)

    def body_text(self) -> str:
        """All text in the page, shadow roots included."""
        return " ".join(self.page.evaluate(_JS_BODY_TEXT).split())


def _close(a, b) -> bool:
    try:
        return math.isclose(float(a), float(b), rel_tol=1e-9)
    except (TypeError, ValueError):
        return False


def wait_for(fn, timeout: float, what: str, step: float = 0.1):
    """Poll ``fn`` until it returns a truthy value (returned) or assert after ``timeout`` seconds."""
    deadline = time.monotonic() + timeout
    value = fn()
    while not value and time.monotonic() < deadline:
        time.sleep(step)
        value = fn()
    assert value, f"timed out after {timeout:.0f} s waiting for {what}"
    return value


def wait_until(predicate, timeout: float, step: float = 0.1) -> bool:
    """Poll ``predicate`` until it is true (True) or ``timeout`` seconds have passed (its last value)."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if predicate():
            return True
        time.sleep(step)
    return bool(predicate())
