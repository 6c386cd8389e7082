"""Runs tab: every run of this server process, overlay of the selected ones, CSV/JSON downloads.

- ``pn.widgets.Tabulator`` (CSS class ``qatlab-runs-table``): one ``LocalRun.summary()`` row per run in
  ``qatlab.runs.all_runs()`` (runs belong to the process and survive page reloads) with its
  weight bits (``4-bit`` / ``ternary`` / ``float``), activations, per channel, scale mode and batch;
  checkbox selection, refreshed about once a second.
- Selected runs are overlaid in ``fig-runs-loss`` (``runs-loss-<run id>``, EMA) and
  ``fig-runs-accuracy`` (``runs-accuracy-<run id>``).
- Buttons: ``Download CSV`` (metrics of the selected runs, or of all runs when none is
  selected; columns ``run_id``, ``name`` then every log column), ``Download configs (JSON)``
  (``{run id: {name, status, config}}``), ``Show in overview`` (first selected run),
  ``Stop selected``, ``Rename`` (the one selected run, to the text in ``New name``) and
  ``Delete selected``.

Ownership (:meth:`qatlab.runs.LocalRun.may_change`): a page stops, renames or deletes the runs it
started; runs of other pages, notebooks and the command line are read-only while they are
active (the column ``started by`` says whose a run is; the buttons are disabled for them, and a
press that gets through anyway is refused with a message in the alert ``qatlab-runs-message``).
Ended runs may be renamed or deleted from any page. Every delete, and a rename of a run another
page started, waits for ``Confirm`` (``Cancel`` drops it); the check is made again on confirm.
"""
from __future__ import annotations

import csv
import io
import json
import math
import time

import numpy as np
import pandas as pd
import panel as pn

from ..runs import NAME_LIMIT, LocalRun, all_runs, checked_name, delete_run
from . import figures as F
from .base import LiveView, bokeh_pane
from .tables import patch_and_stream

TABLE_PERIOD = 1.0  # seconds between table refreshes
# The table's columns, the same with no runs as with some: changing a Tabulator's columns while its
# tab is being drawn for the first time failed in the browser ("Table Not Initialized", then
# "Cannot read properties of null (reading 'firstChild')" and an empty Runs tab).
COLUMNS = ["id", "name", "status", "progress", "steps", "seconds", "train_loss", "test_loss", "test_accuracy",
           "steps_per_second", "dataset", "hidden", "weights", "bits", "activations", "per channel",
           "scale mode", "ste", "optimizer", "lr", "batch", "epochs", "phase", "started by"]


def started_by(run: LocalRun, owner) -> str:
    """Who started ``run``, as the page of ``owner`` sees it (never another session's id)."""
    if owner is not None and run.owner == owner:
        return "this page"
    return "another page" if run.owner is not None else "notebook / CLI"


def bits_text(quant) -> str:
    """Weight precision of a QuantConfig: ``k-bit`` for fake weights, else ``ternary`` / ``float``."""
    return f"{quant.weight_bits}-bit" if quant.weights == "fake" else quant.weights


def quant_columns(config) -> dict:
    """Table columns of a run's quantization and batch size; ``-`` where a setting does not apply
    (per-channel scales exist only for fake weights, a scale mode only with a fake quantizer)."""
    q = config.quant
    fake = q.weights == "fake" or q.activations == "fake"
    return {"bits": bits_text(q),
            "activations": f"{q.activation_bits}-bit" if q.activations == "fake" else "off",
            "per channel": ("yes" if q.per_channel else "no") if q.weights == "fake" else "-",
            "scale mode": q.scale_mode if fake else "-",
            "batch": config.optim.batch_size}


def run_label(run: LocalRun) -> str:
    """Legend label: name, weights (with bits), quantized activations, STE."""
    q = run.config.quant
    weights = f"fake {q.weight_bits}-bit" if q.weights == "fake" else q.weights
    acts = f", act {q.activation_bits}-bit" if q.activations == "fake" else ""
    return f"{run.name}: {weights}{acts}, STE {q.ste}"


def runs_frame(runs: list[LocalRun], owner=None) -> pd.DataFrame:
    """One ``LocalRun.summary()`` row per run with its quantization columns (:func:`quant_columns`),
    plus ``started by`` (:func:`started_by`)."""
    rows = [{**r.summary(), **quant_columns(r.config), "started by": started_by(r, owner)} for r in runs]
    extra = list(dict.fromkeys(k for row in rows for k in row if k not in COLUMNS))
    return pd.DataFrame(rows, columns=COLUMNS + extra)


def _whole(col) -> bool:
    """Every finite value of ``col`` is a whole number (a count such as ``step``)."""
    finite = col[np.isfinite(col)]
    return bool(np.all(finite == np.round(finite)) and np.all(np.abs(finite) < 2**53))


