"""Integer export of a trained model to ``.npz`` (``model.export(path)``) and ``load_exported(path)``.

The file holds a JSON ``meta`` entry (format, version, architecture, one record per layer and per
activation quantizer) and, per layer ``name``:

* float weights: ``name.weight`` float32;
* k-bit weights: ``name.qweight``, the integers ``clamp(rint(w / s) + zp, qmin, qmax)`` in the
  smallest integer dtype that holds ``[qmin, qmax]`` (int8 for k <= 8 symmetric, uint8 for 8-bit
  affine, int16 ...), with ``name.scale`` float32 and ``name.zero_point`` int32, one each
  (per-tensor) or one per output channel;
* ternary weights: ``name.trits``, four trits a byte (2 bits each, low bits first: 0 -> 0,
  1 -> +1, 2 -> -1), with ``name.scale`` (alpha) float32;
* ``name.bias`` float32 when the layer has biases.

Activation quantizers keep ``act{i}.scale`` / ``act{i}.zero_point``. Dequantizing computes
``(q - zp) * s`` in float32, the fake quantizer's own last operation, so the loaded model gives
the fake-quantized model's outputs bit for bit (export checks this for every layer).
"""
from __future__ import annotations

import json
import os
import zipfile
import zlib

import numpy as np

from ..quant import FakeQuantize, TernaryQuantizer, integer_range

FORMAT = "qatlab-export"
VERSION = 1
_INT_DTYPES = (np.int8, np.uint8, np.int16, np.uint16, np.int32)
_TRIT_CODE = np.array([0, 1, -1], np.int8)   # stored code -> trit


def int_dtype(qmin: int, qmax: int) -> np.dtype:
    """Smallest integer dtype holding every value of ``[qmin, qmax]``."""
    for dt in _INT_DTYPES:
        info = np.iinfo(dt)
        if info.min <= qmin and qmax <= info.max:
            return np.dtype(dt)
    raise ValueError(f"qmin/qmax: range [{qmin}, {qmax}] does not fit int32")


def pack_trits(trits: np.ndarray) -> np.ndarray:
    """int8 trits in {-1, 0, 1} (any shape) -> uint8 (ceil(n / 4),), four 2-bit codes a byte."""
    codes = np.where(trits.reshape(-1) < 0, 2, trits.reshape(-1)).astype(np.uint8)
    codes = np.concatenate([codes, np.zeros(-codes.size % 4, np.uint8)]).reshape(-1, 4)
    return (codes[:, 0] | (codes[:, 1] << 2) | (codes[:, 2] << 4) | (codes[:, 3] << 6)).astype(np.uint8)


