"""Sweeps: points and their checks, results and summaries, the median rule, and sweeps on Dask clusters
(a LocalCluster and one started from the ``dask scheduler`` / ``dask worker`` command lines)."""
from __future__ import annotations

import json
import math
import os
import signal
import statistics
import time

import numpy as np
import pytest

import qatlab as ql
from qatlab.runs import RunResult
from qatlab.sweep import MedianStopping, Sweep, SweepResult, expand
from qatlab.sweep.points import random_points
from qatlab.sweep.pruning import Curve

from test_cluster_cli import cli_cluster  # noqa: F401  (fixture: a scheduler and one worker as commands)

JOIN = 300.0


def wait_for(predicate, timeout: float, what: str, every: float = 0.05):
    deadline = time.monotonic() + timeout
    while not (value := predicate()):
        if time.monotonic() > deadline:
            pytest.fail(f"timed out after {timeout:.0f} s waiting for {what}")
        time.sleep(every)
    return value


def base(epochs: int = 3, hidden=(32,)) -> ql.ExperimentConfig:
    cfg = ql.ExperimentConfig()
    cfg.optim.epochs, cfg.model.hidden = epochs, list(hidden)
    cfg.quant.weights = "fake"
    return cfg


@pytest.fixture
def store(tmp_path):
    with ql.RunStore(tmp_path / "runs.sqlite") as s:
        yield s


# ----------------------------------------------------------------------------- points


def test_grid_expands_every_combination_times_seeds_in_seed_major_order():
    cfg = base()
    cfg.data.seed = 7
    points = expand(cfg, grid={"quant.ste": ["identity", ql.SteKind.HARD_TANH], "quant.weight_bits": [2, 4, 8]},
                    seeds=[0, 5])
    assert len(points) == 12
    assert [p.seed for p in points] == [0] * 6 + [5] * 6
    assert [p.point for p in points[:3]] == [{"quant.ste": "identity", "quant.weight_bits": b, "seed": 0}
                                             for b in (2, 4, 8)]
    for p in points:
        assert p.config.quant.ste == p.fields["quant.ste"] and p.config.quant.weight_bits == p.fields["quant.weight_bits"]
        assert p.config.optim.seed == p.seed and p.config.data.seed == 7     # the split stays data.seed's
        assert p.config.optim.epochs == 3
    assert len({p.key for p in points}) == 12
    assert cfg.optim.seed == 0 and cfg.quant.ste == "identity"              # base untouched


@pytest.mark.parametrize("grid, needle", [
    ({"quant.stee": ["identity"]}, "field 'quant.stee': quant has no field 'stee'"),
    ({"quantization.ste": ["identity"]}, "field 'quantization.ste'"),
    ({"quant": [1]}, "field 'quant': is a section"),
    ({"quant.ste.x": [1]}, "quant.ste is a value"),
    ({"quant.ste": ["identity", "bogus"]}, "point 1 {'quant.ste': 'bogus', 'seed': 0}: field 'quant.ste'"),
    ({"quant.weight_bits": [4, 40]}, "point 1 {'quant.weight_bits': 40, 'seed': 0}: field 'quant.weight_bits'"),
    ({"optim.seed": [1, 2]}, "'optim.seed' is set by seeds="),
    ({"quant.ste": []}, "grid['quant.ste']: expected a non-empty list"),
    ({"quant.per_channel": [False, True]}, "point 1 {'quant.per_channel': True, 'seed': 0}"),
])
def test_a_bad_field_or_value_names_itself_and_the_point_and_nothing_is_stored(grid, needle, store):
    cfg = base()
    cfg.quant.weights = "ternary"           # per_channel is refused for ternary weights (a cross-field rule)
    with pytest.raises(ValueError) as err:
        Sweep(cfg, grid=grid).submit(store=store, client=object())
    assert needle in str(err.value)
    assert store.runs() == []


def test_the_memory_estimate_is_checked_for_every_point_before_anything_starts(store, monkeypatch):
    monkeypatch.setenv("QATLAB_MEMORY_BUDGET", "64M")
    with pytest.raises(ValueError, match=r"point 1 \{'model.hidden': \[20000, 20000\], 'seed': 0\}: run needs"):
        Sweep(base(), grid={"model.hidden": [[32], [20000, 20000]]})
    assert store.runs() == []


