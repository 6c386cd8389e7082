"""Two BokehJS hot spots, patched in the page: stylesheets rewritten with the same text, and a
spatial index rebuilt on every streamed row.

**Stylesheets.**

Every renderer of a Bokeh plot calls ``update_position()`` on every paint, which rewrites the
``textContent`` of its inline ``<style>`` element even when the CSS is unchanged. The browser
then re-parses the sheet and marks styles dirty, and the next visual-property read of the paint
(BokehJS reads each through ``getComputedStyle``, for CSS-variable overrides) forces a style
recalculation. Traced in Chromium with four runs streaming into the STE comparison (seven
plots, 10 Hz): 706 style recalculations in 2 s and 980 ms of animation-frame script.

The patch makes ``InlineStyleSheet._update`` skip the write when the text is already the one
asked for; a different text is written as before, so nothing else changes. Same trace with the
patch: 123 recalculations and 548 ms. (Glyph renderers whose data grow still move their
element every frame; those writes differ and go through.)

**Spatial index.** Every ``stream`` to a source makes each glyph that draws from it rebuild its
spatial index (a packed R-tree over all its points, ``GlyphView.index_data``), although the index
is only read for hit testing (hover, selection) and for data-range bounds, which these plots do
not use (their ranges are fitted on the server). With seven plots and ~40 lines streaming at
10 Hz, that was most of Chromium's 0.7 cores. The patch makes the index lazy: ``index_data``
marks it stale and the ``index`` getter builds it on first use, so every reader still gets the
index of the current data. BokehJS also asks every glyph for its bounds (from the index) on each
paint after a data change, to update DataRange1d ranges; the patch skips that for a plot whose
ranges are none of them DataRange1d (the function's only effect is on those ranges). And each
paint positions every glyph renderer's (empty) DOM element at its glyph's data box, read from the
index; while the index is stale that element is left hidden instead (``display: none``, the
state BokehJS itself gives a renderer without a box).

Each patch checks the method it replaces exists; if BokehJS renames it, that patch does nothing
and ``window.qatlab_render_patch`` says so.
"""
from __future__ import annotations

from bokeh.models import CustomJS

#: Sets ``window.qatlab_render_patch`` to "installed" or to what is unavailable (read by the browser test).
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


def install(doc) -> None:
    """Apply the patch once ``doc`` (a Bokeh Document; None: nothing) is ready in the browser."""
    if doc is not None:
        doc.js_on_event("document_ready", CustomJS(code=PATCH_JS))
