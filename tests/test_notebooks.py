"""The notebooks in ``notebooks/`` run top to bottom, headless, without an error.

The committed files keep the outputs of a run top to bottom (so they read well before anyone runs
them): checked here to be complete, in order and free of errors (read as plain JSON: importing
nbformat costs seconds, and only the slow test needs it). The slow test executes each
notebook afresh in memory by nbclient in a Python kernel whose working directory is
``notebooks/``; the files on disk are never written. A cell that raises fails the test with the
cell's traceback; so does any ``error`` output or a traceback printed to stderr.
"""
from __future__ import annotations

import json
import os
import time
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
NOTEBOOKS = ROOT / "notebooks"
NAMES = ["01_quickstart.ipynb", "02_ste_comparison.ipynb", "03_phase_training.ipynb", "04_sweeps.ipynb",
         "05_cnn.ipynb"]
CELL_TIMEOUT = 60  # seconds; each notebook is meant to finish in well under a minute


def _committed(name: str) -> dict:
    """The notebook file as saved (nbformat 4 JSON)."""
    nb = json.loads((NOTEBOOKS / name).read_text(encoding="utf-8"))
    assert nb["nbformat"] == 4, f"{name}: nbformat {nb['nbformat']}, expected 4"
    return nb


def _text(output: dict) -> str:
    """An output's text: a list of lines in the file, one string once nbformat has read it."""
    text = output.get("text", "")
    return "".join(text) if isinstance(text, list) else text


def test_every_notebook_is_listed():
    assert sorted(p.name for p in NOTEBOOKS.glob("*.ipynb")) == sorted(NAMES)


@pytest.mark.parametrize("name", NAMES)
def test_committed_outputs_are_one_clean_run_top_to_bottom(name):
    nb = _committed(name)
    counts = [cell.get("execution_count") for cell in nb["cells"] if cell["cell_type"] == "code"]
    assert counts == list(range(1, len(counts) + 1)), f"{name}: execution counts {counts} (rerun top to bottom)"
    assert not _problems(nb), f"{name}:\n" + "\n".join(_problems(nb))
    last = "".join(_text(o) for o in nb["cells"][-1].get("outputs", []))
    assert "ran top to bottom in" in last, f"{name}: the last cell does not report the notebook's run time"


def _problems(nb) -> list[str]:
    out = []
    for i, cell in enumerate(nb["cells"]):
        for o in cell.get("outputs", []):
            if o.get("output_type") == "error":
                out.append(f"cell {i}: {o.get('ename')}: {o.get('evalue')}")
            elif o.get("output_type") == "stream" and o.get("name") == "stderr" and "Traceback" in _text(o):
                out.append(f"cell {i}: traceback on stderr:\n{_text(o)}")
    return out


@pytest.mark.slow
@pytest.mark.parametrize("name", NAMES)
def test_notebook_runs_headless(name, monkeypatch):
    nbformat = pytest.importorskip("nbformat")
    nbclient = pytest.importorskip("nbclient")
    pytest.importorskip("ipykernel")
    nb = nbformat.read(NOTEBOOKS / name, as_version=4)
    # The kernel inherits this environment: make the checkout importable even if qatlab is not installed.
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")])))
    client = nbclient.NotebookClient(nb, timeout=CELL_TIMEOUT, kernel_name="python3",
                                     resources={"metadata": {"path": str(NOTEBOOKS)}})
    t0 = time.perf_counter()
    try:
        client.execute()
    except nbclient.exceptions.CellExecutionError as exc:
        pytest.fail(f"{name}: a cell raised:\n{exc}")
    seconds = time.perf_counter() - t0
    problems = _problems(nb)
    assert not problems, f"{name}:\n" + "\n".join(problems)
    assert all(c.get("execution_count") for c in nb.cells if c.cell_type == "code"), f"{name}: a cell did not run"
    print(f"{name}: executed in {seconds:.1f} s")
