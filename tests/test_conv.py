"""Conv and pooling kernels and the public layers against slow plain-numpy references."""
import numpy as np
import pytest

import qatlab as ql
from qatlab.kernels import conv as K
from qatlab.kernels.dense import ACT_CODES

RNG = np.random.default_rng(7)


def ref_conv(x, w, b, stride, pad):
    """Direct cross-correlation, float64: y[n, o, i, j] = sum_{c,u,v} xp[n, c, i*sh+u, j*sw+v] w[o, c, u, v] + b[o]."""
    (sh, sw), (ph, pw) = stride, pad
    xp = np.pad(x.astype(np.float64), ((0, 0), (0, 0), (ph, ph), (pw, pw)))
    O, C, kh, kw = w.shape
    OH, OW = (xp.shape[2] - kh) // sh + 1, (xp.shape[3] - kw) // sw + 1
    y = np.zeros((x.shape[0], O, OH, OW))
    for i in range(OH):
        for j in range(OW):
            patch = xp[:, :, i * sh:i * sh + kh, j * sw:j * sw + kw]
            y[:, :, i, j] = np.einsum("ncuv,ocuv->no", patch, w) + b
    return y


def ref_conv_backward(x, w, dy, stride, pad):
    """(dx, dw, db) of ref_conv by scattering each output's gradient over its window, float64."""
    (sh, sw), (ph, pw) = stride, pad
    xp = np.pad(x.astype(np.float64), ((0, 0), (0, 0), (ph, ph), (pw, pw)))
    dxp, dw = np.zeros_like(xp), np.zeros(w.shape)
    O, C, kh, kw = w.shape
    for i in range(dy.shape[2]):
        for j in range(dy.shape[3]):
            g = dy[:, :, i, j].astype(np.float64)
            dw += np.einsum("no,ncuv->ocuv", g, xp[:, :, i * sh:i * sh + kh, j * sw:j * sw + kw])
            dxp[:, :, i * sh:i * sh + kh, j * sw:j * sw + kw] += np.einsum("no,ocuv->ncuv", g, w)
    dx = dxp[:, :, ph:ph + x.shape[2], pw:pw + x.shape[3]]
    return dx, dw, dy.sum(axis=(0, 2, 3))


def ref_im2col(x, kh, kw, sh, sw, ph, pw):
    B, C, H, W = x.shape
    xp = np.pad(x, ((0, 0), (0, 0), (ph, ph), (pw, pw)))
    OH, OW = (H + 2 * ph - kh) // sh + 1, (W + 2 * pw - kw) // sw + 1
    cols = np.zeros((C * kh * kw, B * OH * OW), np.float32)
    for c in range(C):
        for u in range(kh):
            for v in range(kw):
                r = (c * kh + u) * kw + v
                cols[r] = xp[:, c, u:u + sh * (OH - 1) + 1:sh, v:v + sw * (OW - 1) + 1:sw].reshape(-1)
    return cols


