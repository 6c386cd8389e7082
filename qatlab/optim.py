r"""Optimizers (SGD, momentum, Adam/AdamW), learning-rate schedules and global-norm clipping.

Optimizers update float32 parameters in place, one Numba kernel call per contiguous
segment (split across the cores from ``qatlab.runtime.parallel.MIN_ELEMENTS`` elements, same bits). Pass ``mlp.flat_params()`` (or ``mlp.parameters()``, whose views are merged back
into the one flat buffer) and step with ``grads.flat()``: the whole update is then ONE call.
Parameters and gradients may also be lists of ``(name, array)`` pairs or of arrays (C-contiguous
float32), in matching order.

Update rules (t = 1, 2, ... the step number; ``g`` is the gradient after clipping; ``wd`` the
weight decay, decoupled by default: ``p <- p (1 - lr wd)`` before the update, as AdamW; with
``decoupled_weight_decay=False`` it is L2 instead, ``g <- g + wd p``, as torch.optim.Adam/SGD)::

    SGD       p <- p - lr g
    momentum  buf <- mu buf + g;  p <- p - lr buf                   (torch.optim.SGD, momentum=mu)
    Adam      m <- m + (1 - b1) (g - m);  v <- b2 v + (1 - b2) g^2
              p <- p - (lr / (1 - b1^t)) m / (sqrt(v) / sqrt(1 - b2^t) + eps)   (torch.optim.Adam)

Flush to zero: a state value (``buf``, ``m``, ``v``) smaller in magnitude than the smallest normal
float32 (``FLT_MIN`` = 1.1755e-38) is stored as 0. Without it, a parameter whose gradient stays 0
(a dead ReLU unit, a clipped latent) decays its moments into subnormal numbers, where they stay
(0.9 x the smallest subnormal rounds back to itself), and subnormal arithmetic made the whole
Adam step 8x slower on an Intel Xeon (7.5 -> 63 us for 19k parameters, a third of them with zero
gradient). The flushed values move ``p`` by less than 1e-30 lr.
"""
from __future__ import annotations

import math
import numbers

import numpy as np

from .runtime import parallel
from .kernels.dense import scale_inplace, sum_squares
from .kernels.optim_kernels import adam_kernel, momentum_kernel, sgd_kernel, fused_row, fused_rows

SCHEDULES = ("constant", "step", "cosine")
OPTIMIZERS = ("sgd", "momentum", "adam")
_NO_STATE = np.zeros(0, np.float32)
_KERNEL_CODES = {sgd_kernel: 0, momentum_kernel: 1, adam_kernel: 2}   # see Optimizer.fused_kernel


# -- helpers ------------------------------------------------------------------------------------
def _ptr(a: np.ndarray) -> int:
    return a.__array_interface__["data"][0]


def _segments(obj, name: str) -> list[np.ndarray]:
    """1-d float32 views of a flat array, an object with ``flat()`` (Gradients), or a list of
    arrays / (name, array) pairs; consecutive views of one flat buffer are merged into one."""
    if not isinstance(obj, np.ndarray) and callable(getattr(obj, "flat", None)):
        obj = obj.flat()
    arrays = [obj] if isinstance(obj, np.ndarray) else [a[1] if isinstance(a, tuple) else a for a in obj]
    segs = []
    for a in arrays:
        if not isinstance(a, np.ndarray) or a.dtype != np.float32:
            raise TypeError(f"{name}: expected float32 numpy arrays, got {type(a).__name__} {getattr(a, 'dtype', '')}")
        if not a.flags.c_contiguous or not a.flags.writeable:
            raise ValueError(f"{name}: arrays must be C-contiguous and writable")
        if a.size:
            segs.append(a.reshape(-1))
    if not segs:
        raise ValueError(f"{name}: no parameters")
    if len(segs) == 1:
        return segs
    end = _ptr(segs[0])
    for s in segs:
        if _ptr(s) != end:
            return segs
        end += s.nbytes
    base = segs[0].base
    if isinstance(base, np.ndarray) and base.dtype == np.float32 and base.ndim == 1 and base.flags.c_contiguous:
        off = (_ptr(segs[0]) - _ptr(base)) // 4
        total = sum(s.size for s in segs)
        if 0 <= off and off + total <= base.size:
            return [base[off:off + total]]
    return segs