def test_bad_seeds_and_arguments_are_refused():
    with pytest.raises(ValueError, match="seeds: repeated"):
        Sweep(base(), grid={"quant.ste": ["tanh"]}, seeds=[1, 1])
    with pytest.raises(ValueError, match="seeds: expected at least one"):
        Sweep(base(), seeds=[])
    with pytest.raises(ValueError, match="seeds: each seed"):
        Sweep(base(), seeds=[-1])
    with pytest.raises(ValueError, match="max_concurrent"):
        Sweep(base(), max_concurrent=0)
    with pytest.raises(ValueError, match="name"):
        Sweep(base(), name="<b>")
    with pytest.raises(TypeError, match="base"):
        Sweep({"optim": {}})
    with pytest.raises(ValueError, match="early_stopping.mode"):
        Sweep(base(), early_stopping={"metric": "loss", "mode": "lowest"})
    with pytest.raises(ValueError, match=r"random: fields \['quant.ste'\] are in the grid too"):
        Sweep(base(), grid={"quant.ste": ["tanh"]}, random={"n": 2, "fields": {"quant.ste": ["identity"]}})


def test_random_points_are_reproducible_and_within_their_ranges():
    spec = {"n": 40, "seed": 3, "fields": {"optim.lr": ("log_uniform", 1e-4, 1e-1), "optim.momentum": ["uniform", 0.5, 0.9],
                                           "optim.batch_size": ("int", 16, 18), "quant.ste": ["identity", "tanh"]}}
    a, b = random_points(spec), random_points(json.loads(json.dumps(spec)))   # a JSON file gives lists
    assert a == b
    assert a != random_points({**spec, "seed": 4})
    assert all(1e-4 <= p["optim.lr"] <= 1e-1 and 0.5 <= p["optim.momentum"] <= 0.9 for p in a)
    assert {p["optim.batch_size"] for p in a} == {16, 17, 18} and {p["quant.ste"] for p in a} == {"identity", "tanh"}
    lrs = np.log10([p["optim.lr"] for p in a])
    assert lrs.min() < -3 and lrs.max() > -2                # spread over the decades, not bunched at the top
    points = Sweep(base(), random=spec, seeds=[0, 1]).points
    assert len(points) == 80 and points[3].config.optim.lr == a[3]["optim.lr"]
    for bad, needle in ((("log_uniform", 0.0, 1.0), "log_uniform needs low > 0"), (("uniform", 2, 1), "low < high"),
                        (("int", 1.5, 3), "int bounds"), ("abc", "expected (kind, low, high)")):
        with pytest.raises(ValueError, match=needle.replace("(", r"\(").replace(")", r"\)")):
            random_points({"n": 2, "fields": {"optim.lr": bad}})


# ----------------------------------------------------------------------------- results


def _stored_run(store, cfg, sweep_id, point, status, final, message=""):
    rid = store.create_run(cfg, sweep_id=sweep_id, point=point)
    store.set_status(rid, "running")
    store.finish(rid, RunResult(history={}, final=final, status=status, message=message))
    return rid


def test_summary_averages_only_finished_seeds_and_counts_the_others(store):
    values = {("identity", 0): ("finished", 0.90), ("identity", 1): ("finished", 0.80),
              ("identity", 2): ("diverged", 0.10), ("tanh", 0): ("finished", 0.70),
              ("tanh", 1): ("failed", None), ("tanh", 2): ("pruned", 0.05)}
    for (ste, seed), (status, acc) in values.items():
        cfg = base()
        cfg.quant.ste, cfg.optim.seed = ste, seed
        _stored_run(store, cfg, "s1", {"quant.ste": ste, "seed": seed}, status,
                    {} if acc is None else {"test_accuracy": acc, "test_loss": 1 - acc})
    _stored_run(store, base(), "other", {"quant.ste": "identity", "seed": 0}, "finished", {"test_accuracy": 0.0})
    result = SweepResult.from_store(store, "s1")
    assert len(result.table) == 6 and {r["status"] for r in result.table} == {"finished", "diverged", "failed", "pruned"}
    ident, tanh = result.summary
    assert ident["quant.ste"] == "identity" and ident["n_runs"] == 3 and ident["n_finished"] == 2
    assert ident["n_diverged"] == 1 and ident["test_accuracy_count"] == 2
    assert ident["test_accuracy_mean"] == pytest.approx(0.85)
    assert ident["test_accuracy_std"] == pytest.approx(statistics.stdev([0.9, 0.8]))     # ddof 1
    assert (ident["test_accuracy_min"], ident["test_accuracy_max"]) == (0.80, 0.90)
    assert tanh["n_failed"] == 1 and tanh["n_pruned"] == 1 and tanh["test_accuracy_count"] == 1
    assert tanh["test_accuracy_mean"] == 0.70 and tanh["test_accuracy_std"] == 0.0
    assert result.best("test_accuracy")["quant.ste"] == "identity"
    assert result.best("test_loss", mode="min")["quant.ste"] == "identity"
    with pytest.raises(ValueError, match="mode"):
        result.best("test_accuracy", mode="up")
    with pytest.raises(ValueError, match="not a final metric"):
        result.best("accuracy")
    with pytest.raises(KeyError, match="no runs of a sweep 'nope'"):
        SweepResult.from_store(store, "nope")
    assert "identity" in result.format_summary() and "0.8500 +- 0.0707 (2)" in result.format_summary()


