"""MinMaxObserver and MovingAverageMinMaxObserver: tracked ranges, qparams, errors, state safety."""
from __future__ import annotations

import math

import numpy as np
import pytest

import qatlab as ql
import reference as ref

F32 = np.float32
EPS = float(np.finfo(np.float32).eps)
RANGES = [(-128, 127, True), (-8, 7, True), (-127, 127, True), (-1, 0, True), (-32768, 32767, True),
          (0, 255, False), (0, 15, False), (0, 1, False), (0, 65535, False)]


def batches(rng, n=4, shape=(50,), loc=0.5, scale=3.0):
    return [(rng.standard_normal(shape) * scale + loc).astype(F32) for _ in range(n)]


@pytest.mark.parametrize("qmin,qmax,sym", RANGES)
def test_minmax_per_tensor(rng, qmin, qmax, sym):
    obs = ql.MinMaxObserver()
    bs = batches(rng)
    for b in bs:
        obs.observe(b)
    lo, hi = ref.running_minmax(bs)
    assert (obs.min_val, obs.max_val) == (lo, hi)
    scale, zp = obs.calculate_qparams(qmin, qmax, sym)
    rs, rz = ref.minmax_qparams(lo, hi, qmin, qmax, sym)
    assert type(scale) is float and type(zp) is int
    assert scale == float(rs) and zp == int(rz)
    if sym:
        assert zp == 0
    assert qmin <= zp <= qmax


def test_call_is_observe(rng):
    a, b = ql.MinMaxObserver(), ql.MinMaxObserver()
    for x in batches(rng):
        a(x)
        b.observe(x)
    assert (a.min_val, a.max_val) == (b.min_val, b.max_val)


def test_range_always_includes_zero():
    pos = np.array([2.0, 3.0, 4.0], F32)
    obs = ql.MinMaxObserver()
    obs.observe(pos)
    assert obs.min_val == 2.0  # the raw statistic is kept
    s, zp = obs.calculate_qparams(0, 255, False)
    assert s == float(F32(4.0) / F32(255)) and zp == 0  # [0, 4]: 0 is exactly representable
    s, zp = obs.calculate_qparams(-128, 127, True)
    assert s == float(F32(4.0) / F32(127.5)) and zp == 0
    neg = ql.MinMaxObserver()
    neg.observe(-pos)
    s, zp = neg.calculate_qparams(0, 255, False)
    assert zp == 255 and s == float(F32(4.0) / F32(255))  # [-4, 0]
    fq = ql.FakeQuantize(bits=8, symmetric=False, scale=s, zero_point=zp)
    assert fq.forward(np.zeros(1, F32))[0] == 0.0


@pytest.mark.parametrize("value", [0.0, 1e-12, -1e-12])
def test_scale_floor_is_float32_eps(value):
    obs = ql.MinMaxObserver()
    obs.observe(np.full(10, value, F32))
    for qmin, qmax, sym in RANGES:
        s, zp = obs.calculate_qparams(qmin, qmax, sym)
        assert s == EPS
        assert qmin <= zp <= qmax


def test_affine_zero_point_formula(rng):
    obs = ql.MinMaxObserver()
    obs.observe(np.array([-1.3, 0.2, 2.9], F32))
    s, zp = obs.calculate_qparams(0, 255, False)
    expect_s = (F32(2.9) - F32(-1.3)) / F32(255)
    assert s == float(expect_s)
    assert zp == int(0 - np.rint(F32(-1.3) / expect_s))


@pytest.mark.parametrize("axis", [0, 1, 2, -1])
@pytest.mark.parametrize("qmin,qmax,sym", [(-128, 127, True), (0, 15, False)])
def test_minmax_per_channel(rng, axis, qmin, qmax, sym):
    obs = ql.MinMaxObserver(axis=axis)
    bs = batches(rng, shape=(3, 4, 5))
    bs[1][:, :, 0] = 0.0
    for b in bs:
        obs.observe(b)
    lo, hi = ref.running_minmax(bs, axis=axis)
    assert np.array_equal(obs.min_val, lo) and np.array_equal(obs.max_val, hi)
    scale, zp = obs.calculate_qparams(qmin, qmax, sym)
    rs, rz = ref.minmax_qparams(lo, hi, qmin, qmax, sym)
    assert scale.dtype == np.float32 and zp.dtype == np.int64
    assert scale.shape == zp.shape == (bs[0].shape[axis],)
    assert np.array_equal(scale, rs) and np.array_equal(zp, rz)