def _pieces(segs: list[np.ndarray], bounds: list[int]) -> list[np.ndarray]:
    """Cut the concatenation of ``segs`` at the global offsets ``bounds`` (sorted, ending at the total)."""
    out, start, k, seg_start = [], 0, 0, 0
    for b in bounds:
        while start >= seg_start + segs[k].size:
            seg_start += segs[k].size
            k += 1
        out.append(segs[k][start - seg_start:b - seg_start])
        start = b
    return out


def clip_global_norm(grads, max_norm: float) -> float:
    """Scale every gradient by ``max_norm / (n + 1e-6)`` if the global L2 norm n (float64
    accumulation over all arrays) exceeds ``max_norm`` > 0; return n (pre-clip), as
    torch.nn.utils.clip_grad_norm_. ``grads``: flat array, Gradients, or list of arrays/pairs."""
    if not isinstance(max_norm, numbers.Real) or not max_norm > 0:
        raise ValueError(f"max_norm: expected a number > 0, got {max_norm!r}")
    segs = _segments(grads, "grads")
    n = math.sqrt(sum(sum_squares(s) for s in segs))
    if n > max_norm:
        c = max_norm / (n + 1e-6)
        for s in segs:
            scale_inplace(s, c)
    return n


def _check_number(name, value, lo, hi, lo_open=False, hi_open=False):
    ok = isinstance(value, numbers.Real) and not isinstance(value, bool) and math.isfinite(value)
    ok = ok and (value > lo if lo_open else value >= lo) and (value < hi if hi_open else value <= hi)
    if not ok:
        rng = f"{'(' if lo_open else '['}{lo}, {hi}{')' if hi_open else ']'}"
        raise ValueError(f"{name}: expected a number in {rng}, got {value!r}")
    return float(value)


class Schedule:
    """Learning rate at step t = 0, 1, ... of ``total_steps``:

    constant  lr
    step      lr, x0.1 from t >= 0.5 T, x0.01 from t >= 0.75 T
    cosine    lr * 0.5 * (1 + cos(pi * min(t, T) / T))
    """

    def __init__(self, kind: str = "constant", lr: float = 1e-2, total_steps: int | None = None):
        if kind not in SCHEDULES:
            raise ValueError(f"schedule: expected one of {', '.join(SCHEDULES)}; got {kind!r}")
        self.kind = kind
        self.base_lr = _check_number("lr", lr, 0.0, math.inf, lo_open=True)
        if kind != "constant" and (isinstance(total_steps, bool) or not isinstance(total_steps, numbers.Integral)
                                   or total_steps < 1):
            raise ValueError(f"total_steps: expected an int >= 1 for schedule {kind!r}, got {total_steps!r}")
        self.total_steps = None if total_steps is None else int(total_steps)

    def __call__(self, t: int) -> float:
        if self.kind == "constant":
            return self.base_lr
        T = self.total_steps
        if self.kind == "step":
            return self.base_lr * (0.01 if t >= 0.75 * T else 0.1 if t >= 0.5 * T else 1.0)
        return self.base_lr * 0.5 * (1.0 + math.cos(math.pi * min(t, T) / T))

    def rates(self, t: int, count: int) -> np.ndarray:
        """float64 (count,): the rates at steps t, t + 1, ..., t + count - 1."""
        if self.kind == "constant":
            rates = np.empty(count)      # np.full's Python wrapper took longer than the rest of a call
            rates.fill(self.base_lr)
            return rates
        return np.array([self(t + j) for j in range(count)], dtype=np.float64)

    def __repr__(self) -> str:
        return f"Schedule({self.kind!r}, lr={self.base_lr}, total_steps={self.total_steps})"


