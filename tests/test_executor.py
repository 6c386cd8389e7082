"""The Dask executor: RemoteRun on LocalClusters of worker processes (rows, control, results, lost workers)."""
from __future__ import annotations

import os
import signal
import sys
import sqlite3
import time

import numpy as np
import pytest

import qatlab as ql
from qatlab.executor import RemoteRun, connect, local_cluster
from qatlab.executor.cluster import LOCAL_NICE
from qatlab.executor.worker import check_data_here, topic

TIME_COLUMNS = ("time", "steps_per_second")          # wall-clock columns: differ run to run
TIME_FINALS = ("seconds", "steps_per_second", "train_seconds")
JOIN = 300.0     # seconds a test waits for a run (the machine may be shared and busy)


def wait_for(predicate, timeout: float, what: str, every: float = 0.05):
    """Poll ``predicate`` until it returns a truthy value (returned) or fail after ``timeout`` s."""
    deadline = time.monotonic() + timeout
    while True:
        value = predicate()
        if value:
            return value
        if time.monotonic() > deadline:
            pytest.fail(f"timed out after {timeout:.0f} s waiting for {what}")
        time.sleep(every)


def config(epochs: int = 40, seed: int = 0, hidden=(256,)) -> ql.ExperimentConfig:
    cfg = ql.ExperimentConfig()
    cfg.optim.epochs, cfg.optim.seed, cfg.model.hidden = epochs, seed, list(hidden)
    return cfg


@pytest.fixture
def store(tmp_path):
    with ql.RunStore(tmp_path / "runs.sqlite") as s:
        yield s


def _stop_all(runs) -> None:
    for run in runs:
        run.stop()
    for run in runs:
        assert run.join(JOIN), f"{run} did not end after stop()"


# ---------------------------------------------------------------------------------------- no cluster


class _NoClient:
    """A client that must not be used (the run is refused before anything is submitted)."""

    def submit(self, *args, **kwargs):
        raise AssertionError("submitted")


def test_remote_run_refuses_bad_arguments(store):
    with pytest.raises(TypeError, match="config"):
        RemoteRun({"optim": {}})
    with pytest.raises(TypeError, match="store"):
        RemoteRun(config(), store="runs.sqlite")
    with pytest.raises(TypeError, match="client"):
        RemoteRun(config(), client="tcp://127.0.0.1:8786")
    with pytest.raises(TypeError, match="keep_alive"):
        RemoteRun(config(), keep_alive="yes")
    with pytest.raises(TypeError, match="weights: expected a bool"):
        RemoteRun(config(), weights="no")
    with pytest.raises(TypeError, match="on_task_end"):
        RemoteRun(config(), on_task_end="soon")
    with pytest.raises(ValueError, match="name"):
        RemoteRun(config(), name="<b>")


def test_stopped_before_start_never_submits(store):
    run = RemoteRun(config(), store=store, client=_NoClient())
    run.stop()
    assert run.status == "stopped" and run.done and run.join(0)
    assert run.start() is run and run.status == "stopped"
    assert store.runs() == []


def test_memory_estimate_refused_before_anything_is_created(store, monkeypatch):
    monkeypatch.setenv("QATLAB_MEMORY_BUDGET", "1K")
    run = RemoteRun(config(), store=store, client=_NoClient())
    with pytest.raises(ValueError, match="over the budget"):
        run.start()
    assert store.runs() == [] and run.id is None and run.status == "created"


def test_connect_refuses_bad_addresses(monkeypatch):
    monkeypatch.delenv("QATLAB_SCHEDULER", raising=False)
    with pytest.raises(ValueError, match="address"):
        connect("127.0.0.1:8786")
    with pytest.raises(ValueError, match="address"):
        connect(8786)
    with pytest.raises(ValueError, match="n_workers"):
        connect("tcp://127.0.0.1:8786", n_workers=2)
    with pytest.raises(ValueError, match="n_workers"):
        local_cluster(0)
    monkeypatch.setenv("QATLAB_SCHEDULER", "localhost")
    with pytest.raises(ValueError, match="address"):
        connect()


