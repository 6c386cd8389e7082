"""``python -m qatlab.bench phase``: phase training against full backprop, measured side by side.

Workloads (every run of one workload: same seed, epochs, data and batch order; only ``phase`` differs):

* **digits** -- the ``ExperimentConfig`` defaults: digits (1797 x 64, 20% test, seed 0), ternary
  weights, MLP 64-256-10 relu, Adam lr 1e-2 constant, 40 epochs, batch 64, seed 0;
* **synthetic** -- Gaussian-cluster classification, 4000 samples x 784 features, 10 classes,
  MLP 784-1024-10 relu, ternary, 10 epochs, otherwise the defaults. With 784 features the
  clusters are far apart (full backprop reaches 100% test accuracy), so this workload tests the
  wall clock of a bigger layer, not accuracy.

Configurations (rows): full backprop (``phase.enabled = False``); phase with the ``PhaseConfig``
defaults (momentum predictor, adaptive phases); least_squares; momentum and least_squares with
``adaptive_phases=False``; a control -- the phase loop with ``predict_steps=0`` (every step a real
backward pass, clipped to ``max_grad_norm``), which shows the loop's own overhead and the effect
of the default clipping without any prediction; and, on digits, two diagnostic rows:
``prediction.momentum = 0`` (each predicted step reuses the last real gradient plus the learned
correction), which separates "stale gradient" from "extrapolation" in the prediction cosine, and
``prediction.learned_gain = False`` (the predictions applied unscaled), which shows what the
learned gain does for accuracy.

Each configuration is trained ``--repeats`` times (7; quick: 3), interleaved round-robin after one untimed
1-epoch warm-up of each, through ``ql.LocalRun`` (= ``ql.run_experiment`` plus access to the run's
log metadata). Training is deterministic, so accuracy is identical across repeats (checked;
reported in the ``deterministic`` field). Columns:

* ``train s`` -- median ``final["train_seconds"]``: the training loop without the per-epoch
  evaluation (its metrics rows every 10 steps included, alike for every row);
* ``wall x`` -- MEASURED speedup = full-backprop median train seconds / this row's median;
* ``est x`` -- PhaseTrainer's own estimate (mean backward-step seconds x steps / step seconds);
* ``step x`` -- steps / backward passes;
* ``cos`` -- mean cosine(predicted, real gradient) on CORRECT steps, ``nanmean`` of the history
  column ``pred_cosine``; ``cos>0`` the share of those corrections with a positive cosine.

On goal workloads a table says how far the real gradients carry over from step to step along full
backprop (:mod:`qatlab.bench.predictability`): the limit of any prediction from them.

Another table per workload says where the time goes: milliseconds per backward step and per
predicted step (PhaseTrainer's begin_step..end_step timers, or its runs' per step, from ``log.meta["phase_stats"]``),
the loop time outside those (batch gather, metrics rows), and the wall-clock speedup an ideal
phase run with the same step counts could reach given component costs measured in isolation
(forward+loss, backward, optimizer, predictor, metrics row; see the components table).

Goals (issue 4), per phase configuration on digits, over the optimizer seeds 0 and :data:`SEEDS`
(0-19): measured wall-clock speedup >= 1.5x as the median of the per-seed speedups AND test
accuracy within 1 percentage point of full backprop as the mean of the per-seed differences. Seed
0 is the tables above; every other seed is trained :data:`SEED_REPEATS` more times (interleaved)
with full backprop and each phase and diagnostic configuration (two more tables summarise the
accuracy and the wall clock over the seeds; the per-seed numbers, backward passes included, are in
the JSON; diagnostics reported, not judged). Why the median over seeds: the adaptive phase lengths
differ from seed to seed (measured: 209 to 425 backward passes of 920 with the defaults), and so
does the speedup. Why twenty seeds: see :data:`SEEDS`. The defaults are the issue's goal; the
other configurations are judged by the same rule. Nothing is tuned to meet them. ``--quick``: digits
only, 8 epochs, labelled quick in every goal line.
"""
from __future__ import annotations

import dataclasses
import math
import statistics
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np

from .. import config as C
from .predictability import LAGS, gradient_predictability
from .kit import BenchOptions, Column, Goal, SuiteResult, Table, measure_many, suite
from ..data import load_dataset
from ..nn import cross_entropy_loss
from ..optim import make_optimizer
from ..runs import LocalRun
from ..train.build import build_model
from ..train.rows import layer_row
from ..train.predictors import make_predictor

DIGITS_EPOCHS = 40
QUICK_DIGITS_EPOCHS = 8
SYNTH_SAMPLES = 4000
SYNTH_FEATURES = 784
SYNTH_CLASSES = 10
SYNTH_HIDDEN = 1024
SYNTH_EPOCHS = 10
RUN_REPEATS = 3           # default of run_phase_bench; the suite uses opts.repeats (7; quick 3)

