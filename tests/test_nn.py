"""Mlp, Scratch, Gradients and the losses against float64 numpy references and finite differences."""
import gc
import tracemalloc

import numpy as np
import pytest

from qatlab.nn import ACTIVATIONS, Gradients, Mlp, Scratch, accuracy, cross_entropy_loss, mse_loss
from qatlab.optim import Adam

SIZES = [5, 7, 6, 3]


# -- float64 numpy reference ---------------------------------------------------------------------
def act64(z, name):
    return {"relu": lambda: np.maximum(z, 0), "leaky_relu": lambda: np.where(z < 0, 0.01 * z, z),
            "tanh": lambda: np.tanh(z), "sigmoid": lambda: 1 / (1 + np.exp(-z)),
            "sign": lambda: np.sign(z), "identity": lambda: z}[name]()


def dact64(a, name):
    """Derivative in terms of the output; sign is the identity straight-through estimator."""
    return {"relu": lambda: (a > 0) * 1.0, "leaky_relu": lambda: np.where(a > 0, 1.0, 0.01),
            "tanh": lambda: 1 - a * a, "sigmoid": lambda: a * (1 - a)}.get(name, lambda: np.ones_like(a))()


def ref_forward(Ws, bs, x, name, wq=None, aq=None):
    """Returns the output and the per-layer inputs; wq/aq: functions applied to W / hidden h."""
    a, inputs, hs = x.astype(np.float64), [], []
    for i, (W, b) in enumerate(zip(Ws, bs)):
        inputs.append(a)
        Wi = wq(W) if wq else W
        z = a @ Wi.T + b
        if i == len(Ws) - 1:
            return z, inputs, hs
        h = act64(z, name)
        hs.append(h)
        a = aq(h) if aq else h


def ref_backward(Ws, x, name, d_out, wq=None, aq=None, wste=None, aste=None, bs=None):
    """Analytic backprop in float64: returns (dWs latent, dbs, dx)."""
    bs = bs if bs is not None else [np.zeros(W.shape[0]) for W in Ws]
    y, inputs, hs = ref_forward(Ws, bs, x, name, wq, aq)
    dWs, dbs, d = [None] * len(Ws), [None] * len(Ws), d_out.astype(np.float64)
    for i in range(len(Ws) - 1, -1, -1):
        if i < len(Ws) - 1:
            if aste:
                d = d * aste(hs[i])
            d = d * dact64(hs[i], name)
        Wi = wq(Ws[i]) if wq else Ws[i]
        dWq = d.T @ inputs[i]
        dWs[i] = dWq * wste(Ws[i]) if wste else dWq
        dbs[i] = d.sum(axis=0)
        d = d @ Wi
    return dWs, dbs, d


def ref_loss(y, kind, target):
    if kind == "mse":
        return np.mean((y - target) ** 2)
    m = y.max(axis=1, keepdims=True)
    lse = np.log(np.exp(y - m).sum(axis=1)) + m[:, 0]
    return np.mean(lse - y[np.arange(len(target)), target])


def params64(mlp):
    return ([mlp.weights(i).astype(np.float64) for i in range(mlp.num_layers)],
            [mlp.biases(i).astype(np.float64) for i in range(mlp.num_layers)])


def data(B=4, seed=1, sizes=SIZES):
    rng = np.random.default_rng(seed)
    x = rng.standard_normal((B, sizes[0])).astype(np.float32)
    return x, rng.integers(0, sizes[-1], B), rng.standard_normal((B, sizes[-1])).astype(np.float32)


def randomize_biases(mlp, seed=3):
    rng = np.random.default_rng(seed)
    for i in range(mlp.num_layers):
        mlp.biases(i)[:] = rng.standard_normal(mlp.biases(i).shape) * 0.3


def step(mlp, x, kind, labels, target, batch=None, need_input_grad=True):
    sc, g = mlp.scratch(batch or len(x)), mlp.gradients()
    y = mlp.forward(x, sc)
    loss = (cross_entropy_loss(y, labels, g.d_output_mut()) if kind == "xent"
            else mse_loss(y, target, g.d_output_mut()))
    dx = mlp.backward(x, sc, g, need_input_grad=need_input_grad)
    return y, loss, g, dx


