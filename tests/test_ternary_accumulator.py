"""TernaryGradientAccumulator and its kernels (hash, ternarize, weighted sum of packed trits) vs numpy."""
from __future__ import annotations

import numpy as np
import pytest

from qatlab.config import TernaryConfig
from qatlab.kernels.phase_kernels import draw, mix64, ternarize_stochastic, ternarize_threshold, weighted_trits
from qatlab.train.ternary_accumulator import TernaryGradientAccumulator

F32 = np.float32
U64 = np.uint64
GOLD = U64(0x9E3779B97F4A7C15)


# ----------------------------------------------------------------- numpy references
def mix64_ref(z):
    z = np.asarray(z, dtype=U64).copy()
    z ^= z >> U64(30)
    z *= U64(0xBF58476D1CE4E5B9)
    z ^= z >> U64(27)
    z *= U64(0x94D049BB133111EB)
    return z ^ (z >> U64(31))


def draw_ref(key, idx):
    idx = np.asarray(idx, dtype=U64)
    return mix64_ref(np.full(idx.shape, key, dtype=U64) + (idx + U64(1)) * GOLD)


def pack_ref(q):
    """codes 0 / 1 (+1) / 2 (-1), 4 per byte, element i at bits 2 (i % 4)."""
    codes = np.where(q > 0, 1, np.where(q < 0, 2, 0)).astype(np.uint8)
    codes = np.concatenate([codes, np.zeros(-len(codes) % 4, np.uint8)]).reshape(-1, 4)
    return (codes[:, 0] | codes[:, 1] << 2 | codes[:, 2] << 4 | codes[:, 3] << 6).astype(np.uint8)


def unpack_ref(packed, n):
    codes = np.stack([(packed >> s) & 3 for s in (0, 2, 4, 6)], axis=1).reshape(-1)[:n]
    return np.where(codes == 1, 1, np.where(codes == 2, -1, 0))


def shapes():
    return [("w", (7, 5)), ("b", (7,)), ("v", (2,))]


N = 35 + 7 + 2


def flat(rng, scale=1.0):
    return (scale * rng.standard_normal(N)).astype(F32)


def weighted_ref(acc, coeffs):
    """sum_k coeffs[k] * scales[k, t] * trits_k per tensor, float64, from the unpacked rows."""
    out, b0 = [], 0
    for t, (_, shape) in enumerate(shapes()):
        n = int(np.prod(shape))
        q = np.stack([unpack_ref(acc.packed[k, b0:], n) for k in range(acc.capacity)])
        out.append((coeffs[:, None] * acc.scales[:, t:t + 1].astype(np.float64) * q).sum(0))
        b0 += (n + 3) // 4
    return np.concatenate(out)


# ----------------------------------------------------------------- hash
def test_splitmix64_known_vector():
    """splitmix64 seeded with 1234567 (published test vector)."""
    assert int(draw(U64(1234567), 0)) == 6457827717110365317
    assert int(draw(U64(1234567), 1)) == 3203168211198807973


def test_hash_kernels_match_numpy():
    keys = [0, 1, 2**63 + 5, 2**64 - 1]
    for key in keys:
        idx = np.arange(50)
        got = np.array([int(draw(U64(key), int(i))) for i in idx], dtype=U64)
        np.testing.assert_array_equal(got, draw_ref(U64(key), idx))
        assert int(mix64(U64(key))) == int(mix64_ref([key])[0])