GOAL_WALL_X = 1.5         # measured wall-clock speedup over full backprop
GOAL_ACC_PP = 1.0         # |test accuracy - full backprop| in percentage points
#: Optimizer seeds (weight init and batch order) besides the config's own 0 that every goal
#: workload's phase rows and full backprop are also trained with: the goals use the median
#: wall-clock speedup and the mean accuracy difference over seeds 0-19. Why twenty: a test
#: accuracy on digits' 360 test images moves in steps of 0.28 pp and differs by about 1 pp from
#: seed to seed, so the mean of five seeds is +-0.5 pp noise on a 1 pp goal. Measured over 80
#: seeds (one run each): adaptive_phases=False costs -1.1 pp (standard error 0.2) but -0.3 pp on
#: seeds 0-4, which passed it; the defaults make 219-425 backward passes (median 322), seeds 0-4 a
#: median of 372.
SEEDS = tuple(range(1, 20))
SEED_REPEATS = 3          # interleaved runs per extra seed and configuration (train seconds: their median)
QUICK_SEEDS = (1,)


# ----------------------------------------------------------------------------- what runs

@dataclasses.dataclass(frozen=True)
class Workload:
    """A base experiment (phase disabled) and how to describe it; ``goal``: judged by the issue's goals."""

    key: str
    label: str
    config: C.ExperimentConfig
    goal: bool = False


@dataclasses.dataclass(frozen=True)
class Variant:
    """One row: ``phase`` None = full backprop, else PhaseConfig overrides (``prediction.x`` for nested).

    kind: "baseline", "phase" (judged against the goals), "control", "diagnostic" or "storage" (a trend-history
    store other than float32: reported with its bytes, not judged).
    """

    key: str
    label: str
    phase: dict | None
    kind: str = "phase"
    workloads: tuple[str, ...] | None = None   # None: every workload

    def applies_to(self, workload: Workload) -> bool:
        return self.workloads is None or workload.key in self.workloads


VARIANTS: tuple[Variant, ...] = (
    Variant("full", "full backprop", None, kind="baseline"),
    Variant("phase", "phase (defaults)", {}),
    Variant("phase_ls", "phase, least_squares", {"predictor": "least_squares"}),
    Variant("phase_fixed", "phase, adaptive off", {"adaptive_phases": False}),
    Variant("phase_ls_fixed", "phase, least_squares, adaptive off",
            {"predictor": "least_squares", "adaptive_phases": False}),
    Variant("control", "control: predict_steps=0", {"predict_steps": 0}, kind="control"),
    Variant("diag_m0", "diagnostic: momentum=0", {"prediction.momentum": 0.0}, kind="diagnostic",
            workloads=("digits",)),
    Variant("diag_nogain", "diagnostic: learned_gain off", {"prediction.learned_gain": False}, kind="diagnostic",
            workloads=("digits",)),
    *(Variant(f"hist_{pk}{storage}", f"{pl}{storage} trend history", {**over, "history_storage": storage},
              kind="storage", workloads=("digits",))
      for pk, pl, over in (("", "phase, ", {}), ("ls_", "phase, least_squares, ", {"predictor": "least_squares"}))
      for storage in ("ternary", "vsa")),
)
STORED_AS_FLOAT32 = {"momentum": "phase", "least_squares": "phase_ls"}   # the float32 row of each predictor


def digits_workload(epochs: int = DIGITS_EPOCHS) -> Workload:
    """The ExperimentConfig defaults (digits, ternary 64-256-10, Adam 1e-2, batch 64, seed 0), ``epochs`` epochs."""
    cfg = C.ExperimentConfig()
    cfg.optim.epochs = epochs
    return Workload("digits", f"digits 64-256-10 ternary, {epochs} epochs", cfg, goal=True)


def synthetic_workload(epochs: int = SYNTH_EPOCHS, n_samples: int = SYNTH_SAMPLES,
                       n_features: int = SYNTH_FEATURES, hidden: int = SYNTH_HIDDEN,
                       n_classes: int = SYNTH_CLASSES, batch_size: int = 64, goal: bool = False) -> Workload:
    """Synthetic Gaussian-cluster classification, MLP n_features-hidden-n_classes ternary."""
    cfg = C.ExperimentConfig()
    cfg.data.dataset = "synthetic"
    cfg.data.n_samples, cfg.data.n_features, cfg.data.n_classes = n_samples, n_features, n_classes
    cfg.model.hidden = [hidden]
    cfg.optim.epochs = epochs
    cfg.optim.batch_size = batch_size
    label = (f"synthetic {n_features}-{hidden}-{n_classes} ternary, {n_samples} samples, "
             f"{epochs} epochs")
    return Workload("synthetic", label, cfg, goal=goal)


def default_workloads(quick: bool) -> list[Workload]:
    """digits (40 epochs) and synthetic 784-1024-10 (10 epochs); quick: digits, 8 epochs."""
    if quick:
        return [digits_workload(QUICK_DIGITS_EPOCHS)]
    return [digits_workload(), synthetic_workload()]


def variant_config(base: C.ExperimentConfig, variant: Variant, epochs: int | None = None) -> C.ExperimentConfig:
    """A copy of ``base`` with the variant's phase settings (and ``epochs`` if given)."""
    cfg = base.copy()
    if epochs is not None:
        cfg.optim.epochs = epochs
    cfg.phase.enabled = variant.phase is not None
    for name, value in (variant.phase or {}).items():
        target = cfg.phase
        *path, leaf = name.split(".")
        for part in path:
            target = getattr(target, part)
        setattr(target, leaf, value)
    cfg.validate()
    return cfg


# ----------------------------------------------------------------------------- one training

