"""LocalRun (background thread): status transitions, stop/pause/resume/join, diverged and failed runs that
leave the process fine, weight snapshots, summary rows, the registry, run_experiment and compare_ste."""
from __future__ import annotations

import json
import logging
import re
import sys
import threading
import time
import traceback

import numpy as np
import pytest

import qatlab as ql
from qatlab.runs import (ACTIVE, DONE, KEEP_MODELS, MESSAGE_LIMIT, NAME_LIMIT, RunControl, all_runs,
                         delete_run, failure_message, get_run, release_ended)


def tiny(weights="float", epochs=3, **optim) -> ql.ExperimentConfig:
    """A run of a few dozen steps on a small synthetic task (well under a second)."""
    optim.setdefault("lr", 0.05)
    return ql.ExperimentConfig(
        data=ql.DataConfig(dataset="synthetic", n_samples=200, n_features=16, n_classes=3, seed=1),
        model=ql.ModelConfig(hidden=[16]),
        quant=ql.QuantConfig(weights=weights),
        optim=ql.OptimConfig(epochs=epochs, batch_size=32, **optim),
        metrics_every=1)


def endless(weights="ternary") -> ql.ExperimentConfig:
    """A run far too long to finish during a test; tests stop it."""
    return ql.ExperimentConfig(data=ql.DataConfig(dataset="digits"), model=ql.ModelConfig(hidden=[32]),
                               quant=ql.QuantConfig(weights=weights),
                               optim=ql.OptimConfig(epochs=100_000, batch_size=32), metrics_every=5)


def wait_for(pred, timeout=20.0, what="condition"):
    end = time.monotonic() + timeout
    while not pred():
        if time.monotonic() > end:
            raise AssertionError(f"timed out waiting for {what}")
        time.sleep(0.005)


class _ParkingFlag(threading.Event):
    """A run's ``running`` flag (RunControl._running) that also records when the training thread
    waited on it in vain: from then on the thread is parked at its checkpoint and takes no step
    until resumed or stopped."""

    def __init__(self):
        super().__init__()
        self.set()
        self.parked = threading.Event()

    def wait(self, timeout=None):
        running = super().wait(timeout)
        if not running:
            self.parked.set()
        return running


def watch_parking(run) -> threading.Event:
    """Set once ``run``'s training thread is parked by a pause (call before ``run.start()``)."""
    flag = _ParkingFlag()
    run._control._running = flag
    return flag.parked


@pytest.fixture
def stopper():
    """Collects runs a test starts and stops/joins whatever is still alive at teardown."""
    runs = []
    yield runs.append
    for run in runs:
        run.stop()
        run.join(20)


# ----------------------------------------------------------------------------- lifecycle

@pytest.mark.slow
def test_run_finishes_with_result_log_and_progress():
    run = ql.LocalRun(tiny(), name="tiny one")
    assert run.status == "created" and not run.done and run.progress == 0.0 and run.elapsed == 0.0
    assert run.join() is True                                  # never started: nothing to wait for
    assert run.start() is run
    assert run.status in ACTIVE + ("finished",)
    assert run.join(30) is True
    assert run.status == "finished" and run.done and run.message == ""
    assert run.progress == 1.0 and run.steps_done == run.total_steps == 3 * 5  # ceil(160 / 32) = 5 / epoch
    assert run.elapsed > 0 and run.steps_per_second > 0 and run.eta == 0.0
    res = run.result
    assert isinstance(res, ql.RunResult) and res.status == "finished"
    assert res.final["steps"] == 15 and np.isfinite(res.final["test_accuracy"])
    assert len(run.log) == 15 + 3                              # one row per step + one per epoch
    np.testing.assert_array_equal(res.history["loss"], run.log.columns()["loss"], strict=False)
    assert run.log.meta["config"] == run.config.to_dict() == res.config
    assert run.name == "tiny one" and "finished" in repr(run)


def test_run_snapshots_its_config():
    cfg = tiny()
    run = ql.LocalRun(cfg)
    cfg.optim.lr = 0.5
    cfg.model.hidden.append(3)
    assert run.config is not cfg and run.config.optim.lr == 0.05 and run.config.model.hidden == [16]


