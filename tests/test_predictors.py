"""Gradient predictors, their correction, ParamLayout, and the vector kernels they use."""
from __future__ import annotations

import math

import numpy as np
import pytest

from qatlab.config import PredictionConfig
from qatlab.kernels.dense import sum_squares
from qatlab.kernels.phase_kernels import (all_finite, anchor_trend, clamp01, compare_vectors, copy_sum_squares,
                                          fold_correction, norms3, relative_error_cosine, weighted_rows)
from qatlab.train.predictors import (LeastSquaresPredictor, MomentumPredictor, ParamLayout, make_predictor)

F32 = np.float32


def vec(rng, n=64):
    return rng.standard_normal(n).astype(F32)


# ----------------------------------------------------------------- kernels vs numpy
def test_all_finite_kernel(rng):
    x = vec(rng, 100)
    assert all_finite(x) == np.isfinite(x).all()
    for bad in (np.nan, np.inf, -np.inf):
        y = x.copy()
        y[37] = bad
        assert not all_finite(y)
    assert all_finite(np.zeros(0, F32))
    assert all_finite(np.array([np.finfo(F32).max, -np.finfo(F32).max, 1e-45, -0.0], F32))


def test_compare_vectors_kernel(rng):
    a, p = vec(rng), vec(rng)
    out = np.zeros(4)
    compare_vectors(a, p, out)
    a64, p64 = a.astype(np.float64), p.astype(np.float64)
    np.testing.assert_allclose(out, [a64 @ p64, a64 @ a64, p64 @ p64, (a64 - p64) @ (a64 - p64)], rtol=1e-12)