class Optimizer:
    """Base class: holds the parameter segments, the schedule, the step counter and clipping.

    params: flat float32 array, or list of (name, array) / arrays. lr: a number (constant) or a
    :class:`Schedule`. max_grad_norm > 0 clips the gradient's global norm inside :meth:`step`
    (without writing to the gradient arrays); ``last_grad_norm`` is then the pre-clip norm.
    """

    n_state = 0  # float32 state buffers per parameter element

    def __init__(self, params, lr=1e-2, weight_decay=0.0, max_grad_norm=0.0, decoupled_weight_decay=True):
        self.schedule = lr if isinstance(lr, Schedule) else Schedule("constant", lr)
        self.weight_decay = _check_number("weight_decay", weight_decay, 0.0, math.inf)
        self.max_grad_norm = _check_number("max_grad_norm", max_grad_norm, 0.0, math.inf)
        self.decoupled_weight_decay = bool(decoupled_weight_decay)
        self._p = _segments(params, "params")
        self._sizes = [s.size for s in self._p]
        self.num_params = sum(self._sizes)
        self._state = [np.zeros(self.num_params, np.float32) for _ in range(self.n_state)]
        self.t = 0
        self.last_grad_norm = math.nan
        self.last_lr = math.nan
        self._last_grads = self._last_split = None
        self._fused_scalars = np.zeros(8)

    @property
    def lr(self) -> float:
        """Learning rate the next :meth:`step` will use (from the schedule)."""
        return self.schedule(self.t)

    def step(self, grads, lr: float | None = None, grad_scale: float = 1.0) -> None:
        """One update of every parameter from ``grads`` (same total size and order as params).
        lr: override the schedule for this step. grad_scale: the update uses ``grad_scale * grads``
        (a factor applied inside the kernel, grads untouched; e.g. a clipping factor computed
        elsewhere), which ``max_grad_norm`` then clips."""
        lr = self.schedule(self.t) if lr is None else _check_number("lr", lr, 0.0, math.inf)
        if grad_scale != 1.0:
            grad_scale = _check_number("grad_scale", grad_scale, 0.0, math.inf)
        if grads is self._last_grads:  # same object as last step: its segments are cached
            g, groups = self._last_split
        else:
            g = _segments(grads, "grads")
            if len(g) == 1 and len(self._p) == 1:
                if g[0].size != self.num_params:
                    raise ValueError(f"grads: expected {self.num_params} elements (as params), got {g[0].size}")
                groups = [(self._p[0], g[0], *self._state)]
            else:
                groups = self._split(g)
            if isinstance(grads, np.ndarray) or hasattr(grads, "flat"):  # lists may be mutated: no cache
                self._last_grads, self._last_split = grads, (g, groups)
        gscale = grad_scale
        if self.max_grad_norm > 0:
            n = math.sqrt(sum(sum_squares(s) for s in g)) * grad_scale
            self.last_grad_norm = n
            if n > self.max_grad_norm:
                gscale = grad_scale * self.max_grad_norm / (n + 1e-6)
        self.t += 1
        self.last_lr = lr
        decay, l2 = self._decay_l2(lr)
        for arrays in groups:
            self._update(arrays, gscale, l2, decay, lr)

    def _decay_l2(self, lr: float) -> tuple[float, float]:
        """(decay, l2) of the kernels at learning rate lr: decoupled weight decay multiplies p by
        1 - lr * wd, coupled adds wd * p to the gradient."""
        wd = self.weight_decay
        return (1.0 - lr * wd, 0.0) if self.decoupled_weight_decay else (1.0, wd)

    def is_over(self, flat: np.ndarray) -> bool:
        """True when this optimizer updates exactly ``flat``: one segment, the same memory."""
        return len(self._p) == 1 and self._p[0].size == flat.size and _ptr(self._p[0]) == _ptr(flat)

    def _split(self, g):
        if sum(s.size for s in g) != self.num_params:
            raise ValueError(f"grads: expected {self.num_params} elements (as params), got {sum(s.size for s in g)}")
        bounds = sorted(set(np.cumsum(self._sizes).tolist()) | set(np.cumsum([s.size for s in g]).tolist()))
        cols = [_pieces(self._p, bounds), _pieces(g, bounds)] + [_pieces([s], bounds) for s in self._state]
        return list(zip(*cols))

    def _update(self, arrays, gscale, l2, decay, lr):
        parallel.elementwise(self._kernel(), arrays, (gscale, l2, decay, *self._scalars(self.t, lr)))

    def _kernel(self):  # pragma: no cover - abstract
        """The Numba update kernel: ``kernel(p, g, *state, gscale, l2, decay, *self._scalars(t, lr))``."""
        raise NotImplementedError

    def _scalars(self, t: int, lr: float) -> tuple:  # pragma: no cover - abstract
        """The kernel's scalars after (gscale, l2, decay) for step number t (1-based)."""
        raise NotImplementedError

    def fused_kernel(self) -> tuple:
        """How :func:`qatlab.kernels.fused.train_step` makes this optimizer's steps:
        ``(code, state0, state1)``: code 0 SGD, 1 momentum, 2 Adam, and the state buffers
        (float32 (n,), empty when unused). See also :meth:`fused_scalars`, :meth:`fused_done`."""
        states = [*self._state, _NO_STATE, _NO_STATE]
        return self._code, states[0], states[1]

    @property
    def _code(self) -> int:
        return _KERNEL_CODES[self._kernel()]

    def fused_constants(self) -> tuple:
        """What :func:`qatlab.kernels.optim_kernels.fused_row` needs besides the step and its
        learning rate: (max_grad_norm, weight_decay, decoupled (1.0 or 0.0), mu, b1, b2, eps), 0.0
        where this optimizer has no such number."""
        return (self.max_grad_norm, self.weight_decay, float(self.decoupled_weight_decay), *self._row_constants())

    def _row_constants(self) -> tuple:  # pragma: no cover - abstract
        """(mu, b1, b2, eps) of :meth:`fused_constants`."""
        raise NotImplementedError

    def fused_scalars(self, lr: float, ahead: int = 0, out: np.ndarray | None = None) -> np.ndarray:
        """The kernel's scalars for step ``t + 1 + ahead`` at learning rate ``lr``: float64 (8,) =
        max_grad_norm, l2, decay, then :meth:`_scalars` of that step (zero-padded), written into
        ``out`` (default: a buffer that the next call overwrites) by
        :func:`~qatlab.kernels.optim_kernels.fused_row`; changes nothing else (see :meth:`fused_done`)."""
        if not (lr.__class__ is float and 0.0 <= lr < math.inf):   # NaN, inf, negative: refused
            lr = _check_number("lr", lr, 0.0, math.inf)
        sc = self._fused_scalars if out is None else out
        fused_row(self._code, self.fused_constants(), self.t + 1 + ahead, float(lr), sc)
        return sc

    def fused_run_scalars(self, out: np.ndarray, lr_scale: float = 1.0) -> np.ndarray:
        """Learning rates and kernel scalars of the next ``len(out)`` steps, for a kernel that makes
        them in one call: step j runs at ``lr_j = schedule(t + j) * lr_scale`` with
        ``out[j] = fused_scalars(lr_j, ahead=j)`` (out float64 (steps, 8)). Returns the ``lr_j``
        (float64 (steps,)); call :meth:`fused_done` for the steps made. Changes nothing else."""
        if not (isinstance(out, np.ndarray) and out.dtype == np.float64 and out.ndim == 2 and out.shape[1] == 8):
            raise ValueError(f"out: expected a float64 array of shape (steps, 8), got {getattr(out, 'shape', out)!r}")
        if lr_scale.__class__ is not float or lr_scale != 1.0:
            lr_scale = _check_number("lr_scale", lr_scale, 0.0, math.inf, hi_open=True)
            lrs = self.schedule.rates(self.t, len(out))
            lrs *= lr_scale
        else:
            lrs = self.schedule.rates(self.t, len(out))
        fused_rows(self._code, self.fused_constants(), self.t + 1, lrs, out)   # fused_scalars of each step
        return lrs

    def fused_done(self, lr: float, grad_norm: float, steps: int = 1) -> None:
        """Bookkeeping of ``steps`` steps the fused kernel made, the last one at ``lr`` with the norm
        ``grad_norm``: as :meth:`step` does (t, last_lr, and last_grad_norm when clipping is on)."""
        self.t += steps
        self.last_lr = float(lr)
        if self.max_grad_norm > 0:
            self.last_grad_norm = float(grad_norm)


