"""Param configs: defaults as documented, bounds that raise ValueError naming the field and leave the
object unchanged, cross-field validate() rules, to_dict/from_dict/copy round trips (JSON-ready)."""
from __future__ import annotations

import json

import numpy as np
import pytest

import qatlab as ql
from qatlab.config import (DataConfig, ExperimentConfig, ModelConfig, OptimConfig, PhaseConfig, PredictionConfig,
                           QatConfig, QuantConfig, TernaryConfig, VSAConfig)
from qatlab.quant.ste import SteKind

ALL_CONFIGS = [DataConfig, ModelConfig, QuantConfig, OptimConfig, PredictionConfig, TernaryConfig, VSAConfig,
               PhaseConfig, ExperimentConfig, QatConfig]


# ----------------------------------------------------------------------------- defaults

def test_public_names_are_exported():
    for cls in ALL_CONFIGS:
        assert getattr(ql, cls.__name__) is cls


def test_experiment_defaults_match_design():
    d = ExperimentConfig().to_dict()
    assert d["data"] == {"dataset": "digits", "test_fraction": 0.2, "seed": 0, "n_samples": 2000,
                         "n_features": 64, "n_classes": 10, "path": ""}
    assert d["model"] == {"hidden": [256], "activation": "relu", "architecture": "mlp", "conv_channels": [16, 32],
                          "kernel_size": 5, "pool": 2}
    assert d["quant"] == {"weights": "ternary", "weight_bits": 4, "activations": "off", "activation_bits": 8,
                          "symmetric": True, "per_channel": False, "scale_mode": "observer", "ste": "identity",
                          "activation_ste": "clipped_identity"}
    assert {k: d["optim"][k] for k in ("optimizer", "lr", "schedule", "epochs", "batch_size", "seed")} == {
        "optimizer": "adam", "lr": 1e-2, "schedule": "constant", "epochs": 40, "batch_size": 64, "seed": 0}
    assert d["phase"]["enabled"] is False
    assert d["metrics_every"] == 10


def test_phase_defaults_match_issue():
    p = PhaseConfig()
    assert (p.warmup_steps, p.full_steps, p.predict_steps, p.correct_every, p.gradient_accumulation,
            p.max_grad_norm, p.adaptive_phases, p.loss_threshold, p.predictor) == (
        0, 10, 40, 10, 1, 1.0, True, 0.1, "momentum")
    assert p.prediction.to_dict() == {"history_size": 5, "momentum": 0.9, "correction_weight": 0.5,
                                      "history_decay": 0.95, "residual_threshold": 0.5, "learned_gain": True}
    assert p.history_storage == "float32"
    assert p.ternary.to_dict() == {"ternary_threshold": 0.5, "stochastic_rounding": True, "seed": 0}
    assert p.vsa.to_dict() == {"dimension": 8192, "compression_ratio": 0.001, "seed": 42}


def test_qat_config_defaults():
    assert QatConfig().to_dict() == {"lr": 0.01, "epochs": 100, "clip_threshold": 1.0, "log_every": 10,
                                     "batch_size": 1, "ste": "identity", "seed": 0}


def test_nested_defaults_and_lists_are_not_shared_between_instances():
    a, b = ExperimentConfig(), ExperimentConfig()
    for sub in ("data", "model", "quant", "optim", "phase"):
        assert getattr(a, sub) is not getattr(b, sub)
    assert a.phase.prediction is not b.phase.prediction
    a.model.hidden.append(7)
    a.optim.lr = 0.5
    assert b.model.hidden == [256] and ExperimentConfig().model.hidden == [256]
    assert b.optim.lr == 1e-2 and ModelConfig().hidden == [256]


# ----------------------------------------------------------------------------- bounds

