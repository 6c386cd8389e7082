"""The ``train`` and ``quality`` benchmark suites on tiny problems: structure of tables, goals and JSON.

No timing assertions. Torch is hidden from the suites here (their torch-free path); the PyTorch
reference implementations get their own small tests, skipped when torch is not installed.
"""
from __future__ import annotations

import io
import json

import numpy as np
import pytest

from qatlab import bench

from qatlab.bench import quality as bench_quality, train as bench_train
from qatlab.bench.kit import BenchOptions, load_suite
from qatlab.quant.ste import SteKind

TINY_SHAPES = (((8, 16, 4), 4), ((8, 32, 4), 8))
FAST = BenchOptions(quick=True, repeats=1, warmup=0, min_time=0.0)


def _run(name, opts, tmp_path):
    out = tmp_path / f"{name}.json"
    stream = io.StringIO()
    result = bench.run_suite(name, opts, out, stream=stream)
    payload = json.loads(out.read_text())
    return result, payload, stream.getvalue()


def _check_goals(payload):
    for g in payload["goals"]:
        assert g["status"] in ("PASS", "MISS", "SKIP")
        assert g["status"] == ("SKIP" if g["passed"] is None else ("PASS" if g["passed"] else "MISS"))


# ----------------------------------------------------------------------------- train


@pytest.fixture
def tiny_train(monkeypatch):
    monkeypatch.setattr(bench_train, "SHAPES", TINY_SHAPES)
    monkeypatch.setattr(bench_train, "_import_torch", lambda: None)


def test_train_suite_registered():
    assert load_suite("train").fn is bench_train.run
    assert load_suite("quality").fn is bench_quality.run


@pytest.mark.slow
def test_train_suite_quick_structure(tiny_train, tmp_path):
    result, payload, text = _run("train", FAST, tmp_path)
    assert payload["suite"] == "train"
    titles = [t["title"] for t in payload["tables"]]
    assert len(titles) == 3 and titles[0].startswith("ternary-QAT training step")
    assert titles[1].startswith("breakdown") and titles[2].startswith("first call")

    main = payload["tables"][0]
    assert [r["shape"] for r in main["rows"]] == ["8-16-4 b4", "8-32-4 b8"]
    for r in main["rows"]:
        assert r["qatlab_ms"] > 0 and r["floor_ms"] > 0
        assert r["x_floor"] == pytest.approx(r["qatlab_ms"] / r["floor_ms"])
        assert "torch1_ms" not in r                                    # torch hidden: no torch columns
        assert set(r["raw"]) == {"qatlab", "floor", "one_call"} and r["steps_per_call"] == bench_train.RUN_STEPS
        assert r["one_call_ms"] == pytest.approx(r["raw"]["one_call"]["median_s"] * 1e3)
        assert r["qatlab_ms"] == pytest.approx(r["raw"]["qatlab"]["median_s"] * 1e3)   # per step of a run
    keys = {c["key"] for c in main["columns"]}
    assert {"qatlab_ms", "floor_ms", "x_floor", "torch1_ms", "torch1_x", "torchN_ms", "torchN_x"} <= keys

    breakdown = payload["tables"][1]
    pieces = [r["piece"] for r in breakdown["rows"]]
    for _, label, _ in bench_train.BREAKDOWN:
        assert label in pieces
    assert any(p.startswith("glue") for p in pieces) and any(p.startswith("numpy floor") for p in pieces)
    step_row = next(r for r in breakdown["rows"] if r["kind"] == "step")
    assert step_row["8-16-4 b4_pct"] == pytest.approx(100.0)
    timed = next(r for r in breakdown["rows"] if r["kind"] == "timed")      # tiny shapes: the FusedStep
    assert timed["8-16-4 b4_us"] > 0 and all(r["fused"] for r in main["rows"])

    first = payload["tables"][2]["rows"]
    assert len(first) == 1 and "project cache" in first[0]["mode"]        # quick: one subprocess
    for k in ("import_s", "build_s", "first_step_s", "second_step_s", "total_s"):
        assert first[0][k] > 0

    goals = {g["name"]: g for g in payload["goals"]}
    floor_goals = [g for n, g in goals.items() if "numpy floor" in n]
    assert len(floor_goals) == len(TINY_SHAPES)
    assert all(g["status"] in ("PASS", "MISS") for g in floor_goals)
    torch_goals = [g for n, g in goals.items() if "PyTorch" in n]
    assert len(torch_goals) == 4 and all(g["status"] == "SKIP" for g in torch_goals)
    _check_goals(payload)
    assert "OPENBLAS_NUM_THREADS" in " ".join(payload["notes"])
    assert payload["extra"]["torch_default_threads"] is None
    assert "PASS" in text or "MISS" in text


