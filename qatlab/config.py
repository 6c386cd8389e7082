"""Every user-tunable knob, declared with Param.

Param checks types and bounds on assignment and raises ``ValueError`` naming the
parameter, so a widget built with ``pn.Param(cfg)`` and a keyword in Python obey
the same rules. Rules that span several fields live in each config's
``validate()``, which raises ``ValueError`` naming the fields involved.
"""
from __future__ import annotations

import os
from typing import Any

import param

from .quant.ste import STE_NAMES, SteKind


class _Config(param.Parameterized):
    """Base class: ``validate()``, ``to_dict()`` and ``from_dict()`` for every config."""

    _retired: tuple = ()   # fields that were removed; from_dict skips them in old (stored) configs

    def validate(self) -> None:
        """Check rules that involve several fields; raise ``ValueError`` if broken."""
        for value in self.param.values().values():
            if isinstance(value, _Config):
                value.validate()

    def to_dict(self) -> dict[str, Any]:
        """Plain (JSON-ready) nested dict of the values, without the ``name`` field."""
        out = {}
        for key, value in self.param.values().items():
            if key == "name":
                continue
            out[key] = value.to_dict() if isinstance(value, _Config) else _plain(value)
        return out

    @classmethod
    def from_dict(cls, values: dict[str, Any]):
        """Inverse of :meth:`to_dict`; unknown keys raise ``ValueError``."""
        kwargs = {}
        for key, value in values.items():
            if key in cls._retired:
                continue
            if key not in cls.param or key == "name":
                raise ValueError(f"{cls.__name__}: unknown field {key!r}")
            p = cls.param[key]
            if isinstance(p, param.ClassSelector) and isinstance(value, dict):
                value = p.class_.from_dict(value)
            if isinstance(p, (param.Integer, param.Number)) and isinstance(value, bool):   # (Param takes True as 1)
                raise TypeError(f"{cls.__name__}.{key}: expected a number, got {value!r}")
            kwargs[key] = value
        return cls(**kwargs)

    def copy(self):
        """Deep copy (nested configs are copied too)."""
        return type(self).from_dict(self.to_dict())


def _plain(value):
    if isinstance(value, SteKind):
        return value.value
    if isinstance(value, (list, tuple)):
        return [_plain(v) for v in value]
    return value


def _ste_selector(default: str, doc: str) -> param.Selector:
    return param.Selector(default=default, objects=list(STE_NAMES), doc=doc)


class DataConfig(_Config):
    """Which dataset to train on and how to split it."""

    dataset = param.Selector(default="digits", objects=["digits", "mnist", "fashion_mnist", "mnist1d",
                                                        "synthetic", "file"], doc=(
        "digits: 8x8 handwritten digits shipped in assets/ (1797 x 64, 10 classes); "
        "mnist: 5000-image MNIST subset shipped in assets/ (28x28, 10 classes); "
        "fashion_mnist: Fashion-MNIST IDX files (60000/10000 fixed split, 28x28, 10 classes); "
        "mnist1d: MNIST-1D shipped in assets/ (4000/1000 fixed split, length 40, 10 classes); "
        "synthetic: seeded Gaussian-cluster classification task; file: a .npz/.csv/IDX file at `path`. "
        "qatlab.data.DATASET_CARDS describes each named set."))
    test_fraction = param.Number(default=0.2, bounds=(0.05, 0.5), doc=(
        "Share of samples held out for testing (mnist1d and fashion_mnist keep their fixed splits)."))
    seed = param.Integer(default=0, bounds=(0, 2**31 - 1), doc="Seed of the shuffle/split (and of synthetic data).")
    n_samples = param.Integer(default=2000, bounds=(20, 1_000_000), doc="Synthetic only: number of samples.")
    n_features = param.Integer(default=64, bounds=(1, 100_000), doc="Synthetic only: input features.")
    n_classes = param.Integer(default=10, bounds=(2, 1000), doc="Synthetic only: number of classes.")
    path = param.String(default="", doc=(
        "file: path to a .npz (X, y[, X_test, y_test]), a .csv (label last) or an IDX images file "
        "(*images-idx3-ubyte[.gz], labels beside it); fashion_mnist: optional directory of its IDX files."))

    def validate(self) -> None:
        if self.dataset == "file" and not self.path:
            raise ValueError("DataConfig.path: required when dataset='file'")