def train_once(cfg: C.ExperimentConfig) -> dict[str, Any]:
    """Train ``cfg`` once (``ql.LocalRun``, joined) and return the numbers the tables need."""
    run = LocalRun(cfg, name="bench-phase")
    run.start()
    run.join()
    res = run.result
    if res is None or res.status != "finished":
        msg = run.message if res is None else (res.message or res.status)
        raise RuntimeError(f"phase bench: training failed ({run.status}): {msg}")
    final = dict(res.final)
    hist = res.history
    cos = np.asarray(hist.get("pred_cosine", []), dtype=np.float64)
    cos = cos[np.isfinite(cos)]
    out = {**final,
           "history_cosine_mean": float(cos.mean()) if cos.size else math.nan,
           "history_cosine_n": int(cos.size),
           "history_cosine_pos_share": float(np.mean(cos > 0)) if cos.size else math.nan,
           "history_cosine_median": float(np.median(cos)) if cos.size else math.nan,
           "phase_stats": dict(run.log.meta.get("phase_stats") or {})}
    res.model = None      # the registry keeps the LocalRun; drop the weights it no longer needs
    return out


# ----------------------------------------------------------------------------- component costs

def component_costs(base: C.ExperimentConfig, opts: BenchOptions) -> dict[str, float]:
    """Seconds per call, measured in isolation on ``base``'s model and one batch: forward+loss,
    backward, optimizer step, each predictor's predict+clip, and one metrics row."""
    data = load_dataset(base.data)
    mlp = build_model(base, data.n_features, data.n_outputs)
    bs = min(base.optim.batch_size, data.n_train)
    steps_per_epoch = math.ceil(data.n_train / bs)
    scratch, grads = mlp.scratch(bs), mlp.gradients(bs)
    opt = make_optimizer(base.optim, mlp.flat_params(), steps_per_epoch)
    xb, yb = np.ascontiguousarray(data.X_train[:bs]), np.ascontiguousarray(data.y_train[:bs])
    cross_entropy_loss(mlp.forward(xb, scratch), yb, grads.d_output_mut())
    mlp.backward(xb, scratch, grads, need_input_grad=False)
    n = mlp.num_params
    rng = np.random.default_rng(0)
    predictors = {}
    for kind in ("momentum", "least_squares"):
        p = make_predictor(kind, n, base.phase.prediction)
        for t in range(len(p.steps)):    # one single-gradient block per step: a full trend history
            p.push(rng.standard_normal(n).astype(np.float32), t)
            p.close_block()
        predictors[kind] = (p, np.empty(n, np.float32), np.empty(n, np.float32), len(p.steps) + 5)

    def fwd_loss():
        cross_entropy_loss(mlp.forward(xb, scratch), yb, grads.d_output_mut())

    def bwd():
        mlp.backward(xb, scratch, grads, need_input_grad=False)

    def predict(kind):     # what a PREDICT step does: prediction + its norm, then the clipping pass
        p, buf, out, step = predictors[kind]
        norm = math.sqrt(p.predict_sumsq(step, buf))
        np.multiply(buf, np.float32(1.0 / (norm + 1e-6)), out=out)

    def metrics_row():
        for i in range(mlp.num_layers):
            layer_row(mlp, grads, scratch, i)

    fns: dict[str, Callable[[], Any]] = {
        "forward_loss": fwd_loss, "backward": bwd, "optimizer": lambda: opt.step(grads.flat()),
        "predict_momentum": lambda: predict("momentum"),
        "predict_least_squares": lambda: predict("least_squares"),
        "metrics_row": metrics_row,
    }
    ms = measure_many(fns, repeats=opts.repeats, warmup=opts.warmup, min_time=opts.min_time)
    return {k: m.median for k, m in ms.items()}


# ----------------------------------------------------------------------------- the suite body

def _median(xs: Sequence[float]) -> float:
    xs = [x for x in xs if x is not None and math.isfinite(x)]
    return statistics.median(xs) if xs else math.nan


def _ideal_speedup(costs: dict[str, float], steps: int, backward: int, predictor: str,
                   metrics_every: int) -> float:
    """Wall-clock speedup of a phase run with these step counts if each step cost only its parts
    (see :func:`_step_costs`)."""
    full, pred = _step_costs(costs, predictor, metrics_every)
    phase = backward * full + (steps - backward) * pred
    return steps * full / phase if phase > 0 else math.nan


def _step_costs(costs: dict[str, float], predictor: str, metrics_every: int) -> tuple[float, float]:
    """(backward step, predicted step) seconds from the components: fwd+loss + bwd + opt, and
    predict + opt + the fwd+loss a PREDICT step runs only when it logs a row (1 in k); both + row/k."""
    m = costs["metrics_row"] / metrics_every
    full = costs["forward_loss"] + costs["backward"] + costs["optimizer"] + m
    pred = costs["forward_loss"] / metrics_every + costs[f"predict_{predictor}"] + costs["optimizer"] + m
    return full, pred


def _max_speedup(costs: dict[str, float], metrics_every: int) -> float:
    """Wall-clock speedup bound if (almost) no step ran a backward pass (momentum predictor)."""
    full, pred = _step_costs(costs, "momentum", metrics_every)
    return full / pred if pred > 0 else math.nan


