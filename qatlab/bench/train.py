"""``python -m qatlab.bench train``: ms per ternary-QAT training step vs the numpy floor and PyTorch eager.

The step timed is the engine's real hot path (the generic loop's inner step)::

    y = mlp.forward(x, scratch)                       # TernaryQuantizer on every layer's weights
    cross_entropy_loss(y, labels, grads.d_output_mut())
    mlp.backward(x, scratch, grads, need_input_grad=False)
    opt.step(grads.flat())                            # Adam, lr 1e-2

made as ``run_experiment`` makes it: where :class:`qatlab.train.fused_step.FusedStep` applies (the 64-256-10
shapes), :data:`RUN_STEPS` steps in one ``FusedStep.steps`` call (the loop makes its steps in such
runs, up to the next metrics row: 10 steps with the default ``metrics_every``; the same numbers as
one call per step), timed per step; else these calls from Python, one step at a time. The column
``1 call ms`` times ``FusedStep`` one step per call too. Fixed synthetic data (x ~ U[0, 1), random
labels) for each shape; every step of a run uses the same batch. Side by side, in one
``measure_many`` (interleaved round-robin, so they see the same machine load):

* **numpy floor**: the five matrix products of that step in plain numpy with preallocated
  outputs, ``np.matmul(out=)``: ``x @ W1.T``, ``h @ W2.T``, ``dY.T @ h``, ``dY @ W2``, ``dH.T @ x``.
  No quantization, no activation, no loss, no optimizer: the one-thread lower bound. qatlab splits
  products of at least ``qatlab.runtime.parallel.MIN_MACS`` multiply-adds across the cores, so at the
  largest shapes its step can take less time than this floor.
* **PyTorch eager** (when importable), ``torch.set_num_threads(1)``: nn.Linear layers, absmean
  ternary weights through an ``autograd.Function`` with an identity STE, ``F.cross_entropy``,
  ``torch.optim.Adam`` (see :mod:`qatlab.bench.torch_ref`). Torch at its default thread count is
  measured in a second ``measure_many`` together with the qatlab step again.

Also: a check that both implementations compute the same step (loss and weight gradients from
identical weights and data), the first-call time of the qatlab step in fresh subprocesses
(cold Numba compile into an empty cache dir, then a cache load from it; ``--quick``: one process
with the project's own cache), and a per-piece breakdown of the qatlab step.
"""
from __future__ import annotations

import json
import math
import os
import subprocess
import sys
import tempfile
from pathlib import Path

import numpy as np

from ..runtime import parallel
from .kit import BenchOptions, Column, Goal, SuiteResult, Table, measure_many, suite
from ..kernels import fakequant as KF
from ..kernels.dense import IDENTITY, RELU, act_backward_inplace, bias_act_inplace, softmax_cross_entropy
from ..train.fused_step import FusedStep
from ..nn import Mlp, cross_entropy_loss
from ..optim import Adam
from ..kernels.optim_kernels import adam_kernel as adam_update
from ..quant import TernaryQuantizer

#: (layer sizes, batch) of every shape the suite measures.
SHAPES: tuple[tuple[tuple[int, ...], int], ...] = (
    ((64, 256, 10), 64),
    ((64, 256, 10), 256),
    ((784, 256, 10), 128),
    ((784, 1024, 10), 256),
)
LR = 1e-2
SEED = 0
RUN_STEPS = 10                           # steps per FusedStep.steps call (run_experiment: metrics_every)
GOAL_FLOOR_X = 1.5                       # qatlab ms <= 1.5 x numpy floor, every shape
GOAL_TORCH = {((64, 256, 10), 64): 3.0,  # torch ms / qatlab ms >= this
              ((784, 1024, 10), 256): 1.5}
ROOT = Path(__file__).resolve().parents[1]


def shape_label(sizes, batch) -> str:
    """``'64-256-10 b64'``."""
    return f"{'-'.join(map(str, sizes))} b{batch}"