class ModelConfig(_Config):
    """MLP architecture; input and output sizes come from the dataset."""

    hidden = param.List(default=[256], item_type=int, doc="Hidden layer sizes, in order (may be empty).")
    activation = param.Selector(default="relu", objects=["relu", "leaky_relu", "tanh", "sigmoid", "identity", "sign"],
                                doc="Hidden-layer activation; `sign` has an identity STE backward.")
    architecture = param.Selector(default="mlp", objects=["mlp", "cnn"], doc=(
        "mlp: dense layers only; cnn: conv -> activation -> max pool per entry of conv_channels, then "
        "the dense `hidden` layers (needs a dataset of images or 1-d signals)."))
    conv_channels = param.List(default=[16, 32], item_type=int, doc="cnn only: output channels of each conv layer.")
    kernel_size = param.Integer(default=5, bounds=(1, 64), doc=(
        "cnn only: k x k conv kernels, stride 1, no padding (1 x k on 1-d signals)."))
    pool = param.Integer(default=2, bounds=(1, 64), doc="cnn only: max-pool window (and stride) after each conv; 1 = none.")

    def validate(self) -> None:
        for i, h in enumerate(self.hidden):
            if isinstance(h, bool) or not isinstance(h, int):   # True is an int to Python, not a size
                raise ValueError(f"ModelConfig.hidden[{i}]: must be an int in 1..1000000, got {h!r}")
            if h < 1 or h > 1_000_000:
                raise ValueError(f"ModelConfig.hidden[{i}]: must be in 1..1000000, got {h}")


class QuantConfig(_Config):
    """What is quantized, to how many bits, and which STE carries the gradient."""

    weights = param.Selector(default="ternary", objects=["float", "fake", "ternary"], doc=(
        "float: no weight quantization; fake: k-bit FakeQuantize; ternary: BitNet b1.58 absmean."))
    weight_bits = param.Integer(default=4, bounds=(1, 16), doc="Bits of the fake weight quantizer.")
    activations = param.Selector(default="off", objects=["off", "fake"], doc="Quantize hidden activations.")
    activation_bits = param.Integer(default=8, bounds=(1, 16), doc="Bits of the activation quantizer.")
    symmetric = param.Boolean(default=True, doc="Symmetric (zero-point 0) or affine weight quantizer.")
    per_channel = param.Boolean(default=False, doc="One scale per output row of W (fake weights only).")
    scale_mode = param.Selector(default="observer", objects=["observer", "lsq"], doc=(
        "observer: scale from a min/max observer each step; lsq: scale is learned (LSQ)."))
    ste = _ste_selector("identity", "Straight-through estimator of the weight quantizer.")
    activation_ste = _ste_selector("clipped_identity", "Straight-through estimator of the activation quantizer.")

    def validate(self) -> None:
        if self.weights == "fake" and self.weight_bits == 1 and self.symmetric:
            pass  # 1-bit symmetric is the two-level range [-1, 0]; allowed (see FakeQuantize)
        if self.per_channel and self.weights != "fake":
            raise ValueError("QuantConfig.per_channel: only applies when weights='fake'")