def test_per_channel_count_mismatch_leaves_state(rng):
    obs = ql.MinMaxObserver(axis=1)
    obs.observe(rng.standard_normal((2, 3)).astype(F32))
    lo, hi = obs.min_val.copy(), obs.max_val.copy()
    with pytest.raises(ValueError, match="channels"):
        obs.observe(rng.standard_normal((2, 4)).astype(F32))
    assert np.array_equal(obs.min_val, lo) and np.array_equal(obs.max_val, hi)
    with pytest.raises(ValueError, match="axis"):
        obs.observe(np.zeros(5, F32))


# ----------------------------------------------------------------------------- moving average

def test_moving_average_default_constant():
    assert ql.MovingAverageMinMaxObserver().averaging_constant == 0.01


@pytest.mark.parametrize("c", [0.01, 0.3, 1.0])
@pytest.mark.parametrize("axis", [None, 0])
def test_moving_average_seed_and_update(rng, c, axis):
    obs = ql.MovingAverageMinMaxObserver(averaging_constant=c, axis=axis)
    bs = batches(rng, n=6, shape=(4, 30))
    obs.observe(bs[0])
    seed = ref.batch_minmax(bs[0], axis)
    assert np.array_equal(obs.min_val, seed[0]) and np.array_equal(obs.max_val, seed[1])  # first batch seeds
    for b in bs[1:]:
        obs.observe(b)
    lo, hi = ref.moving_average_minmax(bs, c, axis)
    np.testing.assert_allclose(obs.min_val, lo, rtol=1e-14)
    np.testing.assert_allclose(obs.max_val, hi, rtol=1e-14)
    if c == 1.0:
        last = ref.batch_minmax(bs[-1], axis)
        assert np.array_equal(obs.min_val, last[0]) and np.array_equal(obs.max_val, last[1])
    for qmin, qmax, sym in [(-128, 127, True), (0, 255, False)]:
        s, zp = obs.calculate_qparams(qmin, qmax, sym)
        rs, rz = ref.minmax_qparams(lo, hi, qmin, qmax, sym)
        np.testing.assert_allclose(s, rs, rtol=1e-6)
        assert np.all(np.abs(np.asarray(zp) - rz) <= 1)


def test_moving_average_explicit_numbers():
    obs = ql.MovingAverageMinMaxObserver(averaging_constant=0.5)
    obs.observe(np.array([-2.0, 4.0], F32))
    obs.observe(np.array([0.0, 2.0], F32))
    assert (obs.min_val, obs.max_val) == (-1.0, 3.0)
    obs.observe(np.array([-3.0, 3.0], F32))
    assert (obs.min_val, obs.max_val) == (-2.0, 3.0)


@pytest.mark.parametrize("c", [0.0, -0.1, 1.5, float("nan")])
def test_moving_average_bad_constant(c):
    with pytest.raises(ValueError, match="averaging_constant"):
        ql.MovingAverageMinMaxObserver(averaging_constant=c)


# ----------------------------------------------------------------------------- errors and state

@pytest.mark.parametrize("cls", [ql.MinMaxObserver, ql.MovingAverageMinMaxObserver])
def test_error_before_data_and_reset(rng, cls):
    obs = cls()
    with pytest.raises(ValueError, match="observe"):
        obs.calculate_qparams(-128, 127, True)
    obs.observe(rng.standard_normal(10).astype(F32))
    obs.calculate_qparams(-128, 127, True)
    obs.reset()
    assert obs.min_val is None and obs.max_val is None
    with pytest.raises(ValueError, match="observe"):
        obs.calculate_qparams(0, 255, False)
    # after reset, the next batch seeds again
    x = np.array([-1.0, 5.0], F32)
    obs.observe(x)
    assert (obs.min_val, obs.max_val) == (-1.0, 5.0)