def runs_csv(runs: list[LocalRun]) -> str:
    """Metrics of ``runs`` as one CSV: ``run_id``, ``name``, then the union of their log columns."""
    logs = [(r, r.log.columns()) for r in runs]
    keys: list[str] = []
    for _, cols in logs:
        keys += [k for k in cols if k not in keys]
    # columns of whole numbers in every run (step, row_id, phase, ...) are written as integers
    whole = {k for k in keys if all(_whole(cols[k]) for _, cols in logs if k in cols)}
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
                row.append("" if math.isnan(v) else str(int(v)) if k in whole and math.isfinite(v) else repr(v))
            writer.writerow(row)
    return out.getvalue()


def runs_json(runs: list[LocalRun]) -> str:
    """Configs of ``runs`` as JSON: ``{run id: {"name", "status", "config"}}``."""
    return json.dumps({r.id: {"name": r.name, "status": r.status, "config": r.config.to_dict()} for r in runs},
                      indent=2)


class RunsTable(LiveView):
    """Table of all runs, overlay of the selected ones, and downloads.

    Args:
        on_show: called with a LocalRun when ``Show in overview`` is pressed.
        owner: the page's owner id (its runs are the ones it may change while they run).
    """

    def __init__(self, hub=None, options=None, on_show=None, lazy: bool = False, owner=None, **params):
        super().__init__(hub, options, lazy, **params)
        self.on_show = on_show
        self.owner = owner
        self._pending = None   # (runs, action) waiting for Confirm
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
        self.stop_button = pn.widgets.Button(label="Stop selected", color="warning", disabled=True)
        self.name_input = pn.widgets.TextInput(label="New name", placeholder="name of the selected run",
                                               max_length=NAME_LIMIT, width=200)
        self.rename_button = pn.widgets.Button(label="Rename", disabled=True, align="end")
        self.delete_button = pn.widgets.Button(label="Delete selected", color="danger", disabled=True)
        self.confirm_text = pn.pane.Markdown("", margin=(5, 10))
        self.confirm_button = pn.widgets.Button(label="Confirm", color="danger")
        self.cancel_button = pn.widgets.Button(label="Cancel")
        self.confirm_row = pn.Row(self.confirm_text, self.confirm_button, self.cancel_button, visible=False,
                                  css_classes=["qatlab-runs-confirm"])
        self.message = pn.pane.Alert("", alert_type="warning", visible=False, css_classes=["qatlab-runs-message"],
                                     sizing_mode="stretch_width", margin=(5, 10))
        self.show_button.on_click(self._show)
        self.stop_button.on_click(lambda _: self.stop_selected())
        self.rename_button.on_click(lambda _: self.rename_selected(self.name_input.value))
        self.delete_button.on_click(lambda _: self.delete_selected())
        self.confirm_button.on_click(lambda _: self.confirm())
        self.cancel_button.on_click(lambda _: self.cancel())
        self._plots = pn.Column(sizing_mode="stretch_width")
        self._layout = pn.Column(
            pn.pane.Markdown("Every run of this server process. Tick rows to overlay them; downloads use the "
                             "selection (all runs when nothing is selected). Runs of other pages, notebooks "
                             "and the command line are read-only while they run.", margin=(5, 10)),
            self.table,
            pn.Row(self.csv_download, self.json_download, self.show_button, self.stop_button),
            pn.Row(self.name_input, self.rename_button, self.delete_button),
            self.confirm_row, self.message,
            self._plots, sizing_mode="stretch_width")
        self._ids: list[str] = []
        self._last_key = None
        self._next_refresh = 0.0
        self.table.param.watch(self._on_selection, "selection")
        if self._active:    # a hidden (lazy) tab reads the runs when first shown: a page open does not
            self.refresh(force=True)
        self.request_rebuild()

    def _on_selection(self, _event=None) -> None:
        self.cancel()
        self._update_buttons()
        self.request_rebuild()

    # ------------------------------------------------------------ selection
    def selected_runs(self) -> list[LocalRun]:
        """Runs whose rows are ticked, in table order."""
        by_id = {r.id: r for r in all_runs()}
        ids = [self._ids[i] for i in sorted(self.table.selection) if 0 <= i < len(self._ids)]
        return [by_id[i] for i in ids if i in by_id]

    def _chosen(self) -> list[LocalRun]:
        return self.selected_runs() or all_runs()

    def _csv_file(self):
        return io.StringIO(runs_csv(self._chosen()))

    def _json_file(self):
        return io.StringIO(runs_json(self._chosen()))

    def _show(self, _event=None) -> None:
        runs = self.selected_runs()
        if runs and self.on_show is not None:
            self.on_show(runs[0])

    # ------------------------------------------------------------ changing runs (ownership: module doc)
    def _say(self, text: str, alert_type: str = "warning") -> None:
        self.message.object, self.message.alert_type, self.message.visible = text, alert_type, bool(text)

    def _refused(self, runs: list[LocalRun], what: str) -> str:
        ids = ", ".join(r.id for r in runs)
        return (f"Cannot {what} {ids}: another page, a notebook or the command line started "
                f"{'it' if len(runs) == 1 else 'them'}, and {'it is' if len(runs) == 1 else 'they are'} "
                f"read-only while running.")

    def _update_buttons(self) -> None:
        runs = self.selected_runs()
        self.stop_button.disabled = not any(not r.done and r.may_change(self.owner) for r in runs)
        self.rename_button.disabled = not (len(runs) == 1 and runs[0].may_change(self.owner))
        self.delete_button.disabled = not runs or not all(r.may_change(self.owner) for r in runs)

    def stop_selected(self) -> list[LocalRun]:
        """``Stop selected``: stop the selected active runs this page started; returns them."""
        active = [r for r in self.selected_runs() if not r.done]
        mine = [r for r in active if r.may_change(self.owner)]
        for run in mine:
            run.stop()
        refused = [r for r in active if r not in mine]
        self._say(self._refused(refused, "stop") if refused else "")
        return mine

    def rename_selected(self, name: str) -> bool:
        """``Rename``: the one selected run gets ``name`` (validated); a run another page started
        waits for :meth:`confirm`. Returns True when renamed now."""
        runs = self.selected_runs()
        if len(runs) != 1:
            self._say("Select one run to rename.")
            return False
        run = runs[0]
        try:
            new = checked_name(name)
        except (TypeError, ValueError) as exc:
            self._say(str(exc))
            return False
        if not run.may_change(self.owner):
            self._say(self._refused([run], "rename"))
            return False
        action = lambda: setattr(run, "name", new)   # noqa: E731
        if run.owner == self.owner and self.owner is not None:
            return self._apply([run], action, "rename")
        self._ask(f"Rename **{run.id}** ({run.name}), started by {started_by(run, self.owner)}, "
                  f"to **{new}**?", [run], action, "rename")
        return False

    def delete_selected(self) -> None:
        """``Delete selected``: asks for :meth:`confirm`, then removes the runs from the registry
        (an active run of this page is stopped first)."""
        runs = self.selected_runs()
        if not runs:
            self._say("Select the runs to delete.")
            return
        refused = [r for r in runs if not r.may_change(self.owner)]
        if refused:
            self._say(self._refused(refused, "delete"))
            return
        ids = ", ".join(r.id for r in runs)
        self._ask(f"Delete {len(runs)} run{'s' if len(runs) > 1 else ''} ({ids}) and their metrics "
                  "from this server?", runs, lambda: [delete_run(r) for r in runs if r in all_runs()], "delete")

    def _ask(self, text: str, runs: list[LocalRun], action, what: str) -> None:
        self._pending = (runs, action, what)
        self.confirm_text.object = text
        self.confirm_row.visible = True
        self._say("")

    def confirm(self) -> bool:
        """Carry out the action waiting for confirmation (checked again now); True if it was done."""
        if self._pending is None:
            return False
        runs, action, what = self._pending
        self.cancel()
        return self._apply(runs, action, what)

    def cancel(self) -> None:
        """Drop the action waiting for confirmation."""
        self._pending = None
        self.confirm_row.visible = False

    def _apply(self, runs: list[LocalRun], action, what: str) -> bool:
        refused = [r for r in runs if not r.may_change(self.owner)]
        if refused:    # checked again at the moment of the change
            self._say(self._refused(refused, what))
            return False
        try:
            action()
        except (TypeError, ValueError) as exc:   # a bad name
            self._say(str(exc))
            return False
        self._say("")
        if what == "delete":
            self.table.selection = []
        self.refresh(force=True)
        return True

    # ------------------------------------------------------------ refresh
    def refresh(self, force: bool = False) -> None:
        """Re-read ``all_runs()`` into the table, at most once per second and only if it changed."""
        now = time.monotonic()
        if now < self._next_refresh and not force:
            return
        self._next_refresh = now + TABLE_PERIOD
        runs = all_runs()
        df = runs_frame(runs, self.owner)
        key = df.to_json()
        if key == self._last_key:
            return
        self._update_buttons()     # statuses changed: an ended run of another page becomes changeable
        self._last_key = key
        ids = [r.id for r in runs]
        old = self.table.value
        n = len(self._ids)
        if n and ids[:n] == self._ids and list(df.columns) == list(old.columns):
            patch_and_stream(self.table, old, df)
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
            label = run_label(run)
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
