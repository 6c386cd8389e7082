"""Conv2d, MaxPool2d and the Cnn against torch.nn.functional, forward and backward, float32 tolerance."""
import numpy as np
import pytest

import qatlab as ql
from qatlab.nn import cross_entropy_loss

torch = pytest.importorskip("torch", reason="torch (the reference) is not installed")
F = torch.nn.functional

RNG = np.random.default_rng(11)
TOL = {"rtol": 1e-5, "atol": 2e-5}


def _t(a, grad=True):
    return torch.tensor(np.array(a, np.float32), requires_grad=grad)


@pytest.mark.parametrize("B,C,H,W,O,kernel,stride,padding", [
    (4, 3, 12, 12, 8, 3, 1, 0),
    (2, 2, 11, 9, 5, (3, 2), (2, 1), (1, 2)),
    (3, 1, 1, 40, 4, (1, 5), 1, (0, 2)),          # one-dimensional signals: height-1 images
    (2, 4, 7, 7, 3, 3, 2, 1),
    (1, 1, 28, 28, 16, 5, 1, 0),
])
def test_conv2d_matches_torch(B, C, H, W, O, kernel, stride, padding):
    conv = ql.Conv2d(C, O, kernel, stride=stride, padding=padding, seed=5)
    conv.bias = RNG.standard_normal(O)
    x = RNG.standard_normal((B, C, H, W)).astype(np.float32)
    xt, wt, bt = _t(x), _t(conv.weight), _t(conv.bias)
    yt = F.conv2d(xt, wt, bt, stride=stride, padding=padding)
    y = conv.forward(x)
    np.testing.assert_allclose(y, yt.detach().numpy(), **TOL)
    dy = RNG.standard_normal(y.shape).astype(np.float32)
    yt.backward(torch.from_numpy(dy))
    np.testing.assert_allclose(conv.backward(dy), xt.grad.numpy(), **TOL)
    np.testing.assert_allclose(conv.grad_weight, wt.grad.numpy(), rtol=1e-5, atol=1e-4)
    np.testing.assert_allclose(conv.grad_bias, bt.grad.numpy(), rtol=1e-5, atol=1e-4)


@pytest.mark.parametrize("kernel,stride", [(2, None), (3, 2), ((1, 3), (1, 2)), ((2, 3), 1)])
def test_max_pool2d_matches_torch(kernel, stride):
    pool = ql.MaxPool2d(kernel, stride)
    x = RNG.standard_normal((2, 3, 9, 10)).astype(np.float32)
    xt = _t(x)
    yt = F.max_pool2d(xt, kernel, stride)
    np.testing.assert_array_equal(pool.forward(x), yt.detach().numpy())
    dy = RNG.standard_normal(yt.shape).astype(np.float32)
    yt.backward(torch.from_numpy(dy))
    np.testing.assert_allclose(pool.backward(dy), xt.grad.numpy(), rtol=1e-6, atol=1e-6)


def _torch_twin(m, x, labels, weights):
    """Logits, loss and leaf tensors of m's forward in torch, with the given (possibly quantized) weights."""
    ws = [_t(w.reshape(s["weight_shape"])) for w, s in zip(weights, m.layer_specs())]
    bs = [_t(m.biases(i)) for i in range(m.num_layers)]
    xt = _t(x.reshape(len(x), *m.image_shape))
    a = xt
    for l in range(m.n_conv):
        a = F.relu(F.conv2d(a, ws[l], bs[l]))
        if m.pool != (1, 1):
            a = F.max_pool2d(a, m.pool)
    a = a.reshape(len(x), -1)
    for i in range(m.n_conv, m.num_layers):
        a = a @ ws[i].T + bs[i]
        if i < m.num_layers - 1:
            a = F.relu(a)
    loss = F.cross_entropy(a, torch.from_numpy(labels))
    loss.backward()
    return a.detach().numpy(), loss.item(), xt, ws, bs