def test_a_config_run_again_after_a_failure_shows_once_with_its_finished_run(store):
    cfg = base()
    first = _stored_run(store, cfg, "s2", {"seed": 0}, "failed", {}, "worker lost")
    again = _stored_run(store, cfg, "s2", {"seed": 0}, "finished", {"test_accuracy": 0.5})
    result = SweepResult.from_store(store, "s2")
    assert [r["run_id"] for r in result.table] == [again] and first != again
    (row,) = result.summary
    assert row["n_finished"] == 1 and row["n_failed"] == 0 and row["n_superseded"] == 1


# ----------------------------------------------------------------------------- median rule


def _curve(rule, steps, values):
    return rule.curve({"step": np.asarray(steps, float), rule.metric: np.asarray(values, float)})


def test_median_rule_prunes_a_run_worse_than_the_median_of_the_others_at_the_same_step():
    rule = MedianStopping(metric="loss", mode="min", grace=3, min_others=2)
    good = [_curve(rule, [10, 20, 30, 40], [2.0, 1.0, 0.5, 0.4]), _curve(rule, [10, 20, 30], [2.0, 1.2, 0.6])]
    bad = _curve(rule, [10, 20, 30, 40, 50], [2.3, 2.3, 2.2, 2.2, 2.2])
    assert rule.judge(bad, good) == 30.0                # the latest step both others reached
    assert rule.judge(good[0], [good[1], bad]) is None  # better than the median (1.4 at step 30: 0.6 and 2.2)
    assert rule.judge(bad, good[:1]) is None            # one other run is not enough
    assert rule.judge(_curve(rule, [10, 20], [9.0, 9.0]), good) is None   # within its grace rows
    nan_rows = rule.curve({"step": np.array([10.0, 20, 30]), "loss": np.array([1.0, math.nan, 0.5])})
    assert list(nan_rows.steps) == [10.0, 30.0] and list(nan_rows.best) == [1.0, 0.5]
    up = MedianStopping(metric="test_accuracy", mode="max", grace=1)
    assert up.judge(Curve(np.array([5.0]), np.array([0.2])), [Curve(np.array([5.0]), np.array([0.9]))] * 2) == 5.0


# ----------------------------------------------------------------------------- on clusters


@pytest.mark.slow
def test_a_grid_sweep_on_a_local_cluster_lands_in_the_store_and_resumes(client2, store):
    sweep = Sweep(base(), grid={"quant.ste": ["identity", "hard_tanh"], "quant.weight_bits": [2, 4]},
                  seeds=[0, 1], name="grid")
    handle = sweep.submit(store=store, client=client2)
    assert handle.cap == 2 and handle.total == 8
    assert handle.join(JOIN) and handle.error is None
    result = handle.result()
    records = store.runs(sweep_id="grid")
    assert len(records) == 8 and all(r.status == "finished" for r in records)
    assert sorted(json.dumps(r.point, sort_keys=True) for r in records) == \
        sorted(json.dumps(p.point, sort_keys=True) for p in sweep.points)
    assert all(r.config.optim.seed == r.point["seed"] and r.config.quant.ste == r.point["quant.ste"] for r in records)
    for row in result.summary:                           # the summary against the table, by hand
        mine = [t["test_accuracy"] for t in result.table
                if t["quant.ste"] == row["quant.ste"] and t["quant.weight_bits"] == row["quant.weight_bits"]]
        assert len(mine) == 2 and row["test_accuracy_count"] == 2
        assert row["test_accuracy_mean"] == pytest.approx(sum(mine) / 2, rel=1e-12)
        assert row["test_accuracy_std"] == pytest.approx(abs(mine[0] - mine[1]) / math.sqrt(2), rel=1e-9)
    ref = ql.run_experiment(sweep.points[0].config)
    got = store.history(result.table[0]["run_id"]) if result.table[0]["seed"] == 0 else None
    assert got is not None and np.array_equal(got["loss"], ref.history["loss"], equal_nan=True)
    again = Sweep(base(), grid={"quant.ste": ["identity", "hard_tanh"], "quant.weight_bits": [2, 4]},
                  seeds=[0, 1, 2], name="grid").submit(store=store, client=client2)
    assert again.skipped == 8 and again.total == 4        # only the new seed's runs
    assert again.join(JOIN) and len(store.runs(sweep_id="grid")) == 12
    assert len(again.result().summary[0]["seeds"]) == 3