def test_run_rejects_bad_arguments_without_registering():
    n = len(all_runs())
    with pytest.raises(TypeError, match="config"):
        ql.LocalRun({"optim": {"lr": 0.1}})
    with pytest.raises(ValueError, match=r"DataConfig\.path"):
        ql.LocalRun(ql.ExperimentConfig(data=ql.DataConfig(dataset="file")))
    assert len(all_runs()) == n


@pytest.mark.slow
def test_start_twice_raises():
    run = ql.LocalRun(tiny(epochs=1)).start()
    with pytest.raises(RuntimeError, match="already started"):
        run.start()
    assert run.join(30) and run.status == "finished"


@pytest.mark.slow
def test_start_from_eight_threads_starts_one_training_thread(stopper):
    run = ql.LocalRun(endless())
    stopper(run)
    barrier = threading.Barrier(8)
    outcomes = []

    def go():
        barrier.wait()
        try:
            outcomes.append(run.start())
        except RuntimeError as exc:
            outcomes.append(exc)

    callers = [threading.Thread(target=go) for _ in range(8)]
    for t in callers:
        t.start()
    for t in callers:
        t.join(10)
    assert sum(o is run for o in outcomes) == 1
    assert sum(isinstance(o, RuntimeError) and "already started" in str(o) for o in outcomes) == 7
    assert [t.name for t in threading.enumerate()].count(run.id) == 1
    run.stop()
    assert run.join(20) and run.status == "stopped"


def test_registry_lists_runs_in_order_and_finds_them_by_id():
    a, b = ql.LocalRun(tiny()), ql.LocalRun(tiny())
    runs = all_runs()
    assert runs.index(a) < runs.index(b) and a.id != b.id
    assert get_run(a.id) is a and get_run(b.id) is b
    with pytest.raises(KeyError, match="run_id"):
        get_run("run-nope")
    assert a.name == a.id                                      # default name


@pytest.mark.slow
def test_summary_row():
    run = ql.LocalRun(tiny(weights="ternary")).start()
    run.join(30)
    row = run.summary()
    assert list(row) == ["id", "name", "status", "progress", "steps", "seconds", "train_loss", "test_loss",
                         "test_accuracy", "steps_per_second", "dataset", "hidden", "weights", "bits", "ste",
                         "optimizer", "lr", "epochs", "phase"]
    assert row["status"] == "finished" and row["progress"] == 1.0 and row["steps"] == 15
    assert row["dataset"] == "synthetic" and row["hidden"] == "16" and row["weights"] == "ternary"
    assert row["test_accuracy"] == run.result.final["test_accuracy"] and row["phase"] is False
    json.dumps(row)
    fresh = ql.LocalRun(tiny()).summary()
    assert fresh["status"] == "created" and np.isnan(fresh["test_accuracy"]) and fresh["steps"] == 0


@pytest.mark.slow
def test_weight_snapshot_appears_with_latent_and_quantized_copies(stopper):
    run = ql.LocalRun(endless("ternary"))
    stopper(run)
    assert run.weight_snapshot() is None
    run.start()
    wait_for(lambda: run.weight_snapshot() is not None, what="a weight snapshot")
    snap = run.weight_snapshot()
    assert sorted(snap) == ["layer0", "layer1"]
    latent, used = snap["layer0"]
    assert latent.shape == used.shape == (32, 64) and latent.dtype == used.dtype == np.float32
    assert len(np.unique(used)) <= 3 and not np.array_equal(latent, used)   # ternary alpha * {-1, 0, 1}
    assert snap["layer1"][0].shape == (10, 32)
    run.stop()
    assert run.join(20)


# ----------------------------------------------------------------------------- control

@pytest.mark.slow
def test_stop_ends_a_running_run(stopper):
    run = ql.LocalRun(endless())
    stopper(run)
    run.start()
    wait_for(lambda: run.steps_done > 5, what="steps")
    run.stop()
    assert run.join(20)
    assert run.status == "stopped" and run.done and "stopped" in run.message
    assert 0 < run.steps_done < run.total_steps
    assert run.result is not None and run.result.status == "stopped"
    assert len(run.log) > 0


