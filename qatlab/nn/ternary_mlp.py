"""TernaryMLP: a trained ternary network (int8 trits + one alpha per layer) for inference and storage.

Layer ``i`` holds trits ``T_i`` (out_i, in_i) in {-1, 0, +1} and a float32 scale ``alpha_i``;
its weight is ``W_i = float32(T_i) * alpha_i``. No biases. Hidden layers use ReLU, the last
layer is linear::

    a_0 = x;   a_{i+1} = relu(a_i @ W_i.T)  (hidden);   y = a_{L-1} @ W_{L-1}.T

It runs as an :class:`~qatlab.nn.Mlp` (relu, no biases) whose weights are ``alpha_i * T_i``, and
converts from and to one (:meth:`TernaryMLP.from_mlp`, :meth:`TernaryMLP.to_mlp`). This is the network
:class:`qatlab.train.ste_trainer.SteTrainer` trains; both forwards are ``Mlp.forward`` on the same
weights, so ``trainer.finalize().forward(x)`` equals the trainer's fake-quant forward bit for bit.

File format (``save``/``load``, a plain uncompressed ``.npz``, no pickles)::

    format   str     "qatlab.TernaryMLP"
    version  int64   1
    sizes    int64   (L+1,)  [in, hidden..., out]
    alphas   float32 (L,)
    trits_i  uint8   (ceil(out_i*in_i / 4),)  row-major trits, 4 per byte, 2 bits each:
                     code = trit + 1, byte = c0 | c1 << 2 | c2 << 4 | c3 << 6; padding codes are 1 (trit 0)
"""
from __future__ import annotations

import math
import os
import tempfile
import zipfile
import zlib

import numpy as np

from ..quant import TernaryQuantizer, ternary_quantize
from .mlp import Mlp

FORMAT = "qatlab.TernaryMLP"
VERSION = 1
# What reading a damaged .npz raises: truncated or bit-flipped members fail their CRC or their
# inflate, name an unsupported zip feature, or leave a .npy header that does not parse
_UNREADABLE = (OSError, ValueError, EOFError, KeyError, NotImplementedError, zipfile.BadZipFile, zlib.error)