@pytest.mark.parametrize("n", [0, 3, 8, 1003])
def test_sum_squares_and_copy_kernels(rng, n):
    x = vec(rng, n)
    ref = np.sum(x.astype(np.float64) ** 2)
    assert sum_squares(x) == pytest.approx(ref, rel=1e-12)
    dst = np.full(n, 7.0, F32)
    assert copy_sum_squares(x, dst) == pytest.approx(ref, rel=1e-12)
    np.testing.assert_array_equal(dst, x)
    if n:
        for bad in (np.nan, np.inf):
            y = x.copy()
            y[n // 2] = bad
            assert not math.isfinite(copy_sum_squares(y, dst)) and not math.isfinite(sum_squares(y))


@pytest.mark.parametrize("k,s", [(0.0, 0.0), (3.0, 0.0), (0.0, 0.7), (2.5, 0.7)])
def test_anchor_trend_kernel(rng, k, s):
    anchor, trend, corr = vec(rng), vec(rng), vec(rng)
    out = np.zeros(64, F32)
    ss = anchor_trend(anchor, trend, k, corr, s, out)
    ref = anchor + F32(k) * trend + F32(s) * corr                # float32, left to right
    np.testing.assert_array_equal(out, ref)
    assert ss == pytest.approx(np.sum(ref.astype(np.float64) ** 2), rel=1e-12)


@pytest.mark.parametrize("scores, want", [
    ([3.0, 4.0, 9.0, 2.0], (math.sqrt(2.0 / 4.0), 3.0 / math.sqrt(36.0))),
    ([0.0, 0.0, 0.0, 0.0], (0.0, 1.0)),          # both zero: no error, same direction
    ([0.0, 0.0, 5.0, 5.0], (math.inf, 0.0)),     # a = 0, p not: infinite relative error
    ([0.0, 4.0, 0.0, 4.0], (1.0, 0.0))])         # p = 0
def test_relative_error_cosine_kernel(scores, want):
    assert relative_error_cosine(np.array(scores)) == want


@pytest.mark.parametrize("v, want", [(-2.0, 0.0), (-0.0, -0.0), (0.25, 0.25), (1.0, 1.0), (7.0, 1.0)])
def test_clamp01_kernel_is_pythons_min_max(v, want):
    got = clamp01(v)
    assert got == want == min(max(v, 0.0), 1.0) and math.copysign(1, got) == math.copysign(1, min(max(v, 0.0), 1.0))
    assert math.isnan(clamp01(math.nan)) and math.isnan(min(max(math.nan, 0.0), 1.0))


def test_norms3_kernel(rng):
    a, b, c = (rng.standard_normal(1000).astype(F32) * s for s in (1.0, 0.01, 30.0))
    got = norms3(a, b, c)
    for x, v in zip((a, b, c), got):
        assert v == pytest.approx(np.linalg.norm(x.astype(np.float64)), rel=1e-12)
    assert norms3(a[:0], b[:0], c[:0]) == (0.0, 0.0, 0.0)


@pytest.mark.parametrize("h, n", [(1, 64), (2, 64), (5, 64), (3, 1300), (2, 512)])
def test_weighted_rows_kernel(rng, h, n):
    rows = rng.standard_normal((h, n)).astype(F32)     # n = 1300: three chunks, the last partial
    coeffs = rng.standard_normal(h)
    coeffs[0] = 0.0                              # skipped rows add nothing
    out = np.full(n, 9.0, F32)
    weighted_rows(rows, coeffs, out)
    ref = np.zeros(n)
    for i in range(h):
        ref = ref + coeffs[i] * rows[i].astype(np.float64)
    np.testing.assert_array_equal(out, ref.astype(F32))


def test_fold_correction_kernel(rng):
    corr, a, p = vec(rng), vec(rng), vec(rng)
    ref = (0.9 * corr.astype(np.float64) + 0.5 * (a.astype(np.float64) - p.astype(np.float64))).astype(F32)
    fold_correction(corr, 0.9, a, p, 0.5)
    np.testing.assert_array_equal(corr, ref)


# ----------------------------------------------------------------- layout
def test_layout_offsets_and_views():
    lay = ParamLayout([("w", (3, 4)), ("b", (4,)), ("s", ())])
    assert lay.size == 17 and list(lay.offsets) == [0, 12, 16, 17]
    flat = np.arange(17, dtype=F32)
    v = lay.views(flat)
    assert v["w"].shape == (3, 4) and v["s"].shape == () and v["b"][0] == 12
    v["b"][0] = -1
    assert flat[12] == -1


@pytest.mark.parametrize("shapes", [[], [("w", (0,))], [("w", (2,)), ("w", (3,))], [("", (2,))],
                                    [("w", (2.0,))], "nonsense", [("w", (True,))]])
def test_layout_rejects_bad_shapes(shapes):
    with pytest.raises(ValueError, match="param_shapes"):
        ParamLayout(shapes)


def test_layout_check_messages():
    lay = ParamLayout([("w", (3, 4)), ("b", (4,))])
    good = {"w": np.zeros((3, 4), F32), "b": np.zeros(4, F32)}
    assert [f.shape for f in lay.check(good)] == [(12,), (4,)]
    with pytest.raises(ValueError, match=r"grads\['w'\]: expected shape \(3, 4\), got \(4, 3\)"):
        lay.check({**good, "w": np.zeros((4, 3), F32)})
    with pytest.raises(ValueError, match=r"grads\['b'\]: must be a float32 ndarray, got float64"):
        lay.check({**good, "b": np.zeros(4)})
    with pytest.raises(ValueError, match=r"missing \['b'\], unknown \['c'\]"):
        lay.check({"w": good["w"], "c": good["b"]})
    with pytest.raises(ValueError, match=r"grads\['b'\]: contains NaN or inf"):
        lay.check({**good, "b": np.array([0, np.inf, 0, 0], F32)})
    with pytest.raises(ValueError, match="must be a dict"):
        lay.check([good["w"], good["b"]])


# ----------------------------------------------------------------- momentum
def cfg(**kw):
    return PredictionConfig(**kw)


def push_blocks(p, blocks):
    """blocks: list of [(grad, step), ...]; each list is one block (pushed, then closed)."""
    for block in blocks:
        for g, t in block:
            p.push(g, t)
        p.close_block()


def block_means(blocks):
    """(means float64, mean steps) of the blocks: the slow reference of close_block."""
    return ([np.mean([g.astype(np.float64) for g, _ in b], axis=0) for b in blocks],
            [float(np.mean([s for _, s in b])) for b in blocks])


def momentum_reference(anchor, t1, blocks, t, m):
    """g1 + m (k / (T1 - T2)) (G1 - G2) from the raw block contents (float64)."""
    if len(blocks) < 2:
        return anchor.astype(np.float64)
    means, times = block_means(blocks)
    return anchor.astype(np.float64) + m * (t - t1) / (times[-1] - times[-2]) * (means[-1] - means[-2])


def test_momentum_exact_formula_one_step_ahead(rng):
    """Single-gradient blocks at consecutive steps: one step ahead it is g1 + m (g1 - g2)."""
    m = 0.9
    p = MomentumPredictor(64, cfg(momentum=m))
    g2, g1 = vec(rng), vec(rng)
    push_blocks(p, [[(g2, 10)], [(g1, 11)]])
    out = p.predict(12, np.zeros(64, F32))
    ref = g1.astype(np.float64) + m * (g1.astype(np.float64) - g2.astype(np.float64))
    np.testing.assert_allclose(out, ref, rtol=1e-6, atol=1e-6)


def test_momentum_extrapolates_with_step_count(rng):
    m = 0.5
    p = MomentumPredictor(64, cfg(momentum=m))
    g2, g1 = vec(rng), vec(rng)
    push_blocks(p, [[(g2, 4)], [(g1, 7)]])              # gap 3
    preds = [p.predict(t, np.zeros(64, F32)).copy() for t in (8, 9, 12)]
    for t, out in zip((8, 9, 12), preds):
        ref = g1 + m * (t - 7) / 3 * (g1.astype(np.float64) - g2)
        np.testing.assert_allclose(out, ref, rtol=1e-5, atol=1e-5)
    assert not np.array_equal(preds[0], preds[1])


def test_momentum_block_means_and_anchor(rng):
    """Trend between block means, extrapolated from the newest real gradient (the anchor)."""
    m = 0.9
    p = MomentumPredictor(64, cfg(momentum=m))
    blocks = [[(vec(rng), s) for s in range(0, 4)], [(vec(rng), s) for s in range(10, 14)],
              [(vec(rng), s) for s in range(20, 23)]]
    push_blocks(p, blocks)
    gc = vec(rng)
    p.push(gc, 30, block=False)                         # a CORRECT gradient: anchor only, no block
    assert p.block_count == 0 and p.count == 2 and p.newest_step == 30
    for t in (31, 35):
        out = p.predict(t, np.zeros(64, F32))
        np.testing.assert_allclose(out, momentum_reference(gc, 30, blocks, t, m), rtol=1e-5, atol=1e-5)
    g_open = [(vec(rng), s) for s in (40, 41)]          # an open block is closed by the next prediction
    for g, s in g_open:
        p.push(g, s)
    out = p.predict(44, np.zeros(64, F32))
    np.testing.assert_allclose(out, momentum_reference(g_open[-1][0], 41, blocks + [g_open], 44, m),
                               rtol=1e-5, atol=1e-5)


def test_momentum_single_block_and_ring(rng):
    p = MomentumPredictor(64, cfg())
    with pytest.raises(RuntimeError, match="no real gradient"):
        p.predict(0, np.zeros(64, F32))
    g = vec(rng)
    p.push(g, 0)
    np.testing.assert_array_equal(p.predict(5, np.zeros(64, F32)), g)     # one block: no trend
    gs = [vec(rng) for _ in range(3)]
    push_blocks(p, [[(gi, t)] for t, gi in enumerate(gs, start=6)])
    out = p.predict(9, np.zeros(64, F32))     # uses the last two blocks only
    np.testing.assert_allclose(out, gs[2] + 0.9 * (gs[2].astype(np.float64) - gs[1]), rtol=1e-5, atol=1e-5)
    assert p.nbytes == 2 * 64 * 4 + 2 * 8 + 4 * 64 * 4     # entries + steps + anchor, open block, trend, correction
    p.reset()
    with pytest.raises(RuntimeError, match="no real gradient"):
        p.predict(0, np.zeros(64, F32))


def test_push_requires_increasing_steps(rng):
    p = MomentumPredictor(8, cfg())
    p.push(vec(rng, 8), 3)
    with pytest.raises(ValueError, match="step: must increase"):
        p.push(vec(rng, 8), 3)


# ----------------------------------------------------------------- least squares
def ls_reference(anchor, t1, blocks, t, decay, history_size):
    """anchor + b (t - t1), b the per-element slope of np.polyfit over the last history_size
    block means with weights decay^age (polyfit squares its w)."""
    means, times = block_means(blocks[-history_size:])
    x = np.array(times) - times[-1]
    w = decay ** (-x)
    b, _ = np.polyfit(x, np.array(means), 1, w=np.sqrt(w))
    return anchor.astype(np.float64) + b * (t - t1)


@pytest.mark.parametrize("decay,steps", [(0.95, [0, 1, 2, 3, 4, 5, 6]), (0.5, [0, 1, 2, 12, 13, 14, 24]),
                                         (1.0, [3, 4, 5, 9])])
def test_least_squares_matches_weighted_polyfit(rng, decay, steps):
    h = 5
    p = LeastSquaresPredictor(64, cfg(history_size=h, history_decay=decay))
    base, slope = vec(rng), vec(rng)
    blocks = [[(base + 0.1 * s * slope + 0.3 * vec(rng), 3 * s), (base + 0.1 * s * slope + 0.3 * vec(rng), 3 * s + 1)]
              for s in steps]                         # blocks of two gradients, mean step 3 s + 0.5
    push_blocks(p, blocks)
    anchor, t1 = vec(rng), 3 * steps[-1] + 5
    p.push(anchor, t1, block=False)
    for t in (t1 + 1, t1 + 7):
        out = p.predict(t, np.zeros(64, F32))
        np.testing.assert_allclose(out, ls_reference(anchor, t1, blocks, t, decay, h), rtol=1e-4, atol=1e-4)


def test_least_squares_exact_on_linear_trend(rng):
    p = LeastSquaresPredictor(64, cfg(history_size=4))
    a, b = vec(rng), vec(rng)
    push_blocks(p, [[(a + s * b, s)] for s in range(4)])
    out = p.predict(10, np.zeros(64, F32))
    np.testing.assert_allclose(out, a + 10 * b.astype(np.float64), rtol=1e-4, atol=1e-4)
    assert not np.allclose(out, p.predict(11, np.zeros(64, F32)))   # moves with the step
    assert p.nbytes == 4 * 64 * 4 + 4 * 8 + 4 * 64 * 4
    q = LeastSquaresPredictor(64, cfg(history_size=4))
    push_blocks(q, [[(a, 0)]])
    np.testing.assert_array_equal(q.predict(3, np.zeros(64, F32)), a)     # one entry: no slope


def test_make_predictor():
    assert isinstance(make_predictor("momentum", 4, cfg()), MomentumPredictor)
    assert isinstance(make_predictor("least_squares", 4, cfg()), LeastSquaresPredictor)
    with pytest.raises(ValueError, match="predictor"):
        make_predictor("newton", 4, cfg())


# ----------------------------------------------------------------- correction
def test_fold_then_decayed_correction(rng):
    w, decay = 0.5, 0.8
    p = MomentumPredictor(64, cfg(momentum=0.0, correction_weight=w, history_decay=decay, residual_threshold=10.0))
    g = vec(rng)
    p.push(g, 0)
    pred = p.predict(3, np.zeros(64, F32))          # = g (m = 0, no correction yet)
    actual = g + 0.2 * vec(rng)
    res = p.fold(actual, pred, 3)
    e = actual.astype(np.float64) - g
    assert res.step == 3 and not res.reset
    assert res.relative_error == pytest.approx(np.linalg.norm(e) / np.linalg.norm(actual.astype(np.float64)), rel=1e-9)
    a64 = actual.astype(np.float64)
    assert res.cosine == pytest.approx(a64 @ g / np.linalg.norm(a64) / np.linalg.norm(g.astype(np.float64)), rel=1e-9)
    np.testing.assert_allclose(p.correction, w * e, rtol=1e-6, atol=1e-7)
    # applied to following predictions, decayed by history_decay per step
    out = p.predict(5, np.zeros(64, F32))
    np.testing.assert_allclose(out, g + decay ** 2 * w * e, rtol=1e-5, atol=1e-6)
    # a second fold: c = decay^(t - t_c) c + w (a - p)
    actual2 = g + 0.2 * vec(rng)
    res2 = p.fold(actual2, out, 5)
    assert not res2.reset
    ref = decay ** 2 * (w * e) + w * (actual2.astype(np.float64) - out)
    np.testing.assert_allclose(p.correction, ref, rtol=1e-5, atol=1e-6)


def test_large_error_resets_residual(rng):
    p = MomentumPredictor(64, cfg(momentum=0.0, residual_threshold=0.5, correction_weight=1.0))
    g = vec(rng)
    p.push(g, 0)
    pred = p.predict(1, np.zeros(64, F32))
    p.fold(g + 0.1 * vec(rng), pred, 1)
    assert np.any(p.correction != 0)
    res = p.fold(-g, p.predict(2, np.zeros(64, F32)), 2)     # relative error ~2 > 0.5
    assert res.reset and res.relative_error > 0.5 and res.cosine < 0
    assert not np.any(p.correction) and p.correction_scale(3) == 0.0
    np.testing.assert_array_equal(p.predict(3, np.zeros(64, F32)), g)


def test_correction_weight_zero_learns_nothing(rng):
    p = MomentumPredictor(64, cfg(correction_weight=0.0, residual_threshold=1e9))
    g = vec(rng)
    p.push(g, 0)
    p.fold(vec(rng), p.predict(1, np.zeros(64, F32)), 1)
    assert not np.any(p.correction)


def test_learned_gain_is_the_clamped_least_squares_scale_over_all_corrections(rng):
    """gain = clamp(sum a.p / sum p.p, 0, 1) over every fold since reset; 1 before the first."""
    p = MomentumPredictor(64, cfg(learned_gain=True))
    off = MomentumPredictor(64, cfg(learned_gain=False))
    assert p.gain == off.gain == 1.0
    num = den = 0.0
    for t, scale in enumerate((0.3, -2.0, 0.5, 4.0, 0.1), 1):
        pred = vec(rng)
        actual = (scale * pred + 0.5 * vec(rng)).astype(F32)
        for q in (p, off):
            q.fold(actual, pred, t)
        a64, p64 = actual.astype(np.float64), pred.astype(np.float64)
        num, den = num + a64 @ p64, den + p64 @ p64
        assert p.gain == pytest.approx(min(max(num / den, 0.0), 1.0), rel=1e-12)
    assert off.gain == 1.0
    p.fold(vec(rng), np.zeros(64, F32), 9)               # p = 0 adds nothing
    assert p.gain == pytest.approx(min(max(num / den, 0.0), 1.0), rel=1e-12)
    p.reset()
    assert p.gain == 1.0


def test_fold_degenerate_vectors():
    p = MomentumPredictor(4, cfg(residual_threshold=1e9))
    z = np.zeros(4, F32)
    p.push(z, 0)
    res = p.fold(z, z, 1)
    assert res.relative_error == 0.0 and res.cosine == 1.0
    res = p.fold(z, np.ones(4, F32), 2)
    assert math.isinf(res.relative_error) and res.cosine == 0.0 and res.reset


def test_run_scalars_are_the_per_step_ones(rng):
    """steps_since_anchor_run / correction_scale_run give each step's k and decay^(t - t_c)."""
    p = MomentumPredictor(64, cfg(history_decay=0.93))
    assert not p.correction_scale_run(5, 3).any() and not p.steps_since_anchor_run(5, 3).any()   # none yet
    push_blocks(p, [[(vec(rng), 1), (vec(rng), 2)], [(vec(rng), 4)]])
    pred = p.predict(6, np.zeros(64, F32))
    p.fold(pred + F32(0.01) * vec(rng), pred, 6)                 # close to the prediction: no reset
    assert p.has_trend and p.correction_step == 6
    assert p.steps_since_anchor_run(7, 4).tolist() == [p.steps_since_anchor(7 + j) for j in range(4)] == [3, 4, 5, 6]
    assert p.correction_scale_run(7, 4).tolist() == [p.correction_scale(7 + j) for j in range(4)]
