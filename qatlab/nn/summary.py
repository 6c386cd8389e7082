r"""``ql.summary(model, config)``: per layer parameters, bits, memory and MACs (Larq's ``summary``).

Per layer with weights:

* bits per weight: 32 for float weights, ``k`` for a k-bit :class:`~qatlab.quant.FakeQuantize`,
  2 for ternary weights (stored packed, four trits a byte, as :mod:`qatlab.nn.export` writes them;
  ``log2(3) = 1.585`` bits is shown beside it as the information content);
* memory: ``weights * bits / 8`` bytes, plus biases as float32 and the quantizer's parameters
  (a float32 scale per tensor or per output channel, and an int32 zero point each when affine);
  1 kB = 1024 bytes, as Larq counts;
* MACs per sample: ``in * out`` for a dense layer, ``out_c * out_h * out_w * in_c * kh * kw`` for a
  convolution; pooling and flattening have none.

Totals add the float32-equivalent size (every parameter as float32) and the compression ratio
``float32 size / memory``.
"""
from __future__ import annotations

import math

from ..quant import FakeQuantize, TernaryQuantizer

TERNARY_BITS = 2                    # packed storage: four trits a byte
TERNARY_ENTROPY_BITS = math.log2(3)  # information content of one trit
FLOAT_BITS = 32
KB = 1024


def weight_format(q) -> dict:
    """Storage of weights under quantizer ``q``: bits, entropy bits, scales, zero points, label."""
    if q is None or (isinstance(q, FakeQuantize) and not q.enabled):
        return {"bits": FLOAT_BITS, "entropy_bits": float(FLOAT_BITS), "scales": 0, "affine": False,
                "label": "float32"}
    if isinstance(q, TernaryQuantizer):
        return {"bits": TERNARY_BITS, "entropy_bits": TERNARY_ENTROPY_BITS, "scales": 1, "affine": False,
                "label": "ternary"}
    if isinstance(q, FakeQuantize):
        scales = 1 if q.axis is None else "per_channel"
        kind = "int" if q.symmetric else "uint"
        return {"bits": int(q.bits), "entropy_bits": float(q.bits), "scales": scales,
                "affine": not q.symmetric,
                "label": f"{kind}{q.bits}" + ("" if q.axis is None else f" per-ch{q.axis}")}
    raise TypeError(f"model: unknown weight quantizer {type(q).__name__}; expected None, FakeQuantize "
                    "or TernaryQuantizer")


def _activation_bits(q) -> int | None:
    if q is None or (isinstance(q, FakeQuantize) and not q.enabled):
        return None
    return int(q.bits) if isinstance(q, FakeQuantize) else None


def layer_row(name: str, kind: str, weight_shape, n_bias: int, macs: int, out_shape, wq, aq=None) -> dict:
    """One summary row for a layer with weights ``weight_shape`` (out first) and ``n_bias`` biases."""
    n_w = math.prod(weight_shape)
    fmt = weight_format(wq)
    n_scales = weight_shape[0] if fmt["scales"] == "per_channel" else fmt["scales"]
    n_zero_points = n_scales if fmt["affine"] else 0
    weight_bytes = n_w * fmt["bits"] / 8
    qparam_bytes = 4 * (n_scales + n_zero_points)
    memory = weight_bytes + 4 * n_bias + qparam_bytes
    float_bytes = 4 * (n_w + n_bias)
    return {"name": name, "kind": kind, "output_shape": tuple(out_shape), "weight_shape": tuple(weight_shape),
            "weights": n_w, "biases": n_bias, "params": n_w + n_bias, "weight_format": fmt["label"],
            "bits_per_weight": fmt["bits"], "entropy_bits_per_weight": fmt["entropy_bits"],
            "activation_bits": _activation_bits(aq), "scales": n_scales, "zero_points": n_zero_points,
            "memory_bytes": memory, "memory_kb": memory / KB, "float32_bytes": float_bytes,
            "float32_kb": float_bytes / KB, "macs": int(macs)}


def plain_row(name: str, kind: str, out_shape) -> dict:
    """A row for a layer without weights (pooling, flatten)."""
    return {"name": name, "kind": kind, "output_shape": tuple(out_shape), "weight_shape": (), "weights": 0,
            "biases": 0, "params": 0, "weight_format": "", "bits_per_weight": None,
            "entropy_bits_per_weight": None, "activation_bits": None, "scales": 0, "zero_points": 0,
            "memory_bytes": 0.0, "memory_kb": 0.0, "float32_bytes": 0, "float32_kb": 0.0, "macs": 0}


def _mlp_rows(model) -> list[dict]:
    rows = []
    wq, aq = model.weight_quantizers, model.activation_quantizers
    for i in range(model.num_layers):
        n_in, n_out = model.sizes[i], model.sizes[i + 1]
        rows.append(layer_row(f"dense{i}", "dense", (n_out, n_in), n_out if model.bias else 0, n_in * n_out,
                              (n_out,), wq[i], aq[i] if i < len(aq) else None))
    return rows