def test_stop_before_start_stops_at_once_and_start_does_nothing():
    """E.g. a comparison's session closes before the page drew its figures: the runs must not
    stay "created" forever, nor start later."""
    run = ql.LocalRun(tiny())
    run.stop()
    assert run.status == "stopped" and run.message == "stopped before it started" and run.done
    assert run.start() is run and run.status == "stopped" and run._thread is None
    assert run.join(0) and run.steps_done == 0 and run.started_at is None


@pytest.mark.slow
def test_pause_holds_steps_and_resume_continues(stopper):
    run = ql.LocalRun(endless())
    stopper(run)
    parked = watch_parking(run)
    run.resume()                                               # no-op before start
    run.pause()
    assert run.status == "created"
    run.start()
    wait_for(lambda: run.steps_done > 3, what="steps")
    run.pause()
    assert run.status == "paused" and not run.done
    at_pause = run.steps_done
    # the step (or run of steps, up to the next metrics row) in flight completes, then the thread parks
    wait_for(parked.is_set, what="the paused training thread to park at its checkpoint")
    steps, log_rows = run.steps_done, run.log.total_rows
    assert steps <= at_pause + run.config.metrics_every
    time.sleep(0.3)                  # deliberately lets time pass: a paused run takes no step meanwhile
    assert run.steps_done == steps and run.log.total_rows == log_rows and run.status == "paused"
    assert run._thread.is_alive()
    run.resume()
    assert run.status == "running"
    wait_for(lambda: run.steps_done > steps + 3, what="steps after resume")
    run.stop()
    assert run.join(20) and run.status == "stopped"


@pytest.mark.slow
def test_stop_while_paused(stopper):
    run = ql.LocalRun(endless())
    stopper(run)
    parked = watch_parking(run)
    run.start()
    wait_for(lambda: run.steps_done > 0, what="steps")
    run.pause()
    wait_for(parked.is_set, what="the paused training thread to park at its checkpoint")
    run.stop()
    assert run.join(20) and run.status == "stopped"


@pytest.mark.slow
def test_join_timeout_returns_false_while_running(stopper):
    run = ql.LocalRun(endless())
    stopper(run)
    run.start()
    assert run.join(0.05) is False and run.status in ACTIVE
    run.stop()
    assert run.join(20) is True


def test_run_control_checkpoint():
    ctl = RunControl()
    assert ctl.checkpoint() is True
    ctl._running.clear()
    threading.Timer(0.1, ctl._running.set).start()
    t0 = time.monotonic()
    assert ctl.checkpoint() is True and time.monotonic() - t0 >= 0.09   # blocked while paused
    ctl._running.clear()
    threading.Timer(0.1, ctl.stop_requested.set).start()
    assert ctl.checkpoint() is False                                     # a stop ends a pause


@pytest.mark.slow
def test_pause_resume_racing_the_end_never_leaves_a_stale_status():
    # Regression: pause()/resume() did check-then-set on `status` without a lock, so a run finishing
    # in between was left "paused" or "running" forever with a dead thread (~1 in 3 runs here).
    old = sys.getswitchinterval()
    sys.setswitchinterval(1e-5)
    try:
        cfg = ql.ExperimentConfig(data=ql.DataConfig(dataset="synthetic", n_samples=40, n_features=4, n_classes=2),
                                  model=ql.ModelConfig(hidden=[4]), quant=ql.QuantConfig(weights="float"),
                                  optim=ql.OptimConfig(epochs=1, batch_size=32))
        statuses = []
        for _ in range(30):
            run = ql.LocalRun(cfg).start()
            while run._thread.is_alive():
                run.pause()
                run.resume()
            run.join()
            statuses.append(run.status)
    finally:
        sys.setswitchinterval(old)
    assert statuses == ["finished"] * 30


# ----------------------------------------------------------------------------- diverged / failed