@pytest.mark.parametrize("cls", [ql.MinMaxObserver, ql.MovingAverageMinMaxObserver])
@pytest.mark.parametrize("axis", [None, 1])
@pytest.mark.parametrize("bad", [np.nan, np.inf, -np.inf])
def test_nonfinite_raises_and_leaves_state(rng, cls, axis, bad):
    obs = cls(axis=axis)
    x = rng.standard_normal((3, 4)).astype(F32)
    poisoned = x.copy()
    poisoned[1, 2] = bad
    with pytest.raises(ValueError, match="NaN or inf"):
        obs.observe(poisoned)  # first batch: nothing seeded
    assert obs.min_val is None and obs.max_val is None
    obs.observe(x)
    before = (np.copy(obs.min_val), np.copy(obs.max_val), obs.calculate_qparams(0, 255, False))
    with pytest.raises(ValueError, match="NaN or inf"):
        obs.observe(poisoned)
    assert np.array_equal(obs.min_val, before[0]) and np.array_equal(obs.max_val, before[1])
    after = obs.calculate_qparams(0, 255, False)
    assert all(np.array_equal(a, b) for a, b in zip(after, before[2]))
    assert np.all(np.isfinite(after[0]))


def test_empty_and_bad_input():
    obs = ql.MinMaxObserver()
    with pytest.raises(ValueError, match="empty"):
        obs.observe(np.empty(0, F32))
    with pytest.raises(TypeError):
        obs.observe(np.array(["a", "b"]))
    with pytest.raises(TypeError):
        obs.observe(np.array([1j]))
    with pytest.raises(TypeError, match="axis"):
        ql.MinMaxObserver(axis=1.5)
    assert obs.min_val is None


def test_inputs_are_converted_to_float32_first():
    obs = ql.MinMaxObserver()
    x = np.array([0.1, -0.7, 3], np.float64)
    obs.observe(x)
    assert obs.min_val == float(F32(-0.7)) and obs.max_val == 3.0
    obs.observe([1, 2, 30])  # ints / lists convert
    assert obs.max_val == 30.0


def test_calculate_qparams_is_usable_by_fakequantize(rng):
    x = (rng.standard_normal(300) * 4).astype(F32)
    for obs in (ql.MinMaxObserver(), ql.MovingAverageMinMaxObserver(0.1)):
        fq = ql.FakeQuantize(bits=6, symmetric=False, observer=obs)
        s, zp = fq.calibrate(x)
        assert fq.observer is obs and math.isfinite(s) and 0 <= zp <= 63


@pytest.mark.parametrize("qmin,qmax", [(10, 0), (0, 0), (0.0, 255), (True, 5), (0, "255")])
def test_calculate_qparams_checks_the_range(rng, qmin, qmax):
    obs = ql.MinMaxObserver()
    obs.observe(batches(rng)[0])
    with pytest.raises(ValueError, match="qmin, qmax"):
        obs.calculate_qparams(qmin, qmax, False)


@pytest.mark.parametrize("symmetric", [True, False])
def test_a_range_beyond_float32_caps_the_scale(symmetric):
    """PyTorch's scale overflows to inf here (then every output is NaN); ours stops at SCALE_MAX."""
    from qatlab.quant.checks import SCALE_MAX
    fq = ql.FakeQuantize(bits=8, symmetric=symmetric, zero_point=0)
    with np.errstate(all="raise"):
        scale, _ = fq.calibrate(np.array([-3e38, 3e38], F32))
    assert scale == pytest.approx(SCALE_MAX) and fq.scale == scale
    y = fq.forward(np.array([1.0, -1.0, 3e38], F32))
    assert np.all(np.isfinite(y))
    fq.scale = fq.scale                     # the stored scale is one the setter accepts


def test_observer_arguments_of_the_wrong_type():
    with pytest.raises(TypeError, match="axis"):
        ql.MinMaxObserver(axis=True)
    with pytest.raises(TypeError, match="averaging_constant"):
        ql.MovingAverageMinMaxObserver("0.1")
    with pytest.raises(TypeError, match="averaging_constant"):
        ql.MovingAverageMinMaxObserver(True)