# -- construction ------------------------------------------------------------------------------
@pytest.mark.parametrize("sizes, exc", [([64], ValueError), ([64, 0, 10], ValueError), ([], ValueError),
                                        ("64", TypeError), ([64.0, 10], TypeError), (64, TypeError),
                                        ([True, 3], TypeError)])
def test_sizes_validation(sizes, exc):
    with pytest.raises(exc, match="sizes"):
        Mlp(sizes)


def test_name_validation():
    with pytest.raises(ValueError, match="activation.*relu.*gelu"):
        Mlp([2, 2], activation="gelu")
    with pytest.raises(TypeError, match="activation"):
        Mlp([2, 2], activation=None)
    with pytest.raises(ValueError, match="init.*xavier"):
        Mlp([2, 2], init="kaiming")
    with pytest.raises(ValueError, match="weight_quantizers"):
        Mlp([2, 3, 2], weight_quantizers=[None])
    with pytest.raises(ValueError, match="activation_quantizers"):
        Mlp([2, 3, 2], activation_quantizers=[None, None])
    with pytest.raises(TypeError, match="weight_quantizers"):
        Mlp([2, 2], weight_quantizers=[object()])
    with pytest.raises(ValueError, match="seed"):
        Mlp([2, 2], seed=-1)


@pytest.mark.parametrize("activation, init, expected", [
    ("relu", "auto", "he"), ("leaky_relu", "auto", "he"), ("tanh", "auto", "xavier"),
    ("sigmoid", "auto", "xavier"), ("sign", "auto", "xavier"), ("tanh", "he", "he"), ("relu", "xavier", "xavier")])
def test_init_distribution(activation, init, expected):
    mlp = Mlp([400, 300, 200], activation=activation, init=init, seed=3)
    assert mlp.init == expected
    for i, (fan_in, fan_out) in enumerate([(400, 300), (300, 200)]):
        std = np.sqrt(2 / fan_in) if expected == "he" else np.sqrt(2 / (fan_in + fan_out))
        w = mlp.weights(i)
        assert w.dtype == np.float32 and w.flags.c_contiguous and w.shape == (fan_out, fan_in)
        assert abs(w.std() / std - 1) < 0.02 and abs(w.mean()) < 0.01 * std * 10
        assert (mlp.biases(i) == 0).all()


def test_init_is_seeded():
    a, b, c = Mlp([8, 5, 3], seed=1), Mlp([8, 5, 3], seed=1), Mlp([8, 5, 3], seed=2)
    np.testing.assert_array_equal(a.flat_params(), b.flat_params())
    assert not np.array_equal(a.flat_params(), c.flat_params())


def test_parameter_layout_is_one_flat_buffer():
    mlp = Mlp([4, 3, 2])
    names = [n for n, _ in mlp.parameters()]
    assert names == ["w0", "b0", "w1", "b1"]
    assert mlp.param_shapes() == [("w0", (3, 4)), ("b0", (3,)), ("w1", (2, 3)), ("b1", (2,))]
    assert mlp.num_params == 4 * 3 + 3 + 3 * 2 + 2 == mlp.flat_params().size
    np.testing.assert_array_equal(np.concatenate([a.ravel() for _, a in mlp.parameters()]), mlp.flat_params())
    mlp.weights(1)[0, 2] = 42.0
    mlp.biases(0)[1] = -7.0
    assert mlp.flat_params()[12 + 3 + 2] == 42.0 and mlp.flat_params()[12 + 1] == -7.0
    assert mlp.weights(-1) is mlp.weights(1)
    with pytest.raises(ValueError, match="layer"):
        mlp.weights(2)


def test_no_bias():
    mlp = Mlp([4, 3, 2], bias=False, activation="tanh")
    assert [n for n, _ in mlp.parameters()] == ["w0", "w1"] and mlp.biases(0) is None
    x, labels, _ = data(3, sizes=[4, 3, 2])
    y, _, g, _ = step(mlp, x, "xent", labels, None)
    Ws = [mlp.weights(i).astype(np.float64) for i in range(2)]
    ref, _, _ = ref_forward(Ws, [0, 0], x, "tanh")
    np.testing.assert_allclose(y, ref, rtol=1e-5, atol=1e-6)
    assert g.d_biases(0) is None and g.flat().size == mlp.num_params == 4 * 3 + 3 * 2


