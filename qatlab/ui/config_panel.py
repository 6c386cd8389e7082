"""Sidebar: experiment config fields (one per Param of the session's configs), run buttons, keep-alive switch.

Every field is a :class:`~qatlab.ui.fields.Field`: what is typed is parsed and checked against
the Param's bounds where it is typed, and only a value the config can hold is assigned; otherwise
the field shows why (its label and allowed range) and the config keeps its value. After every
edit the whole config's ``validate()`` runs too; a rule it breaks shows under the field it names
(``ModelConfig.hidden[0]: ...``) or, naming none, in the alert ``qatlab-config-error``. While
anything is invalid, ``Start`` and ``Compare STE kinds`` are disabled and the alert lists why
(``Compare STE kinds`` also until the page's comparison figures are built: :meth:`ConfigPanel.set_compare_ready`).
A press of either runs its handler once: presses within :data:`DEBOUNCE_S` of it, or queued
while it ran and the page updated (a double click), are dropped.

Fields are built from each sub-config's Params in declaration order (new Params show up by
themselves) and shown only when they apply (a field hidden while it holds an invalid text shows
the config's value again): :data:`SHOWN_WHEN`, phase fields only with phase
training on, and any Param whose doc starts ``<value> only:`` (e.g. ``Synthetic only:``, ``cnn
only:``) only while a Selector of its config has that value. Data files come by upload or from the
server's data directory (:mod:`qatlab.ui.data_source`); a typed server path is never taken.

Stable labels: buttons ``Start``, ``Stop``, ``Pause``, ``Resume``, ``Compare STE kinds``;
checkbox ``Keep running after this page closes``. The panel holds no training logic: button
clicks call the handlers the Dashboard passes in.
"""
from __future__ import annotations

import math
import os
import re
import time

import panel as pn
import param

from .. import data as qdata
from ..config import ExperimentConfig, dashboard_config
from .base import NO_AUTOLINKS, note_press, one_message
from .data_source import NONE, DataFileChooser
from .fields import Field, as_text, short_error, supported

DEBOUNCE_S = 0.5      # a second press this soon after the first is part of a double click
QUEUED_S = 0.2

# (config attribute, card title, collapsed?)
SECTIONS = [("data", "Dataset", False), ("model", "Model", False), ("quant", "Quantization", False),
            ("optim", "Optimizer", False), ("phase", "Phase training", True)]
_SECTION_KEYS = {key for key, _, _ in SECTIONS}
NOT_SHOWN = {"name", "data.path"}        # path: set by the data file chooser, never typed
LABELS = {
    "data.seed": "Split seed",
    "model.hidden": "Hidden sizes (list)",
    "quant.ste": "STE",
    "quant.activation_ste": "Activation STE",
    "quant.scale_mode": "Scale (observer / LSQ)",
    "optim.lr": "Learning rate",
    "optim.max_grad_norm": "Max grad norm (0 = off)",
    "phase.max_grad_norm": "Phase max grad norm (0 = off)",
    "metrics_every": "Metrics every (steps)",
}


def _fake(c):
    return c.quant.weights == "fake"


def _act(c):
    return c.quant.activations != "off"


FIXED_SPLIT = {"mnist1d", "fashion_mnist"}     # published train/test splits: no test_fraction, no split seed


def _split(c):
    return c.data.dataset not in FIXED_SPLIT


SHOWN_WHEN = {
    "data.test_fraction": _split, "data.seed": _split,
    "quant.weight_bits": _fake, "quant.symmetric": _fake, "quant.per_channel": _fake, "quant.scale_mode": _fake,
    "quant.ste": lambda c: c.quant.weights != "float",
    "quant.activation_bits": _act, "quant.activation_ste": _act,
    "optim.momentum": lambda c: c.optim.optimizer == "momentum",
}
SECTION_SWITCH = {"phase": "enabled"}   # the section's other fields show only while this is on

_ONLY = re.compile(r"^\W*([\w][\w /,-]*?)\s+only\b", re.IGNORECASE)
_NAMED = re.compile(r"\b(\w+)\.(\w+)")


def doc_rule(sub, name: str):
    """``cfg -> bool`` from a doc starting ``<value>[/<value>] only:``, or None (always shown)."""
    m = _ONLY.match(sub.param[name].doc or "")
    if m is None:
        return None
    values = {v for v in re.split(r"[\s/,]+|\bor\b", m.group(1).lower()) if v}
    for other in sub.param:
        p = sub.param[other]
        objects = getattr(p, "objects", None)
        if other != name and isinstance(objects, list) and values & {str(o).lower() for o in objects}:
            return lambda _c, s=sub, o=other: str(getattr(s, o)).lower() in values
    return None