def test_data_path_must_exist_on_the_worker(tmp_path):
    missing = str(tmp_path / "nope.npz")
    cfg = config()
    cfg.data.dataset, cfg.data.path = "file", missing
    with pytest.raises(ValueError, match="nope.npz.*worker tcp://w:1"):
        check_data_here(cfg.data, "worker tcp://w:1")
    cfg.data.dataset, cfg.data.path = "fashion_mnist", str(tmp_path / "none")
    with pytest.raises(ValueError, match="none.*worker"):
        check_data_here(cfg.data, "worker tcp://w:1")
    check_data_here(config().data, "worker tcp://w:1")     # shipped data: nothing to check


@pytest.mark.skipif(not hasattr(os, "SCHED_BATCH"), reason="Linux scheduling classes")
def test_lower_priority_applies_to_its_thread_and_the_threads_it_starts():
    """(On Linux nice and the scheduling class are per thread: the test's own thread keeps its own.)"""
    import threading

    from qatlab.executor.cluster import lower_priority

    def priority():
        return os.getpriority(os.PRIO_PROCESS, 0), os.sched_getscheduler(0)     # (this thread's)
    mine, seen = priority(), {}

    def child():
        seen["child"] = priority()

    def worker_thread():
        lower_priority(3)
        seen["own"] = priority()
        t = threading.Thread(target=child)
        t.start()
        t.join()

    t = threading.Thread(target=worker_thread)
    t.start()
    t.join()
    want = (min(mine[0] + 3, 19), os.SCHED_BATCH)
    assert seen == {"own": want, "child": want}
    assert priority() == mine


# ------------------------------------------------------------------------------- LocalCluster of 2


@pytest.mark.slow
def test_local_cluster_settings_reach_its_scheduler_and_workers(client2):
    """LOCAL_DASK_CONFIG holds on the scheduler (no retry, no work stealing, a slow tick) and in the
    worker processes (slow tick, psutil sampling and memory checks, no statistical profiler), not only where
    it was set."""
    import dask

    from qatlab.executor.cluster import LOCAL_DASK_CONFIG

    def scheduler_view(dask_scheduler):
        return dask_scheduler.allowed_failures, "stealing" in dask_scheduler.extensions, dask_scheduler._tick_interval

    assert client2.run_on_scheduler(scheduler_view) == (0, False, 0.5)
    keys = ("distributed.admin.tick.interval", "distributed.admin.system-monitor.interval",
            "distributed.worker.memory.monitor-interval", "distributed.admin.low-level-log-length",
            "distributed.worker.profile.enabled")
    seen = client2.run(lambda: [dask.config.get(k) for k in keys])
    assert len(seen) == 2
    assert all(values == [LOCAL_DASK_CONFIG[k] for k in keys] for values in seen.values())
    assert LOCAL_DASK_CONFIG["distributed.worker.profile.enabled"] is False
    profiling = client2.run(lambda dask_worker: "profile" in dask_worker.periodic_callbacks)
    assert profiling and not any(profiling.values())
    # the scheduler's own log keeps few records; a leaving client's events are dropped after a minute
    assert client2.run_on_scheduler(lambda dask_scheduler: dask_scheduler._deque_handler.deque.maxlen) == 100
    assert dask.config.get("distributed.scheduler.events-cleanup-delay") == "60s"


@pytest.mark.slow
def test_log_rows_bounds_the_history_kept_here_while_the_store_keeps_every_row(client2, store):
    cfg = config(epochs=3)
    cfg.metrics_every = 1
    with pytest.raises(ValueError, match="log_rows"):
        RemoteRun(cfg, store=store, client=client2, log_rows=8)
    run = RemoteRun(cfg, store=store, client=client2, log_rows=32).start()
    assert run.join(JOIN) and run.status == "finished"
    stored = store.history(run.id)
    kept = run.history()
    assert np.isfinite(stored["loss"]).sum() == run.total_steps > 64
    assert len(kept["row_id"]) <= 32
    steps = kept["step"][np.isfinite(kept["loss"])]
    assert steps[0] == stored["step"][0] and np.all(np.diff(steps) > 0)   # thinned, in order, from the start
    assert set(steps) <= set(stored["step"])


