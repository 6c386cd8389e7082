"""SteTrainer: the 2-layer ternary reference trainer (latent float32 weights, STE, SGD, MSE).

The network is an :class:`~qatlab.nn.Mlp` ``[in, hidden, out]`` with relu, no biases and a
:class:`~qatlab.quant.TernaryQuantizer` on both layers (:attr:`SteTrainer.mlp`)::

    x (B, I) -> h = relu(x @ Q(W1).T) (B, H) -> y = h @ Q(W2).T (B, O),   loss = mean((y - t)^2)

``Q`` is the BitNet b1.58 absmean ternary projection, one alpha per layer, recomputed every
step from the latents. Each step: quantize, forward, MSE loss (mean over batch and outputs),
backprop; the gradient w.r.t. ``Q(W)`` is mapped to the latent by the STE chosen in
``config.ste`` and zeroed where ``|W| > config.clip_threshold``; then ``W -= lr * dW``.

Differences from the seed (Rust) trainer, on purpose: the hidden activation is ReLU, not
``sign`` with a pass-through gradient (sign throws away the magnitude the MSE target needs and
its STE is biased); the forward uses ``alpha * T`` rather than bare trits (so the output has the
scale of the targets); weights are (out, in) like every layer in qatlab.

The hot path (a whole epoch, or one step) is one Numba call (:mod:`qatlab.kernels.ste_kernels`: the
main engine's kernels, and its SGD kernel with the ternary STE and the latent clip) on the Mlp's
buffers, allocated once.
"""
from __future__ import annotations

import logging
import math
import weakref
from dataclasses import dataclass

import numpy as np

