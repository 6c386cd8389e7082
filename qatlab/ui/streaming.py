"""The periodic pull: ``MetricsLog.since(cursor)`` -> ``ColumnDataSource.stream(batch, rollover=...)``.

Each session (browser tab or notebook) owns one :class:`StreamHub`. For every run
a view wants to show, the hub keeps one :class:`RunStream` holding that session's
four ColumnDataSources for the run:

``loss-source-<run id>``  (``RunStream.loss``)
    the training loss alone, streamed on every tick: ``step``, ``epoch``, ``time``, ``loss``,
    ``loss_s``, ``k`` (the loss curves use it).
``train-source-<run id>``  (``RunStream.train``)
    every training metric, streamed at most every :data:`DETAIL_EVERY`-th tick, on a tick that also
    streams loss rows (:meth:`StreamHub.tick`; the rows of the ticks between wait in the RunStream;
    a run that has ended streams them on the next tick): the browser applies each stream to every
    glyph drawn from the source and repaints its figure (the STE comparison's small multiples
    draw ~40 glyphs in four figures). Streaming them less often, and with the loss rows, cuts the
    browser's CPU use (on a small machine it shares the cores with the server and the training);
    a figure costs about the same per refresh whatever its point count.
    One row per logged training step: ``step``, ``epoch``, ``time``, ``loss``, ``lr``,
    ``steps_per_second``, ``active_grad_fraction``, per layer ``grad_norm_<i>``,
    ``noise_mse_<i>``, ``sqnr_db_<i>``, ``scale_<i>``, ``saturation_<i>``,
    ``frac_neg_<i>``, ``frac_zero_<i>``, ``frac_pos_<i>``, the phase columns
    (``phase``, ``backward_passes``, ``speedup_steps``, ``speedup_wall``, ``pred_error``,
    ``pred_cosine``, ``pred_gain``, ``full_len``, ``predict_len``) when phase training is on, ``k``
    (index of the row among all training rows), and an EMA-smoothed copy
    ``<column>_s`` of every column in :data:`SMOOTHED`.
``eval-source-<run id>``  (``RunStream.eval``)
    one row per epoch: ``step``, ``epoch``, ``time``, ``test_loss``, ``test_accuracy``,
    ``train_accuracy``, ``train_loss``; streamed with the training source (a short epoch ends
    several times a tick).
``phase-source-<run id>``  (``RunStream.phases``)
    one row per contiguous phase segment: ``left``/``right`` (steps), ``left_t``/``right_t``
    (seconds), ``phase`` (code), ``label``, ``color``.

Per tick :meth:`StreamHub.pull` asks each run's log only for the rows it has not
seen and calls ``stream`` at most once per source (``patch`` once for the open
phase segment). A run that is done and fully read costs one integer comparison.

Display decimation: a training or loss source holds at most :data:`DISPLAY_CAP` rows (1000,
TensorBoard's default number of points kept per scalar curve). Only every ``stride``-th training
row is streamed (``k % stride == 0``), the stride planned before the first row from the run's
planned rows (``total_steps // metrics_every + 1``, from its log's meta): ``ceil(planned / cap)``.
A run that logs more than planned overflows; then every other row is dropped
(``k % (2 * stride) == 0`` is kept), the source is resent whole, and the stride doubles. So the
whole history stays visible at bounded cost, like the MetricsLog's own thinning (the full log
stays in the run, up to ``MetricsLog.capacity`` rows, default 100k). Why plan: thinning as the
rows arrive would resend each source whole (a full training source is a few hundred KB of JSON)
at every doubling, and stream every row until the first one: megabytes in a comparison's first seconds.

Thread rule: the hub is touched only on the session's event loop (the periodic
callback or a widget callback). Runs append to their MetricsLogs from other threads (the Dask
client's, a LocalRun's training thread).
"""
from __future__ import annotations

import base64
import gzip
import math
import sys

import numpy as np
from bokeh.core.property.validation import validate
from bokeh.core.serialization import Serializer
from bokeh.models import ColumnDataSource