def unpack_trits(packed: np.ndarray, n: int) -> np.ndarray:
    """Inverse of :func:`pack_trits`: int8 (n,); ValueError on code 3 or non-zero padding."""
    if packed.dtype != np.uint8 or packed.ndim != 1 or packed.size != -(-n // 4):
        raise ValueError(f"trits: expected uint8 ({-(-n // 4)},) for {n} weights, got {packed.dtype} {packed.shape}")
    codes = ((packed[:, None] >> np.array([0, 2, 4, 6], np.uint8)) & 3).reshape(-1)
    if np.any(codes == 3) or np.any(codes[n:] != 0):
        raise ValueError("trits: invalid 2-bit code (3, or non-zero padding): the file is corrupt")
    return _TRIT_CODE[codes[:n]]


# ----------------------------------------------------------------------------- export


def _channel_params(q: FakeQuantize, n_out: int):
    """(scale float32 (C,) or (), zero_point int32 like it) of quantizer q, checking the axis."""
    if q.axis not in (None, 0):
        raise ValueError(f"model: weight quantizer axis {q.axis} not exportable; expected None or 0 "
                         "(per output channel)")
    s = np.asarray(q.scale, np.float32)
    zp = np.asarray(q.zero_point, np.int32)
    if q.axis == 0:
        s, zp = np.broadcast_to(s, (n_out,)).copy(), np.broadcast_to(zp, (n_out,)).copy()
    return s, zp


def _dequantize(qw: np.ndarray, s: np.ndarray, zp: np.ndarray) -> np.ndarray:
    """(q - zp) * s in float32, s/zp broadcast over the output channel (axis 0) when per-channel."""
    shape = (-1,) + (1,) * (qw.ndim - 1) if s.ndim else ()
    f32 = np.float32
    return (qw.astype(f32) - zp.astype(f32).reshape(shape)) * s.astype(f32).reshape(shape)


def encode_weight(name: str, w: np.ndarray, q) -> tuple[dict, dict]:
    """(meta record, arrays) of one layer's latent weights ``w`` (out, ...) under quantizer ``q``."""
    rec = {"name": name, "weight_shape": list(w.shape)}
    if q is None or (isinstance(q, FakeQuantize) and not q.enabled):
        return {**rec, "quant": "float"}, {f"{name}.weight": np.array(w, np.float32)}
    wq = q.forward(w, np.empty_like(w))
    if isinstance(q, TernaryQuantizer):
        alpha = np.float32(q.alpha)
        trits = np.clip(np.rint(wq / alpha), -1, 1).astype(np.int8)
        arrays = {f"{name}.trits": pack_trits(trits), f"{name}.scale": np.array(alpha, np.float32)}
        rec = {**rec, "quant": "ternary", "bits": 2}
        back = _dequantize(trits, np.array(alpha), np.array(0, np.int32))
    elif isinstance(q, FakeQuantize):
        qmin, qmax = q.quant_range()
        s, zp = _channel_params(q, w.shape[0])
        shape = (-1,) + (1,) * (w.ndim - 1) if s.ndim else ()
        ints = np.clip(np.rint(wq / s.reshape(shape)) + zp.reshape(shape), qmin, qmax)
        qw = ints.astype(int_dtype(qmin, qmax))
        arrays = {f"{name}.qweight": qw, f"{name}.scale": s, f"{name}.zero_point": zp}
        rec = {**rec, "quant": "int", "bits": int(q.bits), "qmin": qmin, "qmax": qmax,
               "symmetric": bool(q.symmetric), "axis": q.axis}
        back = _dequantize(qw, s, zp)
    else:
        raise TypeError(f"model: unknown weight quantizer {type(q).__name__} on {name}")
    if not np.array_equal(back, wq):   # the integers must give the fake-quantized weights exactly
        raise RuntimeError(f"{name}: integer weights do not reproduce the fake-quantized weights")
    return rec, arrays


def encode_activation(i: int, q) -> tuple[dict | None, dict]:
    """(meta record or None, arrays) of hidden activation quantizer ``i``."""
    if q is None:
        return None, {}
    if not isinstance(q, FakeQuantize):
        raise TypeError(f"model: activation quantizer {i} is a {type(q).__name__}; expected FakeQuantize")
    if q.axis is not None:
        raise ValueError(f"model: activation quantizer {i} is per-channel (axis {q.axis}); not exportable")
    rec = {"bits": int(q.bits), "symmetric": bool(q.symmetric), "narrow_range": bool(q.narrow_range),
           "enabled": bool(q.enabled), "ste": q.ste.value}
    return rec, {f"act{i}.scale": np.array(q.scale, np.float32), f"act{i}.zero_point": np.array(q.zero_point, np.int32)}


def _write(path, meta: dict, arrays: dict) -> str:
    path = os.fspath(path)
    if not path.endswith(".npz"):
        path += ".npz"
    tmp = path + ".part"
    with open(tmp, "wb") as f:
        np.savez_compressed(f, meta=np.array(json.dumps(meta)), **arrays)
    os.replace(tmp, path)
    return path


def _cnn_layers(model):
    """(architecture, [(name, weights, bias, quantizer)]) of a Cnn; conv kernels as (Cout, C, kh, kw)."""
    arch = {"kind": "cnn", "image_shape": list(model.image_shape), "conv_channels": list(model.conv_channels),
            "n_outputs": int(model.dense_sizes[-1]), "hidden": list(model.dense_sizes[1:-1]),
            "kernel_size": list(model.kernel_size), "pool": list(model.pool), "activation": model.activation}
    named = []
    for i, spec in enumerate(model.layer_specs()):
        conv = spec["kind"] == "conv"
        w = model.weights(i).reshape(spec["weight_shape"])
        name = f"conv{i}" if conv else f"dense{i - model.n_conv}"
        named.append((name, w, model.biases(i), model.weight_quantizers[i]))
    return arch, named


def export_model(model, path) -> str:
    """Write ``model`` (Mlp or Cnn) to ``path`` (``.npz`` added if missing); returns the path.

    Each weight quantizer runs its forward once on the current latent weights (as a model forward
    does: an observing quantizer takes its scale from them), and the integers are taken from that."""
    if not isinstance(path, (str, os.PathLike)):
        raise TypeError(f"path: expected a str or os.PathLike, got {type(path).__name__}")
    from .cnn import Cnn
    from .mlp import Mlp

    if isinstance(model, Mlp):
        arch = {"kind": "mlp", "sizes": list(model.sizes), "activation": model.activation, "bias": model.bias}
        named = [(f"dense{i}", model.weights(i), model.biases(i), model.weight_quantizers[i])
                 for i in range(model.num_layers)]
    elif isinstance(model, Cnn):
        arch, named = _cnn_layers(model)
    else:
        raise TypeError(f"model: expected an Mlp or Cnn, got {type(model).__name__}")
    layers, arrays = [], {}
    for name, w, b, q in named:
        rec, arr = encode_weight(name, np.ascontiguousarray(w, np.float32), q)
        rec["bias"] = b is not None
        if b is not None:
            arr[f"{name}.bias"] = np.array(b, np.float32)
        layers.append(rec)
        arrays.update(arr)
    acts = []
    for i, q in enumerate(model.activation_quantizers):
        rec, arr = encode_activation(i, q)
        acts.append(rec)
        arrays.update(arr)
    meta = {"format": FORMAT, "version": VERSION, "architecture": arch, "layers": layers, "activations": acts}
    return _write(path, meta, arrays)


# ----------------------------------------------------------------------------- load


def _bad(path, why: str) -> ValueError:
    return ValueError(f"path: {os.fspath(path)!r} is not a valid qatlab export: {why}")


def _read(path) -> tuple[dict, dict]:
    """(meta, arrays) with every array read (zip CRCs checked); ValueError when unreadable."""
    if not isinstance(path, (str, os.PathLike)):
        raise TypeError(f"path: expected a str or os.PathLike, got {type(path).__name__}")
    if not os.path.isfile(path):
        raise ValueError(f"path: no such file: {os.fspath(path)!r}")
    try:
        with np.load(path, allow_pickle=False) as z:
            arrays = {k: z[k] for k in z.files}
    except (OSError, ValueError, EOFError, zipfile.BadZipFile, zlib.error, KeyError) as e:
        raise _bad(path, f"cannot read it as .npz ({type(e).__name__}: {e})") from None
    try:
        meta = json.loads(str(arrays.pop("meta")))
    except KeyError:
        raise _bad(path, "no 'meta' entry") from None
    except (ValueError, TypeError) as e:
        raise _bad(path, f"meta is not JSON ({e})") from None
    if not isinstance(meta, dict) or meta.get("format") != FORMAT:
        raise _bad(path, f"format is not {FORMAT!r}")
    if meta.get("version") != VERSION:
        raise _bad(path, f"version {meta.get('version')!r}, this qatlab reads version {VERSION}")
    return meta, arrays


def _array(arrays, key, dtype, shape, path) -> np.ndarray:
    a = arrays.get(key)
    if a is None:
        raise _bad(path, f"missing array {key!r}")
    if dtype is not None and a.dtype != np.dtype(dtype):
        raise _bad(path, f"{key} has dtype {a.dtype}, expected {np.dtype(dtype)}")
    if shape is not None and a.shape != tuple(shape):
        raise _bad(path, f"{key} has shape {a.shape}, expected {tuple(shape)}")
    return a


def _scale(arrays, key, shape, path) -> np.ndarray:
    s = _array(arrays, key, np.float32, shape, path)
    if not np.all(np.isfinite(s)) or np.any(s <= 0):
        raise _bad(path, f"{key} must be finite and > 0")
    return s


def decode_weight(rec: dict, arrays: dict, path) -> np.ndarray:
    """The float32 weights (dequantized) of one layer record; ValueError when inconsistent."""
    try:
        name, shape, kind = rec["name"], tuple(int(d) for d in rec["weight_shape"]), rec["quant"]
    except (KeyError, TypeError, ValueError):
        raise _bad(path, f"layer record {rec!r} lacks name/weight_shape/quant") from None
    if not shape or min(shape) < 1:
        raise _bad(path, f"{name}: weight_shape {shape} is not a positive shape")
    if kind == "float":
        w = _array(arrays, f"{name}.weight", np.float32, shape, path)
        if not np.all(np.isfinite(w)):
            raise _bad(path, f"{name}.weight holds NaN or inf")
        return w
    if kind == "ternary":
        alpha = _scale(arrays, f"{name}.scale", (), path)
        try:
            trits = unpack_trits(_array(arrays, f"{name}.trits", np.uint8, None, path), int(np.prod(shape)))
        except ValueError as e:
            raise _bad(path, f"{name}: {e}") from None
        return _dequantize(trits.reshape(shape), alpha, np.array(0, np.int32))
    if kind == "int":
        try:
            lo, hi = integer_range(int(rec["bits"]), bool(rec["symmetric"]), False)
            qmin, qmax = int(rec["qmin"]), int(rec["qmax"])
            axis = rec["axis"]
        except (KeyError, TypeError, ValueError) as e:
            raise _bad(path, f"{name}: bad integer record ({e})") from None
        if not lo <= qmin < qmax <= hi:
            raise _bad(path, f"{name}: range [{qmin}, {qmax}] does not fit {rec['bits']} bits")
        if axis not in (None, 0):
            raise _bad(path, f"{name}: axis {axis!r}, expected null or 0")
        cshape = () if axis is None else (shape[0],)
        qw = _array(arrays, f"{name}.qweight", int_dtype(qmin, qmax), shape, path)
        s = _scale(arrays, f"{name}.scale", cshape, path)
        zp = _array(arrays, f"{name}.zero_point", np.int32, cshape, path)
        if qw.min() < qmin or qw.max() > qmax or np.any(zp < qmin) or np.any(zp > qmax):
            raise _bad(path, f"{name}: integers outside [{qmin}, {qmax}]")
        return _dequantize(qw, s, zp)
    raise _bad(path, f"{name}: unknown quant kind {kind!r}")


def decode_bias(rec: dict, arrays: dict, path) -> np.ndarray | None:
    if not rec.get("bias"):
        return None
    b = _array(arrays, f"{rec['name']}.bias", np.float32, (int(rec["weight_shape"][0]),), path)
    if not np.all(np.isfinite(b)):
        raise _bad(path, f"{rec['name']}.bias holds NaN or inf")
    return b


def decode_activation(i: int, rec, arrays: dict, path):
    """A fixed (non-observing) FakeQuantize for activation record ``i``, or None."""
    if rec is None:
        return None
    try:
        s = _scale(arrays, f"act{i}.scale", (), path)
        zp = _array(arrays, f"act{i}.zero_point", np.int32, (), path)
        return FakeQuantize(bits=int(rec["bits"]), symmetric=bool(rec["symmetric"]),
                            narrow_range=bool(rec["narrow_range"]), scale=float(s), zero_point=int(zp),
                            enabled=bool(rec["enabled"]), ste=rec["ste"])
    except (KeyError, TypeError, ValueError) as e:
        raise _bad(path, f"activation quantizer {i}: {e}") from None


def _build_mlp(arch: dict, layers: list, weights: list, biases: list, acts: list, path):
    from .mlp import Mlp

    try:
        sizes, act, bias = [int(s) for s in arch["sizes"]], arch["activation"], bool(arch["bias"])
        model = Mlp(sizes, activation=act, bias=bias, activation_quantizers=acts)
    except (KeyError, TypeError, ValueError) as e:
        raise _bad(path, f"architecture {arch!r}: {e}") from None
    if len(layers) != model.num_layers:
        raise _bad(path, f"{len(layers)} layer records for {model.num_layers} layers")
    for i, (w, b) in enumerate(zip(weights, biases)):
        if w.shape != model.weights(i).shape or (b is None) == bias:
            raise _bad(path, f"layer {i}: weights {w.shape} / bias do not fit sizes {sizes}")
        model.weights(i)[:] = w
        if b is not None:
            model.biases(i)[:] = b
    return model


class ExportedModel:
    """A model loaded from an export: ``model`` (an Mlp or Cnn holding the dequantized weights and
    fixed activation quantizers), ``meta`` (the file's records) and ``forward(x)`` -> outputs."""

    def __init__(self, model, meta: dict):
        self.model = model
        self.meta = meta
        self.architecture = meta["architecture"]

    def forward(self, x) -> np.ndarray:
        """Outputs (B, K) float32 for inputs x (a new array)."""
        x = np.asarray(x)
        B = len(x) if x.ndim >= 1 and len(x) else 1
        return self.model.forward(x, self.model.scratch(B)).copy()

    def predict(self, x) -> np.ndarray:
        """Predicted class per row (argmax of :meth:`forward`)."""
        return np.argmax(self.forward(x), axis=1)

    def __repr__(self) -> str:
        kinds = [r["quant"] for r in self.meta["layers"]]
        return f"ExportedModel({self.architecture.get('kind')}, layers={kinds})"


def load_exported(path) -> ExportedModel:
    """Load an export written by ``model.export(path)``; ValueError when the file is not a valid one."""
    meta, arrays = _read(path)
    arch, layers, acts = meta.get("architecture"), meta.get("layers"), meta.get("activations")
    if not isinstance(arch, dict) or not isinstance(layers, list) or not isinstance(acts, list):
        raise _bad(path, "meta lacks architecture/layers/activations")
    for rec in layers:
        if not isinstance(rec, dict):
            raise _bad(path, f"layer record {rec!r} is not an object")
    weights = [decode_weight(rec, arrays, path) for rec in layers]
    biases = [decode_bias(rec, arrays, path) for rec in layers]
    aq = [decode_activation(i, rec, arrays, path) for i, rec in enumerate(acts)]
    if arch.get("kind") == "mlp":
        model = _build_mlp(arch, layers, weights, biases, aq, path)
    elif arch.get("kind") == "cnn":
        model = _build_cnn(arch, weights, biases, aq, path)
    else:
        raise _bad(path, f"unknown architecture kind {arch.get('kind')!r}")
    return ExportedModel(model, meta)


def _build_cnn(arch: dict, weights: list, biases: list, acts: list, path):
    from .cnn import Cnn

    try:
        model = Cnn(tuple(arch["image_shape"]), list(arch["conv_channels"]), int(arch["n_outputs"]),
                    hidden=list(arch["hidden"]), kernel_size=tuple(arch["kernel_size"]), pool=tuple(arch["pool"]),
                    activation=arch["activation"], activation_quantizers=acts)
    except (KeyError, TypeError, ValueError) as e:
        raise _bad(path, f"architecture {arch!r}: {e}") from None
    if len(weights) != model.num_layers:
        raise _bad(path, f"{len(weights)} layer records for {model.num_layers} layers")
    for i, (w, b) in enumerate(zip(weights, biases)):
        target = model.weights(i)
        if w.size != target.size or w.shape[0] != target.shape[0] or b is None:
            raise _bad(path, f"layer {i}: weights {w.shape} / bias do not fit the architecture ({target.shape})")
        target[:] = w.reshape(target.shape)
        model.biases(i)[:] = b
    return model