def blas_threads() -> dict:
    """{library: threads} of the BLAS libraries loaded in this process (threadpoolctl), or {} when unknown."""
    try:
        from threadpoolctl import threadpool_info
    except Exception:
        return {}
    return {f"{i.get('internal_api')} ({Path(i.get('filepath', '')).name})": i.get("num_threads")
            for i in threadpool_info() if i.get("user_api") == "blas"}


def _import_torch():
    """torch, or None when it is not importable here."""
    try:
        import torch
    except Exception:  # ImportError, or a broken install raising OSError etc.
        return None
    return torch


def _data(sizes, batch):
    rng = np.random.default_rng(1234 + batch + sizes[0])
    x = rng.random((batch, sizes[0]), dtype=np.float32)
    labels = rng.integers(0, sizes[-1], batch).astype(np.int64)
    return x, labels


def _qatlab_setup(sizes, batch):
    """(mlp, scratch, grads, opt) for a ternary-QAT model, seeded like the quality recipe."""
    n = len(sizes) - 1
    mlp = Mlp(list(sizes), activation="relu", seed=SEED,
              weight_quantizers=[TernaryQuantizer(ste="identity") for _ in range(n)])
    scratch, grads = mlp.scratch(batch), mlp.gradients(batch)
    opt = Adam(mlp.flat_params(), lr=LR)
    return mlp, scratch, grads, opt


def make_qatlab_step(sizes, batch, x, labels, fused=True, run=1):
    """(step, mlp, grads): step() runs qatlab training steps on (x, labels): with a
    :class:`FusedStep` where it applies (unless ``fused`` is False) ``run`` steps in one
    ``FusedStep.steps`` call (run = 1: one ``FusedStep`` call, returning the loss), else one step
    through the Python calls (returning the loss)."""
    mlp, scratch, grads, opt = _qatlab_setup(sizes, batch)
    one_call = FusedStep.build(mlp, scratch, grads, opt) if fused else None
    if one_call is not None and run > 1:
        idx = np.tile(np.arange(batch, dtype=np.int64), run)
        return (lambda: one_call.steps(x, idx, run, labels=labels)), mlp, grads
    if one_call is not None:
        return (lambda: one_call(x, labels=labels)), mlp, grads
    flat = grads.flat()

    def step():
        y = mlp.forward(x, scratch)
        loss = cross_entropy_loss(y, labels, grads.d_output_mut())
        mlp.backward(x, scratch, grads, need_input_grad=False)
        opt.step(flat)
        return loss

    return step, mlp, grads


def make_numpy_floor(sizes, batch, x):
    """floor(): the five matrix products of one 2-layer step in plain numpy, outputs preallocated."""
    if len(sizes) != 3:
        raise ValueError(f"sizes: the numpy floor is written for 2-layer models, got {sizes}")
    n_in, hid, k = sizes
    rng = np.random.default_rng(7)
    w1 = rng.standard_normal((hid, n_in), dtype=np.float32)
    w2 = rng.standard_normal((k, hid), dtype=np.float32)
    h = np.empty((batch, hid), np.float32)
    y = np.empty((batch, k), np.float32)
    dy = rng.standard_normal((batch, k), dtype=np.float32)
    dw2 = np.empty((k, hid), np.float32)
    dh = np.empty((batch, hid), np.float32)
    dw1 = np.empty((hid, n_in), np.float32)
    w1t, w2t, dyt, dht = w1.T, w2.T, dy.T, dh.T
    mm = np.matmul

    def floor():
        mm(x, w1t, out=h)
        mm(h, w2t, out=y)
        mm(dyt, h, out=dw2)
        mm(dy, w2, out=dh)
        mm(dht, x, out=dw1)

    return floor


