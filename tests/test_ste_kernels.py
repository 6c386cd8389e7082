"""SteTrainer's kernels against slow numpy references: the clipped-STE SGD update
(optim_kernels.sgd_ternary_ste) and the step/epoch around the main fused step (kernels.ste_kernels)."""
from __future__ import annotations

import numpy as np
import pytest

from qatlab.config import QatConfig
from qatlab.kernels import ste_kernels as K
from qatlab.kernels.optim_kernels import sgd_ternary_ste
from qatlab.quant import ternary_quantize
from qatlab.quant.ste import SteKind
from qatlab.train.ste_trainer import SteTrainer

F32 = np.float32


def _reference_sgd(p, g, ste, alpha, clip, touched, lr):
    """float32 numpy version of sgd_ternary_ste -> (p', touched'); tanh's factor in float64."""
    inv = F32(1) / F32(alpha)
    u = p * inv
    if ste == 0:
        gq = g.copy()
    elif ste == 1:
        gq = np.where(np.abs(np.rint(u)) <= 1, g, F32(0))
    elif ste == 2:
        gq = (g * (1.0 - np.tanh(u.astype(np.float64)) ** 2)).astype(F32)
    else:
        a = F32(1) - np.abs(u)
        gq = np.where(a > 0, g * a, F32(0))
    gq = np.where(np.abs(p) <= F32(clip), gq, F32(0)).astype(F32)
    return (p - F32(lr) * gq).astype(F32), touched | (gq != 0)


@pytest.mark.parametrize("ste", list(SteKind))
def test_sgd_ternary_ste_matches_numpy(ste):
    rng = np.random.default_rng(ste.code)
    n = 3001
    p = rng.uniform(-0.4, 0.4, n).astype(F32)
    p[:5] = [0.25, -0.25, 0.0, 0.3, 0.125]        # on the clip, at zero, beyond the range
    g = rng.normal(0, 1e-2, n).astype(F32)
    g[10:20] = 0.0
    touched = (rng.random(n) < 0.1).astype(np.uint8)   # earlier steps' marks stay
    alpha, clip, lr = F32(0.1), 0.25, 0.5
    ref_p, ref_t = _reference_sgd(p, g, ste.code, alpha, clip, touched.astype(bool), lr)
    out_p, out_t = p.copy(), touched.copy()
    sgd_ternary_ste(out_p, g, ste.code, alpha, clip, out_t, lr)
    if ste is SteKind.TANH:    # sech^2 by the kernels' exp: within a few float32 ulps of the factor
        np.testing.assert_allclose(out_p, ref_p, rtol=0, atol=1e-7)
    else:
        assert np.array_equal(out_p, ref_p)
    assert np.array_equal(out_t.astype(bool), ref_t)
    assert np.array_equal(out_p[np.abs(p) > clip], p[np.abs(p) > clip])   # the clipped latents stay


def _model(I=5, H=7, O=3, batch=4, seed=0):
    """A trainer (its Net tuple and buffers) and data."""
    rng = np.random.default_rng(seed)
    trainer = SteTrainer.from_f32(I, H, O, rng.uniform(-1, 1, (H, I)), rng.uniform(-1, 1, (O, H)),
                                  QatConfig(lr=0.1, clip_threshold=0.8))
    trainer._ensure_rows(batch)
    X = rng.normal(size=(11, I)).astype(F32)
    T = rng.normal(size=(11, O)).astype(F32)
    return trainer, X, T


def _reference_step(w1, w2, x, t, ste, lr, clip):
    """float64 numpy step -> (w1', w2', loss, g1 != 0, g2 != 0)."""
    (t1, a1), (t2, a2) = ternary_quantize(w1), ternary_quantize(w2)
    q1, q2 = t1 * a1, t2 * a2
    x, t = x.astype(np.float64), t.astype(np.float64)
    pre = x @ q1.T
    h = np.maximum(pre, 0.0)
    y = h @ q2.T
    dy = 2 * (y - t) / y.size
    dq2 = dy.T @ h
    dq1 = ((dy @ q2) * (pre > 0)).T @ x
    factors = []
    for w, a in ((w1, a1), (w2, a2)):
        u = w.astype(np.float64) / a
        f = {0: np.ones_like(u), 1: (np.abs(np.rint(w * (F32(1) / F32(a)))) <= 1) * 1.0,
             2: 1.0 - np.tanh(u) ** 2, 3: np.maximum(0.0, 1.0 - np.abs(u))}[ste]
        factors.append(f * (np.abs(w) <= clip))
    g1, g2 = dq1 * factors[0], dq2 * factors[1]
    return w1 - lr * g1, w2 - lr * g2, np.mean((y - t) ** 2), g1 != 0, g2 != 0


