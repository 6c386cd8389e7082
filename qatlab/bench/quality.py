"""``python -m qatlab.bench quality``: final test accuracy of the digits recipe per weight quantizer and STE.

The recipe (issue 3): digits (8x8, 1797 samples, 20% test split, seed 0), MLP 64-256-10 relu,
Adam lr 1e-2 (constant), 40 epochs, batch 64, seed 0, cross-entropy, trained with
``ql.run_experiment(cfg)`` -- the generic loop, including its per-epoch evaluation and metrics
rows every ``metrics_every`` = 10 steps, which are part of its seconds.

Runs: float, 8-bit fake, 4-bit fake, ternary (identity STE); then every SteKind for ternary and
for 2-bit fake weights (symmetric, per-tensor, observer scale). When torch is importable the first
four are also trained by a PyTorch eager implementation of the same recipe
(:mod:`qatlab.bench.torch_ref`: same split, same initial weights, same batch order, Adam lr 1e-2,
identity STE), reported side by side. Goals: float, 8-bit and 4-bit >= 97%, ternary >= 96%.
``--quick`` trains fewer epochs and says so in every goal line and in the notes.

Then the CNN recipes of issue 24 (:mod:`qatlab.bench.quality_cnn`): mnist LeNet (float, 4-bit
per-channel, ternary; mean over seeds 0-2; every SteKind; the PyTorch twin) and mnist1d CNN vs MLP.
The environment variable ``QATLAB_BENCH_QUALITY_PARTS`` (``digits``, ``cnn`` or ``digits,cnn``, the
default) picks which halves run.
"""
from __future__ import annotations

import math
import os

from .. import config as C
from .kit import BenchOptions, Column, Goal, SuiteResult, Table, suite
from ..data import load_dataset
from ..nn import Mlp
from ..runs import run_experiment
from ..quant.ste import SteKind

EPOCHS = 40
QUICK_EPOCHS = 5
BATCH = 64
LR = 1e-2
SEED = 0
HIDDEN = 256
TEST_FRACTION = 0.2
PARTS_ENV = "QATLAB_BENCH_QUALITY_PARTS"
PARTS = ("digits", "cnn")

#: (key, label, weights, bits, goal) of the main comparison; goal is the accuracy floor (fraction).
MAIN_RUNS = (
    ("float", "float", "float", None, 0.97),
    ("fake8", "8-bit fake", "fake", 8, 0.97),
    ("fake4", "4-bit fake", "fake", 4, 0.97),
    ("ternary", "ternary", "ternary", None, 0.96),
)


def make_config(weights: str, bits: int | None = None, ste: SteKind | str = SteKind.IDENTITY,
                epochs: int = EPOCHS) -> C.ExperimentConfig:
    """The quality recipe's ExperimentConfig for one weight quantizer and STE."""
    quant = C.QuantConfig(weights=weights, ste=SteKind(ste))
    if bits is not None:
        quant.weight_bits = bits
    return C.ExperimentConfig(
        data=C.DataConfig(dataset="digits", test_fraction=TEST_FRACTION, seed=SEED),
        model=C.ModelConfig(hidden=[HIDDEN], activation="relu"),
        quant=quant,
        optim=C.OptimConfig(optimizer="adam", lr=LR, schedule="constant", epochs=epochs, batch_size=BATCH,
                            seed=SEED),
        phase=C.PhaseConfig(enabled=False),
        metrics_every=10)


def _import_torch():
    """torch, or None when it is not importable here."""
    try:
        import torch
    except Exception:  # ImportError, or a broken install raising OSError etc.
        return None
    return torch


def _qatlab_row(label: str, weights: str, bits, ste: SteKind, epochs: int) -> dict:
    res = run_experiment(make_config(weights, bits, ste, epochs))
    f = res.final
    return {"run": label, "weights": weights, "bits": bits, "ste": ste.value, "epochs": epochs,
            "test_accuracy": f["test_accuracy"], "test_acc_pct": 100.0 * f["test_accuracy"],
            "test_loss": f["test_loss"], "train_loss": f["train_loss"], "seconds": f["seconds"],
            "steps": f.get("steps"), "steps_per_second": f["steps_per_second"], "status": res.status}


def _torch_row(ds, weights: str, bits, epochs: int) -> dict:
    from . import torch_ref as ref

    init = Mlp([ds.n_features, HIDDEN, ds.n_outputs], activation="relu", seed=SEED)  # = build_model's init
    r = ref.train(ds, init.sizes, weights, bits or 8, epochs=epochs, batch_size=BATCH, lr=LR, seed=SEED,
                  weights=[init.weights(i) for i in range(init.num_layers)],
                  biases=[init.biases(i) for i in range(init.num_layers)], threads=1)
    return {"torch_test_accuracy": r["test_accuracy"], "torch_test_acc_pct": 100.0 * r["test_accuracy"],
            "torch_test_loss": r["test_loss"], "torch_seconds": r["seconds"],
            "torch_steps_per_second": r["steps_per_second"], "torch_status": r["status"]}


def _warm_up(ds) -> None:
    """One short untimed run per quantizer kind (and torch), so no timed run pays Numba cache loads."""
    for weights, bits in (("float", None), ("fake", 8), ("ternary", None)):
        run_experiment(make_config(weights, bits, epochs=1))
        if ds is not None:
            _torch_row(ds, weights, bits, 1)