def _cnn_rows(model) -> list[dict]:
    """conv rows (each followed by its max pool), a flatten row, then the dense rows."""
    rows, wq, aq = [], model.weight_quantizers, model.activation_quantizers
    n_conv, dense = model.n_conv, 0
    for i, spec in enumerate(model.layer_specs()):
        act_q = aq[i] if i < len(aq) else None
        if spec["kind"] == "conv":
            c_out = spec["weight_shape"][0]
            rows.append(layer_row(f"conv{i}", "conv", spec["weight_shape"], c_out, spec["macs"],
                                  spec["conv_shape"], wq[i], act_q))
            if tuple(spec["pool"]) != (1, 1):
                rows.append(plain_row(f"maxpool{i}", "maxpool", spec["out_shape"]))
            if i == n_conv - 1:
                rows.append(plain_row("flatten", "flatten", (math.prod(spec["out_shape"]),)))
        else:
            n_out = spec["weight_shape"][0]
            rows.append(layer_row(f"dense{dense}", "dense", spec["weight_shape"], n_out, spec["macs"],
                                  spec["out_shape"], wq[i], act_q))
            dense += 1
    return rows


def _model_rows(model) -> list[dict]:
    from .cnn import Cnn
    from .mlp import Mlp

    if isinstance(model, Mlp):
        return _mlp_rows(model)
    if isinstance(model, Cnn):
        return _cnn_rows(model)
    raise TypeError(f"model: expected an Mlp or Cnn, got {type(model).__name__}")


class ModelSummary:
    """``layers`` (list of dicts, one per layer) and ``totals`` (dict); ``str()`` is a table."""

    def __init__(self, layers: list[dict], totals: dict, title: str = ""):
        self.layers = layers
        self.totals = totals
        self.title = title

    def to_dict(self) -> dict:
        return {"title": self.title, "layers": self.layers, "totals": self.totals}

    def __str__(self) -> str:
        cols = (("name", "layer", "{}"), ("output_shape", "output", _shape), ("params", "params", "{:,}"),
                ("weight_format", "weights", "{}"), ("bits_per_weight", "bits/w", _bits),
                ("activation_bits", "act bits", "{}"), ("memory_kb", "memory kB", "{:.2f}"),
                ("macs", "MACs/sample", "{:,}"))
        cells = [[_cell(r.get(k), f) for k, _, f in cols] for r in self.layers]
        t = self.totals
        cells.append(["total", "", f"{t['params']:,}", "", "", "", f"{t['memory_kb']:.2f}", f"{t['macs']:,}"])
        widths = [max(len(h), *(len(c[i]) for c in cells)) for i, (_, h, _) in enumerate(cols)]
        line = lambda vals: "  ".join(v.ljust(w) if i < 2 else v.rjust(w)  # noqa: E731
                                      for i, (v, w) in enumerate(zip(vals, widths))).rstrip()
        out = [self.title] if self.title else []
        out += [line([h for _, h, _ in cols]), "  ".join("-" * w for w in widths)]
        out += [line(c) for c in cells]
        out.append(f"float32-equivalent size {t['float32_kb']:.2f} kB, quantized {t['memory_kb']:.2f} kB, "
                   f"compression {t['compression']:.2f}x")
        if any(r["weight_format"] == "ternary" for r in self.layers):
            out.append(f"ternary weights: {TERNARY_BITS} bits each packed (information content "
                       f"log2(3) = {TERNARY_ENTROPY_BITS:.3f} bits)")
        return "\n".join(out)

    __repr__ = __str__


def _shape(s) -> str:
    return "x".join(str(d) for d in s)


def _bits(b) -> str:
    return f"{b:g}"


def _cell(v, fmt) -> str:
    if v is None or v == "":
        return "-" if v is None else ""
    return fmt(v) if callable(fmt) else fmt.format(v)


def summary(model, config=None) -> ModelSummary:
    """Summary of ``model`` (an Mlp or Cnn with its quantizers); ``config`` (an ExperimentConfig,
    optional) names the recipe in the title. The model's own quantizers decide the bits."""
    from ..config import ExperimentConfig

    if config is not None and not isinstance(config, ExperimentConfig):
        raise TypeError(f"config: expected None or an ExperimentConfig, got {type(config).__name__}")
    layers = _model_rows(model)
    memory = sum(r["memory_bytes"] for r in layers)
    float_bytes = sum(r["float32_bytes"] for r in layers)
    totals = {"params": sum(r["params"] for r in layers), "weights": sum(r["weights"] for r in layers),
              "biases": sum(r["biases"] for r in layers), "macs": sum(r["macs"] for r in layers),
              "memory_bytes": memory, "memory_kb": memory / KB, "float32_bytes": float_bytes,
              "float32_kb": float_bytes / KB, "compression": float_bytes / memory if memory else math.nan}
    title = f"{type(model).__name__} summary"
    if config is not None:
        q = config.quant
        wdesc = {"float": "float weights", "ternary": "ternary weights",
                 "fake": f"{q.weight_bits}-bit weights"}[q.weights]
        title += f" ({config.data.dataset}, {wdesc})"
    return ModelSummary(layers, totals, title)
