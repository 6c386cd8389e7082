"""The metric columns are named once (qatlab.metrics) and a run's history has exactly those."""
import pytest

import qatlab as ql
from qatlab.metrics import EPOCH_COLUMNS, LAYER_METRICS, PHASE_COLUMNS, STEP_COLUMNS

pytestmark = pytest.mark.slow   # trains two short runs


@pytest.mark.parametrize("phase", [False, True])
def test_history_columns_are_the_declared_ones(phase):
    cfg = ql.ExperimentConfig()
    cfg.optim.epochs, cfg.model.hidden, cfg.phase.enabled = 1, [16], phase
    result = ql.run_experiment(cfg)
    n_layers = len(cfg.model.hidden) + 1
    declared = {*STEP_COLUMNS, *EPOCH_COLUMNS, *(f"{m}_{i}" for m in LAYER_METRICS for i in range(n_layers))}
    if phase:
        declared |= set(PHASE_COLUMNS)
    assert set(result.history) == declared | {"row_id"}     # row_id: the MetricsLog's own
