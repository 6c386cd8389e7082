"""The ``phase`` benchmark suite on a tiny synthetic workload: tables, goals, notes and JSON.

No timing assertions: only structure, the arithmetic that links columns, and the goal rule.
"""
from __future__ import annotations

import dataclasses
import io
import json
import math
import re
import statistics

import pytest

from qatlab import bench

from qatlab.bench import phase as bench_phase
from qatlab import config as C
from qatlab.bench.kit import BenchOptions, load_suite

FAST = BenchOptions(quick=True, repeats=1, warmup=0, min_time=0.0)


def tiny_workload(goal: bool = True) -> bench_phase.Workload:
    """16-16-10 on 240 synthetic samples, batch 16, 3 epochs: 36 steps, one FULL + predict cycle."""
    return bench_phase.synthetic_workload(epochs=3, n_samples=240, n_features=16, hidden=16,
                                          batch_size=16, goal=goal)


@pytest.fixture
def tiny_suite(monkeypatch):
    monkeypatch.setattr(bench_phase, "default_workloads", lambda quick: [tiny_workload()])


def _run_cli(tmp_path, opts=FAST):
    out = tmp_path / "phase.json"
    stream = io.StringIO()
    result = bench.run_suite("phase", opts, out, stream=stream)
    return result, json.loads(out.read_text()), stream.getvalue()


def test_suite_registered():
    assert load_suite("phase").fn is bench_phase.run


def test_default_workloads():
    digits, synth = bench_phase.default_workloads(quick=False)
    assert digits.key == "digits" and digits.goal and not synth.goal
    d = digits.config
    default = C.ExperimentConfig()
    assert d.to_dict() == default.to_dict()           # the defaults are the defaults
    assert d.data.dataset == "digits" and d.model.hidden == [256] and d.quant.weights == "ternary"
    assert d.optim.epochs == 40 and d.optim.batch_size == 64 and d.optim.lr == 1e-2 and d.optim.seed == 0
    s = synth.config
    assert (s.data.dataset, s.data.n_features, s.data.n_classes, s.data.n_samples) == ("synthetic", 784, 10, 4000)
    assert s.model.hidden == [1024] and s.quant.weights == "ternary" and s.optim.epochs == 10
    assert "784-1024-10" in synth.label and "10 epochs" in synth.label
    (quick,) = bench_phase.default_workloads(quick=True)
    assert quick.key == "digits" and quick.config.optim.epochs == bench_phase.QUICK_DIGITS_EPOCHS


def test_variant_config_applies_overrides_only():
    base = C.ExperimentConfig()
    by = {v.key: v for v in bench_phase.VARIANTS}
    full = bench_phase.variant_config(base, by["full"])
    assert full.phase.enabled is False
    dflt = bench_phase.variant_config(base, by["phase"])
    expected = C.PhaseConfig(enabled=True)
    assert dflt.phase.to_dict() == expected.to_dict()   # phase row = PhaseConfig defaults, untuned
    m0 = bench_phase.variant_config(base, by["diag_m0"], epochs=2)
    assert m0.phase.prediction.momentum == 0.0 and m0.optim.epochs == 2
    assert base.phase.enabled is False and base.phase.prediction.momentum == 0.9   # base untouched
    ls = bench_phase.variant_config(base, by["phase_ls_fixed"])
    assert ls.phase.predictor == "least_squares" and ls.phase.adaptive_phases is False
    assert by["diag_m0"].applies_to(bench_phase.digits_workload())
    assert not by["diag_m0"].applies_to(tiny_workload())
    nogain = bench_phase.variant_config(base, by["diag_nogain"])
    assert nogain.phase.prediction.learned_gain is False and base.phase.prediction.learned_gain is True
    assert by["diag_nogain"].kind == "diagnostic" and not by["diag_nogain"].applies_to(tiny_workload())


