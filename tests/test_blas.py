"""One BLAS thread whatever was imported first: same numbers, same speed class."""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent

# A 64-64-10 product big enough for OpenBLAS to use several threads if it may (batch 512).
SCRIPT = """
import json, sys
if sys.argv[1] == "numpy-first":
    import numpy
import qatlab as ql
from qatlab.runtime.blas import limit_blas_threads
cfg = ql.ExperimentConfig()
cfg.model.hidden = [64]; cfg.optim.epochs = 2; cfg.optim.batch_size = 512
res = ql.run_experiment(cfg)
print(json.dumps({"loss": res.final["train_loss"], "acc": res.final["test_accuracy"]}))
"""


def _run(order: str) -> dict:
    env = {k: v for k, v in os.environ.items() if k != "OPENBLAS_NUM_THREADS"}
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(ROOT), env.get("PYTHONPATH")]))
    out = subprocess.run([sys.executable, "-c", SCRIPT, order], capture_output=True, text=True, env=env,
                         timeout=300, check=True)
    return json.loads(out.stdout.strip().splitlines()[-1])


@pytest.mark.slow
def test_import_order_does_not_change_the_run():
    assert _run("numpy-first") == _run("qatlab-first")


def test_limit_blas_threads_applies_a_limit():
    from qatlab.runtime.blas import limit_blas_threads
    assert limit_blas_threads(1) is True   # numpy's OpenBLAS is loaded in this process