def _row(workload: Workload, variant: Variant, cfg: C.ExperimentConfig, results: list[dict]) -> dict:
    r0 = results[0]
    secs = [r["train_seconds"] for r in results]
    keys = ("test_accuracy", "test_loss", "steps", "backward_passes")
    deterministic = all(all((r.get(k) == r0.get(k)) or (r.get(k) != r.get(k) and r0.get(k) != r0.get(k))
                            for k in keys) for r in results)
    med = _median(secs)
    idx = min(range(len(secs)), key=lambda i: abs(secs[i] - med))   # the repeat nearest the median
    rep = results[idx]
    ps = rep["phase_stats"]
    steps = int(r0["steps"])
    phase_on = variant.phase is not None
    backward = int(r0.get("backward_passes", steps)) if phase_on else steps
    n_pred = int(ps.get("predict_steps", 0)) if phase_on else 0
    bwd_s, pred_s = float(ps.get("backward_seconds", math.nan)), float(ps.get("predict_seconds", math.nan))
    ms_bwd = 1e3 * bwd_s / backward if phase_on and backward else math.nan
    ms_pred = 1e3 * pred_s / n_pred if phase_on and n_pred else math.nan
    mean_loss = ps.get("mean_loss", {}) if phase_on else {}
    return {
        "workload": workload.key, "variant": variant.key, "label": variant.label, "kind": variant.kind,
        "predictor": cfg.phase.predictor if phase_on else None,
        "adaptive": bool(cfg.phase.adaptive_phases) if phase_on else None,
        "epochs": cfg.optim.epochs, "steps": steps, "backward_passes": backward,
        "step_speedup": steps / backward if backward else math.nan,
        "test_loss": r0["test_loss"], "test_accuracy": r0["test_accuracy"],
        "test_accuracy_pct": 100.0 * r0["test_accuracy"], "train_loss": r0["train_loss"],
        "train_seconds": med, "train_seconds_min": min(secs), "train_seconds_max": max(secs),
        "train_seconds_samples": secs, "seconds_samples": [r["seconds"] for r in results],
        "repeats": len(results), "deterministic": deterministic,
        "wall_estimate": _median([r.get("speedup_wall", math.nan) for r in results]) if phase_on else math.nan,
        "cosine": rep["history_cosine_mean"] if phase_on else math.nan,
        "cosine_n": rep["history_cosine_n"] if phase_on else 0,
        "cosine_pos_share": rep["history_cosine_pos_share"] if phase_on else math.nan,
        "cosine_median": rep["history_cosine_median"] if phase_on else math.nan,
        "cosine_trainer_mean": r0.get("mean_prediction_cosine", math.nan) if phase_on else math.nan,
        "prediction_error": ps.get("mean_prediction_error", math.nan) if phase_on else math.nan,
        "corrections": ps.get("corrections", 0) if phase_on else 0,
        "correction_resets": ps.get("correction_resets", 0) if phase_on else 0,
        "clipped_steps": ps.get("clipped_steps", 0) if phase_on else 0,
        "prediction_gain_end": ps.get("prediction_gain", math.nan) if phase_on else math.nan,
        "history_storage": cfg.phase.history_storage if phase_on else None,
        "history_bytes": ps.get("history_bytes") if phase_on else None,
        "full_length_end": ps.get("full_length") if phase_on else None,
        "predict_length_end": ps.get("predict_length") if phase_on else None,
        "loss_full": mean_loss.get("full", math.nan), "loss_predict": mean_loss.get("predict", math.nan),
        "loss_correct": mean_loss.get("correct", math.nan),
        "ms_per_step": 1e3 * med / steps if steps else math.nan,
        "ms_backward_step": ms_bwd, "ms_predict_step": ms_pred,
        "predict_cost_ratio": ms_pred / ms_bwd if ms_bwd and ms_bwd == ms_bwd else math.nan,
        "seconds_backward_steps": bwd_s if phase_on else math.nan,
        "seconds_predict_steps": pred_s if phase_on else math.nan,
        "seconds_outside_steps": (rep["train_seconds"] - bwd_s - pred_s) if phase_on else math.nan,
        "median_repeat": idx,
        "phase_stats": ps,
    }


def _pct(x: float) -> str:
    return f"{100 * x:.0f}%"


RESULT_COLUMNS = [
    Column("label", "configuration"),
    Column("test_loss", "test loss", "{:.4f}"),
    Column("test_accuracy_pct", "test acc %", "{:.2f}"),
    Column("acc_delta_pp", "Δacc pp", "{:+.2f}"),
    Column("steps", "steps", "{:d}"),
    Column("backward_passes", "backward", "{:d}"),
    Column("step_speedup", "step x", "{:.2f}x"),
    Column("train_seconds", "train s", "{:.2f}"),
    Column("spread", "min..max s"),
    Column("wall_speedup", "wall x", "{:.2f}x"),
    Column("wall_estimate", "est x", "{:.2f}x"),
    Column("cosine", "cos", "{:+.3f}"),
    Column("cosine_pos_share", "cos>0", _pct),
    Column("verdict", "goal"),
]