class TernaryMLP:
    """Ternary MLP; ``trits`` a sequence of integer arrays (out_i, in_i), ``alphas`` one scale > 0 per layer.

    Consecutive layers must chain (``in_{i+1} == out_i``). Trits are stored as read-only int8
    copies, alphas as float32 (``self.alphas`` holds them as Python floats).
    """

    def __init__(self, trits, alphas):
        trits, alphas = list(trits), list(alphas)
        if not trits:
            raise ValueError("trits: need at least one layer")
        if len(alphas) != len(trits):
            raise ValueError(f"alphas: expected {len(trits)} values (one per layer), got {len(alphas)}")
        self._trits, self._alpha32 = [], []
        for i, (t, a) in enumerate(zip(trits, alphas)):
            t = np.asarray(t)
            if t.dtype.kind not in "iu":
                raise TypeError(f"trits[{i}]: expected an integer array, got dtype {t.dtype}")
            if t.ndim != 2 or 0 in t.shape:
                raise ValueError(f"trits[{i}]: expected a non-empty 2-D array (out, in), got shape {t.shape}")
            if i and t.shape[1] != self._trits[-1].shape[0]:
                raise ValueError(f"trits[{i}]: has {t.shape[1]} inputs, layer {i - 1} has {self._trits[-1].shape[0]} outputs")
            if np.any((t < -1) | (t > 1)):
                raise ValueError(f"trits[{i}]: values must be -1, 0 or +1")
            a32 = np.float32(a)
            if not (math.isfinite(a32) and a32 > 0):
                raise ValueError(f"alphas[{i}]: must be a finite number > 0, got {a!r}")
            t8 = np.ascontiguousarray(t, dtype=np.int8).copy()
            t8.flags.writeable = False
            self._trits.append(t8)
            self._alpha32.append(a32)
        self._mlp = Mlp(self.sizes, activation="relu", bias=False)   # the dequantized weights alpha_i * T_i
        for i, (t8, a32) in enumerate(zip(self._trits, self._alpha32)):
            np.multiply(t8, a32, out=self._mlp.weights(i), dtype=np.float32)

    # ------------------------------------------------------------------ Mlp conversions

    @classmethod
    def from_mlp(cls, mlp: Mlp) -> "TernaryMLP":
        """Ternarize an :class:`~qatlab.nn.Mlp` without biases (relu between layers): each layer's latent
        weights -> trits and alpha by the absmean projection (:func:`~qatlab.quant.ternary_quantize`, what
        its :class:`~qatlab.quant.TernaryQuantizer` computes in the forward)."""
        if not isinstance(mlp, Mlp):
            raise TypeError(f"mlp: expected an Mlp, got {type(mlp).__name__}")
        if mlp.bias or (mlp.num_layers > 1 and mlp.activation != "relu"):
            raise ValueError(f"mlp: a TernaryMLP has relu between layers and no biases, got {mlp!r}")
        pairs = [ternary_quantize(mlp.weights(i)) for i in range(mlp.num_layers)]
        return cls([t for t, _ in pairs], [a for _, a in pairs])

    def to_mlp(self, ste="identity") -> Mlp:
        """An :class:`~qatlab.nn.Mlp` (relu, no biases, a :class:`~qatlab.quant.TernaryQuantizer` with
        ``ste`` per layer) whose latents project back to exactly these trits and alphas, so
        ``TernaryMLP.from_mlp(m.to_mlp())`` equals ``m``: latent = c * T with c chosen so that
        ``mean|c*T| == alpha`` (plain ``alpha * T`` would shrink alpha to ``alpha * share of non-zero
        trits``). An all-zero layer comes back with alpha = float32 eps."""
        mlp = Mlp(self.sizes, activation="relu", bias=False,
                  weight_quantizers=[TernaryQuantizer(ste=ste) for _ in self._trits])
        for i, (t, a) in enumerate(zip(self._trits, self._alpha32)):
            mlp.weights(i)[:] = _latent_from_trits(t, float(a))
        return mlp

    # ------------------------------------------------------------------ shape

    @property
    def trits(self) -> tuple[np.ndarray, ...]:
        """Read-only int8 trit matrices, one (out_i, in_i) per layer."""
        return tuple(self._trits)

    @property
    def alphas(self) -> tuple[float, ...]:
        """Per-layer scales (float32 values as Python floats)."""
        return tuple(float(a) for a in self._alpha32)

    @property
    def sizes(self) -> tuple[int, ...]:
        """(in, hidden..., out)."""
        return (self._trits[0].shape[1],) + tuple(t.shape[0] for t in self._trits)

    @property
    def n_layers(self) -> int:
        """Number of weight layers L."""
        return len(self._trits)

    @property
    def in_features(self) -> int:
        """Inputs of the first layer."""
        return self.sizes[0]

    @property
    def hidden_size(self) -> int:
        """Width of the first hidden layer (the hidden layer of a 2-layer net)."""
        if self.n_layers < 2:
            raise AttributeError("hidden_size: a 1-layer TernaryMLP has no hidden layer")
        return self.sizes[1]

    @property
    def out_features(self) -> int:
        """Outputs of the last layer."""
        return self.sizes[-1]

    def weights(self, i: int) -> np.ndarray:
        """Dequantized weight ``float32(T_i) * alpha_i`` of layer ``i``, (out_i, in_i) float32 (a copy)."""
        return self._mlp.weights(self._layer(i)).copy()

    def _layer(self, i) -> int:
        if isinstance(i, bool) or not isinstance(i, (int, np.integer)) or not 0 <= i < self.n_layers:
            raise ValueError(f"i: layer index must be an int in 0..{self.n_layers - 1}, got {i!r}")
        return int(i)

    def __repr__(self) -> str:
        return f"TernaryMLP(sizes={list(self.sizes)}, alphas={[round(a, 6) for a in self.alphas]})"

    # ------------------------------------------------------------------ inference

    def forward(self, x) -> np.ndarray:
        """Network output: x (in,) -> (out,), or x (B, in) -> (B, out); float32."""
        x2, single = as_batch(x, self.in_features, "x")
        y = self._mlp.forward(x2, self._mlp.scratch(x2.shape[0]))
        return y[0] if single else y

    __call__ = forward

    def predict(self, x) -> np.ndarray | int:
        """argmax of the output (ties go to the lowest index): x (in,) -> int, x (B, in) -> int64 (B,)."""
        y = self.forward(x)
        return int(np.argmax(y)) if y.ndim == 1 else np.argmax(y, axis=1)

    def layer_sparsity(self, i: int) -> float:
        """Share of zero trits in layer ``i`` (0..n_layers-1)."""
        t = self._trits[self._layer(i)]
        return float(np.count_nonzero(t == 0) / t.size)

    # ------------------------------------------------------------------ storage

    def save(self, path) -> None:
        """Write the .npz described in the module doc to ``path`` (exactly that name; atomic replace)."""
        arrays = {"format": np.array(FORMAT), "version": np.array(VERSION, dtype=np.int64),
                  "sizes": np.array(self.sizes, dtype=np.int64), "alphas": np.array(self._alpha32, dtype=np.float32)}
        for i, t in enumerate(self._trits):
            arrays[f"trits_{i}"] = pack_trits(t)
        path = os.fspath(path)
        fd, tmp = tempfile.mkstemp(dir=os.path.dirname(os.path.abspath(path)), suffix=".tmp")
        try:
            with os.fdopen(fd, "wb") as f:
                np.savez(f, **arrays)
            os.replace(tmp, path)
        except BaseException:
            if os.path.exists(tmp):
                os.remove(tmp)
            raise

    @classmethod
    def load(cls, path) -> "TernaryMLP":
        """Read a file written by :meth:`save`; malformed content raises ``ValueError`` naming what is wrong."""
        try:
            with np.load(path, allow_pickle=False) as f:
                files = {k: f[k] for k in f.files}
        except _UNREADABLE as exc:  # not a zip / pickled objects / truncated / a bad CRC (bit flips)
            raise ValueError(f"path: {os.fspath(path)!r} is not a readable TernaryMLP .npz "
                             f"({type(exc).__name__}: {exc})") from exc
        for key in ("format", "version", "sizes", "alphas"):
            if key not in files:
                raise ValueError(f"path: missing array {key!r}; not a TernaryMLP file")
        if files["format"].shape != () or str(files["format"]) != FORMAT:
            raise ValueError(f"format: expected {FORMAT!r}, got {files['format']!r}")
        version = files["version"]   # exactly the integer 1: neither 1.9 nor "1"
        if version.shape != () or version.dtype.kind not in "iu" or int(version) != VERSION:
            raise ValueError(f"version: this reader supports {VERSION}, got {files['version']!r}")
        sizes, alphas = files["sizes"], files["alphas"]
        if sizes.dtype.kind not in "iu" or sizes.ndim != 1 or sizes.size < 2 or np.any(sizes < 1):
            raise ValueError(f"sizes: expected >= 2 positive integers, got {sizes!r}")
        n_layers = sizes.size - 1
        if alphas.dtype != np.float32 or alphas.shape != (n_layers,):
            raise ValueError(f"alphas: expected float32 of shape ({n_layers},), got {alphas.dtype} {alphas.shape}")
        extra = set(files) - {"format", "version", "sizes", "alphas"} - {f"trits_{i}" for i in range(n_layers)}
        if extra:
            raise ValueError(f"path: unexpected arrays {sorted(extra)}")
        trits = []
        for i in range(n_layers):
            key = f"trits_{i}"
            if key not in files:
                raise ValueError(f"path: missing array {key!r}")
            shape = (int(sizes[i + 1]), int(sizes[i]))
            trits.append(unpack_trits(files[key], shape, name=key))
        return cls(trits, alphas)


