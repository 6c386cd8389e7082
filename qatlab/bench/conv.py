"""``python -m qatlab.bench conv``: a CNN training step beside PyTorch eager and an im2col + BLAS floor.

The model is LeNet-shaped (issue 24): conv 1->16 5x5, ReLU, max-pool 2, conv 16->32 5x5, ReLU,
max-pool 2, linear 512->10; cross-entropy, Adam lr 1e-3, batch 64 of 28x28 images. One step is
forward, loss, backward (no input gradient) and the optimizer update, for float weights, 4-bit fake
per output channel (symmetric, min/max scale each step) and ternary (absmean), all identity STE.

Measured side by side in one run (:func:`~qatlab.bench.kit.measure_many` interleaves the samples):

* **qatlab**: :class:`~qatlab.nn.cnn.Cnn` with its scratch/gradient buffers and :class:`~qatlab.optim.Adam`;
* **PyTorch eager** (when importable): :class:`~qatlab.bench.torch_ref.TorchCnn` from the same initial
  weights, at 1 thread and at torch's default thread count; the goal compares with the faster;
* **floor**: the step's matrix products only, in numpy on im2col matrices built beforehand
  (conv1 forward and weight gradient, conv2 forward, weight and input gradients, linear forward
  and both gradients): what any im2col + BLAS implementation has to spend.

Goals: qatlab >= 1.5x faster than torch eager; qatlab within 2x of the floor; fake-quantized and
ternary steps <= 1.2x the float step (medians). A second table splits each qatlab step into forward,
loss + backward and Adam. ``--sizes N`` sets the batch (default 64).
"""
from __future__ import annotations

import numpy as np

from .. import config as C
from ..runtime import parallel
from .kit import BenchOptions, Column, Goal, SuiteResult, Table, measure_many, suite
from ..nn import cross_entropy_loss
from ..nn.cnn import Cnn
from ..nn.layers import CHUNK_IMAGES
from ..optim import Adam
from ..train.build import weight_quantizer

IMAGE = (1, 28, 28)
CHANNELS = (16, 32)
KERNEL = 5
POOL = 2
CLASSES = 10
BATCH = 64
LR = 1e-3
SEED = 0
#: (key, label, weights, bits, per_channel)
KINDS = (("float", "float", "float", None, False),
         ("fake4pc", "4-bit fake per-channel", "fake", 4, True),
         ("ternary", "ternary", "ternary", None, False))
GOAL_TORCH = 1.5      # torch eager ms / qatlab ms at least
GOAL_FLOOR = 2.0      # qatlab ms / floor ms at most
GOAL_QUANT = 1.2      # quantized step ms / float step ms at most


def data(batch: int = BATCH):
    """Fixed random images (batch, 1, 28, 28) in [0, 1) and labels (batch,)."""
    rng = np.random.default_rng(1234)
    return rng.random((batch, *IMAGE), dtype=np.float32), rng.integers(0, CLASSES, batch).astype(np.int64)


def quant_config(weights: str, bits=None, per_channel=False) -> C.ExperimentConfig:
    cfg = C.ExperimentConfig()
    cfg.quant.weights = weights
    if bits is not None:
        cfg.quant.weight_bits = bits
    cfg.quant.per_channel = per_channel
    cfg.quant.ste = "identity"
    return cfg


def make_model(weights: str, bits=None, per_channel=False) -> Cnn:
    """The LeNet-shaped Cnn (seed 0) with the weight quantizers the training loop would give it."""
    model = Cnn(IMAGE, list(CHANNELS), CLASSES, kernel_size=KERNEL, pool=POOL, seed=SEED)
    cfg = quant_config(weights, bits, per_channel)
    model.set_quantizers([weight_quantizer(cfg, model.weights(i)) for i in range(model.num_layers)])
    return model


