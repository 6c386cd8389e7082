"""The Cnn model: gradients, buffers, argument checks, and training through run_experiment."""
import math

import numpy as np
import pytest

import qatlab as ql
from qatlab import resources
from qatlab.nn import cross_entropy_loss, mse_loss
from qatlab.train.build import build_model

RNG = np.random.default_rng(3)


def _step(m, x, labels, batch=None):
    s, g = m.scratch(batch or len(x)), m.gradients(batch or len(x))
    out = m.forward(x, s)
    loss = cross_entropy_loss(out, labels, g.d_output_mut())
    dx = m.backward(x, s, g)
    return out.copy(), loss, dx.copy(), g


def test_gradients_match_finite_differences():
    m = ql.Cnn((2, 7, 6), [3, 4], 3, hidden=[5], kernel_size=(2, 3), pool=1, activation="tanh", seed=2)
    x = RNG.standard_normal((3, 84)).astype(np.float32)
    target = RNG.standard_normal((3, 3)).astype(np.float32)
    s, g = m.scratch(3), m.gradients(3)
    mse_loss(m.forward(x, s), target, g.d_output_mut())
    m.backward(x, s, g, need_input_grad=False)
    flat, grad = m.flat_params(), g.flat().copy()
    eps = 1e-2
    for k in RNG.choice(flat.size, 40, replace=False):
        old = flat[k]
        flat[k] = old + eps
        up = mse_loss(m.forward(x, s), target)
        flat[k] = old - eps
        down = mse_loss(m.forward(x, s), target)
        flat[k] = old
        assert (up - down) / (2 * eps) == pytest.approx(grad[k], rel=2e-2, abs=2e-4), k