class OptimConfig(_Config):
    """Optimizer, schedule and loop sizes."""

    optimizer = param.Selector(default="adam", objects=["sgd", "momentum", "adam"], doc="Update rule.")
    lr = param.Number(default=1e-2, bounds=(0.0, 1e3), inclusive_bounds=(False, True), softbounds=(1e-4, 1.0),
                      doc="Learning rate (> 0).")
    schedule = param.Selector(default="constant", objects=["constant", "step", "cosine"],
                              doc="constant; step: x0.1 at 50% and 75% of training; cosine: to 0 at the end.")
    epochs = param.Integer(default=40, bounds=(1, 100_000), doc="Passes over the training set.")
    batch_size = param.Integer(default=64, bounds=(1, 65_536), doc="Samples per step.")
    seed = param.Integer(default=0, bounds=(0, 2**31 - 1), doc="Seed of init and batch order.")
    momentum = param.Number(default=0.9, bounds=(0.0, 1.0), inclusive_bounds=(True, False), doc="Momentum (momentum optimizer).")
    weight_decay = param.Number(default=0.0, bounds=(0.0, 1.0), doc="Decoupled weight decay (AdamW style).")
    max_grad_norm = param.Number(default=0.0, bounds=(0.0, None), doc="Global-norm gradient clipping; 0 = off.")
    loss = param.Selector(default="cross_entropy", objects=["cross_entropy", "mse"], doc="Training loss.")


class PredictionConfig(_Config):
    """How PhaseTrainer predicts gradients between full backward passes."""

    history_size = param.Integer(default=5, bounds=(2, 64), doc="Block means (one per FULL run) kept for the least-squares fit.")
    momentum = param.Number(default=0.9, bounds=(0.0, 2.0), doc=(
        "m in g_hat = g1 + m (k / (T1 - T2)) (G1 - G2): the trend between the two newest block means G "
        "(one per FULL run, at their mean steps T), extrapolated k steps from the newest real gradient g1."))
    correction_weight = param.Number(default=0.5, bounds=(0.0, 1.0), doc="Share of the measured error folded into the correction.")
    history_decay = param.Number(default=0.95, bounds=(0.0, 1.0), inclusive_bounds=(False, True),
                                 doc=("Weight history_decay^age (steps) of older block means in the least-squares fit; "
                                      "the learned correction decays by this factor per step."))
    residual_threshold = param.Number(default=0.5, bounds=(0.0, None), doc=(
        "Relative prediction error above which the learned residual is reset."))
    learned_gain = param.Boolean(default=True, doc=(
        "Scale every prediction by its least-squares gain measured on the correct steps so far, "
        "clamp(sum a.p / sum p.p, 0, 1) (1 before the first): predictions that do not point "
        "where the real gradients go shrink towards zero instead of pushing the weights. The predicted "
        "step is made at learning rate * gain too (Adam's step hardly shrinks with its gradient); at "
        "gain 0 it makes no optimizer update."))


class TernaryConfig(_Config):
    """Ternary trend history (``PhaseConfig.history_storage = "ternary"``): TernaryGradientAccumulator settings."""

    _retired = ("accumulation_steps",)   # never changed a run: nothing trained through the accumulator then
    ternary_threshold = param.Number(default=0.5, bounds=(0.0, None), doc="Deterministic: |g| > t * mean|g| becomes +-1.")
    stochastic_rounding = param.Boolean(default=True, doc="Unbiased stochastic ternarization instead of the threshold.")
    seed = param.Integer(default=0, bounds=(0, 2**31 - 1), doc="Seed of the stochastic rounding.")


class VSAConfig(_Config):
    """VSA trend history (``PhaseConfig.history_storage = "vsa"``): VSAGradientCompressor settings."""

    dimension = param.Integer(default=8192, bounds=(64, 1 << 24), doc="Hypervector dimension D.")
    compression_ratio = param.Number(default=0.001, bounds=(0.0, 1.0), inclusive_bounds=(False, True), doc=(
        "Share of non-zeros in the sparse random projection: k = max(1, round(ratio * D)) per parameter. It sets "
        "the cost of coding, O(n k), not the quality (while n k >> D)."))
    seed = param.Integer(default=42, bounds=(0, 2**31 - 1), doc="Seed of the projection hash and keys.")