# (config class, field, a value outside its bounds or type); assignment must raise ValueError
# naming "<Class>.<field>" and leave the object exactly as it was.
BAD_VALUES = [
    (DataConfig, "dataset", "cifar10"), (DataConfig, "test_fraction", 0.04), (DataConfig, "test_fraction", 0.51),
    (DataConfig, "seed", -1), (DataConfig, "seed", 2**31), (DataConfig, "n_samples", 19),
    (DataConfig, "n_features", 0), (DataConfig, "n_classes", 1), (DataConfig, "path", 3),
    (ModelConfig, "hidden", "256"), (ModelConfig, "activation", "gelu"),
    (QuantConfig, "weights", "binary"), (QuantConfig, "weight_bits", 0), (QuantConfig, "weight_bits", 17),
    (QuantConfig, "activations", "on"), (QuantConfig, "activation_bits", 0), (QuantConfig, "activation_bits", 17),
    (QuantConfig, "scale_mode", "minmax"), (QuantConfig, "ste", "straight"), (QuantConfig, "activation_ste", "x"),
    (QuantConfig, "symmetric", "yes"),
    (OptimConfig, "optimizer", "rmsprop"), (OptimConfig, "lr", 0.0), (OptimConfig, "lr", -1e-3),
    (OptimConfig, "lr", 1000.5), (OptimConfig, "lr", float("nan")), (OptimConfig, "lr", float("inf")),
    (OptimConfig, "lr", "0.1"), (OptimConfig, "schedule", "linear"), (OptimConfig, "epochs", 0),
    (OptimConfig, "epochs", 1.5), (OptimConfig, "batch_size", 0), (OptimConfig, "batch_size", 65_537),
    (OptimConfig, "momentum", 1.0), (OptimConfig, "momentum", -0.1), (OptimConfig, "weight_decay", 1.5),
    (OptimConfig, "max_grad_norm", -1.0), (OptimConfig, "loss", "hinge"),
    (PredictionConfig, "history_size", 1), (PredictionConfig, "history_size", 65),
    (PredictionConfig, "momentum", 2.5), (PredictionConfig, "correction_weight", 1.5),
    (PredictionConfig, "history_decay", 0.0), (PredictionConfig, "residual_threshold", -0.1),
    (PhaseConfig, "history_storage", "float16"), (TernaryConfig, "ternary_threshold", -1.0),
    (VSAConfig, "dimension", 63), (VSAConfig, "compression_ratio", 0.0), (VSAConfig, "compression_ratio", 1.1),
    (PhaseConfig, "warmup_steps", -1), (PhaseConfig, "full_steps", -1), (PhaseConfig, "predict_steps", -1),
    (PhaseConfig, "correct_every", 0), (PhaseConfig, "gradient_accumulation", 0),
    (PhaseConfig, "gradient_accumulation", 1025), (PhaseConfig, "max_grad_norm", -0.5),
    (PhaseConfig, "predictor", "kalman"), (PhaseConfig, "prediction", TernaryConfig()),
    (ExperimentConfig, "metrics_every", 0), (ExperimentConfig, "data", 5),
    (ExperimentConfig, "optim", DataConfig()),
    (QatConfig, "lr", 0.0), (QatConfig, "clip_threshold", 0.0), (QatConfig, "log_every", -1),
    (QatConfig, "ste", "nope"),
]


@pytest.mark.parametrize("cls,field,value", BAD_VALUES,
                         ids=[f"{c.__name__}.{f}={v!r}" for c, f, v in BAD_VALUES])
def test_out_of_bounds_assignment_raises_naming_field_and_leaves_object_unchanged(cls, field, value):
    cfg = cls()
    before = cfg.to_dict()
    with pytest.raises(ValueError, match=rf"{cls.__name__}\.{field}"):
        setattr(cfg, field, value)
    assert cfg.to_dict() == before


@pytest.mark.parametrize("cls,field,value", BAD_VALUES[::4],
                         ids=[f"{c.__name__}.{f}={v!r}" for c, f, v in BAD_VALUES[::4]])
def test_out_of_bounds_constructor_raises_naming_field(cls, field, value):
    with pytest.raises(ValueError, match=rf"{cls.__name__}\.{field}"):
        cls(**{field: value})


def test_hidden_items_must_be_ints():
    cfg = ModelConfig()
    with pytest.raises(TypeError, match=r"ModelConfig\.hidden"):
        cfg.hidden = [64, 1.5]
    assert cfg.hidden == [256]


def test_bounds_of_nested_config_reached_through_parent():
    cfg = ExperimentConfig()
    before = cfg.to_dict()
    with pytest.raises(ValueError, match=r"OptimConfig\.lr"):
        cfg.optim.lr = -1.0
    with pytest.raises(ValueError, match=r"VSAConfig\.dimension"):
        cfg.phase.vsa.dimension = 1
    assert cfg.to_dict() == before