@pytest.mark.slow
def test_the_schedulers_stream_logs_keep_few_row_batches(client2, store):
    """Dask's streams log the messages they sent (for debugging); on the local cluster that log is
    short, so a long run logging every step does not pile its rows up in the scheduler's process."""
    cfg = config(epochs=2400)           # 55,200 rows in about 280 batches (the log's 10 messages may
    cfg.metrics_every = 1               # each carry a few batches when the client reads late)
    run = RemoteRun(cfg, store=store, client=client2).start()
    assert run.join(JOIN) and run.status == "finished"

    def rows_in_stream_logs(dask_scheduler):
        rows = 0
        for stream in dask_scheduler.client_comms.values():
            for payload in stream.recent_message_log:
                for msg in payload if isinstance(payload, list) else ():
                    event = msg.get("event") if isinstance(msg, dict) else None
                    if isinstance(event, tuple) and isinstance(event[1], dict):
                        rows += len(event[1].get("rows", ()))
        return rows

    assert run.steps_done == 2400 * 23
    assert client2.run_on_scheduler(rows_in_stream_logs) < run.steps_done / 2    # (Dask's default: all)


@pytest.mark.slow
def test_run_on_a_worker_streams_rows_and_matches_in_process(client2, store):
    cfg = config(epochs=600)    # ~2 s: still training when its first rows are seen, on a busy machine too
    assert all(client2.run(lambda: "qatlab" in sys.modules).values())     # WarmWorker imported it
    run = RemoteRun(cfg, name="remote", store=store, client=client2).start()
    assert run.id is not None and store.get(run.id).status in ("created", "running")
    # rows reach this process and the store while the run trains
    wait_for(lambda: store.get(run.id).n_rows > 0 and len(run.log) > 0, JOIN, "stored rows")
    assert not run.done and store.get(run.id).status == "running"
    assert run.log.meta["total_steps"] == run.total_steps > 0 and run.log.meta["config"] == cfg.to_dict()
    assert run.join(JOIN) and run.status == "finished", run.message
    left = client2.run_on_scheduler(lambda dask_scheduler, rid=run.id: [t for t in dask_scheduler._broker._topics if rid in t])
    assert left == []                       # the scheduler forgot the run's topics (rows, its Variables' removal) ...
    assert client2.get_events(topic(run.id)) == ()              # ... and its rows
    assert run.progress == 1.0 and run.elapsed > 0
    record = store.get(run.id)
    assert record.status == "finished" and record.worker == run.worker and run.worker.startswith("tcp://127.0.0.1")
    assert record.n_rows == len(run.log) > 100
    ref = ql.run_experiment(cfg)
    got, stored = run.history(), store.history(run.id)
    assert set(got) == set(ref.history)
    for key, column in ref.history.items():
        if key not in TIME_COLUMNS:
            assert np.array_equal(got[key], column, equal_nan=True), key
            assert np.array_equal(stored[key], column, equal_nan=True), key
    result = run.result()
    for key, value in ref.final.items():
        if key not in TIME_FINALS:
            assert result.final[key] == value or (np.isnan(value) and np.isnan(result.final[key])), key
    assert record.final["test_accuracy"] == ref.final["test_accuracy"]
    np.testing.assert_array_equal(result.model.flat_params(), ref.model.flat_params())
    np.testing.assert_array_equal(store.load_model(run.id).flat_params(), ref.model.flat_params())
    run.release()                            # the model leaves this process; the store keeps it
    assert run.result().model is None and run.result().final == result.final
    np.testing.assert_array_equal(store.load_model(run.id).flat_params(), ref.model.flat_params())
    lean = RemoteRun(config(epochs=2), store=store, client=client2, keep_model=False).start()
    assert lean.join(JOIN) and lean.status == "finished" and lean.result().model is None   # only the store has it
    assert store.load_model(lean.id).flat_params().size == ref.model.flat_params().size


@pytest.mark.slow
def test_large_layers_split_across_cores_match_in_process(client2, store):
    # 784 x 1024 ternary weights: matrix products in blocks (qatlab.runtime.parallel.dot) and the ternary scale's
    # sum in slices (parallel.sum_slices), whose blocks follow the shapes only, not the cores or Dask's threads
    cfg = config(epochs=1, hidden=(1024,))
    cfg.data.dataset = "mnist"
    run = RemoteRun(cfg, store=store, client=client2).start()
    assert run.join(JOIN) and run.status == "finished", run.message
    ref = ql.run_experiment(cfg)
    for key, column in ref.history.items():
        if key not in TIME_COLUMNS:
            assert np.array_equal(run.history()[key], column, equal_nan=True), key
    np.testing.assert_array_equal(run.result().model.flat_params(), ref.model.flat_params())