class ConfigPanel(pn.viewable.Viewer):
    """Experiment config fields plus run buttons for the sidebar.

    Args:
        config: the session's editable ExperimentConfig (a fresh default one if None).
        on_start, on_stop, on_compare, on_pause, on_resume: zero-argument handlers.
        data_dir: the server's data directory (default ``$QATLAB_DATA_DIR``).

    ``fields`` maps ``"optim.lr"``-style keys to :class:`Field`; ``problems`` lists what keeps
    Start disabled (empty when the config is valid).
    """

    def __init__(self, config: ExperimentConfig | None = None, on_start=None, on_stop=None, on_compare=None,
                 on_pause=None, on_resume=None, data_dir: str | None = None, **params):
        super().__init__(**params)
        self.config = config if config is not None else dashboard_config()
        self.start_button = pn.widgets.Button(label="Start", color="primary", sizing_mode="stretch_width")
        self.stop_button = pn.widgets.Button(label="Stop", color="danger", sizing_mode="stretch_width")
        self.pause_button = pn.widgets.Button(label="Pause", sizing_mode="stretch_width")
        self.resume_button = pn.widgets.Button(label="Resume", sizing_mode="stretch_width")
        self.compare_button = pn.widgets.Button(label="Compare STE kinds", color="success",
                                                sizing_mode="stretch_width")
        self.keep_alive = pn.widgets.Checkbox(label="Keep running after this page closes", value=False)
        self.error = pn.pane.Alert("", alert_type="danger", visible=False, css_classes=["qatlab-config-error"],
                                   sizing_mode="stretch_width", margin=(5, 10), renderer_options=NO_AUTOLINKS)
        self._quiet_until = 0.0
        for button, handler, once in ((self.start_button, on_start, True), (self.stop_button, on_stop, False),
                                      (self.compare_button, on_compare, True), (self.pause_button, on_pause, False),
                                      (self.resume_button, on_resume, False)):
            if handler is not None:
                button.on_click(self._pressed(self._debounced(handler) if once else (lambda _e, h=handler: h())))
        self.problems: list[str] = []
        self.compare_ready = True    # False while the page's comparison figures are prepared (set_compare_ready)
        self._building = True
        self.fields: dict[str, Field] = {}
        self.rules = {}
        self.file_chooser = DataFileChooser(self.config.data, data_dir=data_dir, on_change=self._changed)
        self.dataset_card = pn.pane.Markdown("", css_classes=["qatlab-dataset-card"], sizing_mode="stretch_width",
                                             margin=(0, 10), styles={"font-size": "12px"})
        self.file_chooser.on_shown = self._lay_out
        self._contents = {key: self._section(key) for key, _, _ in SECTIONS}   # every view of a card, in order
        self._laid: set[int] = set()      # ids of the views in the page (shown at least once)
        self._dirty: set[str] = set()     # cards whose laid-out views changed, not yet sent
        self._batching = False            # inside _changed: cards are updated once, at its end
        self._cards = {key: pn.Card(title=title, collapsed=collapsed, sizing_mode="stretch_width", margin=(4, 0))
                       for key, title, collapsed in SECTIONS}
        self._filled = {key for key, _, collapsed in SECTIONS if not collapsed}   # a collapsed card fills when opened
        for key in set(self._cards) - self._filled:
            self._cards[key].param.watch(lambda e, k=key: self._fill(k) if not e.new else None, "collapsed")
        self.cards = pn.Column(*self._cards.values(), sizing_mode="stretch_width")
        self.buttons = pn.Column(
            pn.Row(self.start_button, self.stop_button, sizing_mode="stretch_width"),
            pn.Row(self.pause_button, self.resume_button, sizing_mode="stretch_width"),
            self.compare_button, self.keep_alive, self.error, sizing_mode="stretch_width")
        self._building = False
        self._lay_out(self.dataset_card)
        self._changed()

    # ---------------------------------------------------------------- building
    def _field(self, obj, key: str, name: str) -> Field:
        path = f"{key}.{name}" if key else name
        field = Field(obj, name, label=LABELS.get(path), on_change=self._changed)
        field.on_shown = self._lay_out
        self.fields[path] = field
        rule = SHOWN_WHEN.get(path) or doc_rule(obj, name)
        switch = SECTION_SWITCH.get(key)
        if switch is not None and name != switch:
            rule = (lambda c, r=rule, o=obj, s=switch: bool(getattr(o, s)) and (r is None or r(c)))
        if rule is not None:
            self.rules[path] = rule
        return field

    def _section(self, key: str) -> list:
        sub = getattr(self.config, key)
        views = []
        for name in sub.param:
            if f"{key}.{name}" in NOT_SHOWN or name in NOT_SHOWN or not supported(sub.param[name]):
                continue
            views.append(self._field(sub, key, name))
            if key == "data" and name == "dataset":
                views += [self.dataset_card, self.file_chooser]
        if key == "optim":
            views.append(self._field(self.config, "", "metrics_every"))
        return views

    # ---------------------------------------------------------------- layout
    def _lay_out(self, *parts) -> None:
        """Put the shown views of ``parts`` (Fields, the file chooser: widgets and error line; or
        panes) in the page, in their card's order. A view is laid out once first shown: a hidden
        field, an error line, the upload box build no Bokeh models when a page opens."""
        views = []
        for part in parts:
            if isinstance(part, pn.viewable.Viewable):
                views.append(part)
            else:
                views += [*(part.views if part.visible else ()), *((part.message,) if part.message_shown else ())]
        new = {id(v) for v in views} - self._laid
        if not new:
            return
        self._laid |= new
        self._dirty |= {key for key in self._filled if any(id(v) in new for v in _views(self._contents[key]))}
        if not (self._building or self._batching):
            self._flush()

    def _flush(self) -> None:
        dirty, self._dirty = self._dirty, set()
        for key in dirty:
            self._fill(key)

    def _fill(self, key: str) -> None:
        """Show card ``key``'s laid-out views (a collapsed card is filled when first opened)."""
        self._filled.add(key)
        shown = [v for v in _views(self._contents[key]) if id(v) in self._laid]
        card = self._cards[key]
        if len(shown) != len(card.objects) or any(a is not b for a, b in zip(shown, card.objects)):
            card.objects = shown

    # ---------------------------------------------------------------- checking
    def _parts(self):
        return [*self.fields.values(), self.file_chooser]

    def _changed(self, *_):
        """After any edit: find what is invalid, show it, enable or disable Start / Compare, show the fields that apply."""
        if self._building:
            return
        self._batching = True
        try:
            self._check()
        finally:
            self._batching = False
        self._lay_out(*self._parts())
        self._flush()

    def _check(self) -> None:
        """The body of :meth:`_changed` (fields shown, errors, Start enabled)."""
        self._apply_rules()
        own = [p.error for p in self._parts() if p.error]
        rule = None
        if not own:
            try:
                self.config.validate()
            except (ValueError, TypeError) as exc:
                rule = short_error(exc)
        named = self._part_named(rule) if rule else None
        for part in self._parts():
            part.set_rule_error(f"{part.label}: {rule}" if part is named else None)
        if named is not None and not named.visible:
            named.visible = True      # e.g. per_channel still on after weights left 'fake': show it to fix it
        self.problems = own + ([rule] if rule else [])
        self.start_button.disabled = bool(self.problems)
        self.compare_button.disabled = bool(self.problems) or not self.compare_ready
        if self.problems:
            self.error.object = "**Start is disabled until this is fixed:**\n\n" + "\n".join(
                f"- {_md(p)}" for p in self.problems)
        self.error.visible = bool(self.problems)

    def set_compare_ready(self, ready: bool) -> None:
        """Hold ``Compare STE kinds`` disabled until ``ready`` (the Dashboard: until the comparison tab's
        figures are in the page); it is also disabled while the config is invalid."""
        self.compare_ready = bool(ready)
        self.compare_button.disabled = bool(self.problems) or not self.compare_ready

    def _part_named(self, message: str):
        """The field a rule's message names (``ModelConfig.hidden[0]: ...``, ``phase.gradient_accumulation: ...``)."""
        for a, b in _NAMED.findall(message.split(":", 1)[0]):
            for part in self._parts():
                if part.key == f"{a}.{b}":
                    return part
            if f"{a}.{b}" in self.fields:
                return self.fields[f"{a}.{b}"]
        return None

    def _apply_rules(self) -> None:
        for path, rule in self.rules.items():
            field = self.fields[path]
            field.visible = rule(self.config)
            if not field.visible and field.error:
                field.revert()
        dataset = self.config.data.dataset
        self.file_chooser.visible = dataset == "file"
        self.dataset_card.object = card_markdown(qdata.DATASET_CARDS.get(dataset))
        self.dataset_card.visible = bool(self.dataset_card.object)

    # ---------------------------------------------------------------- buttons
    @staticmethod
    def _pressed(click):
        """``click``, after noting the press (figures being built wait for presses: :func:`note_press`),
        its page updates sent as one message (:func:`one_message`)."""
        @one_message
        def noted(event):
            note_press()
            click(event)
        return noted

    def _debounced(self, handler):
        """Click handler running ``handler`` once per press (not while one runs, not within DEBOUNCE_S after)."""
        def click(_event):
            pressed = time.monotonic()
            if pressed < self._quiet_until:
                return
            self._quiet_until = math.inf
            try:
                handler()
            finally:
                self._reopen_after(pressed)
        return click

    def _reopen_after(self, pressed: float) -> None:
        """Accept presses again once this one's page update has gone out (in a server session: on the
        next event-loop turn) and QUEUED_S more have passed, and not before DEBOUNCE_S after it:
        a click queued while the handler ran and the page updated is then dropped."""
        def reopen():
            self._quiet_until = max(pressed + DEBOUNCE_S, time.monotonic() + QUEUED_S)
        doc = pn.state.curdoc
        if doc is not None and getattr(doc, "session_context", None) is not None:
            doc.add_next_tick_callback(reopen)
        else:
            reopen()

    def load_config(self, cfg: ExperimentConfig) -> None:
        """Put ``cfg``'s values into the fields as if typed (each field and then the whole config are
        checked again), and its other settings (nested phase settings) into the config.

        A data file comes only from what the page may use: a file of the server's data directory
        is chosen in its list, the file the sidebar already uses is kept; any other path is not
        taken (the page never takes a server path), so the Data file field asks for a file."""
        if not isinstance(cfg, ExperimentConfig):
            raise TypeError(f"cfg: expected an ExperimentConfig, got {type(cfg).__name__}")
        self._building = True        # one check and one layout at the end, not one per field
        try:
            for key in [s for s, _, _ in SECTIONS] + [""]:
                self._load_section(getattr(cfg, key) if key else cfg, getattr(self.config, key) if key else self.config,
                                   key)
        finally:
            self._building = False
        self._load_data_file(cfg.data)
        self._changed()

    def _load_section(self, source, target, key: str) -> None:
        for name in source.param:
            path = f"{key}.{name}" if key else name
            if name == "name" or path == "data.path" or (not key and name in _SECTION_KEYS):
                continue
            value = getattr(source, name)
            field = self.fields.get(path)
            if field is not None and field.typed:
                text = as_text(field.p, value)
                field.widget.param.update(value=text, value_input=text)
                field.set_text(text)
            elif field is not None:
                field.widget.value = value
            elif isinstance(value, param.Parameterized):     # nested settings without fields: copied
                getattr(target, name).param.update(**{n: v for n, v in value.param.values().items() if n != "name"})
            elif supported(source.param[name]):
                setattr(target, name, value)

    def _load_data_file(self, data) -> None:
        """The data file of a loaded config (see :meth:`load_config`)."""
        chooser, path = self.file_chooser, data.path
        if data.dataset != "file" or not path or path == self.config.data.path:
            return
        if chooser.data_dir is not None:
            name = os.path.relpath(os.path.realpath(path), os.path.realpath(chooser.data_dir)).replace(os.sep, "/")
            if name in chooser.choice.options and name != NONE:
                chooser.choice.value = name          # as if chosen in the list (resolved and checked again)
                return
        self.config.data.path = ""                   # not offered to the page: validate() names the Data file field
        chooser.show_using()

    def validated(self) -> ExperimentConfig | None:
        """A copy of the config if every field holds what was typed and ``validate()`` accepts it;
        otherwise notify and return None."""
        self._changed()
        if self.problems:
            self.notify_error(self.problems[0])
            return None
        try:
            cfg = self.config.copy()
            cfg.validate()
        except (ValueError, TypeError) as exc:
            self.notify_error(short_error(exc))
            return None
        self.error.visible = False
        return cfg

    def notify_error(self, message: str) -> None:
        """Show ``message`` as a toast (server sessions) and in the inline alert."""
        self.error.object = _md(message)
        self.error.visible = True
        if pn.state.notifications is not None:
            pn.state.notifications.error(message, duration=8000)

    def __panel__(self):
        return pn.Column(self.buttons, self.cards, sizing_mode="stretch_width")


