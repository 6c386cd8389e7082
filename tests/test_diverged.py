"""Every numeric blow-up ends a run as ``diverged`` with the quantity and the step named, in every
mode (Python step, fused step and runs, LSQ scales, per-channel, phase training with block runs,
gradient accumulation and max_grad_norm=0); ``failed`` is left for bugs."""
import re

import numpy as np
import pytest

import qatlab as ql
from qatlab.diverged import NonFiniteError
from qatlab.train import trainer
from qatlab.train.trainer import train_experiment


def _cfg(**fields):
    """A tiny synthetic run (300 samples, 16 features, 4 classes, hidden [32], batch 32), with
    ``section__field=value`` overrides."""
    c = ql.ExperimentConfig()
    c.data.dataset, c.data.n_samples, c.data.n_features, c.data.n_classes = "synthetic", 300, 16, 4
    c.model.hidden, c.optim.epochs, c.optim.batch_size = [32], 2, 32
    for key, value in fields.items():
        section, name = key.split("__")
        setattr(getattr(c, section), name, value)
    return c


def _blow_up(**fields):
    """mse + SGD (unless given) at a learning rate that overflows the gradient within a few steps."""
    return _cfg(**{"optim__loss": "mse", "optim__optimizer": "sgd", **fields})


def _assert_diverged(result, quantity: str):
    assert result.status == "diverged", (result.status, result.message)
    assert "\n" not in result.message
    m = re.search(r"at step (\d+) \(epoch (\d+)\)", result.message)
    assert m, result.message
    assert re.search(quantity, result.message), result.message
    step = int(m.group(1))
    assert result.final["steps"] in (step - 1, step)      # the step seen, or the one before it made
    return step


@pytest.mark.slow
@pytest.mark.filterwarnings("ignore::RuntimeWarning")   # numpy warns on the way to inf
@pytest.mark.parametrize("fields, quantity", [
    ({"quant__weights": "fake", "optim__lr": 1000.0}, r"parameter w\d became NaN or inf"),      # Python step
    ({"quant__weights": "fake", "quant__per_channel": True, "optim__lr": 1000.0}, r"parameter w\d became"),
    ({"quant__weights": "float", "quant__activations": "fake", "optim__lr": 100.0}, r"loss became inf"),
    ({"quant__weights": "ternary", "optim__lr": 100.0}, r"loss became inf"),                   # fused runs
    ({"quant__weights": "float", "optim__lr": 1000.0, "optim__loss": "cross_entropy"}, r"loss became nan"),
], ids=["python-fake", "python-per-channel", "python-activations", "fused-ternary", "fused-float"])
def test_plain_and_fused_training(fields, quantity):
    _assert_diverged(train_experiment(_blow_up(**fields)), quantity)


@pytest.mark.slow
@pytest.mark.parametrize("fields", [
    {"optim__lr": 10.0},                                                        # Adam: ~lr per step in log s
    {"optim__lr": 100.0, "quant__per_channel": True},
    {"optim__lr": 1000.0, "optim__optimizer": "sgd", "optim__loss": "mse", "quant__per_channel": True},
    {"optim__lr": 100.0, "phase__enabled": True, "optim__epochs": 4},
], ids=["adam", "per-channel", "per-channel-sgd", "phase"])
def test_lsq_scale_leaving_float32(fields):
    """Was ``failed``: ``ValueError: scale: must be a finite number > 0 ... got inf``."""
    result = train_experiment(_cfg(quant__weights="fake", quant__scale_mode="lsq", **fields))
    _assert_diverged(result, r"LSQ scale of layer \d became (inf|\d\.\d+e\+\d+)")


@pytest.mark.slow
@pytest.mark.filterwarnings("ignore::RuntimeWarning")   # numpy warns on the way to inf
@pytest.mark.parametrize("fields", [
    {"quant__weights": "fake"},                                   # PhaseStepper.step, Python backward
    {"quant__weights": "fake", "phase__gradient_accumulation": 2},
    {"quant__weights": "ternary", "optim__lr": 100.0},            # fused backward runs and block runs
    {"quant__weights": "ternary", "phase__gradient_accumulation": 2, "optim__lr": 100.0},
], ids=["python", "python-accumulation", "fused", "fused-accumulation"])
def test_phase_training_without_clipping(fields):
    """Was ``failed``: ``grads[...] contains NaN or inf`` from the phase trainer's check."""
    fields.setdefault("optim__lr", 1.0)
    result = train_experiment(_blow_up(phase__enabled=True, phase__max_grad_norm=0.0, **fields))
    _assert_diverged(result, r"(gradient of [wb]\d.* became NaN or inf|loss became inf|parameter w\d became)")


@pytest.mark.slow
def test_non_finite_parameter_with_a_finite_loss_is_caught_at_the_next_metrics_row(monkeypatch):
    """An inf latent weight behind a fake quantizer saturates: the step's loss stays finite (the
    next one is not); the parameter check at the step's metrics row sees it first."""
    built, build = [], trainer.build_model

    def capture(*args, **kw):
        built.append(build(*args, **kw))
        return built[-1]

    monkeypatch.setattr(trainer, "build_model", capture)

    def report(step, total):
        if step == 9:           # before step 10, which logs a row
            built[0].weights(0)[0, 0] = np.inf
        return True

    cfg = _cfg(quant__weights="fake", quant__scale_mode="lsq", quant__ste="clipped_identity")
    cfg.metrics_every = 10
    result = train_experiment(cfg, report=report)
    assert _assert_diverged(result, r"parameter w0 became NaN or inf") == 10


@pytest.mark.slow
def test_run_and_compare_ste_end_diverged_not_failed():
    cfg = _cfg(quant__weights="fake", quant__scale_mode="lsq", optim__lr=10.0)
    run = ql.run_experiment(cfg)
    _assert_diverged(run, r"LSQ scale of layer \d")
    results = ql.compare_ste(cfg)
    assert sorted(r.status for r in results.values()) == ["diverged"] * 4


def test_non_finite_error_is_a_value_error_naming_the_quantity():
    err = NonFiniteError("scale: went to inf", "LSQ scale of layer 1", float("inf"))
    assert isinstance(err, ValueError) and err.describe(37) == "LSQ scale of layer 1 became inf at step 37"
    assert NonFiniteError("x: observed NaN").describe(3) == "x: observed NaN became NaN or inf at step 3"
    layout = ql.train.predictors.ParamLayout([("w0", (2, 2)), ("b0", (2,))])
    grads = np.zeros(6, np.float32)
    grads[4] = np.nan
    with pytest.raises(NonFiniteError, match=r"grads\['b0'\]: contains NaN or inf") as info:
        layout.check_flat(grads)
    assert info.value.quantity == "gradient of b0"


def test_hidden_sizes_must_be_ints_not_bools():
    cfg = _cfg()
    cfg.model.hidden = [True]
    with pytest.raises(ValueError, match=r"ModelConfig.hidden\[0\]: must be an int in 1..1000000, got True"):
        train_experiment(cfg)
