"""SteTrainer: the 2-layer ternary reference trainer (latent float32 weights, STE, SGD, MSE).

Network, as in :mod:`qatlab.kernels.ste_kernels` (no biases)::

    x (B, I) -> h = relu(x @ Q(W1).T) (B, H) -> y = h @ Q(W2).T (B, O),   loss = mean((y - t)^2)

``Q`` is the BitNet b1.58 absmean ternary projection, one alpha per layer, recomputed every
step from the latents. Each step: quantize, forward, MSE loss (mean over batch and outputs),
backprop; the gradient w.r.t. ``Q(W)`` is mapped to the latent by the STE chosen in
``config.ste`` and zeroed where ``|W| > config.clip_threshold``; then ``W -= lr * dW``.

Differences from the seed (Rust) trainer, on purpose: the hidden activation is ReLU, not
``sign`` with a pass-through gradient (sign throws away the magnitude the MSE target needs and
its STE is biased); the forward uses ``alpha * T`` rather than bare trits (so the output has the
scale of the targets); weights are (out, in) like every layer in qatlab.

The hot path (a whole epoch, or one step) is one Numba call on buffers allocated once.
"""
from __future__ import annotations

import logging
import math
import weakref
from dataclasses import dataclass

import numpy as np

from ..config import QatConfig
from ..kernels import ste_kernels as K
from ..kernels.fakequant import ternary_forward
from ..quant import ternary_quantize
from ..quant.ste import SteKind
from ..nn.ternary_mlp import TernaryMLP, _as_batch

logger = logging.getLogger("qatlab.train.ste_trainer")


@dataclass(frozen=True)
class QatResult:
    """What :meth:`SteTrainer.train` returns.

    final_loss               ``loss_history[-1]`` (nan/inf when diverged)
    epochs_run               epochs started (the diverged one included)
    active_gradient_fraction share of all latents (W1 and W2 together) whose gradient was
                             non-zero on at least one step of the last epoch run; a gradient is
                             zero where the clip rule, the STE, a dead ReLU or a zero input kills it
    loss_history             float64 (epochs_run,): per epoch, the mean over its samples of the
                             per-sample MSE, each measured by the step that trained on it (before
                             that step's update); the diverged epoch holds the non-finite step loss
    diverged                 a step's loss was nan/inf; training stopped there, that step did not update
    message                  empty, or what happened when it diverged
    """

    final_loss: float
    epochs_run: int
    active_gradient_fraction: float
    loss_history: np.ndarray
    diverged: bool
    message: str = ""