@pytest.mark.slow
@pytest.mark.filterwarnings("ignore::RuntimeWarning")
def test_diverging_run_reports_diverged_and_process_carries_on():
    cfg = tiny(optimizer="sgd", lr=1e3)
    cfg.optim.loss = "mse"
    run = ql.LocalRun(cfg).start()
    assert run.join(30)
    assert run.status == "diverged" and run.done
    assert " became " in run.message and "step" in run.message   # the loss, a gradient or a parameter
    assert run.result.status == "diverged" and run.steps_done < run.total_steps
    cols = run.log.columns()
    step_rows = np.isfinite(cols["lr"])
    assert step_rows.any() and np.isfinite(cols["loss"][step_rows]).all()   # the non-finite step is not logged
    # the process is fine: another run right after trains normally
    ok = ql.run_experiment(tiny())
    assert ok.status == "finished" and ok.final["test_accuracy"] > 0.5


@pytest.mark.slow
@pytest.mark.filterwarnings("ignore::RuntimeWarning")
@pytest.mark.parametrize("phase", [False, True])
def test_diverging_cross_entropy_run_diverges(phase):
    cfg = tiny(optimizer="sgd", lr=1e3, epochs=5)
    cfg.phase.enabled, cfg.phase.max_grad_norm = phase, 0.0     # phase training clips by default
    res = ql.run_experiment(cfg)
    assert res.status == "diverged" and "nan" in res.message


@pytest.mark.slow
def test_corrupt_file_fails_with_one_line_and_logs_the_traceback(tmp_path, caplog):
    good = tmp_path / "good.npz"
    rng = np.random.default_rng(0)
    np.savez_compressed(good, X=rng.random((60, 4)).astype(np.float32), y=np.arange(60) % 3)
    bad = tmp_path / "corrupt.npz"
    bad.write_bytes(good.read_bytes()[:-40])                 # a truncated download
    cfg = tiny()
    cfg.data.dataset, cfg.data.path = "file", str(bad)
    caplog.set_level(logging.ERROR, logger="qatlab.runs")
    run = ql.LocalRun(cfg).start()
    assert run.join(30)
    assert run.status == "failed" and run.done and run.result is None
    assert "\n" not in run.message and len(run.message) <= MESSAGE_LIMIT
    assert re.match(r"^\w+: .+", run.message) and "Traceback" not in run.message   # "SomeError: why"
    logged = [r for r in caplog.records if r.name == "qatlab.runs" and run.id in r.getMessage()]
    assert len(logged) == 1 and logged[0].exc_info is not None      # the full traceback is in the server log
    assert "load_arrays" in "".join(traceback.format_exception(*logged[0].exc_info))   # the real stack
    assert np.isnan(run.summary()["test_accuracy"])
    res = ql.run_experiment(cfg)                              # the blocking API does not raise either
    assert res.status == "failed" and res.message == run.message and res.final == {}
    cfg.data.path = str(good)                                 # and the process is fine afterwards
    assert ql.run_experiment(cfg).status == "finished"


@pytest.mark.slow
def test_exception_mid_training_fails_and_keeps_rows(monkeypatch, caplog):
    import qatlab.train.rows as rows
    real = rows._layer_row
    calls = {"n": 0}

    def flaky(*args, **kwargs):
        calls["n"] += 1
        if calls["n"] > 6:                                   # 2 layers -> rows for 3 steps, then boom
            raise RuntimeError("boom in layer_row\n  second line " + "x" * 500)
        return real(*args, **kwargs)

    monkeypatch.setattr(rows, "_layer_row", flaky)
    caplog.set_level(logging.ERROR, logger="qatlab.runs")
    run = ql.LocalRun(tiny()).start()
    assert run.join(30)
    assert run.status == "failed" and run.message.startswith("RuntimeError: boom in layer_row second line xxx")
    assert len(run.message) == MESSAGE_LIMIT and run.message.endswith("\u2026")   # shortened, one line
    assert len(run.log) == 3 and run.finished_at is not None
    (record,) = [r for r in caplog.records if run.id in r.getMessage()]
    assert record.levelno == logging.ERROR and record.exc_info[0] is RuntimeError


