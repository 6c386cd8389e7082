"""Runs tab: every run of this server process, overlay of the selected ones, CSV/JSON downloads.

- ``pn.widgets.Tabulator`` (CSS class ``qatlab-runs-table``): one ``Run.summary()`` row per run in
  ``qatlab.runs.all_runs()`` (runs belong to the process and survive page reloads);
  checkbox selection, refreshed about once a second.
- Selected runs are overlaid in ``fig-runs-loss`` (``runs-loss-<run id>``, EMA) and
  ``fig-runs-accuracy`` (``runs-accuracy-<run id>``).
- Buttons: ``Download CSV`` (metrics of the selected runs, or of all runs when none is
  selected; columns ``run_id``, ``name`` then every log column), ``Download configs (JSON)``
  (``{run id: {name, status, config}}``), ``Show in overview`` (first selected run), and
  ``Stop selected``.
"""
from __future__ import annotations

import csv
import io
import json
import math
import time

import pandas as pd
import panel as pn

from ..runs import Run, all_runs
from . import figures as F
from .base import LiveView, bokeh_pane

TABLE_PERIOD = 1.0  # seconds between table refreshes


def runs_frame(runs: list[Run]) -> pd.DataFrame:
    """One ``Run.summary()`` row per run."""
    rows = [r.summary() for r in runs]
    return pd.DataFrame(rows) if rows else pd.DataFrame(columns=["id", "name", "status", "progress"])


def runs_csv(runs: list[Run]) -> str:
    """Metrics of ``runs`` as one CSV: ``run_id``, ``name``, then the union of their log columns."""
    logs = [(r, r.log.columns()) for r in runs]
    keys: list[str] = []
    for _, cols in logs:
        keys += [k for k in cols if k not in keys]
    out = io.StringIO()
    writer = csv.writer(out)
    writer.writerow(["run_id", "name", *keys])
    for run, cols in logs:
        n = len(cols.get("row_id", []))
        for j in range(n):
            row = [run.id, run.name]
            for k in keys:
                col = cols.get(k)
                v = float(col[j]) if col is not None else math.nan
                row.append("" if math.isnan(v) else repr(v))
            writer.writerow(row)
    return out.getvalue()


def runs_json(runs: list[Run]) -> str:
    """Configs of ``runs`` as JSON: ``{run id: {"name", "status", "config"}}``."""
    return json.dumps({r.id: {"name": r.name, "status": r.status, "config": r.config.to_dict()} for r in runs},
                      indent=2)


def _same(a, b) -> bool:
    """Equal, treating NaN as equal to NaN."""
    if isinstance(a, float) and isinstance(b, float) and math.isnan(a) and math.isnan(b):
        return True
    return a == b


