"""The Sweeps tab with a 200-run sweep: how long a selection takes to reach the table and both charts,
and whether the server's memory stays flat across refreshes (``python -m qatlab.bench sweep``).

:func:`fill_store` stores ``n`` finished runs of one sweep (a grid of STE kind x weight bits x seeds,
each with ``rows`` metric rows). Their metric values are synthetic (a smooth loss and accuracy
curve per run): the view's costs depend on how many runs and rows there are, not on the values.
:func:`measure_view` builds a :class:`~qatlab.ui.sweep_view.SweepView` whose Panel objects are
rendered into a Bokeh Document (so every change also updates the Bokeh models, as on a page),
then times selections made the three ways a page makes them (ticking table rows, tapping a
line or point, tapping a heatmap cell) and samples the process's resident memory across refreshes.
"""
from __future__ import annotations

import gc
import math
import statistics
import time

import numpy as np

KINDS = ("identity", "clipped_identity", "tanh", "hard_tanh")
BITS = (2, 3, 4, 5, 6)


def rss_bytes() -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) * 1024
    return 0


def fill_store(store, n: int = 200, rows: int = 60, name: str = "bench-view") -> str:
    """Store ``n`` finished runs of the sweep ``name`` (STE kind x bits x seeds); returns ``name``."""
    from ..config import ExperimentConfig
    from ..train.result import RunResult
    base = ExperimentConfig()
    base.quant.weights = "fake"
    per_seed = len(KINDS) * len(BITS)
    steps = np.arange(1, rows + 1, dtype=np.float64)
    for i in range(n):
        seed, kind, bits = i // per_seed, KINDS[i % len(KINDS)], BITS[(i // len(KINDS)) % len(BITS)]
        cfg = base.copy()
        cfg.optim.seed, cfg.quant.ste, cfg.quant.weight_bits = seed, kind, bits
        rid = store.create_run(cfg, name=f"{kind} {bits}-bit seed={seed}", sweep_id=name,
                               point={"quant.ste": kind, "quant.weight_bits": bits, "seed": seed})
        store.set_status(rid, "running")
        top = 0.8 + 0.02 * bits + 0.01 * KINDS.index(kind) + 0.003 * (seed % 5)
        acc = top * (1 - np.exp(-steps / 15))
        loss = 2.3 * np.exp(-steps / 20) + 0.05
        store.append_columns(rid, {"row_id": steps - 1, "step": steps, "loss": loss, "test_accuracy": acc})
        store.finish(rid, RunResult(history={}, final={"test_accuracy": float(acc[-1]), "test_loss": float(loss[-1]),
                                                        "train_loss": float(loss[-1])},
                                    model=None, status="finished", message="", config=cfg.to_dict()))
    return name


def measure_view(store, name: str, selections: int = 30, refreshes: int = 300) -> dict:
    """Selection -> highlight seconds (table, chart, heatmap taps) and RSS across refreshes."""
    from bokeh.document import Document

    from .sweep_view import SweepView
    view = SweepView(store=store, config_source=lambda: None)
    view.set_active(True)
    doc = Document()
    doc.add_root(view.__panel__().get_root(doc))
    t0 = time.perf_counter()
    view.show_sweep(name)
    if not view.wait_loaded(300):
        raise RuntimeError(f"the sweep {name!r} was not read within 300 s")
    load_s = time.perf_counter() - t0
    n = len(view.rows)
    rng = np.random.default_rng(0)
    times: dict[str, list[float]] = {"table": [], "chart": [], "heatmap": []}
    for k in range(selections):
        rows = sorted(rng.choice(n, size=int(rng.integers(1, 6)), replace=False).tolist())
        for how, act in (("table", lambda: setattr(view.table, "selection", rows)),
                         ("chart", lambda: setattr(view.source.selected, "indices", rows[:1])),
                         ("heatmap", lambda: setattr(view.heat_source.selected, "indices",
                                                     [k % len(view.cell_members)]))):
            start = time.perf_counter()
            act()
            times[how].append(time.perf_counter() - start)
        assert view.source.selected.indices == view.table.selection == view.selected
    gc.collect()
    rss = []
    metrics = list(view.metric_select.options)
    for i in range(refreshes):
        view.refresh(force=True)
        if i % 10 == 0:             # switching the metric redraws both charts' sources
            view.metric_select.value = metrics[(i // 10) % len(metrics)]
            view.select([i % n, (7 * i) % n])
        if i % 50 == 0 or i == refreshes - 1:
            gc.collect()
            rss.append(rss_bytes())
    out = {"runs": n, "load_s": load_s, "rss_mb": [r / 2**20 for r in rss],
           "rss_growth_mb": (rss[-1] - rss[1]) / 2**20 if len(rss) > 2 else math.nan}
    for how, ts in times.items():
        out[f"{how}_median_ms"] = 1e3 * statistics.median(ts)
        out[f"{how}_max_ms"] = 1e3 * max(ts)
    out["worst_ms"] = max(out[f"{how}_max_ms"] for how in times)
    return out
