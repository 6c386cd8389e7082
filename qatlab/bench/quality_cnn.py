"""The CNN half of ``python -m qatlab.bench quality``: the mnist and mnist1d recipes (issue 24).

mnist: the LeNet-shaped CNN (conv 1->16 5x5, ReLU, max-pool 2, conv 16->32 5x5, ReLU, max-pool 2,
linear 512->10), Adam lr 1e-3 (constant), batch 64, 20 epochs, the 4000/1000 split (seed 0) of the
shipped 5000-image subset; mean over seeds 0-2 (init and batch order) for float, 4-bit fake per
output channel (symmetric, min/max scale each step) and ternary (absmean), identity STE; then every
SteKind for ternary and 4-bit per-channel at seed 0. mnist1d: a float CNN (three conv 1x3 layers of
64 channels, each followed by ReLU and max-pool 1x2, then dense 192->10) beside the MLP 40-256-10,
same optimizer, 30 epochs, the dataset's own 4000/1000 split, mean over the same seeds.

Every run goes through ``ql.run_experiment(cfg)``. When torch is importable the mnist main runs are
also trained by the PyTorch eager twin (:func:`qatlab.bench.torch_ref.train_cnn`: same split, same
initial weights, same batch order, identity STE). Quick mode: 1 epoch, seed 0 only.
"""
from __future__ import annotations

import math
import statistics

from .. import config as C
from .kit import Column, Goal, Table
from ..data import load_dataset
from ..nn.cnn import Cnn
from ..runs import run_experiment
from ..quant.ste import SteKind

MNIST_EPOCHS = 20
MNIST1D_EPOCHS = 30
QUICK_EPOCHS = 1
SEEDS = (0, 1, 2)
QUICK_SEEDS = (0,)
LR = 1e-3
BATCH = 64
LENET = {"conv_channels": [16, 32], "kernel_size": 5, "pool": 2, "hidden": []}
MNIST1D_CNN = {"conv_channels": [64, 64, 64], "kernel_size": 3, "pool": 2, "hidden": []}
MNIST1D_MLP_HIDDEN = [256]
#: (key, label, weights, bits, per_channel, goal: mean test accuracy floor)
MNIST_RUNS = (("float", "float", "float", None, False, 0.965),
              ("fake4pc", "4-bit per-channel", "fake", 4, True, 0.965),
              ("ternary", "ternary", "ternary", None, False, 0.960))
MNIST1D_GOAL = 0.90


def mnist_config(weights="float", bits=None, per_channel=False, ste=SteKind.IDENTITY, seed=0,
                 epochs=MNIST_EPOCHS) -> C.ExperimentConfig:
    """The mnist CNN recipe for one weight quantizer, STE and seed."""
    quant = C.QuantConfig(weights=weights, ste=SteKind(ste), per_channel=per_channel)
    if bits is not None:
        quant.weight_bits = bits
    return C.ExperimentConfig(
        data=C.DataConfig(dataset="mnist", test_fraction=0.2, seed=0),
        model=C.ModelConfig(architecture="cnn", activation="relu", **LENET),
        quant=quant, optim=_optim(seed, epochs), phase=C.PhaseConfig(enabled=False), metrics_every=10)


def mnist1d_config(architecture: str, seed=0, epochs=MNIST1D_EPOCHS) -> C.ExperimentConfig:
    """The mnist1d recipe: the float CNN or the float MLP."""
    model = (C.ModelConfig(architecture="cnn", activation="relu", **MNIST1D_CNN) if architecture == "cnn"
             else C.ModelConfig(architecture="mlp", activation="relu", hidden=list(MNIST1D_MLP_HIDDEN)))
    return C.ExperimentConfig(data=C.DataConfig(dataset="mnist1d"), model=model,
                              quant=C.QuantConfig(weights="float"), optim=_optim(seed, epochs),
                              phase=C.PhaseConfig(enabled=False), metrics_every=10)


