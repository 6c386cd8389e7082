"""The Quantization tab's model summary: built from the run's config, equal to ql.summary of the
model the run trained, still there after the model is released."""
from __future__ import annotations

import math

import pytest

pn = pytest.importorskip("panel")

import qatlab as ql  # noqa: E402
from qatlab.ui import QuantView  # noqa: E402
from qatlab.ui.summary_view import ModelSummaryPanel, data_sizes, summary_html  # noqa: E402

KEYS = ("name", "kind", "output_shape", "params", "weight_format", "bits_per_weight", "memory_kb", "macs")


def cnn_config(weights: str = "ternary") -> ql.ExperimentConfig:
    cfg = ql.ExperimentConfig()
    cfg.data.dataset = "mnist"
    cfg.model.architecture = "cnn"
    cfg.model.conv_channels = [4, 8]
    cfg.model.hidden = [16]
    cfg.quant.weights = weights
    cfg.optim.epochs = 1
    return cfg


def assert_same(shown, expected):
    assert [tuple(r[k] for k in KEYS) for r in shown.layers] == [tuple(r[k] for k in KEYS) for r in expected.layers]
    assert shown.totals == expected.totals


@pytest.mark.slow
def test_summary_panel_equals_ql_summary_of_the_trained_model_and_survives_release():
    cfg = cnn_config()
    run = ql.LocalRun(cfg).start()
    assert run.join(timeout=120)
    assert run.status == "finished", run.message
    view = QuantView(run)
    expected = ql.summary(run.result.model, run.config)
    shown = view.model_summary.summary
    assert_same(shown, expected)
    assert [r["kind"] for r in shown.layers] == ["conv", "maxpool", "conv", "maxpool", "flatten", "dense", "dense"]
    html = view.model_summary.pane.object
    assert html.count("qatlab-summary-conv") == 2 and "ternary" in html
    assert f"{expected.totals['compression']:.2f}&times;" in html
    assert f"{expected.layers[0]['macs']:,}" in html
    assert view.model_summary.pane in view._plots.objects
    # every weight layer of the cnn gets its histograms, titled by the summary's layer names
    assert sorted(k for k in view.hist_sources if k.startswith("latent-")) == [f"latent-{i}" for i in range(4)]
    assert view.figures["hist-latent-2"].title.text == "Layer 2 (dense0) · latent W"
    assert view.hist_sources["latent-0"].data["count"].sum() == 4 * 1 * 5 * 5   # conv0's weights

    run.release()
    assert run.result.model is None
    again = QuantView(run)
    assert_same(again.model_summary.summary, expected)


@pytest.mark.parametrize("weights, bits", [("float", 32), ("fake", 4)])
def test_summary_follows_the_quant_config(weights, bits):
    cfg = cnn_config(weights)
    cfg.quant.weight_bits = 4
    panel = ModelSummaryPanel()
    panel.show(cfg)
    s = panel.summary
    assert {r["bits_per_weight"] for r in s.layers if r["params"]} == {bits}
    conv0 = s.layers[0]
    assert conv0["output_shape"] == (4, 24, 24) and conv0["macs"] == 4 * 24 * 24 * 1 * 5 * 5
    assert math.isclose(s.totals["compression"], s.totals["float32_bytes"] / s.totals["memory_bytes"])
    if weights == "float":
        assert s.totals["memory_bytes"] == s.totals["float32_bytes"]


def test_summary_of_an_mlp_and_the_dataset_sizes():
    cfg = ql.ExperimentConfig()           # digits, MLP
    assert data_sizes(cfg) == (64, 10, (1, 8, 8))
    cfg.data.dataset = "synthetic"
    cfg.data.n_features, cfg.data.n_classes = 12, 3
    assert data_sizes(cfg) == (12, 3, None)
    panel = ModelSummaryPanel()
    panel.show(cfg)
    sizes = [12, *cfg.model.hidden, 3]
    assert [r["macs"] for r in panel.summary.layers] == [a * b for a, b in zip(sizes[:-1], sizes[1:])]
    assert summary_html(panel.summary).count("qatlab-summary-dense") == len(cfg.model.hidden) + 1


def test_summary_panel_explains_a_config_that_cannot_build():
    cfg = cnn_config()
    cfg.data.dataset = "synthetic"        # flat features: no cnn
    panel = ModelSummaryPanel()
    panel.show(cfg)
    assert panel.summary is None and "No model summary" in panel.pane.object and "architecture" in panel.pane.object
    panel.show(None)
    assert panel.summary is None and panel.pane.object == ""