@pytest.mark.parametrize("ste", [0, 1, 2, 3])
def test_train_step_kernel_matches_numpy(ste):
    trainer, X, T = _model(batch=4)
    w1, w2 = trainer.w1_latent.copy(), trainer.w2_latent.copy()
    touched = np.zeros(trainer.mlp.num_params, np.uint8)
    loss = K.train_step(X[:4], T[:4], trainer._net, trainer._acts_at(4), ste, F32(0.1), F32(0.8), touched)
    r1, r2, ref_loss, t1, t2 = _reference_step(w1, w2, X[:4], T[:4], ste, 0.1, 0.8)
    assert loss == pytest.approx(ref_loss, rel=1e-6)
    np.testing.assert_allclose(trainer.w1_latent, r1, rtol=0, atol=1e-6)
    np.testing.assert_allclose(trainer.w2_latent, r2, rtol=0, atol=1e-6)
    assert np.array_equal(touched.astype(bool), np.concatenate([t1.ravel(), t2.ravel()]))   # the flat layout


def test_train_step_kernel_refuses_non_finite_input():
    trainer, X, T = _model()
    before = trainer.mlp.flat_params().copy()
    X[1, 2] = np.nan
    touched = np.zeros(trainer.mlp.num_params, np.uint8)
    assert K.train_step(X[:4], T[:4], trainer._net, trainer._acts_at(4), 0, F32(0.1), F32(0.8), touched) == -1.0
    assert np.array_equal(trainer.mlp.flat_params(), before) and not touched.any()


def test_train_epoch_kernel_is_its_steps_in_perm_order():
    trainer, X, T = _model(batch=4)
    twin, _, _ = _model(batch=4)
    perm = np.random.default_rng(2).permutation(len(X))          # 11 rows: batches of 4, 4, 3
    touched = np.zeros(trainer.mlp.num_params, np.uint8)
    loss, steps = K.train_epoch(X, T, perm, 4, trainer._net, trainer._acts_at(4), trainer._acts_at(3),
                                trainer._xb, trainer._tb, 3, F32(0.1), F32(0.8), touched)
    w1, w2, total = twin.w1_latent.copy(), twin.w2_latent.copy(), 0.0
    hits = np.zeros(trainer.mlp.num_params, bool)
    for s in range(0, 11, 4):
        idx = perm[s:s + 4]
        w1, w2, step_loss, t1, t2 = _reference_step(w1, w2, X[idx], T[idx], 3, 0.1, 0.8)
        w1, w2 = w1.astype(F32), w2.astype(F32)
        hits |= np.concatenate([t1.ravel(), t2.ravel()])
        total += step_loss * len(idx)
    assert steps == 3 and loss == pytest.approx(total / 11, rel=1e-6)
    np.testing.assert_allclose(trainer.w1_latent, w1, rtol=0, atol=1e-5)
    np.testing.assert_allclose(trainer.w2_latent, w2, rtol=0, atol=1e-5)
    assert np.array_equal(touched.astype(bool), hits)


def test_train_epoch_kernel_stops_at_a_non_finite_loss():
    trainer, X, T = _model(batch=4)
    X[5] = 3e38                                    # the second batch overflows
    perm = np.arange(len(X))
    touched = np.zeros(trainer.mlp.num_params, np.uint8)
    loss, steps = K.train_epoch(X, T, perm, 4, trainer._net, trainer._acts_at(4), trainer._acts_at(3),
                                trainer._xb, trainer._tb, 0, F32(0.1), F32(0.8), touched)
    assert steps == 2 and not np.isfinite(loss)
    assert np.isfinite(trainer.mlp.flat_params()).all()


@pytest.mark.parametrize("ste", [0, 2])
def test_train_step_kernel_is_the_fused_step_then_the_clipped_sgd(ste):
    """The step is fused.train_step at stage BACKWARD (STE codes 0) and sgd_ternary_ste per layer, bit for bit."""
    from qatlab.kernels.fused import BACKWARD
    from qatlab.kernels.fused import train_step as fused_step
    trainer, X, T = _model(batch=4, seed=3)
    twin, _, _ = _model(batch=4, seed=3)
    touched, twin_touched = (np.zeros(trainer.mlp.num_params, np.uint8) for _ in range(2))
    loss = K.train_step(X[:4], T[:4], trainer._net, trainer._acts_at(4), ste, F32(0.1), F32(0.8), touched)
    none = np.zeros(0, F32)
    ref = fused_step(X[:4], np.zeros(0, np.int64), T[:4], BACKWARD, twin._net, twin._acts_at(4), (0, none, none),
                     np.zeros(8), none, 0.0)[0]
    p, g = twin.mlp.flat_params(), twin._grads.flat()
    alphas, k1 = twin._net[3], twin.w1_latent.size
    sgd_ternary_ste(p[:k1], g[:k1], ste, alphas[0], F32(0.8), twin_touched[:k1], F32(0.1))
    sgd_ternary_ste(p[k1:], g[k1:], ste, alphas[1], F32(0.8), twin_touched[k1:], F32(0.1))
    assert loss == ref
    assert np.array_equal(trainer.mlp.flat_params(), p) and np.array_equal(touched, twin_touched)