def _pieces(sizes, batch, x, labels):
    """{name: fn} timing each piece of the qatlab step separately (own model and buffers).

    Composite pieces (``mlp.forward``, ``mlp.backward``, ``Adam.step``, ``TernaryQuantizer.*``)
    call the public API; ``kernel`` pieces call the Numba kernels directly with the same
    arguments, so the difference is the Python wrapper's cost.
    """
    step = make_qatlab_step(sizes, batch, x, labels, fused=False)[0]
    fused = make_qatlab_step(sizes, batch, x, labels)[0]
    mlp2, scratch, grads2, opt = _qatlab_setup(sizes, batch)
    step()
    qs = mlp2.weight_quantizers
    ws = [mlp2.weights(i) for i in range(mlp2.num_layers)]
    bs = [mlp2.biases(i) for i in range(mlp2.num_layers)]
    wq = [np.empty_like(w) for w in ws]
    wqT = [w.T for w in wq]
    hs = [np.empty((batch, n), np.float32) for n in sizes[1:]]
    ds = [np.empty((batch, n), np.float32) for n in sizes[1:]]
    dw = [np.empty_like(w) for w in ws]
    db = [np.empty_like(b) for b in bs]
    for q, w, o in zip(qs, ws, wq):
        q.forward(w, o)
    for h, a, w in zip(hs, [x] + hs[:-1], wqT):
        np.dot(a, w, out=h)
    ds[-1][:] = 0.01
    flat_g = grads2.flat()
    y = mlp2.forward(x, scratch)
    cross_entropy_loss(y, labels, grads2.d_output_mut())
    mlp2.backward(x, scratch, grads2, need_input_grad=False)
    d_out = grads2.d_output_mut()
    last = mlp2.num_layers - 1
    f32 = np.float32
    m_state = np.zeros_like(flat_g)
    v_state = np.zeros_like(flat_g)
    p_copy = mlp2.flat_params().copy()
    inv = [f32(1.0) / f32(q.alpha) for q in qs]
    alpha = [f32(q.alpha) for q in qs]
    z, one, mone = f32(0.0), f32(1.0), f32(-1.0)

    def quantize():
        for q, w, o in zip(qs, ws, wq):
            q.forward(w, o)

    flat_ws = [w.reshape(-1) for w in ws]
    flat_wq = [o.reshape(-1) for o in wq]

    def abs_mean_kernel():
        for w in flat_ws:
            KF.abs_mean(w)

    def fq_kernel():
        for w, o, i, s in zip(flat_ws, flat_wq, inv, alpha):
            KF.fq_forward(w, i, s, z, mone, one, o)

    def fwd_matmuls():
        a = x
        for h, w in zip(hs, wqT):
            parallel.dot(a, w, out=h)
            a = h

    def bias_act():
        for i, (h, b) in enumerate(zip(hs, bs)):
            bias_act_inplace(h, b, IDENTITY if i == last else RELU)

    def loss():
        cross_entropy_loss(y, labels, d_out)

    def loss_kernel():
        softmax_cross_entropy(y, labels, d_out)

    def bwd_matmuls():
        for i in range(last, -1, -1):
            parallel.dot(ds[i].T, x if i == 0 else hs[i - 1], out=dw[i])
            if i > 0:
                parallel.dot(ds[i], wq[i], out=ds[i - 1])

    def act_bwd():
        for i in range(last, -1, -1):
            act_backward_inplace(ds[i], hs[i], IDENTITY if i == last else RELU, db[i])

    def ste_bwd():
        for q, g, w in zip(qs, dw, ws):
            q.backward(g, w, g)

    def forward():
        mlp2.forward(x, scratch)

    def backward():
        mlp2.backward(x, scratch, grads2, need_input_grad=False)

    def adam():
        opt.step(flat_g)

    def adam_kernel():
        adam_update(p_copy, flat_g, m_state, v_state, 1.0, 0.0, 1.0, 0.9, 0.999, LR / (1 - 0.9 ** 10),
                     math.sqrt(1 - 0.999 ** 10), 1e-8)

    return {
        "step": step, "fused": fused,
        "quantize": quantize, "abs_mean_kernel": abs_mean_kernel, "fq_kernel": fq_kernel,
        "fwd_matmuls": fwd_matmuls, "bias_act": bias_act, "forward": forward,
        "loss": loss, "loss_kernel": loss_kernel,
        "bwd_matmuls": bwd_matmuls, "act_bwd": act_bwd, "ste_bwd": ste_bwd, "backward": backward,
        "adam": adam, "adam_kernel": adam_kernel,
    }