# ----------------------------------------------------------------------------- 2-bit packing

def pack_trits(trits) -> np.ndarray:
    """Trits (any shape, values -1/0/+1) -> uint8 (ceil(n/4),), row-major, 4 per byte (see module doc)."""
    t = np.asarray(trits).reshape(-1)
    if t.dtype.kind not in "iu" or np.any((t < -1) | (t > 1)):
        raise ValueError("trits: expected integer values -1, 0 or +1")
    codes = (t.astype(np.int16) + 1).astype(np.uint8)
    pad = (-codes.size) % 4
    codes = np.concatenate([codes, np.ones(pad, dtype=np.uint8)]).reshape(-1, 4)
    return (codes[:, 0] | (codes[:, 1] << 2) | (codes[:, 2] << 4) | (codes[:, 3] << 6)).astype(np.uint8)


def unpack_trits(packed, shape, name: str = "packed") -> np.ndarray:
    """Inverse of :func:`pack_trits`: uint8 (ceil(n/4),) -> int8 of ``shape``; invalid codes raise ``ValueError``."""
    packed = np.asarray(packed)
    n = int(np.prod(shape))
    if packed.dtype != np.uint8 or packed.shape != ((n + 3) // 4,):
        raise ValueError(f"{name}: expected uint8 of shape ({(n + 3) // 4},) for {shape} trits, "
                         f"got {packed.dtype} {packed.shape}")
    codes = (packed[:, None] >> np.array([0, 2, 4, 6], dtype=np.uint8)) & 3
    codes = codes.reshape(-1)
    if np.any(codes == 3):
        raise ValueError(f"{name}: contains the invalid 2-bit code 3")
    if np.any(codes[n:] != 1):
        raise ValueError(f"{name}: padding after the last trit must encode 0")
    return (codes[:n].astype(np.int8) - 1).reshape(shape)


def _latent_from_trits(trits: np.ndarray, alpha: float) -> np.ndarray:
    """float32 c * T with mean|c*T| == alpha after absmean's float32 rounding (see to_mlp)."""
    nnz = np.count_nonzero(trits)
    tf = trits.astype(np.float32)
    if nnz == 0:
        return tf
    c = np.float32(alpha * trits.size / nnz)
    for cand in (c, np.nextafter(c, np.float32(np.inf)), np.nextafter(c, np.float32(0))):
        w = tf * cand
        if ternary_quantize(w)[1] == alpha:
            return w
    return tf * c


def as_batch(x, features: int, name: str) -> tuple[np.ndarray, bool]:
    """x (features,) or (B, features) -> (C-contiguous float32 (B, features), was 1-D)."""
    arr = np.asarray(x)
    if arr.dtype.kind not in "fiub":
        raise TypeError(f"{name}: expected a real numeric array, got dtype {arr.dtype}")
    if arr.ndim == 1 and arr.shape[0] == features:
        return np.ascontiguousarray(arr, dtype=np.float32).reshape(1, features), True
    if arr.ndim == 2 and arr.shape[1] == features and arr.shape[0] >= 1:
        return np.ascontiguousarray(arr, dtype=np.float32), False
    raise ValueError(f"{name}: expected shape ({features},) or (B, {features}) with B >= 1, got {arr.shape}")