def test_qatlab_step_trains_and_floor_runs():
    sizes, batch = (8, 16, 4), 16
    x, labels = bench_train._data(sizes, batch)
    step, mlp, grads = bench_train.make_qatlab_step(sizes, batch, x, labels)
    losses = [step() for _ in range(30)]
    assert np.isfinite(losses).all() and losses[-1] < losses[0]      # fixed batch: it memorises
    assert all(q.alpha > 0 for q in mlp.weight_quantizers)
    bench_train.make_numpy_floor(sizes, batch, x)()
    with pytest.raises(ValueError, match="sizes"):
        bench_train.make_numpy_floor((8, 16, 16, 4), batch, np.zeros((batch, 8), np.float32))


@pytest.mark.slow
def test_first_call_cold_cache(tmp_path):
    r = bench_train.first_call((8, 16, 4), 4, cache_dir=str(tmp_path))
    assert r["total_s"] == pytest.approx(r["import_s"] + r["build_s"] + r["first_step_s"])
    assert any(tmp_path.rglob("*.nbi"))                               # the child wrote its Numba cache there


# ----------------------------------------------------------------------------- quality


@pytest.fixture
def tiny_quality(monkeypatch):
    monkeypatch.setattr(bench_quality, "QUICK_EPOCHS", 1)
    monkeypatch.setattr(bench_quality, "_import_torch", lambda: None)
    monkeypatch.setenv(bench_quality.PARTS_ENV, "digits")


def test_quality_config_is_the_recipe():
    cfg = bench_quality.make_config("fake", 4, "tanh")
    assert (cfg.data.dataset, cfg.data.test_fraction, cfg.data.seed) == ("digits", 0.2, 0)
    assert cfg.model.hidden == [256] and cfg.model.activation == "relu"
    assert (cfg.quant.weights, cfg.quant.weight_bits, cfg.quant.ste) == ("fake", 4, SteKind.TANH)
    o = cfg.optim
    assert (o.optimizer, o.lr, o.schedule, o.epochs, o.batch_size, o.seed) == ("adam", 1e-2, "constant", 40, 64, 0)
    assert cfg.phase.enabled is False


@pytest.mark.slow
def test_quality_suite_quick_structure(tiny_quality, tmp_path):
    result, payload, text = _run("quality", FAST, tmp_path)
    main, ste = payload["tables"]
    assert [r["run"] for r in main["rows"]] == ["float", "8-bit fake", "4-bit fake", "ternary"]
    for r in main["rows"]:
        assert r["epochs"] == 1 and r["status"] == "finished"
        assert 0.0 <= r["test_accuracy"] <= 1.0 and r["test_acc_pct"] == pytest.approx(100 * r["test_accuracy"])
        assert r["test_loss"] > 0 and r["seconds"] > 0 and r["steps_per_second"] > 0
        assert "torch_test_accuracy" not in r
    assert {"torch_test_acc_pct", "delta_pp"} <= {c["key"] for c in main["columns"]}
    assert main["rows"][0]["test_accuracy"] > 0.5                     # one epoch already learns digits

    pairs = [(r["run"], r["ste"]) for r in ste["rows"]]
    assert pairs == [(w, k.value) for w in ("ternary", "2-bit fake") for k in SteKind]
    assert ste["rows"][0]["test_accuracy"] == main["rows"][3]["test_accuracy"]   # reused identity run
    assert all(r["bits"] == 2 for r in ste["rows"][4:])

    names = [g["name"] for g in payload["goals"]]
    assert names == ["float test accuracy >= 97%", "8-bit fake test accuracy >= 97%",
                     "4-bit fake test accuracy >= 97%", "ternary test accuracy >= 96%"]
    assert all("quick run: 1 of 40 epochs" in g["measured"] for g in payload["goals"])
    _check_goals(payload)
    assert payload["notes"][0].startswith("QUICK RUN")
    assert payload["extra"] == {"epochs": 1, "quick": True, "torch": False, "parts": ["digits"]}