#: breakdown rows: (key, label, kind) -- kind "leaf" pieces add up to the step (with the glue row).
BREAKDOWN = (
    ("quantize", "quantize: TernaryQuantizer.forward x L (absmean + fake-quant)", "leaf"),
    ("abs_mean_kernel", "  of which kernel abs_mean (alpha, float64 sum)", "detail"),
    ("fq_kernel", "  of which kernel fq_forward (rint/clamp/scale)", "detail"),
    ("fwd_matmuls", "forward matmuls: parallel.dot(a, Wq.T, out=) x L", "leaf"),
    ("bias_act", "forward bias + activation: bias_act_inplace x L", "leaf"),
    ("forward", "= mlp.forward total", "total"),
    ("loss", "loss: cross_entropy_loss (softmax + dL/dy)", "leaf"),
    ("loss_kernel", "  of which kernel softmax_cross_entropy", "detail"),
    ("act_bwd", "backward act' + bias grad: act_backward_inplace x L", "leaf"),
    ("bwd_matmuls", "backward matmuls: dW = d.T @ a, d_prev = d @ Wq (2L-1)", "leaf"),
    ("ste_bwd", "backward STE: TernaryQuantizer.backward x L", "leaf"),
    ("backward", "= mlp.backward total", "total"),
    ("adam", "optimizer: Adam.step(flat)", "leaf"),
    ("adam_kernel", "  of which kernel adam_kernel", "detail"),
)


def _breakdown(sizes, batch, x, labels, opts: BenchOptions) -> dict:
    ms = measure_many(_pieces(sizes, batch, x, labels), repeats=opts.repeats, warmup=opts.warmup,
                      min_time=opts.min_time)
    step = ms["step"].median
    out = {"step_us": step * 1e6, "pieces": {k: m.median * 1e6 for k, m in ms.items()},
           "spread_pct": {k: 100.0 * m.rel_spread for k, m in ms.items()}}
    p = out["pieces"]
    leaf = sum(p[k] for k, _, kind in BREAKDOWN if kind == "leaf")
    out["leaf_sum_us"] = leaf
    out["glue_us"] = step * 1e6 - leaf
    out["forward_glue_us"] = p["forward"] - p["quantize"] - p["fwd_matmuls"] - p["bias_act"]
    out["backward_glue_us"] = p["backward"] - p["act_bwd"] - p["bwd_matmuls"] - p["ste_bwd"]
    return out