@pytest.mark.slow
def test_pause_resume_and_stop_reach_the_worker(client2, store):
    run = RemoteRun(config(epochs=5000), store=store, client=client2).start()
    try:
        wait_for(lambda: run.steps_done > 0, JOIN, "the first steps")
        run.pause()
        assert run.status == "paused"
        wait_for(lambda: store.get(run.id).status == "paused", 30, "the store's paused status")
        seen = {"steps": -1, "since": time.monotonic()}

        def settled():          # no new step for a second: the worker holds between steps
            if run.steps_done != seen["steps"]:
                seen["steps"], seen["since"] = run.steps_done, time.monotonic()
            return time.monotonic() - seen["since"] >= 1.0
        wait_for(settled, 60, "the paused run to stop stepping")
        held = run.steps_done
        run.resume()
        assert run.status == "running"
        wait_for(lambda: run.steps_done > held, 60, "steps after resume()")
        wait_for(lambda: store.get(run.id).status == "running", 30, "the store's running status")
    finally:
        run.stop()
    assert run.join(JOIN) and run.status == "stopped"
    assert run.message.startswith("stopped by request")
    record = store.get(run.id)
    assert record.status == "stopped" and record.n_rows == len(run.log) > 0
    assert run.steps_done < run.total_steps


@pytest.mark.slow
def test_a_store_locked_past_its_timeout_does_not_end_the_run(client2, tmp_path):
    store = ql.RunStore(tmp_path / "locked.sqlite", timeout=0.5)
    run = RemoteRun(config(epochs=5000), store=store, client=client2).start()
    try:
        wait_for(lambda: store.get(run.id).n_rows > 0, JOIN, "the first stored rows")
        other = sqlite3.connect(store.path, isolation_level=None)
        other.execute("BEGIN EXCLUSIVE")           # several of the store's timeouts
        time.sleep(3)
        other.execute("ROLLBACK")
        assert run.status == "running"
        held = store.get(run.id).n_rows
        wait_for(lambda: store.get(run.id).n_rows > held, 60, "rows stored again after the lock")
    finally:
        run.stop()
    assert run.join(JOIN) and run.status == "stopped", run.message
    record = store.get(run.id)
    assert record.status == "stopped" and record.n_rows == len(run.log)
    np.testing.assert_array_equal(store.history(run.id)["row_id"], np.arange(record.n_rows))   # none lost
    store.close()


@pytest.mark.slow
@pytest.mark.filterwarnings("ignore::RuntimeWarning")
def test_diverged_status_and_message_come_from_the_trainer(client2, store):
    cfg = ql.ExperimentConfig(data=ql.DataConfig(dataset="synthetic", n_samples=200, n_features=16, n_classes=3, seed=1),
                              model=ql.ModelConfig(hidden=[16]), quant=ql.QuantConfig(weights="float"),
                              optim=ql.OptimConfig(epochs=3, batch_size=32, optimizer="sgd", lr=1e3, loss="mse"),
                              metrics_every=1)
    run = RemoteRun(cfg, store=store, client=client2).start()
    assert run.join(JOIN) and run.status == "diverged"
    ref = ql.run_experiment(cfg)
    assert ref.status == "diverged" and run.message == ref.message and run.error is None
    record = store.get(run.id)
    assert record.status == "diverged" and record.message == ref.message and record.n_rows == len(run.log) > 0


@pytest.mark.slow
def test_a_run_whose_client_closed_stops_on_its_worker(client2, store):
    from distributed import Client
    owner = Client(client2.scheduler.address, set_as_default=False, timeout="60s")
    try:
        run = RemoteRun(config(epochs=5000), store=store, client=owner).start()
        wait_for(lambda: len(run.log) > 0, JOIN, "the run's first rows")
        run.pause()                  # (a paused run too must not hold the worker for nobody)
        wait_for(lambda: store.get(run.id).status == "paused", 30, "the paused status")
    finally:
        owner.close(timeout=30)

    def busy():
        return sum(client2.run(lambda dask_worker: len(dask_worker.state.executing)).values())
    wait_for(lambda: busy() == 0, 60, "the worker to drop the abandoned run", every=0.2)
    assert run.join(JOIN) and run.status == "stopped" and "client closed" in run.message
    assert store.get(run.id).status == "stopped"


