"""The sidebar never disagrees with the run: every field checked where it is typed, Start disabled
while anything is invalid, only fields that apply shown, one run per press (no server, no browser)."""
from __future__ import annotations

import math

import param
import pytest

pn = pytest.importorskip("panel")

import qatlab as ql  # noqa: E402
from qatlab.store import RunStore  # noqa: E402
from qatlab.ui import Dashboard  # noqa: E402
from qatlab.ui import config_panel as cp  # noqa: E402
from qatlab.ui.config_panel import ConfigPanel, card_markdown, doc_rule  # noqa: E402
from qatlab.ui.fields import Field, parse_list, parse_number, range_text  # noqa: E402


def typed(panel: ConfigPanel, key: str, text: str) -> Field:
    """Type ``text`` into the field ``key`` as the browser does (keys, then Enter)."""
    field = panel.fields[key]
    field.widget.value_input = text
    field.widget.value = text
    return field


def test_range_text_names_bounds_and_kind():
    assert range_text(ql.OptimConfig.param.lr) == "a number > 0 and <= 1000"
    assert range_text(ql.OptimConfig.param.batch_size) == "a whole number from 1 to 65536"
    assert range_text(ql.OptimConfig.param.max_grad_norm) == "a number >= 0"
    assert range_text(ql.OptimConfig.param.momentum) == "a number >= 0 and < 1"


def test_parse_number_accepts_only_what_the_param_holds():
    p = ql.OptimConfig.param
    assert parse_number(p.epochs, " 1e3 ") == 1000 and isinstance(parse_number(p.epochs, "1e3"), int)
    assert parse_number(p.lr, "1e-3") == 1e-3 and parse_number(p.lr, "1000") == 1000
    for param_, text in [(p.lr, "0"), (p.lr, "1e6"), (p.lr, "nan"), (p.lr, "inf"), (p.lr, "abc"), (p.lr, ""),
                         (p.epochs, "1e6"), (p.epochs, "2.5"), (p.epochs, "0"), (p.batch_size, "100000"),
                         (p.momentum, "1"), (p.momentum, "-0.1")]:
        with pytest.raises(ValueError, match="must be"):
            parse_number(param_, text)


def test_parse_list_of_ints():
    p = ql.ModelConfig.param.hidden
    assert parse_list(p, "[256, 128]") == [256, 128] == parse_list(p, "256 128") == parse_list(p, "256,128,")
    assert parse_list(p, "") == [] == parse_list(p, "[]")
    for text in ["abc", "True", "1.5", "2, x"]:
        with pytest.raises(ValueError, match="whole numbers"):
            parse_list(p, text)
    for text in ["1,2,,3", ",1", "1,,"]:
        with pytest.raises(ValueError, match="an empty item between commas"):
            parse_list(p, text)


def _bad_texts(field: Field) -> list[str]:
    """Text the field must refuse: unparsable, and just outside each bound."""
    p = field.p
    if isinstance(p, param.List):
        return ["abc", "1.5"]
    if not isinstance(p, param.Number):
        return []
    out = ["abc", "nan"]
    lo, hi = p.bounds or (None, None)
    step = 1 if isinstance(p, param.Integer) else max(abs(lo or hi or 1) * 1e-3, 1e-9)
    if lo is not None:
        out.append(str(lo if not p.inclusive_bounds[0] else lo - step))
    if hi is not None:
        out.append(str(hi if not p.inclusive_bounds[1] else hi + step))
    return out


def _all_fields_config(architecture: str) -> ql.ExperimentConfig:
    """Fake weights and activations, momentum; the mlp with phases and synthetic data, the cnn with
    images (neither phases nor flat synthetic features apply to it)."""
    cfg = ql.ExperimentConfig()
    cfg.quant.weights, cfg.quant.activations, cfg.optim.optimizer = "fake", "fake", "momentum"
    cfg.data.dataset = "synthetic" if architecture == "mlp" else "mnist"
    cfg.model.architecture = architecture
    cfg.phase.enabled = architecture == "mlp"
    return cfg