def _breakdown_table(per_shape: dict) -> Table:
    keys = list(per_shape)
    rows = []

    def add(label, values, kind):
        row = {"piece": label, "kind": kind}
        for key in keys:
            v = values[key]
            step = per_shape[key]["breakdown"]["step_us"]
            row[f"{key}_us"] = v
            row[f"{key}_pct"] = 100.0 * v / step if step else None
        rows.append(row)

    for k, label, kind in BREAKDOWN:
        add(label, {s: per_shape[s]["breakdown"]["pieces"][k] for s in keys}, kind)
    add("sum of the leaf pieces", {s: per_shape[s]["breakdown"]["leaf_sum_us"] for s in keys}, "sum")
    add("glue: step - leaf sum (Python calls, checks, views)", {s: per_shape[s]["breakdown"]["glue_us"]
                                                               for s in keys}, "glue")
    add("  in forward (forward - its pieces)", {s: per_shape[s]["breakdown"]["forward_glue_us"] for s in keys},
        "glue")
    add("  in backward (backward - its pieces)", {s: per_shape[s]["breakdown"]["backward_glue_us"] for s in keys},
        "glue")
    add("full step, these calls from Python (same measure_many)", {s: per_shape[s]["breakdown"]["step_us"]
                                                                   for s in keys}, "step")
    add("FusedStep, one call per step (where it applies; the main table's 1 call ms)",
        {s: per_shape[s]["breakdown"]["pieces"]["fused"] for s in keys}, "timed")
    add("numpy floor: the 5 matmuls (main table)", {s: per_shape[s]["floor_ms"] * 1e3 for s in keys}, "floor")
    cols = [Column("piece", "piece (us per step; % of the full step)")]
    for key in keys:
        cols += [Column(f"{key}_us", f"{key} us", "{:.1f}"), Column(f"{key}_pct", "%", "{:.0f}")]
    return Table("breakdown of the qatlab step (each piece timed alone, interleaved; medians)", cols, rows)


def _check_same_math(torch, sizes, batch, x, labels) -> dict:
    """Loss and weight gradients of one step from identical weights and data: qatlab vs torch."""
    from . import torch_ref as ref

    mlp, scratch, grads, _ = _qatlab_setup(sizes, batch)
    n = mlp.num_layers
    model = ref.TorchMlp(sizes, "ternary", weights=[mlp.weights(i) for i in range(n)],
                         biases=[mlp.biases(i) for i in range(n)])
    y = mlp.forward(x, scratch)
    loss_q = cross_entropy_loss(y, labels, grads.d_output_mut())
    mlp.backward(x, scratch, grads, need_input_grad=False)
    with ref.num_threads(1):
        loss_t = torch.nn.functional.cross_entropy(model(torch.from_numpy(x)), torch.from_numpy(labels))
        loss_t.backward()
    rel = 0.0
    for i, layer in enumerate(model.layers):
        g_t = layer.weight.grad.numpy()
        g_q = grads.d_weights(i)
        rel = max(rel, float(np.max(np.abs(g_q - g_t)) / max(np.max(np.abs(g_t)), 1e-30)))
    return {"loss_qatlab": loss_q, "loss_torch": loss_t.detach().item(),
            "loss_rel_diff": abs(loss_q - loss_t.detach().item()) / max(abs(loss_t.detach().item()), 1e-30),
            "grad_max_rel_diff": rel}


FIRST_CALL_SCRIPT = r"""
import json, sys, time
t0 = time.perf_counter()
import numpy as np
import qatlab
from qatlab.nn import Mlp, cross_entropy_loss
from qatlab.optim import Adam
from qatlab.quant import TernaryQuantizer
t1 = time.perf_counter()
sizes, batch = json.loads(sys.argv[1]), int(sys.argv[2])
rng = np.random.default_rng(0)
x = rng.random((batch, sizes[0]), dtype=np.float32)
labels = rng.integers(0, sizes[-1], batch).astype(np.int64)
mlp = Mlp(sizes, seed=0, weight_quantizers=[TernaryQuantizer() for _ in sizes[1:]])
scratch, grads = mlp.scratch(batch), mlp.gradients(batch)
opt = Adam(mlp.flat_params(), lr=1e-2)
def step():
    y = mlp.forward(x, scratch)
    cross_entropy_loss(y, labels, grads.d_output_mut())
    mlp.backward(x, scratch, grads, need_input_grad=False)
    opt.step(grads.flat())
t2 = time.perf_counter()
step()
t3 = time.perf_counter()
step()
t4 = time.perf_counter()
print(json.dumps({"import_s": t1 - t0, "build_s": t2 - t1, "first_step_s": t3 - t2, "second_step_s": t4 - t3}))
"""