# ----------------------------------------------------------------------------- torch references


def test_torch_step_matches_qatlab(torch):
    sizes, batch = (8, 16, 4), 8
    x, labels = bench_train._data(sizes, batch)
    check = bench_train._check_same_math(torch, sizes, batch, x, labels)
    assert check["loss_rel_diff"] < 1e-5
    assert check["grad_max_rel_diff"] < 1e-4


def test_torch_reference_quant(torch):
    from qatlab.bench import torch_ref as ref
    from qatlab.quant import FakeQuantize, TernaryQuantizer

    w = np.random.default_rng(0).standard_normal((16, 8)).astype(np.float32)
    lin = ref.QuantLinear(8, 16, "ternary")
    with torch.no_grad():
        lin.weight.copy_(torch.from_numpy(w))
    np.testing.assert_allclose(lin.quantized_weight().detach().numpy(), TernaryQuantizer().forward(w), rtol=1e-6)
    lin4 = ref.QuantLinear(8, 16, "fake", bits=4)
    with torch.no_grad():
        lin4.weight.copy_(torch.from_numpy(w))
    fq = FakeQuantize(bits=4, symmetric=True)
    fq.calibrate(w)
    np.testing.assert_array_equal(lin4.quantized_weight().detach().numpy(), fq.forward(w))
    wq = lin4.quantized_weight()
    wq.sum().backward()                                             # identity STE: gradient of sum is 1
    np.testing.assert_array_equal(lin4.weight.grad.numpy(), np.ones_like(w))


