"""Runs tab: every run of the run store (earlier server processes, notebooks, the CLI), newest first.

- ``pn.widgets.Tabulator`` (CSS class ``qatlab-runs-table``): one row per stored run
  (:data:`COLUMNS`: status, progress, final metrics, the config's data / model / quantization /
  optimizer columns, ``started by``, ``created`` (UTC), ``worker``, ``sweep``, ``notes``), checkbox
  selection, refreshed about once a second from a light read of the store
  (:mod:`qatlab.ui.run_listing`; the table is touched only when something changed). Runs this
  process trains (``live_runs()``: RemoteRuns) show their live status, steps and progress.
- ``Filter``: rows whose name, notes, status, dataset, weights, STE or sweep contain the text
  (any case) are shown, the others hidden.
- Selected runs are overlaid in ``fig-runs-loss`` (``runs-loss-<run id>``, EMA) and
  ``fig-runs-accuracy`` (``runs-accuracy-<run id>``): a live run's rows as they arrive, a stored
  run's history read once when it is selected (:class:`~qatlab.ui.stored_run.StoredRun`).
- Buttons: ``Download CSV`` (metrics of the selected runs, or of every shown run when none is
  selected; columns ``run_id``, ``name`` then every history column), ``Download configs (JSON)``
  (``{run id: {name, status, notes, created, config}}``), ``Download model`` (the one selected
  run's stored model as ``.npz``, the store's artifact format; disabled without one),
  ``Show in overview`` (first selected run), ``Load config into sidebar`` (the one selected run),
  ``Stop selected``, ``Rename`` (to the text in ``New name``), ``Save notes`` (the ``Notes`` text)
  and ``Delete selected`` (the store's run, rows and model).

Ownership: a page stops, renames, annotates or deletes the runs it started; runs of other pages,
notebooks and the command line are read-only while they are active (``started by`` says whose a run
is, from the store's owner page; the buttons are disabled for them, and a press that gets through
anyway is refused with a message in the alert ``qatlab-runs-message``). Ended runs may be renamed,
annotated or deleted from any page. Every delete, and a rename or notes change of a run another page
started, waits for ``Confirm`` (``Cancel`` drops it); the check is made again on confirm. A page's
own run that is still training is stopped, then deleted once it has ended.

The page never shows a server file path: messages and downloaded configs keep only a file's name.
"""
from __future__ import annotations

import copy
import csv
import io
import json
import logging
import math
import re
import threading
import time

import numpy as np
import pandas as pd
import panel as pn

from ..runs import NAME_LIMIT, checked_name
from ..store import ENDED, RunStore, StoreLockedError
from . import figures as F
from .base import NO_AUTOLINKS, LiveView, bokeh_pane
from .run_listing import Listed, utc_minutes
from .stored_run import StoredRun, public_config, scrub_paths
from .tables import same

log = logging.getLogger(__name__)

TABLE_PERIOD = 1.0             # seconds between table refreshes
INTERRUPTED_EVERY = 15.0       # seconds between checks for runs whose owner process died
DELETE_JOIN_SECONDS = 60.0     # how long a deleted run of this page may take to stop
NOTES_LIMIT = 2000             # characters of a run's notes
FINAL_COLUMNS = ("train_loss", "test_loss", "test_accuracy", "steps_per_second")
CONFIG_COLUMNS = ("dataset", "hidden", "weights", "bits", "activations", "per channel", "scale mode", "ste",
                  "optimizer", "lr", "batch", "epochs", "phase")
# The table's columns, the same with no runs as with some: changing a Tabulator's columns while its
# tab is being drawn for the first time failed in the browser ("Table Not Initialized", then
# "Cannot read properties of null (reading 'firstChild')" and an empty Runs tab).
COLUMNS = ["id", "name", "status", "progress", "steps", "seconds", *FINAL_COLUMNS, *CONFIG_COLUMNS, "started by",
           "created", "worker", "sweep", "notes"]
FILTERED = ("name", "notes", "status", "dataset", "weights", "ste", "sweep")


