"""The named structures the fused training kernels (:mod:`qatlab.kernels.fused`) take.

A kernel takes each one as a plain tuple in this field order and names it on entry
(``net = Net(*net)``): Numba types a plain tuple of arrays in C when it dispatches a call, a
namedtuple field by field in Python, a few microseconds a call. Build them with these classes and
pass ``tuple(...)`` of them (:meth:`FusedStep` does).
"""
from __future__ import annotations

from typing import NamedTuple

import numpy as np


class Net(NamedTuple):
    """A dense MLP's arrays, one entry per layer i in each tuple."""

    act: int                # hidden activation code (qatlab.kernels.dense)
    ternary: np.ndarray     # int64 (L,): 1 = absmean ternary weights, 0 = float
    stes: np.ndarray        # int64 (L,): each ternary layer's STE code
    alphas: np.ndarray      # float32 (L,): receives each ternary layer's alpha
    ws: tuple               # latent weights (out, in)
    bs: tuple               # biases (out,)
    wqs: tuple              # the weights used (out, in): ws[i] itself for a float layer
    dws: tuple              # weight gradients (out, in), views of g
    dbs: tuple              # bias gradients (out,), views of g
    p: np.ndarray           # float32 (n,): every parameter, flat (ws and bs are views of it)
    g: np.ndarray           # float32 (n,): every gradient, flat


class Activations(NamedTuple):
    """Activations at one batch size B: per layer i, outputs hs[i] and deltas ds[i], both (B, out)."""

    hs: tuple
    ds: tuple               # ds[-1] receives dL/dy


class Opt(NamedTuple):
    """The optimizer (:meth:`qatlab.optim.Optimizer.fused_kernel`): 0 SGD, 1 momentum, 2 Adam, and its state."""

    kind: int
    state0: np.ndarray      # float32 (n,) or (0,) when unused
    state1: np.ndarray


class Batches(NamedTuple):
    """Where a run's batches come from (rows of a training split) and are gathered to."""

    X: np.ndarray           # float32 (n, in)
    Y: np.ndarray           # int64 (n,) labels, or (0,) with targets
    T: np.ndarray           # float32 (n, K) targets, or (0, K) with labels
    idx: np.ndarray         # int64 (steps * B,): batch j is rows idx[j*B:(j+1)*B]
    mse_loss: bool          # MSE (against T, or one-hot rows of Y), else softmax cross-entropy
    xb: np.ndarray          # float32 (B, in): receives each batch
    labels: np.ndarray      # int64 (B,): its labels (with Y)
    targets: np.ndarray     # float32 (B, K): its MSE targets


class Stash(NamedTuple):
    """The real gradient kept after each UPDATE step (phase training's backward steps)."""

    stash: np.ndarray       # float32 (n,) or (0,): none
    clip: float             # > 0: the update's gradient scaled to global norm <= clip
    acc: np.ndarray         # float32 (n,) or (0,): each stashed gradient added to it
    acc_fresh: bool         # the first one is copied into acc instead


class RunOut(NamedTuple):
    """Per step j of a run: its loss, rows predicted right, optimizer norm and stashed sum of squares."""

    losses: np.ndarray      # float64 (steps,)
    correct: np.ndarray     # int64 (steps,)
    norms: np.ndarray       # float64 (steps,)
    sumsqs: np.ndarray      # float64 (steps,)


class Predictor(NamedTuple):
    """Phase training's predictor state (:class:`qatlab.train.predictors.GradientPredictor`), updated in place."""

    anchor: np.ndarray      # float32 (n,): the last real gradient g1
    staging: np.ndarray     # float32 (n,): where a CORRECT step's real gradient goes (then swapped in)
    trend: np.ndarray       # float32 (n,)
    corr: np.ndarray        # float32 (n,): the learned correction, folded in place
    pred: np.ndarray        # float32 (n,): a CORRECT step's prediction
    scores: np.ndarray      # float64 (4,): its comparison with the real gradient
    state: np.ndarray       # float64 (len(PREDICTOR_STATE),), in/out


class BlockPlan(NamedTuple):
    """Which steps a predict block makes and how it folds and clips (see predict_block)."""

    first: int              # the run index of its first step
    pos: int                # that step's block position (1-based)
    every: int              # the CORRECT spacing's cap
    has_trend: bool
    decay: float
    weight: float
    threshold: float
    learn_gain: bool
    max_norm: float
    clip: float
    rows: np.ndarray        # int64 (r,), increasing: the steps that log a metrics row


class Schedule(NamedTuple):
    """The optimizer steps of a run: scalars made per update from its constants and learning rates."""

    consts: tuple           # Optimizer.fused_constants()
    t0: int                 # the optimizer's step before the run
    lrs: np.ndarray         # float64 (steps,): learning rate of update u
    scs: np.ndarray         # float64 (steps, 8) scratch: each update's scalars
    ks: np.ndarray          # float64 (steps,) scratch
    cs: np.ndarray          # float64 (steps,) scratch


class BlockOut(NamedTuple):
    """What a predict block reports (slots and columns named in qatlab.kernels.fused)."""

    result: np.ndarray      # float64 (len(BLOCK_RESULT),)
    corrections: np.ndarray     # float64 (steps, len(CORRECTION_COLUMNS))
    row_out: np.ndarray     # float64 (rows, len(ROW_COLUMNS))
    row_sums: np.ndarray    # float64 (rows, LAYER_SUMS * layers)
