"""The model summary panel of the Quantization tab: ``ql.summary`` of a run's model as an HTML table.

The summary is computed from the run's config alone (the model is rebuilt with
:func:`qatlab.train.build.build_model` on the dataset's sizes), so it stays available after the
run's model is released. Shapes of the shipped datasets come from their cards; a synthetic set
from its config; a user file is loaded once (its sizes are cached per data config).

The table (an HTML pane, CSS class ``qatlab-model-summary``; rows ``tr.qatlab-summary-<kind>``)
shows per layer the output shape, parameters, weight format, bits per weight, memory in kB and
MACs per sample, then the totals with the float32-equivalent size and the compression ratio.
"""
from __future__ import annotations

import functools
import html
import json
import math

import panel as pn

from ..config import DataConfig, ExperimentConfig
from ..data import DATASET_CARDS, load_dataset
from ..nn.summary import ModelSummary, summary
from ..train.build import build_model


@functools.lru_cache(maxsize=16)
def _file_sizes(data_json: str) -> tuple[int, int, tuple | None]:
    data = load_dataset(DataConfig.from_dict(json.loads(data_json)))
    return data.X_train.shape[1], data.n_classes, data.image_shape


def data_sizes(cfg: ExperimentConfig) -> tuple[int, int, tuple | None]:
    """(n_inputs, n_outputs, image_shape or None) of the data ``cfg.data`` describes."""
    d = cfg.data
    card = DATASET_CARDS.get(d.dataset)
    if card is not None:
        shape = tuple(card["input_shape"])
        return math.prod(shape), int(card["classes"]), shape
    if d.dataset == "synthetic":
        return int(d.n_features), int(d.n_classes), None
    return _file_sizes(json.dumps(d.to_dict(), sort_keys=True))


def config_summary(cfg: ExperimentConfig) -> ModelSummary:
    """``ql.summary`` of the model ``cfg`` trains (freshly built: the layout and quantizers decide
    every number, not the trained weights)."""
    n_in, n_out, shape = data_sizes(cfg)
    return summary(build_model(cfg, n_in, n_out, shape), cfg)


def _shape(s) -> str:
    return "&times;".join(str(d) for d in s)


def summary_html(s: ModelSummary) -> str:
    """The summary as a small HTML table: one row per layer, then the totals."""
    head = ("<tr><th>layer</th><th>output</th><th>params</th><th>weights</th><th>bits/weight</th>"
            "<th>memory (kB)</th><th>MACs/sample</th></tr>")
    rows = []
    for r in s.layers:
        bits = "–" if r["bits_per_weight"] is None else f"{r['bits_per_weight']:g}"
        rows.append(f"<tr class='qatlab-summary-{r['kind']}'><td>{html.escape(r['name'])}</td>"
                    f"<td>{_shape(r['output_shape'])}</td><td>{r['params']:,}</td>"
                    f"<td>{html.escape(r['weight_format'])}</td><td>{bits}</td>"
                    f"<td>{r['memory_kb']:.2f}</td><td>{r['macs']:,}</td></tr>")
    t = s.totals
    rows.append(f"<tr class='qatlab-summary-total'><td><b>total</b></td><td></td><td><b>{t['params']:,}</b></td>"
                f"<td></td><td></td><td><b>{t['memory_kb']:.2f}</b></td><td><b>{t['macs']:,}</b></td></tr>")
    foot = (f"float32-equivalent size <b>{t['float32_kb']:.2f} kB</b>, stored <b>{t['memory_kb']:.2f} kB</b>: "
            f"compression <b>{t['compression']:.2f}&times;</b>. Memory counts weights at their bits, biases "
            "and quantizer scales as float32 (1 kB = 1024 bytes).")
    if any(r["weight_format"] == "ternary" for r in s.layers):
        foot += " Ternary weights are stored packed, 2 bits each (information content log2(3) = 1.585 bits)."
    style = ("<style>table.qatlab-summary{border-collapse:collapse;font-size:13px}"
             "table.qatlab-summary th{text-align:right;border-bottom:2px solid #0072B5;padding:4px 8px}"
             "table.qatlab-summary td{text-align:right;padding:3px 8px;border-bottom:1px solid #e0e0e0}"
             "table.qatlab-summary td:first-child,table.qatlab-summary th:first-child{text-align:left}</style>")
    return (f"{style}<b>{html.escape(s.title)}</b><table class='qatlab-summary'><thead>{head}</thead>"
            f"<tbody>{''.join(rows)}</tbody></table><small>{foot}</small>")


class ModelSummaryPanel:
    """An HTML pane showing the summary of one run's config; ``summary`` is the ModelSummary shown
    (None when there is no run, or the config cannot build a model: the pane says why)."""

    def __init__(self):
        self.summary: ModelSummary | None = None
        self.pane = pn.pane.HTML("", css_classes=["qatlab-model-summary"], sizing_mode="stretch_width",
                                 margin=(0, 10))
        self._key = None

    def show(self, cfg: ExperimentConfig | None) -> None:
        """Show the summary of ``cfg`` (recomputed only when the config changes)."""
        key = None if cfg is None else json.dumps(cfg.to_dict(), sort_keys=True)
        if key == self._key:
            return
        self._key, self.summary = key, None
        if cfg is None:
            self.pane.object = ""
            return
        try:
            self.summary = config_summary(cfg)
        except (ValueError, TypeError, OSError) as e:  # e.g. a cnn on flat features, a missing file
            self.pane.object = f"<small>No model summary: {html.escape(str(e))}</small>"
            return
        self.pane.object = summary_html(self.summary)
