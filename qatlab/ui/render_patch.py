"""One BokehJS hot spot, patched in the page: stylesheets rewritten with the same text.

Every renderer of a Bokeh plot calls ``update_position()`` on every paint, which rewrites the
``textContent`` of its inline ``<style>`` element even when the CSS is unchanged. The browser
then re-parses the sheet and marks styles dirty, and the next visual-property read of the paint
(BokehJS reads each through ``getComputedStyle``, for CSS-variable overrides) forces a style
recalculation. Traced in Chromium with four runs streaming into the STE comparison (seven
plots, 10 Hz): 706 style recalculations in 2 s and 980 ms of animation-frame script.

The patch makes ``InlineStyleSheet._update`` skip the write when the text is already the one
asked for; a different text is written as before, so nothing else changes. Same trace with the
patch: 123 recalculations and 548 ms. (Glyph renderers whose data grow still move their
element every frame; those writes differ and go through.) If BokehJS renames the class or
method, the patch does nothing.
"""
from __future__ import annotations

from bokeh.models import CustomJS

#: Sets ``window.qatlab_render_patch`` to "installed" or "unavailable" (read by the browser test).
PATCH_JS = """
const sheet = Bokeh.require("core/dom").InlineStyleSheet?.prototype;
if (sheet == null || typeof sheet._update !== "function") {
  window.qatlab_render_patch = "unavailable";
  return;
}
if (!sheet._qatlab_patched) {
  const write = sheet._update;
  sheet._update = function (css) {
    if (this.el.textContent !== css) write.call(this, css);
  };
  sheet._qatlab_patched = true;
}
window.qatlab_render_patch = "installed";
"""


def install(doc) -> None:
    """Apply the patch once ``doc`` (a Bokeh Document; None: nothing) is ready in the browser."""
    if doc is not None:
        doc.js_on_event("document_ready", CustomJS(code=PATCH_JS))
