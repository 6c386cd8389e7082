"""Server-side auto-ranging of the streaming plots.

Bokeh's ``DataRange1d`` refits in the browser on every streamed row, and each refit re-lays out
and repaints the whole plot: with four runs streaming at 10 Hz that was most of the browser's
work (the page fell to about 3 updates/s). The time-series figures therefore use plain
``Range1d`` ranges tagged :data:`AUTO`, and one :class:`RangeFitter` per view moves them from the
server, only when the data leave them:

- x grows to the right with headroom: when the newest x passes the end, the end becomes
  ``lo + X_HEADROOM * (hi - lo)``, so a run that grows 1000x moves its x range about 17 times;
  once the view's runs have ended (``update(final=True)``), x ends at the data's end (plus
  ``X_FINAL_MARGIN`` of the span), not in the headroom;
- y grows with a margin: when a value leaves the range, it becomes the data's extent padded by
  ``Y_MARGIN`` of its span on both sides (in log10 units on a log axis, positive values only);
- hiding a line (legend click) or new data after a rebuild refits to the visible lines' extent;
- a user's zoom or pan wins: while a range differs from the value last set here, it is left
  alone. The ``reset`` tool returns to ``reset_start``/``reset_end``, kept equal to the fitted
  range, and fitting resumes from there.

Extents are kept per (source, column) and updated from the rows appended since the last tick,
so a tick costs time proportional to the new rows, not to the displayed history.
"""
from __future__ import annotations

import math

import numpy as np
from bokeh.models import GlyphRenderer, Range1d

#: Tag of the ranges a RangeFitter manages (fixed ranges such as ``fraction_range()`` lack it).
AUTO = "qatlab-auto"
X_HEADROOM = 1.5
X_FINAL_MARGIN = 0.01
Y_MARGIN = 0.08

#: Glyph fields read per dimension (Line, Step, Scatter use x/y; VStrip x0/x1 spans only x).
_FIELDS = {"x": ("x", "x0", "x1"), "y": ("y",)}


def auto_range(log: bool = False) -> Range1d:
    """A placeholder ``Range1d`` (0..1, or 0.001..1 on a log axis) for a RangeFitter to manage."""
    return Range1d(start=1e-3 if log else 0.0, end=1.0, tags=[AUTO])


class _ColumnExtent:
    """Finite (min, max) of one source column, updated from the rows appended since the last call.

    Bokeh streams lists by extending the column in place; anything else (a new column object:
    thinning, an EMA rewrite, an array stream; fewer rows; a changed last row: rollover)
    rescans the column.
    """

    def __init__(self, positive: bool):
        self.positive = positive
        self.col, self.n, self.last = None, 0, None
        self.lo, self.hi = math.inf, -math.inf

    def update(self, data, field: str) -> None:
        col = data.get(field)
        if col is None:
            return
        n, start = len(col), self.n
        if col is not self.col or n < start or (start and not _same(col[start - 1], self.last)):
            start, self.lo, self.hi = 0, math.inf, -math.inf
        if n > start:
            values = np.asarray(col[start:n], dtype=np.float64)
            values = values[np.isfinite(values) & (values > 0)] if self.positive else values[np.isfinite(values)]
            if len(values):
                self.lo, self.hi = min(self.lo, float(values.min())), max(self.hi, float(values.max()))
        self.col, self.n, self.last = col, n, (col[n - 1] if n else None)


def _same(a, b) -> bool:
    return a == b or (a != a and b != b)   # NaN == NaN here