def test_compare_waits_for_its_figures_and_for_a_valid_config():
    panel = ConfigPanel(ql.ExperimentConfig())
    panel.set_compare_ready(False)                   # the Dashboard: the comparison's figures are not in the page
    assert panel.compare_button.disabled and not panel.start_button.disabled
    typed(panel, "optim.lr", "0.02")                 # a valid edit does not enable it
    assert panel.compare_button.disabled
    typed(panel, "optim.lr", "abc")
    panel.set_compare_ready(True)                    # ready, but the config is not
    assert panel.compare_button.disabled and panel.start_button.disabled
    typed(panel, "optim.lr", "0.02")
    assert not panel.compare_button.disabled and not panel.start_button.disabled


@pytest.mark.parametrize("architecture", ["mlp", "cnn"])
def test_every_field_refuses_what_its_config_cannot_hold(architecture):
    """Every numeric / list field of every config the sidebar shows (new Params included)."""
    panel = ConfigPanel(_all_fields_config(architecture))
    assert not panel.problems
    checked = 0
    for key, field in panel.fields.items():
        if not field.visible:      # e.g. a field of the other architecture
            continue
        before = field.obj.to_dict()
        good = field.widget.value
        for text in _bad_texts(field):
            typed(panel, key, text)
            assert field.error is not None and field.error.startswith(field.label + ":"), (key, text, field.error)
            assert "must be" in field.error and field.message.visible, (key, field.error)
            assert field.obj.to_dict() == before, f"{key}: {text!r} changed the config"
            assert panel.start_button.disabled and panel.compare_button.disabled, key
            assert field.error in panel.problems and panel.error.visible
            assert panel.validated() is None
            checked += 1
        typed(panel, key, good)
        assert field.error is None and not field.message.visible, key
        assert not panel.start_button.disabled and not panel.problems, (key, panel.problems)
    assert checked >= 50 and {"optim.lr", "optim.batch_size", "optim.epochs", "model.hidden"} <= set(panel.fields)
    assert panel.fields["model.kernel_size"].visible == (architecture == "cnn")


@pytest.mark.parametrize("key, text, expect", [
    ("optim.lr", "0", "Learning rate: must be a number > 0 and <= 1000, got 0"),
    ("optim.lr", "1e6", "Learning rate: must be a number > 0 and <= 1000, got 1e6"),
    ("optim.batch_size", "100000", "Batch size: must be a whole number from 1 to 65536, got 100000"),
    ("optim.epochs", "1e6", "Epochs: must be a whole number from 1 to 100000, got 1e6"),
    ("model.hidden", "abc", "Hidden sizes (list): must be whole numbers separated by commas"),
])
def test_the_reported_cases_name_field_and_range(key, text, expect):
    panel = ConfigPanel()
    before = panel.config.to_dict()
    field = typed(panel, key, text)
    assert field.error.startswith(expect) and field.widget.value == text     # the box keeps what was typed
    assert panel.config.to_dict() == before and panel.validated() is None


def test_a_rule_of_the_config_shows_at_the_field_it_names():
    panel = ConfigPanel()
    field = typed(panel, "model.hidden", "64, 0")
    assert panel.config.model.hidden == [64, 0]           # held as typed, and Start refuses it
    assert field.error is None and field.rule_error.startswith("Hidden sizes (list): ModelConfig.hidden[1]")
    assert panel.start_button.disabled and panel.validated() is None
    typed(panel, "model.hidden", "64, 32")
    assert field.rule_error is None and not panel.start_button.disabled


def test_config_set_from_python_shows_in_the_widget_and_clears_the_error():
    panel = ConfigPanel()
    typed(panel, "optim.epochs", "zzz")
    panel.config.optim.epochs = 7
    assert panel.fields["optim.epochs"].widget.value == "7" and not panel.problems
    panel.config.model.hidden = [32, 16]
    assert panel.fields["model.hidden"].widget.value == "32, 16"
    assert isinstance(panel.validated(), ql.ExperimentConfig)


def shown(panel: ConfigPanel) -> set[str]:
    return {k for k, f in panel.fields.items() if f.visible}


