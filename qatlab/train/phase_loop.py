"""Phase training inside the generic loop: one PhaseTrainer drives an Mlp's steps.

On WARMUP / FULL / CORRECT steps the batch is split into ``gradient_accumulation``
micro-batches, each gets a real backward pass and is recorded; the mean (clipped)
is what the optimizer sees. On PREDICT steps only the forward runs (for the
loss); the backward pass is skipped and the predicted gradient is used instead.
The gradients land in the model's flat gradient buffer, so the optimizer call is
the same in both modes.
"""
from __future__ import annotations

import math

import numpy as np

from ..config import PhaseConfig
from .phase import PhaseTrainer

# PhaseTrainer.step_metrics() key -> MetricsLog column (the dashboard reads these names).
_COLUMNS = {"phase": "phase", "backward_passes": "backward_passes", "step_speedup": "speedup_steps",
            "wallclock_speedup": "speedup_wall", "prediction_error": "pred_error",
            "prediction_cosine": "pred_cosine", "full_length": "full_len", "predict_length": "predict_len"}


class PhaseStepper:
    """Runs one training step of ``mlp`` in phase mode; see the module doc."""

    def __init__(self, cfg: PhaseConfig, mlp, scratch, grads, loss_fn):
        self.trainer = PhaseTrainer(mlp.param_shapes(), cfg)
        self.k = cfg.gradient_accumulation
        self.mlp, self.scratch, self.grads, self.loss_fn = mlp, scratch, grads, loss_fn
        self.grad_views = dict(grads.parameters())   # views into grads.flat()
        self._last_correction_step = -1

    def step(self, xb: np.ndarray, yb: np.ndarray, update) -> float:
        """Forward (and, unless PREDICT, backward) on the batch, then ``update(flat_grads)``.

        Returns the batch loss. A non-finite loss returns at once without updating and leaves
        the step open: the run ends as diverged (call ``trainer.reset()`` to reuse the trainer).
        """
        info = self.trainer.begin_step()
        mlp, scratch, grads = self.mlp, self.scratch, self.grads
        if info.needs_backward:
            total = 0.0
            parts = ((xb, yb),) if self.k == 1 else zip(np.array_split(xb, self.k), np.array_split(yb, self.k))
            for xm, ym in parts:
                y = mlp.forward(xm, scratch)
                loss = self.loss_fn(y, ym, grads.d_output_mut())
                if not math.isfinite(loss):
                    return loss
                mlp.backward(xm, scratch, grads, need_input_grad=False)
                self.trainer.record_full_gradients(self.grad_views)
                total += loss * len(xm)
            loss = total / len(xb)
            self.trainer.gradients_for_update(out=self.grad_views)
        else:
            loss = self.loss_fn(mlp.forward(xb, scratch), yb)
            if not math.isfinite(loss):
                return loss
            self.trainer.get_predicted_gradients(out=self.grad_views)
        update(grads.flat(), info.needs_backward)
        self.trainer.end_step(loss)
        return loss

    def metrics(self) -> dict:
        """Phase columns for the metrics row; prediction error/cosine only right after a correction."""
        raw = self.trainer.step_metrics()
        row = {_COLUMNS[k]: v for k, v in raw.items() if k in _COLUMNS}
        corrections = self.trainer.get_stats().corrections
        if corrections == self._last_correction_step:
            row.pop("pred_error"), row.pop("pred_cosine")
        self._last_correction_step = corrections
        return row

    def final(self) -> dict:
        """Summary numbers for RunResult.final."""
        s = self.trainer.get_stats()
        return {"backward_passes": s.backward_passes, "speedup_steps": s.speedup_ratio,
                "speedup_wall": s.wallclock_speedup, "mean_prediction_cosine": s.mean_prediction_cosine}

    def stats_dict(self) -> dict:
        """The full TrainerStats as a plain dict."""
        return self.trainer.get_stats().to_dict()