class _ManagedRange:
    """One auto range and the source columns whose data it must show.

    Reading a Bokeh property costs microseconds (``visible`` is never set, so each read resolves
    the default), so columns are grouped per source (one ``data`` read per source per tick) and
    visibility is tracked by ``on_change`` callbacks instead of being read every tick.
    """

    def __init__(self, rng: Range1d, dim: str, log: bool):
        self.range, self.dim, self.log = rng, dim, log
        self.sources: dict[str, tuple] = {}     # source id -> (source, [(renderer id, field, _ColumnExtent)])
        self.visible: dict[str, bool] = {}      # renderer id -> visible
        self.fitted: tuple | None = None        # (start, end) last set here
        self.refit = True
        self._watching: list = []               # (renderer, its visible callback), for close()

    def add(self, renderer) -> None:
        glyph, source = renderer.glyph, renderer.data_source
        fields = []
        has = glyph.properties()     # (asking a Bokeh model for a property it lacks builds a costly error)
        for attr in (a for a in _FIELDS[self.dim] if a in has):
            field = getattr(glyph, attr)
            if isinstance(field, dict):
                field = field.get("field")
            if isinstance(field, str):
                fields.append((renderer.id, field, _ColumnExtent(self.log)))
        if not fields:
            return
        self.sources.setdefault(source.id, (source, []))[1].extend(fields)
        self.visible[renderer.id] = renderer.visible
        callback = (lambda attr, old, new, rid=renderer.id: self._on_visible(rid, new))
        renderer.on_change("visible", callback)
        self._watching.append((renderer, callback))

    def close(self) -> None:
        """Stop watching the renderers (a renderer that outlives this range keeps no reference to it)."""
        for renderer, callback in self._watching:
            renderer.remove_on_change("visible", callback)
        self._watching = []

    def _on_visible(self, rid: str, visible: bool) -> None:
        self.visible[rid] = bool(visible)
        self.refit = True

    def extent(self) -> tuple[float, float] | None:
        lo, hi = math.inf, -math.inf
        for source, columns in self.sources.values():
            data = source.data
            for rid, field, ext in columns:
                ext.update(data, field)
                if self.visible[rid]:
                    lo, hi = min(lo, ext.lo), max(hi, ext.hi)
        return (lo, hi) if lo <= hi else None

    def fit(self, final: bool = False) -> None:
        rng = self.range
        if self.fitted is not None and (rng.start, rng.end) != self.fitted:
            return                                   # the user zoomed or panned: leave it
        extent = self.extent()
        if extent is None:
            return
        lo, hi = (math.log10(v) for v in extent) if self.log else extent
        start, end = (math.log10(v) for v in (rng.start, rng.end)) if self.log else (rng.start, rng.end)
        span = hi - lo if hi > lo else max(abs(hi), 1.0) * 0.1
        tight = final and self.dim == "x" and hi > lo     # the data will not grow: no headroom
        inside = start <= lo and hi <= end and (not tight or end <= hi + 2 * X_FINAL_MARGIN * span)
        if not self.refit and inside:
            return
        self.refit = False
        if self.dim == "x":
            start, end = lo, (hi + X_FINAL_MARGIN * span if tight else lo + X_HEADROOM * span) if hi > lo else hi + span
        else:
            start, end = lo - Y_MARGIN * span, hi + Y_MARGIN * span
        if self.log:
            start, end = 10.0 ** start, 10.0 ** end
        rng.update(start=start, end=end, reset_start=start, reset_end=end)
        self.fitted = (rng.start, rng.end)


class RangeFitter:
    """Fits the :data:`AUTO` ranges of ``figures`` to their data; call :meth:`update` once per tick.

    Args:
        figures: Bokeh figures; ranges shared between them (linked x axes) are fitted once,
            to every figure's lines.
    """

    def __init__(self, figures):
        self.figures = list(figures)
        managed: dict[str, _ManagedRange] = {}
        for fig in self.figures:
            for dim, rng in (("x", fig.x_range), ("y", fig.y_range)):
                if not isinstance(rng, Range1d) or AUTO not in rng.tags:
                    continue
                log = (fig.x_scale if dim == "x" else fig.y_scale).__class__.__name__ == "LogScale"
                m = managed.setdefault(rng.id, _ManagedRange(rng, dim, log))
                for renderer in fig.renderers:
                    if isinstance(renderer, GlyphRenderer):
                        m.add(renderer)
        self.ranges = list(managed.values())

    def close(self) -> None:
        """Forget the figures: their renderers no longer call back into this fitter."""
        for m in self.ranges:
            m.close()

    def update(self, final: bool = False) -> None:
        """Move every managed range whose data left it (see the module doc); ``final``: the
        runs shown have ended, so x ranges end at the data."""
        for m in self.ranges:
            m.fit(final)