# -- forward -----------------------------------------------------------------------------------
@pytest.mark.parametrize("name", ACTIVATIONS)
def test_forward_matches_numpy(name):
    mlp = Mlp(SIZES, activation=name, seed=4)
    randomize_biases(mlp)
    x, _, _ = data(6)
    sc = mlp.scratch(8)
    y = mlp.forward(x, sc)
    assert y.shape == (6, 3) and y.dtype == np.float32 and np.shares_memory(y, sc.output())
    ref, _, _ = ref_forward(*params64(mlp), x, name)
    np.testing.assert_allclose(y, ref, rtol=1e-5, atol=1e-5)
    Ws, bs = params64(mlp)
    np.testing.assert_allclose(sc.activations(0), act64(x @ Ws[0].T + bs[0], name), rtol=1e-5, atol=1e-5)
    assert sc.layer_input(1) is sc.activations(0) and sc.weights_used(0) is mlp.weights(0)


def test_forward_input_validation():
    mlp = Mlp([4, 3, 2])
    sc = mlp.scratch(5)
    with pytest.raises(ValueError, match=r"\(batch, 4\).*\(5, 3\)"):
        mlp.forward(np.zeros((5, 3), np.float32), sc)
    with pytest.raises(ValueError, match=r"batch_size|\(6, 4\)"):
        mlp.forward(np.zeros((6, 4), np.float32), sc)
    with pytest.raises(ValueError, match="x"):
        mlp.forward(np.zeros(4, np.float32), sc)
    with pytest.raises(TypeError, match="x"):
        mlp.forward(np.array([["a"] * 4]), sc)
    with pytest.raises(TypeError, match="scratch"):
        mlp.forward(np.zeros((1, 4), np.float32), Mlp([4, 2]).scratch(5))
    x64 = np.random.default_rng(0).standard_normal((5, 4))
    y64 = mlp.forward(x64, sc).copy()
    np.testing.assert_array_equal(y64, mlp.forward(x64.astype(np.float32), sc))
    np.testing.assert_array_equal(y64[:, :], mlp.forward(np.asfortranarray(x64.astype(np.float32)), sc))


def test_smaller_final_batch_uses_leading_rows():
    mlp = Mlp(SIZES, activation="tanh", seed=5)
    x, labels, _ = data(8)
    sc, g = mlp.scratch(8), mlp.gradients()
    mlp.forward(x, sc)
    y = mlp.forward(x[:3], sc)
    assert y.shape == (3, 3) and sc.batch == 3
    loss = cross_entropy_loss(y, labels[:3], g.d_output_mut())
    assert g.d_output_mut().shape == (3, 3)
    dx = mlp.backward(x[:3], sc, g)
    y2, loss2, g2, dx2 = step(mlp, x[:3], "xent", labels[:3], None)
    np.testing.assert_allclose(y, y2, rtol=1e-6)
    assert loss == pytest.approx(loss2)
    np.testing.assert_allclose(g.flat(), g2.flat(), rtol=1e-5, atol=1e-7)
    np.testing.assert_allclose(dx, dx2, rtol=1e-5, atol=1e-7)


# -- gradients vs finite differences -----------------------------------------------------------
def numeric_grads(Ws, bs, x, name, kind, target, eps=1e-6):
    def loss():
        return ref_loss(ref_forward(Ws, bs, x, name)[0], kind, target)
    out = []
    for arr in [a for pair in zip(Ws, bs) for a in pair] + [x]:
        g = np.zeros_like(arr)
        for idx in np.ndindex(arr.shape):
            old = arr[idx]
            arr[idx] = old + eps
            lp = loss()
            arr[idx] = old - eps
            lm = loss()
            arr[idx] = old
            g[idx] = (lp - lm) / (2 * eps)
        out.append(g)
    return out


