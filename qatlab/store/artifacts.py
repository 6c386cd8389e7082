"""A trained model as a store artifact: an uncompressed ``.npz`` (no pickles) and back.

Arrays::

    meta            JSON text: format, version, sizes, activation, bias, init, image_shape (Cnn; else null)
    config          JSON text: the run's ExperimentConfig (rebuilds the quantizers)
    flat_params     float32 (num_params,)   the latent parameters (Mlp.flat_params layout)
    w<i>_trits      uint8, packed 4 trits a byte (qatlab.nn.ternary_mlp.pack_trits)  ternary layers
    w<i>_alpha      float32 ()                                                     ternary layers
    wq<i>_scale, wq<i>_zero_point[, wq<i>_min, wq<i>_max]    fake-quantized layers (scale, observer)
    aq<i>_scale, aq<i>_zero_point[, aq<i>_min, aq<i>_max]    hidden activation quantizers

:func:`load_model` rebuilds the model with :func:`qatlab.train.build.build_model` from the config
and restores the parameters and quantizer state, so its forward pass equals the stored model's.
"""
from __future__ import annotations

import io
import json
import zipfile

import numpy as np

FORMAT = "qatlab.Mlp"
VERSION = 1


def storable(model) -> bool:
    """True for the models :func:`model_to_npz` saves (Mlp and Cnn)."""
    from ..nn import Cnn, Mlp
    return isinstance(model, (Mlp, Cnn))


def model_to_npz(model, config: dict) -> bytes:
    """The ``.npz`` bytes of an :class:`~qatlab.nn.Mlp` or Cnn trained with ``config`` (a dict)."""
    from ..quant import FakeQuantize, TernaryQuantizer, ternary_quantize
    from ..nn.ternary_mlp import pack_trits
    if not storable(model):
        raise TypeError(f"model: the store saves qatlab.Mlp and Cnn models, got {type(model).__name__}")
    image_shape = getattr(model, "image_shape", None)
    meta = {"format": FORMAT, "version": VERSION, "sizes": list(model.sizes), "activation": model.activation,
            "bias": model.bias, "init": getattr(model, "init", None),
            "image_shape": None if image_shape is None else list(image_shape)}
    arrays = {"meta": np.array(json.dumps(meta)), "config": np.array(json.dumps(config)),
              "flat_params": model.flat_params().copy()}
    for i, q in enumerate(model.weight_quantizers):
        if isinstance(q, TernaryQuantizer):
            trits, alpha = ternary_quantize(model.weights(i))
            arrays[f"w{i}_trits"] = pack_trits(trits)
            arrays[f"w{i}_alpha"] = np.float32(alpha)
        elif isinstance(q, FakeQuantize):
            arrays.update(_fake_state(f"wq{i}", q))
    for i, q in enumerate(model.activation_quantizers):
        if isinstance(q, FakeQuantize):
            arrays.update(_fake_state(f"aq{i}", q))
    buf = io.BytesIO()
    np.savez(buf, **arrays)
    return buf.getvalue()


def _fake_state(prefix: str, q) -> dict:
    out = {f"{prefix}_scale": np.asarray(q.scale, np.float32), f"{prefix}_zero_point": np.asarray(q.zero_point, np.int64)}
    obs = q.observer
    if obs is not None and obs.min_val is not None:
        out[f"{prefix}_min"] = np.asarray(obs.min_val)
        out[f"{prefix}_max"] = np.asarray(obs.max_val)
    return out


def load_model(data: bytes):
    """The model stored by :func:`model_to_npz`; ``ValueError`` for a foreign blob."""
    from ..config import ExperimentConfig
    from ..quant import FakeQuantize, TernaryQuantizer
    from ..train.build import build_model
    try:
        files = np.load(io.BytesIO(data), allow_pickle=False)
        meta = json.loads(str(files["meta"]))
        config = json.loads(str(files["config"]))
    except (OSError, KeyError, ValueError, zipfile.BadZipFile) as exc:
        raise ValueError(f"model artifact: not a stored qatlab model ({exc})") from exc
    if meta.get("format") != FORMAT or meta.get("version") != VERSION:
        raise ValueError(f"model artifact: format {meta.get('format')!r} v{meta.get('version')} is not "
                         f"{FORMAT!r} v{VERSION}")
    sizes = meta["sizes"]
    image_shape = meta.get("image_shape")
    model = build_model(ExperimentConfig.from_dict(config), sizes[0], sizes[-1],
                        None if image_shape is None else tuple(image_shape))
    if list(model.sizes) != sizes or model.activation != meta["activation"]:
        raise ValueError(f"model artifact: the config rebuilds sizes {list(model.sizes)}, the artifact holds {sizes}")
    flat = files["flat_params"]
    if flat.shape != model.flat_params().shape:
        raise ValueError(f"model artifact: flat_params has {flat.shape}, the model needs {model.flat_params().shape}")
    model.flat_params()[:] = flat
    for i, q in enumerate(model.weight_quantizers):
        if isinstance(q, TernaryQuantizer) and f"w{i}_alpha" in files:
            q.alpha = np.float32(files[f"w{i}_alpha"])
        elif isinstance(q, FakeQuantize):
            _restore_fake(f"wq{i}", q, files)
    for i, q in enumerate(model.activation_quantizers):
        if isinstance(q, FakeQuantize):
            _restore_fake(f"aq{i}", q, files)
    return model


def _restore_fake(prefix: str, q, files) -> None:
    if f"{prefix}_scale" not in files:
        return
    scale, zp = files[f"{prefix}_scale"], files[f"{prefix}_zero_point"]
    q.update_params(scale if scale.ndim else float(scale), zp if zp.ndim else int(zp))
    if f"{prefix}_min" in files and q.observer is not None:
        lo, hi = files[f"{prefix}_min"], files[f"{prefix}_max"]
        q.observer.min_val = lo if lo.ndim else lo[()]
        q.observer.max_val = hi if hi.ndim else hi[()]
