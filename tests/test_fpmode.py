"""qatlab.runtime.fpmode: per-thread flush-to-zero of subnormal floats, used by training threads."""
import threading

import numpy as np
import pytest

from qatlab.runtime import fpmode, parallel

pytestmark = pytest.mark.skipif(not fpmode.X86, reason="MXCSR exists on x86 only")

SUB = np.float32(1e-39)          # a float32 subnormal


def _control(mode):
    """MXCSR without its sticky exception flags (bits 0-5), which any operation may set."""
    return mode & ~0x3F


def _halve(x):
    return (x * np.float32(0.5))


def test_flush_is_per_thread_and_restored():
    before = fpmode.get_mode()
    x = np.full(4, SUB)
    assert _halve(x)[0] == np.float32(5e-40)                # IEEE: gradual underflow
    with fpmode.subnormals_flushed():
        assert fpmode.get_mode() & (fpmode.FTZ | fpmode.DAZ) == fpmode.FTZ | fpmode.DAZ
        assert (_halve(x) == 0).all()                       # DAZ: subnormal inputs read as 0
        assert np.float32(1e-20) * np.float32(1e-20) == 0   # FTZ: subnormal results become 0
        seen = []
        t = threading.Thread(target=lambda: seen.append(_halve(x)[0]))
        t.start(), t.join()
        assert seen == [np.float32(5e-40)]                  # another thread keeps IEEE semantics
    assert _control(fpmode.get_mode()) == _control(before)
    assert _halve(x)[0] == np.float32(5e-40)


def test_split_work_runs_in_the_callers_mode(monkeypatch):
    monkeypatch.setattr(parallel, "cores", lambda: 2)
    x = np.full(1 << 12, SUB)
    out = np.empty_like(x)

    def halve(lo, hi):
        np.multiply(x[lo:hi], np.float32(0.5), out=out[lo:hi])

    with fpmode.subnormals_flushed():
        parallel.split_rows(halve, len(x), 2)
    assert (out == 0).all()                                 # the pool's slice was flushed too
    parallel.split_rows(halve, len(x), 2)
    assert (out == np.float32(5e-40)).all()                 # and is back to IEEE afterwards


@pytest.mark.slow
def test_training_flushes_only_inside_the_run():
    import qatlab as ql
    before = fpmode.get_mode()
    cfg = ql.ExperimentConfig(model=ql.ModelConfig(hidden=[8]), optim=ql.OptimConfig(epochs=1))
    from qatlab.train.trainer import train_experiment
    modes = []
    result = train_experiment(cfg, report=lambda done, total: modes.append(fpmode.get_mode()) or True)
    assert result.status == "finished" and modes                  # report runs inside the loop
    assert all(m & (fpmode.FTZ | fpmode.DAZ) == fpmode.FTZ | fpmode.DAZ for m in modes)
    assert _control(fpmode.get_mode()) == _control(before)