def started_by(page: str | None, owner) -> str:
    """Who started a run whose store owner page is ``page``, as the page of ``owner`` sees it
    (never another session's id)."""
    if owner is not None and page == owner:
        return "this page"
    return "another page" if page is not None else "notebook / CLI"


def run_label(run) -> str:
    """Legend label: name, weights (with bits), quantized activations, STE."""
    q = run.config.quant
    weights = f"fake {q.weight_bits}-bit" if q.weights == "fake" else q.weights
    acts = f", act {q.activation_bits}-bit" if q.activations == "fake" else ""
    return f"{run.name}: {weights}{acts}, STE {q.ste}"


def _number(value) -> float:
    return float(value) if isinstance(value, (int, float)) and not isinstance(value, bool) else math.nan


def table_row(entry: Listed, live, owner) -> dict:
    """The table row of a stored run; a ``live`` run (RemoteRun) of this process gives status,
    steps, progress and seconds."""
    final = entry.final
    if live is not None:
        status, steps, total = live.status, int(live.steps_done), int(live.total_steps)
        progress = round(steps / total, 3) if total else 0.0
        seconds = round(_number(getattr(live, "elapsed", math.nan)), 2)
    else:
        status, steps = entry.status, _number(final.get("steps"))
        progress = 1.0 if status == "finished" else math.nan
        seconds = _number(final.get("seconds"))
        end = entry.ended or entry.heartbeat
        if math.isnan(seconds) and entry.started is not None and end is not None:
            seconds = round(max(0.0, end - entry.started), 2)
    row = {"id": entry.id, "name": entry.name, "status": status, "progress": progress, "steps": steps,
           "seconds": seconds}
    row.update({k: _number(final.get(k)) for k in FINAL_COLUMNS})
    cols = entry.columns
    row.update({k: cols[k] for k in CONFIG_COLUMNS})
    row.update({"started by": started_by(entry.page, owner), "created": utc_minutes(entry.created),
                "worker": entry.worker or "", "sweep": (entry.sweep_id or "")[:8], "notes": entry.notes})
    return row


def frame(rows: list[dict]) -> pd.DataFrame:
    """The table's DataFrame (always :data:`COLUMNS`)."""
    return pd.DataFrame(rows, columns=COLUMNS)


def matches(row: dict, text: str) -> bool:
    """Whether ``text`` (lower case) is in one of the row's :data:`FILTERED` columns (any case)."""
    return not text or any(text in str(row[k]).lower() for k in FILTERED)


def _whole(col) -> bool:
    """Every finite value of ``col`` is a whole number (a count such as ``step``)."""
    finite = col[np.isfinite(col)]
    return bool(np.all(finite == np.round(finite)) and np.all(np.abs(finite) < 2**53))


def history_csv(items) -> str:
    """Metrics as one CSV: ``run_id``, ``name``, then the union of the histories' columns.

    items: ``(run id, name, {column: array})`` per run (``RunStore.history`` or ``MetricsLog.columns()``)."""
    items = list(items)
    keys: list[str] = []
    for _, _, cols in items:
        keys += [k for k in cols if k not in keys]
    # columns of whole numbers in every run (step, row_id, phase, ...) are written as integers
    whole = {k for k in keys if all(_whole(cols[k]) for _, _, cols in items if k in cols)}
    out = io.StringIO()
    writer = csv.writer(out)
    writer.writerow(["run_id", "name", *keys])
    for run_id, name, cols in items:
        n = len(cols.get("row_id", []))
        for j in range(n):
            row = [run_id, name]
            for k in keys:
                col = cols.get(k)
                v = float(col[j]) if col is not None else math.nan
                row.append("" if math.isnan(v) else str(int(v)) if k in whole and math.isfinite(v) else repr(v))
            writer.writerow(row)
    return out.getvalue()


def runs_csv(runs) -> str:
    """:func:`history_csv` of run-likes (``id``, ``name``, ``log``)."""
    return history_csv((r.id, r.name, r.log.columns()) for r in runs)


def runs_json(runs) -> str:
    """Configs of run-likes as JSON: ``{run id: {"name", "status", "config"}}`` (no server paths)."""
    return json.dumps({r.id: {"name": r.name, "status": r.status, "config": public_config(r.config.to_dict())}
                       for r in runs}, indent=2)


