"""Quantization tab: per-layer latent vs quantized weight histograms, and quantizer state over time.

Histograms come from the run's ``weight_snapshot()``: the latest weights its worker published
(about once a second, at most 16,384 evenly strided weights per layer); they are recomputed only
when a new snapshot appears.
Sources ``hist-latent-layer<i>`` / ``hist-quant-layer<i>`` (columns left, right,
count) feed figures ``fig-hist-latent-<i>`` / ``fig-hist-quant-<i>``.

Time series from the run's ``train-source-<run id>`` (x linked), one line per layer
(dash style = layer):

- ``fig-quant-fractions``: ``frac-neg-<i>-<run id>``, ``frac-zero-<i>-...``, ``frac-pos-<i>-...``;
- ``fig-quant-scale``: ``scale-<i>-<run id>``;
- ``fig-quant-saturation``: ``saturation-<i>-<run id>``;
- ``fig-quant-sqnr``: ``sqnr-<i>-<run id>``.
"""
from __future__ import annotations

import numpy as np
import panel as pn
import param
from bokeh.models import ColumnDataSource, Range1d

from ..progress import RunProgress
from . import figures as F
from .base import LiveView, bokeh_pane
from .streaming import n_layers_of
from .summary_view import ModelSummaryPanel

BINS = 60
MAX_LEVELS = 64            # at most this many distinct quantized values are drawn as bars
MAX_POINTS = 250_000       # larger weight matrices are subsampled (evenly) for the histograms
FRACTION_COLORS = {"neg": "#d62728", "zero": "#7f7f7f", "pos": "#2ca02c"}

_EMPTY = {"left": np.zeros(0), "right": np.zeros(0), "count": np.zeros(0)}


def _sample(w: np.ndarray) -> np.ndarray:
    flat = np.asarray(w, dtype=np.float64).ravel()
    flat = flat[np.isfinite(flat)]
    if flat.size > MAX_POINTS:
        flat = flat[:: int(np.ceil(flat.size / MAX_POINTS))]
    return flat


def histogram(w: np.ndarray, bins: int = BINS) -> dict:
    """``{left, right, count}`` arrays (bins,) of a symmetric histogram of ``w``."""
    flat = _sample(w)
    if flat.size == 0:
        return dict(_EMPTY)
    lim = float(np.max(np.abs(flat))) or 1.0
    counts, edges = np.histogram(flat, bins=bins, range=(-lim, lim))
    return {"left": edges[:-1], "right": edges[1:], "count": counts.astype(np.float64)}


def level_bars(w: np.ndarray, max_levels: int = MAX_LEVELS) -> dict:
    """One bar per distinct value of a quantized ``w`` (a histogram if there are too many)."""
    flat = _sample(w)
    if flat.size == 0:
        return dict(_EMPTY)
    values, counts = np.unique(flat, return_counts=True)
    if len(values) > max_levels:
        return histogram(flat)
    gaps = np.diff(values)
    width = 0.6 * float(gaps.min()) if len(gaps) else max(abs(float(values[0])) * 0.1, 1e-3)
    return {"left": values - width / 2, "right": values + width / 2, "count": counts.astype(np.float64)}


def describe_quant(q) -> str:
    """One line of what a QuantConfig quantizes: weights (bits, STE) and activations (bits, STE)."""
    weights = f"weights: **{q.weights}**" + (f" ({q.weight_bits} bit)" if q.weights == "fake" else "")
    if q.weights != "float":
        weights += f", STE **{q.ste}**"
    if q.activations == "off":
        return weights + " · activations: **not quantized**"
    return weights + f" · activations: **{q.activations}** ({q.activation_bits} bit), STE **{q.activation_ste}**"


