"""The benchmark harness (qatlab.bench.kit), the CLI (qatlab.bench) and the fakequant suite on tiny sizes.

No timing assertions: statistics are checked on a fake clock, the suite only for shape and validity.
"""
from __future__ import annotations

import json
import math
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from qatlab import bench

from qatlab.bench import fakequant as bench_fakequant, kit as benchkit
from qatlab.bench.kit import (BenchOptions, Column, Goal, Measurement, SuiteNotAvailable, SuiteResult, Table,
                             format_table, measure, measure_many, write_json)

ROOT = Path(__file__).resolve().parents[1]


class FakeClock:
    """A timer whose time only moves when the fake function 'runs' for a scripted duration."""

    def __init__(self, durations):
        self.now = 0.0
        self.durations = list(durations)
        self.calls = 0

    def timer(self):
        return self.now

    def fn(self):
        self.now += self.durations[self.calls % len(self.durations)]
        self.calls += 1


# ----------------------------------------------------------------------------- statistics

def test_measurement_from_samples_statistics():
    m = Measurement.from_samples([5.0, 1.0, 3.0, 2.0, 4.0], number=10)
    assert m.median == 3.0 and m.min == 1.0 and m.max == 5.0
    assert (m.q1, m.q3) == (2.0, 4.0)
    assert m.iqr == 2.0
    assert m.mad == 1.0                        # |x - 3| = 2,2,0,1,1 -> median 1
    assert m.rel_spread == pytest.approx(2 / 3)
    assert m.repeats == 5 and m.number == 10
    assert m.samples == (5.0, 1.0, 3.0, 2.0, 4.0)  # order of measurement kept


def test_quartiles_match_numpy():
    xs = [0.3, 0.1, 0.7, 0.2, 0.9, 0.4]
    m = Measurement.from_samples(xs)
    q1, q3 = np.percentile(xs, [25, 75])
    assert m.q1 == pytest.approx(q1) and m.q3 == pytest.approx(q3)
    assert m.median == pytest.approx(np.median(xs))


def test_measurement_per_step():
    m = Measurement.from_samples([2.0, 4.0, 6.0, 8.0], number=3).per(2)
    assert (m.median, m.min, m.max, m.number, m.samples) == (2.5, 1.0, 4.0, 3, (1.0, 2.0, 3.0, 4.0))


def test_measurement_rejects_empty():
    with pytest.raises(ValueError, match="samples"):
        Measurement.from_samples([])


def test_measure_with_fixed_number_on_fake_clock():
    # warm-up 2 calls (durations 9, 9 ignored), then 5 samples of number=2 calls each.
    clock = FakeClock([9, 9, 1, 1, 2, 2, 3, 3, 10, 10, 4, 4])
    m = measure(clock.fn, repeats=5, warmup=2, number=2, timer=clock.timer)
    assert clock.calls == 2 + 5 * 2
    assert list(m.samples) == [1.0, 2.0, 3.0, 10.0, 4.0]   # seconds per call
    assert m.median == 3.0 and m.min == 1.0
    assert m.iqr == 2.0                               # q1 = 2, q3 = 4: the 10 s outlier barely moves it


def test_measure_calibrates_loop_count_to_min_time():
    clock = FakeClock([0.001])                        # every call takes 1 ms
    m = measure(clock.fn, repeats=3, warmup=0, min_time=0.05, timer=clock.timer)
    assert m.number >= 50
    assert m.median == pytest.approx(0.001) and m.iqr == pytest.approx(0.0, abs=1e-12)


def test_measure_zero_min_time_uses_one_call():
    clock = FakeClock([0.5])
    m = measure(clock.fn, repeats=4, warmup=0, min_time=0.0, timer=clock.timer)
    assert m.number == 1 and m.repeats == 4 and m.median == 0.5