def test_only_fields_that_apply_are_shown():
    panel = ConfigPanel(ql.ExperimentConfig())   # (the digits MLP: the CNN default shows the cnn fields)
    cfg = panel.config
    for weights in ("ternary", "float"):
        cfg.quant.weights = weights
        assert not {"quant.weight_bits", "quant.per_channel", "quant.scale_mode", "quant.symmetric"} & shown(panel)
    assert "quant.ste" not in shown(panel)
    cfg.quant.weights = "fake"
    assert {"quant.weight_bits", "quant.per_channel", "quant.scale_mode", "quant.ste"} <= shown(panel)
    assert not {"quant.activation_bits", "quant.activation_ste"} & shown(panel)
    cfg.quant.activations = "fake"
    assert {"quant.activation_bits", "quant.activation_ste"} <= shown(panel)
    assert "optim.momentum" not in shown(panel)
    cfg.optim.optimizer = "momentum"
    assert "optim.momentum" in shown(panel)
    assert shown(panel) & {k for k in panel.fields if k.startswith("phase.")} == {"phase.enabled"}
    cfg.phase.enabled = True
    assert "phase.full_steps" in shown(panel) and "phase.predictor" in shown(panel)
    synthetic_only = {k for k in panel.fields if k.startswith("data.") and "nly" in (panel.fields[k].p.doc or "")[:40]}
    assert synthetic_only and not synthetic_only & shown(panel)
    cfg.data.dataset = "synthetic"
    assert synthetic_only <= shown(panel)
    assert not panel.file_chooser.visible
    cfg.data.dataset = "file"
    assert panel.file_chooser.visible and not synthetic_only & shown(panel)
    cnn_only = {"model.conv_channels", "model.kernel_size", "model.pool"}
    assert not cnn_only & shown(panel) and "model.hidden" in shown(panel)
    cfg.model.architecture = "cnn"
    assert cnn_only <= shown(panel)
    assert {"data.test_fraction", "data.seed"} <= shown(panel)
    cfg.data.dataset = "mnist1d"       # a fixed split
    assert not {"data.test_fraction", "data.seed"} & shown(panel)


def test_a_field_hidden_while_invalid_shows_the_configs_value_again():
    panel = ConfigPanel()
    panel.config.optim.optimizer = "momentum"
    typed(panel, "optim.momentum", "2")
    assert panel.start_button.disabled
    panel.fields["optim.optimizer"].widget.value = "adam"
    field = panel.fields["optim.momentum"]
    assert not field.visible and field.error is None and field.widget.value == "0.9"
    assert not panel.start_button.disabled and panel.config.optim.momentum == 0.9


def test_a_hidden_field_a_rule_names_is_shown_to_be_fixed():
    panel = ConfigPanel()
    panel.config.quant.weights = "fake"
    panel.fields["quant.per_channel"].widget.value = True
    panel.fields["quant.weights"].widget.value = "ternary"      # per_channel applies to fake weights only
    field = panel.fields["quant.per_channel"]
    assert field.visible and field.rule_error.startswith("Per channel: QuantConfig.per_channel")
    assert panel.start_button.disabled
    field.widget.value = False
    assert not field.visible and not panel.problems and not panel.start_button.disabled


def _card_views(panel: ConfigPanel) -> list:
    return [v for card in panel.cards.objects for v in card.objects]