def ref_pool(x, kh, kw, sh, sw):
    B, C, H, W = x.shape
    OH, OW = (H - kh) // sh + 1, (W - kw) // sw + 1
    y, idx = np.zeros((B, C, OH, OW), np.float32), np.zeros((B, C, OH, OW), np.int32)
    for b in range(B):
        for c in range(C):
            for i in range(OH):
                for j in range(OW):
                    win = x[b, c, i * sh:i * sh + kh, j * sw:j * sw + kw]
                    k = int(np.argmax(win))    # the first maximum, or the first NaN
                    y[b, c, i, j] = win.flat[k]
                    idx[b, c, i, j] = (i * sh + k // kw) * W + j * sw + k % kw
    return y, idx


GEOMS = [  # (B, C, H, W, O, kernel, stride, padding)
    (2, 3, 9, 7, 4, (3, 3), (1, 1), (0, 0)),
    (3, 2, 10, 11, 5, (3, 2), (2, 1), (1, 2)),
    (2, 1, 1, 20, 3, (1, 5), (1, 1), (0, 2)),     # a 1-d signal: height-1 images
    (2, 2, 6, 6, 3, (3, 3), (2, 2), (1, 1)),
    (1, 1, 5, 5, 2, (5, 5), (1, 1), (0, 0)),      # the kernel covers the image: one output
]


@pytest.mark.parametrize("geom", GEOMS)
def test_im2col_and_col2im_match_numpy(geom):
    B, C, H, W, _, (kh, kw), (sh, sw), (ph, pw) = geom
    x = RNG.standard_normal((B, C, H, W)).astype(np.float32)
    ref = ref_im2col(x, kh, kw, sh, sw, ph, pw)
    cols = np.full_like(ref, np.nan)
    K.im2col(x, kh, kw, sh, sw, ph, pw, 0, B, cols)
    np.testing.assert_array_equal(cols, ref)
    # col2im is im2col's adjoint: <im2col(x), c> == <x, col2im(c)>
    c = RNG.standard_normal(ref.shape).astype(np.float32)
    dx = np.full_like(x, np.nan)
    K.col2im(c, kh, kw, sh, sw, ph, pw, 0, B, dx)
    assert np.isclose(np.vdot(ref.astype(np.float64), c), np.vdot(x.astype(np.float64), dx), rtol=1e-5)
    # a range of images writes those images only
    part = np.zeros_like(ref)
    K.im2col(x, kh, kw, sh, sw, ph, pw, 1, B, part)
    n = ref.shape[1] // B
    np.testing.assert_array_equal(part[:, n:], ref[:, n:])
    assert not part[:, :n].any()


@pytest.mark.parametrize("act", sorted(ACT_CODES))
def test_bias_activation_layout_kernels_match_numpy(act):
    B, O, P = 3, 4, 10
    z = RNG.standard_normal((O, B * P)).astype(np.float32)
    bias = RNG.standard_normal(O).astype(np.float32)
    y = np.full((B, O, P), np.nan, np.float32)
    K.cols_to_nchw(z, bias, ACT_CODES[act], 1, B, y)          # images 1 and 2, then image 0
    assert np.isnan(y[0]).all()
    K.cols_to_nchw(z, bias, ACT_CODES[act], 0, 1, y)
    pre = (z + bias[:, None]).reshape(O, B, P).transpose(1, 0, 2)
    ref = {"identity": pre, "relu": np.maximum(pre, 0), "leaky_relu": np.where(pre < 0, 0.01 * pre, pre),
           "tanh": np.tanh(pre), "sigmoid": 1 / (1 + np.exp(-pre)), "sign": np.sign(pre)}[act]
    np.testing.assert_allclose(y, ref, rtol=1e-6, atol=1e-6)
    dy = RNG.standard_normal((B, O, P)).astype(np.float32)
    deriv = {"identity": 1.0, "sign": 1.0, "relu": (y > 0) * 1.0, "leaky_relu": np.where(y > 0, 1.0, 0.01),
             "tanh": 1 - y * y, "sigmoid": y * (1 - y)}[act]
    dz, db = np.full((O, B * P), np.nan, np.float32), np.empty(O, np.float32)
    K.nchw_to_cols(dy, y, ACT_CODES[act], 1, B, dz, db)      # images 1 and 2 only
    ref_dz = (dy * deriv).transpose(1, 0, 2).reshape(O, B * P)
    assert np.isnan(dz[:, :P]).all()
    np.testing.assert_allclose(dz[:, P:], ref_dz[:, P:], rtol=1e-6, atol=1e-7)
    np.testing.assert_allclose(db, ref_dz[:, P:].astype(np.float64).sum(axis=1), rtol=1e-5, atol=1e-6)


def ref_bias_act_pool(z, bias, relu, B, H, W, kh, kw):
    """Max pool (stride = window) of act(z + bias) laid out as (B, Cout, H, W), with the pool's indices."""
    a = (z + bias[:, None]).reshape(len(bias), B, H, W).transpose(1, 0, 2, 3)
    return ref_pool(np.maximum(a, 0) if relu else np.ascontiguousarray(a), kh, kw, kh, kw)


@pytest.mark.parametrize("act", ["relu", "identity"])
@pytest.mark.parametrize("k", [(2, 2), (1, 2), (3, 2), (2, 3)])
def test_bias_act_pool_and_its_backward_match_numpy(act, k):
    B, O, H, W = 3, 4, 7, 9
    code = ACT_CODES[act]
    z = RNG.integers(-3, 4, (O, B * H * W)).astype(np.float32)      # ties: the first maximum wins
    z[1, 5], z[2, 70], z[3, 100:102] = np.nan, np.inf, (np.inf, -np.inf)
    bias = np.array([0.5, -1, 0, 2], np.float32)
    y_ref, idx_ref = ref_bias_act_pool(z, bias, act == "relu", B, H, W, *k)
    y, idx = np.full_like(y_ref, np.nan), np.full_like(idx_ref, -1)
    K.bias_act_pool(z, bias, code, *k, H, W, 1, B, y, idx)
    K.bias_act_pool(z, bias, code, *k, H, W, 0, 1, y, idx)
    np.testing.assert_array_equal(y, y_ref)
    live = y_ref > 0 if act == "relu" else np.ones(y.shape, bool)
    np.testing.assert_array_equal(idx[live], idx_ref[live])   # a ReLU window with max <= 0 routes no gradient
    dy = RNG.standard_normal(y.shape).astype(np.float32)
    dz, db = np.full((O, B * H * W), np.nan, np.float32), np.empty(O, np.float32)
    K.pool_to_cols(dy, idx, y, code, H * W, 0, B, dz, db)
    # reference: the pool's backward, then the activation's derivative, in the (Cout, B*P) layout
    da = np.zeros((B, O, H, W), np.float32)
    for (b, o, i, j), v in np.ndenumerate(dy):
        da[b, o].flat[idx_ref[b, o, i, j]] += v
    pre = (z + bias[:, None]).reshape(O, B, H, W).transpose(1, 0, 2, 3)
    if act == "relu":
        da = da * (pre > 0)
    ref_dz = da.transpose(1, 0, 2, 3).reshape(O, -1)
    np.testing.assert_array_equal(dz, ref_dz)
    np.testing.assert_allclose(db, ref_dz.astype(np.float64).sum(axis=1), rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("k,s", [((2, 2), (2, 2)), ((1, 2), (1, 2)), ((3, 3), (2, 2)), ((1, 3), (1, 2)),
                                 ((3, 2), (1, 1))])
def test_maxpool_matches_numpy_with_ties_and_nan(k, s):
    x = RNG.integers(-2, 3, (2, 3, 7, 9)).astype(np.float32)     # many ties: the first maximum wins
    x[0, 0, 1, 1] = np.nan
    x[1, 2, 0, 0] = np.nan
    x[1, 1, 0, 2:4] = np.inf, -np.inf
    y_ref, idx_ref = ref_pool(x, *k, *s)
    y, idx = np.empty_like(y_ref), np.empty_like(idx_ref)
    K.maxpool_forward(x, *k, *s, y, idx)
    np.testing.assert_array_equal(y, y_ref)
    np.testing.assert_array_equal(idx, idx_ref)
    dy = RNG.standard_normal(y.shape).astype(np.float32)
    dx = np.full_like(x, np.nan)
    K.maxpool_backward(dy, idx, dx)
    ref = np.zeros_like(x)
    for (b, c, i, j), v in np.ndenumerate(dy):
        ref[b, c].flat[idx[b, c, i, j]] += v
    np.testing.assert_array_equal(dx, ref)


@pytest.mark.parametrize("geom", GEOMS)
def test_conv2d_layer_matches_the_direct_reference(geom):
    B, C, H, W, O, kernel, stride, pad = geom
    conv = ql.Conv2d(C, O, kernel, stride=stride, padding=pad, seed=3)
    conv.bias = RNG.standard_normal(O)
    x = RNG.standard_normal((B, C, H, W)).astype(np.float32)
    y = conv.forward(x)
    np.testing.assert_allclose(y, ref_conv(x, conv.weight, conv.bias, stride, pad), rtol=1e-5, atol=1e-5)
    dy = RNG.standard_normal(y.shape).astype(np.float32)
    dx = conv.backward(dy)
    rdx, rdw, rdb = ref_conv_backward(x, conv.weight, dy, stride, pad)
    np.testing.assert_allclose(dx, rdx, rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(conv.grad_weight, rdw, rtol=1e-5, atol=1e-4)
    np.testing.assert_allclose(conv.grad_bias, rdb, rtol=1e-5, atol=1e-5)
    assert conv.weight.shape == (O, C, *kernel) and conv.grad_weight.shape == conv.weight.shape


def test_conv2d_on_many_images_split_over_the_cores():
    conv = ql.Conv2d(3, 8, 3, padding=1, seed=1)
    x = RNG.standard_normal((64, 3, 40, 40)).astype(np.float32)      # big enough to split over images
    y = conv.forward(x).copy()
    dy = RNG.standard_normal(y.shape).astype(np.float32)
    dx = conv.backward(dy).copy()
    for part in (slice(0, 2), slice(62, 64)):                          # the first and the last range
        np.testing.assert_allclose(y[part], ref_conv(x[part], conv.weight, conv.bias, (1, 1), (1, 1)),
                                   rtol=1e-5, atol=1e-5)
        np.testing.assert_allclose(dx[part], ref_conv_backward(x[part], conv.weight, dy[part], (1, 1), (1, 1))[0],
                                   rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(conv.grad_weight, ref_conv_backward(x, conv.weight, dy, (1, 1), (1, 1))[1],
                               rtol=1e-4, atol=1e-3)


def test_linear_flatten_maxpool_layers():
    lin = ql.Linear(6, 4, seed=2)
    lin.bias = [1, 2, 3, 4]
    x = RNG.standard_normal((5, 6)).astype(np.float32)
    np.testing.assert_allclose(lin.forward(x), x @ lin.weight.T + lin.bias, rtol=1e-6, atol=1e-6)
    dy = RNG.standard_normal((5, 4)).astype(np.float32)
    np.testing.assert_allclose(lin.backward(dy), dy @ lin.weight, rtol=1e-6, atol=1e-6)
    np.testing.assert_allclose(lin.grad_weight, dy.T @ x, rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(lin.grad_bias, dy.sum(0), rtol=1e-6, atol=1e-6)
    flat = ql.Flatten()
    z = RNG.standard_normal((2, 3, 4, 5)).astype(np.float32)
    assert flat.forward(z).shape == (2, 60)
    np.testing.assert_array_equal(flat.backward(flat.forward(z)), z)
    pool = ql.MaxPool2d(2)
    assert pool.stride == (2, 2) and pool.forward(z).shape == (2, 3, 2, 2)


def test_layer_arguments_are_checked():
    with pytest.raises(ValueError, match="in_channels"):
        ql.Conv2d(0, 4, 3)
    with pytest.raises(TypeError, match="out_channels"):
        ql.Conv2d(1, 4.0, 3)
    with pytest.raises(ValueError, match="kernel_size"):
        ql.Conv2d(1, 4, (3, 3, 3))
    with pytest.raises(ValueError, match="stride"):
        ql.Conv2d(1, 4, 3, stride=0)
    with pytest.raises(ValueError, match="padding"):
        ql.Conv2d(1, 4, 3, padding=-1)
    with pytest.raises(ValueError, match="kernel_size"):
        ql.MaxPool2d(0)
    with pytest.raises(ValueError, match="out_features"):
        ql.Linear(3, 0)
    conv = ql.Conv2d(2, 4, 5)
    with pytest.raises(ValueError, match="x: expected shape"):
        conv.forward(np.zeros((1, 3, 8, 8)))
    with pytest.raises(ValueError, match="kernel_size: a 5x5 kernel does not fit a 4x8"):
        conv.forward(np.zeros((1, 2, 4, 8)))
    with pytest.raises(ValueError, match="dy: call forward"):
        conv.backward(np.zeros((1, 4, 4, 4)))
    with pytest.raises(ValueError, match="weight: expected shape"):
        conv.weight = np.zeros((4, 2, 3, 3))
    with pytest.raises(ValueError, match="kernel_size: a 3x3 window"):
        ql.MaxPool2d(3).forward(np.zeros((1, 1, 2, 5)))
    conv.weight = np.ones((4, 2, 5, 5))
    assert conv.weight.dtype == np.float32 and conv.weight.sum() == 200
    for layer, field, bad in [(conv, "weight", np.full((4, 2, 5, 5), np.nan)), (conv, "bias", np.full(4, np.inf)),
                              (ql.Linear(3, 2), "weight", np.full((2, 3), np.nan))]:
        before = getattr(layer, field).copy()
        with pytest.raises(ValueError, match=f"{field}: must hold finite numbers"):
            setattr(layer, field, bad)
        assert np.array_equal(getattr(layer, field), before)
