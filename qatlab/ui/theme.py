"""Air-gapped look: the template settings app/main.py uses.

Panel 1.9's ``Fast`` design lists Google's "Open Sans" stylesheet as a font resource and
``FastListTemplate`` sets ``font_url`` to it; both would make the page request
``fonts.googleapis.com``. :func:`template_kwargs` uses the Fast design without that resource
(:func:`qatlab.ui.internals.fast_design`), a system font stack and an empty ``font_url``. Panel's and
Bokeh's own JS/CSS (including the bundled fast-components module) are served by the Panel server
itself in server mode.

The template has no busy indicator: Panel keeps one process-wide busy flag and sets it on every
open page's indicator for each event of any page, so one page's spinner turned with another's work
and each press cost a document update per open page.
"""
from __future__ import annotations

from .internals import fast_design

SYSTEM_FONT = ("system-ui, -apple-system, 'Segoe UI', Roboto, 'Helvetica Neue', Arial, "
               "'Noto Sans', 'Liberation Sans', sans-serif")
#: The Fast design minus its web-font resource (nothing is fetched from other hosts).
LocalFast = fast_design()


def template_kwargs(**overrides) -> dict:
    """Keyword arguments for ``pn.template.FastListTemplate`` that keep the page off external hosts."""
    kwargs = dict(title="qatlab · quantization-aware training lab", design=LocalFast, font=SYSTEM_FONT,
                  font_url="", accent="#0072B5", sidebar_width=360, main_layout=None,
                  busy_indicator=None)
    kwargs.update(overrides)
    return kwargs