def test_measure_many_interleaves_round_robin():
    order = []
    t = {"now": 0.0}
    fns = {k: (lambda k=k, d=d: (order.append(k), t.__setitem__("now", t["now"] + d)))
           for k, d in (("a", 1.0), ("b", 2.0))}
    ms = measure_many(fns, repeats=3, warmup=0, number=1, timer=lambda: t["now"])
    assert order == ["a", "b"] * 3
    assert ms["a"].median == 1.0 and ms["b"].median == 2.0


@pytest.mark.parametrize("kw, field", [({"repeats": 0}, "repeats"), ({"warmup": -1}, "warmup"),
                                       ({"number": 0}, "number")])
def test_measure_rejects_bad_arguments(kw, field):
    with pytest.raises(ValueError, match=field):
        measure(lambda: None, **kw)


def test_bench_options_defaults_and_overrides():
    full, quick = BenchOptions.make(), BenchOptions.make(quick=True)
    assert quick.quick and quick.repeats < full.repeats and quick.min_time < full.min_time
    o = BenchOptions.make(quick=True, repeats=5, min_time=0.0, sizes=[64, 128])
    assert (o.repeats, o.min_time, o.sizes) == (5, 0.0, (64, 128))
    with pytest.raises(ValueError, match="repeats"):
        BenchOptions.make(repeats=0)
    with pytest.raises(ValueError, match="sizes"):
        BenchOptions.make(sizes=[0])


# ----------------------------------------------------------------------------- tables, goals, JSON

def test_format_table_aligns_columns():
    table = Table("title", [Column("name", "name"), Column("v", "value", "{:.2f}"), Column("ok", "ok")],
                  [{"name": "a", "v": 1.0, "ok": "yes"}, {"name": "longer", "v": 123.456, "ok": None}])
    lines = format_table(table).splitlines()
    assert lines[0] == "title"
    assert lines[1].split() == ["name", "value", "ok"]
    assert set(lines[2]) <= {"-", " "}
    body = lines[3:]
    assert body[0].startswith("a      ") and body[1].startswith("longer ")
    # numbers right-aligned: the value column ends at the same offset on every row
    ends = [line.index(cell) + len(cell) for line, cell in zip(body, ["1.00", "123.46"])]
    assert ends[0] == ends[1] == lines[1].index("value") + len("value")
    assert body[1].rstrip().endswith("-")     # None renders as '-'


def test_goal_lines():
    assert Goal("g", True, "3 us", "< 10 us").line() == "PASS  g: 3 us (target < 10 us)"
    assert Goal("g", False, "30 us").line().startswith("MISS  g: 30 us")
    assert Goal("g", None, "not measured").status == "SKIP"


def test_write_json_is_strict_and_creates_parents(tmp_path):
    path = write_json(tmp_path / "a" / "b.json",
                      {"x": np.float32(1.5), "n": np.int64(3), "bad": math.nan, "inf": math.inf,
                       "arr": np.arange(3), "t": (1, 2)})
    text = path.read_text()
    data = json.loads(text)
    assert data == {"x": 1.5, "n": 3, "bad": None, "inf": None, "arr": [0, 1, 2], "t": [1, 2]}
    assert "NaN" not in text and "Infinity" not in text
    assert not list(path.parent.glob(".*tmp"))


def test_machine_info_and_line():
    info = benchkit.machine_info()
    for key in ("cpu", "logical_cpus", "python", "numpy", "numba", "torch", "numba_threading_layer"):
        assert key in info
    line = benchkit.machine_line(info)
    assert "numba" in line and "NUMBA_THREADING_LAYER=" in line and "cores" in line


# ----------------------------------------------------------------------------- registry

def test_registry_reports_missing_module_cleanly():
    with pytest.raises(SuiteNotAvailable, match="not available yet"):
        benchkit.load_suite("no_such_suite_xyz")
    avail = benchkit.available_suites()
    assert isinstance(avail["fakequant"], benchkit.SuiteSpec)
    assert set(benchkit.KNOWN_SUITES) <= set(avail)