@pytest.mark.slow
def test_missing_data_file_fails_naming_it(client2, store, tmp_path):
    cfg = config()
    cfg.data.dataset, cfg.data.path = "file", str(tmp_path / "absent.npz")
    run = RemoteRun(cfg, store=store, client=client2).start()     # (not readable here: the worker decides)
    assert run.join(JOIN) and run.status == "failed"
    assert isinstance(run.error, ValueError) and "absent.npz" in run.message and "worker" in run.message
    record = store.get(run.id)
    assert record.status == "failed" and "absent.npz" in record.message


@pytest.mark.slow
def test_stop_of_a_queued_run_cancels_it(client2, store):
    busy = [RemoteRun(config(epochs=5000, seed=s), store=store, client=client2).start() for s in (0, 1)]
    queued = RemoteRun(config(), name="queued", store=store, client=client2)
    try:
        wait_for(lambda: all(r.status == "running" for r in busy), JOIN, "both workers busy")
        queued.start()
        assert queued.status == "created" and store.get(queued.id).status == "created"
        queued.stop()
        assert queued.join(JOIN) and queued.status == "stopped"
        assert queued.message == "stopped before it started" and queued.worker is None
        assert store.get(queued.id).status == "stopped" and store.get(queued.id).n_rows == 0
    finally:
        _stop_all(busy)


@pytest.mark.slow
def test_prepare_creates_the_run_and_start_only_submits_it(client2, store):
    run = RemoteRun(config(epochs=2), name="ready", store=store, client=client2, weights=False)
    assert run.prepare() is run and run.status == "created" and run.task_ended and not run.join(0)
    assert store.get(run.id).status == "created"
    with pytest.raises(RuntimeError, match="already prepared"):
        run.prepare()
    assert run.start() is run and run.join(JOIN) and run.status == "finished"
    assert run.task_ended and store.get(run.id).status == "finished"
    assert run.weight_snapshot() is None           # (weights=False: the worker published none)
    with pytest.raises(RuntimeError, match="already started"):
        run.start()


@pytest.mark.slow
def test_a_prepared_run_stopped_before_start_is_stored_stopped_and_forgotten(client2, store):
    from distributed import Variable

    from qatlab.executor.worker import control_name
    run = RemoteRun(config(), store=store, client=client2).prepare()
    assert Variable(control_name(run.id), client=client2).get(timeout=5) == "run"
    run.stop()
    assert run.done and run.join(0) and run.message == "stopped before it started"
    assert store.get(run.id).status == "stopped"

    def control_gone() -> bool:                # (Variable.delete reaches the scheduler a moment later)
        try:
            Variable(control_name(run.id), client=client2).get(timeout=0.2)
        except Exception:
            return True
        return False

    wait_for(control_gone, 30, "the control Variable to be deleted")
    assert run.start() is run and run.status == "stopped" and run.worker is None


@pytest.mark.slow
def test_the_scheduler_lets_go_of_the_rows_the_client_has(client2, store):
    from qatlab.executor.remote import DROP_ROWS
    cfg = config(epochs=5000, hidden=(16,))
    cfg.metrics_every = 1
    run = RemoteRun(cfg, store=store, client=client2).start()
    try:
        wait_for(lambda: len(run.log) > 3 * DROP_ROWS, JOIN, "rows")
        held = [m for _, m in client2.get_events(topic(run.id))]
        held_rows = sum(len(m["rows"]) for m in held if m.get("kind") == "rows")
        assert held_rows < 2 * DROP_ROWS < len(run.log)
        assert [m["kind"] for m in held if m.get("kind") == "start"] == ["start"]
    finally:
        _stop_all([run])
    assert len(store.history(run.id)["step"]) == len(run.log)