def _views(entries) -> list:
    """A card's entries (panes, Fields, the file chooser) as the panes they lay out, in order:
    a part's widgets, then its error line once it has one."""
    out = []
    for entry in entries:
        if isinstance(entry, pn.viewable.Viewable):
            out.append(entry)
        else:
            out += [*entry.views, *((entry.message,) if entry.message_made else ())]
    return out


def card_markdown(card) -> str:
    """A dataset card (``qatlab.data.DATASET_CARDS`` entry: a dict or text) as a few Markdown lines."""
    if not card:
        return ""
    if isinstance(card, str):
        return card
    card = dict(card)
    lines = [f"**{_md(str(card.pop('title', '')))}**"] if "title" in card else []
    if "input_shape" in card:
        card["input_shape"] = " x ".join(str(n) for n in card["input_shape"])
    names = {"size": "", "classes": "classes: ", "input_shape": "input: ", "source": "source: ", "licence": "licence: "}
    for key, value in card.items():
        lines.append(f"{names.get(key, key.replace('_', ' ') + ': ')}{_md(str(value))}")
    return "  \n".join(lines)


def _md(text: str) -> str:
    """``text`` shown literally in Markdown (no emphasis from ``*`` or ``_``, no HTML)."""
    return re.sub(r"([\\`*_{}\[\]<>#|])", r"\\\1", text)
