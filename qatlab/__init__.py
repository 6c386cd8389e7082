"""qatlab: a laboratory for quantization-aware training."""
from .ste import SteKind
from .config import (DataConfig, ExperimentConfig, ModelConfig, OptimConfig, PhaseConfig, PredictionConfig,
                     QatConfig, QuantConfig, TernaryConfig, VSAConfig)
from .metrics import MetricsLog
from .quant import (FakeQuantize, MinMaxObserver, MovingAverageMinMaxObserver, TernaryQuantizer,
                    ternary_dequantize, ternary_quantize)
from . import data
from .runs import Run, RunResult, compare_ste, run_experiment, start_ste_comparison