def _optim(seed, epochs) -> C.OptimConfig:
    return C.OptimConfig(optimizer="adam", lr=LR, schedule="constant", epochs=epochs, batch_size=BATCH, seed=seed)


def qatlab_run(cfg: C.ExperimentConfig) -> dict:
    res = run_experiment(cfg)
    f = res.final
    return {"test_accuracy": f.get("test_accuracy", math.nan), "test_loss": f.get("test_loss", math.nan),
            "train_loss": f.get("train_loss", math.nan), "seconds": f.get("seconds", math.nan),
            "steps_per_second": f.get("steps_per_second", math.nan), "status": res.status}


def torch_run(ds, cfg: C.ExperimentConfig) -> dict:
    """The PyTorch twin of ``cfg`` (a cnn recipe) from qatlab's initial weights for its seed."""
    from . import torch_ref as ref

    m, q = cfg.model, cfg.quant
    init = Cnn(ds.image_shape, m.conv_channels, ds.n_outputs, hidden=m.hidden, kernel_size=m.kernel_size,
               pool=m.pool, seed=cfg.optim.seed)                    # = build_model's init
    params = [(init.weights(i), init.biases(i)) for i in range(init.num_layers)]
    r = ref.train_cnn(ds, ds.image_shape, m.conv_channels, m.kernel_size, m.pool, m.hidden, q.weights,
                      q.weight_bits, q.per_channel, params=params, epochs=cfg.optim.epochs, batch_size=BATCH,
                      lr=LR, seed=cfg.optim.seed, threads=1)
    return {"test_accuracy": r["test_accuracy"], "seconds": r["seconds"], "status": r["status"]}


def _mean(xs) -> float:
    xs = [x for x in xs if x is not None and math.isfinite(x)]
    return statistics.fmean(xs) if xs else math.nan


def summarize(key, label, runs: list[dict], torch_runs: list[dict] | None) -> dict:
    """One table row from per-seed runs: mean/min/max accuracy (and the torch twin's mean)."""
    accs = [r["test_accuracy"] for r in runs]
    row = {"key": key, "run": label, "seeds": [r["seed"] for r in runs], "acc_pct": 100 * _mean(accs),
           "min_pct": 100 * min(accs), "max_pct": 100 * max(accs), "test_accuracy": _mean(accs),
           "seconds": _mean([r["seconds"] for r in runs]), "status": ",".join(sorted({r["status"] for r in runs})),
           "per_seed": runs}
    if torch_runs:
        t = _mean([r["test_accuracy"] for r in torch_runs])
        row.update({"torch_acc_pct": 100 * t, "torch_test_accuracy": t, "delta_pp": row["acc_pct"] - 100 * t,
                    "torch_seconds": _mean([r["seconds"] for r in torch_runs]), "torch_per_seed": torch_runs})
    return row


MAIN_COLUMNS = [Column("run", "weights"), Column("acc_pct", "test acc % (mean)", "{:.2f}"),
                Column("min_pct", "min", "{:.2f}"), Column("max_pct", "max", "{:.2f}"),
                Column("seconds", "s/run", "{:.1f}"), Column("status", "status"),
                Column("torch_acc_pct", "torch acc %", "{:.2f}"), Column("torch_seconds", "torch s/run", "{:.1f}"),
                Column("delta_pp", "qatlab - torch (pp)", "{:+.2f}")]
STE_COLUMNS = [Column("run", "weights"), Column("ste", "STE"), Column("acc_pct", "test acc %", "{:.2f}"),
               Column("test_loss", "test loss", "{:.4f}"), Column("seconds", "seconds", "{:.1f}"),
               Column("status", "status"), Column("note", "note")]