def test_goal_rule():
    judge = bench_phase._judge
    assert judge({"wall_speedup": 1.5, "acc_delta_pp": -1.0})
    assert judge({"wall_speedup": 2.0, "acc_delta_pp": 0.5})
    assert not judge({"wall_speedup": 1.49, "acc_delta_pp": 0.0})
    assert not judge({"wall_speedup": 3.0, "acc_delta_pp": -1.01})
    assert not judge({"wall_speedup": 3.0, "acc_delta_pp": 1.5})    # either direction counts
    assert not judge({"wall_speedup": math.nan, "acc_delta_pp": 0.0})
    assert not judge({"wall_speedup": 2.0, "acc_delta_pp": 0.3, "acc_delta_seeds_pp": -1.2})   # seeds decide
    assert judge({"wall_speedup": 2.0, "acc_delta_pp": -3.0, "acc_delta_seeds_pp": 0.9})
    assert not judge({"wall_speedup": 1.6, "acc_delta_pp": 0.0, "wall_speedup_seeds": 1.4})    # median of seeds
    assert judge({"wall_speedup": 1.2, "acc_delta_pp": 0.0, "wall_speedup_seeds": 1.5})


def _keys(table: dict) -> list[str]:
    return [c["key"] for c in table["columns"]]


def _ints(text: str) -> list[int]:
    """The whole numbers in a count cell such as ``1/2`` or ``19 (18..20)``."""
    return [int(x) for x in re.findall(r"\d+", text)]