def make_qatlab_step(weights: str, bits, per_channel, x, labels):
    """(step, model): step() makes one training step on (x, labels) and returns the loss."""
    model = make_model(weights, bits, per_channel)
    scratch, grads = model.scratch(len(x)), model.gradients(len(x))
    opt = Adam(model.flat_params(), lr=LR)
    flat = grads.flat()

    def step():
        y = model.forward(x, scratch)
        loss = cross_entropy_loss(y, labels, grads.d_output_mut())
        model.backward(x, scratch, grads, need_input_grad=False)
        opt.step(flat)
        return loss

    return step, model


def make_pieces(weights: str, bits, per_channel, x, labels) -> dict:
    """{piece: fn} for one model: its forward alone, forward + loss + backward, and the whole step."""
    model = make_model(weights, bits, per_channel)
    scratch, grads = model.scratch(len(x)), model.gradients(len(x))
    opt = Adam(model.flat_params(), lr=LR)

    def forward():
        return model.forward(x, scratch)

    def forward_backward():
        loss = cross_entropy_loss(model.forward(x, scratch), labels, grads.d_output_mut())
        model.backward(x, scratch, grads, need_input_grad=False)
        return loss

    def step():
        loss = forward_backward()
        opt.step(grads.flat())
        return loss

    return {"forward": forward, "forward_backward": forward_backward, "step": step}


def breakdown_rows(m: dict) -> list[dict]:
    """Rows of forward / backward (with the loss) / optimizer ms per kind from measured pieces: the
    fastest sample of each (differences of medians go negative on a loaded machine)."""
    rows = []
    for key, label, *_ in KINDS:
        f, fb, st = (m[f"{key}:{p}"].min * 1e3 for p in ("forward", "forward_backward", "step"))
        rows.append({"kind": key, "weights": label, "forward_ms": f, "backward_ms": fb - f,
                     "optimizer_ms": st - fb, "step_ms": st})
    return rows


BREAKDOWN_COLUMNS = [Column("weights", "weights"), Column("forward_ms", "forward ms", "{:.3f}"),
                     Column("backward_ms", "loss + backward ms", "{:.3f}"),
                     Column("optimizer_ms", "Adam ms", "{:.3f}"), Column("step_ms", "step ms", "{:.3f}")]


def make_floor(batch: int = BATCH):
    """floor(): the LeNet step's eight matrix products on im2col matrices, outputs preallocated."""
    rng = np.random.default_rng(7)

    def r(*shape):
        return rng.standard_normal(shape, dtype=np.float32)

    p1, p2 = 24 * 24, 8 * 8                               # conv output positions per image
    k1, k2 = IMAGE[0] * KERNEL ** 2, CHANNELS[0] * KERNEL ** 2
    w1, cols1, z1, dz1, dw1 = r(CHANNELS[0], k1), r(k1, batch * p1), r(CHANNELS[0], batch * p1), \
        r(CHANNELS[0], batch * p1), r(CHANNELS[0], k1)
    w2, cols2, z2, dz2, dw2, dcols2 = r(CHANNELS[1], k2), r(k2, batch * p2), r(CHANNELS[1], batch * p2), \
        r(CHANNELS[1], batch * p2), r(CHANNELS[1], k2), r(k2, batch * p2)
    n_flat = CHANNELS[1] * 16
    w3, a3, y3, dy3, dw3, da3 = r(CLASSES, n_flat), r(batch, n_flat), r(batch, CLASSES), r(batch, CLASSES), \
        r(CLASSES, n_flat), r(batch, n_flat)
    mm = np.matmul
    cols1t, cols2t, w2t, w3t, dy3t = cols1.T, cols2.T, w2.T, w3.T, dy3.T

    def floor():
        mm(w1, cols1, out=z1)
        mm(w2, cols2, out=z2)
        mm(a3, w3t, out=y3)
        mm(dy3t, a3, out=dw3)
        mm(dy3, w3, out=da3)
        mm(dz2, cols2t, out=dw2)
        mm(w2t, dz2, out=dcols2)
        mm(dz1, cols1t, out=dw1)

    return floor


def torch_params(model: Cnn) -> list:
    """(weight, bias) numpy pairs of every layer of ``model``, for the torch twin's initial point."""
    return [(model.weights(i).copy(), model.biases(i).copy()) for i in range(model.num_layers)]


