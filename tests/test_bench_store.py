"""The store suite of ``python -m qatlab.bench``: its tables, and goals that follow its numbers."""
from __future__ import annotations

import json

import pytest

from qatlab.bench import store as bench_store
from qatlab.bench import main as bench_main
from qatlab.bench.kit import load_suite


@pytest.mark.slow
def test_store_suite_quick_structure(tmp_path, monkeypatch):
    monkeypatch.setattr(bench_store, "HISTORY_ROWS", 3000)
    out = tmp_path / "store.json"
    assert bench_main(["store", "--quick", "--repeats", "1", "--sizes", "3", "--out", str(out)]) == 0
    assert load_suite("store").fn is bench_store.run
    payload = json.loads(out.read_text())
    logged, reads = (t["rows"] for t in payload["tables"])
    assert [r["metrics_every"] for r in logged] == list(bench_store.ROWS_EVERY)
    for r in logged:
        assert r["plain_sps"] > 0 and r["store_sps"] > 0 and r["cost"] == pytest.approx(1 - r["store_sps"] / r["plain_sps"])
        assert r["rows"] > 3 * 23 // r["metrics_every"]          # 3 epochs of 23 steps, and the epochs' rows
    assert [r["state"] for r in reads] == ["live", "finished"]
    assert all(r["rows"] == 300 and r["columns"] > 10 and r["median_ms"] > 0 for r in reads)   # (quick: a tenth)
    worst, slowest = max(r["cost"] for r in logged), max(r["median_ms"] for r in reads)
    goals = payload["goals"]
    assert [g["passed"] for g in goals] == [worst <= bench_store.GOAL_COST, slowest < bench_store.GOAL_READ_MS]


@pytest.mark.slow   # trains: the rows come from a real run_experiment
def test_history_rows_carry_a_runs_columns_with_renumbered_steps():
    rows = bench_store._history_rows(500)
    assert [r["step"] for r in rows[:3]] == [1.0, 2.0, 3.0] and rows[-1]["step"] == 500.0
    assert {"loss", "test_accuracy"} <= set().union(*rows)