@pytest.mark.slow
def test_suite_tiny_structure_and_json(tiny_suite, tmp_path):
    """The numbers of every table and the goal verdicts follow from the runs' numbers (the report's
    wording is not pinned)."""
    result, payload, text = _run_cli(tmp_path)
    assert payload["suite"] == "phase"
    tables = payload["tables"]
    # the tables, known by their columns: results, time, accuracy over seeds, wall clock over seeds,
    # gradient predictability, component costs
    assert [_keys(t) for t in (tables[0], tables[1], tables[4], tables[5])] == [
        [c.key for c in bench_phase.RESULT_COLUMNS], [c.key for c in bench_phase.TIME_COLUMNS],
        [f"lag_{k}" for k in bench_phase.LAGS] + ["momentum"], [c.key for c in bench_phase.COMPONENT_COLUMNS]]
    assert len(tables) == 6
    assert _keys(tables[2]) == ["label", "mean", "se", "median", "worst", "best", "within"]
    assert _keys(tables[3]) == ["label", "median", "min", "max", "passing", "backward"]
    pred = tables[4]["rows"][0]
    assert pred["steps"] == 36 and all(-1.0 <= pred[k] <= 1.0 for k in ("lag_1", "lag_9", "momentum"))
    assert payload["extra"]["workloads"]["synthetic"]["gradient_predictability"] == pred

    rows = tables[0]["rows"]
    keys = [r["variant"] for r in rows]
    assert keys == ["full", "phase", "phase_ls", "phase_fixed", "phase_ls_fixed", "control"]  # no diag: not digits
    base = rows[0]
    assert base["wall_speedup"] == pytest.approx(1.0) and base["acc_delta_pp"] == 0.0
    assert base["backward_passes"] == base["steps"] == 36 and base["verdict"] is None
    for r in rows:
        assert r["steps"] == base["steps"]                      # same epochs and data
        assert r["deterministic"] is True and r["repeats"] == 1
        assert r["train_seconds"] > 0
        assert r["wall_speedup"] == pytest.approx(base["train_seconds"] / r["train_seconds"])
        assert r["acc_delta_pp"] == pytest.approx(100 * (r["test_accuracy"] - base["test_accuracy"]))
        assert r["step_speedup"] == pytest.approx(r["steps"] / r["backward_passes"])
        assert 0.0 <= r["test_accuracy"] <= 1.0 and math.isfinite(r["test_loss"])
    for r in rows[1:5]:
        assert r["kind"] == "phase" and r["backward_passes"] < r["steps"]
        # the goal rule on the numbers: median wall-clock speedup and mean accuracy difference over the seeds
        deltas, walls = r["acc_delta_per_seed"], r["wall_speedup_per_seed"]
        assert len(deltas) == len(walls) == 1 + len(bench_phase.QUICK_SEEDS) == 2     # seeds 0 and 1
        assert r["goal_passed"] == (statistics.median(walls) >= bench_phase.GOAL_WALL_X
                                    and abs(statistics.fmean(deltas)) <= bench_phase.GOAL_ACC_PP)
        assert r["verdict"] == ("PASS" if r["goal_passed"] else "MISS")
        assert r["cosine_n"] >= 1 and -1.0 <= r["cosine"] <= 1.0      # at least one CORRECT step logged
        assert r["corrections"] >= 1 and r["ms_backward_step"] > 0 and r["ms_predict_step"] > 0
    control = rows[5]
    assert control["kind"] == "control" and control["backward_passes"] == control["steps"]
    assert control["verdict"] is None and control["goal_passed"] is None

    time_rows = tables[1]["rows"]
    assert [r["variant"] for r in time_rows] == keys
    seed_rows = tables[2]["rows"]                                # quick: seeds 0 and 1
    assert [r["label"] for r in seed_rows] == [r["label"] for r in rows[1:5]]
    for sr, r in zip(seed_rows, rows[1:5]):
        d0, d1 = r["acc_delta_per_seed"]
        assert d0 == pytest.approx(r["acc_delta_pp"])
        assert sr["mean"] == pytest.approx((d0 + d1) / 2) == pytest.approx(r["acc_delta_seeds_pp"])
        assert sr["se"] == pytest.approx(abs(d0 - d1) / 2)
        assert (sr["worst"], sr["best"]) == (min(d0, d1), max(d0, d1))
        assert _ints(sr["within"]) == [(abs(d0) <= bench_phase.GOAL_ACC_PP) + (abs(d1) <= bench_phase.GOAL_ACC_PP), 2]
    wall_rows = tables[3]["rows"]
    assert [r["label"] for r in wall_rows] == [r["label"] for r in rows[1:5]]
    for wr, r in zip(wall_rows, rows[1:5]):
        walls, backward = r["wall_speedup_per_seed"], r["backward_passes_per_seed"]
        assert walls[0] == r["wall_speedup"] and backward[0] == r["backward_passes"] and len(walls) == 2
        assert r["wall_speedup_seeds"] == pytest.approx(statistics.median(walls)) == wr["median"]
        assert (wr["min"], wr["max"]) == (min(walls), max(walls))
        assert _ints(wr["passing"]) == [sum(w >= bench_phase.GOAL_WALL_X for w in walls), 2]
        shown_median, shown_min, shown_max = _ints(wr["backward"])
        assert abs(shown_median - statistics.median(backward)) <= 0.5
        assert (shown_min, shown_max) == (min(backward), max(backward))
    comp = tables[5]["rows"]
    assert len(comp) == 1 and comp[0]["workload"] == "synthetic"
    for k in ("forward_loss_ms", "backward_ms", "optimizer_ms", "predict_momentum_ms",
              "predict_least_squares_ms", "metrics_row_ms", "max_speedup"):
        assert comp[0][k] > 0

    # one goal per phase row, its verdict the row's; quick results are labelled as such
    goals = result.goals
    assert len(goals) == 4
    for g, r in zip(goals, rows[1:5]):
        assert r["label"] in g.name and "[quick]" in g.name
        assert g.passed is r["goal_passed"] and g.status == r["verdict"]
        assert g.name in text                                    # the report lists every goal
    assert [g["passed"] for g in payload["goals"]] == [g.passed for g in goals]
    assert payload["extra"]["quick"] is True and payload["extra"]["goal_wall_x"] == bench_phase.GOAL_WALL_X
    assert payload["extra"]["workloads"]["synthetic"]["config"]["phase"]["enabled"] is False
    json.dumps(payload, allow_nan=False)                         # strict JSON


