"""Pieces of the Dask task (qatlab.executor.worker) checked without a cluster."""
from __future__ import annotations

import time

import numpy as np
import pytest

from qatlab.executor import worker as worker_module
from qatlab.executor.worker import (SEND_SECONDS, WEIGHTS_POINTS, WorkerLost, _check_first_start, _Control, _RowLog,
                                    _Sender, drop_received_rows, pack_weights, unpack_weights)


class _Client:
    def __init__(self, events):
        self.events = events

    def get_events(self, topic):
        return self.events


def test_a_second_start_of_a_run_is_refused_as_worker_lost():
    _check_first_start(_Client([]), "r1")                                   # first start: nothing before
    _check_first_start(_Client([(0.0, {"kind": "rows", "seq": 0})]), "r1")  # rows alone do not count
    with pytest.raises(WorkerLost, match="worker lost: the run started on tcp://a:1"):
        _check_first_start(_Client([(0.0, {"kind": "start", "worker": "tcp://a:1"})]), "r1")


class _Worker:
    def __init__(self):
        self.sent = []

    def log_event(self, topic, msg):
        self.sent.append((topic, msg))


def test_runs_send_their_rows_in_the_same_slots_of_the_clock(monkeypatch):
    clock = [1000.0]
    monkeypatch.setattr(worker_module.time, "time", lambda: clock[0])
    senders = [_Sender(_Worker(), f"run-{i}") for i in range(2)]
    logs = [_RowLog(), _RowLog()]
    sends = [[], []]
    # run 0 reports every 7 ms, run 1 every 11 ms from 40 ms on: their batches leave in the same slots,
    # each within a report interval of its slot's start
    for ms in range(0, 1200):
        clock[0] = 1000.0 + ms / 1000
        for i, (every, offset) in enumerate(((7, 0), (11, 40))):
            if ms >= offset and (ms - offset) % every == 0:
                logs[i].append({"step": ms, "loss": 1.0})
                before = len(senders[i].worker.sent)
                senders[i].send(logs[i])
                if len(senders[i].worker.sent) > before:
                    slot = int(clock[0] // SEND_SECONDS)
                    assert ms == offset or clock[0] - slot * SEND_SECONDS < every / 1000
                    sends[i].append(slot)
    assert len(sends[0]) == len(set(sends[0])) >= 7           # at most one batch per slot
    assert sends[1] == sends[0]
    rows = [sum(len(m["rows"]) for _, m in s.worker.sent) for s in senders]
    assert rows == [s.sent for s in senders] and rows[0] == len(range(0, 1200, 7)) - len(logs[0].pending)


def test_weights_travel_as_float32_bytes_of_evenly_strided_positions():
    rng = np.random.default_rng(0)
    small = (rng.normal(size=(8, 5)), np.sign(rng.normal(size=(8, 5))))
    big = (rng.normal(size=(300, 200)).astype(np.float32), rng.normal(size=(300, 200)).astype(np.float32))
    packed = pack_weights({"layer0": small, "layer1": big})
    assert all(isinstance(b, bytes) for pair in packed.values() for b in pair)
    back = unpack_weights(packed)
    np.testing.assert_array_equal(back["layer0"][0], small[0].ravel().astype(np.float32))   # small: every weight
    np.testing.assert_array_equal(back["layer0"][1], small[1].ravel().astype(np.float32))
    stride = -(-big[0].size // WEIGHTS_POINTS)
    assert len(back["layer1"][0]) <= WEIGHTS_POINTS and stride > 1
    np.testing.assert_array_equal(back["layer1"][0], big[0].ravel()[::stride])               # big: the same positions
    np.testing.assert_array_equal(back["layer1"][1], big[1].ravel()[::stride])


class _Variable:
    def __init__(self, value):
        self.value, self.reads = value, 0

    def get(self, timeout=None):
        self.reads += 1
        return self.value


def test_control_reads_the_request_after_the_first_start_check_and_proceed_waits_for_it():
    import threading
    order, release = [], threading.Event()

    def first():
        release.wait(5)
        order.append("first")

    var = _Variable("stop")
    control = _Control(var, first)
    try:
        time.sleep(0.2)                             # deliberately lets time pass: the control thread waits
        assert var.reads == 0 and order == []       # nothing is read before the check is done
        release.set()
        assert control.proceed() is False and order == ["first"] and var.reads >= 1
    finally:
        control.close()


def test_control_raises_in_proceed_what_the_first_start_check_raised():
    def first():
        raise WorkerLost("worker lost: the run started on tcp://a:1, which died; it is not run twice")

    var = _Variable("run")
    control = _Control(var, first)
    try:
        with pytest.raises(WorkerLost, match="tcp://a:1"):
            control.proceed()
        assert var.reads == 0
    finally:
        control.close()


def test_received_row_batches_are_dropped_from_the_scheduler_and_other_events_kept():
    from collections import deque
    from types import SimpleNamespace

    def rows(seq, n):
        return (0.0, {"kind": "rows", "seq": seq, "rows": [{"step": seq + i} for i in range(n)]})

    events = deque([(0.0, {"kind": "start", "worker": "tcp://a:1"}), rows(0, 3), rows(3, 3),
                    (0.0, {"kind": "weights"}), rows(6, 3)])
    scheduler = SimpleNamespace(_broker=SimpleNamespace(_topics={"t": SimpleNamespace(events=events)}))
    drop_received_rows(scheduler, "t", received=5)          # the batch of rows 3-5 is not all received
    assert [(m["kind"], m.get("seq")) for _, m in events] == [("start", None), ("rows", 3), ("weights", None),
                                                              ("rows", 6)]
    drop_received_rows(scheduler, "absent", received=5)     # an unknown topic: nothing to do