def first_call(sizes, batch, cache_dir: str | None = None, timeout: float = 600.0) -> dict:
    """Time import + build + first step (+ a second step) in a fresh ``python -c`` subprocess.

    cache_dir: NUMBA_CACHE_DIR for the child (an empty dir: cold compile); None: the project's
    own cache (whatever state it is in). The child inherits this environment, with
    OPENBLAS_NUM_THREADS as in this process.
    """
    env = dict(os.environ)
    env["PYTHONPATH"] = str(ROOT) + (os.pathsep + env["PYTHONPATH"] if env.get("PYTHONPATH") else "")
    if cache_dir is not None:
        env["NUMBA_CACHE_DIR"] = cache_dir
    proc = subprocess.run([sys.executable, "-c", FIRST_CALL_SCRIPT, json.dumps(list(sizes)), str(batch)],
                          env=env, cwd=str(ROOT), capture_output=True, text=True, timeout=timeout)
    if proc.returncode != 0:
        raise RuntimeError(f"first-call subprocess failed ({proc.returncode}): {proc.stderr.strip()[-2000:]}")
    out = json.loads(proc.stdout.strip().splitlines()[-1])
    out["total_s"] = out["import_s"] + out["build_s"] + out["first_step_s"]
    return out


def _first_call_rows(quick: bool) -> list[dict]:
    sizes, batch = SHAPES[0]
    rows = []
    if quick:
        r = first_call(sizes, batch)
        rows.append({"mode": "project cache (compile or cache-load)", **r})
        return rows
    with tempfile.TemporaryDirectory(prefix="qatlab-numba-cache-") as d:
        rows.append({"mode": "cold: compile into an empty NUMBA_CACHE_DIR", **first_call(sizes, batch, d)})
        rows.append({"mode": "cache load: second process, same NUMBA_CACHE_DIR", **first_call(sizes, batch, d)})
    return rows


def _bench_shape(sizes, batch, opts: BenchOptions, torch, torch_default_threads) -> dict:
    x, labels = _data(sizes, batch)
    fused = FusedStep.build(*_qatlab_setup(sizes, batch)) is not None
    run = RUN_STEPS if fused else 1
    step, _, _ = make_qatlab_step(sizes, batch, x, labels, run=run)
    floor = make_numpy_floor(sizes, batch, x)
    fns = {"qatlab": step, "floor": floor}
    if fused:
        fns["one_call"] = make_qatlab_step(sizes, batch, x, labels)[0]
    kw = dict(repeats=opts.repeats, warmup=opts.warmup, min_time=opts.min_time)
    res = {"sizes": list(sizes), "batch": batch, "shape": shape_label(sizes, batch), "fused": fused,
           "steps_per_call": run}
    if torch is not None:
        from . import torch_ref as ref

        model = ref.TorchMlp(sizes, "ternary")
        tstep, _ = ref.make_train_step(model, x, labels, lr=LR)
        with ref.num_threads(1):
            ms = measure_many({**fns, "torch1": tstep}, **kw)
        with ref.num_threads(torch_default_threads):
            msn = measure_many({"qatlab": step, "torchN": tstep}, **kw)
        res["check"] = _check_same_math(torch, sizes, batch, x, labels)
    else:
        ms = measure_many(fns, **kw)
        msn = None
    ms["qatlab"] = ms["qatlab"].per(run)
    if msn is not None:
        msn["qatlab"] = msn["qatlab"].per(run)
    q, f = ms["qatlab"], ms["floor"]
    if fused:
        res["one_call_ms"] = ms["one_call"].median * 1e3
    res.update({
        "qatlab_ms": q.median * 1e3, "floor_ms": f.median * 1e3, "x_floor": q.median / f.median,
        "qatlab_spread_pct": 100.0 * q.rel_spread, "floor_spread_pct": 100.0 * f.rel_spread,
        "steps_per_s": 1.0 / q.median,
        "raw": {k: m.to_dict() for k, m in ms.items()},
    })
    if torch is not None:
        t1, tn, qn = ms["torch1"], msn["torchN"], msn["qatlab"]
        res.update({
            "torch1_ms": t1.median * 1e3, "torch1_x": t1.median / q.median,
            "torch1_spread_pct": 100.0 * t1.rel_spread,
            "torchN_ms": tn.median * 1e3, "torchN_x": tn.median / qn.median,
            "qatlab_ms_with_torchN": qn.median * 1e3, "torch_default_threads": torch_default_threads,
            "grad_max_rel_diff": res["check"]["grad_max_rel_diff"],
            "loss_rel_diff": res["check"]["loss_rel_diff"],
        })
        res["raw"].update({f"{k}_with_torchN": m.to_dict() for k, m in msn.items()})
    res["breakdown"] = _breakdown(sizes, batch, x, labels, opts)
    return res