def make_torch_step(weights: str, bits, per_channel, x, labels, params, threads=None):
    """step() of the torch twin (one eager training step, returns the loss as float); ``threads``
    set around each call (None: torch's default)."""
    import torch
    import torch.nn.functional as F

    from . import torch_ref as ref

    model = ref.TorchCnn(IMAGE, CHANNELS, KERNEL, POOL, (), CLASSES, weights, bits or 8, per_channel, params)
    opt = torch.optim.Adam(model.parameters(), lr=LR)
    xt, yt = torch.from_numpy(np.ascontiguousarray(x)), torch.from_numpy(labels)

    def one():
        opt.zero_grad(set_to_none=True)
        loss = F.cross_entropy(model(xt), yt)
        loss.backward()
        opt.step()
        return loss

    if threads is None:
        return one

    def step():
        with ref.num_threads(threads):
            return one()

    return step


def same_math(weights, bits, per_channel, x, labels) -> dict:
    """Losses of the first three steps of qatlab and the torch twin from the same start (float64 diffs)."""
    q_step, model = make_qatlab_step(weights, bits, per_channel, x, labels)
    t_step = make_torch_step(weights, bits, per_channel, x, labels, torch_params(model), threads=1)
    q = [float(q_step()) for _ in range(3)]
    t = [float(t_step().detach()) for _ in range(3)]
    return {"qatlab_losses": q, "torch_losses": t,
            "max_rel_diff": max(abs(a - b) / max(abs(b), 1e-12) for a, b in zip(q, t))}


def _import_torch():
    try:
        import torch
    except Exception:  # ImportError, or a broken install raising OSError etc.
        return None
    return torch


def _row(key, label, m, floor, float_m, t1=None, tn=None, threads=None) -> dict:
    q = m[key].median
    row = {"kind": key, "weights": label, "qatlab_ms": q * 1e3, "floor_ms": floor.median * 1e3,
           "x_floor": q / floor.median, "x_float": q / float_m.median,
           "raw": {"qatlab": m[key].to_dict(), "floor": floor.to_dict()}}
    if t1 is not None:
        best = min(t1.median, tn.median)
        row.update({"torch1_ms": t1.median * 1e3, "torchN_ms": tn.median * 1e3, "torch_threads": threads,
                    "torch_best_ms": best * 1e3, "x_torch": best / q})
        row["raw"].update({"torch1": t1.to_dict(), "torchN": tn.to_dict()})
    return row


COLUMNS = [
    Column("weights", "weights"),
    Column("qatlab_ms", "qatlab ms", "{:.3f}"),
    Column("torch1_ms", "torch 1t ms", "{:.3f}"),
    Column("torchN_ms", "torch default ms", "{:.3f}"),
    Column("x_torch", "torch best/qatlab", "{:.2f}x"),
    Column("floor_ms", "floor ms", "{:.3f}"),
    Column("x_floor", "qatlab/floor", "{:.2f}x"),
    Column("x_float", "qatlab/float step", "{:.2f}x"),
]


def goals(rows: dict) -> list[Goal]:
    """PASS/MISS per goal from the rows' numbers (SKIP for torch when it is not importable)."""
    out = []
    for key, label, *_ in KINDS:
        r = rows[key]
        x = r.get("x_torch")
        out.append(Goal(f"{label} step >= {GOAL_TORCH}x faster than PyTorch eager",
                        None if x is None else bool(x >= GOAL_TORCH),
                        "torch not importable" if x is None else
                        f"{x:.2f}x ({r['qatlab_ms']:.2f} ms vs {r['torch_best_ms']:.2f} ms)", f">= {GOAL_TORCH}x"))
    for key, label, *_ in KINDS:
        r = rows[key]
        out.append(Goal(f"{label} step within {GOAL_FLOOR}x of the im2col + BLAS floor", bool(r["x_floor"] <= GOAL_FLOOR),
                        f"{r['x_floor']:.2f}x ({r['qatlab_ms']:.2f} ms vs {r['floor_ms']:.2f} ms)", f"<= {GOAL_FLOOR}x"))
    for key, label, *_ in KINDS[1:]:
        r = rows[key]
        out.append(Goal(f"{label} step <= {GOAL_QUANT}x the float step", bool(r["x_float"] <= GOAL_QUANT),
                        f"{r['x_float']:.2f}x ({r['qatlab_ms']:.2f} ms vs {rows['float']['qatlab_ms']:.2f} ms)",
                        f"<= {GOAL_QUANT}x"))
    return out