def configs_json(entries: list[Listed]) -> str:
    """Configs of listed runs as JSON: ``{run id: {"name", "status", "notes", "created", "config"}}``."""
    return json.dumps({e.id: {"name": e.name, "status": e.status, "notes": e.notes, "created": utc_minutes(e.created),
                              "config": public_config(e.config_dict)} for e in entries}, indent=2)


def model_npz(store: RunStore, entry: Listed) -> bytes:
    """The run's stored model as ``.npz`` bytes (:func:`qatlab.store.artifacts.model_to_npz`); KeyError without one."""
    from ..store.artifacts import model_to_npz
    return model_to_npz(store.load_model(entry.id), public_config(entry.config_dict))


def checked_notes(notes) -> str:
    """Notes text: at most NOTES_LIMIT printable characters (line breaks and tabs allowed)."""
    if not isinstance(notes, str):
        raise TypeError(f"notes: expected a str, got {type(notes).__name__}")
    if len(notes) > NOTES_LIMIT or not notes.replace("\n", "").replace("\t", "").replace("\r", "").isprintable():
        raise ValueError(f"notes: expected at most {NOTES_LIMIT} printable characters, got {len(notes)} characters")
    return notes.strip()


def _md(text: str) -> str:
    """``text`` shown literally in Markdown (no emphasis, no HTML)."""
    return re.sub(r"([\\`*_{}\[\]<>#|])", r"\\\1", text)


def _file_name(name: str) -> str:
    return re.sub(r"[^\w.-]+", "_", name).strip("._")[:40] or "run"


def _delete_when_ended(store: RunStore, run, timeout: float, gave_up) -> None:
    """A deleted run of this page that was still training: delete it from the store once it has
    ended; ``gave_up()`` when it did not end within ``timeout`` seconds (it stays in the store)."""
    if not run.join(timeout):
        log.warning("qatlab: run %s did not stop within %.0f s; it was not deleted", run.id, timeout)
        gave_up()
        return
    try:
        store.delete(run.id)
    except KeyError:
        pass
    except Exception:
        log.exception("qatlab: deleting run %s failed", run.id)