TIME_COLUMNS = [
    Column("label", "configuration"),
    Column("ms_per_step", "ms/step", "{:.3f}"),
    Column("backward_passes", "bwd steps", "{:d}"),
    Column("ms_backward_step", "ms/bwd step", "{:.3f}"),
    Column("predict_steps", "pred steps", "{:d}"),
    Column("ms_predict_step", "ms/pred step", "{:.3f}"),
    Column("predict_cost_ratio", "pred/bwd", "{:.2f}"),
    Column("outside_pct", "outside %", "{:.0f}"),
    Column("loss_blocks", "loss FULL/pred/CORR"),
    Column("lengths", "F/P at end"),
    Column("ideal_speedup", "ideal x", "{:.2f}x"),
    Column("wall_speedup", "wall x", "{:.2f}x"),
]

COMPONENT_COLUMNS = [
    Column("workload", "workload"),
    Column("forward_loss_ms", "fwd+loss ms", "{:.3f}"),
    Column("backward_ms", "backward ms", "{:.3f}"),
    Column("optimizer_ms", "optimizer ms", "{:.3f}"),
    Column("predict_momentum_ms", "predict mom ms", "{:.3f}"),
    Column("predict_least_squares_ms", "predict LS ms", "{:.3f}"),
    Column("metrics_row_ms", "metrics row ms", "{:.3f}"),
    Column("backward_share", "bwd share of step", _pct),
    Column("full_step_ms", "fwd+bwd+opt ms", "{:.3f}"),
    Column("max_speedup", "max x", "{:.2f}x"),
]


HISTORY_COLUMNS = [
    Column("label", "configuration"),
    Column("history_storage", "stored as"),
    Column("history_bytes", "history bytes", "{:,d}"),
    Column("bytes_ratio", "of float32", _pct),
    Column("acc_delta_pp", "Δacc pp (seed 0)", "{:+.2f}"),
    Column("acc_delta_seeds", "Δacc pp (seeds)", "{:+.2f}"),
    Column("vs_float32_pp", "minus float32's pp", "{:+.2f}"),
    Column("cosine", "cos", "{:+.3f}"),
    Column("wall_speedup", "wall x", "{:.2f}x"),
]


def _history_rows(rows: list[dict]) -> list[dict]:
    """The storage rows after the float32 rows of the same predictors: bytes held, accuracy against full backprop
    (mean over the seeds when measured) and against the same predictor with float32 entries."""
    by = {r["variant"]: r for r in rows}
    stored = [r for r in rows if r["kind"] == "storage" and STORED_AS_FLOAT32[r["predictor"]] in by]
    if not stored:
        return []
    float32 = [by[k] for k in STORED_AS_FLOAT32.values() if k in by]
    out = []
    for r in float32 + stored:
        f32 = by[STORED_AS_FLOAT32[r["predictor"]]]
        acc = r.get("acc_delta_seeds_pp", math.nan)
        out.append({**r, "bytes_ratio": r["history_bytes"] / f32["history_bytes"], "acc_delta_seeds": acc,
                    "vs_float32_pp": acc - f32.get("acc_delta_seeds_pp", math.nan)})
    return out


def _verdict(row: dict) -> str | None:
    if row["kind"] != "phase":
        return None
    return "PASS" if row["goal_passed"] else "MISS"


def _judge(row: dict) -> bool:
    """Wall clock and accuracy, over the seeds when measured: the median of the per-seed wall-clock
    speedups (seed 0: the medians of the main table) and the mean accuracy difference."""
    wall = row.get("wall_speedup_seeds", row["wall_speedup"])
    acc = row.get("acc_delta_seeds_pp", row["acc_delta_pp"])
    return bool(wall >= GOAL_WALL_X and abs(acc) <= GOAL_ACC_PP)


def _seed_rows(wl: Workload, vs: Sequence[Variant], seeds: Sequence[int], rows: list[dict],
               progress: Callable[[str], None] | None) -> tuple[list[dict], list[dict]]:
    """Train the baseline and every phase variant :data:`SEED_REPEATS` times (interleaved) per extra
    seed. Per phase row: the accuracy difference per seed (seed 0 from ``rows``), their mean and
    the worst; the wall-clock speedup per seed (median train seconds of the baseline over the
    variant's, same seed), their median, and the backward passes per seed; also stored in ``rows``.
    Returns (accuracy rows, wall-clock rows)."""
    keep = [v for v in vs if v.kind in ("baseline", "phase", "diagnostic", "storage")]
    runs: dict[str, dict[int, list[dict]]] = {v.key: {sd: [] for sd in seeds} for v in keep}
    for seed in seeds:
        for rep in range(SEED_REPEATS):
            for v in keep:
                if progress:
                    progress(f"{wl.key}: {v.label}, seed {seed}, repeat {rep + 1}/{SEED_REPEATS}")
                cfg = variant_config(wl.config, v)
                cfg.optim.seed = seed
                runs[v.key][seed].append(train_once(cfg))
    base = runs[vs[0].key]
    base_s = {sd: _median([r["train_seconds"] for r in base[sd]]) for sd in seeds}
    acc_rows, wall_rows = [], []
    for v, row in zip(vs, rows):
        if v.kind not in ("phase", "diagnostic", "storage"):
            continue
        mine = runs[v.key]
        deltas = [row["acc_delta_pp"]] + [100.0 * (mine[sd][0]["test_accuracy"] - base[sd][0]["test_accuracy"])
                                          for sd in seeds]
        walls = [row["wall_speedup"]] + [base_s[sd] / _median([r["train_seconds"] for r in mine[sd]])
                                         for sd in seeds]
        backward = [row["backward_passes"]] + [mine[sd][0]["backward_passes"] for sd in seeds]
        row["acc_delta_seeds_pp"] = statistics.fmean(deltas)
        row["acc_delta_worst_pp"] = min(deltas)
        row["acc_delta_per_seed"] = deltas
        row["wall_speedup_seeds"] = statistics.median(walls)
        row["wall_speedup_per_seed"] = walls
        row["backward_passes_per_seed"] = backward
        se = statistics.stdev(deltas) / math.sqrt(len(deltas)) if len(deltas) > 1 else math.nan
        acc_rows.append({"label": v.label, "mean": row["acc_delta_seeds_pp"], "se": se,
                         "median": statistics.median(deltas), "worst": row["acc_delta_worst_pp"], "best": max(deltas),
                         "within": f"{sum(abs(d) <= GOAL_ACC_PP for d in deltas)}/{len(deltas)}"})
        wall_rows.append({"label": v.label, "median": row["wall_speedup_seeds"], "min": min(walls),
                          "max": max(walls), "passing": f"{sum(w >= GOAL_WALL_X for w in walls)}/{len(walls)}",
                          "backward": f"{statistics.median(backward):.0f} ({min(backward)}..{max(backward)})"})
    return acc_rows, wall_rows