@pytest.mark.parametrize("cls,field,value", [
    (OptimConfig, "lr", 1e3), (OptimConfig, "lr", 1e-9), (OptimConfig, "momentum", 0.0),
    (DataConfig, "test_fraction", 0.05), (DataConfig, "test_fraction", 0.5), (QuantConfig, "weight_bits", 1),
    (QuantConfig, "weight_bits", 16), (PredictionConfig, "history_decay", 1.0), (VSAConfig, "compression_ratio", 1.0),
    (PhaseConfig, "gradient_accumulation", 1024), (ModelConfig, "hidden", []), (OptimConfig, "batch_size", 65_536),
])
def test_boundary_values_are_accepted(cls, field, value):
    cfg = cls(**{field: value})
    assert getattr(cfg, field) == value
    cfg.validate()


def test_ste_fields_accept_stekind_and_serialise_as_strings():
    q = QuantConfig(ste=SteKind.TANH)
    q.activation_ste = SteKind.HARD_TANH
    d = q.to_dict()
    assert d["ste"] == "tanh" and d["activation_ste"] == "hard_tanh"
    assert type(d["ste"]) is str
    json.dumps(d)
    assert QuantConfig.from_dict(d).ste == SteKind.TANH


# ----------------------------------------------------------------------------- validate()

@pytest.mark.parametrize("make,match", [
    (lambda: DataConfig(dataset="file"), r"DataConfig\.path"),
    (lambda: ModelConfig(hidden=[64, 0]), r"ModelConfig\.hidden\[1\]"),
    (lambda: ModelConfig(hidden=[-3]), r"ModelConfig\.hidden\[0\]"),
    (lambda: ModelConfig(hidden=[1_000_001]), r"ModelConfig\.hidden\[0\]"),
    (lambda: QuantConfig(weights="ternary", per_channel=True), r"QuantConfig\.per_channel"),
    (lambda: QuantConfig(weights="float", per_channel=True), r"QuantConfig\.per_channel"),
    (lambda: PhaseConfig(warmup_steps=0, full_steps=0, predict_steps=0), r"PhaseConfig"),
    (lambda: PhaseConfig(full_steps=0, predict_steps=5), r"PhaseConfig\.full_steps"),
])
def test_validate_rules_raise_naming_fields(make, match):
    cfg = make()
    before = cfg.to_dict()
    with pytest.raises(ValueError, match=match):
        cfg.validate()
    assert cfg.to_dict() == before


@pytest.mark.parametrize("make", [
    lambda: DataConfig(dataset="file", path="x.npz"),
    lambda: ModelConfig(hidden=[]),
    lambda: ModelConfig(hidden=[1, 1_000_000]),
    lambda: QuantConfig(weights="fake", per_channel=True),
    lambda: QuantConfig(weights="fake", weight_bits=1, symmetric=True),
    lambda: PhaseConfig(warmup_steps=5, full_steps=0, predict_steps=0),
    lambda: PhaseConfig(full_steps=3, predict_steps=0),
    lambda: ExperimentConfig(),
])
def test_validate_accepts_valid_combinations(make):
    make().validate()


@pytest.mark.parametrize("edit,match", [
    (lambda c: setattr(c.data, "dataset", "file"), r"DataConfig\.path"),
    (lambda c: setattr(c.model, "hidden", [0]), r"ModelConfig\.hidden\[0\]"),
    (lambda c: setattr(c.quant, "per_channel", True), r"QuantConfig\.per_channel"),
    (lambda c: (setattr(c.phase, "full_steps", 0), setattr(c.phase, "predict_steps", 4)), r"PhaseConfig\.full_steps"),
])
def test_experiment_validate_checks_every_nested_config(edit, match):
    cfg = ExperimentConfig()
    edit(cfg)
    with pytest.raises(ValueError, match=match):
        cfg.validate()


def test_run_rejects_invalid_config_before_training():
    cfg = ExperimentConfig(model=ModelConfig(hidden=[0]))
    with pytest.raises(ValueError, match=r"ModelConfig\.hidden"):
        ql.LocalRun(cfg)


# ----------------------------------------------------------------------------- dicts and copies