class RunsTable(LiveView):
    """The store's runs, overlay of the selected ones, downloads and run management.

    Args:
        store: the :class:`~qatlab.store.RunStore` listed.
        live_runs: ``() -> list`` of the runs this process holds (RemoteRuns: ``id name status
            steps_done total_steps done stop() log config``), or None.
        on_show: called with a run (the live one, else a StoredRun) by ``Show in overview``.
        on_load_config: called with an ExperimentConfig by ``Load config into sidebar``.
        owner: the page's owner id (its runs are the ones it may change while they run).
    """

    def __init__(self, store: RunStore, live_runs=None, on_show=None, on_load_config=None, owner=None,
                 hub=None, options=None, lazy: bool = False, **params):
        if not isinstance(store, RunStore):
            raise TypeError(f"store: expected a qatlab RunStore, got {type(store).__name__}")
        for label, fn in (("live_runs", live_runs), ("on_show", on_show), ("on_load_config", on_load_config)):
            if fn is not None and not callable(fn):
                raise TypeError(f"{label}: expected a callable or None, got {type(fn).__name__}")
        super().__init__(hub, options, lazy, **params)
        self.store, self.owner = store, owner
        self.live_runs = live_runs or (lambda: [])
        self.on_show, self.on_load_config = on_show, on_load_config
        self._pending = None           # (ids, action, what) waiting for Confirm
        self.figures: dict = {}
        self._shown: list = []         # run-likes overlaid now
        self._stored: dict[str, StoredRun] = {}   # stored runs read for the current selection
        self._entries: dict[str, Listed] = {}     # every listed run, newest first
        self._raw = None               # the last listing read
        self._ids: list[str] = []      # the table's rows (filtered), in order
        self._shown_rows: list[dict] = []
        self._entry_cache: dict[str, tuple] = {}   # run id -> (raw listing row, Listed)
        self._row_cache: dict[str, tuple] = {}     # run id -> (Listed, table row) of runs not live here
        self._selected: list[str] = []
        self._deleting: set[str] = set()
        self._last_key = None
        self._syncing = False          # the table's value or selection is being set here
        self._next_refresh = self._next_interrupted_check = 0.0
        self.refresh_seconds = 0.0     # how long the last refresh took
        self._store_error: str | None = None
        self._holder = pn.Column(sizing_mode="stretch_width")   # the tab's content, once built
        self._built = False
        if not lazy:
            self.build()

    def build(self) -> None:
        """Make the widgets and read the store (a lazy view does it when first shown: a page opens
        without them)."""
        if self._built:
            return
        self._built = True
        self._build_widgets()
        self._holder.objects = [self._layout]
        self.refresh(force=True)
        self.request_rebuild()

    def set_active(self, active: bool) -> None:
        if active:
            self.build()
        super().set_active(active)

    def _build_widgets(self) -> None:
        self.table = pn.widgets.Tabulator(frame([]), css_classes=["qatlab-runs-table"], selectable="checkbox",
                                          disabled=True, show_index=False, sizing_mode="stretch_width", height=300,
                                          formatters={"progress": {"type": "progress", "max": 1}})
        self.filter_input = pn.widgets.TextInput(label="Filter", placeholder="name, notes, status, dataset, STE, ...",
                                                 width=320)
        self.csv_download = pn.widgets.FileDownload(callback=self._csv_file, filename="qatlab-runs.csv",
                                                    label="Download CSV", embed=False)
        self.json_download = pn.widgets.FileDownload(callback=self._json_file, filename="qatlab-configs.json",
                                                     label="Download configs (JSON)", embed=False)
        self.model_download = pn.widgets.FileDownload(callback=self._model_file, filename="qatlab-model.npz",
                                                      label="Download model", embed=False, disabled=True)
        self.show_button = pn.widgets.Button(label="Show in overview", disabled=True)
        self.load_button = pn.widgets.Button(label="Load config into sidebar", disabled=True)
        self.stop_button = pn.widgets.Button(label="Stop selected", color="warning", disabled=True)
        self.name_input = pn.widgets.TextInput(label="New name", placeholder="name of the selected run",
                                               max_length=NAME_LIMIT, width=200)
        self.rename_button = pn.widgets.Button(label="Rename", disabled=True, align="end")
        self.notes_input = pn.widgets.TextAreaInput(label="Notes", placeholder="notes of the selected run",
                                                    max_length=NOTES_LIMIT, width=320, height=60)
        self.notes_button = pn.widgets.Button(label="Save notes", disabled=True, align="end")
        self.delete_button = pn.widgets.Button(label="Delete selected", color="danger", disabled=True, align="end")
        self.confirm_text = pn.pane.Markdown("", margin=(5, 10))
        self.confirm_button = pn.widgets.Button(label="Confirm", color="danger")
        self.cancel_button = pn.widgets.Button(label="Cancel")
        self.confirm_row = pn.Row(self.confirm_text, self.confirm_button, self.cancel_button, visible=False,
                                  css_classes=["qatlab-runs-confirm"])
        self.message = pn.pane.Alert("", alert_type="warning", visible=False, css_classes=["qatlab-runs-message"],
                                     sizing_mode="stretch_width", margin=(5, 10), renderer_options=NO_AUTOLINKS)
        self.show_button.on_click(self._show)
        self.load_button.on_click(lambda _: self.load_selected_config())
        self.stop_button.on_click(lambda _: self.stop_selected())
        self.rename_button.on_click(lambda _: self.rename_selected(self.name_input.value))
        self.notes_button.on_click(lambda _: self.save_notes(self.notes_input.value))
        self.delete_button.on_click(lambda _: self.delete_selected())
        self.confirm_button.on_click(lambda _: self.confirm())
        self.cancel_button.on_click(lambda _: self.cancel())
        self.filter_input.param.watch(lambda *_: self.refresh(force=True), ["value", "value_input"])  # (1 or 2 events)
        self.table.param.watch(self._on_selection, "selection")
        self._plots = pn.Column(sizing_mode="stretch_width")
        self._layout = pn.Column(
            pn.pane.Markdown("Every run of the run store: this server's, earlier servers', notebooks' and the "
                             "command line's. Tick rows to overlay them; downloads use the selection (every "
                             "shown run when nothing is selected). Runs of other pages, notebooks and the "
                             "command line are read-only while they run.", margin=(5, 10)),
            self.filter_input, self.table,
            pn.Row(self.csv_download, self.json_download, self.model_download, self.show_button, self.load_button,
                   self.stop_button),
            pn.Row(self.name_input, self.rename_button, self.notes_input, self.notes_button, self.delete_button),
            self.confirm_row, self.message,
            self._plots, sizing_mode="stretch_width")

    # ------------------------------------------------------------ selection
    def _on_selection(self, _event=None) -> None:
        if self._syncing:
            return
        ids = [self._ids[i] for i in sorted(self.table.selection) if 0 <= i < len(self._ids)]
        if ids != self._selected:
            self._selected = ids
            self._selection_changed()

    def _selection_changed(self) -> None:
        self.cancel()
        entries = self.selected_entries()
        if len(entries) == 1:
            self.notes_input.value = entries[0].notes
            self.model_download.filename = f"qatlab-model-{_file_name(entries[0].name)}-{entries[0].id[:8]}.npz"
        self._update_buttons()
        self.request_rebuild()

    def selected_ids(self) -> list[str]:
        """Ids of the ticked rows, in table order."""
        return list(self._selected)

    def selected_entries(self) -> list[Listed]:
        """The ticked runs' listing entries, in table order."""
        return [self._entries[i] for i in self._selected if i in self._entries]

    def _live(self) -> dict:
        return {r.id: r for r in self.live_runs() if getattr(r, "id", None)}

    def run_like(self, run_id: str):
        """The live run of ``run_id`` if this process holds one, else its :class:`StoredRun` (read
        once per selection); ``KeyError`` / ``ValueError`` if the store cannot give it."""
        live = self._live().get(run_id)
        if live is not None:
            return live
        stored = self._stored.get(run_id)
        if stored is None:
            stored = self._stored[run_id] = StoredRun(self.store, run_id)
        return stored

    def selected_runs(self) -> list:
        """Run-likes of the ticked rows (:meth:`run_like`), skipping runs the store no longer has."""
        out = []
        for rid in self._selected:
            try:
                out.append(self.run_like(rid))
            except (KeyError, ValueError) as exc:
                self._say(_md(scrub_paths(str(exc))))
        return out

    def _chosen(self) -> list[Listed]:
        return self.selected_entries() or [self._entries[i] for i in self._ids if i in self._entries]

    # ------------------------------------------------------------ downloads, show, load
    def _csv_file(self):
        items = []
        for entry in self._chosen():
            try:
                items.append((entry.id, entry.name, self.store.history(entry.id)))
            except KeyError:          # deleted meanwhile
                continue
        return io.StringIO(history_csv(items))

    def _json_file(self):
        return io.StringIO(configs_json(self._chosen()))

    def _model_file(self):
        entries = self.selected_entries()
        if len(entries) != 1 or not entries[0].has_model:
            self._say("Select one run that has a stored model.")
            return io.BytesIO(b"")
        try:
            return io.BytesIO(model_npz(self.store, entries[0]))
        except (KeyError, ValueError) as exc:
            self._say(_md(scrub_paths(str(exc))))
            return io.BytesIO(b"")

    def _show(self, _event=None) -> None:
        runs = self.selected_runs()
        if runs and self.on_show is not None:
            self.on_show(runs[0])

    def load_selected_config(self) -> bool:
        """``Load config into sidebar``: pass the one selected run's config to ``on_load_config``."""
        from ..config import ExperimentConfig
        entries = self.selected_entries()
        if len(entries) != 1:
            self._say("Select one run to load its config.")
            return False
        try:
            cfg = ExperimentConfig.from_dict(copy.deepcopy(entries[0].config_dict))   # (the listing's dict is shared)
        except (TypeError, ValueError) as exc:
            self._say(f"The config of {entries[0].id[:8]} cannot be loaded: {_md(scrub_paths(str(exc)))}")
            return False
        if self.on_load_config is not None:
            self.on_load_config(cfg)
        self._say("")
        return True

    # ------------------------------------------------------------ changing runs (ownership: module doc)
    def _say(self, text: str, alert_type: str = "warning") -> None:
        self.message.object, self.message.alert_type, self.message.visible = text, alert_type, bool(text)

    def _status(self, entry: Listed, live: dict) -> str:
        run = live.get(entry.id)
        return run.status if run is not None else entry.status

    def _mine(self, entry: Listed) -> bool:
        return self.owner is not None and entry.page == self.owner

    def refusal(self, entry: Listed, what: str, live: dict | None = None) -> str | None:
        """Why this page may not ``what`` (stop, rename, notes, delete) the run now; None if it may."""
        live = self._live() if live is None else live
        active = self._status(entry, live) not in ENDED
        run = live.get(entry.id)
        if what == "stop":
            if run is not None and self._mine(entry) and not run.done:
                return None
            if not active:
                return "it has ended"
        elif not active:
            return None
        if not self._mine(entry):
            return "another page, a notebook or the command line started it, and it is read-only while running"
        if run is None and what in ("stop", "delete"):
            return "it is active but not trained by this server process"
        return None

    def _refused(self, entries: list[Listed], what: str, live: dict) -> str:
        reasons = {}
        for e in entries:
            reasons.setdefault(self.refusal(e, what, live), []).append(e.id[:8])
        return " ".join(f"Cannot {what} {', '.join(ids)}: {why}." for why, ids in reasons.items() if why)

    def _update_buttons(self) -> None:
        entries, live = self.selected_entries(), self._live()
        one = len(entries) == 1
        self.show_button.disabled = not entries
        self.load_button.disabled = not one
        self.model_download.disabled = not (one and entries[0].has_model)
        self.stop_button.disabled = not any(self.refusal(e, "stop", live) is None for e in entries)
        self.rename_button.disabled = not (one and self.refusal(entries[0], "rename", live) is None)
        self.notes_button.disabled = not (one and self.refusal(entries[0], "notes", live) is None)
        self.delete_button.disabled = not entries or any(self.refusal(e, "delete", live) for e in entries)

    def stop_selected(self) -> list:
        """``Stop selected``: stop the selected live runs this page started; returns them."""
        live = self._live()
        entries = [e for e in self.selected_entries() if self._status(e, live) not in ENDED]
        mine = [e for e in entries if self.refusal(e, "stop", live) is None]
        runs = [live[e.id] for e in mine]
        for run in runs:
            run.stop()
        refused = [e for e in entries if e not in mine]
        self._say(self._refused(refused, "stop", live) if refused else "")
        return runs

    def _one_changeable(self, what: str) -> Listed | None:
        entries = self.selected_entries()
        if len(entries) != 1:
            self._say(f"Select one run to {what}.")
            return None
        why = self.refusal(entries[0], what)
        if why:
            self._say(f"Cannot {what} {entries[0].id[:8]}: {why}.")
            return None
        return entries[0]

    def _change(self, entry: Listed, action, what: str, question: str) -> bool:
        """Apply now for this page's run; ask first for another page's (``question``: its ``{run}`` is
        replaced by the run's name, id and who started it)."""
        if self._mine(entry):
            return self._apply([entry.id], action, what)
        run = f"**{_md(entry.name)}** (`{entry.id[:8]}`, started by {started_by(entry.page, self.owner)})"
        self._ask(question.replace("{run}", run), [entry.id], action, what)
        return False

    def rename_selected(self, name: str) -> bool:
        """``Rename``: the one selected run gets ``name`` (validated); a run another page started
        waits for :meth:`confirm`. Returns True when renamed now."""
        entry = self._one_changeable("rename")
        if entry is None:
            return False
        try:
            new = checked_name(name)
        except (TypeError, ValueError) as exc:
            self._say(_md(str(exc)))
            return False

        def action():
            self.store.rename(entry.id, new)
            run = self._live().get(entry.id)
            if run is not None:
                run.name = new
        return self._change(entry, action, "rename", "Rename {run} to **" + _md(new) + "**?")

    def save_notes(self, notes: str) -> bool:
        """``Save notes``: the one selected run's notes become ``notes``; a run another page
        started waits for :meth:`confirm`. Returns True when saved now."""
        entry = self._one_changeable("notes")
        if entry is None:
            return False
        try:
            text = checked_notes(notes)
        except (TypeError, ValueError) as exc:
            self._say(_md(str(exc)))
            return False
        return self._change(entry, lambda: self.store.set_notes(entry.id, text), "notes", "Save the notes of {run}?")

    def delete_selected(self) -> None:
        """``Delete selected``: asks for :meth:`confirm`, then removes the runs from the store
        (a training run of this page is stopped first and deleted once it has ended)."""
        entries, live = self.selected_entries(), self._live()
        if not entries:
            self._say("Select the runs to delete.")
            return
        refused = [e for e in entries if self.refusal(e, "delete", live)]
        if refused:
            self._say(self._refused(refused, "delete", live))
            return
        ids = [e.id for e in entries]
        names = ", ".join(f"{_md(e.name)} (`{e.id[:8]}`)" for e in entries[:5]) + (" ..." if len(entries) > 5 else "")
        self._ask(f"Delete {len(ids)} run{'s' if len(ids) > 1 else ''} ({names}) with their metrics and models "
                  "from the run store?", ids, lambda: self._delete(ids), "delete")

    def _delete(self, ids: list[str]) -> None:
        live = self._live()
        for rid in ids:
            run = live.get(rid)
            if run is not None and not run.done:
                run.stop()
                self._deleting.add(rid)
                gave_up = (lambda r=rid: self._deleting.discard(r))     # (the table shows it again)
                threading.Thread(target=_delete_when_ended, args=(self.store, run, DELETE_JOIN_SECONDS, gave_up),
                                 name=f"qatlab-delete-{rid[:8]}", daemon=True).start()
                continue
            try:
                self.store.delete(rid)
            except KeyError:          # deleted by another page meanwhile
                pass
            self._stored.pop(rid, None)

    def _ask(self, text: str, ids: list[str], action, what: str) -> None:
        self._pending = (ids, action, what)
        self.confirm_text.object = text
        self.confirm_row.visible = True
        self._say("")

    def confirm(self) -> bool:
        """Carry out the action waiting for confirmation (checked again now); True if it was done."""
        if self._pending is None:
            return False
        ids, action, what = self._pending
        self.cancel()
        self.refresh(force=True)     # statuses as of now
        return self._apply(ids, action, what)

    def cancel(self) -> None:
        """Drop the action waiting for confirmation."""
        self._pending = None
        self.confirm_row.visible = False

    def _apply(self, ids: list[str], action, what: str) -> bool:
        live = self._live()
        entries = [self._entries[i] for i in ids if i in self._entries]
        if len(entries) < len(ids):
            self._say("The run was deleted meanwhile." if len(ids) == 1 else "Some of the runs were deleted meanwhile.")
            return False
        refused = [e for e in entries if self.refusal(e, what, live)]
        if refused:    # checked again at the moment of the change
            self._say(self._refused(refused, what, live))
            return False
        try:
            action()
        except (TypeError, ValueError, KeyError, StoreLockedError) as exc:
            self._say(_md(scrub_paths(str(exc).strip("'\""))))
            return False
        self._say("")
        if what == "delete":
            self.table.selection = []
        self.refresh(force=True)
        return True

    # ------------------------------------------------------------ refresh
    def _check_interrupted(self, now: float) -> None:
        """Now and then: mark runs whose owner process died as interrupted (the store does it on opening)."""
        if now < self._next_interrupted_check:
            return
        self._next_interrupted_check = now + INTERRUPTED_EVERY
        try:
            self.store.mark_interrupted()
        except (StoreLockedError, ValueError) as exc:
            log.warning("qatlab: checking for interrupted runs failed: %s", exc)

    def refresh(self, force: bool = False) -> None:
        """Re-read the store's listing into the table, at most once per second (unless ``force``)
        and only if something changed (a listing row, a live run's progress, the filter)."""
        now = time.monotonic()
        if not self._built or (now < self._next_refresh and not force):
            return
        self._next_refresh = now + TABLE_PERIOD
        start = time.perf_counter()
        self._check_interrupted(now)
        try:
            raw = self.store.listing()
        except (StoreLockedError, ValueError) as exc:
            log.warning("qatlab: reading the run store failed: %s", exc)
            self._store_error = f"The run store cannot be read now: {_md(scrub_paths(str(exc)))}"
            self._say(self._store_error)
            return
        if self._store_error is not None:       # readable again
            if self.message.object == self._store_error:
                self._say("")
            self._store_error = None
        live = self._live()
        text = (self.filter_input.value_input or "").strip().lower()
        live_key = tuple((rid, r.status, r.steps_done, r.total_steps, int(getattr(r, "elapsed", 0.0)))
                         for rid, r in live.items())
        key = (raw, live_key, text, frozenset(self._deleting))
        if key == self._last_key:
            self.refresh_seconds = time.perf_counter() - start
            return
        self._last_key = key
        if raw != self._raw:
            self._raw = raw
            self._entries = {row[0]: self._entry(row) for row in raw}
            self._deleting &= set(self._entries)
        self._show_rows(self._rows(live, text))
        self._update_buttons()     # statuses changed: an ended run of another page becomes changeable
        self.refresh_seconds = time.perf_counter() - start

    def _entry(self, raw: tuple) -> Listed:
        """The listing entry of a raw row (the previous one while the run's row is unchanged)."""
        cached = self._entry_cache.get(raw[0])
        if cached is None or cached[0] != raw:
            cached = self._entry_cache[raw[0]] = (raw, Listed.from_row(raw))
        return cached[1]

    def _rows(self, live: dict, text: str) -> list[dict]:
        """The table rows to show: every listed run not being deleted whose row matches the filter
        ``text``; a stored run's row is computed again only when its listing entry changed."""
        rows = []
        for entry in self._entries.values():
            if entry.id in self._deleting:
                continue
            run = live.get(entry.id)
            if run is None:
                cached = self._row_cache.get(entry.id)
                if cached is None or cached[0] is not entry:
                    cached = self._row_cache[entry.id] = (entry, table_row(entry, None, self.owner))
                row = cached[1]
            else:
                row = table_row(entry, run, self.owner)
            if matches(row, text):
                rows.append(row)
        if len(self._row_cache) > 2 * len(self._entries) + 100:     # deleted runs' rows
            self._row_cache = {k: v for k, v in self._row_cache.items() if k in self._entries}
            self._entry_cache = {k: v for k, v in self._entry_cache.items() if k in self._entries}
        return rows

    def _show_rows(self, rows: list[dict]) -> None:
        ids = [r["id"] for r in rows]
        if ids == self._ids:                # the same runs in the same order: patch the cells that changed
            patch: dict[str, list] = {}
            for i, (new, old) in enumerate(zip(rows, self._shown_rows)):
                if new is not old:
                    for col in COLUMNS:
                        if not same(new[col], old[col]):
                            patch.setdefault(col, []).append((i, new[col]))
            self._shown_rows = rows
            if patch:
                self.table.patch(patch)
            return
        selected = [rid for rid in self._selected if rid in ids]
        self._syncing = True
        try:
            self.table.value = frame(rows)
            self._ids, self._shown_rows = ids, rows
            self.table.selection = [ids.index(rid) for rid in selected]
        finally:
            self._syncing = False
        if selected != self._selected:     # a selected run was deleted or filtered out
            self._selected = selected
            self._selection_changed()

    def rebuild(self) -> None:
        """Overlay figures of the selected runs."""
        if not self._built:
            return
        for rid in [r for r in self._stored if r not in self._selected]:    # deselected: free their history
            stored = self._stored.pop(rid)
            if rid in self.hub and self.hub.stream(stored).run is stored:
                self.hub.drop(rid)
        runs = self.selected_runs()
        self.figures, self._shown = {}, runs
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
        return list(self._shown) if self.figures else []

    def _panel(self):
        return self._holder