def run_cnn_recipes(quick: bool, torch_ok: bool) -> tuple[list[Table], list[Goal], list[str], dict]:
    """(tables, goals, notes, extra) of the mnist and mnist1d recipes."""
    seeds = QUICK_SEEDS if quick else SEEDS
    ep_mnist = QUICK_EPOCHS if quick else MNIST_EPOCHS
    ep_1d = QUICK_EPOCHS if quick else MNIST1D_EPOCHS
    ds = load_dataset(mnist_config().data) if torch_ok else None
    main, seed0 = {}, {}
    for key, label, weights, bits, pc, _ in MNIST_RUNS:
        runs, truns = [], []
        for s in seeds:
            cfg = mnist_config(weights, bits, pc, seed=s, epochs=ep_mnist)
            runs.append({"seed": s, **qatlab_run(cfg)})
            if torch_ok:
                truns.append({"seed": s, **torch_run(ds, cfg)})
        seed0[key] = runs[0]
        main[key] = summarize(key, label, runs, truns)

    ste_rows = []
    for key, label, weights, bits, pc, _ in MNIST_RUNS[1:]:
        for kind in SteKind:
            if kind is SteKind.IDENTITY and seed0[key]["seed"] == 0:
                r, note = seed0[key], "seed 0 run of the main table"
            else:
                r, note = qatlab_run(mnist_config(weights, bits, pc, kind, seed=0, epochs=ep_mnist)), ""
            ste_rows.append({"run": label, "ste": kind.value, "acc_pct": 100 * r["test_accuracy"], **r, "note": note})

    one_d = {}
    for arch in ("cnn", "mlp"):
        runs = [{"seed": s, **qatlab_run(mnist1d_config(arch, s, ep_1d))} for s in seeds]
        one_d[arch] = summarize(arch, f"mnist1d {arch.upper()}", runs, None)

    tag = f" (quick run: {ep_mnist} of {MNIST_EPOCHS} epochs, seeds {list(seeds)})" if quick else ""
    goals = [Goal(f"mnist CNN {label}: mean test accuracy >= {100 * floor:.1f}%",
                  bool(main[key]["test_accuracy"] >= floor), f"{main[key]['acc_pct']:.2f}%{tag}",
                  f">= {100 * floor:.1f}%") for key, label, *_, floor in MNIST_RUNS]
    tag1d = f" (quick run: {ep_1d} of {MNIST1D_EPOCHS} epochs)" if quick else ""
    goals.append(Goal(f"mnist1d CNN: mean test accuracy >= {100 * MNIST1D_GOAL:.0f}%",
                      bool(one_d["cnn"]["test_accuracy"] >= MNIST1D_GOAL),
                      f"{one_d['cnn']['acc_pct']:.2f}% (MLP {one_d['mlp']['acc_pct']:.2f}%){tag1d}",
                      f">= {100 * MNIST1D_GOAL:.0f}%"))
    recipe = (f"mnist 4000/1000, LeNet CNN, Adam lr {LR:g}, batch {BATCH}, {ep_mnist} epochs, "
              f"seeds {list(seeds)}")
    tables = [Table(f"mnist CNN test accuracy ({recipe})", MAIN_COLUMNS, list(main.values())),
              Table(f"mnist CNN STE comparison (seed 0, {ep_mnist} epochs)", STE_COLUMNS, ste_rows),
              Table(f"mnist1d: CNN vs MLP (float, {ep_1d} epochs, seeds {list(seeds)})", MAIN_COLUMNS[:6],
                    list(one_d.values()))]
    notes = [f"mnist recipe: {recipe}; fake = symmetric 4-bit per output channel with a min/max scale each step; "
             "ternary = absmean; identity STE in the main table",
             f"mnist1d: CNN conv {MNIST1D_CNN['conv_channels']} kernel 1x{MNIST1D_CNN['kernel_size']} pool "
             f"1x{MNIST1D_CNN['pool']} dense {MNIST1D_CNN['hidden']}; MLP 40-{MNIST1D_MLP_HIDDEN[0]}-10"]
    if torch_ok:
        notes.append("mnist torch twin (1 thread): TorchCnn, same split, initial weights and batch order as "
                     "qatlab per seed; per-channel fake quant via fake_quantize_per_channel_affine")
    extra = {"mnist_epochs": ep_mnist, "mnist1d_epochs": ep_1d, "seeds": list(seeds)}
    return tables, goals, notes, extra
