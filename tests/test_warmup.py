"""The per-user Numba cache qatlab sets up, and the kernel warm-up (qatlab.warmup)."""
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

import qatlab as ql
from qatlab import warmup

ROOT = Path(__file__).resolve().parent.parent


def _python(code: str, env_changes: dict, cwd: Path) -> str:
    """Run ``code`` in a fresh interpreter (env: ours, minus NUMBA_CACHE_DIR, plus ``env_changes``)."""
    env = {k: v for k, v in os.environ.items() if k != "NUMBA_CACHE_DIR"}
    env.update(env_changes)
    env["PYTHONPATH"] = str(ROOT) + os.pathsep + env.get("PYTHONPATH", "")
    out = subprocess.run([sys.executable, "-c", textwrap.dedent(code)], env=env, cwd=cwd, capture_output=True,
                         text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    return out.stdout.strip()


CACHE_DIR_OF = """
    import os, qatlab, numba
    print(numba.config.CACHE_DIR, os.environ["NUMBA_CACHE_DIR"], sep="|")
"""


@pytest.mark.slow
def test_cache_dir_defaults_to_the_users_cache(tmp_path):
    out = _python(CACHE_DIR_OF, {"XDG_CACHE_HOME": str(tmp_path / "xdg")}, tmp_path)
    expected = str(tmp_path / "xdg" / "qatlab" / "numba")
    assert out == f"{expected}|{expected}"


@pytest.mark.slow
def test_cache_dir_without_xdg_is_under_home(tmp_path):
    env = {"HOME": str(tmp_path / "home"), "XDG_CACHE_HOME": ""}
    out = _python(CACHE_DIR_OF, env, tmp_path)
    expected = str(tmp_path / "home" / ".cache" / "qatlab" / "numba")
    assert out == f"{expected}|{expected}"


@pytest.mark.slow
def test_numba_cache_dir_in_the_environment_wins(tmp_path):
    mine = str(tmp_path / "mine")
    out = _python(CACHE_DIR_OF, {"NUMBA_CACHE_DIR": mine, "XDG_CACHE_HOME": str(tmp_path / "xdg")}, tmp_path)
    assert out == f"{mine}|{mine}"


@pytest.mark.slow
def test_cache_dir_applies_when_numba_was_imported_first(tmp_path):
    # numba read an empty NUMBA_CACHE_DIR at import: qatlab sets its config, and a cached kernel
    # defined afterwards writes its index files there
    (tmp_path / "kern.py").write_text("from numba import njit\n\n@njit(cache=True)\ndef twice(x):\n    return 2 * x\n")
    code = """
        import numba, qatlab, kern
        assert kern.twice(3) == 6
        print(numba.config.CACHE_DIR)
    """
    out = _python(code, {"XDG_CACHE_HOME": str(tmp_path / "xdg")}, tmp_path)
    cache = tmp_path / "xdg" / "qatlab" / "numba"
    assert out == str(cache)
    assert list(cache.rglob("kern.twice-*.nbi")), sorted(str(p) for p in cache.rglob("*"))


@pytest.mark.slow
def test_a_numba_config_set_before_qatlab_is_kept(tmp_path):
    code = """
        import numba
        numba.config.CACHE_DIR = "/somewhere/else"
        import qatlab, os
        print(numba.config.CACHE_DIR, "NUMBA_CACHE_DIR" in os.environ, sep="|")
    """
    assert _python(code, {"XDG_CACHE_HOME": str(tmp_path)}, tmp_path) == "/somewhere/else|False"


def test_status_text_names_what_is_left(monkeypatch):
    monkeypatch.setattr(warmup._status, "left", ["a", "b", "c"])
    assert warmup.status_text() == "compiling kernels... (3 left)"
    monkeypatch.setattr(warmup._status, "left", [])
    monkeypatch.setattr(warmup._counter, "active", 1)
    assert warmup.status_text() == "compiling kernels..."
    monkeypatch.setattr(warmup._counter, "active", 0)
    assert warmup.status_text() is None


def test_compile_counter_sees_a_real_compilation():
    from numba import njit

    seen = []

    @njit
    def add_one(x):
        return x + 1

    class Probe(warmup._nb_event.Listener):
        def on_start(self, event):
            seen.append(warmup.status()[1])

        def on_end(self, event):
            pass

    probe = Probe()
    warmup._nb_event.register("numba:compile", probe)
    try:
        assert add_one(1) == 2
    finally:
        warmup._nb_event.unregister("numba:compile", probe)
    assert seen and all(seen)      # during the compilation status() said "compiling"
    assert warmup.status()[1] is False


def test_progress_text_says_compiling_instead_of_loss_nan(monkeypatch):
    from qatlab.ui.run_view import progress_text

    monkeypatch.setattr(warmup._status, "left", ["a", "b"])
    run = ql.LocalRun(ql.ExperimentConfig(), register=False)
    run.status = "running"
    assert progress_text([run]) == (0.0, "compiling kernels... (2 left)")
    assert progress_text([]) == (0.0, "compiling kernels... (2 left)")
    run.steps_done, run.total_steps = 5, 920
    assert progress_text([run])[1].startswith("step 5 / 920")
    monkeypatch.setattr(warmup._status, "left", [])
    assert progress_text([]) == (0.0, "No run yet: press **Start**.")


def test_bad_configs_are_refused_before_anything_runs(monkeypatch):
    monkeypatch.setattr(warmup._status, "left", [])
    with pytest.raises(TypeError, match="configs"):
        warmup.warmup([("x", 3)])
    assert warmup._status.left == []


@pytest.mark.slow
def test_warmup_reports_progress_and_seconds():
    cfg = ql.ExperimentConfig()
    cfg.data.dataset, cfg.data.n_samples = "synthetic", 5000
    calls = []
    seconds = warmup.warmup([("tiny", cfg), cfg], progress=calls.append)
    assert calls == [["tiny", "config 2"], ["config 2"], []]
    assert set(seconds) == {"tiny", "config 2"} and all(s > 0 for s in seconds.values())
    assert warmup.status()[0] == 0


def _overloads() -> dict:
    from numba.core.registry import CPUDispatcher

    found = {}
    for module in list(sys.modules.values()):
        if getattr(module, "__name__", "").startswith("qatlab"):
            for value in vars(module).values():
                if isinstance(value, CPUDispatcher):
                    found[value] = set(value.overloads)
    return found


@pytest.mark.slow
def test_after_the_warmup_full_runs_need_no_new_kernel():
    # every kernel (and argument types) a full-length run of each default config uses was
    # compiled or loaded by the warm-up already
    warmup.warmup()
    before = _overloads()
    for label, cfg in warmup.default_configs():
        cfg.optim.epochs = 2 if cfg.model.architecture == "cnn" else 12   # (the MLP's phase cycles take longer to reach)
        assert ql.run_experiment(cfg).status == "finished", label
    missed = {d.py_func.__qualname__: sigs - before.get(d, set()) for d, sigs in _overloads().items()
              if sigs - before.get(d, set())}
    assert not missed


@pytest.mark.slow
def test_a_config_that_fails_is_reported_and_the_rest_still_warms(monkeypatch, caplog, tmp_path):
    bad = ql.ExperimentConfig()
    bad.data.dataset, bad.data.path = "file", str(tmp_path / "missing.npz")
    good = ql.ExperimentConfig()
    good.data.dataset, good.data.n_samples = "synthetic", 200
    monkeypatch.setattr(warmup._status, "error", "")
    with caplog.at_level("WARNING", logger="qatlab.warmup"):
        seconds = warmup.warmup([("bad", bad), ("good", good)])
    assert list(seconds) == ["good"]
    assert warmup._status.error.startswith("bad: failed"), warmup._status.error
    assert "bad" in caplog.text and warmup.status()[0] == 0