class PhaseConfig(_Config):
    """Phase-based training: full backward passes alternate with predicted gradients.

    CORRECT steps come every ``correct_every`` steps of a predict block, after a ramp from
    ``first_correct_every`` (2, 3, ... one more per CORRECT step): without it the first blocks'
    nine predicted steps in a row overshot and the test loss spiked (digits, Adam lr 0.01, 4-bit
    LSQ: 12.8 after epoch 1 against 0.25 with full backprop; 0.43 with the ramp).
    """

    enabled = param.Boolean(default=False, doc="Train in phases (generic trainer only).")
    warmup_steps = param.Integer(default=0, bounds=(0, None), doc="Full-backward steps before the first cycle.")
    full_steps = param.Integer(default=10, bounds=(0, None), doc="FULL steps per cycle.")
    predict_steps = param.Integer(default=40, bounds=(0, None), doc="Steps of the predict block (PREDICT + CORRECT).")
    correct_every = param.Integer(default=10, bounds=(1, None), doc=(
        "Spacing of the CORRECT steps in a predict block once the ramp (first_correct_every) is done."))
    first_correct_every = param.Integer(default=2, bounds=(1, None), doc=(
        "Ramp of the CORRECT spacing: a block's first CORRECT step comes this many steps after its start "
        "(min(this, correct_every)), and each CORRECT step made adds 1 to the spacing up to correct_every; "
        "the spacing carries over from block to block. Early in training the real gradient turns within "
        "a few steps, and nine predicted steps along one (Adam/momentum move each weight ~lr a step) "
        "made the loss jump up to 50x; set it to correct_every for no ramp."))
    gradient_accumulation = param.Integer(default=1, bounds=(1, 1024), doc="Micro-batches averaged per optimizer step.")
    max_grad_norm = param.Number(default=1.0, bounds=(0.0, None), doc="Clip every gradient handed to the optimizer; 0 = off.")
    adaptive_phases = param.Boolean(default=True, doc="Adapt FULL / predict lengths to the loss trend.")
    loss_threshold = param.Number(default=0.1, bounds=(0.0, None), doc="Relative loss rise that lengthens FULL.")
    predictor = param.Selector(default="momentum", objects=["momentum", "least_squares"], doc="Gradient predictor.")
    prediction = param.ClassSelector(class_=PredictionConfig, default=PredictionConfig(), instantiate=True)
    history_storage = param.Selector(default="float32", objects=["float32", "ternary", "vsa"], doc=(
        "How the predictor keeps its trend entries (one block-mean gradient per FULL run, 2 for momentum, "
        "history_size for least_squares): float32 (exact, 4 bytes per parameter each); ternary (packed trits and "
        "one scale per tensor, 2 bits per parameter each, unbiased stochastic rounding; settings in ternary); vsa "
        "(one hypervector of vsa.dimension floats each whatever the model's size, decoded when the trend is "
        "recomputed; settings in vsa). The Phases tab and the phase bench show the bytes and the accuracy."))
    ternary = param.ClassSelector(class_=TernaryConfig, default=TernaryConfig(), instantiate=True)
    vsa = param.ClassSelector(class_=VSAConfig, default=VSAConfig(), instantiate=True)

    def validate(self) -> None:
        super().validate()
        if self.warmup_steps == 0 and self.full_steps == 0 and self.predict_steps == 0:
            raise ValueError("PhaseConfig: warmup_steps, full_steps and predict_steps are all 0")
        if self.full_steps == 0 and self.predict_steps > 0:
            raise ValueError("PhaseConfig.full_steps: must be >= 1 when predict_steps > 0 (predictions need real gradients)")


class ExperimentConfig(_Config):
    """One experiment: data, model, quantization, optimizer, phase training, logging."""

    data = param.ClassSelector(class_=DataConfig, default=DataConfig(), instantiate=True)
    model = param.ClassSelector(class_=ModelConfig, default=ModelConfig(), instantiate=True)
    quant = param.ClassSelector(class_=QuantConfig, default=QuantConfig(), instantiate=True)
    optim = param.ClassSelector(class_=OptimConfig, default=OptimConfig(), instantiate=True)
    phase = param.ClassSelector(class_=PhaseConfig, default=PhaseConfig(), instantiate=True)
    metrics_every = param.Integer(default=10, bounds=(1, 1_000_000), doc="Steps between metrics rows.")

    def validate(self) -> None:
        super().validate()
        if self.model.architecture == "cnn":
            _validate_cnn(self)
        if self.phase.enabled and self.phase.gradient_accumulation > self.optim.batch_size:
            raise ValueError(f"phase.gradient_accumulation: {self.phase.gradient_accumulation} micro-batches need "
                             f"optim.batch_size >= that, got {self.optim.batch_size}")