from ..metrics import EPOCH_COLUMNS, LAYER_METRICS, PHASE_COLUMNS, STEP_COLUMNS
from .figures import PHASE_COLORS, PHASE_NAMES

DISPLAY_CAP = 1000
#: The training and eval sources are streamed at most every DETAIL_EVERY-th tick (1 Hz), the loss sources on every tick.
DETAIL_EVERY = 10
EVAL_CAP = 10_000
PHASE_CAP = 5000

LOSS_COLUMNS = ("step", "epoch", "time", "loss", "loss_s", "k")
#: Column names (or prefixes ending in ``_``) that get an EMA-smoothed ``<name>_s`` copy.
SMOOTHED = ("loss", "grad_norm_", "noise_mse_", "sqnr_db_", "active_grad_fraction", "pred_error")


class InlineList(list):
    """One streamed column batch (numbers) that Bokeh serializes as a single float64 array,
    base64-encoded inside the JSON message (an encoder registered with Bokeh's Serializer for this
    type only; the browser decodes it to a Float64Array).

    Why not the alternatives: a plain list costs the server one Python call per number (Bokeh
    encodes it element by element: ~1400 calls a tick with four runs, the largest part of the
    tick in a profile); a numpy array costs the browser a binary frame pair per column, and the
    server a copy of the whole column (``np.append``) on every stream. A list subclass is
    extended in place in the source's list column.
    """


def _encode_inline(values: InlineList, serializer) -> dict:
    """Bokeh's inline ndarray form: base64 of a gzip stream (what BokehJS decodes), float64, stored
    uncompressed (compressing a few hundred numbers a tick costs more than it saves)."""
    data = np.asarray(values, dtype=np.float64)
    packed = base64.b64encode(gzip.compress(data.tobytes(), compresslevel=0, mtime=1)).decode("ascii")
    return {"type": "ndarray", "array": {"type": "bytes", "data": packed}, "shape": list(data.shape),
            "dtype": "float64", "order": sys.byteorder}


Serializer.register(InlineList, _encode_inline)


def _payload(columns: dict) -> dict:
    """Stream payload: numeric columns as :class:`InlineList`, string columns as plain lists."""
    return {k: (InlineList(v.tolist()) if isinstance(v, np.ndarray) else v) for k, v in columns.items()}


def _empty(columns) -> dict:
    """Source data with an empty list per column (each its own list: Bokeh extends them in place)."""
    return {c: [] for c in columns}


def n_layers_of(config) -> int:
    """Number of weight layers of the model an ExperimentConfig describes (a cnn's conv layers first)."""
    m = config.model
    return len(m.hidden) + 1 + (len(m.conv_channels) if m.architecture == "cnn" else 0)


def train_columns(config) -> list[str]:
    """Raw training columns a run of ``config`` logs (the source layout is fixed up front)."""
    cols = list(STEP_COLUMNS)
    for i in range(n_layers_of(config)):
        cols += [f"{m}_{i}" for m in LAYER_METRICS]
    if config.phase.enabled:
        cols += list(PHASE_COLUMNS)
    return cols


def is_smoothed(column: str) -> bool:
    """True for columns that get an ``_s`` (EMA) copy."""
    return any(column == s or (s.endswith("_") and column.startswith(s)) for s in SMOOTHED)


def ema(values: np.ndarray, weight: float, state: tuple[float, int] = (0.0, 0)):
    """Debiased exponential moving average, as TensorBoard's smoothing slider computes it.

    ``s_n = weight * s_{n-1} + (1 - weight) * x_n``, shown as ``s_n / (1 - weight**n)``;
    non-finite inputs give NaN and leave the state alone.

    Args:
        values: array (k,) of new values.
        weight: 0 (no smoothing) .. <1.
        state: ``(s, n)`` carried over from the previous call.

    Returns:
        (smoothed array (k,), new state).
    """
    out = np.full(len(values), np.nan)
    last, n = state
    if weight <= 0.0:
        finite = np.isfinite(values)
        out[finite] = values[finite]
        if finite.any():
            last, n = float(values[finite][-1]), n + int(finite.sum())
        return out, (last, n)
    keep = 1.0 - weight
    for j, x in enumerate(values.tolist()):
        if math.isfinite(x):
            last = weight * last + keep * x
            n += 1
            out[j] = last / (1.0 - weight ** n)
    return out, (last, n)