MAIN_COLUMNS = [
    Column("shape", "shape"),
    Column("qatlab_ms", "qatlab ms", "{:.3f}"),
    Column("qatlab_spread_pct", "±IQR %", "{:.0f}"),
    Column("steps_per_s", "steps/s", "{:.0f}"),
    Column("floor_ms", "numpy floor ms", "{:.3f}"),
    Column("x_floor", "qatlab/floor", "{:.2f}x"),
    Column("one_call_ms", "1 call ms", "{:.3f}"),
    Column("torch1_ms", "torch 1t ms", "{:.3f}"),
    Column("torch1_x", "torch 1t/qatlab", "{:.2f}x"),
    Column("torchN_ms", "torch default ms", "{:.3f}"),
    Column("qatlab_ms_with_torchN", "qatlab ms in that run", "{:.3f}"),
    Column("torchN_x", "torch default/qatlab", "{:.2f}x"),
    Column("grad_max_rel_diff", "grad diff vs torch", "{:.1e}"),
]

FIRST_CALL_COLUMNS = [
    Column("mode", "fresh process (64-256-10 b64)"),
    Column("import_s", "import s", "{:.2f}"),
    Column("build_s", "build s", "{:.3f}"),
    Column("first_step_s", "first step s", "{:.2f}"),
    Column("total_s", "import+build+first s", "{:.2f}"),
    Column("second_step_s", "second step s", "{:.4f}"),
]


def _goals(per_shape: dict, torch_ok: bool, torch_default_threads) -> list[Goal]:
    goals = []
    for r in per_shape.values():
        goals.append(Goal(f"{r['shape']}: qatlab step within {GOAL_FLOOR_X}x of the numpy floor",
                          r["x_floor"] <= GOAL_FLOOR_X,
                          f"{r['x_floor']:.2f}x (qatlab {r['qatlab_ms']:.3f} ms, floor {r['floor_ms']:.3f} ms)",
                          f"<= {GOAL_FLOOR_X}x"))
    for (sizes, batch), need in GOAL_TORCH.items():
        label = shape_label(sizes, batch)
        r = per_shape.get(label)
        for tag, what in (("torch1", "torch 1 thread"), ("torchN", f"torch default {torch_default_threads} threads")):
            name = f"{label}: qatlab >= {need}x faster than PyTorch eager ({what})"
            if not torch_ok:
                goals.append(Goal(name.replace(f" {torch_default_threads} threads", ""), None,
                                  "torch not importable", f">= {need}x"))
            elif r is None:
                goals.append(Goal(name, None, "shape not measured in this run", f">= {need}x"))
            else:
                q_ms = r["qatlab_ms"] if tag == "torch1" else r["qatlab_ms_with_torchN"]
                goals.append(Goal(name, r[f"{tag}_x"] >= need,
                                  f"{r[f'{tag}_x']:.2f}x (qatlab {q_ms:.3f} ms, torch {r[f'{tag}_ms']:.3f} ms)",
                                  f">= {need}x"))
    return goals