@pytest.mark.parametrize("image,channels,hidden,kernel,pool,batch", [
    ((1, 28, 28), [16, 32], [], 5, 2, 6),        # the LeNet shape of the bench
    ((1, 28, 28), [16, 32], [], 5, 2, 40),       # several chunks of images (the last one partial)
    ((2, 9, 10), [3], [7], 3, 2, 6),
    ((1, 1, 40), [4, 6], [8], 5, 2, 6),          # mnist1d-like signals
    ((1, 8, 8), [4, 5], [], 3, 1, 6),            # digits-like, no pooling
    ((1, 8, 8), [4, 5], [], 3, 1, 35),
])
def test_cnn_matches_a_torch_twin(image, channels, hidden, kernel, pool, batch):
    m = ql.Cnn(image, channels, 10, hidden=hidden, kernel_size=kernel, pool=pool, seed=3)
    for i in range(m.num_layers):
        m.biases(i)[:] = RNG.standard_normal(m.biases(i).shape) * 0.1
    x = RNG.standard_normal((batch, int(np.prod(image)))).astype(np.float32)
    labels = RNG.integers(0, 10, batch)
    s, g = m.scratch(batch + 2), m.gradients(batch + 2)
    out = m.forward(x, s)
    loss = cross_entropy_loss(out, labels, g.d_output_mut())
    dx = m.backward(x, s, g)
    ref, ref_loss, xt, ws, bs = _torch_twin(m, x, labels, [m.weights(i) for i in range(m.num_layers)])
    np.testing.assert_allclose(out, ref, **TOL)
    assert loss == pytest.approx(ref_loss, rel=1e-5)
    np.testing.assert_allclose(dx, xt.grad.numpy().reshape(dx.shape), **TOL)
    for i in range(m.num_layers):
        np.testing.assert_allclose(g.d_weights(i), ws[i].grad.numpy().reshape(g.d_weights(i).shape), **TOL)
        np.testing.assert_allclose(g.d_biases(i), bs[i].grad.numpy(), **TOL)


def _quantizer(kind, ste, w):
    if kind == "ternary":
        return ql.TernaryQuantizer(ste=ste)
    axis = 0 if kind == "per_channel" else None
    q = ql.FakeQuantize(bits=4, symmetric=True, ste=ste, axis=axis, observer=ql.MinMaxObserver(axis=axis))
    q.observer_enabled = True
    return q


@pytest.mark.parametrize("kind", ["per_tensor", "per_channel", "ternary"])
@pytest.mark.parametrize("ste", list(ql.SteKind))
def test_quantized_conv_gradients_follow_the_ste(kind, ste):
    """Forward with quantized weights equals torch's with those weights; the latent gradient is the
    STE (the quantizer's backward) of torch's gradient with respect to the quantized weights."""
    m = ql.Cnn((1, 12, 12), [4, 6], 5, kernel_size=3, pool=2, seed=1)
    m.set_quantizers([_quantizer(kind, ste, m.weights(i)) for i in range(m.num_layers)])
    x = RNG.standard_normal((4, 144)).astype(np.float32)
    labels = RNG.integers(0, 5, 4)
    s, g = m.scratch(4), m.gradients(4)
    out = m.forward(x, s)
    cross_entropy_loss(out, labels, g.d_output_mut())
    m.backward(x, s, g, need_input_grad=False)
    used = [s.weights_used(i).copy() for i in range(m.num_layers)]
    assert not np.array_equal(used[0], m.weights(0))        # the conv really ran on quantized weights
    if kind == "per_channel":   # one scale per output channel of the (Cout, C*k*k) view, as torch's per-channel
        q = m.weight_quantizers[0]
        ref = torch.fake_quantize_per_channel_affine(
            torch.from_numpy(m.conv_weight(0).copy()), torch.from_numpy(np.asarray(q.scale, np.float32)),
            torch.from_numpy(np.asarray(q.zero_point, np.int32)), 0, -8, 7)
        np.testing.assert_array_equal(used[0].reshape(ref.shape), ref.numpy())
    ref, _, _, ws, _ = _torch_twin(m, x, labels, used)
    np.testing.assert_allclose(out, ref, **TOL)
    for i in range(m.num_layers):
        grad_q = ws[i].grad.numpy().reshape(used[i].shape).copy()
        expect = m.weight_quantizers[i].backward(grad_q, m.weights(i), np.empty_like(grad_q))
        np.testing.assert_allclose(g.d_weights(i), expect, rtol=1e-5, atol=2e-5)
