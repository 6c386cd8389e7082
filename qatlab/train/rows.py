"""Metrics rows of the training loop: one row every ``metrics_every`` steps, with per-layer columns."""
from __future__ import annotations

import functools
import math

import numpy as np

from ..kernels.dense import sum_squares, two_sign_counts
from ..kernels.fused import LAYER_SUMS, layer_sums
from ..kernels.phase_kernels import all_finite
from ..metrics import LAYER_METRICS, STEP_COLUMNS
from ..quant import TernaryQuantizer, noise_stats


def layer_row(mlp, grads, scratch, i: int) -> dict:
    """Per-layer metrics of layer i: grad norm, quantization noise/SQNR/scale/saturation, sign fractions."""
    return _layer_row(mlp, grads, scratch, i)[0]


def layer_columns(mlp, grads, scratch) -> tuple[dict, int]:
    """Every layer's :func:`layer_row` columns, and the count of non-zero weight gradients."""
    return merged(_layer_row(mlp, grads, scratch, i) for i in range(mlp.num_layers))


def layer_columns_of_sums(mlp, sums: np.ndarray) -> tuple[dict, int]:
    """:func:`layer_columns` from each layer's :func:`~qatlab.kernels.fused.layer_sums` in ``sums``
    (float64 (LAYER_SUMS * layers,)), as a phase block run returns them."""
    return merged(layer_row_of_sums(mlp, i, sums[LAYER_SUMS * i:LAYER_SUMS * (i + 1)])
                  for i in range(mlp.num_layers))


@functools.cache
def _layer_keys(i: int) -> dict[str, str]:
    return {m: f"{m}_{i}" for m in LAYER_METRICS}


def _layer_row(mlp, grads, scratch, i: int) -> tuple[dict, int]:
    """(:func:`layer_row`, count of non-zero (and not NaN) weight gradients of layer i)."""
    k = _layer_keys(i)
    w, dw, used = mlp.weights(i), grads.d_weights(i).reshape(-1), scratch.weights_used(i)
    q = mlp.weight_quantizers[i]
    if q is None or isinstance(q, TernaryQuantizer):    # one kernel, as phase training's block runs log rows
        sums = np.empty(LAYER_SUMS)
        layer_sums(w.reshape(-1), dw, used.reshape(-1), q is not None, np.float32(q.alpha if q else 0.0), sums)
        return layer_row_of_sums(mlp, i, sums)
    g_neg, g_pos, neg, pos = two_sign_counts(dw, used.reshape(-1))
    row = {k["grad_norm"]: math.sqrt(sum_squares(dw))}
    row[k["noise_mse"]], row[k["sqnr_db"]], row[k["saturation"]] = q.noise_stats(w)
    row[k["scale"]] = float(np.mean(q.scale))
    n = used.size
    row[k["frac_neg"]], row[k["frac_zero"]], row[k["frac_pos"]] = neg / n, (n - neg - pos) / n, pos / n
    return row, g_neg + g_pos


def layer_row_of_sums(mlp, i: int, sums: np.ndarray) -> tuple[dict, int]:
    """:func:`_layer_row` of a layer with a ternary quantizer or none, from its
    :func:`~qatlab.kernels.fused.layer_sums` ``sums``."""
    k = _layer_keys(i)
    sumsq, g_nonzero, neg, pos, noise, saturated, signal, alpha = sums.tolist()
    row = {k["grad_norm"]: math.sqrt(sumsq)}
    n = mlp.weights(i).size
    if mlp.weight_quantizers[i] is not None:
        row[k["noise_mse"]], row[k["sqnr_db"]], row[k["saturation"]] = noise_stats(noise, saturated, signal, n)
        row[k["scale"]] = alpha
    row[k["frac_neg"]], row[k["frac_zero"]], row[k["frac_pos"]] = neg / n, (n - neg - pos) / n, pos / n
    return row, int(g_nonzero)


def merged(layer_rows) -> tuple[dict, int]:
    """The columns of all layers' :func:`_layer_row` pairs and their non-zero weight gradients."""
    layers, nonzero = {}, 0
    for layer, nz in layer_rows:
        layers.update(layer)
        nonzero += nz
    return layers, nonzero


def metrics_row(step: int, epoch: float, elapsed: float, loss, lr: float, layers: dict, nonzero: int,
                n_weights: int, phase_columns: dict | None) -> dict:
    """A per-step metrics row: its step, epoch (fractional), seconds, loss, learning rate, speed, the share
    of weights with a non-zero gradient, the layer columns and (phase training) the phase columns."""
    row = dict(zip(STEP_COLUMNS, (step, epoch, elapsed, loss, lr, step / elapsed if elapsed > 0 else math.nan,
                                  nonzero / n_weights)))   # active_grad_fraction: weights with a non-zero gradient
    row.update(layers)
    if phase_columns is not None:
        row.update(phase_columns)
    return row


def blown_up(mlp, layers: dict) -> str | None:
    """What the metrics row's layer columns ``layers`` (empty: no row) or the parameters show
    non-finite ("gradient of layer 1 became inf"), or None; one pass over the parameters."""
    for i in range(mlp.num_layers):
        norm = layers.get(f"grad_norm_{i}", 0.0)
        if not math.isfinite(norm):
            return f"gradient of layer {i} became {norm}"
    return None if all_finite(mlp.flat_params()) else f"parameter {non_finite_parameter(mlp)} became NaN or inf"


def non_finite_parameter(mlp) -> str | None:
    """The name of the first parameter of ``mlp`` holding a NaN or inf, or None."""
    return next((name for name, p in mlp.parameters() if not all_finite(p.reshape(-1))), None)