def dashboard_config() -> ExperimentConfig:
    """The experiment the dashboard and the notebooks start from: a ternary LeNet-style CNN on ``mnist``
    (conv 16 and 32 channels, 5x5, max-pool 2, then linear to the 10 classes) for 8 epochs, a row every
    5 steps: long enough to watch live. ``ExperimentConfig()`` keeps the digits MLP the benches use."""
    cfg = ExperimentConfig()
    cfg.data.dataset = "mnist"
    cfg.model.architecture, cfg.model.hidden = "cnn", []
    cfg.optim.epochs = 8
    cfg.metrics_every = 5
    return cfg


def _validate_cnn(cfg: "ExperimentConfig") -> None:
    """The cnn-only rules: channels, no phase training, and, for a named dataset of known image shape or
    a data file whose headers tell it, kernel and pool windows that fit every feature map (other
    datasets are checked when loaded)."""
    channels = cfg.model.conv_channels
    if not channels:
        raise ValueError("ModelConfig.conv_channels: architecture='cnn' needs at least one conv layer")
    for i, c in enumerate(channels):
        if isinstance(c, bool) or not isinstance(c, int) or not 1 <= c <= 4096:
            raise ValueError(f"ModelConfig.conv_channels[{i}]: must be an int in 1..4096, got {c!r}")
    if cfg.phase.enabled:
        raise ValueError("PhaseConfig.enabled: phase training supports architecture='mlp' only")
    if cfg.data.dataset == "synthetic":
        raise ValueError("ModelConfig.architecture: 'cnn' needs a dataset of images or 1-d signals; "
                         "dataset 'synthetic' gives flat features -- use architecture='mlp'")
    from .data.files import file_image_shape     # at call time: data imports config
    from .data.shipped import DATASET_CARDS
    from .nn.cnn import conv_plan                # shapes only: allocates nothing
    shape = DATASET_CARDS.get(cfg.data.dataset, {}).get("input_shape")
    if cfg.data.dataset == "file" and cfg.data.path:
        shape = file_image_shape(cfg.data.path)     # (headers only; None: loading will tell)
        if shape == ():
            raise ValueError(f"ModelConfig.architecture: 'cnn' needs images or 1-d signals; the file "
                             f"{os.path.basename(cfg.data.path)} holds flat features -- use architecture='mlp'")
    if shape is not None:
        try:
            conv_plan(shape, channels, cfg.model.kernel_size, cfg.model.pool)
        except ValueError as e:
            raise ValueError(f"ModelConfig.{e}") from None


class QatConfig(_Config):
    """SteTrainer (2-layer ternary reference trainer) settings."""

    lr = param.Number(default=0.01, bounds=(0.0, 1e3), inclusive_bounds=(False, True), doc="SGD learning rate.")
    epochs = param.Integer(default=100, bounds=(1, 1_000_000), doc="Passes over the samples.")
    clip_threshold = param.Number(default=1.0, bounds=(0.0, None), inclusive_bounds=(False, True),
                                  doc="Gradient is zeroed where |latent| > clip_threshold.")
    log_every = param.Integer(default=10, bounds=(0, None), doc="Log the loss every n epochs through `logging` (0 = never).")
    batch_size = param.Integer(default=1, bounds=(1, 65_536), doc="Samples per SGD step.")
    ste = _ste_selector("identity", "Estimator of the ternary projection.")
    seed = param.Integer(default=0, bounds=(0, 2**31 - 1), doc="Seed of the sample order.")