class QuantView(LiveView):
    """Per-layer weight histograms (live) and quantizer statistics over time for one run."""

    run = param.ClassSelector(class_=RunProgress, default=None, allow_None=True, doc="The run shown.")

    def __init__(self, run: RunProgress | None = None, hub=None, options=None, lazy: bool = False, **params):
        super().__init__(hub, options, lazy, **params)
        self.figures: dict = {}
        self.hist_sources: dict[str, ColumnDataSource] = {}
        self._snapshot = None
        self._fitted: dict = {}       # histogram range id -> (start, end) set last (a user zoom differs)
        self.intro = pn.pane.Markdown("No run yet: press **Start** to see its weights.", margin=(5, 10))
        self.model_summary = ModelSummaryPanel()   # ql.summary of the run's config (CSS qatlab-model-summary)
        self._plots = pn.Column(sizing_mode="stretch_width")
        self._layout = pn.Column(self.intro, self._plots, sizing_mode="stretch_width")
        self.follow_run(run)

    def rebuild(self) -> None:
        """(Re)create histogram and time-series figures for the current run."""
        self.figures, self.hist_sources, self._snapshot, self._fitted = {}, {}, None, {}
        run = self.run
        self.model_summary.show(None if run is None else run.config)
        if run is None:
            self._plots.objects = []
            return
        self.intro.object = f"**{run.name}** · {describe_quant(run.config.quant)} · histograms refresh about twice a second."
        rs = self.hub.stream(run)
        x, xr, rid = self.x_field, F.shared_x_range(), run.id
        n = n_layers_of(run.config)
        rows, names = [], self._layer_names(n)
        for i in range(n):
            lat = self.hist_sources[f"latent-{i}"] = ColumnDataSource(dict(_EMPTY), name=f"hist-latent-layer{i}")
            qnt = self.hist_sources[f"quant-{i}"] = ColumnDataSource(dict(_EMPTY), name=f"hist-quant-layer{i}")
            hx = Range1d(-1.0, 1.0)  # latent and quantized W of a layer share the x axis (set in refresh)
            f1 = F.histogram_figure(f"{names[i]} · latent W", lat, name=f"fig-hist-latent-{i}",
                                    renderer_name=f"hist-latent-{i}", color="#1f77b4", x_range=hx)
            f2 = F.histogram_figure(f"{names[i]} · quantized W", qnt, name=f"fig-hist-quant-{i}",
                                    renderer_name=f"hist-quant-{i}", color="#ff7f0e", x_range=hx)
            self.figures[f"hist-latent-{i}"], self.figures[f"hist-quant-{i}"] = f1, f2
            rows.append(pn.Row(bokeh_pane(f1), bokeh_pane(f2), sizing_mode="stretch_width"))

        frac = F.line_figure("Weight sign fractions (−1 / 0 / +1)", "fraction", name="fig-quant-fractions",
                             x_field=x, x_range=xr, y_range=F.fraction_range())
        scale = F.line_figure("Quantizer scale", "scale", name="fig-quant-scale", x_field=x, x_range=xr,
                              y_log=self.options.log_y)
        sat = F.line_figure("Saturation (clamped share)", "fraction", name="fig-quant-saturation", x_field=x,
                            x_range=xr)
        sqnr = F.line_figure("SQNR", "dB", name="fig-quant-sqnr", x_field=x, x_range=xr)
        for i in range(n):
            dash = F.LAYER_DASHES[i % len(F.LAYER_DASHES)]
            for part, color in FRACTION_COLORS.items():
                F.add_line(frac, rs.train, x, f"frac_{part}_{i}", color=color, dash=dash, width=1.5,
                           name=f"frac-{part}-{i}-{rid}", label=f"{part} L{i}")
            color = F.run_color(i)
            F.add_line(scale, rs.train, x, f"scale_{i}", color=color, name=f"scale-{i}-{rid}", label=f"layer {i}")
            F.add_line(sat, rs.train, x, f"saturation_{i}", color=color, name=f"saturation-{i}-{rid}",
                       label=f"layer {i}")
            F.add_line(sqnr, rs.train, x, f"sqnr_db_{i}", color=color, name=f"sqnr-{i}-{rid}", label=f"layer {i}")
        for fig in (frac, scale, sat, sqnr):
            F.finish(fig)
        self.figures.update({"fractions": frac, "scale": scale, "saturation": sat, "sqnr": sqnr})
        series = pn.GridBox(bokeh_pane(frac), bokeh_pane(scale), bokeh_pane(sat), bokeh_pane(sqnr), ncols=2,
                            sizing_mode="stretch_width")
        self._plots.objects = [pn.pane.Markdown("### Model summary", margin=(0, 10)), self.model_summary.pane,
                               pn.pane.Markdown("### Weights: latent vs quantized", margin=(0, 10)), *rows,
                               pn.pane.Markdown("### Quantizer over time", margin=(0, 10)), series]
        self.refresh()

    def refresh(self, force: bool = False) -> None:
        """Recompute the histograms when the run published a new weight snapshot (already on
        every call: ``force`` changes nothing)."""
        if self.run is None:
            return
        snap = self.run.weight_snapshot()
        if snap is None or snap is self._snapshot:
            return
        self._snapshot = snap
        for i in range(n_layers_of(self.run.config)):
            pair = snap.get(f"layer{i}")
            if pair is None or f"latent-{i}" not in self.hist_sources:
                continue
            latent, quantized = pair
            lat, qnt = histogram(latent), level_bars(quantized)
            self.hist_sources[f"latent-{i}"].data = lat
            self.hist_sources[f"quant-{i}"].data = qnt
            F.fit_histogram(self.figures[f"hist-latent-{i}"], lat, [lat, qnt], self._fitted)
            F.fit_histogram(self.figures[f"hist-quant-{i}"], qnt, [lat, qnt], self._fitted)

    def _layer_names(self, n: int) -> list[str]:
        """Histogram titles: ``Layer i``, with the summary's name (conv0, dense1, ...) for a cnn."""
        s = self.model_summary.summary
        named = [r["name"] for r in s.layers if r["weights"]] if s is not None else []
        if self.run.config.model.architecture != "cnn" or len(named) != n:
            return [f"Layer {i}" for i in range(n)]
        return [f"Layer {i} ({name})" for i, name in enumerate(named)]

    def shown_runs(self) -> list:
        return [self.run] if self.run is not None else []

    def _panel(self):
        return self._layout
