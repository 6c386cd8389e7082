"""Each kernel of qatlab.kernels.dense against a plain numpy reference."""
import numpy as np
import pytest
from hypothesis import given, settings, strategies as st

from qatlab.kernels import dense as K

ACTS = list(K.ACT_CODES)


def ref_act(z, name):
    z = z.astype(np.float32)
    if name == "relu":
        return np.where(z < 0, np.float32(0), z)
    if name == "leaky_relu":
        return np.where(z < 0, z * np.float32(0.01), z)
    if name == "tanh":
        return np.tanh(z)
    if name == "sigmoid":
        return np.float32(1) / (np.float32(1) + np.exp(-z))
    if name == "sign":
        return np.sign(z)
    return z


def ref_act_grad(a, name):
    """d act / dz written in terms of the output a (sign: straight-through, 1)."""
    if name == "relu":
        return (a > 0).astype(np.float32)
    if name == "leaky_relu":
        return np.where(a > 0, np.float32(1), np.float32(0.01))
    if name == "tanh":
        return 1 - a * a
    if name == "sigmoid":
        return a * (1 - a)
    return np.ones_like(a)


def rand(shape, seed=0, scale=2.0):
    z = (np.random.default_rng(seed).standard_normal(shape) * scale).astype(np.float32)
    z.flat[::7] = 0.0  # exact zeros exercise sign(0) and the relu kink
    return z


@pytest.mark.parametrize("name", ACTS)
def test_bias_act_inplace_matches_numpy(name):
    z, b = rand((9, 13)), rand(13, seed=1)
    b[::3] = 0.0
    zb = z + b  # ties: elements where z + b == 0 exactly
    expected = ref_act(zb, name)
    out = z.copy()
    K.bias_act_inplace(out, b, K.ACT_CODES[name])
    np.testing.assert_allclose(out, expected, rtol=2e-6, atol=1e-7)
    if name in ("relu", "leaky_relu", "sign", "identity"):
        np.testing.assert_array_equal(out, expected)


def test_activation_values_at_zero_and_nan():
    z = np.array([[0.0, np.nan, -3.0]], np.float32)
    b = np.zeros(3, np.float32)
    for name, expected in [("sign", [0, np.nan, -1]), ("relu", [0, np.nan, 0]),
                           ("leaky_relu", [0, np.nan, -0.03]), ("sigmoid", [0.5, np.nan, 1 / (1 + np.exp(3))])]:
        out = z.copy()
        K.bias_act_inplace(out, b, K.ACT_CODES[name])
        np.testing.assert_allclose(out[0], np.array(expected, np.float32), rtol=1e-6, err_msg=name)


@pytest.mark.parametrize("name", ACTS)
def test_act_backward_inplace_matches_numpy(name):
    a = ref_act(rand((8, 11), seed=2), name)
    d = rand((8, 11), seed=3)
    db = np.full(11, 123.0, np.float32)  # overwritten, not accumulated
    expected = d * ref_act_grad(a, name)
    K.act_backward_inplace(d, a, K.ACT_CODES[name], db)
    np.testing.assert_allclose(d, expected, rtol=1e-6, atol=1e-7)
    np.testing.assert_allclose(db, expected.sum(axis=0), rtol=1e-5, atol=1e-6)


def test_bias_grad_matches_numpy():
    dz = rand((17, 5), seed=4)
    out = np.full(5, -1.0, np.float32)
    K.bias_grad(dz, out)
    np.testing.assert_allclose(out, dz.sum(axis=0), rtol=1e-5, atol=1e-6)


def ref_xent(logits, labels):
    l64 = logits.astype(np.float64)
    m = l64.max(axis=1, keepdims=True)
    lse = np.log(np.exp(l64 - m).sum(axis=1)) + m[:, 0]
    B = len(labels)
    loss = np.mean(lse - l64[np.arange(B), labels])
    p = np.exp(l64 - lse[:, None])
    p[np.arange(B), labels] -= 1
    return loss, p / B


@pytest.mark.parametrize("shift", [0.0, 1e4, -1e4])
def test_softmax_cross_entropy_matches_numpy_and_is_stable(shift):
    logits = rand((6, 10), seed=5, scale=3.0) + np.float32(shift)
    labels = np.array([0, 9, 3, 3, 1, 7], np.int64)
    d = np.empty_like(logits)
    loss = K.softmax_cross_entropy(logits, labels, d)
    ref_loss, ref_grad = ref_xent(logits, labels)
    assert np.isfinite(loss)
    assert loss == pytest.approx(ref_loss, rel=1e-6, abs=1e-6)
    np.testing.assert_allclose(d, ref_grad, rtol=1e-5, atol=1e-7)
    # loss only (0-row gradient buffer) gives the same number
    assert K.softmax_cross_entropy(logits, labels, np.zeros((0, 10), np.float32)) == loss


def test_softmax_cross_entropy_rejects_bad_labels_before_writing():
    logits = rand((3, 4), seed=6)
    d = np.full((3, 4), 7.0, np.float32)
    with pytest.raises(ValueError, match="labels"):
        K.softmax_cross_entropy(logits, np.array([0, 4, 1]), d)
    with pytest.raises(ValueError, match="labels"):
        K.softmax_cross_entropy(logits, np.array([0, 1, -1]), d)
    assert (d == 7.0).all()