@suite("conv", description="LeNet CNN training step (batch 64): qatlab vs PyTorch eager vs im2col+BLAS floor")
def run(opts: BenchOptions) -> SuiteResult:
    """Run the conv suite (see the module docstring) and return its table and goals."""
    batch = BATCH if opts.sizes is None else opts.sizes[0]
    x, labels = data(batch)
    torch = _import_torch()
    fns, checks = {}, {}
    for key, _, weights, bits, pc in KINDS:
        fns[key], model = make_qatlab_step(weights, bits, pc, x, labels)
        if torch is not None:
            params = torch_params(model)
            fns[f"torch1_{key}"] = make_torch_step(weights, bits, pc, x, labels, params, threads=1)
            fns[f"torchN_{key}"] = make_torch_step(weights, bits, pc, x, labels, params)
            checks[key] = same_math(weights, bits, pc, x, labels)
    fns["floor"] = make_floor(batch)
    m = measure_many(fns, repeats=opts.repeats, warmup=opts.warmup, min_time=opts.min_time)
    threads = torch.get_num_threads() if torch is not None else None
    rows = {}
    for key, label, *_ in KINDS:
        t1, tn = (m[f"torch1_{key}"], m[f"torchN_{key}"]) if torch is not None else (None, None)
        rows[key] = _row(key, label, m, m["floor"], m["float"], t1, tn, threads)
        if key in checks:
            rows[key]["torch_loss_rel_diff"] = checks[key]["max_rel_diff"]
    recipe = (f"conv 1->16 5x5, ReLU, max-pool 2, conv 16->32 5x5, ReLU, max-pool 2, linear 512->10; "
              f"Adam lr {LR:g}, batch {batch}")
    notes = [f"one step = forward, cross-entropy, backward (no input gradient), Adam update; {recipe}",
             f"qatlab runs its conv layers in chunks of {CHUNK_IMAGES} images on {parallel.cores()} core(s) "
             "(the same bits on any core count)",
             "floor = the step's 8 matrix products (numpy matmul on im2col matrices built beforehand); "
             "no im2col, activation, pooling, loss or optimizer work",
             "fake: symmetric 4-bit per output channel, min/max scale every step; ternary: absmean; identity STE",
             "breakdown: differences of separately timed calls; a piece smaller than the machine's noise "
             "(Adam over 44k parameters) can come out negative on a loaded machine"]
    if torch is None:
        notes.append("torch is not importable here: the PyTorch columns are empty")
    else:
        diffs = ", ".join(f"{k} {c['max_rel_diff']:.1e}" for k, c in checks.items())
        notes.append(f"torch {torch.__version__} eager twin from the same initial weights; relative loss "
                     f"difference over its first 3 steps vs qatlab: {diffs}; 'torch best' = the faster of "
                     f"1 thread and the default {threads} threads")
    pieces = {f"{key}:{p}": fn for key, _, w, b, pc in KINDS for p, fn in make_pieces(w, b, pc, x, labels).items()}
    parts = measure_many(pieces, repeats=opts.repeats, warmup=opts.warmup, min_time=opts.min_time)
    tables = [Table(f"CNN training step, LeNet shape, batch {batch} (ms per step)", COLUMNS, list(rows.values())),
              Table("where a qatlab step's time goes (fastest sample of: forward; forward + loss + backward; "
                    "step; the differences)", BREAKDOWN_COLUMNS, breakdown_rows(parts))]
    return SuiteResult(tables=tables, goals=goals(rows), notes=notes,
                       extra={"batch": batch, "torch": torch is not None, "torch_threads": threads,
                              "same_math": checks})
