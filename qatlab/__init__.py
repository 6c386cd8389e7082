"""qatlab: a laboratory for quantization-aware training."""
import os as _os

# One BLAS thread per training thread: the matrices here are small and several runs train at
# once, where a multi-threaded OpenBLAS is much slower. Must be set before numpy/scipy load
# their OpenBLAS; an explicit setting in the environment wins.
_os.environ.setdefault("OPENBLAS_NUM_THREADS", "1")
import sys as _sys

# One per-user Numba cache (server, notebooks, CLI, tests share compiled kernels) unless the
# environment names one. Set before qatlab's kernel modules import numba; if numba is already
# loaded, its config is set directly (the env copy keeps numba's reload_config and workers in line).
_numba = _sys.modules.get("numba")
if not _os.environ.get("NUMBA_CACHE_DIR") and not (_numba is not None and _numba.config.CACHE_DIR):
    _os.environ["NUMBA_CACHE_DIR"] = _os.path.join(
        _os.environ.get("XDG_CACHE_HOME") or _os.path.join(_os.path.expanduser("~"), ".cache"), "qatlab", "numba")
    if _numba is not None:
        _numba.config.CACHE_DIR = _os.environ["NUMBA_CACHE_DIR"]

if "numpy" in _sys.modules:   # imported first (a notebook's `import numpy`, Panel under `panel serve`):
    from .runtime.blas import limit_blas_threads as _limit   # its OpenBLAS already read the environment
    _limit()
from .config import (DataConfig, ExperimentConfig, ModelConfig, OptimConfig, PhaseConfig, PredictionConfig,
                     QatConfig, QuantConfig, TernaryConfig, VSAConfig, dashboard_config)
from .metrics import MetricsLog
from .quant import (FakeQuantize, MinMaxObserver, MovingAverageMinMaxObserver, SteKind, TernaryQuantizer,
                    ternary_dequantize, ternary_quantize)
from . import data
from .runs import LocalRun, RunResult, compare_ste, run_experiment, start_ste_comparison
from .nn import Cnn, CnnGradients, CnnScratch, Conv2d, Flatten, Gradients, Linear, MaxPool2d, Mlp, Scratch
from .nn.export import ExportedModel, load_exported
from .nn.summary import ModelSummary, summary
from .train.fused_step import FusedStep
from .nn.ternary_mlp import TernaryMLP
from .train.ste_trainer import QatResult, SteTrainer
from .train.phase import PhaseTrainer, StepInfo, TrainerStats, TrainingPhase, make_phase_trainer
from .train.predictors import CorrectionResult, LeastSquaresPredictor, MomentumPredictor
from .train.ternary_accumulator import TernaryGradientAccumulator
from .train.vsa import VSABundle, VSAGradientCompressor, VSAHistory, VSAReport
from .resources import check_memory, estimate_memory
from .store import RunRecord, RunStore


def __getattr__(name: str):
    """The executor (connect, shutdown, Run = RemoteRun) imports Dask, about a second: loaded on first use."""
    if name in ("connect", "shutdown", "RemoteRun", "Run"):
        from . import executor
        return executor.RemoteRun if name == "Run" else getattr(executor, name)
    raise AttributeError(f"module 'qatlab' has no attribute {name!r}")

# Sweeps: grid/random points x seeds on the executor (making a Sweep loads Dask, for its checks).
from .sweep import MedianStopping, Sweep, SweepResult  # noqa: E402

__all__ = [
    # quantizers
    "SteKind", "FakeQuantize", "MinMaxObserver", "MovingAverageMinMaxObserver", "TernaryQuantizer",
    "ternary_quantize", "ternary_dequantize",
    # configs and data
    "ExperimentConfig", "DataConfig", "ModelConfig", "QuantConfig", "OptimConfig", "PhaseConfig",
    "PredictionConfig", "QatConfig", "TernaryConfig", "VSAConfig", "dashboard_config", "data",
    # models
    "Mlp", "Gradients", "Scratch", "Cnn", "CnnGradients", "CnnScratch", "Linear", "Conv2d", "MaxPool2d",
    "Flatten", "TernaryMLP", "ExportedModel", "load_exported", "ModelSummary", "summary",
    # training
    "run_experiment", "RunResult", "MetricsLog", "FusedStep", "SteTrainer", "QatResult", "PhaseTrainer",
    "StepInfo", "TrainerStats", "TrainingPhase", "make_phase_trainer", "CorrectionResult",
    "LeastSquaresPredictor", "MomentumPredictor", "TernaryGradientAccumulator", "VSABundle",
    "VSAGradientCompressor", "VSAHistory", "VSAReport", "check_memory", "estimate_memory",
    # runs, store, executor, sweeps
    "LocalRun", "compare_ste", "start_ste_comparison", "RunStore", "RunRecord", "connect", "shutdown", "Run",
    "RemoteRun", "Sweep", "SweepResult", "MedianStopping",
]