def _non_default_experiment() -> ExperimentConfig:
    return ExperimentConfig(
        data=DataConfig(dataset="synthetic", test_fraction=0.25, seed=3, n_samples=300, n_features=7, n_classes=4),
        model=ModelConfig(hidden=[32, 16], activation="tanh"),
        quant=QuantConfig(weights="fake", weight_bits=3, activations="fake", activation_bits=6, symmetric=False,
                          per_channel=True, scale_mode="lsq", ste=SteKind.HARD_TANH, activation_ste="tanh"),
        optim=OptimConfig(optimizer="momentum", lr=0.05, schedule="cosine", epochs=3, batch_size=17, seed=9,
                          momentum=0.8, weight_decay=1e-4, max_grad_norm=2.5, loss="mse"),
        phase=PhaseConfig(enabled=True, warmup_steps=2, full_steps=4, predict_steps=12, correct_every=3,
                          gradient_accumulation=2, max_grad_norm=0.0, adaptive_phases=False, loss_threshold=0.2,
                          predictor="least_squares", history_storage="ternary",
                          prediction=PredictionConfig(history_size=7, momentum=1.1, correction_weight=0.25,
                                                      history_decay=0.9, residual_threshold=0.3),
                          ternary=TernaryConfig(ternary_threshold=0.7, stochastic_rounding=False, seed=5),
                          vsa=VSAConfig(dimension=1024, compression_ratio=0.5, seed=1)),
        metrics_every=3)


@pytest.mark.parametrize("cls", ALL_CONFIGS)
def test_to_dict_from_dict_round_trip_defaults(cls):
    cfg = cls()
    d = cfg.to_dict()
    assert "name" not in d
    assert set(d) == set(cls.param) - {"name"}
    assert json.loads(json.dumps(d)) == d
    back = cls.from_dict(d)
    assert type(back) is cls and back.to_dict() == d


def test_round_trip_non_default_nested_through_json():
    cfg = _non_default_experiment()
    cfg.validate()
    d = cfg.to_dict()
    text = json.dumps(d)
    back = ExperimentConfig.from_dict(json.loads(text))
    assert back.to_dict() == d
    assert isinstance(back.phase.prediction, PredictionConfig) and back.phase.prediction.history_size == 7
    assert back.quant.ste == SteKind.HARD_TANH and back.model.hidden == [32, 16]
    assert d["phase"]["vsa"] == {"dimension": 1024, "compression_ratio": 0.5, "seed": 1}


def test_from_dict_skips_retired_fields_of_stored_configs():
    old = ExperimentConfig().to_dict()
    old["phase"]["ternary"]["accumulation_steps"] = 3        # removed: it never changed a run
    back = ExperimentConfig.from_dict(old)
    assert "accumulation_steps" not in back.phase.ternary.to_dict() and back.to_dict() != old
    with pytest.raises(ValueError, match=r"TernaryConfig: unknown field 'accumulation_step'"):
        TernaryConfig.from_dict({"accumulation_step": 3})


def test_from_dict_partial_uses_defaults():
    cfg = ExperimentConfig.from_dict({"optim": {"lr": 0.3}, "metrics_every": 2})
    assert cfg.optim.lr == 0.3 and cfg.optim.epochs == 40 and cfg.metrics_every == 2
    assert cfg.model.hidden == [256]


@pytest.mark.parametrize("cls,d,match", [
    (ExperimentConfig, {"learning_rate": 0.1}, r"ExperimentConfig.*'learning_rate'"),
    (ExperimentConfig, {"optim": {"lr": 0.1, "nesterov": True}}, r"OptimConfig.*'nesterov'"),
    (ExperimentConfig, {"phase": {"vsa": {"dim": 3}}}, r"VSAConfig.*'dim'"),
    (OptimConfig, {"name": "x"}, r"OptimConfig.*'name'"),
])
def test_from_dict_unknown_key_raises_naming_it(cls, d, match):
    with pytest.raises(ValueError, match=match):
        cls.from_dict(d)


def test_from_dict_out_of_bounds_value_raises_naming_field():
    with pytest.raises(ValueError, match=r"OptimConfig\.lr"):
        ExperimentConfig.from_dict({"optim": {"lr": -1.0}})
    with pytest.raises(ValueError, match=r"QuantConfig\.ste"):
        ExperimentConfig.from_dict({"quant": {"ste": "nope"}})


def test_from_dict_accepts_config_instances_for_nested_fields():
    cfg = ExperimentConfig.from_dict({"optim": OptimConfig(lr=0.2)})
    assert cfg.optim.lr == 0.2


