"""Memory estimate of a run (qatlab.resources): parts, budget sources, the refusal before any
allocation, and the estimate against what a real run allocates (tracemalloc)."""
import tracemalloc

import pytest

import qatlab as ql
from qatlab import resources
from qatlab.data import load_dataset
from qatlab.train.trainer import train_experiment


def _cfg(hidden, optimizer="adam", weights="fake", phase=False, batch_size=64, activations="off"):
    c = ql.ExperimentConfig()
    c.data.dataset, c.data.n_samples, c.data.n_features, c.data.n_classes = "synthetic", 4000, 256, 10
    c.model.hidden = hidden
    c.optim.epochs, c.optim.batch_size, c.optim.optimizer = 1, batch_size, optimizer
    c.quant.weights, c.quant.activations, c.phase.enabled = weights, activations, phase
    c.metrics_every = 50
    return c


def test_layer_shapes_of_an_mlp():
    assert resources.layer_shapes(_cfg([32, 16]), 64, 10) == [(64, 32), (32, 16), (16, 10)]
    assert resources.layer_shapes(_cfg([]), 64, 10) == [(64, 10)]


def test_parts_follow_the_config():
    sizes = dict(n_train=1000, n_test=200, n_features=64, n_outputs=10)
    params = 64 * 128 + 128 + 128 * 10 + 10
    est = {opt: ql.estimate_memory(_cfg([128], optimizer=opt), **sizes) for opt in ("sgd", "momentum", "adam")}
    assert est["adam"]["parameters"] == 4 * params
    assert [est[k]["optimizer_state"] for k in ("sgd", "momentum", "adam")] == [0, 4 * params, 8 * params]
    assert est["adam"]["dataset"] == 1200 * (64 * 4 + 8)
    assert est["adam"]["total"] == sum(v for k, v in est["adam"].items() if k != "total")
    bigger = ql.estimate_memory(_cfg([128], batch_size=512), **sizes)
    assert bigger["scratch"] > est["adam"]["scratch"] and bigger["parameters"] == est["adam"]["parameters"]
    assert ql.estimate_memory(_cfg([128], phase=True), **sizes)["phase"] > 0 == est["adam"]["phase"]


def test_budget_from_argument_environment_or_available_memory(monkeypatch):
    monkeypatch.delenv(resources.ENV, raising=False)
    limit, source = resources.memory_budget()
    assert 0 < limit <= resources.available_memory() and "half of the memory available" in source
    monkeypatch.setenv(resources.ENV, "4G")
    assert resources.memory_budget() == (4 << 30, "QATLAB_MEMORY_BUDGET=4G")
    assert resources.memory_budget("512M")[0] == 512 << 20
    assert resources.memory_budget(10_000)[0] == 10_000
    assert resources.parse_bytes("1.5 GiB") == 3 << 29 and resources.parse_bytes("1e6") == 10**6
    for bad in ("lots", "4X", "-1G", "0"):
        monkeypatch.setenv(resources.ENV, bad)
        with pytest.raises(ValueError, match="QATLAB_MEMORY_BUDGET"):
            resources.memory_budget()
    for bad in (0, -5, True, float("nan")):
        with pytest.raises(ValueError, match="budget"):
            resources.memory_budget(bad)


def test_check_memory_names_the_estimate_and_the_budget():
    cfg = _cfg([4096, 4096])
    parts = ql.check_memory(cfg, 1000, 200, 64, 10, budget="1G")
    assert parts["total"] < 1 << 30
    with pytest.raises(ValueError, match=r"run needs ~.* MiB \(parameters .* MiB.*dataset .*\), over the budget "
                                         r"of 1.0 MiB \(the budget argument\)"):
        ql.check_memory(cfg, 1000, 200, 64, 10, budget="1M")


def test_huge_hidden_layers_are_refused_before_anything_is_allocated(monkeypatch):
    monkeypatch.setenv(resources.ENV, "4G")
    cfg = ql.ExperimentConfig()
    cfg.model.hidden = [200_000, 200_000]
    load_dataset(cfg.data)                    # loaded (and cached, if it is) outside the measurement
    tracemalloc.start()
    try:
        with pytest.raises(ValueError, match=r"run needs ~\d+\.\d GiB \(parameters 149\.\d GiB.*over the budget "
                                             r"of 4\.0 GiB \(QATLAB_MEMORY_BUDGET=4G\)"):
            train_experiment(cfg)
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert peak < 64 << 20                    # the digits split, not one hidden layer (149 GiB)


@pytest.mark.slow
@pytest.mark.parametrize("cfg", [_cfg([1024, 1024]), _cfg([2048], "momentum", "ternary", phase=True, batch_size=256),
                                 _cfg([512, 512], activations="fake", batch_size=512)],
                         ids=["fake-adam", "ternary-phase-momentum", "fake-activations"])
def test_estimate_is_within_a_quarter_of_what_a_run_allocates(cfg):
    warm = cfg.copy()                         # imports and kernel compilation outside the measurement
    warm.model.hidden, warm.data.n_samples = [8], 200
    train_experiment(warm)
    data = load_dataset(cfg.data)
    estimate = ql.estimate_memory(cfg, data.n_train, data.n_test, data.n_features, data.n_outputs)["total"]
    del data
    tracemalloc.start()
    try:
        assert train_experiment(cfg).status == "finished"
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert 0.75 * peak <= estimate <= 1.25 * peak, (estimate, peak)