class RunsTable(LiveView):
    """Table of all runs, overlay of the selected ones, and downloads.

    Args:
        on_show: called with a Run when ``Show in overview`` is pressed.
    """

    def __init__(self, hub=None, options=None, on_show=None, lazy: bool = False, **params):
        super().__init__(hub, options, lazy, **params)
        self.on_show = on_show
        self.figures: dict = {}
        self.table = pn.widgets.Tabulator(runs_frame([]), css_classes=["qatlab-runs-table"], selectable="checkbox",
                                          disabled=True, show_index=False, sizing_mode="stretch_width", height=260,
                                          formatters={"progress": {"type": "progress", "max": 1}})
        self.csv_download = pn.widgets.FileDownload(callback=self._csv_file, filename="qatlab-runs.csv",
                                                    label="Download CSV", embed=False)
        self.json_download = pn.widgets.FileDownload(callback=self._json_file, filename="qatlab-configs.json",
                                                     label="Download configs (JSON)",
                                                     embed=False)
        self.show_button = pn.widgets.Button(label="Show in overview")
        self.stop_button = pn.widgets.Button(label="Stop selected", color="warning")
        self.show_button.on_click(self._show)
        self.stop_button.on_click(lambda _: [r.stop() for r in self.selected_runs() if not r.done])
        self._plots = pn.Column(sizing_mode="stretch_width")
        self._layout = pn.Column(
            pn.pane.Markdown("Every run of this server process. Tick rows to overlay them; downloads use the "
                             "selection (all runs when nothing is selected).", margin=(5, 10)),
            self.table,
            pn.Row(self.csv_download, self.json_download, self.show_button, self.stop_button),
            self._plots, sizing_mode="stretch_width")
        self._ids: list[str] = []
        self._last_key = None
        self._next_refresh = 0.0
        self.table.param.watch(lambda e: self.request_rebuild(), "selection")
        self.refresh(force=True)
        self.rebuild()

    # ------------------------------------------------------------ selection
    def selected_runs(self) -> list[Run]:
        """Runs whose rows are ticked, in table order."""
        by_id = {r.id: r for r in all_runs()}
        ids = [self._ids[i] for i in sorted(self.table.selection) if 0 <= i < len(self._ids)]
        return [by_id[i] for i in ids if i in by_id]

    def _chosen(self) -> list[Run]:
        return self.selected_runs() or all_runs()

    def _csv_file(self):
        return io.StringIO(runs_csv(self._chosen()))

    def _json_file(self):
        return io.StringIO(runs_json(self._chosen()))

    def _show(self, _event=None) -> None:
        runs = self.selected_runs()
        if runs and self.on_show is not None:
            self.on_show(runs[0])

    # ------------------------------------------------------------ refresh
    def refresh(self, force: bool = False) -> None:
        """Re-read ``all_runs()`` into the table, at most once per second and only if it changed."""
        now = time.monotonic()
        if now < self._next_refresh and not force:
            return
        self._next_refresh = now + TABLE_PERIOD
        runs = all_runs()
        df = runs_frame(runs)
        key = df.to_json()
        if key == self._last_key:
            return
        self._last_key = key
        ids = [r.id for r in runs]
        old = self.table.value
        n = len(self._ids)
        if n and ids[:n] == self._ids and list(df.columns) == list(old.columns):
            # patch changed cells and stream new rows: replacing the value re-renders the whole table
            patch = {}
            for col in df.columns:
                changed = [(i, v) for i, (v, o) in enumerate(zip(df[col].iloc[:n], old[col])) if not _same(v, o)]
                if changed:
                    patch[col] = changed
            if patch:
                self.table.patch(patch)
            if len(ids) > n:
                self.table.stream(df.iloc[n:])
        else:
            self.table.value = df
        self._ids = ids

    def rebuild(self) -> None:
        """Overlay figures of the selected runs."""
        runs = self.selected_runs()
        self.figures = {}
        if not runs:
            self._plots.objects = [pn.pane.Markdown("*Tick runs above to overlay their curves.*", margin=(0, 10))]
            return
        x, xr = self.x_field, F.shared_x_range()
        loss = F.line_figure("Train loss (EMA) of the selected runs", "loss", name="fig-runs-loss", x_field=x,
                             x_range=xr, y_log=self.options.log_y, height=280)
        acc = F.line_figure("Test accuracy of the selected runs", "accuracy", name="fig-runs-accuracy",
                            x_field=x, x_range=xr, y_range=F.fraction_range(), height=280)
        for i, run in enumerate(runs):
            rs = self.hub.stream(run)
            color = F.run_color(i)
            label = f"{run.name} ({run.config.quant.weights}, {run.config.quant.ste})"
            F.add_line(loss, rs.loss, x, "loss_s", color=color, name=f"runs-loss-{run.id}", label=label)
            F.add_line(acc, rs.eval, x, "test_accuracy", color=color, name=f"runs-accuracy-{run.id}", label=label)
        F.finish(loss)
        F.finish(acc, location="bottom_right")
        self.figures = {"loss": loss, "accuracy": acc}
        self._plots.objects = [pn.Row(bokeh_pane(loss), bokeh_pane(acc), sizing_mode="stretch_width")]

    def shown_runs(self) -> list:
        return self.selected_runs() if self.figures else []

    def _panel(self):
        return self._layout
