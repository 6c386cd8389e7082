"""How much memory a run needs, estimated from its config before anything is allocated.

``estimate_memory(cfg, n_train, n_test, n_features, n_outputs)`` adds up, in bytes, the arrays the
training loop (:mod:`qatlab.train.trainer`) allocates for the model :func:`layer_shapes`
describes: parameters, their gradients and the backward pass's per-row deltas, optimizer state,
quantized-weight copies, forward scratch at the batch size, evaluation scratch, phase training's
gradient buffers, and the dataset's float32 copies. ``check_memory`` refuses a run whose total is
over a budget: by default half of the memory available (``MemAvailable``), or the environment
variable ``QATLAB_MEMORY_BUDGET`` (bytes, or with a suffix: ``512M``, ``4G``), or the argument.

Layers are described by :func:`layer_shapes`; a layer kind is its shape tuple, turned into counts
by :func:`_layer_counts` (an MLP's dense layer is ``(n_in, n_out)``).
"""
from __future__ import annotations

import os
import re

from .train.history import history_nbytes

F32 = 4
EVAL_CHUNK = 1024              # test rows the training loop evaluates at once (qatlab.train.loss)
OPTIMIZER_STATE = {"sgd": 0, "momentum": 1, "adam": 2}   # float32 buffers per parameter
ENV = "QATLAB_MEMORY_BUDGET"
_UNITS = {"": 1, "k": 1 << 10, "m": 1 << 20, "g": 1 << 30, "t": 1 << 40}


def layer_shapes(cfg, n_features: int, n_outputs: int, image_shape=None) -> list[tuple]:
    """The model's layers in order. MLP: one ``(n_in, n_out)`` per dense layer. CNN (needs the
    dataset's ``image_shape``): one ``(C*kh*kw, Cout, OH*OW, pooled outputs)`` per conv layer, then
    the dense layers from the flattened features."""
    first = int(n_features)
    convs = []
    if cfg.model.architecture == "cnn":
        from .nn.cnn import conv_plan     # shapes only: allocates nothing
        if image_shape is None:
            raise ValueError("ModelConfig.architecture: 'cnn' needs a dataset with an image shape")
        plan = conv_plan(image_shape, cfg.model.conv_channels, cfg.model.kernel_size, cfg.model.pool)
        convs = [(g.ck, g.c_out, g.p, pooled[0] * pooled[1] * pooled[2]) for g, _, pooled in plan]
        first = convs[-1][3]
    sizes = [first, *(int(h) for h in cfg.model.hidden), int(n_outputs)]
    return convs + list(zip(sizes[:-1], sizes[1:]))


def _layer_counts(shape: tuple) -> tuple[int, int, int]:
    """(weights, biases, activations per sample) of one :func:`layer_shapes` entry."""
    if len(shape) == 2:                     # dense (n_in, n_out)
        n_in, n_out = shape
        return n_in * n_out, n_out, n_out
    if len(shape) == 4:                     # conv (C*kh*kw, Cout, OH*OW, pooled outputs)
        ck, c_out, _, out = shape
        return ck * c_out, c_out, out
    raise ValueError(f"shape: unknown layer description {shape!r}")


def _conv_workspace(shapes, batch: int, eval_rows: int, act_quant: bool) -> int:
    """Float32 entries of the conv layers' own buffers (:class:`~qatlab.nn.cnn.CnnScratch` and
    ``CnnGradients``) beyond each layer's output: im2col matrix, product, activation (+ quantized
    copy), argmax indices, and the activation's gradient (the backward's other conv gradients reuse
    the im2col and product buffers). The evaluation scratch keeps its im2col buffers to
    ``INFERENCE_ROWS`` rows."""
    inference_rows = min(eval_rows, 128)   # qatlab.nn.cnn.INFERENCE_ROWS
    total = 0
    for ck, c_out, p, out in (s for s in shapes if len(s) == 4):
        per_row = c_out * p * (2 if act_quant else 1) + out          # activation (+ quantized), indices
        total += batch * (per_row + (ck + c_out) * p)                 # training forward
        total += batch * c_out * p                                    # the activation's gradient
        total += eval_rows * per_row + inference_rows * (ck + c_out) * p
    return total