def test_a_page_lays_out_only_what_it_shows():
    """Hidden fields, error lines, the upload box and the collapsed Phase card's fields join the page
    when first shown, in their card's order (each laid-out pane is Bokeh models a page open builds)."""
    from bokeh.document import Document

    panel = ConfigPanel()                         # the mnist CNN: hidden sizes, momentum, ... do not apply
    laid = {id(v) for v in _card_views(panel)}
    hidden = [f for f in panel.fields.values() if not f.visible]
    assert hidden and not any(id(f.widget) in laid for f in hidden)
    assert not any(f.message_made for f in panel.fields.values())
    assert id(panel.file_chooser.box) not in laid
    phase = panel.cards.objects[-1]
    assert phase.collapsed and not phase.objects
    small = len(list(panel.cards.get_root(Document()).references()))

    lr = typed(panel, "optim.lr", "0")            # an error line, right under its widget
    views = _card_views(panel)
    assert lr.message_shown and views[views.index(lr.widget) + 1] is lr.message
    typed(panel, "optim.lr", "0.01")
    assert not lr.message.visible and lr.message in _card_views(panel)   # kept, hidden
    panel.fields["optim.optimizer"].widget.value = "momentum"
    optim = [f for k, f in panel.fields.items() if k.startswith("optim.") or k == "metrics_every"]
    expect = [v for f in optim if f.visible for v in (f.widget, *((f.message,) if f.message_made else ()))]
    assert panel.cards.objects[3].objects == expect and panel.fields["optim.momentum"].widget in expect
    quant, sent = panel.cards.objects[2], []
    quant.param.watch(lambda e: sent.append(len(e.new)), "objects")
    panel.fields["quant.weights"].widget.value = "fake"     # four fields appear: one update of the card
    assert len(sent) == 1 and {"quant.weight_bits", "quant.per_channel"} <= shown(panel)
    panel.config.data.dataset = "file"
    views = _card_views(panel)
    assert views[views.index(panel.dataset_card) + 1] is panel.file_chooser.box
    phase.collapsed = False                        # opened: its shown fields, in order
    assert [v for v in phase.objects] == [panel.fields["phase.enabled"].widget]
    panel.config.phase.enabled = True
    assert len(phase.objects) > 5 and phase.objects[0] is panel.fields["phase.enabled"].widget
    full = len(list(panel.cards.get_root(Document()).references()))
    assert full > small + 40, (small, full)


def test_doc_rule_is_generic():
    class Arch(param.Parameterized):
        architecture = param.Selector(default="mlp", objects=["mlp", "cnn"])
        kernel_size = param.Integer(default=3, bounds=(1, 7), doc="cnn only: side of the square kernels.")
        hidden = param.List(default=[8], item_type=int, doc="Hidden sizes (mlp / cnn head).")
    a = Arch()
    rule = doc_rule(a, "kernel_size")
    assert rule is not None and not rule(None)
    a.architecture = "cnn"
    assert rule(None) and doc_rule(a, "hidden") is None


def test_cards_render_dicts_and_text():
    text = card_markdown({"title": "MNIST subset", "size": "5000 images", "classes": 10, "input_shape": (1, 28, 28)})
    assert text.startswith("**MNIST subset**") and "1 x 28 x 28" in text and "classes: 10" in text
    assert card_markdown("plain") == "plain" and card_markdown(None) == ""


def test_start_runs_once_per_press(monkeypatch):
    clock = [100.0]
    monkeypatch.setattr(cp.time, "monotonic", lambda: clock[0])
    calls = []
    panel = ConfigPanel(on_start=lambda: calls.append("start"), on_compare=lambda: calls.append("compare"))
    panel.start_button.clicks += 1
    panel.start_button.clicks += 1          # a double click: the second press within DEBOUNCE_S
    panel.compare_button.clicks += 1
    assert calls == ["start"]
    clock[0] += cp.DEBOUNCE_S + 0.01
    panel.compare_button.clicks += 1
    assert calls == ["start", "compare"]


def test_a_press_during_the_handler_is_dropped():
    calls = []
    panel = ConfigPanel()

    def handler():
        calls.append(1)
        panel.start_button.clicks += 1      # arrives while the first press is being handled
    panel.start_button.on_click(panel._debounced(handler))
    panel.start_button.clicks += 1
    assert calls == [1] and math.isfinite(panel._quiet_until)


def test_dashboard_start_with_an_invalid_field_creates_no_run(tmp_path):
    dash = Dashboard(period=0, store=RunStore(tmp_path / "runs.sqlite"))
    typed(dash.config_panel, "optim.lr", "0")
    assert dash.start_run() is None and dash.compare_ste() is None
    assert dash.store.runs() == [] and dash._client is None
    assert "Learning rate" in dash.config_panel.error.object