# ----------------------------------------------------------------- ternarize kernels
@pytest.mark.parametrize("n", [1, 4, 13, 64])
def test_ternarize_threshold_matches_numpy(rng, n):
    g = rng.standard_normal(n).astype(F32)
    packed = np.full((n + 3) // 4, 0xFF, np.uint8)
    scale, npos, nneg = ternarize_threshold(g, 0.7, packed)
    g64 = g.astype(np.float64)
    tau = 0.7 * np.abs(g64).mean()
    q = np.where(np.abs(g64) > tau, np.sign(g64), 0)
    np.testing.assert_array_equal(packed, pack_ref(q))
    np.testing.assert_array_equal(unpack_ref(packed, n), q)
    assert scale == pytest.approx(np.abs(g64)[q != 0].mean(), rel=1e-12)
    assert (npos, nneg) == ((q > 0).sum(), (q < 0).sum())


def test_ternarize_threshold_zero_gradient():
    packed = np.full(2, 0xFF, np.uint8)
    assert ternarize_threshold(np.zeros(5, F32), 0.5, packed) == (0.0, 0, 0)
    assert not packed.any()


@pytest.mark.parametrize("n,offset", [(1, 0), (13, 0), (64, 1000)])
def test_ternarize_stochastic_matches_numpy(rng, n, offset):
    g = rng.standard_normal(n).astype(F32)
    key = U64(0xDEADBEEF12345678)
    packed = np.full((n + 3) // 4, 0xFF, np.uint8)
    scale, npos, nneg = ternarize_stochastic(g, key, offset, packed)
    s = np.abs(g).max()
    u = (draw_ref(key, offset + np.arange(n)) >> U64(40)).astype(F32) * F32(2.0 ** -24)
    q = np.where(u < np.abs(g) / s, np.sign(g), 0)
    assert scale == s
    np.testing.assert_array_equal(packed, pack_ref(q))
    assert (npos, nneg) == ((q > 0).sum(), (q < 0).sum())
    assert ternarize_stochastic(np.zeros(n, F32), key, 0, packed)[0] == 0.0 and not packed.any()


def test_weighted_trits_matches_numpy(rng):
    k, n_a, n_b = 3, 9, 6
    trits = rng.integers(-1, 2, size=(k, n_a + n_b))
    packed = np.stack([np.concatenate([pack_ref(t[:n_a]), pack_ref(t[n_a:])]) for t in trits])
    scales = rng.random((k, 2)).astype(F32)
    coeffs = np.array([0.5, 0.0, -2.0])
    out = np.zeros(n_b, F32)
    weighted_trits(packed, scales, coeffs, (n_a + 3) // 4, 1, out)
    ref = (coeffs[:, None] * scales[:, 1:2].astype(np.float64) * trits[:, n_a:]).sum(0)
    np.testing.assert_allclose(out, ref.astype(F32), rtol=1e-7)


# ----------------------------------------------------------------- accumulator
def test_packed_storage_nbytes():
    acc = TernaryGradientAccumulator(8, shapes())
    per_row = (35 + 3) // 4 + (7 + 3) // 4 + (2 + 3) // 4      # 9 + 2 + 1 bytes
    assert acc.packed.shape == (8, per_row) and acc.packed.dtype == np.uint8 and acc.capacity == 8
    assert acc.nbytes == acc.packed.nbytes + acc.scales.nbytes == 8 * per_row + 8 * 3 * 4
    big = TernaryGradientAccumulator(8, [("w", (1000, 1000))])
    assert big.nbytes == 8 * 250_000 + 8 * 4          # 2 MB where float32 would need 32 MB


def test_weighted_sum_formula(rng):
    acc = TernaryGradientAccumulator(3, shapes())
    for slot in range(3):
        acc.write(slot, flat(rng))
    coeffs = np.array([0.25, -1.5, 0.0])
    out = np.full(N, np.nan, F32)
    assert acc.weighted_sum(coeffs, out) is out
    np.testing.assert_allclose(out, weighted_ref(acc, coeffs), rtol=1e-6, atol=1e-7)
    acc.write(2, flat(rng, 1e3))                       # a row with coefficient 0 changes nothing
    np.testing.assert_array_equal(acc.weighted_sum(coeffs, np.zeros(N, F32)), out)


def test_stochastic_rounding_is_unbiased():
    """2000 draws of the same gradient, averaged: the estimate is within its standard error of g."""
    n, k = 512, 2000
    g = (np.random.default_rng(7).standard_normal(n) * np.linspace(0.01, 1, n)).astype(F32)
    acc = TernaryGradientAccumulator(k, [("g", (n,))], TernaryConfig(seed=3))
    for slot in range(k):
        acc.write(slot, g)
    est = acc.weighted_sum(np.full(k, 1.0 / k), np.zeros(n, F32)).astype(np.float64)
    s = np.abs(g).max()
    se = np.sqrt(np.maximum(s * np.abs(g) - g.astype(np.float64) ** 2, 1e-30) / k)
    z = (est - g) / se
    assert np.abs(z).max() < 4.5
    assert abs(z.mean()) < 4 / np.sqrt(n)                 # no systematic bias
    assert 0.8 < z.var() < 1.2                            # the variance is the binomial one


def test_deterministic_mode_uses_threshold_and_is_biased():
    g = np.array([0.05, -0.2, 1.0, -1.0, 0.4, 0.0], F32)          # mean|g| = 0.4417
    acc = TernaryGradientAccumulator(2, [("g", (6,))], TernaryConfig(stochastic_rounding=False, ternary_threshold=0.5))
    acc.write(0, g)
    acc.write(1, g)
    np.testing.assert_array_equal(unpack_ref(acc.packed[0], 6), [0, 0, 1, -1, 1, 0])
    assert acc.scales[0, 0] == pytest.approx(0.8)
    np.testing.assert_array_equal(acc.packed[0], acc.packed[1])   # no randomness
    np.testing.assert_allclose(acc.weighted_sum(np.array([0.5, 0.5]), np.zeros(6, F32)), [0, 0, 0.8, -0.8, 0.8, 0],
                               rtol=1e-6)
    assert acc.last_fractions == pytest.approx((1 / 6, 3 / 6, 2 / 6))
    acc2 = TernaryGradientAccumulator(1, [("g", (6,))], TernaryConfig(stochastic_rounding=False, ternary_threshold=0.0))
    acc2.write(0, g)
    np.testing.assert_array_equal(unpack_ref(acc2.packed[0], 6), [1, -1, 1, -1, 1, 0])


def test_seed_determinism_and_stream(rng):
    g = flat(rng)
    runs = []
    for seed in (0, 0, 1):
        acc = TernaryGradientAccumulator(4, shapes(), TernaryConfig(seed=seed))
        for slot in range(4):
            acc.write(slot, g)
        runs.append(acc.packed.copy())
    np.testing.assert_array_equal(runs[0], runs[1])
    assert not np.array_equal(runs[0], runs[2])
    assert not np.array_equal(runs[0][0], runs[0][1])        # fresh draws for every write
    acc = TernaryGradientAccumulator(4, shapes(), TernaryConfig(seed=0))
    acc.write(0, g)
    acc.write(0, g)                                           # the stream continues: the second draw
    assert np.array_equal(acc.packed[0], runs[0][1])
    acc.reset()
    acc.write(0, g)                                           # and restarts after reset()
    assert np.array_equal(acc.packed[0], runs[0][0])


def test_validation(rng):
    acc = TernaryGradientAccumulator(2, shapes())
    before = acc.packed.copy()
    with pytest.raises(ValueError, match=r"flat: a flat array must be float32 of shape \(44,\)"):
        acc.write(0, np.zeros(43, F32))
    with pytest.raises(ValueError, match="NaN"):
        acc.write(0, np.full(N, np.nan, F32))
    with pytest.raises(ValueError, match=r"slot: must be in \[0, 2\)"):
        acc.write(2, flat(rng))
    np.testing.assert_array_equal(acc.packed, before)
    with pytest.raises(TypeError, match="TernaryConfig"):
        TernaryGradientAccumulator(2, shapes(), config={"seed": 1})
    for bad in (0, 1.5, True):
        with pytest.raises(ValueError, match="capacity"):
            TernaryGradientAccumulator(bad, shapes())
    for field, bad in [("ternary_threshold", -0.1), ("seed", -1)]:
        with pytest.raises(ValueError, match=field):
            TernaryConfig(**{field: bad})