def test_to_dict_returns_fresh_lists():
    cfg = ModelConfig(hidden=[8, 4])
    d = cfg.to_dict()
    d["hidden"].append(99)
    assert cfg.hidden == [8, 4]


def test_copy_is_deep_and_equal():
    cfg = _non_default_experiment()
    dup = cfg.copy()
    assert type(dup) is ExperimentConfig and dup.to_dict() == cfg.to_dict()
    assert dup.optim is not cfg.optim and dup.phase.prediction is not cfg.phase.prediction
    assert dup.model.hidden is not cfg.model.hidden
    dup.optim.lr = 0.9
    dup.model.hidden.append(3)
    dup.phase.prediction.history_size = 2
    assert cfg.optim.lr == 0.05 and cfg.model.hidden == [32, 16] and cfg.phase.prediction.history_size == 7


def test_copy_of_sub_config():
    q = QuantConfig(weights="fake", weight_bits=2)
    dup = q.copy()
    assert type(dup) is QuantConfig and dup.to_dict() == q.to_dict() and dup is not q


def _cnn_on_file(path) -> ql.ExperimentConfig:
    cfg = ql.ExperimentConfig()
    cfg.model.architecture, cfg.model.hidden = "cnn", []
    cfg.data.dataset, cfg.data.path = "file", str(path)
    return cfg


def test_a_cnn_on_a_file_of_flat_features_is_refused_before_loading(tmp_path):
    rng = np.random.default_rng(0)
    np.savez(tmp_path / "flat.npz", X=rng.normal(size=(20, 6)).astype(np.float32), y=np.arange(20) % 2)
    (tmp_path / "rows.csv").write_text("0.5,1.5,0\n2.5,3.5,1\n")
    for name in ("flat.npz", "rows.csv"):
        with pytest.raises(ValueError, match=f"ModelConfig.architecture: 'cnn' needs images .* the file {name} "
                                             "holds flat features -- use architecture='mlp'"):
            _cnn_on_file(tmp_path / name).validate()
        cfg = _cnn_on_file(tmp_path / name)
        cfg.model.architecture = "mlp"
        cfg.validate()


def test_a_cnn_on_an_image_file_is_checked_against_its_shape(tmp_path):
    np.savez(tmp_path / "img.npz", X=np.zeros((10, 12, 12), np.uint8), y=np.arange(10) % 2)
    cfg = _cnn_on_file(tmp_path / "img.npz")
    cfg.model.conv_channels, cfg.model.kernel_size, cfg.model.pool = [4], 3, 2
    cfg.validate()                                   # 12x12 -> 10x10 -> 5x5
    cfg.model.kernel_size = 13
    with pytest.raises(ValueError, match="^ModelConfig"):
        cfg.validate()
    (tmp_path / "missing.npz").unlink(missing_ok=True)
    _cnn_on_file(tmp_path / "missing.npz").validate()     # unknown until loaded: the loader names the problem


def test_file_image_shape_reads_headers_only(tmp_path):
    from qatlab.data.files import file_image_shape
    np.savez(tmp_path / "a.npz", X=np.zeros((3, 2, 5, 7), np.float32), y=np.zeros(3))
    np.savez(tmp_path / "b.npz", X=np.zeros((3, 5, 7), np.float32), y=np.zeros(3))
    np.savez(tmp_path / "c.npz", X=np.zeros((3, 4), np.float32), y=np.zeros(3))
    np.savez(tmp_path / "d.npz", y=np.zeros(3))
    header = bytes([0, 0, 8, 3]) + (5).to_bytes(4, "big") + (28).to_bytes(4, "big") + (27).to_bytes(4, "big")
    (tmp_path / "t10k-images-idx3-ubyte").write_bytes(header + bytes(5 * 28 * 27))
    (tmp_path / "junk.npz").write_bytes(b"not a zip")
    assert file_image_shape(tmp_path / "a.npz") == (2, 5, 7) and file_image_shape(tmp_path / "b.npz") == (1, 5, 7)
    assert file_image_shape(tmp_path / "c.npz") == () and file_image_shape(tmp_path / "x.csv") == ()
    assert file_image_shape(tmp_path / "t10k-images-idx3-ubyte") == (1, 28, 27)
    for name in ("d.npz", "junk.npz", "missing.npz"):
        assert file_image_shape(tmp_path / name) is None
