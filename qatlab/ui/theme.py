"""Air-gapped look: a Fast design without web fonts, and the template settings app/main.py uses.

Panel 1.9's ``Fast`` design lists Google's "Open Sans" stylesheet as a font
resource and ``FastListTemplate`` sets ``font_url`` to it; both would make the
page request ``fonts.googleapis.com``. :class:`LocalFast` drops the font
resource and :func:`template_kwargs` sets a system font stack with an empty
``font_url``. Panel's and Bokeh's own JS/CSS (including the bundled
fast-components module) are served by the Panel server itself in server mode.
"""
from __future__ import annotations

from panel.io.resources import CDN_DIST
from panel.theme.fast import Fast

SYSTEM_FONT = ("system-ui, -apple-system, 'Segoe UI', Roboto, 'Helvetica Neue', Arial, "
               "'Noto Sans', 'Liberation Sans', sans-serif")


class LocalFast(Fast):
    """The Fast design minus its web-font resource (nothing is fetched from other hosts)."""

    _resources = {key: value for key, value in Fast._resources.items() if key != "font"}
    # Relative resources resolve against the class name ("localfast/..."); point at Fast's bundled copy,
    # which the server maps to its local /static/extensions/panel/bundled/ directory.
    _resources["js_modules"] = {**Fast._resources["js_modules"],
                                "fast-design": f"{CDN_DIST}bundled/fast/js/fast_design.js"}


def template_kwargs(**overrides) -> dict:
    """Keyword arguments for ``pn.template.FastListTemplate`` that keep the page off external hosts."""
    kwargs = dict(title="qatlab · quantization-aware training lab", design=LocalFast, font=SYSTEM_FONT,
                  font_url="", accent="#0072B5", sidebar_width=360, main_layout=None)
    kwargs.update(overrides)
    return kwargs