def _compare_to_baseline(row: dict, base: dict, phase_on: bool, costs: dict[str, float], metrics_every: int) -> None:
    """A row's columns against full backprop's (``base``), and its time split, added to ``row``."""
    row["acc_delta_pp"] = 100.0 * (row["test_accuracy"] - base["test_accuracy"])
    row["wall_speedup"] = base["train_seconds"] / row["train_seconds"]
    row["spread"] = f"{row['train_seconds_min']:.2f}..{row['train_seconds_max']:.2f}"
    row["predict_steps"] = row["steps"] - row["backward_passes"]
    row["outside_pct"] = (100.0 * row["seconds_outside_steps"] / row["train_seconds_samples"][row["median_repeat"]]
                          if phase_on else math.nan)
    row["loss_blocks"] = (f"{row['loss_full']:.3f}/{row['loss_predict']:.3f}/{row['loss_correct']:.3f}"
                          if phase_on else None)
    row["lengths"] = f"{row['full_length_end']}/{row['predict_length_end']}" if phase_on else None
    row["ideal_speedup"] = _ideal_speedup(costs, row["steps"], row["backward_passes"], row["predictor"] or "momentum",
                                          metrics_every)


def run_phase_bench(workloads: Sequence[Workload], opts: BenchOptions, *, repeats: int = RUN_REPEATS,
                    variants: Sequence[Variant] = VARIANTS, warmup_epochs: int = 1, seeds: Sequence[int] = (),
                    quick: bool = False, progress: Callable[[str], None] | None = None) -> SuiteResult:
    """Train every variant of every workload ``repeats`` times (interleaved), build tables and goals.

    ``opts`` sets the component micro-benchmark (repeats, warmup, min_time); ``warmup_epochs`` 0
    skips the untimed warm-up trainings; ``seeds``: extra optimizer seeds for the accuracy goal of
    goal workloads (see :data:`SEEDS`). Returns the :class:`SuiteResult` the harness prints.
    """
    if repeats < 1:
        raise ValueError(f"repeats: must be >= 1, got {repeats}")
    tag = " [quick]" if quick else ""
    tables: list[Table] = []
    goals: list[Goal] = []
    notes: list[str] = []
    extra: dict[str, Any] = {"repeats": repeats, "quick": quick, "goal_wall_x": GOAL_WALL_X,
                             "goal_acc_pp": GOAL_ACC_PP, "workloads": {}}
    comp_rows = []
    for wl in workloads:
        vs = [v for v in variants if v.applies_to(wl)]
        if not vs or vs[0].phase is not None:
            raise ValueError("variants: the first variant must be full backprop (phase None)")
        cfgs = {v.key: variant_config(wl.config, v) for v in vs}
        if warmup_epochs > 0:
            for v in vs:
                train_once(variant_config(wl.config, v, epochs=min(warmup_epochs, wl.config.optim.epochs)))
        results: dict[str, list[dict]] = {v.key: [] for v in vs}
        for rep in range(repeats):
            for v in vs:
                if progress:
                    progress(f"{wl.key}: {v.label}, repeat {rep + 1}/{repeats}")
                results[v.key].append(train_once(cfgs[v.key]))
        costs = component_costs(wl.config, opts)
        rows = [_row(wl, v, cfgs[v.key], results[v.key]) for v in vs]
        base = rows[0]
        for row, v in zip(rows, vs):
            _compare_to_baseline(row, base, v.phase is not None, costs, wl.config.metrics_every)
        seed_rows, wall_rows = _seed_rows(wl, vs, seeds, rows, progress) if wl.goal and seeds else ([], [])
        for row, v in zip(rows, vs):
            row["goal_passed"] = _judge(row) if v.kind == "phase" else None
            row["verdict"] = _verdict(row)
        tables.append(Table(f"{wl.label}: phase training vs full backprop (medians of {repeats} interleaved "
                            f"runs{tag})", RESULT_COLUMNS, rows))
        tables.append(Table(f"{wl.label}: where the time goes (the median repeat{tag})", TIME_COLUMNS, rows))
        if seed_rows:
            over = f"over optimizer seeds 0-{max(seeds)}" if len(seeds) > 1 else f"over optimizer seeds 0, {seeds[0]}"
            tables.append(Table(f"{wl.label}: test accuracy minus full backprop's, pp, {over} (one run each; "
                                f"seed 0 = the table above; per seed in the JSON){tag}",
                                [Column("label", "configuration"), Column("mean", "mean", "{:+.2f}"),
                                 Column("se", "± s.e.", "{:.2f}"), Column("median", "median", "{:+.2f}"),
                                 Column("worst", "worst", "{:+.2f}"), Column("best", "best", "{:+.2f}"),
                                 Column("within", "seeds within 1 pp")], seed_rows))
            tables.append(Table(f"{wl.label}: wall-clock speedup {over} (medians of {SEED_REPEATS} interleaved "
                                f"runs each; seed 0 = the table above; per seed in the JSON){tag}",
                                [Column("label", "configuration"), Column("median", "median", "{:.2f}x"),
                                 Column("min", "min", "{:.2f}x"), Column("max", "max", "{:.2f}x"),
                                 Column("passing", "seeds >= 1.5x"),
                                 Column("backward", "backward passes: median (min..max)")], wall_rows))
        if history_rows := _history_rows(rows):
            tables.append(Table(f"{wl.label}: where the predictor keeps its trend entries (history_storage): bytes "
                                f"and accuracy{tag}", HISTORY_COLUMNS, history_rows))
        pred = gradient_predictability(wl.config) if wl.goal else None
        if pred is not None:
            tables.append(Table(f"{wl.label}: how far real gradients carry over (full backprop, seed 0, "
                                f"{pred['steps']} steps): mean cosine{tag}",
                                [*[Column(f"lag_{k}", f"g_t vs g_t+{k}", "{:+.3f}") for k in LAGS],
                                 Column("momentum", "momentum formula vs g_t+1", "{:+.3f}")], [pred]))
            notes.append(_why_predictability(wl, pred, tag))
        step_ms = costs["forward_loss"] + costs["backward"] + costs["optimizer"]
        comp = {"workload": wl.key, **{f"{k}_ms": 1e3 * s for k, s in costs.items()},
                "backward_share": costs["backward"] / step_ms if step_ms > 0 else math.nan,
                "full_step_ms": 1e3 * step_ms,
                "max_speedup": _max_speedup(costs, wl.config.metrics_every)}
        comp_rows.append(comp)
        extra["workloads"][wl.key] = {"label": wl.label, "config": wl.config.to_dict(), "component_costs_s": costs,
                                      "gradient_predictability": pred}

        for row in rows:
            if row["kind"] != "phase":
                continue
            seeds_txt = (f"; over {len(seeds) + 1} seeds {row['acc_delta_seeds_pp']:+.1f} pp mean, "
                         f"{row['acc_delta_worst_pp']:+.1f} pp worst" if "acc_delta_seeds_pp" in row else "")
            wall_txt = (f"{row['wall_speedup_seeds']:.2f}x wall-clock median over {len(seeds) + 1} seeds (seed 0 "
                        f"{row['wall_speedup']:.2f}x, " if "wall_speedup_seeds" in row
                        else f"{row['wall_speedup']:.2f}x wall-clock (")
            measured = (wall_txt + f"trainer estimate {row['wall_estimate']:.2f}x, "
                        f"{row['step_speedup']:.2f}x fewer backward passes), {row['acc_delta_pp']:+.1f} pp accuracy "
                        f"({row['test_accuracy_pct']:.1f}% vs {base['test_accuracy_pct']:.1f}%{seeds_txt}), "
                        f"prediction cosine {row['cosine']:+.2f}")
            name = f"{row['label']} on {wl.key}{tag}"
            if wl.goal:
                goals.append(Goal(name, row["goal_passed"], measured,
                                  f"wall-clock >= {GOAL_WALL_X:.1f}x and |Δacc| <= {GOAL_ACC_PP:.0f} pp"
                                  + (" (median and mean over the seeds)" if "acc_delta_seeds_pp" in row else "")))
            else:
                notes.append(f"{row['verdict']} (no goal on this workload; digits rule applied) {name}: {measured}")
        notes.extend(_why(wl, rows, costs, tag))
        if not all(r["deterministic"] for r in rows):
            bad = ", ".join(r["label"] for r in rows if not r["deterministic"])
            notes.append(f"{wl.key}: NOT deterministic across repeats (accuracy/loss/steps differ): {bad}")

    tables.append(Table(f"component costs per call, measured in isolation (batch of one step, medians{tag})",
                        COMPONENT_COLUMNS, comp_rows))
    notes.extend([
        "wall x = full-backprop median train seconds / this row's (measured side by side, same seed, epochs, "
        "data and batch order); train seconds exclude the per-epoch evaluation; est x = PhaseTrainer's estimate",
        "cos = nanmean of history['pred_cosine'] (cosine of predicted vs real gradient on CORRECT steps); "
        "cos>0 = share of corrections with a positive cosine",
        "ms/bwd step and ms/pred step: PhaseTrainer's begin_step..end_step timers, or its runs' time per step "
        "(backward_run, predicted_steps, predict_block_run: its kernel's clock splits the kinds) (forward, "
        "backward or prediction, clipping, optimizer, a CORRECT step's fold); outside % = share of train seconds "
        "outside those (batch gather, metrics rows, loop)",
        "ideal x = speedup a phase run with the same step counts would reach if every step cost only its "
        "components (backward step: fwd+loss+backward+optimizer; predicted: predict+optimizer, plus fwd+loss "
        "on the 1 in metrics_every PREDICT steps that log a row; both + metrics row / metrics_every); "
        "max x = the same with no backward step at all",
        "control: phase loop with predict_steps=0 (every step a real backward pass, PhaseConfig.max_grad_norm "
        "clipping on); full backprop has no clipping (OptimConfig.max_grad_norm = 0)",
    ])
    if quick:
        notes.append(f"QUICK run: digits only, {QUICK_DIGITS_EPOCHS} epochs instead of {DIGITS_EPOCHS}; "
                     "the goal lines are labelled [quick] and are not the issue's measurement")
    extra["component_costs"] = comp_rows
    return SuiteResult(tables=tables, goals=goals, notes=notes, extra=extra)