class SGD(Optimizer):
    """SGD, with heavy-ball momentum when ``momentum`` > 0 (torch.optim.SGD, dampening 0)."""

    def __init__(self, params, lr=1e-2, momentum=0.0, weight_decay=0.0, max_grad_norm=0.0,
                 decoupled_weight_decay=True):
        self.momentum = _check_number("momentum", momentum, 0.0, 1.0, hi_open=True)
        self.n_state = 1 if self.momentum > 0 else 0
        super().__init__(params, lr, weight_decay, max_grad_norm, decoupled_weight_decay)

    def _kernel(self):
        return momentum_kernel if self.momentum > 0 else sgd_kernel

    def _scalars(self, t, lr):
        return (lr, self.momentum) if self.momentum > 0 else (lr,)

    def _row_constants(self):
        return self.momentum, 0.0, 0.0, 0.0


class Momentum(SGD):
    """SGD with momentum (default 0.9)."""

    def __init__(self, params, lr=1e-2, momentum=0.9, weight_decay=0.0, max_grad_norm=0.0,
                 decoupled_weight_decay=True):
        super().__init__(params, lr, momentum, weight_decay, max_grad_norm, decoupled_weight_decay)


class Adam(Optimizer):
    """Adam with bias correction (torch.optim.Adam); decoupled weight decay makes it AdamW."""

    n_state = 2

    def __init__(self, params, lr=1e-3, betas=(0.9, 0.999), eps=1e-8, weight_decay=0.0, max_grad_norm=0.0,
                 decoupled_weight_decay=True):
        b1, b2 = betas
        self.betas = (_check_number("betas[0]", b1, 0.0, 1.0, hi_open=True),
                      _check_number("betas[1]", b2, 0.0, 1.0, hi_open=True))
        self.eps = _check_number("eps", eps, 0.0, math.inf)
        super().__init__(params, lr, weight_decay, max_grad_norm, decoupled_weight_decay)

    def _kernel(self):
        return adam_kernel

    def _scalars(self, t, lr):
        b1, b2 = self.betas
        return b1, b2, lr / (1.0 - b1 ** t), math.sqrt(1.0 - b2 ** t), self.eps

    def _row_constants(self):
        return 0.0, *self.betas, self.eps


