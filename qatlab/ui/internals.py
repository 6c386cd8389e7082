"""Every use of Panel's and Bokeh's private internals, in one module, behind one switch.

``QATLAB_PANEL_INTERNALS=0`` (read at import) turns all of them off and the app runs on public APIs
alone, at three costs: a closed page's runs stop only when Bokeh destroys its session (15-30 s
later, not within a second: :class:`~qatlab.ui.base.PageWatch` cannot see the connection count), its
periodic callback is stopped by the Dashboard rather than by Panel, and the page is drawn with the
Fast design's web font and BokehJS's repaint hot spots as shipped. ``tests/ui/test_browser.py`` runs
the app both ways. The Bokeh and Panel versions these were written for are pinned in pyproject.toml.

What is used:

- ``ServerSessionContext._session`` (Bokeh): the session's connection count (:func:`server_session`);
- ``pn.state._periodic`` (Panel): a periodic callback stopped with its session (:func:`stop_with_session`);
- ``Fast._resources`` (Panel): the Fast design without its Google web font (:func:`fast_design`);
- BokehJS internals patched in the page (:func:`install_render_patch`), described below.

The BokehJS patch (two repaint hot spots of plots that stream rows at 10 Hz):

- **Stylesheets:** every renderer rewrites its inline ``<style>`` text on every paint, even when the
  CSS is unchanged, and each write costs the browser a style recalculation. ``InlineStyleSheet._update``
  now skips a write of the text already there.
- **Spatial index:** every ``stream`` makes each glyph rebuild its R-tree over all its points,
  although these plots only read it for hit testing and DataRange1d bounds (their ranges are fitted
  on the server). ``index_data`` now marks the index stale and the ``index`` getter builds it on
  first use; bounds are not recomputed for a plot without DataRange1d ranges; a renderer whose
  index is stale keeps its (empty) DOM element hidden instead of positioning it.

Each part checks the method it replaces exists; if BokehJS renames it, that part does nothing and
``window.qatlab_render_patch`` says so.
"""
from __future__ import annotations

import os

from bokeh.models import CustomJS

#: False when ``QATLAB_PANEL_INTERNALS=0``: nothing below touches a private name.
ENABLED = os.environ.get("QATLAB_PANEL_INTERNALS", "1").strip() != "0"


def server_session(session_context):
    """The Bokeh ``ServerSession`` of a session context (None outside a server, or switched off)."""
    if not ENABLED or session_context is None:
        return None
    return getattr(session_context, "_session", None)


def stop_with_session(doc, callback) -> None:
    """Register a started ``pn.io.PeriodicCallback`` with Panel so it stops when ``doc``'s session ends."""
    if ENABLED and doc is not None:
        import panel as pn
        pn.state._periodic.setdefault(doc, []).append(callback)


def fast_design():
    """Panel's Fast design minus its web-font resource, so the page fetches nothing from other hosts
    (switched off: Fast itself)."""
    from panel.io.resources import CDN_DIST
    from panel.theme.fast import Fast
    if not ENABLED:
        return Fast
    # relative resources resolve against the class name ("localfast/..."): point at Fast's bundled copy
    resources = {key: value for key, value in Fast._resources.items() if key != "font"}
    resources["js_modules"] = {**Fast._resources["js_modules"],
                               "fast-design": f"{CDN_DIST}bundled/fast/js/fast_design.js"}
    return type("LocalFast", (Fast,), {"_resources": resources,
                                       "__doc__": "The Fast design minus its web-font resource."})


PATCH_JS = """
const missing = [];
const cls = (module, name) => { try { return Bokeh.require(module)[name] ?? null; } catch (e) { return null; } };
const proto = (module, name) => cls(module, name)?.prototype;
const sheet = proto("core/dom", "InlineStyleSheet");
if (sheet == null || typeof sheet._update !== "function") {
  missing.push("stylesheet");
} else if (!sheet._qatlab_patched) {
  const write = sheet._update;
  sheet._update = function (css) {
    if (this.el.textContent !== css) write.call(this, css);
  };
  sheet._qatlab_patched = true;
}
const glyph = proto("models/glyphs/glyph", "GlyphView");
const getter = glyph == null ? null : Object.getOwnPropertyDescriptor(glyph, "index")?.get;
if (getter == null || typeof glyph.index_data !== "function") {
  missing.push("index");
} else if (!glyph._qatlab_patched) {
  const build = glyph.index_data;
  glyph.index_data = function () { this._index = null; this._qatlab_index_stale = true; };
  Object.defineProperty(glyph, "index", {
    configurable: true,
    get() {
      if (this._qatlab_index_stale) {
        this._qatlab_index_stale = false;
        build.call(this);
      }
      return getter.call(this);
    },
  });
  glyph._qatlab_patched = true;
}
const renderer = proto("models/renderers/glyph_renderer", "GlyphRendererView");
const bbox = renderer == null ? null : Object.getOwnPropertyDescriptor(renderer, "bbox")?.get;
if (bbox == null) {
  missing.push("renderer bbox");
} else if (!renderer._qatlab_patched) {
  Object.defineProperty(renderer, "bbox", {
    configurable: true,
    get() { return this.glyph?._qatlab_index_stale ? undefined : bbox.call(this); },
  });
  renderer._qatlab_patched = true;
}
const ranges = proto("models/plots/range_manager", "RangeManager");
const DataRange1d = cls("models/ranges/data_range1d", "DataRange1d");
if (ranges == null || DataRange1d == null || typeof ranges._update_dataranges !== "function") {
  missing.push("dataranges");
} else if (!ranges._qatlab_patched) {
  const update = ranges._update_dataranges;
  ranges._update_dataranges = function (frame) {
    for (const rs of [frame.x_ranges, frame.y_ranges]) {
      for (const [, r] of rs) {
        if (r instanceof DataRange1d) return update.call(this, frame);
      }
    }
  };
  ranges._qatlab_patched = true;
}
window.qatlab_render_patch = missing.length ? "unavailable: " + missing.join(", ") : "installed";
"""


def install_render_patch(doc) -> None:
    """Apply the BokehJS patch once ``doc`` (a Bokeh Document; None: nothing) is ready in the browser."""
    if ENABLED and doc is not None:
        doc.js_on_event("document_ready", CustomJS(code=PATCH_JS))