def test_registry_lazy_import_registers_suite(tmp_path, monkeypatch):
    # A suite module dropped into the package is found by name, without touching the registry code.
    pkg = tmp_path / "fakepkg"
    pkg.mkdir()
    (pkg / "__init__.py").write_text("")
    (pkg / "bench_demo.py").write_text(
        "from qatlab.bench.kit import suite, SuiteResult\n"
        "@suite('demo_lazy')\n"
        "def run(opts):\n    'A demo suite.'\n    return SuiteResult(tables=[])\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.setattr(benchkit, "suite_module", lambda name: f"fakepkg.bench_{name.split('_')[0]}")
    monkeypatch.setattr(benchkit, "_REGISTRY", dict(benchkit._REGISTRY))
    spec = benchkit.load_suite("demo_lazy")
    assert spec.name == "demo_lazy" and spec.description == "A demo suite."


def test_registry_does_not_hide_errors_inside_a_suite_module(tmp_path, monkeypatch):
    pkg = tmp_path / "brokenpkg"
    pkg.mkdir()
    (pkg / "__init__.py").write_text("")
    (pkg / "bench_broken.py").write_text("import a_module_that_does_not_exist_qq\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.setattr(benchkit, "suite_module", lambda name: f"brokenpkg.bench_{name}")
    with pytest.raises(ModuleNotFoundError, match="a_module_that_does_not_exist_qq"):
        benchkit.load_suite("broken")


# ----------------------------------------------------------------------------- CLI

TINY = ["--quick", "--sizes", "64,1k", "--repeats", "2", "--min-time", "0"]


def _check_fakequant_json(path: Path, sizes, torch_expected: bool):
    data = json.loads(path.read_text())      # strict JSON (write_json forbids NaN)
    assert data["suite"] == "fakequant"
    assert data["options"]["sizes"] == list(sizes) and data["options"]["repeats"] == 2
    assert {"cpu", "numba", "numpy"} <= set(data["machine"])
    detail = data["tables"][:-1]
    assert [t["rows"][0]["n"] for t in detail] == list(sizes)
    for table in detail:
        rows = table["rows"]
        ops = {(r["op"], r["impl"]) for r in rows}
        assert ("copy", "np.copyto (1 thread)") in ops
        assert ("forward", "FakeQuantize.forward") in ops and ("forward", "kernel fq_forward") in ops
        assert ("forward", "numpy reference") in ops
        for kind in ("identity", "clipped_identity", "tanh", "hard_tanh"):
            assert (f"backward {kind}", "FakeQuantize.backward") in ops
        for r in rows:
            assert r["median_s"] > 0 and r["gelem_s"] > 0 and len(r["samples_s"]) == 2
        torch_rows = [r for r in rows if r["impl"].startswith("torch")]
        fwd = next(r for r in rows if r["impl"] == "FakeQuantize.forward")
        if torch_expected:
            assert {r["threads"] for r in torch_rows} >= {1}
            assert len(torch_rows) == 4 and all(r["speedup"] > 0 for r in torch_rows)
            assert fwd["equal_torch"] is True          # a real bit-for-bit comparison on the data
        else:
            assert torch_rows == [] and fwd["equal_torch"] is None
    statuses = {g["name"]: g["status"] for g in data["goals"]}
    assert all(s in ("PASS", "MISS", "SKIP") for s in statuses.values())
    assert all(s == "SKIP" for name, s in statuses.items() if "16M" in name or "4K" in name)
    return data


@pytest.mark.slow   # the whole fakequant suite through the CLI, timing torch too (the torch-free run stays fast)
def test_cli_fakequant_tiny_writes_valid_json(tmp_path, capsys):
    out = tmp_path / "res" / "fq.json"
    assert bench.main(["fakequant", "--out", str(out), *TINY]) == 0
    printed = capsys.readouterr().out
    assert "np.copyto" in printed and "FakeQuantize.forward" in printed and "SKIP" in printed
    assert f"wrote {out}" in printed
    torch_ok = bench_fakequant._import_torch() is not None
    _check_fakequant_json(out, (64, 1024), torch_ok)


def test_cli_fakequant_without_torch(tmp_path, monkeypatch, capsys):
    monkeypatch.setattr(bench_fakequant, "_import_torch", lambda: None)
    out = tmp_path / "fq.json"
    assert bench.main(["fakequant", "--out", str(out), *TINY]) == 0
    assert "torch not importable" in capsys.readouterr().out
    data = _check_fakequant_json(out, (64, 1024), torch_expected=False)
    assert any(g["status"] == "SKIP" and "torch" in g["name"] for g in data["goals"])


def test_cli_all_runs_available_suites_and_skips_missing_ones(tmp_path, capsys, monkeypatch):
    # Pin the list so the test does not depend on which later suites exist yet.
    monkeypatch.setattr(benchkit, "KNOWN_SUITES", ("fakequant", "no_such_suite_xyz"))
    # Suites other tests imported are registered too: keep only fakequant for this run.
    monkeypatch.setattr(benchkit, "_REGISTRY", {"fakequant": benchkit.load_suite("fakequant")})
    monkeypatch.setattr(bench_fakequant, "_import_torch", lambda: None)   # keep it fast
    assert bench.main(["all", "--out", str(tmp_path), *TINY]) == 0
    printed = capsys.readouterr().out
    assert (tmp_path / "fakequant.json").exists()
    assert "skip: suite 'no_such_suite_xyz' not available yet" in printed
    assert not (tmp_path / "no_such_suite_xyz.json").exists()
    assert "ran 1 suite(s): fakequant" in printed


def test_cli_unknown_or_missing_suite_is_a_clean_error(capsys):
    assert bench.main(["no_such_suite_xyz"]) == 1
    err = capsys.readouterr().err
    assert "not available yet" in err and "Traceback" not in err


@pytest.mark.parametrize("argv", [["fakequant", "--repeats", "0"], ["fakequant", "--sizes", "abc"],
                                  ["fakequant", "--min-time", "-1"]])
def test_cli_rejects_bad_arguments(argv, capsys):
    with pytest.raises(SystemExit) as exc:
        bench.main(argv)
    assert exc.value.code == 2


def test_cli_sizes_accept_suffixes():
    assert bench._parse_sizes("4k,256K,16m,100") == (4096, 262144, 16 * 2**20, 100)


def test_cli_strict_exit_code_on_miss(tmp_path, monkeypatch):
    def fake_suite(opts):
        return SuiteResult(tables=[], goals=[Goal("always missed", False, "x")])
    monkeypatch.setattr(benchkit, "_REGISTRY", dict(benchkit._REGISTRY))
    benchkit.suite("fake_miss")(fake_suite)
    assert bench.main(["fake_miss", "--out", str(tmp_path / "m.json")]) == 0
    assert bench.main(["fake_miss", "--strict", "--out", str(tmp_path / "m.json")]) == 1
    assert json.loads((tmp_path / "m.json").read_text())["goals"][0]["status"] == "MISS"


@pytest.mark.slow
def test_module_entry_point_list():
    proc = subprocess.run([sys.executable, "-m", "qatlab.bench", "--list"], cwd=ROOT,
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    assert "fakequant" in proc.stdout


# ----------------------------------------------------------------------------- suite pieces

def test_numpy_reference_forward_matches_kernel():
    from qatlab.kernels import fakequant as K
    f32 = np.float32
    x = np.random.default_rng(0).standard_normal(1000, dtype=f32) * f32(4)
    s = f32(bench_fakequant.SCALE)
    inv_s = f32(1) / s
    ref = bench_fakequant.numpy_reference_forward(x, inv_s, s, f32(0), f32(-128), f32(127))
    out = np.empty_like(x)
    K.fq_forward(x, inv_s, s, f32(0), f32(-128), f32(127), out)
    assert ref.dtype == np.float32 and np.array_equal(ref, out)


def test_size_label():
    assert [bench_fakequant.size_label(n) for n in (4096, 262144, 16 * 2**20, 1000)] == ["4K", "256K", "16M", "1000"]