def estimate_memory(cfg, n_train: int, n_test: int, n_features: int, n_outputs: int,
                    image_shape=None) -> dict[str, int]:
    """Bytes per part of a run of ``cfg`` on a dataset of these sizes, and their ``"total"``
    (a cnn needs the dataset's ``image_shape`` (C, H, W))."""
    shapes = layer_shapes(cfg, n_features, n_outputs, image_shape)
    counts = [_layer_counts(s) for s in shapes]
    weights = sum(w for w, _, _ in counts)
    params = weights + sum(b for _, b, _ in counts)
    acts = sum(a for _, _, a in counts)                    # per sample, every layer's output
    hidden = acts - counts[-1][2]                          # per sample, hidden layers only
    batch = max(1, min(int(cfg.optim.batch_size), int(n_train)))
    eval_rows = max(1, min(EVAL_CHUNK, int(n_test)))
    # forward: every layer's output and each hidden layer's quantized copy (allocated always)
    per_row = acts + hidden
    phase = 0
    if cfg.phase.enabled:
        tensors = [n for w, b, _ in counts for n in (w, b) if n]
        # trainer: staging, prediction, output; predictor: anchor, block sum, trend, correction; its trend entries
        phase = (3 + 4) * params * F32 + history_nbytes(cfg.phase, tensors)
    parts = {
        "parameters": params * F32,
        "gradients": (params + batch * (acts + n_features)) * F32,     # + the backward pass's deltas
        "optimizer_state": OPTIMIZER_STATE[cfg.optim.optimizer] * params * F32,
        "quantizer_copies": 2 * weights * F32,             # quantized weights: training and eval scratch
        # + the batch gathered from the training split, and the loss's one-hot targets
        "scratch": (batch * (per_row + n_features) + max(batch, EVAL_CHUNK) * n_outputs) * F32,
        "eval_scratch": eval_rows * per_row * F32,
        "phase": phase,
        "dataset": (int(n_train) + int(n_test)) * (int(n_features) * F32 + 8),
        "conv_workspace": _conv_workspace(shapes, batch, eval_rows, cfg.quant.activations != "off") * F32,
    }
    parts["total"] = sum(parts.values())
    return parts


def parse_bytes(text: str, name: str = ENV) -> int:
    """``"4G"``, ``"512 MiB"``, ``"1e9"`` -> bytes (binary units: K = 1024)."""
    m = re.fullmatch(r"\s*([0-9]*\.?[0-9]+(?:[eE][+-]?[0-9]+)?)\s*([kKmMgGtT]?)(?:i?[bB])?\s*", str(text))
    if not m:
        raise ValueError(f"{name}: expected bytes, or a number with a suffix K, M, G or T (e.g. 4G), got {text!r}")
    value = float(m.group(1)) * _UNITS[m.group(2).lower()]
    if not value >= 1:
        raise ValueError(f"{name}: expected at least 1 byte, got {text!r}")
    return int(value)


def available_memory() -> int:
    """Bytes the system can still give (``MemAvailable`` of /proc/meminfo, else free pages)."""
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")


def memory_budget(budget=None) -> tuple[int, str]:
    """(bytes, where they come from): the argument, else ``QATLAB_MEMORY_BUDGET``, else half of
    :func:`available_memory`."""
    if budget is not None:
        return (parse_bytes(budget, "budget") if isinstance(budget, str) else _positive(budget)), "the budget argument"
    env = os.environ.get(ENV, "").strip()
    if env:
        return parse_bytes(env), f"{ENV}={env}"
    return available_memory() // 2, f"half of the memory available; set {ENV}, e.g. 16G, to change it"


def _positive(budget) -> int:
    if isinstance(budget, bool) or not isinstance(budget, (int, float)) or not budget >= 1:
        raise ValueError(f"budget: expected a number of bytes >= 1 or a string like '4G', got {budget!r}")
    return int(budget)


def _gib(n: int) -> str:
    for unit, size in (("GiB", 1 << 30), ("MiB", 1 << 20), ("KiB", 1 << 10)):
        if n >= size:
            return f"{n / size:.1f} {unit}"
    return f"{n} B"


def check_memory(cfg, n_train: int, n_test: int, n_features: int, n_outputs: int, budget=None,
                 image_shape=None) -> dict[str, int]:
    """:func:`estimate_memory`, or ``ValueError`` naming the estimate and the budget when over it."""
    parts = estimate_memory(cfg, n_train, n_test, n_features, n_outputs, image_shape)
    limit, source = memory_budget(budget)
    if parts["total"] > limit:
        shown = ", ".join(f"{k.replace('_', ' ')} {_gib(v)}" for k, v in parts.items() if k != "total" and v)
        raise ValueError(f"run needs ~{_gib(parts['total'])} ({shown}), over the budget of {_gib(limit)} "
                         f"({source}); use fewer or smaller layers, a smaller batch or less data")
    return parts