from ..config import QatConfig
from ..kernels import ste_kernels as K
from ..kernels.state import Activations, Net
from ..nn.mlp import Mlp
from ..nn.ternary_mlp import TernaryMLP, as_batch
from ..quant import TernaryQuantizer
from ..quant.ste import SteKind

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
    ``config`` (a :class:`QatConfig`; it is watched, so edits apply from the next step), ``mlp``
    (the :class:`~qatlab.nn.Mlp` whose weights the latents are).
    One trainer is not meant to be stepped from two threads at once.
    """

    def __init__(self, in_features: int, hidden_size: int, out_features: int, w1, w2, config: QatConfig | None = None):
        self.in_features = _positive_int(in_features, "in_features")
        self.hidden_size = _positive_int(hidden_size, "hidden_size")
        self.out_features = _positive_int(out_features, "out_features")
        H, I, O = self.hidden_size, self.in_features, self.out_features
        w1 = _check_weight(w1, (H, I), "w1", "(hidden_size, in_features)")
        w2 = _check_weight(w2, (O, H), "w2", "(out_features, hidden_size)")
        self._mlp = Mlp([I, H, O], activation="relu", bias=False,
                        weight_quantizers=[TernaryQuantizer(), TernaryQuantizer()])
        self._w1, self._w2 = self._mlp.weights(0), self._mlp.weights(1)   # views of its flat parameters
        np.copyto(self._w1, w1)
        np.copyto(self._w2, w2)
        self._touched = np.zeros(self._mlp.num_params, np.uint8)   # laid out like the flat parameters
        self._rows = 0
        self._ensure_rows(1)
        self.config = QatConfig() if config is None else config

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
    def from_mlp(cls, mlp: TernaryMLP | Mlp, config: QatConfig | None = None) -> "SteTrainer":
        """Trainer whose latents reproduce a 2-layer ``mlp``.

        A :class:`TernaryMLP`: its :meth:`~TernaryMLP.to_mlp` latents, c * T with c chosen so that
        the first quantization gives back exactly T and alpha, so ``from_mlp(m).finalize()`` equals
        ``m``. An :class:`~qatlab.nn.Mlp` ``[in, hidden, out]`` (relu, no biases): its latent weights, copied.
        """
        if isinstance(mlp, TernaryMLP):
            if mlp.n_layers != 2:
                raise ValueError(f"mlp: SteTrainer needs a 2-layer TernaryMLP, got {mlp.n_layers} layers")
            mlp = mlp.to_mlp()
        elif isinstance(mlp, Mlp):
            if mlp.num_layers != 2 or mlp.bias or mlp.activation != "relu":
                raise ValueError(f"mlp: SteTrainer needs a 2-layer relu Mlp without biases, got {mlp!r}")
        else:
            raise TypeError(f"mlp: expected a TernaryMLP or an Mlp, got {type(mlp).__name__}")
        I, H, O = mlp.sizes
        return cls(I, H, O, mlp.weights(0), mlp.weights(1), config)

    @property
    def mlp(self) -> Mlp:
        """The network trained: its weights are the latents (:attr:`w1_latent`, :attr:`w2_latent`)."""
        return self._mlp

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
        """Grow the per-batch buffers (the Mlp's scratch and gradients, rows >= the batch) if needed;
        they are reused across steps, and the kernels' Net tuple names them."""
        if rows <= self._rows:
            return
        mlp, f32 = self._mlp, np.float32
        scratch, grads = mlp.scratch(rows), mlp.gradients(rows)
        # stes 0: a fused.train_step on this Net leaves dL/dQ(W) as is; the STE comes with the clip in the update
        layers = mlp.kernel_layers(scratch, grads)
        self._net = tuple(Net(layers.act, np.ones(2, np.int64), np.zeros(2, np.int64), np.zeros(2, f32),
                              (self._w1, self._w2), layers.bs, layers.wqs, layers.dws, layers.dbs,
                              mlp.flat_params(), grads.flat()))
        self._scratch, self._grads, self._acts = scratch, grads, {}
        self._xb = np.zeros((rows, self.in_features), f32)
        self._tb = np.zeros((rows, self.out_features), f32)
        self._rows = rows

    def _acts_at(self, B: int) -> tuple:
        """The Activations tuple at B <= self._rows rows (made once per B)."""
        acts = self._acts.get(B)
        if acts is None:
            acts = self._acts[B] = tuple(Activations(*self._mlp.kernel_rows(self._scratch, self._grads, B)))
        return acts

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
                ste = SteKind(config.ste)
                for q in trainer._mlp.weight_quantizers:   # the Mlp's own backward would use it
                    q.ste = ste
                trainer._hyper = (ste.code, np.float32(config.lr), np.float32(config.clip_threshold))

        self._config = config
        watcher = config.param.watch(sync, ["ste", "lr", "clip_threshold"])
        self._unwatch = weakref.finalize(self, config.param.unwatch, watcher)  # also runs when self is collected
        sync()

    def train_step(self, x, t) -> float:
        """One SGD step; returns its MSE loss (before the update).

        x (in,) with t (out,), or a batch x (B, in) with t (B, out); finite values. A non-finite
        loss is returned (never raised) and the latents are left unchanged.
        """
        x2, single = as_batch(x, self.in_features, "x")
        t2, t_single = as_batch(t, self.out_features, "t")
        if single != t_single or x2.shape[0] != t2.shape[0]:
            raise ValueError(f"t: shape {np.shape(t)} does not match x shape {np.shape(x)}")
        B = x2.shape[0]
        self._ensure_rows(B)
        ste, lr, clip = self._hyper
        loss = K.train_step(x2, t2, self._net, self._acts_at(B), ste, lr, clip, self._touched)
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
        n = X.shape[0]
        batch, epochs, log_every = min(int(cfg.batch_size), n), int(cfg.epochs), int(cfg.log_every)
        self._ensure_rows(batch)
        acts = self._acts_at(batch)
        last_acts = self._acts_at(n % batch) if n % batch else acts
        rng = np.random.default_rng(cfg.seed)
        history = np.empty(epochs, dtype=np.float64)
        diverged, message, run = False, "", 0
        for epoch in range(epochs):
            perm = rng.permutation(n)
            self._touched.fill(0)
            loss, steps = K.train_epoch(X, T, perm, batch, self._net, acts, last_acts, self._xb, self._tb,
                                        ste, lr, clip, self._touched)
            history[epoch], run = loss, epoch + 1
            if not math.isfinite(loss):
                diverged = True
                message = f"loss became {loss} at epoch {epoch + 1}, step {steps}; training stopped"
                logger.warning("SteTrainer diverged: %s", message)
                break
            if log_every and run % log_every == 0:
                logger.info("epoch %d/%d  loss %.6g", run, epochs, loss)
        return QatResult(final_loss=float(history[run - 1]), epochs_run=run,
                         active_gradient_fraction=np.count_nonzero(self._touched) / self._touched.size,
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
        """Fake-quant forward of the current latents (:meth:`Mlp.forward <qatlab.nn.Mlp.forward>`):
        x (in,) -> (out,), x (B, in) -> (B, out), float32."""
        x2, single = as_batch(x, self.in_features, "x")
        y = self._mlp.forward(x2, self._mlp.scratch(x2.shape[0]))
        return y[0] if single else y

    def finalize(self) -> TernaryMLP:
        """Ternarize the latents (absmean, per layer) -> :class:`TernaryMLP`; its forward equals :meth:`forward`."""
        return TernaryMLP.from_mlp(self._mlp)


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