def make_optimizer(cfg, params, steps_per_epoch: int) -> Optimizer:
    """Optimizer described by an :class:`qatlab.config.OptimConfig`: ``cfg.optimizer`` (sgd,
    momentum, adam), ``lr`` with ``schedule`` over ``epochs * steps_per_epoch`` steps,
    ``momentum``, ``weight_decay`` (decoupled), ``max_grad_norm`` (0 = off)."""
    if isinstance(steps_per_epoch, bool) or not isinstance(steps_per_epoch, numbers.Integral) or steps_per_epoch < 1:
        raise ValueError(f"steps_per_epoch: expected an int >= 1, got {steps_per_epoch!r}")
    if cfg.optimizer not in OPTIMIZERS:
        raise ValueError(f"optimizer: expected one of {', '.join(OPTIMIZERS)}; got {cfg.optimizer!r}")
    sched = Schedule(cfg.schedule, cfg.lr, int(cfg.epochs) * int(steps_per_epoch))
    common = dict(weight_decay=cfg.weight_decay, max_grad_norm=cfg.max_grad_norm)
    if cfg.optimizer == "adam":
        return Adam(params, sched, **common)
    if cfg.optimizer == "momentum":
        return Momentum(params, sched, momentum=cfg.momentum, **common)
    return SGD(params, sched, **common)