def test_failure_message_is_one_short_line():
    assert failure_message(ValueError("scale: must be > 0")) == "ValueError: scale: must be > 0"
    assert failure_message(KeyError()) == "KeyError"
    assert failure_message(OSError("a\n\tb   c"), limit=20) == "OSError: a b c"
    long = failure_message(MemoryError("x" * 1000), limit=50)
    assert len(long) == 50 and long.startswith("MemoryError: xxx") and long.endswith("\u2026")


# ----------------------------------------------------------------------------- run_experiment, compare_ste

@pytest.mark.slow
def test_run_experiment_returns_finished_result():
    res = ql.run_experiment(tiny(weights="ternary"))
    assert res.status == "finished" and res.message == ""
    assert isinstance(res.model, ql.Mlp) and list(res.model.sizes) == [16, 16, 3]
    assert res.config["quant"]["weights"] == "ternary"


def _without_ste(d: dict) -> dict:
    d = json.loads(json.dumps(d))
    d["quant"].pop("ste")
    return d


@pytest.mark.slow
def test_compare_ste_one_finished_result_per_kind_only_ste_differs():
    cfg = tiny(weights="ternary", epochs=2)
    results = ql.compare_ste(cfg)
    assert list(results) == list(ql.SteKind)
    for kind, res in results.items():
        assert isinstance(res, ql.RunResult) and res.status == "finished", (kind, res.message)
        assert res.config["quant"]["ste"] == kind.value
        assert _without_ste(res.config) == _without_ste(cfg.to_dict())
        assert np.isfinite(res.final["test_accuracy"])
    # same seed and data: the first row's loss (before any update) is identical for every kind
    first = {float(res.history["loss"][0]) for res in results.values()}
    assert len(first) == 1
    assert cfg.quant.ste == "identity"                        # the caller's config is untouched


@pytest.mark.slow
def test_compare_ste_subset_and_validation():
    results = ql.compare_ste(tiny(weights="ternary", epochs=1), kinds=["tanh", ql.SteKind.HARD_TANH])
    assert list(results) == [ql.SteKind.TANH, ql.SteKind.HARD_TANH]
    assert all(r.status == "finished" for r in results.values())
    with pytest.raises(ValueError, match="kinds"):
        ql.compare_ste(tiny(), kinds=[])
    with pytest.raises(ValueError, match="ste"):
        ql.compare_ste(tiny(), kinds=["bogus"])


@pytest.mark.slow
def test_start_ste_comparison_names_owner_and_concurrency():
    runs = ql.start_ste_comparison(tiny(weights="ternary", epochs=1), owner="session-1", group="A")
    try:
        assert [r.name for r in runs.values()] == [f"A {k.value}" for k in ql.SteKind]
        assert all(r.owner == "session-1" and r.status in ACTIVE + DONE for r in runs.values())
        assert len({r.id for r in runs.values()}) == 4
    finally:
        for r in runs.values():
            assert r.join(30) and r.status == "finished"


@pytest.mark.slow
def test_small_log_capacity_keeps_epoch_metrics():
    cfg = ql.ExperimentConfig(data=ql.DataConfig(dataset="digits"), model=ql.ModelConfig(hidden=[16]),
                              quant=ql.QuantConfig(weights="float"), optim=ql.OptimConfig(epochs=6, batch_size=64),
                              metrics_every=1)
    run = ql.LocalRun(cfg, log_capacity=16).start()
    assert run.join(30) and run.status == "finished"
    assert len(run.log) <= 16
    assert np.isfinite(run.result.history.get("test_accuracy", np.array([]))).any()
    assert np.isfinite(run.log.last("test_accuracy"))


@pytest.mark.slow
def test_start_ste_comparison_can_leave_the_runs_unstarted():
    runs = ql.start_ste_comparison(tiny(weights="ternary", epochs=1), kinds=["tanh", "identity"], start=False)
    assert list(runs) == [ql.SteKind.TANH, ql.SteKind.IDENTITY]
    assert all(r.status == "created" for r in runs.values())
    for r in runs.values():
        r.start()
    assert all(r.join(30) and r.status == "finished" for r in runs.values())


# ----------------------------------------------------------------------------- rename, delete, release, ownership

