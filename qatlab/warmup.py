"""Kernel warm-up: compile (or load from the Numba cache) the kernels a first run needs, up front.

On an empty Numba cache the first run of a configuration spends ~25 s compiling before its first
step. :func:`warmup` trains each configuration for one epoch, so that the dashboard's first Start,
an STE comparison and a phase run begin at once; with a filled cache it only loads the kernels
(about a second). :func:`start` runs it once per process on a background thread.

:func:`status` says what is still compiling, for the page's progress line: the warm-up's
configurations left, and whether Numba is compiling anything right now (a run of a configuration
the warm-up did not cover compiles on its first step).
"""
from __future__ import annotations

import logging
import threading
import time
from typing import Callable

from numba.core import event as _nb_event

from .config import ExperimentConfig, dashboard_config
from .quant.ste import SteKind

__all__ = ["default_configs", "warmup", "start", "wait", "status", "status_text", "WarmupStatus"]


def default_configs() -> list[tuple[str, ExperimentConfig]]:
    """(label, config) the dashboard starts most: its default run (:func:`dashboard_config`), the STE
    comparison's kinds, fake-quantized weights (with and without activations) and float weights of that
    CNN; then the digits MLP and its phase training (phase training is MLP-only)."""
    out = []

    def add(label, base, **changes):
        cfg = base()
        for key, value in changes.items():
            section, name = key.split("__")
            setattr(getattr(cfg, section), name, value)
        out.append((label, cfg))

    add("default run", dashboard_config)
    default_ste = dashboard_config().quant.ste
    for kind in SteKind:
        if kind.value != default_ste:
            add(f"STE {kind.value}", dashboard_config, quant__ste=kind.value)
    add("fake-quantized weights", dashboard_config, quant__weights="fake")
    add("fake weights + activations", dashboard_config, quant__weights="fake", quant__activations="fake")
    add("float weights", dashboard_config, quant__weights="float")
    add("MLP on digits", ExperimentConfig)
    add("phase training", ExperimentConfig, phase__enabled=True)
    add("phase training (least squares)", ExperimentConfig, phase__enabled=True, phase__predictor="least_squares")
    return out


class WarmupStatus:
    """What the warm-up has left (thread-safe snapshot via :meth:`snapshot`)."""

    def __init__(self):
        self._lock = threading.Lock()
        self.left: list[str] = []      # labels not finished yet, the current one first
        self.seconds: dict[str, float] = {}
        self.error = ""

    def snapshot(self) -> list[str]:
        with self._lock:
            return list(self.left)


class _CompileCounter(_nb_event.Listener):
    """Counts Numba compilations in progress (nested compilations of callees included)."""

    def __init__(self):
        self.active = 0

    def on_start(self, event):
        self.active += 1

    def on_end(self, event):
        self.active = max(0, self.active - 1)


_counter = _CompileCounter()
_nb_event.register("numba:compile", _counter)
_log = logging.getLogger("qatlab.warmup")
_status = WarmupStatus()
_start_lock = threading.Lock()
_thread: threading.Thread | None = None


#: Phase runs reach some kernels only after a few FULL/predict cycles (digits: 23 steps an epoch).
PHASE_EPOCHS = 6
#: Image datasets whose CNN runs warm up on mnist1d instead (1-channel signals: the same compiled kernels).
IMAGE_SETS = ("mnist", "fashion_mnist")


def _tiny(config: ExperimentConfig) -> ExperimentConfig:
    """``config`` trained for one epoch, phase runs for a few cycles (synthetic data capped at 400
    samples, image CNNs on mnist1d): the same kernels and argument types, a fraction of the time."""
    if not isinstance(config, ExperimentConfig):
        raise TypeError(f"configs: expected (label, ExperimentConfig) pairs, got {type(config).__name__}")
    cfg = config.copy()
    cfg.optim.epochs = PHASE_EPOCHS if cfg.phase.enabled else 1
    if cfg.model.architecture == "cnn" and cfg.data.dataset in IMAGE_SETS:
        cfg.data.dataset = "mnist1d"     # the same kernels (dtypes and ranks) on 40 values, not 784, an image
    if cfg.data.dataset == "synthetic":
        cfg.data.n_samples = min(cfg.data.n_samples, 400)
    cfg.validate()
    return cfg


def warmup(configs=None, progress: Callable[[list[str]], None] | None = None) -> dict[str, float]:
    """Train each configuration for one epoch so its kernels are compiled and cached.

    Args:
        configs: ``[(label, ExperimentConfig), ...]`` or plain configs (labelled by position);
            default :func:`default_configs`.
        progress: called with the labels still left (the one starting first) before each
            configuration, and with ``[]`` at the end.

    Returns {label: seconds}. A configuration that fails is reported in ``status_text()`` /
    the returned dict is missing it; the warm-up goes on with the next one.
    """
    from .runs import run_experiment   # runs imports the trainers: keep `import qatlab.warmup` light

    items = default_configs() if configs is None else list(configs)
    pairs = [(it if isinstance(it, tuple) else (f"config {i + 1}", it)) for i, it in enumerate(items)]
    pairs = [(str(label), _tiny(cfg)) for label, cfg in pairs]   # validates all before starting any
    with _status._lock:
        _status.left = [label for label, _ in pairs]
    seconds = {}
    for i, (label, cfg) in enumerate(pairs):
        if progress is not None:
            progress([lab for lab, _ in pairs[i:]])
        t0 = time.perf_counter()
        result = run_experiment(cfg)
        if result.status == "finished":
            seconds[label] = time.perf_counter() - t0
        else:
            lines = result.message.strip().splitlines()
            _status.error = f"{label}: {result.status}" + (f": {lines[-1]}" if lines else "")
            _log.warning("warm-up of %s did not finish (its runs compile on first use): %s", label, _status.error)
        with _status._lock:
            _status.left = [lab for lab, _ in pairs[i + 1:]]
            _status.seconds.update(seconds)
    if progress is not None:
        progress([])
    return seconds


def start(configs=None) -> threading.Thread:
    """Start :func:`warmup` on a daemon thread, once per process (later calls return the same thread)."""
    global _thread
    with _start_lock:
        if _thread is None:
            if configs is None:
                pending = [label for label, _ in default_configs()]
            else:
                pending = [c[0] if isinstance(c, tuple) else f"config {i + 1}" for i, c in enumerate(configs)]
            with _status._lock:           # status says "compiling" from now on, not when the thread runs
                _status.left = pending
            _thread = threading.Thread(target=_run_logged, args=(configs,), name="qatlab-warmup", daemon=True)
            _thread.start()
        return _thread


def _run_logged(configs) -> None:
    try:
        warmup(configs)
    except Exception as exc:   # a warm-up failure must not take the server down; runs compile lazily then
        _status.error = f"{type(exc).__name__}: {exc}"
        _log.warning("kernel warm-up failed (runs compile on first use): %s", _status.error)
        with _status._lock:
            _status.left = []


def wait(timeout: float | None = None) -> bool:
    """Block until the warm-up started by :func:`start` has ended; True if it has."""
    thread = _thread
    if thread is None:
        return True
    thread.join(timeout)
    return not thread.is_alive()


def status() -> tuple[int, bool]:
    """(warm-up configurations left, whether Numba is compiling right now)."""
    return len(_status.snapshot()), _counter.active > 0


def status_text() -> str | None:
    """``"compiling kernels... (n left)"`` while anything compiles, else None."""
    left, compiling = status()
    if left:
        return f"compiling kernels... ({left} left)"
    if compiling:
        return "compiling kernels..."
    return None