def test_partial_batches_and_the_evaluation_scratch():
    m = ql.Cnn((1, 12, 12), [4, 6], 10, kernel_size=3, pool=2, seed=0)
    x = RNG.standard_normal((300, 144)).astype(np.float32)
    labels = RNG.integers(0, 10, 300)
    full = m.forward(x, m.scratch(300)).copy()
    ev = m.scratch(300, backward=False)              # convs in chunks of INFERENCE_ROWS rows
    np.testing.assert_allclose(m.forward(x, ev), full, rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(m.forward(x[:7], ev), full[:7], rtol=1e-5, atol=1e-5)
    g = m.gradients(300)
    with pytest.raises(ValueError, match="backward=False"):
        m.backward(x[:7], ev, g)
    out, loss, dx, g5 = _step(m, x[:5], labels[:5], batch=64)    # a partial batch of a bigger scratch
    out_ref, loss_ref, dx_ref, g_ref = _step(m, x[:5], labels[:5])
    np.testing.assert_allclose(out, out_ref, rtol=1e-6, atol=1e-6)
    np.testing.assert_allclose(dx, dx_ref, rtol=1e-5, atol=1e-7)
    np.testing.assert_allclose(g5.flat(), g_ref.flat(), rtol=1e-5, atol=1e-6)
    assert dx.shape == (5, 144) and g5.d_output().shape == (5, 10)
    s = m.scratch(5)
    cross_entropy_loss(m.forward(x[:5], s), labels[:5], g5.d_output_mut())
    m.backward(x[:5], s, g5)
    with pytest.raises(ValueError, match="backward already ran"):   # it reused the forward's buffers
        m.backward(x[:5], s, g5)
    m.forward(x[:5], s)
    np.testing.assert_allclose(m.backward(x[:5], s, g5), dx_ref, rtol=1e-5, atol=1e-7)


@pytest.mark.parametrize("cores", [1, 3])
def test_results_do_not_depend_on_the_core_count(monkeypatch, cores):
    from qatlab.runtime import parallel
    m = ql.Cnn((1, 28, 28), [16, 32], 10, seed=4)          # big enough for split products and images
    x = RNG.random((64, 784), dtype=np.float32)
    labels = RNG.integers(0, 10, 64)
    monkeypatch.setattr(parallel, "_cores", 2)
    out, _, dx, g = _step(m, x, labels)
    monkeypatch.setattr(parallel, "_cores", cores)
    out_c, _, dx_c, g_c = _step(m, x, labels)
    np.testing.assert_array_equal(out_c, out)
    np.testing.assert_array_equal(dx_c, dx)
    np.testing.assert_array_equal(g_c.flat(), g.flat())


def test_conv_output_of_a_fused_relu_and_pool():
    m = ql.Cnn((1, 10, 10), [3], 4, kernel_size=3, pool=2, seed=1)
    m.biases(0)[:] = [0.3, -0.2, 0.1]
    x = RNG.standard_normal((5, 1, 10, 10)).astype(np.float32)
    s = m.scratch(5)
    m.forward(x, s)
    w = m.conv_weight(0)
    ref = np.zeros((5, 3, 8, 8))
    for i in range(8):
        for j in range(8):
            ref[:, :, i, j] = np.einsum("ncuv,ocuv->no", x[:, :, i:i + 3, j:j + 3], w) + m.biases(0)
    np.testing.assert_allclose(s.conv_output(0), np.maximum(ref, 0), rtol=1e-5, atol=1e-5)
    g = m.gradients(5)
    cross_entropy_loss(s.output(), RNG.integers(0, 4, 5), g.d_output_mut())
    m.backward(x, s, g)
    with pytest.raises(ValueError, match="not kept"):
        s.conv_output(0)


class _PassThrough:
    """An activation quantizer that changes nothing: it only splits the Cnn's chunked conv stages."""

    def forward(self, x, out):
        out[...] = x
        return out

    def backward(self, grad, x, out):
        out[...] = grad
        return out


@pytest.mark.parametrize("act", ["relu", "tanh"])
@pytest.mark.parametrize("where", [0, 1])
def test_conv_stages_split_at_activation_quantizers(act, where):
    """A quantizer on one conv layer makes the batch meet there (stages of chunked layers before and
    after); with a pass-through quantizer the results equal the unsplit (fused, for relu) model's."""
    m = ql.Cnn((1, 16, 16), [4, 6], 5, kernel_size=3, pool=2, activation=act, seed=5)
    x = RNG.standard_normal((37, 256)).astype(np.float32)        # three chunks, the last partial
    labels = RNG.integers(0, 5, 37)
    out, loss, dx, g = _step(m, x, labels)
    aqs = [None] * (m.num_layers - 1)
    aqs[where] = _PassThrough()
    m.set_quantizers(None, aqs)
    assert len(m._stages()) == 2 - where
    out_q, loss_q, dx_q, g_q = _step(m, x, labels)
    np.testing.assert_array_equal(out_q, out)
    np.testing.assert_allclose(dx_q, dx, rtol=1e-6, atol=1e-7)
    np.testing.assert_allclose(g_q.flat(), g.flat(), rtol=1e-5, atol=1e-6)


def test_four_dimensional_input_and_activation_quantizers():
    m = ql.Cnn((1, 10, 10), [3], 4, hidden=[6], kernel_size=3, pool=2, seed=0)
    x = RNG.standard_normal((4, 1, 10, 10)).astype(np.float32)
    labels = RNG.integers(0, 4, 4)
    out, _, dx, g = _step(m, x, labels)
    np.testing.assert_array_equal(_step(m, x.reshape(4, -1), labels)[0], out)
    aqs = [ql.FakeQuantize(bits=2, symmetric=False, observer=ql.MovingAverageMinMaxObserver(1.0), observer_enabled=True)
           for _ in range(m.num_layers - 1)]
    m.set_quantizers(None, aqs)
    s = m.scratch(4)
    out_q = m.forward(x, s)
    assert not np.allclose(out_q, out)
    conv_out = s.conv_output(0)
    assert conv_out.shape == (4, 3, 8, 8) and conv_out.min() >= 0            # relu output, before its quantizer
    levels = np.unique(aqs[0].forward(conv_out.copy()))
    assert len(levels) <= 4                                                 # 2-bit activations feed the pool
    g = m.gradients(4)
    cross_entropy_loss(out_q, labels, g.d_output_mut())
    assert m.backward(x, s, g).shape == (4, 100) and np.isfinite(g.flat()).all()


def test_layout_and_specs():
    m = ql.Cnn((1, 28, 28), [16, 32], 10, seed=0)
    assert m.sizes == (784, 16 * 12 * 12, 32 * 4 * 4, 10) and m.num_layers == 3
    assert m.param_shapes() == [("w0", (16, 25)), ("b0", (16,)), ("w1", (32, 400)), ("b1", (32,)),
                                ("w2", (10, 512)), ("b2", (10,))]
    assert m.num_params == 16 * 26 + 32 * 401 + 10 * 513
    assert np.shares_memory(m.conv_weight(1), m.flat_params()) and m.conv_weight(1).shape == (32, 16, 5, 5)
    specs = m.layer_specs()
    assert [s["kind"] for s in specs] == ["conv", "conv", "dense"]
    assert specs[0]["macs"] == 16 * 24 * 24 * 25 and specs[1]["out_shape"] == (32, 4, 4)
    assert specs[2]["weight_shape"] == (10, 512)
    signal = ql.Cnn((1, 1, 40), [8], 10, kernel_size=5, pool=2)     # 1-d: (1, 5) kernels, (1, 2) pools
    assert signal.kernel_size == (1, 5) and signal.pool == (1, 2) and signal.sizes[1] == 8 * 18
    shapes = resources.layer_shapes(_cnn_cfg(), 784, 10, (1, 28, 28))
    assert shapes == [(25, 16, 576, 2304), (400, 32, 64, 512), (512, 10)]


def test_arguments_are_checked_before_allocating():
    with pytest.raises(ValueError, match="image_shape"):
        ql.Cnn((28, 28), [4], 10)
    with pytest.raises(ValueError, match="conv_channels"):
        ql.Cnn((1, 8, 8), [], 10)
    with pytest.raises(ValueError, match=r"conv_channels\[1\]"):
        ql.Cnn((1, 8, 8), [4, 0], 10)
    with pytest.raises(ValueError, match="kernel_size: 5x5 is larger than conv layer 1's 2x2 input"):
        ql.Cnn((1, 8, 8), [4, 4], 10, kernel_size=5)
    with pytest.raises(ValueError, match="pool: a 3x3 window is larger than conv layer 0's 2x2 output"):
        ql.Cnn((1, 4, 4), [4], 10, kernel_size=3, pool=3)
    with pytest.raises(ValueError, match="activation"):
        ql.Cnn((1, 8, 8), [4], 10, kernel_size=3, activation="gelu")
    m = ql.Cnn((1, 8, 8), [4], 10, kernel_size=3)
    with pytest.raises(ValueError, match="x: expected shape"):
        m.forward(np.zeros((2, 65), np.float32), m.scratch(2))
    with pytest.raises(TypeError, match="scratch"):
        m.forward(np.zeros((2, 64), np.float32), ql.Mlp([64, 10]).scratch(2))
    with pytest.raises(ValueError, match="weight_quantizers"):
        m.set_quantizers([None])


def _cnn_cfg(**model):
    cfg = ql.ExperimentConfig()
    cfg.model.architecture = "cnn"
    cfg.model.hidden = []
    for k, v in model.items():
        setattr(cfg.model, k, v)
    return cfg


def test_config_and_build_checks():
    cfg = _cnn_cfg()
    assert (cfg.model.conv_channels, cfg.model.kernel_size, cfg.model.pool) == ([16, 32], 5, 2)
    assert ql.ExperimentConfig().model.architecture == "mlp"
    cfg.phase.enabled = True
    with pytest.raises(ValueError, match="phase training supports architecture='mlp' only"):
        cfg.validate()
    with pytest.raises(ValueError, match="ModelConfig.conv_channels"):
        _cnn_cfg(conv_channels=[]).validate()
    with pytest.raises(ValueError, match="ModelConfig.kernel_size: 5x5 is larger than conv layer 1's 2x2"):
        _cnn_cfg().validate()                                      # digits are 8x8: known before loading
    cfg = _cnn_cfg(conv_channels=[4], kernel_size=3, pool=7)
    with pytest.raises(ValueError, match="ModelConfig.pool: a 7x7 window is larger than conv layer 0.s 6x6"):
        cfg.validate()
    cfg.data.dataset = "mnist"
    cfg.validate()
    cfg.data.dataset = "synthetic"
    with pytest.raises(ValueError, match="'synthetic' gives flat features"):
        cfg.validate()
    with pytest.raises(ValueError, match=r"ModelConfig.architecture: 'cnn' needs a dataset of images"):
        build_model(_cnn_cfg(), 64, 10, None)
    with pytest.raises(ValueError, match="ModelConfig.kernel_size: 5x5 is larger"):
        build_model(_cnn_cfg(), 64, 10, (1, 8, 8))
    with pytest.raises(ValueError, match="ModelConfig.pool"):
        build_model(_cnn_cfg(conv_channels=[4], kernel_size=3, pool=7), 64, 10, (1, 8, 8))
    cfg = _cnn_cfg(conv_channels=[4], kernel_size=3)
    cfg.quant.weights, cfg.quant.per_channel, cfg.quant.activations = "fake", True, "fake"
    m = build_model(cfg, 64, 10, (1, 8, 8))
    assert isinstance(m, ql.Cnn) and np.shape(m.weight_quantizers[0].scale) in ((), (4,))
    assert all(q is not None for q in m.activation_quantizers)
    cfg.model.conv_channels = [4, 4, 4]
    with pytest.raises(ValueError, match="ModelConfig.pool: a 2x2 window"):   # refused before loading anything
        ql.run_experiment(cfg)


def test_a_file_of_flat_features_is_refused_before_the_run(tmp_path):
    path = tmp_path / "flat.npz"
    np.savez(path, X=RNG.random((200, 64)).astype(np.float32), y=RNG.integers(0, 3, 200))
    cfg = _cnn_cfg(conv_channels=[4], kernel_size=3)
    cfg.data.dataset, cfg.data.path = "file", str(path)
    with pytest.raises(ValueError, match="the file flat.npz holds flat features"):   # from its header
        ql.run_experiment(cfg)


def _digits_cnn(weights="ternary", epochs=4, **quant):
    cfg = _cnn_cfg(conv_channels=[16], kernel_size=3, pool=2)
    cfg.quant.weights = weights
    for k, v in quant.items():
        setattr(cfg.quant, k, v)
    cfg.optim.epochs, cfg.optim.lr, cfg.metrics_every = epochs, 3e-3, 5
    return cfg


@pytest.mark.slow
def test_ternary_cnn_trains_on_digits_deterministically():
    a = ql.run_experiment(_digits_cnn(epochs=8))
    b = ql.run_experiment(_digits_cnn(epochs=8))
    assert a.status == "finished" and isinstance(a.model, ql.Cnn)
    assert a.final["test_accuracy"] > 0.85
    for key, col in a.history.items():
        if "time" not in key and "per_second" not in key:
            np.testing.assert_array_equal(np.asarray(col, float), np.asarray(b.history[key], float), err_msg=key)
    assert {"sqnr_db_0", "frac_zero_0", "grad_norm_1"} <= set(a.history)


@pytest.mark.slow
@pytest.mark.parametrize("quant", [dict(weights="fake", per_channel=True, scale_mode="lsq"),
                                   dict(weights="fake", activations="fake", ste="tanh"),
                                   dict(weights="float")])
def test_cnn_trains_with_every_kind_of_quantizer(quant):
    res = ql.run_experiment(_digits_cnn(epochs=3, **quant))
    assert res.status == "finished", res.message
    assert res.final["test_accuracy"] > 0.8
    assert math.isfinite(res.final["train_loss"]) and res.final["train_loss"] < 1.0


@pytest.mark.slow
def test_ternary_lenet_trains_on_mnist():
    cfg = _cnn_cfg()
    cfg.data.dataset = "mnist"
    cfg.optim.epochs, cfg.optim.lr, cfg.metrics_every = 2, 1e-3, 20
    res = ql.run_experiment(cfg)
    if res.status == "failed" and "mnist" in res.message.lower() and "not" in res.message.lower():
        pytest.skip(f"mnist is not available: {res.message}")
    assert res.status == "finished", res.message
    assert res.final["test_accuracy"] > 0.9


@pytest.mark.slow
def test_cnn_on_one_dimensional_signals():
    cfg = _cnn_cfg(conv_channels=[16, 16], kernel_size=5, pool=2, hidden=[64])
    cfg.data.dataset = "mnist1d"
    cfg.optim.epochs, cfg.optim.lr, cfg.metrics_every = 3, 3e-3, 20
    cfg.quant.weights = "float"
    res = ql.run_experiment(cfg)
    if res.status == "failed" and "mnist1d" in res.message.lower() and "not" in res.message.lower():
        pytest.skip(f"mnist1d is not available: {res.message}")
    assert res.status == "finished", res.message
    assert res.model.kernel_size == (1, 5)
    assert res.final["test_accuracy"] > 0.4       # 10 classes; the MLP's 68% takes many more epochs