def test_softmax_cross_entropy_nan_logits_give_nan_loss():
    logits = rand((2, 3), seed=7)
    logits[1, 2] = np.nan
    assert np.isnan(K.softmax_cross_entropy(logits, np.array([0, 1]), np.empty_like(logits)))


def test_exp_nonpositive_inplace_is_within_1_02_ulp_of_exp_and_0_below_flt_min():
    x = np.linspace(-87.3, 0.0, 400_000, dtype=np.float32)
    out = x.copy()
    K.exp_nonpositive_inplace(out)
    exact = np.exp(x.astype(np.float64))
    ulp = np.spacing(exact.astype(np.float32)).astype(np.float64)
    assert (np.abs(out - exact) / ulp).max() <= 1.02
    tiny = np.array([-87.34, -87.5, -100.0, -1e30, -0.0], np.float32)
    K.exp_nonpositive_inplace(tiny)
    np.testing.assert_array_equal(tiny, [0, 0, 0, 0, 1])


@pytest.mark.parametrize("B, C, scale", [(70, 10, 3.0), (33, 1000, 60.0), (17, 3, 1e3)])
def test_softmax_cross_entropy_many_rows_wide_range(B, C, scale):
    """More than 16 rows (the log is taken of products of 16 row sums) and exps that underflow."""
    logits = rand((B, C), seed=B, scale=scale)
    labels = np.random.default_rng(C).integers(0, C, B)
    d = np.empty_like(logits)
    loss = K.softmax_cross_entropy(logits, labels, d)
    ref_loss, ref_grad = ref_xent(logits, labels)
    assert loss == pytest.approx(ref_loss, rel=1e-6, abs=1e-6)
    np.testing.assert_allclose(d, ref_grad, rtol=1e-5, atol=1e-9)


@pytest.mark.parametrize("bad", [np.inf, -np.inf])
def test_softmax_cross_entropy_infinite_logits_give_nan_loss(bad):
    logits = rand((20, 3), seed=7)
    logits[17, 1] = bad
    assert np.isnan(K.softmax_cross_entropy(logits, np.zeros(20, np.int64), np.empty_like(logits)))


def test_mse_matches_numpy():
    y, t = rand((5, 3), seed=8), rand((5, 3), seed=9)
    d = np.empty_like(y)
    loss = K.mse(y, t, d)
    diff = y.astype(np.float64) - t
    assert loss == pytest.approx(np.mean(diff ** 2), rel=1e-6)  # the difference is taken in float32
    np.testing.assert_allclose(d, 2 * diff / y.size, rtol=1e-6)
    assert K.mse(y, t, np.zeros((0, 3), np.float32)) == loss


def test_sum_squares_and_scale():
    x = rand(1001, seed=10)
    assert K.sum_squares(x) == pytest.approx(np.sum(x.astype(np.float64) ** 2), rel=1e-12)
    y = x.copy()
    K.scale_inplace(y, 0.25)
    np.testing.assert_array_equal(y, x * np.float32(0.25))


@settings(max_examples=30, deadline=None)
@given(st.integers(1, 9), st.integers(2, 12), st.integers(0, 2**31 - 1))
def test_softmax_gradient_rows_sum_to_zero(B, C, seed):
    logits = rand((B, C), seed=seed, scale=5.0)
    labels = np.random.default_rng(seed).integers(0, C, B)
    d = np.empty_like(logits)
    loss = K.softmax_cross_entropy(logits, labels, d)
    assert loss >= 0
    np.testing.assert_allclose(d.sum(axis=1), 0.0, atol=1e-6)
    assert (d[np.arange(B), labels] <= 0).all()


def test_sign_counts_matches_numpy():
    x = rand(10_001, seed=11)
    x[::7] = 0.0
    x[5] = np.nan
    assert K.sign_counts(x) == (np.count_nonzero(x < 0), np.count_nonzero(x > 0))
    assert K.sign_counts(np.zeros(0, np.float32)) == (0, 0)
    y = rand(300, seed=12)
    y[::3] = 0.0
    assert K.two_sign_counts(x, y) == (*K.sign_counts(x), np.count_nonzero(y < 0), np.count_nonzero(y > 0))


def test_count_correct_matches_numpy_argmax(rng):
    logits = rng.standard_normal((200, 7)).astype(np.float32)
    logits[:20, 3] = logits[:20, 5] = 9.0                       # ties: the first index wins
    logits[20, 2], logits[21, 0], logits[22, :] = np.nan, np.nan, np.nan   # NaN: np.argmax's pick
    logits[23, 4], logits[23, 6] = np.inf, np.nan
    labels = rng.integers(0, 7, 200)
    labels[:10] = 3
    labels[10:20] = 5
    want = int(np.count_nonzero(np.argmax(logits, axis=1) == labels))
    assert K.count_correct(logits, labels) == want
    assert K.count_correct(logits, labels.astype(np.int32)) == want
    assert K.count_correct(logits[:0], labels[:0]) == 0
