"""Sidebar: experiment config widgets (built from the Param configs), run buttons, keep-alive switch.

Widgets come from ``pn.Param`` over the session's :class:`~qatlab.config.ExperimentConfig`
sub-configs, so bounds and docs are the engine's own: an out-of-range value is
refused by the widget. Rules spanning several fields are checked by
``config.validate()`` when a button is pressed; a ``ValueError`` becomes a
notification (and the inline alert ``qatlab-config-error``), never a traceback.

Stable labels: buttons ``Start``, ``Stop``, ``Pause``, ``Resume``, ``Compare STE kinds``;
checkbox ``Keep running after this page closes``. The panel holds no training
logic: button clicks call the handlers the Dashboard passes in.
"""
from __future__ import annotations

import panel as pn

from ..config import ExperimentConfig

INT = pn.widgets.IntInput
FLOAT = pn.widgets.FloatInput

# Per sub-config: (card title, parameters shown, widget overrides, collapsed?)
SECTIONS = {
    "data": ("Dataset", ["dataset", "test_fraction", "seed", "n_samples", "n_features", "n_classes", "path"],
             {"seed": INT, "n_samples": INT, "n_features": INT, "n_classes": INT}, True),
    "model": ("Model", ["hidden", "activation"],
              {"hidden": {"label": "Hidden sizes (list)"}}, False),
    "quant": ("Quantization", ["weights", "weight_bits", "activations", "activation_bits", "symmetric", "per_channel",
                               "scale_mode", "ste", "activation_ste"],
              {"ste": {"type": pn.widgets.Select, "label": "STE"},
               "activation_ste": {"type": pn.widgets.Select, "label": "Activation STE"},
               "scale_mode": {"type": pn.widgets.Select, "label": "Scale (observer / LSQ)"}}, False),
    "optim": ("Optimizer", ["optimizer", "lr", "schedule", "epochs", "batch_size", "seed", "momentum",
                            "weight_decay", "max_grad_norm", "loss"],
              {"lr": {"type": FLOAT, "label": "Learning rate", "start": 1e-7, "end": 1e3, "step": 1e-3,
                      "format": "0.[000000]"},
               "epochs": INT, "batch_size": INT, "seed": INT, "weight_decay": FLOAT,
               "max_grad_norm": {"type": FLOAT, "label": "Max grad norm (0 = off)"}}, False),
    "phase": ("Phase training", ["enabled", "warmup_steps", "full_steps", "predict_steps", "correct_every",
                                 "adaptive_phases", "loss_threshold", "predictor", "gradient_accumulation",
                                 "max_grad_norm"],
              {"gradient_accumulation": INT}, True),
}


class ConfigPanel(pn.viewable.Viewer):
    """Experiment config widgets plus run buttons for the sidebar.

    Args:
        config: the session's editable ExperimentConfig (a fresh default one if None).
        on_start, on_stop, on_compare, on_pause, on_resume: zero-argument handlers.
    """

    def __init__(self, config: ExperimentConfig | None = None, on_start=None, on_stop=None, on_compare=None,
                 on_pause=None, on_resume=None, **params):
        super().__init__(**params)
        self.config = config if config is not None else ExperimentConfig()
        self.start_button = pn.widgets.Button(label="Start", color="primary", sizing_mode="stretch_width")
        self.stop_button = pn.widgets.Button(label="Stop", color="danger", sizing_mode="stretch_width")
        self.pause_button = pn.widgets.Button(label="Pause", sizing_mode="stretch_width")
        self.resume_button = pn.widgets.Button(label="Resume", sizing_mode="stretch_width")
        self.compare_button = pn.widgets.Button(label="Compare STE kinds", color="success",
                                                sizing_mode="stretch_width")
        self.keep_alive = pn.widgets.Checkbox(label="Keep running after this page closes", value=False)
        self.error = pn.pane.Alert("", alert_type="danger", visible=False, css_classes=["qatlab-config-error"],
                                   sizing_mode="stretch_width", margin=(5, 10))
        for button, handler in ((self.start_button, on_start), (self.stop_button, on_stop),
                                (self.compare_button, on_compare), (self.pause_button, on_pause),
                                (self.resume_button, on_resume)):
            if handler is not None:
                button.on_click(lambda _e, h=handler: h())
        self.param_panes = {}
        cards = []
        for key, (title, params_shown, widgets, collapsed) in SECTIONS.items():
            sub = getattr(self.config, key)
            pane = pn.Param(sub, parameters=params_shown, widgets=widgets, show_name=False,
                            sizing_mode="stretch_width", name=title)
            if key == "optim":
                extra = pn.Param(self.config, parameters=["metrics_every"], show_name=False,
                                 widgets={"metrics_every": {"type": INT, "label": "Metrics every (steps)"}},
                                 sizing_mode="stretch_width")
                pane = pn.Column(pane, extra, sizing_mode="stretch_width")
            self.param_panes[key] = pane
            cards.append(pn.Card(pane, title=title, collapsed=collapsed, sizing_mode="stretch_width",
                                 margin=(4, 0)))
        self.cards = pn.Column(*cards, sizing_mode="stretch_width")
        self.buttons = pn.Column(
            pn.Row(self.start_button, self.stop_button, sizing_mode="stretch_width"),
            pn.Row(self.pause_button, self.resume_button, sizing_mode="stretch_width"),
            self.compare_button, self.keep_alive, self.error, sizing_mode="stretch_width")

    def validated(self) -> ExperimentConfig | None:
        """A copy of the config if ``validate()`` accepts it; otherwise notify and return None."""
        try:
            self.config.validate()
            cfg = self.config.copy()
        except (ValueError, TypeError) as exc:
            self.notify_error(str(exc))
            return None
        self.error.visible = False
        return cfg

    def notify_error(self, message: str) -> None:
        """Show ``message`` as a toast (server sessions) and in the inline alert."""
        self.error.object = message
        self.error.visible = True
        if pn.state.notifications is not None:
            pn.state.notifications.error(message, duration=8000)

    def __panel__(self):
        return pn.Column(self.buttons, self.cards, sizing_mode="stretch_width")