@pytest.mark.slow
def test_a_stopped_sweep_leaves_only_the_runs_it_started(client2, store):
    handle = Sweep(base(epochs=20_000), seeds=[0, 1, 2, 3], name="halt").submit(store=store, client=client2)
    wait_for(lambda: len(store.runs(sweep_id="halt")) == 3, JOIN, "two runs started and the next one prepared")
    assert store.runs(sweep_id="halt", status="created")     # the next run waits, ready, for a free slot
    handle.stop()
    assert handle.join(JOIN) and handle.error is None
    records = store.runs(sweep_id="halt")
    assert sorted(r.id for r in records) == sorted(r.id for r in handle.runs) and len(records) == 2
    assert all(r.status == "stopped" for r in records)
    assert handle.counts() == {"stopped": 2, "queued": 0}


@pytest.mark.slow
def test_a_diverged_run_is_counted_not_averaged(client2, store):
    cfg = ql.ExperimentConfig(data=ql.DataConfig(dataset="synthetic", n_samples=200, n_features=16, n_classes=3),
                              model=ql.ModelConfig(hidden=[16]), quant=ql.QuantConfig(weights="float"),
                              optim=ql.OptimConfig(epochs=3, batch_size=32, optimizer="sgd"), metrics_every=1)
    result = Sweep(cfg, grid={"optim.lr": [0.05, 1e3]}, seeds=[0, 1], name="div").run(
        store=store, client=client2, progress=False)
    by_lr = {row["optim.lr"]: row for row in result.summary}
    assert by_lr[1e3]["n_diverged"] == 2 and by_lr[1e3]["n_finished"] == 0 and by_lr[1e3]["test_loss_count"] == 0
    assert math.isnan(by_lr[1e3]["test_loss_mean"])
    assert by_lr[0.05]["n_finished"] == 2 and by_lr[0.05]["test_loss_count"] == 2
    assert result.best("test_accuracy")["optim.lr"] == 0.05
    assert sum(row["status"] == "diverged" for row in result.table) == 2


@pytest.mark.slow
def test_median_rule_prunes_a_plainly_bad_point(client2, store):
    cfg = base(epochs=800)          # runs of a second or more: the rule acts before they end
    # one good point among two that barely learn: whatever the timing, a good run's references hold at
    # least as many bad runs as good ones, so the median it is held to is bad (or halfway)
    result = Sweep(cfg, grid={"optim.lr": [1e-2, 1e-7, 1e-6]}, seeds=[0, 1], name="prune",
                   early_stopping={"metric": "loss", "mode": "min", "grace": 5}).run(
        store=store, client=client2, progress=False)
    by_lr = {row["optim.lr"]: row for row in result.summary}
    assert by_lr[1e-2]["n_pruned"] == 0 and by_lr[1e-2]["n_finished"] == 2
    assert by_lr[1e-7]["n_pruned"] + by_lr[1e-6]["n_pruned"] >= 1
    full = max(row["steps"] for row in result.table if row["status"] == "finished")
    pruned = store.runs(sweep_id="prune", status="pruned")
    for record in pruned:
        assert record.point["optim.lr"] < 1e-5 and record.message.startswith("pruned by median rule at step")
        assert record.n_rows > 0 and record.final["steps"] <= full
    assert min(record.final["steps"] for record in pruned) < full      # stopped early, not at its end


@pytest.mark.slow
def test_a_killed_worker_fails_its_run_the_sweep_finishes_and_resuming_reruns_only_it(cli_cluster, tmp_path):  # noqa: F811
    client = ql.connect(cli_cluster, warm=False)
    client.wait_for_workers(1, timeout=120)
    store = ql.RunStore(tmp_path / "runs.sqlite")

    def sweep():
        return Sweep(base(), grid={"optim.epochs": [300, 3]}, seeds=[0], name="kill")

    handle = sweep().submit(store=store, client=client)
    victim = wait_for(lambda: handle.runs and handle.runs[0], JOIN, "the first run")
    wait_for(lambda: victim.worker_pid and len(victim.log) > 0, JOIN, "the first run's rows")
    os.kill(victim.worker_pid, signal.SIGKILL)
    assert handle.join(JOIN) and handle.error is None
    statuses = {r.point["optim.epochs"]: r for r in store.runs(sweep_id="kill")}
    assert statuses[300].status == "failed" and statuses[300].message.startswith("worker lost")
    assert statuses[3].status == "finished"
    client.wait_for_workers(1, timeout=120)               # the nanny restarted the worker
    again = sweep().submit(store=store, client=client)
    assert again.skipped == 1 and again.total == 1
    assert again.join(JOIN) and again.error is None
    assert [r.point["optim.epochs"] for r in again.runs] == [300]
    result = again.result()
    assert {row["optim.epochs"]: row["status"] for row in result.table} == {300: "finished", 3: "finished"}
    assert {row["optim.epochs"]: row["n_superseded"] for row in result.summary} == {300: 1, 3: 0}
    store.close()