def test_name_is_settable_and_validated():
    run = ql.LocalRun(tiny(), name="  first  ")
    assert run.name == "first"
    run.name = "second try"
    assert run.name == "second try" and run.summary()["name"] == "second try"
    for bad in ("", "   ", "x" * (NAME_LIMIT + 1), "tab\there", "new\nline", "<b>bold</b>"):
        with pytest.raises(ValueError, match="name: expected 1 to"):
            run.name = bad
    with pytest.raises(TypeError, match="name: expected a str"):
        run.name = 5
    with pytest.raises(ValueError, match="name"):
        ql.LocalRun(tiny(), name="")
    assert run.name == "second try"                            # refused values change nothing


@pytest.mark.slow
def test_delete_removes_from_the_registry_and_stops_an_active_run():
    ended = ql.LocalRun(tiny()).start()
    assert ended.join(30) and ended.result.model is not None
    assert delete_run(ended.id) is ended
    assert ended not in all_runs() and ended.released and ended.result.model is None
    assert ended.result.final and len(ended.log) > 0           # history and final metrics stay
    with pytest.raises(KeyError, match="run"):
        delete_run(ended.id)
    with pytest.raises(TypeError, match="run: expected a LocalRun or a run id"):
        delete_run(3)
    active = ql.LocalRun(endless()).start()
    wait_for(lambda: active.steps_done > 0, what="steps")
    delete_run(active)
    assert active not in all_runs()
    assert active.join(20) and active.status == "stopped"
    wait_for(lambda: active.released, what="the deleted run to be released once it ended")
    assert active.weight_snapshot() is None and active.result.model is None


@pytest.mark.slow
def test_release_drops_model_and_snapshot_but_keeps_history(stopper):
    run = ql.LocalRun(endless())
    stopper(run)
    with pytest.raises(RuntimeError, match="only an ended run"):
        run.release()
    run.start()
    wait_for(lambda: run.weight_snapshot() is not None, what="a weight snapshot")
    with pytest.raises(RuntimeError, match="only an ended run"):
        run.release()
    run.stop()
    assert run.join(20)
    history, final, config = run.log.columns(), dict(run.result.final), run.config.to_dict()
    run.release()
    run.release()                                              # idempotent
    assert run.released and run.result.model is None and run.weight_snapshot() is None
    assert run.status == "stopped" and run.result.final == final and run.config.to_dict() == config
    np.testing.assert_array_equal(run.log.columns()["loss"], history["loss"])
    assert run in all_runs() and run.summary()["steps"] == run.steps_done   # still listed


@pytest.mark.slow
def test_ended_runs_beyond_keep_models_are_released_automatically():
    runs = [ql.LocalRun(tiny(epochs=1)) for _ in range(KEEP_MODELS + 3)]
    for run in runs:                                           # one after another: a clear order of ending
        run.start()
        assert run.join(30) and run.status == "finished"
    held = [r for r in all_runs() if r.done and not r.released]
    assert len(held) <= KEEP_MODELS
    assert all(r.result.model is not None for r in runs[-KEEP_MODELS:])
    assert all(r.released and r.result.model is None for r in runs[:3])
    assert all(np.isfinite(r.result.final["test_accuracy"]) for r in runs)
    assert release_ended(keep=2) == runs[-KEEP_MODELS:-2]
    with pytest.raises(ValueError, match="keep"):
        release_ended(keep=-1)


@pytest.mark.slow
def test_may_change_own_runs_always_other_runs_once_ended(stopper):
    mine = ql.LocalRun(endless(), owner="page-a")
    stopper(mine)
    cli = ql.LocalRun(endless())                                    # a notebook's or the command line's run
    stopper(cli)
    assert mine.may_change("page-a") and not mine.may_change("page-b")
    assert not cli.may_change("page-a") and not cli.may_change(None)
    mine.start()
    cli.start()
    assert mine.may_change("page-a") and not mine.may_change("page-b") and not cli.may_change("page-a")
    mine.stop()
    cli.stop()
    assert mine.join(20) and cli.join(20)
    assert mine.may_change("page-b") and cli.may_change("page-a")