class SteTrainer:
    """2-layer ternary MLP trainer; see the module doc. Build with :meth:`from_f32` or :meth:`from_mlp`.

    Fields: ``w1_latent`` (hidden, in) and ``w2_latent`` (out, hidden) float32 (writable
    arrays; assigning validates and copies), ``in_features``, ``hidden_size``, ``out_features``,
    ``config`` (a :class:`QatConfig`; it is watched, so edits apply from the next step).
    One trainer is not meant to be stepped from two threads at once.
    """

    def __init__(self, in_features: int, hidden_size: int, out_features: int, w1, w2, config: QatConfig | None = None):
        self.in_features = _positive_int(in_features, "in_features")
        self.hidden_size = _positive_int(hidden_size, "hidden_size")
        self.out_features = _positive_int(out_features, "out_features")
        H, I, O = self.hidden_size, self.in_features, self.out_features
        self._w1 = _check_weight(w1, (H, I), "w1", "(hidden_size, in_features)")
        self._w2 = _check_weight(w2, (O, H), "w2", "(out_features, hidden_size)")
        self.config = QatConfig() if config is None else config
        f32 = np.float32
        self._wq1, self._dq1 = np.zeros((H, I), f32), np.zeros((H, I), f32)
        self._wq2, self._dq2 = np.zeros((O, H), f32), np.zeros((O, H), f32)
        self._touched1, self._touched2 = np.zeros((H, I), np.uint8), np.zeros((O, H), np.uint8)
        self._rows = 0
        self._ensure_rows(1)

    # ------------------------------------------------------------------ construction

    @classmethod
    def from_f32(cls, in_features: int, hidden_size: int, out_features: int, w1, w2,
                 config: QatConfig | None = None) -> "SteTrainer":
        """Trainer with latents copied from ``w1`` (hidden, in) and ``w2`` (out, hidden), finite floats.

        Only 2-D arrays of exactly those shapes are accepted (the seed API's flat vectors were
        laid out (in, hidden); reshaping them silently would transpose the network).
        """
        return cls(in_features, hidden_size, out_features, w1, w2, config)

    @classmethod
    def from_mlp(cls, mlp: TernaryMLP, config: QatConfig | None = None) -> "SteTrainer":
        """Trainer whose latents reproduce a 2-layer ``mlp``: latent = c * T with c chosen so that
        ``mean|c*T| == alpha``; the first quantization gives back exactly T and alpha, so
        ``from_mlp(m).finalize()`` equals ``m`` (plain ``alpha * T`` would shrink alpha to
        ``alpha * share of non-zero trits``). An all-zero layer comes back with alpha = float32 eps."""
        if not isinstance(mlp, TernaryMLP):
            raise TypeError(f"mlp: expected a TernaryMLP, got {type(mlp).__name__}")
        if mlp.n_layers != 2:
            raise ValueError(f"mlp: SteTrainer needs a 2-layer TernaryMLP, got {mlp.n_layers} layers")
        w1, w2 = (_latent_from_trits(t, a) for t, a in zip(mlp.trits, mlp.alphas))
        return cls(mlp.in_features, mlp.hidden_size, mlp.out_features, w1, w2, config)

    @property
    def w1_latent(self) -> np.ndarray:
        """Latent weights of layer 1, float32 (hidden, in)."""
        return self._w1

    @w1_latent.setter
    def w1_latent(self, value) -> None:
        np.copyto(self._w1, _check_weight(value, self._w1.shape, "w1_latent", "(hidden_size, in_features)"))

    @property
    def w2_latent(self) -> np.ndarray:
        """Latent weights of layer 2, float32 (out, hidden)."""
        return self._w2

    @w2_latent.setter
    def w2_latent(self, value) -> None:
        np.copyto(self._w2, _check_weight(value, self._w2.shape, "w2_latent", "(out_features, hidden_size)"))

    def __repr__(self) -> str:
        return (f"SteTrainer({self.in_features}-{self.hidden_size}-{self.out_features}, "
                f"ste={self.config.ste!s}, lr={self.config.lr})")

    # ------------------------------------------------------------------ training

    def _ensure_rows(self, rows: int) -> None:
        """Grow the per-batch buffers (rows, .) if needed; they are reused across steps."""
        if rows <= self._rows:
            return
        f32 = np.float32
        self._xb = np.zeros((rows, self.in_features), f32)
        self._tb = np.zeros((rows, self.out_features), f32)
        self._h, self._dh = np.zeros((rows, self.hidden_size), f32), np.zeros((rows, self.hidden_size), f32)
        self._y, self._dy = np.zeros((rows, self.out_features), f32), np.zeros((rows, self.out_features), f32)
        self._rows = rows

    @property
    def config(self) -> QatConfig:
        """The settings; edits to it (or assigning another QatConfig) apply from the next step."""
        return self._config

    @config.setter
    def config(self, config: QatConfig) -> None:
        if not isinstance(config, QatConfig):
            raise TypeError(f"config: expected a QatConfig, got {type(config).__name__}")
        config.validate()
        if getattr(self, "_unwatch", None) is not None:
            self._unwatch()  # stop following the previous config
        ref = weakref.ref(self)

        def sync(*_events):  # Param reads cost ~us each: keep the step's scalars cached
            trainer = ref()
            if trainer is not None:
                trainer._hyper = (SteKind(config.ste).code, np.float32(config.lr), np.float32(config.clip_threshold))

        self._config = config
        watcher = config.param.watch(sync, ["ste", "lr", "clip_threshold"])
        self._unwatch = weakref.finalize(self, config.param.unwatch, watcher)  # also runs when self is collected
        sync()

    def train_step(self, x, t) -> float:
        """One SGD step; returns its MSE loss (before the update).

        x (in,) with t (out,), or a batch x (B, in) with t (B, out); finite values. A non-finite
        loss is returned (never raised) and the latents are left unchanged.
        """
        x2, single = _as_batch(x, self.in_features, "x")
        t2, t_single = _as_batch(t, self.out_features, "t")
        if single != t_single or x2.shape[0] != t2.shape[0]:
            raise ValueError(f"t: shape {np.shape(t)} does not match x shape {np.shape(x)}")
        B = x2.shape[0]
        self._ensure_rows(B)
        ste, lr, clip = self._hyper
        scratch = K.SteScratch(self._wq1, self._wq2, self._h[:B], self._y[:B], self._dy[:B], self._dh[:B],
                               self._dq1, self._dq2, self._touched1, self._touched2)
        loss = K.train_step(x2, t2, self._w1, self._w2, ste, lr, clip, tuple(scratch))
        if loss < 0:  # the kernel found a non-finite input and did nothing
            _check_finite(x2, "x")
            _check_finite(t2, "t")
        return float(loss)

    def train(self, samples) -> QatResult:
        """Train ``config.epochs`` epochs of ``config.batch_size`` batches -> :class:`QatResult`.

        ``samples``: a list of (x (in,), t (out,)) pairs, or a tuple of arrays (X (n, in), T (n, out)).
        Each epoch visits the samples in an order from ``np.random.default_rng(config.seed)``
        (seeded afresh per call, so equal configs give identical runs); the last batch of an
        epoch may be short. Every ``config.log_every`` epochs the loss is logged at INFO on
        ``qatlab.train.ste_trainer``. A non-finite loss stops training (``diverged``), never raises.
        """
        X, T = self._dataset(samples)
        cfg = self.config
        ste, lr, clip = self._hyper
        batch, epochs, log_every = int(cfg.batch_size), int(cfg.epochs), int(cfg.log_every)
        self._ensure_rows(min(batch, X.shape[0]))
        rng = np.random.default_rng(cfg.seed)
        history = np.empty(epochs, dtype=np.float64)
        diverged, message, run = False, "", 0
        for epoch in range(epochs):
            perm = rng.permutation(X.shape[0])
            self._touched1.fill(0)
            self._touched2.fill(0)
            scratch = K.SteScratch(self._wq1, self._wq2, self._h, self._y, self._dy, self._dh, self._dq1, self._dq2,
                                   self._touched1, self._touched2)
            loss, steps = K.train_epoch(X, T, perm, batch, self._w1, self._w2, ste, lr, clip, self._xb, self._tb,
                                        tuple(scratch))
            history[epoch], run = loss, epoch + 1
            if not math.isfinite(loss):
                diverged = True
                message = f"loss became {loss} at epoch {epoch + 1}, step {steps}; training stopped"
                logger.warning("SteTrainer diverged: %s", message)
                break
            if log_every and run % log_every == 0:
                logger.info("epoch %d/%d  loss %.6g", run, epochs, loss)
        touched = np.count_nonzero(self._touched1) + np.count_nonzero(self._touched2)
        return QatResult(final_loss=float(history[run - 1]), epochs_run=run,
                         active_gradient_fraction=touched / (self._w1.size + self._w2.size),
                         loss_history=history[:run].copy(), diverged=diverged, message=message)

    def _dataset(self, samples) -> tuple[np.ndarray, np.ndarray]:
        """samples -> validated C-contiguous float32 X (n, in), T (n, out)."""
        I, O = self.in_features, self.out_features
        if isinstance(samples, tuple) and len(samples) == 2 and isinstance(samples[0], np.ndarray) \
                and samples[0].ndim == 2:
            X, T = samples[0], np.asarray(samples[1])
            names = ("X", "T")
        else:
            try:
                pairs = list(samples)
            except TypeError:
                raise TypeError("samples: expected a list of (x, t) pairs or a tuple (X, T) of arrays") from None
            for i, pair in enumerate(pairs):
                if not isinstance(pair, (tuple, list)) or len(pair) != 2:
                    raise ValueError(f"samples[{i}]: expected an (x, t) pair")
                for j, (a, n) in enumerate(zip(pair, (I, O))):
                    if np.shape(a) != (n,):
                        raise ValueError(f"samples[{i}][{j}]: expected shape ({n},), got {np.shape(a)}")
            X = np.array([p[0] for p in pairs]).reshape(len(pairs), I)
            T = np.array([p[1] for p in pairs]).reshape(len(pairs), O)
            names = ("samples x", "samples t")
        for arr, name in zip((X, T), names):
            if arr.dtype.kind not in "fiub":
                raise TypeError(f"{name}: expected real numbers, got dtype {arr.dtype}")
        if X.shape[0] < 1 or X.shape[1:] != (I,):
            raise ValueError(f"{names[0]}: expected shape (n, {I}) with n >= 1, got {X.shape}")
        if T.shape != (X.shape[0], O):
            raise ValueError(f"{names[1]}: expected shape ({X.shape[0]}, {O}), got {T.shape}")
        X, T = (np.ascontiguousarray(a, dtype=np.float32) for a in (X, T))
        _check_finite(X, names[0])
        _check_finite(T, names[1])
        return X, T

    # ------------------------------------------------------------------ inference / export

    def forward(self, x) -> np.ndarray:
        """Fake-quant forward of the current latents: x (in,) -> (out,), x (B, in) -> (B, out), float32."""
        x2, single = _as_batch(x, self.in_features, "x")
        wq1, wq2 = np.empty_like(self._w1), np.empty_like(self._w2)
        ternary_forward(self._w1.reshape(-1), wq1.reshape(-1))
        ternary_forward(self._w2.reshape(-1), wq2.reshape(-1))
        h = np.empty((x2.shape[0], self.hidden_size), np.float32)
        y = np.empty((x2.shape[0], self.out_features), np.float32)
        K.dense(x2, wq1, True, h)
        K.dense(h, wq2, False, y)
        return y[0] if single else y

    def finalize(self) -> TernaryMLP:
        """Ternarize the latents (absmean, per layer) -> :class:`TernaryMLP`; its forward equals :meth:`forward`."""
        (t1, a1), (t2, a2) = ternary_quantize(self._w1), ternary_quantize(self._w2)
        return TernaryMLP([t1, t2], [a1, a2])


# ----------------------------------------------------------------------------- helpers

def _positive_int(value, name: str) -> int:
    if isinstance(value, bool) or not isinstance(value, (int, np.integer)) or value < 1:
        raise ValueError(f"{name}: must be an integer >= 1, got {value!r}")
    return int(value)


def _check_weight(w, shape, name: str, meaning: str) -> np.ndarray:
    """w -> float32 C-contiguous copy of exactly ``shape``, finite; ValueError/TypeError otherwise."""
    arr = np.asarray(w)
    if arr.dtype.kind not in "fiub":
        raise TypeError(f"{name}: expected a real numeric array, got dtype {arr.dtype}")
    if arr.shape != tuple(shape):
        raise ValueError(f"{name}: expected shape {tuple(shape)} {meaning}, got {arr.shape}")
    arr = np.array(arr, dtype=np.float32, order="C")
    _check_finite(arr, name)
    return arr


def _check_finite(a: np.ndarray, name: str) -> None:
    if not np.isfinite(a).all():
        raise ValueError(f"{name}: contains NaN or inf")


def _latent_from_trits(trits: np.ndarray, alpha: float) -> np.ndarray:
    """float32 c * T with mean|c*T| == alpha after absmean's float32 rounding (see from_mlp)."""
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