def test_cli_refuses_a_bad_sweep_file_naming_the_field(tmp_path, capsys):
    from qatlab.__main__ import main
    path = tmp_path / "sweep.json"
    path.write_text(json.dumps({"name": "x", "base": {"optim": {"epochs": 1}}, "grid": {"quant.stx": ["tanh"]}}))
    assert main(["sweep", str(path), "--store", str(tmp_path / "runs.sqlite")]) == 2
    assert "field 'quant.stx'" in capsys.readouterr().err
    path.write_text(json.dumps({"base": {}, "grids": {}}))
    assert main(["sweep", str(path), "--store", str(tmp_path / "runs.sqlite")]) == 2
    assert "unknown keys ['grids']" in capsys.readouterr().err


@pytest.mark.slow
def test_cli_runs_a_sweep_file_and_prints_the_summary(tmp_path):
    import subprocess
    import sys
    path = tmp_path / "sweep.json"
    path.write_text(json.dumps({"name": "cli", "base": {"optim": {"epochs": 2}, "model": {"hidden": [16]}},
                                "grid": {"quant.ste": ["identity", "tanh"]}, "seeds": [0]}))
    store = tmp_path / "runs.sqlite"
    env = {**os.environ, "QATLAB_SCHEDULER": ""}
    out = subprocess.run([sys.executable, "-m", "qatlab", "sweep", str(path), "--store", str(store)],
                         capture_output=True, text=True, timeout=600, env=env)
    assert out.returncode == 0, out.stderr[-2000:]
    lines = out.stdout.strip().splitlines()
    assert lines[0].split()[:3] == ["quant.ste", "runs", "ok"] and len(lines) == 3
    with ql.RunStore(store) as s:
        assert [r.status for r in s.runs(sweep_id="cli")] == ["finished", "finished"]


def test_runs_of_the_same_point_under_another_base_config_are_summarised_apart(store):
    short, long = base(epochs=2), base(epochs=5)
    for cfg, acc in ((short, 0.5), (long, 0.9)):
        _stored_run(store, cfg, "s3", {"quant.ste": "identity", "seed": 0}, "finished", {"test_accuracy": acc})
    rows = SweepResult.from_store(store, "s3").summary
    assert sorted(row["test_accuracy_mean"] for row in rows) == [0.5, 0.9]


def test_config_diff_names_the_dotted_fields_that_differ():
    from qatlab.sweep import config_diff, flat_fields
    a, b = base(), base()
    b.quant.ste, b.model.hidden = "tanh", [16, 16]
    assert config_diff(a, b) == {"model.hidden": ([32], [16, 16]), "quant.ste": ("identity", "tanh")}
    assert config_diff(a, a.to_dict()) == {}
    assert flat_fields(a)["optim.epochs"] == 3 and "phase.prediction.momentum" in flat_fields(a)


def test_the_sweep_bench_suite_is_registered():
    from qatlab.bench import kit as benchkit
    assert "sweep" in benchkit.KNOWN_SUITES and benchkit.load_suite("sweep").name == "sweep"


def test_bench_slot_overhead_counts_each_worker_up_to_its_last_run():
    from types import SimpleNamespace

    from qatlab.bench.sweep import slot_overhead

    def task(run_id, worker, start, stop):
        return {"key": f"qatlab-run-{run_id}", "worker": worker,
                "startstops": [{"action": "transfer", "start": start - 1, "stop": start},
                               {"action": "compute", "start": start, "stop": stop}]}

    records = [SimpleNamespace(id=i, final={"seconds": 1.0}) for i in "abc"]
    tasks = [task("a", "w1", 100.1, 101.2), task("b", "w1", 101.25, 102.3), task("c", "w2", 100.2, 101.25),
             {"key": "other-task", "worker": "w2", "startstops": [{"action": "compute", "start": 1, "stop": 200}]}]
    # w1: 102.3 - 100 - 2 s trained = 0.3 s; w2: 101.25 - 100 - 1 s = 0.25 s (its idle end not counted)
    assert slot_overhead(tasks, records, submitted=100.0) == pytest.approx(0.55 / 3)