MAIN_COLUMNS = [
    Column("run", "weights"),
    Column("ste", "STE"),
    Column("test_acc_pct", "test acc %", "{:.2f}"),
    Column("test_loss", "test loss", "{:.4f}"),
    Column("train_loss", "train loss", "{:.4f}"),
    Column("seconds", "seconds", "{:.2f}"),
    Column("steps_per_second", "steps/s", "{:.0f}"),
    Column("status", "status"),
    Column("torch_test_acc_pct", "torch acc %", "{:.2f}"),
    Column("torch_test_loss", "torch loss", "{:.4f}"),
    Column("torch_seconds", "torch s", "{:.2f}"),
    Column("torch_steps_per_second", "torch steps/s", "{:.0f}"),
    Column("delta_pp", "qatlab - torch (pp)", "{:+.2f}"),
]

STE_COLUMNS = [
    Column("run", "weights"),
    Column("ste", "STE"),
    Column("test_acc_pct", "test acc %", "{:.2f}"),
    Column("test_loss", "test loss", "{:.4f}"),
    Column("train_loss", "train loss", "{:.4f}"),
    Column("seconds", "seconds", "{:.2f}"),
    Column("steps_per_second", "steps/s", "{:.0f}"),
    Column("status", "status"),
    Column("note", "note"),
]


def _goals(main: dict, epochs: int, quick: bool) -> list[Goal]:
    goals = []
    tag = f" (quick run: {epochs} of {EPOCHS} epochs)" if quick else ""
    for key, label, _, _, floor in MAIN_RUNS:
        r = main[key]
        acc = r["test_accuracy"]
        ok = bool(math.isfinite(acc) and acc >= floor)
        goals.append(Goal(f"{label} test accuracy >= {100 * floor:.0f}%", ok,
                          f"{100 * acc:.2f}%{tag}", f">= {100 * floor:.0f}%"))
    return goals


def parts() -> tuple[str, ...]:
    """The halves named by ``QATLAB_BENCH_QUALITY_PARTS`` (default both); ValueError for other names."""
    raw = os.environ.get(PARTS_ENV, ",".join(PARTS))
    names = tuple(p.strip() for p in raw.split(",") if p.strip())
    if not names or any(p not in PARTS for p in names):
        raise ValueError(f"{PARTS_ENV}: expected a comma-separated subset of {', '.join(PARTS)}; got {raw!r}")
    return names


@suite("quality", description="test accuracy per weight quantizer and STE: digits MLP, mnist/mnist1d CNN, vs PyTorch eager")
def run(opts: BenchOptions) -> SuiteResult:
    """Run the quality suite (see the module docstring) and return its tables and goals."""
    halves = parts()
    torch = _import_torch()
    result = run_digits(opts, torch) if "digits" in halves else SuiteResult(tables=[])
    if "cnn" in halves:
        from .quality_cnn import run_cnn_recipes

        tables, goals, notes, extra = run_cnn_recipes(opts.quick, torch is not None)
        result.tables += tables
        result.goals += goals
        result.notes += notes
        result.extra["cnn"] = extra
    result.extra["parts"] = list(halves)
    return result


def run_digits(opts: BenchOptions, torch) -> SuiteResult:
    """The digits MLP recipe (tables, goals, notes)."""
    epochs = QUICK_EPOCHS if opts.quick else EPOCHS
    ds = load_dataset(make_config("float", epochs=epochs).data) if torch is not None else None

    _warm_up(ds)
    main = {}
    for key, label, weights, bits, _ in MAIN_RUNS:
        row = _qatlab_row(label, weights, bits, SteKind.IDENTITY, epochs)
        if torch is not None:
            row.update(_torch_row(ds, weights, bits, epochs))
            row["delta_pp"] = row["test_acc_pct"] - row["torch_test_acc_pct"]
        main[key] = row

    ste_rows = []
    for label, weights, bits in (("ternary", "ternary", None), ("2-bit fake", "fake", 2)):
        for kind in SteKind:
            if weights == "ternary" and kind is SteKind.IDENTITY:
                row = {k: v for k, v in main["ternary"].items() if not k.startswith("torch") and k != "delta_pp"}
                row["note"] = "same run as the main table (deterministic)"
            else:
                row = _qatlab_row(label, weights, bits, kind, epochs)
            ste_rows.append(row)

    recipe = (f"digits 64-{HIDDEN}-10 relu, Adam lr {LR:g}, {epochs} epochs, batch {BATCH}, seed {SEED}, "
              f"{100 * TEST_FRACTION:.0f}% test split")
    tables = [Table(f"test accuracy after training ({recipe})", MAIN_COLUMNS, list(main.values())),
              Table("STE comparison: ternary and 2-bit fake weights, each SteKind", STE_COLUMNS, ste_rows)]
    notes = [
        f"recipe: {recipe}; cross-entropy; qatlab via ql.run_experiment(cfg) (fake: symmetric per-tensor, "
        "scale from the current min/max each step; ternary: absmean); final = after the last epoch",
        "qatlab seconds include its per-epoch test evaluation and a metrics row every 10 steps; "
        "one untimed 1-epoch warm-up run per quantizer kind comes first (Numba cache loads)",
    ]
    if opts.quick:
        notes.insert(0, f"QUICK RUN: {epochs} epochs instead of {EPOCHS}; accuracies and goals are not "
                        "the recipe's")
    if torch is None:
        notes.append("torch is not importable here: the PyTorch columns are empty (pip install 'torch==2.13.0')")
    else:
        notes.append(f"torch {torch.__version__} eager (1 thread): nn.Linear + autograd.Function identity STE "
                     "(ternary: fake_quantize_per_tensor_affine(W, mean|W|, 0, -1, 1); k-bit: min/max scale), "
                     "F.cross_entropy, torch.optim.Adam; same split, same initial weights (qatlab's seeded "
                     "init) and the same batch order as qatlab; it also evaluates the test split every epoch and takes "
                     "train loss/accuracy from the batches")
    return SuiteResult(tables=tables, goals=_goals(main, epochs, opts.quick), notes=notes,
                       extra={"epochs": epochs, "quick": opts.quick, "torch": torch is not None})