@pytest.mark.slow
def test_torch_reference_train(torch):
    from qatlab.bench import torch_ref as ref
    from qatlab.data import make_synthetic

    ds = make_synthetic("classification", n_samples=200, n_features=8, n_classes=3, seed=0)
    r = ref.train(ds, (8, 16, 3), "ternary", epochs=2, batch_size=32)
    assert r["status"] == "finished" and r["steps"] == 2 * -(-ds.n_train // 32)
    assert 0.0 <= r["test_accuracy"] <= 1.0 and r["seconds"] > 0


# ----------------------------------------------------------------------------- conv


@pytest.mark.slow   # runs the conv suite: times training steps of the LeNet Cnn (as the train suite's test)
def test_conv_suite_quick_structure(monkeypatch, tmp_path):
    from qatlab.bench import conv as bench_conv

    monkeypatch.setattr(bench_conv, "_import_torch", lambda: None)
    opts = BenchOptions(quick=True, repeats=1, warmup=0, min_time=0.0, sizes=(8,))
    result, payload, text = _run("conv", opts, tmp_path)
    assert load_suite("conv").fn is bench_conv.run
    rows = payload["tables"][0]["rows"]
    assert [r["kind"] for r in rows] == ["float", "fake4pc", "ternary"]
    for r in rows:
        assert r["qatlab_ms"] > 0 and r["floor_ms"] > 0 and "torch1_ms" not in r
        assert r["x_floor"] == pytest.approx(r["qatlab_ms"] / r["floor_ms"])
        assert r["x_float"] == pytest.approx(r["qatlab_ms"] / rows[0]["qatlab_ms"])
        assert r["qatlab_ms"] == pytest.approx(r["raw"]["qatlab"]["median_s"] * 1e3)
    pieces = payload["tables"][1]["rows"]
    assert [r["kind"] for r in pieces] == ["float", "fake4pc", "ternary"]
    for r in pieces:
        assert r["forward_ms"] > 0 and r["step_ms"] > 0
        assert r["forward_ms"] + r["backward_ms"] + r["optimizer_ms"] == pytest.approx(r["step_ms"])
    goals = payload["goals"]
    assert len(goals) == 3 + 3 + 2
    assert all(g["status"] == "SKIP" for g in goals[:3])             # torch hidden
    for g, r in zip(goals[3:6], rows):                                # PASS/MISS follows the numbers
        assert g["passed"] == (r["x_floor"] <= bench_conv.GOAL_FLOOR)
    for g, r in zip(goals[6:], rows[1:]):
        assert g["passed"] == (r["x_float"] <= bench_conv.GOAL_QUANT)
    _check_goals(payload)
    assert payload["extra"]["batch"] == 8 and payload["extra"]["torch"] is False


def test_conv_goals_follow_numbers():
    from qatlab.bench import conv as bench_conv

    def row(q, floor, fl, torch_best=None):
        r = {"qatlab_ms": q, "floor_ms": floor, "x_floor": q / floor, "x_float": q / fl}
        if torch_best is not None:
            r.update(torch_best_ms=torch_best, x_torch=torch_best / q)
        return r
    rows = {"float": row(10, 6, 10, 16), "fake4pc": row(12.5, 6, 10, 20), "ternary": row(11, 5, 10, 16)}
    status = [g.status for g in bench_conv.goals(rows)]
    assert status == ["PASS", "PASS", "MISS", "PASS", "MISS", "MISS", "MISS", "PASS"]


def test_conv_floor_and_steps_train():
    from qatlab.bench import conv as bench_conv

    x, labels = bench_conv.data(8)
    for _, _, weights, bits, pc in bench_conv.KINDS:
        step, model = bench_conv.make_qatlab_step(weights, bits, pc, x, labels)
        losses = [step() for _ in range(15)]
        assert np.isfinite(losses).all() and losses[-1] < losses[0]     # a fixed batch is memorised
    bench_conv.make_floor(8)()


@pytest.mark.slow   # trains the Cnn of each kind three steps, in qatlab and in its torch twin
def test_conv_torch_twin_same_math(torch):
    from qatlab.bench import conv as bench_conv

    x, labels = bench_conv.data(8)
    for _, _, weights, bits, pc in bench_conv.KINDS:
        check = bench_conv.same_math(weights, bits, pc, x, labels)
        assert abs(check["qatlab_losses"][0] - check["torch_losses"][0]) < 1e-5 * check["torch_losses"][0]
        assert check["max_rel_diff"] < 1e-2


def test_quality_parts_env(monkeypatch):
    monkeypatch.delenv(bench_quality.PARTS_ENV, raising=False)
    assert bench_quality.parts() == ("digits", "cnn")
    monkeypatch.setenv(bench_quality.PARTS_ENV, " cnn ")
    assert bench_quality.parts() == ("cnn",)
    monkeypatch.setenv(bench_quality.PARTS_ENV, "digits,imagenet")
    with pytest.raises(ValueError, match="QATLAB_BENCH_QUALITY_PARTS"):
        bench_quality.parts()


def test_cnn_quality_configs_are_the_recipes():
    from qatlab.bench import quality_cnn as q

    cfg = q.mnist_config("fake", 4, True, "tanh", seed=2)
    assert (cfg.data.dataset, cfg.data.test_fraction, cfg.data.seed) == ("mnist", 0.2, 0)
    m = cfg.model
    assert (m.architecture, m.conv_channels, m.kernel_size, m.pool, m.hidden) == ("cnn", [16, 32], 5, 2, [])
    assert (cfg.quant.weights, cfg.quant.weight_bits, cfg.quant.per_channel, cfg.quant.ste) == ("fake", 4, True,
                                                                                               SteKind.TANH)
    o = cfg.optim
    assert (o.optimizer, o.lr, o.schedule, o.epochs, o.batch_size, o.seed) == ("adam", 1e-3, "constant", 20, 64, 2)
    assert q.mnist1d_config("mlp").model.architecture == "mlp" and q.mnist1d_config("cnn").data.dataset == "mnist1d"


@pytest.mark.slow
def test_quality_cnn_quick_structure(monkeypatch, tmp_path):
    from qatlab.bench import quality_cnn as q

    monkeypatch.setattr(bench_quality, "_import_torch", lambda: None)
    monkeypatch.setenv(bench_quality.PARTS_ENV, "cnn")
    result, payload, text = _run("quality", FAST, tmp_path)
    main, ste, one_d = payload["tables"]
    assert [r["key"] for r in main["rows"]] == ["float", "fake4pc", "ternary"]
    for r in main["rows"]:
        assert r["seeds"] == [0] and r["status"] == "finished" and "torch_acc_pct" not in r
        accs = [s["test_accuracy"] for s in r["per_seed"]]
        assert r["test_accuracy"] == pytest.approx(sum(accs) / len(accs))
        assert r["min_pct"] <= r["acc_pct"] <= r["max_pct"]
    assert main["rows"][0]["test_accuracy"] > 0.5                     # one epoch already learns mnist
    pairs = [(r["run"], r["ste"]) for r in ste["rows"]]
    assert pairs == [(w, k.value) for w in ("4-bit per-channel", "ternary") for k in SteKind]
    assert ste["rows"][0]["test_accuracy"] == main["rows"][1]["per_seed"][0]["test_accuracy"]
    assert [r["key"] for r in one_d["rows"]] == ["cnn", "mlp"]
    goals = payload["goals"]
    assert len(goals) == 4 and all("quick run" in g["measured"] for g in goals)
    floors = [f for *_, f in q.MNIST_RUNS] + [q.MNIST1D_GOAL]
    accs = [r["test_accuracy"] for r in main["rows"]] + [one_d["rows"][0]["test_accuracy"]]
    assert [g["passed"] for g in goals] == [a >= f for a, f in zip(accs, floors)]   # from the numbers
    _check_goals(payload)
    assert payload["extra"]["parts"] == ["cnn"] and payload["extra"]["cnn"]["seeds"] == [0]


def test_torch_cnn_twin_matches_qatlab(torch):
    from qatlab.bench import torch_ref as ref
    from qatlab.data import Dataset
    from qatlab.nn.cnn import Cnn

    model = Cnn((1, 12, 12), [3, 4], 5, hidden=[6], kernel_size=3, pool=2, seed=1)
    params = [(model.weights(i), model.biases(i)) for i in range(model.num_layers)]
    twin = ref.TorchCnn((1, 12, 12), (3, 4), 3, 2, (6,), 5, params=params)
    x = np.random.default_rng(0).random((7, 1, 12, 12), dtype=np.float32)
    with torch.no_grad():
        want = twin(torch.from_numpy(x)).numpy()
    np.testing.assert_allclose(model.forward(x, model.scratch(7)), want, rtol=1e-5, atol=1e-6)
    with pytest.raises(ValueError, match="params"):
        ref.TorchCnn((1, 12, 12), (3,), 3, 2, (), 5, params=params)

    rng = np.random.default_rng(1)
    X, y = rng.random((90, 144), dtype=np.float32), rng.integers(0, 5, 90).astype(np.int64)
    ds = Dataset(X[:70], y[:70], X[70:], y[70:], 5, "classification", "tiny", image_shape=(1, 12, 12))
    for quant, pc in (("float", False), ("fake", True), ("ternary", False)):
        r = ref.train_cnn(ds, (1, 12, 12), (3,), 3, 2, (), quant, 4, pc, epochs=2, batch_size=32)
        assert r["status"] == "finished" and r["steps"] == 2 * 3 and 0.0 <= r["test_accuracy"] <= 1.0