@pytest.mark.parametrize("kind", ["mse", "xent"])
@pytest.mark.parametrize("name", [a for a in ACTIVATIONS if a != "sign"])
def test_gradients_match_finite_differences(name, kind):
    mlp = Mlp(SIZES, activation=name, seed=6)
    randomize_biases(mlp)
    x, labels, target = data(4, seed=7)
    _, loss, g, dx = step(mlp, x, kind, labels, target)
    Ws, bs = params64(mlp)
    t = labels if kind == "xent" else target.astype(np.float64)
    assert loss == pytest.approx(ref_loss(ref_forward(Ws, bs, x, name)[0], kind, t), rel=1e-5)
    num = numeric_grads(Ws, bs, x.astype(np.float64), name, kind, t)
    analytic = [a for i in range(mlp.num_layers) for a in (g.d_weights(i), g.d_biases(i))] + [dx]
    for a, n in zip(analytic, num):
        np.testing.assert_allclose(a, n, rtol=2e-3, atol=2e-5 * max(1.0, np.abs(n).max()))


def test_sign_activation_uses_straight_through_backward():
    mlp = Mlp(SIZES, activation="sign", seed=8)
    x, labels, _ = data(5, seed=9)
    y, _, g, dx = step(mlp, x, "xent", labels, None)
    Ws, bs = params64(mlp)
    np.testing.assert_allclose(y, ref_forward(Ws, bs, x, "sign")[0], rtol=1e-5, atol=1e-5)
    d_out = g.d_output().astype(np.float64)
    dWs, dbs, dx_ref = ref_backward(Ws, x, "sign", d_out, bs=bs)
    for i in range(mlp.num_layers):
        np.testing.assert_allclose(g.d_weights(i), dWs[i], rtol=1e-5, atol=1e-6)
        np.testing.assert_allclose(g.d_biases(i), dbs[i], rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(dx, dx_ref, rtol=1e-5, atol=1e-6)


# -- quantizers --------------------------------------------------------------------------------
class RoundQuant:
    """Test quantizer: forward round(v / step) * step; backward clipped STE (|v| <= clip)."""

    def __init__(self, step, clip):
        self.step, self.clip, self.seen, self.aliased = np.float32(step), clip, None, None

    def fq(self, v):
        return np.rint(v / self.step) * self.step

    def ste(self, v):
        return (np.abs(v) <= self.clip).astype(np.float64)

    def forward(self, v, out):
        np.multiply(np.rint(v / self.step), self.step, out=out)
        return out

    def backward(self, g, v, out):
        self.seen, self.aliased = v.copy(), out is g
        np.multiply(g, np.abs(v) <= self.clip, out=out)
        return out


def test_weight_quantizer_forward_and_ste_backward():
    qs = [RoundQuant(0.25, 0.3), RoundQuant(0.125, 0.25), RoundQuant(0.5, 0.4)]
    mlp = Mlp(SIZES, activation="tanh", seed=10, weight_quantizers=qs)
    x, labels, _ = data(5, seed=11)
    y, _, g, dx = step(mlp, x, "xent", labels, None)
    Ws, bs = params64(mlp)
    wq = [lambda W, q=q: q.fq(W) for q in qs]
    # forward uses the quantized weights
    y_ref = ref_forward([f(W) for f, W in zip(wq, Ws)], bs, x, "tanh")[0]
    np.testing.assert_allclose(y, y_ref, rtol=1e-5, atol=1e-5)
    assert not np.allclose(y, ref_forward(Ws, bs, x, "tanh")[0], atol=1e-3)
    # latent gradient = dL/dWq (computed with the quantized weights) x STE factor
    for i, q in enumerate(qs):
        Wq = [f(W) for f, W in zip(wq, Ws)]
        dWs, dbs, dx_ref = ref_backward(Wq, x, "tanh", g.d_output().astype(np.float64), bs=bs)
        np.testing.assert_allclose(g.d_weights(i), dWs[i] * q.ste(Ws[i]), rtol=1e-5, atol=1e-6)
        np.testing.assert_allclose(g.d_biases(i), dbs[i], rtol=1e-5, atol=1e-6)
        assert q.aliased and np.array_equal(q.seen, mlp.weights(i))
        assert 0 < (g.d_weights(i) == 0).sum() < g.d_weights(i).size  # the clip acted somewhere
    np.testing.assert_allclose(dx, dx_ref, rtol=1e-5, atol=1e-6)


def test_activation_quantizer_forward_and_ste_backward():
    aqs = [RoundQuant(0.5, 0.6), None]
    mlp = Mlp(SIZES, activation="tanh", seed=12, activation_quantizers=aqs)
    randomize_biases(mlp)
    x, _, target = data(6, seed=13)
    y, _, g, dx = step(mlp, x, "mse", None, target)
    Ws, bs = params64(mlp)
    q = aqs[0]
    layer_aq = iter([q.fq, lambda h: h])
    y_ref, inputs, hs = ref_forward(Ws, bs, x, "tanh", aq=lambda h: next(layer_aq)(h))
    np.testing.assert_allclose(y, y_ref, rtol=1e-5, atol=1e-5)
    # manual backprop: the quantizer sees the pre-quantization h and scales dL/dhq by its STE
    d = g.d_output().astype(np.float64)
    dW2 = d.T @ inputs[2]
    d = (d @ Ws[2]) * dact64(hs[1], "tanh")
    dW1 = d.T @ inputs[1]
    d_hq = d @ Ws[1]
    d = d_hq * q.ste(hs[0]) * dact64(hs[0], "tanh")
    dW0 = d.T @ inputs[0]
    for i, ref in enumerate([dW0, dW1, dW2]):
        np.testing.assert_allclose(g.d_weights(i), ref, rtol=1e-4, atol=1e-6)
    np.testing.assert_allclose(dx, d @ Ws[0], rtol=1e-4, atol=1e-6)
    np.testing.assert_allclose(q.seen, hs[0], rtol=1e-5, atol=1e-6)
    assert q.aliased and 0 < (q.ste(hs[0]) == 0).sum()


# -- Gradients ---------------------------------------------------------------------------------
def test_gradients_buffers_and_views():
    mlp = Mlp([4, 3, 2], seed=14)
    g = mlp.gradients()
    assert isinstance(g, Gradients) and g.flat().size == mlp.num_params
    with pytest.raises(ValueError, match="forward"):
        g.d_output_mut()
    with pytest.raises(ValueError, match="need_input_grad"):
        g.d_input()
    x, labels, _ = data(3, sizes=[4, 3, 2])
    sc = mlp.scratch(3)
    assert isinstance(sc, Scratch)
    mlp.forward(x, sc)
    d = g.d_output_mut()
    assert d.shape == (3, 2) and d.flags.writeable and not g.d_output().flags.writeable
    cross_entropy_loss(sc.output(), labels, d)
    before = g.d_output().copy()
    assert mlp.backward(x, sc, g, need_input_grad=False) is None
    np.testing.assert_array_equal(g.d_output(), before)  # backward leaves dL/dy alone
    with pytest.raises(ValueError):
        g.d_weights(0)[0, 0] = 1.0
    g.d_weights_mut(1)[0, 0] = 5.0
    g.d_biases_mut(0)[2] = 6.0
    assert g.flat()[12 + 3] == 5.0 and g.flat()[12 + 2] == 6.0 and g.d_weights(1)[0, 0] == 5.0
    assert [n for n, _ in g.parameters()] == ["w0", "b0", "w1", "b1"]
    dx = mlp.backward(x, sc, g)
    assert dx.shape == (3, 4) and np.array_equal(dx, g.d_input())
    sized = mlp.gradients(16)
    assert sized.d_output_mut().shape == (3, 2)  # rows of the model's latest forward


def test_backward_requires_forward_and_matching_objects():
    mlp = Mlp([4, 3, 2])
    x = np.zeros((2, 4), np.float32)
    with pytest.raises(ValueError, match="forward"):
        mlp.backward(x, mlp.scratch(2), mlp.gradients(2))
    sc = mlp.scratch(2)
    mlp.forward(x, sc)
    with pytest.raises(TypeError, match="grads"):
        mlp.backward(x, sc, Mlp([4, 5, 2]).gradients(2))
    with pytest.raises(ValueError, match="rows"):
        mlp.backward(x[:1], sc, mlp.gradients(2))


def test_gradient_norm_scale_and_clip():
    mlp = Mlp([4, 3, 2])
    g = mlp.gradients()
    v = np.random.default_rng(15).standard_normal(g.flat().size).astype(np.float32)
    g.flat()[:] = v
    norm = np.sqrt(np.sum(v.astype(np.float64) ** 2))
    assert g.global_l2_norm_params() == pytest.approx(norm, rel=1e-12)
    assert g.clip_global_norm_params(norm * 2) == pytest.approx(norm)
    np.testing.assert_array_equal(g.flat(), v)  # below the threshold: untouched
    assert g.clip_global_norm_params(1.0) == pytest.approx(norm)
    assert g.global_l2_norm_params() == pytest.approx(1.0, rel=1e-5)
    np.testing.assert_allclose(g.flat(), v / (norm + 1e-6), rtol=1e-6)
    for bad in (0.0, -1.0, float("nan"), "1"):
        with pytest.raises(ValueError, match="max_norm"):
            g.clip_global_norm_params(bad)
    g.scale_params(2.0)
    np.testing.assert_allclose(g.flat(), 2 * v / (norm + 1e-6), rtol=1e-6)
    with pytest.raises(ValueError, match="s"):
        g.scale_params(float("inf"))
    g.zero_params()
    assert not g.flat().any() and g.global_l2_norm_params() == 0.0


# -- losses ------------------------------------------------------------------------------------
def central_diff(f, y, eps):
    g = np.zeros(y.shape)
    for idx in np.ndindex(y.shape):
        old = y[idx]
        y[idx] = old + eps
        lp = f(y)
        y[idx] = old - eps
        lm = f(y)
        y[idx] = old
        g[idx] = (lp - lm) / (2 * eps)
    return g


def test_mse_loss():
    rng = np.random.default_rng(16)
    y, t = rng.standard_normal((4, 3)).astype(np.float32), rng.standard_normal((4, 3)).astype(np.float32)
    d = np.empty_like(y)
    loss = mse_loss(y, t, d)
    assert loss == pytest.approx(np.mean((y.astype(np.float64) - t) ** 2), rel=1e-6)
    np.testing.assert_allclose(d, 2 * (y - t) / 12, rtol=1e-6)
    num = central_diff(lambda v: mse_loss(v, t), y, np.float32(2 ** -8))
    np.testing.assert_allclose(d, num, rtol=1e-4, atol=1e-6)
    assert mse_loss(y.astype(np.float64), t) == pytest.approx(loss)
    with pytest.raises(ValueError, match="target"):
        mse_loss(y, t[:2])
    with pytest.raises(ValueError, match="d_out"):
        mse_loss(y, t, np.empty((4, 2), np.float32))
    with pytest.raises(TypeError, match="d_out"):
        mse_loss(y, t, np.empty((4, 3)))


def test_cross_entropy_loss():
    rng = np.random.default_rng(17)
    y = (rng.standard_normal((5, 4)) * 3).astype(np.float32)
    labels = np.array([0, 3, 2, 2, 1])
    d = np.empty_like(y)
    loss = cross_entropy_loss(y, labels, d)
    assert loss == pytest.approx(ref_loss(y.astype(np.float64), "xent", labels), rel=1e-6)
    p = np.exp(y - y.max(1, keepdims=True))
    p /= p.sum(1, keepdims=True)
    p[np.arange(5), labels] -= 1
    np.testing.assert_allclose(d, p / 5, rtol=1e-5, atol=1e-7)
    num = central_diff(lambda v: cross_entropy_loss(v, labels), y, np.float32(2 ** -10))
    np.testing.assert_allclose(d, num, rtol=1e-3, atol=1e-5)
    assert cross_entropy_loss(y, labels.astype(np.int32)) == pytest.approx(loss)
    with pytest.raises(TypeError, match="labels"):
        cross_entropy_loss(y, labels.astype(np.float64))
    with pytest.raises(ValueError, match="labels"):
        cross_entropy_loss(y, labels[:3])
    with pytest.raises(ValueError, match="labels"):
        cross_entropy_loss(y, np.array([0, 1, 2, 3, 4]))


def test_accuracy_ties_to_lowest_index():
    logits = np.array([[1, 1, 0], [0, 2, 2], [3, 0, 0]], np.float32)
    assert accuracy(logits, np.array([0, 1, 0])) == 1.0
    assert accuracy(logits, np.array([1, 2, 0])) == pytest.approx(1 / 3)


# -- hot path ----------------------------------------------------------------------------------
class Ternary:
    """absmean ternary weights, identity STE, writing into preallocated buffers only."""

    def forward(self, w, out):
        np.abs(w, out=out)
        s = out.mean() + np.float32(1e-8)
        np.multiply(w, np.float32(1) / s, out=out)
        np.rint(out, out=out)
        np.clip(out, -1, 1, out=out)
        out *= s
        return out

    def backward(self, g, w, out):
        return out


def test_training_step_does_not_allocate_arrays():
    mlp = Mlp([64, 256, 10], seed=0, weight_quantizers=[Ternary(), Ternary()])
    x, labels, _ = data(64, sizes=[64, 256, 10])
    sc, g = mlp.scratch(64), mlp.gradients(64)
    opt = Adam(mlp.flat_params(), 1e-3, max_grad_norm=1.0)

    def train_step():
        y = mlp.forward(x, sc)
        loss = cross_entropy_loss(y, labels, g.d_output_mut())
        mlp.backward(x, sc, g, need_input_grad=False)
        opt.step(g.flat())
        return loss

    first = train_step()
    # tracemalloc counts Python objects too: right after a full collection (automatic, somewhere in
    # a long test session) the next few dozen steps leave up to 7.8 kB of them alive (measured:
    # numpy's fromnumeric wrappers, 4.8 kB), after 50 steps 1.3 kB. So: collect, keep the collector
    # off, take 100 warm-up steps, then measure.
    gc.collect()
    gc.disable()
    try:
        for _ in range(100):
            train_step()
        tracemalloc.start()
        for _ in range(20):
            last = train_step()
        _, peak = tracemalloc.get_traced_memory()
        tracemalloc.stop()
    finally:
        gc.enable()
    assert peak < 4096, peak  # the smallest buffer here (the 64 x 10 output) is 2560 bytes
    assert last < first


@pytest.mark.parametrize("parts", [2, 3])
def test_large_products_split_across_cores_match_one_thread(force_split, parts):
    """Above parallel.MIN_MACS the dense products run as blocks on several threads (column blocks
    of ``x @ W.T``, row blocks of the gradient products); the forward, the gradients and dL/dx
    agree with the one-thread products to float32 rounding, and bit for bit with the same blocks
    on one core."""
    from qatlab.runtime import parallel
    sizes = [40, 96, 7]
    mlp = Mlp(sizes, activation="relu", seed=11)
    randomize_biases(mlp)
    x, labels, _ = data(70, seed=12, sizes=sizes)
    y1, loss1, g1, dx1 = step(mlp, x, "xent", labels, None)
    splits = force_split(parts, MIN_MACS=1)
    y2, loss2, g2, dx2 = step(mlp, x, "xent", labels, None)
    # (blocks, threads): layer 0's forward: 96 columns of W0.T in 3 blocks of >= 32; backward: dW1 = dY.T @ h
    # has 7 rows (too few to split), d_prev = dY @ W1 70 rows (2 blocks), dW0 = dH.T @ x 96 rows, dx 70 rows
    assert splits == [(3, min(parts, 3)), (2, 2), (3, min(parts, 3)), (2, 2)]
    np.testing.assert_allclose(y2, y1, rtol=1e-5, atol=1e-6)
    assert loss2 == pytest.approx(loss1, rel=1e-6)
    np.testing.assert_allclose(g2.flat(), g1.flat(), rtol=1e-5, atol=1e-7)
    np.testing.assert_allclose(dx2, dx1, rtol=1e-5, atol=1e-7)
    splits_one = force_split(1, MIN_MACS=1)   # one core: the same blocks one after the other, the same bits
    y4, loss4, g4, dx4 = step(mlp, x, "xent", labels, None)
    assert [n for n, _ in splits_one] == [3, 2, 3, 2] and {p for _, p in splits_one} == {1}
    assert np.array_equal(y4, y2) and loss4 == loss2 and np.array_equal(g4.flat(), g2.flat())
    assert np.array_equal(dx4, dx2)
    force_split(parts, MIN_MACS=1)
    with parallel._splitting:            # another thread's split holds the pool: same slices, serially
        y3, loss3, g3, dx3 = step(mlp, x, "xent", labels, None)
    assert np.array_equal(y3, y2) and loss3 == loss2 and np.array_equal(g3.flat(), g2.flat())
    assert np.array_equal(dx3, dx2)