def _why_predictability(wl: Workload, pred: dict, tag: str) -> str:
    """Note on :func:`~qatlab.bench.predictability.gradient_predictability`'s measurement."""
    lags = ", ".join(f"{pred[f'lag_{k}']:+.2f} at {k}" for k in LAGS)
    return (f"why ({wl.key}{tag}): along full backprop a real minibatch gradient has mean cosine {lags} "
            f"steps ahead (the momentum predictor's formula, one step ahead: {pred['momentum']:+.2f}); a "
            f"predict block needs predictions up to {wl.config.phase.correct_every - 1} steps past the last "
            f"real gradient, where little or none of it carries over")


def _why(wl: Workload, rows: list[dict], costs: dict[str, float], tag: str) -> list[str]:
    """Notes derived from the data: prediction quality and where the time goes, for the defaults row."""
    by = {r["variant"]: r for r in rows}
    d = by.get("phase")
    if d is None:
        return []
    out = [f"why ({wl.key}{tag}): on CORRECT steps the defaults' predicted gradient has mean cosine "
           f"{d['cosine']:+.3f} with the real one (median {d['cosine_median']:+.3f}, positive in "
           f"{_pct(d['cosine_pos_share']) if d['cosine_n'] else '-'} of {d['cosine_n']} logged corrections, "
           f"relative error {d['prediction_error']:.2f}); mean loss FULL {d['loss_full']:.3f} vs predict "
           f"{d['loss_predict']:.3f} vs CORRECT {d['loss_correct']:.3f}; phases adapted to F/P = {d['lengths']}; "
           f"learned gain at the end {d['prediction_gain_end']:.2f}"]
    m0 = by.get("diag_m0")
    if m0 is not None:
        out.append(f"why ({wl.key}{tag}): reusing the last real gradient (momentum=0) gives cosine "
                   f"{m0['cosine']:+.3f} and {m0['acc_delta_pp']:+.1f} pp, so stale gradients, not only the "
                   f"extrapolation, point away from the real gradient")
    ng = by.get("diag_nogain")
    if ng is not None and "acc_delta_seeds_pp" in ng:
        out.append(f"why ({wl.key}{tag}): without the learned gain the defaults' predictions are applied as they "
                   f"are: {ng['acc_delta_seeds_pp']:+.1f} pp mean over the seeds (worst "
                   f"{ng['acc_delta_worst_pp']:+.1f} pp) vs {d.get('acc_delta_seeds_pp', d['acc_delta_pp']):+.1f} pp "
                   f"with it, {ng['wall_speedup']:.2f}x wall-clock")
    ctrl = by.get("control")
    if ctrl is not None:
        out.append(f"why ({wl.key}{tag}): the phase loop without prediction (control) runs at "
                   f"{ctrl['wall_speedup']:.2f}x of full backprop with {ctrl['acc_delta_pp']:+.1f} pp accuracy "
                   f"(loop overhead and clipping alone)")
    step = costs["forward_loss"] + costs["backward"] + costs["optimizer"]
    if step > 0 and d["ms_backward_step"] == d["ms_backward_step"]:
        out.append(f"why ({wl.key}{tag}): a predicted step costs {d['ms_predict_step']:.3f} ms vs "
                   f"{d['ms_backward_step']:.3f} ms for a backward step ({d['predict_cost_ratio']:.2f}); in "
                   f"isolation the backward pass is {_pct(costs['backward'] / step)} of fwd+bwd+optimizer, so "
                   f"with {d['step_speedup']:.2f}x fewer backward passes the ideal wall-clock speedup is "
                   f"{d['ideal_speedup']:.2f}x (and {_max_speedup(costs, wl.config.metrics_every):.2f}x even "
                   f"with no backward pass at all); measured {d['wall_speedup']:.2f}x")
    return out


@suite("phase", description="phase training vs full backprop: accuracy, backward passes, measured wall clock")
def run(opts: BenchOptions) -> SuiteResult:
    """Run the phase suite (see the module docstring) and return its tables and goals."""
    return run_phase_bench(default_workloads(opts.quick), opts, repeats=opts.repeats, quick=opts.quick,
                           seeds=QUICK_SEEDS if opts.quick else SEEDS)