class _Capped:
    """A training-row source holding at most ``cap`` rows: beyond, every other row is dropped and
    only every ``stride``-th row (by ``k``) is streamed from then on (see the module doc)."""

    def __init__(self, source: ColumnDataSource, cap: int):
        self.source, self.cap, self.stride = source, cap, 1

    def plan(self, expected_rows: int) -> None:
        """Before the first row: stream every ``ceil(expected_rows / cap)``-th row from the start."""
        if not len(self.source.data["k"]):
            self.stride = max(self.stride, -(-int(expected_rows) // self.cap))

    def stream(self, rows: dict) -> None:
        ks = rows["k"]
        keep = ks % self.stride == 0
        while len(self.source.data["k"]) + int(keep.sum()) > self.cap:
            data = self.source.data
            mask = np.asarray(data["k"]) % (2 * self.stride) == 0
            self.source.data = {c: InlineList(np.asarray(v)[mask].tolist()) for c, v in data.items()}
            self.stride *= 2
            keep = ks % self.stride == 0
        if keep.any():
            self.source.stream(_payload({c: v[keep] for c, v in rows.items()}), rollover=self.cap)


def _joined(batches: list[dict]) -> dict:
    """One batch of the column dicts in ``batches`` (same keys), in order."""
    return batches[0] if len(batches) == 1 else {c: np.concatenate([b[c] for b in batches]) for c in batches[0]}


class RunStream:
    """One session's view of one run: cursor into the run's log and its four sources.

    Args:
        run: a LocalRun, RemoteRun or stored run (read only: ``log``, ``config``, ``id``, ``done``).
        smoothing: initial EMA weight (0..0.99).
        cap: most rows kept in the training and the loss source (each thinned 2:1 beyond).
    """

    def __init__(self, run, smoothing: float = 0.0, cap: int = DISPLAY_CAP):
        self.run = run
        self.smoothing = float(smoothing)
        self.columns = train_columns(run.config)
        self.smoothed = [c for c in self.columns if is_smoothed(c)]
        train = _empty([*self.columns, *(f"{c}_s" for c in self.smoothed), "k"])
        self.train = ColumnDataSource(train, name=f"train-source-{run.id}")
        self.loss = ColumnDataSource(_empty(LOSS_COLUMNS), name=f"loss-source-{run.id}")
        self._train_cap, self._loss_cap = _Capped(self.train, cap), _Capped(self.loss, cap)
        self._pending: list[dict] = []   # training rows read but not yet in self.train
        self._pending_eval: list[dict] = []   # eval rows read but not yet in self.eval
        self.eval = ColumnDataSource(_empty(EPOCH_COLUMNS), name=f"eval-source-{run.id}")
        self.phases = ColumnDataSource(_empty(["left", "right", "left_t", "right_t", "phase", "label", "color"]),
                                       name=f"phase-source-{run.id}")
        self.cursor = 0          # next MetricsLog row id to read
        self.k = 0               # training rows seen so far
        self._ema = {c: (0.0, 0) for c in self.smoothed}
        self._last_xy = (0.0, 0.0)   # (step, time) of the previous training row, for phase segments
        self._open_phase = None      # phase code of the last (open) segment in self.phases
        self.rows_seen = 0

    @property
    def exhausted(self) -> bool:
        """The run is done and every row it logged is in the sources."""
        return (self.run.done and self.cursor >= self.run.log.total_rows and not self._pending
                and not self._pending_eval)

    @property
    def stride(self) -> int:
        """The training source streams every stride-th training row (module doc)."""
        return self._train_cap.stride

    def pull(self, every_metric: bool = True) -> int:
        """:meth:`read` new rows, then :meth:`flush` the waiting ones with ``every_metric``.
        Returns the number of rows read."""
        n = self.read()
        self.flush(every_metric)
        return n

    def read(self) -> int:
        """Read new rows from the run's log: stream the loss rows at once and keep the training and
        eval rows for :meth:`flush`. Returns the number of rows read."""
        log = self.run.log
        if log.total_rows <= self.cursor:
            return 0
        batch, self.cursor = log.since(self.cursor)
        n = len(batch["row_id"])
        if n:
            self.rows_seen += n
            nan = np.full(n, np.nan)
            is_eval = np.isfinite(batch.get("test_loss", nan)) | np.isfinite(batch.get("test_accuracy", nan))
            if is_eval.any():
                self._pending_eval.append({c: batch.get(c, nan)[is_eval] for c in EPOCH_COLUMNS})
            train = ~is_eval
            if train.any():
                if self.k == 0:
                    self._plan_stride()
                rows = self._with_smoothing({c: batch.get(c, nan)[train] for c in self.columns})
                self._loss_cap.stream({c: rows[c] for c in LOSS_COLUMNS})
                self._pending.append(rows)
        return n

    def flush(self, every_metric: bool = True) -> None:
        """Stream the training and eval rows read so far (and phase segments), with ``every_metric``
        or once the run is done and read (its curves are complete when its status says so)."""
        if not (every_metric or (self.run.done and self.cursor >= self.run.log.total_rows)):
            return
        if self._pending_eval:
            self.eval.stream(_payload(_joined(self._pending_eval)), rollover=EVAL_CAP)
            self._pending_eval = []
        if self._pending:
            rows = _joined(self._pending)
            self._pending = []
            self._train_cap.stream(rows)
            if "phase" in rows:
                self._stream_phases(rows["step"], rows["time"], rows["phase"])

    def _plan_stride(self) -> None:
        """Plan both capped sources' stride from the run's planned training rows (module doc)."""
        total, every = self.run.log.meta.get("total_steps"), getattr(self.run.config, "metrics_every", 0)
        if total and every:
            for capped in (self._train_cap, self._loss_cap):
                capped.plan(total // every + 1)

    def _with_smoothing(self, rows: dict) -> dict:
        """rows plus their ``<column>_s`` (EMA) copies and ``k`` (training row index)."""
        m = len(rows["step"])
        for c in self.smoothed:
            rows[f"{c}_s"], self._ema[c] = ema(rows[c], self.smoothing, self._ema[c])
        rows["k"] = np.arange(self.k, self.k + m, dtype=np.float64)
        self.k += m
        return rows

    def _stream_phases(self, steps, times, phases) -> None:
        """Extend the open phase segment (patch) and stream the segments that begin in this batch."""
        new: list[list] = []
        extend = None
        prev_s, prev_t = self._last_xy
        for s, t, p in zip(steps.tolist(), times.tolist(), phases.tolist()):
            if not math.isfinite(p):
                continue
            p = int(p)
            current = new[-1][4] if new else self._open_phase
            if current == p:
                if new:
                    new[-1][1], new[-1][3] = s, t
                else:
                    extend = (s, t)
            else:
                new.append([prev_s, s, prev_t, t, p])
            prev_s, prev_t = s, t
        self._last_xy = (prev_s, prev_t)
        if extend is not None:
            last = len(self.phases.data["left"]) - 1
            if last >= 0:
                self.phases.patch({"right": [(last, extend[0])], "right_t": [(last, extend[1])]})
        if new:
            self._open_phase = new[-1][4]
            cols = np.array([row[:4] for row in new], dtype=np.float64)
            codes = [row[4] for row in new]
            self.phases.stream(_payload({"left": cols[:, 0], "right": cols[:, 1], "left_t": cols[:, 2],
                                         "right_t": cols[:, 3], "phase": np.array(codes, dtype=np.float64),
                                         "label": [PHASE_NAMES.get(c, str(c)) for c in codes],
                                         "color": [PHASE_COLORS.get(c, "#cccccc") for c in codes]}),
                               rollover=PHASE_CAP)

    def set_smoothing(self, weight: float) -> None:
        """Recompute every ``<column>_s`` over the displayed rows with a new EMA weight."""
        self.pull()                 # rows waiting for the training source join it first
        self.smoothing = float(weight)
        data = self.train.data
        patch = {}
        for c in self.smoothed:
            smoothed, self._ema[c] = ema(np.asarray(data[c], dtype=np.float64), self.smoothing)
            patch[f"{c}_s"] = InlineList(smoothed.tolist())
        if len(data["k"]):
            self.train.data.update(patch)
        loss = np.asarray(self.loss.data["loss"], dtype=np.float64)
        if len(loss):
            self.loss.data.update({"loss_s": InlineList(ema(loss, self.smoothing)[0].tolist())})

    def last(self, column: str, default: float = math.nan) -> float:
        """Latest finite value of a training or eval column among the displayed rows."""
        for src in (self.loss, self.train, self.eval):
            col = src.data.get(column)
            if col is not None and len(col):
                arr = np.asarray(col, dtype=np.float64)
                finite = np.flatnonzero(np.isfinite(arr))
                if len(finite):
                    return float(arr[finite[-1]])
        return default


class StreamHub:
    """All RunStreams of one session; :meth:`pull` is the body of the session's periodic callback.

    Args:
        smoothing: initial EMA weight applied to every stream.
        cap: display cap per training source.
    """

    def __init__(self, smoothing: float = 0.0, cap: int = DISPLAY_CAP):
        self.smoothing = float(smoothing)
        self.cap = cap
        self._streams: dict[str, RunStream] = {}
        self.ticks = 0
        self._flushed = -DETAIL_EVERY    # tick of the last pull that streamed every metric

    def stream(self, run) -> RunStream:
        """The RunStream of ``run`` (created, and filled with everything logged so far, on first use)."""
        rs = self._streams.get(run.id)
        if rs is None:
            rs = self._streams[run.id] = RunStream(run, self.smoothing, self.cap)
            with validate(False):
                rs.pull()
        return rs

    def __contains__(self, run_id: str) -> bool:
        return run_id in self._streams

    @property
    def streams(self) -> list[RunStream]:
        return list(self._streams.values())

    def pull(self, run_ids=None, every_metric: bool = True) -> int:
        """Stream new rows of every run (or only of ``run_ids``); returns the rows read.

        ``every_metric`` False streams only loss rows (the training and eval rows wait, see
        :meth:`RunStream.read`). Runs left out keep their cursor and catch up on a later pull.
        Bokeh's per-stream property validation (a full pass over every column) is skipped: the
        batches are built here from numpy columns of equal length.
        """
        return self._pull(run_ids, every_metric)

    def tick(self, run_ids=None) -> int:
        """One periodic tick: :meth:`pull` with every metric when :meth:`tick_is_full` and the tick
        reads rows (they arrive in batches several ticks apart, and a tick without them would make
        the browser repaint on its own), or when that is overdue by another :data:`DETAIL_EVERY`
        ticks (a paused run's last rows). Returns the rows read."""
        return self._pull(run_ids, None)

    def _pull(self, run_ids, every_metric: bool | None) -> int:
        with validate(False):
            pulled = [rs for rid, rs in list(self._streams.items())
                      if (run_ids is None or rid in run_ids) and not rs.exhausted]
            total = sum(rs.read() for rs in pulled)
            if every_metric is None:
                overdue = self.ticks - self._flushed >= 2 * DETAIL_EVERY
                every_metric = self.tick_is_full() and (total > 0 or overdue)
            if every_metric:
                self._flushed = self.ticks
            for rs in pulled:
                rs.flush(every_metric)
        self.ticks += 1
        return total

    def tick_is_full(self) -> bool:
        """Whether the training and eval rows are due (:data:`DETAIL_EVERY` ticks since they last went)."""
        return self.ticks - self._flushed >= DETAIL_EVERY

    def set_smoothing(self, weight: float) -> None:
        """Change the EMA weight of every stream (recomputes the smoothed columns)."""
        self.smoothing = float(weight)
        for rs in self._streams.values():
            rs.set_smoothing(weight)

    def drop(self, run_id: str) -> None:
        """Forget a run's stream (its sources are no longer updated)."""
        self._streams.pop(run_id, None)