@suite("train", description="ternary-QAT training step (Adam, cross-entropy): qatlab vs numpy floor vs torch")
def run(opts: BenchOptions) -> SuiteResult:
    """Run the train suite (see the module docstring) and return its tables and goals."""
    torch = _import_torch()
    torch_default_threads = torch.get_num_threads() if torch is not None else None
    per_shape = {}
    for sizes, batch in SHAPES:
        r = _bench_shape(sizes, batch, opts, torch, torch_default_threads)
        per_shape[r["shape"]] = r
    main = Table("ternary-QAT training step, ms per step (medians; ratios: qatlab/floor, torch/qatlab)",
                 MAIN_COLUMNS, [{k: v for k, v in r.items() if k != "breakdown"} for r in per_shape.values()])
    first = Table("first call of the qatlab step in a fresh subprocess", FIRST_CALL_COLUMNS,
                  _first_call_rows(opts.quick))
    breakdown = _breakdown_table(per_shape)
    fused_shapes = [k for k, r in per_shape.items() if r["fused"]]
    blas = os.environ.get("OPENBLAS_NUM_THREADS")
    loaded = blas_threads()
    loaded_txt = ", ".join(f"{k}: {v} thread(s)" for k, v in loaded.items()) or "threadpoolctl not available"
    notes = [
        f"OPENBLAS_NUM_THREADS={blas} (set by `import qatlab` unless already set); BLAS in this process: "
        f"{loaded_txt}; qatlab's products and the numpy floor use that same BLAS; qatlab splits a product of "
        f">= {parallel.MIN_MACS:,} multiply-adds into row or column blocks on {parallel.cores()} cores "
        "(qatlab.runtime.parallel), the floor runs on one thread",
        "qatlab step: mlp.forward (TernaryQuantizer, identity STE, on every layer) + cross_entropy_loss + "
        "mlp.backward(need_input_grad=False) + Adam.step(flat), lr 1e-2; at "
        + ", ".join(fused_shapes or ["no shape"])
        + f" as run_experiment makes it: {RUN_STEPS} steps per qatlab.train.fused_step.FusedStep.steps call (one Numba call "
        "that also gathers each batch), time per step; '1 call ms': FusedStep, one call per step; synthetic "
        "x ~ U[0,1), random labels",
        "numpy floor: the 5 matmuls x@W1.T, h@W2.T, dY.T@h, dY@W2, dH.T@x with np.matmul(out=), nothing else",
        "qatlab, floor and torch 1-thread are interleaved in one measure_many; torch at its default thread "
        "count in a second one together with qatlab (its ratio uses that run's qatlab time, shown; torch's "
        "OpenMP workers keep spinning after each op, so on a small loaded machine both slow down there)",
        "breakdown: every piece timed alone on its own buffers in one more measure_many; 'glue' = full step "
        "minus the sum of the leaf pieces (Python calls, argument checks, views)",
        "first call: `python -c` child timing import qatlab, model build, first step (Numba compile or cache "
        "load of every kernel the step uses) and a second step",
    ]
    if opts.sizes:
        notes.append("--sizes is ignored by this suite (its shapes are fixed by the issue)")
    if torch is None:
        notes.append("torch is not importable here: torch columns and goals skipped (pip install 'torch==2.13.0')")
    else:
        notes.append(f"torch {torch.__version__}: eager, nn.Linear + autograd.Function ternary STE + "
                     "F.cross_entropy + torch.optim.Adam (default, non-fused); 'grad diff vs torch' = max |dW_qatlab"
                     " - dW_torch| / max |dW_torch| of one step from identical weights and data")
    return SuiteResult(tables=[main, breakdown, first], goals=_goals(per_shape, torch is not None,
                                                                     torch_default_threads),
                       notes=notes,
                       extra={"openblas_num_threads": blas, "blas_threads": loaded, "torch_default_threads": torch_default_threads,
                              "shapes": [{"sizes": list(s), "batch": b} for s, b in SHAPES],
                              "breakdown_us": {k: r["breakdown"] for k, r in per_shape.items()}})