@pytest.mark.slow
def test_non_goal_workload_reports_in_notes(tmp_path):
    res = bench_phase.run_phase_bench([tiny_workload(goal=False)], FAST, repeats=2, warmup_epochs=0,
                                      variants=bench_phase.VARIANTS[:2])
    assert res.goals == []
    row = res.tables[0].rows[1]
    assert row["repeats"] == 2 and len(row["train_seconds_samples"]) == 2
    # no goal, but the digits rule is still applied to the numbers and its verdict reported in the notes
    assert row["goal_passed"] == (row["wall_speedup"] >= bench_phase.GOAL_WALL_X
                                  and abs(row["acc_delta_pp"]) <= bench_phase.GOAL_ACC_PP)
    assert row["verdict"] == ("PASS" if row["goal_passed"] else "MISS")
    assert any(row["label"] in n and row["verdict"] in n for n in res.notes)
    assert "[quick]" not in res.tables[0].title


def test_bad_arguments():
    with pytest.raises(ValueError, match="repeats"):
        bench_phase.run_phase_bench([tiny_workload()], FAST, repeats=0)
    with pytest.raises(ValueError, match="first variant"):
        bench_phase.run_phase_bench([tiny_workload()], FAST, repeats=1, variants=bench_phase.VARIANTS[1:])


def test_ideal_and_max_speedup_formulas():
    costs = {"forward_loss": 2.0, "backward": 3.0, "optimizer": 1.0, "predict_momentum": 0.5,
             "predict_least_squares": 1.5, "metrics_row": 4.0}
    full, pred = bench_phase._step_costs(costs, "momentum", metrics_every=4)
    assert full == 2.0 + 3.0 + 1.0 + 1.0                 # fwd+loss + bwd + opt + row/k
    assert pred == 2.0 / 4 + 0.5 + 1.0 + 1.0             # fwd+loss only on the 1 in k that log a row
    assert bench_phase._ideal_speedup(costs, 10, 4, "momentum", 4) == pytest.approx(10 * full / (4 * full + 6 * pred))
    assert bench_phase._max_speedup(costs, 4) == pytest.approx(full / pred)
    assert bench_phase._step_costs(costs, "least_squares", 4)[1] == pytest.approx(pred + 1.0)


@pytest.mark.slow
def test_history_storage_table_gives_bytes_and_accuracy_against_float32():
    by = {v.key: v for v in bench_phase.VARIANTS}
    everywhere = [dataclasses.replace(by[k], workloads=None) for k in ("hist_ternary", "hist_ls_vsa")]
    variants = [by["full"], by["phase"], by["phase_ls"], *everywhere]
    wl = tiny_workload(goal=False)
    res = bench_phase.run_phase_bench([wl], FAST, repeats=1, warmup_epochs=0, variants=variants)
    (table,) = [t for t in res.tables if t.columns is bench_phase.HISTORY_COLUMNS]
    rows = {r["variant"]: r for r in table.rows}
    assert list(rows) == ["phase", "phase_ls", "hist_ternary", "hist_ls_vsa"]
    n = 16 * 16 + 16 + 16 * 10 + 10
    f32, ls = rows["phase"], rows["phase_ls"]
    assert (f32["history_storage"], f32["history_bytes"], f32["bytes_ratio"]) == ("float32", 2 * 4 * n, 1.0)
    assert ls["history_bytes"] == 5 * 4 * n
    tern, vsa = rows["hist_ternary"], rows["hist_ls_vsa"]
    assert tern["history_bytes"] == 2 * ((256 + 3) // 4 + (16 + 3) // 4 + (160 + 3) // 4 + (10 + 3) // 4 + 4 * 4)
    assert tern["bytes_ratio"] == pytest.approx(tern["history_bytes"] / f32["history_bytes"])
    d = C.VSAConfig().dimension
    assert vsa["history_bytes"] == 5 * 4 * d + 4 * d + 8 * d + 32
    assert vsa["bytes_ratio"] == pytest.approx(vsa["history_bytes"] / ls["history_bytes"])
    for r in (tern, vsa):      # one seed here: no mean over seeds, the seed-0 difference is the row's
        assert r["acc_delta_pp"] == pytest.approx(100 * (r["test_accuracy"] - res.tables[0].rows[0]["test_accuracy"]))
        assert math.isnan(r["acc_delta_seeds"]) and math.isnan(r["vs_float32_pp"]) and r["kind"] == "storage"
    assert all(r["verdict"] is None for r in (tern, vsa)) and res.goals == []