@pytest.mark.slow
def test_an_ended_run_is_freed_once_nothing_holds_it(client2, store):
    """Dask's client keeps every topic handler it was given (unsubscribe_topic does not drop it):
    the run's must not keep the run, its rows and its model alive in a long-lived server."""
    import gc
    import weakref
    run = RemoteRun(config(epochs=2), store=store, client=client2).start()
    assert run.join(JOIN) and run.status == "finished"
    ref = weakref.ref(run)
    del run
    wait_for(lambda: gc.collect() >= 0 and ref() is None, 30, "the ended run to be freed")


@pytest.mark.slow
def test_on_task_end_is_called_once_the_worker_slot_is_free(client2, store):
    import threading
    freed = threading.Event()
    run = RemoteRun(config(epochs=2), store=store, client=client2, on_task_end=freed.set).start()
    assert freed.wait(JOIN) and run.task_ended
    assert run.join(JOIN) and run.status == "finished"
    with pytest.raises(TypeError, match="on_task_end"):
        RemoteRun(config(), on_task_end="soon")


# ------------------------------------------------------------------------------- LocalCluster of 4


@pytest.mark.slow
def test_four_runs_progress_together(client4, store):
    runs = [RemoteRun(config(epochs=400, seed=s), name=f"seed {s}", store=store, client=client4).start()
            for s in range(4)]
    try:
        wait_for(lambda: all(len(r.log) > 0 for r in runs) or any(r.done for r in runs), JOIN, "rows of every run")
        assert not any(r.done for r in runs), [r.status for r in runs]
        assert len({r.worker for r in runs}) == 4            # one worker process each
    finally:
        _stop_all(runs)
    assert all(store.get(r.id).n_rows > 0 for r in runs)


@pytest.mark.slow
def test_killed_worker_fails_its_run_and_the_others_finish(client4, store):
    victim = RemoteRun(config(epochs=5000), name="victim", store=store, client=client4).start()
    others = [RemoteRun(config(epochs=100, seed=s), store=store, client=client4).start() for s in (1, 2)]
    try:
        wait_for(lambda: victim.worker_pid and len(victim.log) > 0, JOIN, "the victim's first rows")
        wait_for(lambda: all(r.status == "running" or r.done for r in others), JOIN, "the other runs to start")
        os.kill(victim.worker_pid, signal.SIGKILL)
        assert victim.join(JOIN) and victim.status == "failed"
        assert victim.message.startswith("worker lost")
        for run in others:
            assert run.join(JOIN) and run.status == "finished", run.message
    finally:
        _stop_all([victim, *others])
    record = store.get(victim.id)
    assert record.status == "failed" and record.message.startswith("worker lost") and record.n_rows > 0
    assert [store.get(r.id).status for r in others] == ["finished", "finished"]


# ------------------------------------------------------------------------ the process-wide cluster


@pytest.mark.slow
def test_connect_starts_one_warm_local_cluster_and_shutdown_stops_its_runs(store, monkeypatch):
    monkeypatch.delenv("QATLAB_SCHEDULER", raising=False)
    client = connect(n_workers=2)
    try:
        assert connect() is client
        workers = client.scheduler_info(n_workers=-1)["workers"]
        assert len(workers) == 2 and all(a.startswith("tcp://127.0.0.1:") for a in workers)
        assert all(v["nthreads"] == 1 for v in workers.values())

        def warmed():
            from qatlab import warmup
            return warmup.wait(240) and warmup.status()[0] == 0 and "qatlab.train.trainer" in sys.modules
        assert all(client.run(warmed).values())
        # the tasks train at a lower priority than this process, as batch work (lower_priority)
        task_thread = client.submit(lambda: (os.getpriority(os.PRIO_PROCESS, 0), os.sched_getscheduler(0)),
                                    pure=False).result()
        assert task_thread == (min(os.getpriority(os.PRIO_PROCESS, 0) + LOCAL_NICE, 19), os.SCHED_BATCH)
        run = RemoteRun(config(epochs=5000), store=store).start()      # on connect()'s cluster
        wait_for(lambda: len(run.log) > 0, JOIN, "the run's first rows")
    finally:
        ql.shutdown()
    assert run.done and run.status == "stopped"
    assert store.get(run.id).status == "stopped"
