"""ql.summary: per-layer parameters, bits, memory and MACs, checked by hand on small models."""
from __future__ import annotations

import math

import numpy as np
import pytest

import qatlab as ql
from qatlab.nn.summary import summary
from qatlab.train.build import build_model


def _cfg(weights="float", bits=4, per_channel=False, symmetric=True, activations="off"):
    cfg = ql.ExperimentConfig()
    cfg.quant.weights = weights
    cfg.quant.weight_bits = bits
    cfg.quant.per_channel = per_channel
    cfg.quant.symmetric = symmetric
    cfg.quant.activations = activations
    return cfg


@pytest.fixture
def small():
    def make(**kw):
        cfg = _cfg(**kw)
        cfg.model.hidden = [3]
        return build_model(cfg, 4, 2), cfg        # Mlp 4-3-2: 12 + 3 and 6 + 2 parameters
    return make


def test_float_mlp_by_hand(small):
    model, cfg = small()
    s = summary(model, cfg)
    assert [r["name"] for r in s.layers] == ["dense0", "dense1"]
    d0, d1 = s.layers
    assert (d0["weights"], d0["biases"], d0["params"], d0["macs"]) == (12, 3, 15, 12)
    assert (d1["weights"], d1["biases"], d1["params"], d1["macs"]) == (6, 2, 8, 6)
    assert d0["bits_per_weight"] == 32 and d0["weight_format"] == "float32" and d0["scales"] == 0
    assert d0["memory_bytes"] == 60 and d1["memory_bytes"] == 32
    t = s.totals
    assert (t["params"], t["macs"], t["memory_bytes"], t["float32_bytes"]) == (23, 18, 92, 92)
    assert t["compression"] == 1.0 and t["memory_kb"] == pytest.approx(92 / 1024)


def test_fake_per_tensor_by_hand(small):
    model, cfg = small(weights="fake", bits=4)
    d0, d1 = summary(model, cfg).layers
    # 12 weights x 4 bits = 6 bytes, 3 float32 biases = 12, one float32 scale = 4
    assert d0["memory_bytes"] == 6 + 12 + 4 and d0["bits_per_weight"] == 4 and d0["scales"] == 1
    assert d1["memory_bytes"] == 3 + 8 + 4 and d1["zero_points"] == 0
    t = summary(model, cfg).totals
    assert t["memory_bytes"] == 37 and t["compression"] == pytest.approx(92 / 37)


def test_fake_per_channel_affine_by_hand(small):
    model, cfg = small(weights="fake", bits=8, per_channel=True, symmetric=False)
    d0, d1 = summary(model, cfg).layers
    # 12 bytes of weights, 12 of biases, 3 scales + 3 int32 zero points
    assert (d0["scales"], d0["zero_points"]) == (3, 3)
    assert d0["memory_bytes"] == 12 + 12 + 24 and d1["memory_bytes"] == 6 + 8 + 16
    assert d0["weight_format"] == "uint8 per-ch0"


def test_ternary_by_hand(small):
    model, cfg = small(weights="ternary")
    s = summary(model, cfg)
    d0, d1 = s.layers
    assert d0["bits_per_weight"] == 2 and d0["entropy_bits_per_weight"] == pytest.approx(math.log2(3))
    assert d0["memory_bytes"] == 3 + 12 + 4 and d1["memory_bytes"] == 1.5 + 8 + 4
    assert s.totals["compression"] == pytest.approx(92 / 32.5)
    text = str(s)
    assert "log2(3) = 1.585" in text and "compression 2.83x" in text and "ternary" in text
    assert "dense0" in text and "total" in text


def test_activation_bits_and_title(small):
    model, cfg = small(weights="fake", bits=2, activations="fake")
    s = summary(model, cfg)
    assert [r["activation_bits"] for r in s.layers] == [8, None]
    assert s.title == "Mlp summary (digits, 2-bit weights)"
    assert summary(model).title == "Mlp summary"


def test_model_quantizers_decide_not_config(small):
    model, _ = small(weights="ternary")
    s = summary(model, _cfg("float"))             # the model is ternary whatever the config says
    assert all(r["bits_per_weight"] == 2 for r in s.layers)


def test_larger_mlp_totals():
    model = ql.Mlp([64, 256, 10])
    t = summary(model).totals
    assert t["params"] == 64 * 256 + 256 + 256 * 10 + 10 == model.num_params
    assert t["macs"] == 64 * 256 + 256 * 10


def test_bad_input():
    with pytest.raises(TypeError, match="model"):
        summary(np.zeros(3))
    with pytest.raises(TypeError, match="config"):
        summary(ql.Mlp([4, 2]), config={"quant": "x"})


def _cnn(weights="float"):
    from qatlab.nn.cnn import Cnn

    model = Cnn((1, 8, 8), [2], 3, kernel_size=3, pool=2)      # conv 1->2 3x3: 2x6x6, pool: 2x3x3, dense 18->3
    if weights == "ternary":
        model.set_quantizers([ql.TernaryQuantizer(), ql.TernaryQuantizer()])
    return model


def test_cnn_by_hand():
    s = summary(_cnn())
    assert [r["name"] for r in s.layers] == ["conv0", "maxpool0", "flatten", "dense0"]
    conv, pool, flat, dense = s.layers
    assert conv["weight_shape"] == (2, 1, 3, 3) and conv["output_shape"] == (2, 6, 6)
    assert (conv["weights"], conv["biases"], conv["macs"]) == (18, 2, 2 * 9 * 36)
    assert pool["output_shape"] == (2, 3, 3) and pool["params"] == 0 and pool["macs"] == 0
    assert flat["output_shape"] == (18,)
    assert (dense["weights"], dense["biases"], dense["macs"]) == (54, 3, 54)
    t = s.totals
    assert (t["params"], t["macs"], t["memory_bytes"]) == (77, 702, 308) and t["compression"] == 1.0


def test_ternary_cnn_by_hand():
    s = summary(_cnn("ternary"))
    conv, _, _, dense = s.layers
    assert conv["memory_bytes"] == 18 * 2 / 8 + 8 + 4 and dense["memory_bytes"] == 54 * 2 / 8 + 12 + 4
    assert s.totals["compression"] == pytest.approx(308 / 46)
    assert "conv0" in str(s) and "maxpool0" in str(s) and "2x6x6" in str(s)


def test_lenet_macs():
    from qatlab.nn.cnn import Cnn

    t = summary(Cnn((1, 28, 28), [16, 32], 10, kernel_size=5, pool=2)).totals
    assert t["params"] == (16 * 25 + 16) + (32 * 16 * 25 + 32) + (512 * 10 + 10)
    assert t["macs"] == 16 * 25 * 576 + 32 * 400 * 64 + 5120
