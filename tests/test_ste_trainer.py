"""SteTrainer: one step against a float64 numpy reference per SteKind, clip rule, determinism,
shuffling/batching, active-gradient fraction, divergence, finalize/from_mlp round trips, learning,
logging and input validation."""
from __future__ import annotations

import logging

import numpy as np
import pytest

from qatlab.config import QatConfig
from qatlab.quant import TernaryQuantizer, ternary_quantize
from qatlab.quant.ste import SteKind
from qatlab.nn.ternary_mlp import TernaryMLP
from qatlab.train.ste_trainer import QatResult, SteTrainer

I, H, O = 6, 9, 4


def _latents(seed=0, i=I, h=H, o=O):
    rng = np.random.default_rng(seed)
    return rng.uniform(-1, 1, size=(h, i)).astype(np.float32), rng.uniform(-1, 1, size=(o, h)).astype(np.float32)


def _data(n, seed=1, i=I, o=O):
    rng = np.random.default_rng(seed)
    return rng.normal(size=(n, i)).astype(np.float32), (3 * rng.normal(size=(n, o))).astype(np.float32)


def _ste_factor(w, alpha, ste: SteKind) -> np.ndarray:
    """d Q(w) / d w as the STE defines it (u = w / alpha), float64."""
    u = w.astype(np.float64) / alpha
    if ste is SteKind.IDENTITY:
        return np.ones_like(u)
    if ste is SteKind.CLIPPED_IDENTITY:  # the clamp did not act: |rint(w * float32(1/alpha))| <= 1
        return (np.abs(np.rint(w * (np.float32(1) / np.float32(alpha)))) <= 1).astype(np.float64)
    if ste is SteKind.TANH:
        return 1.0 - np.tanh(u) ** 2
    return np.maximum(0.0, 1.0 - np.abs(u))


def _reference_step(w1, w2, x, t, ste, lr, clip):
    """Slow float64 version of one step -> (w1', w2', loss, (dQ1, dQ2), (g1, g2))."""
    (t1, a1), (t2, a2) = ternary_quantize(w1), ternary_quantize(w2)
    q1, q2 = t1 * a1, t2 * a2
    x, t = x.astype(np.float64).reshape(-1, w1.shape[1]), t.astype(np.float64).reshape(-1, w2.shape[0])
    pre = x @ q1.T
    h = np.maximum(pre, 0.0)
    y = h @ q2.T
    loss = np.mean((y - t) ** 2)
    dy = 2 * (y - t) / y.size
    dq2 = dy.T @ h
    dq1 = ((dy @ q2) * (pre > 0)).T @ x
    g1 = dq1 * _ste_factor(w1, a1, ste) * (np.abs(w1) <= clip)
    g2 = dq2 * _ste_factor(w2, a2, ste) * (np.abs(w2) <= clip)
    return w1 - lr * g1, w2 - lr * g2, loss, (dq1, dq2), (g1, g2)


# ----------------------------------------------------------------------------- one step

@pytest.mark.parametrize("ste", list(SteKind))
@pytest.mark.parametrize("batch", [1, 5])
def test_step_matches_float64_reference(ste, batch):
    w1, w2 = _latents()
    x, t = _data(batch)
    if batch == 1:
        x, t = x[0], t[0]
    lr, clip = 0.5, 0.9
    trainer = SteTrainer.from_f32(I, H, O, w1, w2, QatConfig(lr=lr, clip_threshold=clip, ste=ste.value))
    r1, r2, loss_ref, (dq1, dq2), (g1, g2) = _reference_step(w1, w2, x, t, ste, lr, clip)
    loss = trainer.train_step(x, t)
    assert loss == pytest.approx(loss_ref, rel=1e-5)
    for w0, w, ref, g, dq in ((w1, trainer.w1_latent, r1, g1, dq1), (w2, trainer.w2_latent, r2, g2, dq2)):
        np.testing.assert_allclose(w, ref, rtol=0, atol=2e-6)
        # the latent gradient is the upstream gradient times the STE factor (and the clip mask)
        scale = np.abs(g).max()
        np.testing.assert_allclose((w0.astype(np.float64) - w) / lr, g, rtol=1e-4, atol=1e-5 * scale)
        quantizer = TernaryQuantizer(ste=ste)
        quantizer.forward(w0)
        g_quant = quantizer.backward(dq.astype(np.float32), w0) * (np.abs(w0) <= clip)
        np.testing.assert_allclose((w0.astype(np.float64) - w) / lr, g_quant, rtol=1e-4, atol=1e-5 * scale)
    factor = _ste_factor(w1, ternary_quantize(w1)[1], ste)
    if ste is not SteKind.IDENTITY:  # the latents reach the regions where the STE shapes the gradient
        assert factor.min() == pytest.approx(0.0, abs=0.1) and factor.max() > 0.5


def test_clip_rule_zeroes_gradient_beyond_threshold():
    w1, w2 = _latents(seed=2)
    x, t = _data(3, seed=5)
    _, _, _, (dq1, _), _ = _reference_step(w1, w2, x, t, SteKind.IDENTITY, 0.1, np.inf)
    k = np.flatnonzero((np.abs(dq1.ravel()) > 1e-3) & (np.abs(w1.ravel()) > 0.3))[0]
    clip = float(np.abs(w1.ravel()[k]))  # this latent sits exactly on the threshold: it still learns
    trainer = SteTrainer.from_f32(I, H, O, w1, w2, QatConfig(lr=0.1, clip_threshold=clip))
    trainer.train_step(x, t)
    for w0, w in ((w1, trainer.w1_latent), (w2, trainer.w2_latent)):
        outside = np.abs(w0) > clip
        assert outside.any() and (~outside).any()
        assert np.array_equal(w[outside], w0[outside])
    assert trainer.w1_latent.ravel()[k] != w1.ravel()[k]


@pytest.mark.slow
def test_all_latents_clipped_means_no_learning():
    w1, w2 = _latents()
    trainer = SteTrainer.from_f32(I, H, O, w1, w2, QatConfig(clip_threshold=1e-6, epochs=3, log_every=0))
    res = trainer.train(_data(8))
    assert res.active_gradient_fraction == 0.0
    assert np.array_equal(trainer.w1_latent, w1) and np.array_equal(trainer.w2_latent, w2)
    np.testing.assert_allclose(res.loss_history, res.loss_history[0], rtol=1e-12)


def test_non_finite_loss_returned_and_latents_untouched():
    w1, w2 = _latents()
    trainer = SteTrainer.from_f32(I, H, O, w1, w2)
    loss = trainer.train_step(np.full(I, 3e38, np.float32), np.zeros(O, np.float32))
    assert not np.isfinite(loss)
    assert np.array_equal(trainer.w1_latent, w1) and np.array_equal(trainer.w2_latent, w2)


# ----------------------------------------------------------------------------- train()

@pytest.mark.slow
def test_epochs_follow_seeded_shuffle_in_batches():
    """train() == train_step over np.random.default_rng(seed).permutation(n) batches, last one short."""
    w1, w2 = _latents()
    X, T = _data(10)
    cfg = QatConfig(lr=0.05, epochs=3, batch_size=4, seed=7, log_every=0)
    trainer = SteTrainer.from_f32(I, H, O, w1, w2, cfg)
    res = trainer.train((X, T))
    twin = SteTrainer.from_f32(I, H, O, w1, w2, cfg)
    rng = np.random.default_rng(7)
    expected = []
    for _ in range(3):
        perm = rng.permutation(10)
        total = 0.0
        for s in range(0, 10, 4):
            idx = perm[s:s + 4]
            total += twin.train_step(X[idx], T[idx]) * len(idx)
        expected.append(total / 10)
    np.testing.assert_allclose(res.loss_history, expected, rtol=1e-6)
    np.testing.assert_allclose(trainer.w1_latent, twin.w1_latent, rtol=0, atol=1e-6)
    assert res.loss_history.dtype == np.float64 and res.epochs_run == 3 and not res.diverged
    assert res.final_loss == res.loss_history[-1]


@pytest.mark.slow
def test_pairs_and_arrays_are_the_same_data():
    w1, w2 = _latents()
    X, T = _data(12)
    cfg = QatConfig(epochs=2, batch_size=3, log_every=0)
    a = SteTrainer.from_f32(I, H, O, w1, w2, cfg).train((X, T))
    b = SteTrainer.from_f32(I, H, O, w1, w2, cfg).train(list(zip(X, T)))
    c = SteTrainer.from_f32(I, H, O, w1, w2, cfg).train([(list(x), list(t)) for x, t in zip(X, T)])
    assert np.array_equal(a.loss_history, b.loss_history) and np.array_equal(a.loss_history, c.loss_history)


@pytest.mark.slow
def test_determinism_same_seed_same_history():
    w1, w2 = _latents()
    data = _data(40)
    runs = []
    for seed in (0, 0, 1):
        trainer = SteTrainer.from_f32(I, H, O, w1, w2, QatConfig(epochs=5, batch_size=4, seed=seed, log_every=0))
        runs.append((trainer.train(data), trainer.w1_latent.copy()))
    assert np.array_equal(runs[0][0].loss_history, runs[1][0].loss_history)
    assert np.array_equal(runs[0][1], runs[1][1])
    assert not np.array_equal(runs[0][0].loss_history, runs[2][0].loss_history)


@pytest.mark.slow
def test_active_gradient_fraction_counts_latents_with_nonzero_gradient():
    rng = np.random.default_rng(3)
    X = rng.uniform(0.1, 1.0, size=(6, I)).astype(np.float32)
    X[:, 2] = 0.0                                  # a zero input column: no gradient for W1[:, 2]
    T = rng.normal(size=(6, O)).astype(np.float32)
    w1, w2 = _latents()
    w1[0] = -np.abs(w1[0]) - 0.1                    # hidden unit 0 is dead: W1[0, :] and W2[:, 0] get none
    for ste in (SteKind.IDENTITY, SteKind.HARD_TANH):
        cfg = QatConfig(epochs=1, batch_size=6, clip_threshold=0.95, ste=ste.value, log_every=0)
        res = SteTrainer.from_f32(I, H, O, w1, w2, cfg).train((X, T))
        _, _, _, _, (g1, g2) = _reference_step(w1, w2, X, T, ste, 0.01, 0.95)
        expected = (np.count_nonzero(g1) + np.count_nonzero(g2)) / (w1.size + w2.size)
        assert res.active_gradient_fraction == expected and 0.3 < expected < 0.9


@pytest.mark.slow
def test_divergence_stops_training_without_raising(caplog):
    w1, w2 = _latents()
    X, T = _data(8)
    X[5] = 3e38                                     # finite, but the forward overflows
    trainer = SteTrainer.from_f32(I, H, O, w1, w2, QatConfig(epochs=10, batch_size=1, log_every=0))
    with caplog.at_level(logging.WARNING, logger="qatlab.train.ste_trainer"):
        res = trainer.train((X, T))
    assert isinstance(res, QatResult) and res.diverged and res.epochs_run == 1
    assert len(res.loss_history) == 1 and not np.isfinite(res.final_loss)
    assert "epoch 1" in res.message and any("diverged" in r.getMessage() for r in caplog.records)
    assert np.isfinite(trainer.w1_latent).all() and np.isfinite(trainer.w2_latent).all()


@pytest.mark.slow
def test_logs_every_n_epochs(caplog):
    w1, w2 = _latents()
    trainer = SteTrainer.from_f32(I, H, O, w1, w2, QatConfig(epochs=7, log_every=3))
    with caplog.at_level(logging.INFO, logger="qatlab.train.ste_trainer"):
        trainer.train(_data(5))
    lines = [r.getMessage() for r in caplog.records if r.name == "qatlab.train.ste_trainer"]
    assert len(lines) == 2 and lines[0].startswith("epoch 3/7") and lines[1].startswith("epoch 6/7")


def test_config_edits_apply_to_next_step():
    w1, w2 = _latents()
    x, t = _data(1)
    cfg = QatConfig(lr=0.5)
    trainer = SteTrainer.from_f32(I, H, O, w1, w2, cfg)
    cfg.ste = "hard_tanh"
    cfg.clip_threshold = 0.9
    trainer.train_step(x, t)
    r1, _, _, _, _ = _reference_step(w1, w2, x, t, SteKind.HARD_TANH, 0.5, 0.9)
    np.testing.assert_allclose(trainer.w1_latent, r1, atol=2e-6)
    trainer.config = QatConfig(lr=1e-9)
    cfg.lr = 100.0                                  # the old config is no longer followed
    before = trainer.w1_latent.copy()
    trainer.train_step(x, t)
    np.testing.assert_allclose(trainer.w1_latent, before, atol=1e-6)


@pytest.mark.slow
@pytest.mark.parametrize("ste", list(SteKind))
def test_learns_ternary_teacher(ste):
    """32-64-8 student learns a random ternary teacher: final MSE < 0.5 x initial."""
    rng = np.random.default_rng(1)
    i, h, o = 32, 64, 8
    teacher = TernaryMLP([rng.integers(-1, 2, (h, i)), rng.integers(-1, 2, (o, h))], [i ** -0.5, h ** -0.5])
    X = rng.normal(size=(512, i)).astype(np.float32)
    T = teacher.forward(X)
    trainer = SteTrainer.from_f32(i, h, o, rng.normal(0, 0.1, (h, i)), rng.normal(0, 0.1, (o, h)),
                                  QatConfig(lr=0.05, epochs=30, batch_size=16, ste=ste.value, log_every=0))
    initial = np.mean((trainer.forward(X) - T) ** 2)
    res = trainer.train((X, T))
    final = np.mean((trainer.forward(X) - T) ** 2)
    assert final < 0.5 * initial and res.final_loss < 0.5 * res.loss_history[0]
    assert 0.0 < res.active_gradient_fraction <= 1.0


# ----------------------------------------------------------------------------- finalize / from_mlp

@pytest.mark.slow
def test_finalize_forward_equals_fake_quant_forward():
    w1, w2 = _latents(seed=4, i=32, h=64, o=8)
    X, T = _data(64, i=32, o=8)
    trainer = SteTrainer.from_f32(32, 64, 8, w1, w2, QatConfig(epochs=3, batch_size=8, log_every=0))
    trainer.train((X, T))
    mlp = trainer.finalize()
    for latent, trits, alpha in zip((trainer.w1_latent, trainer.w2_latent), mlp.trits, mlp.alphas):
        ref_trits, ref_alpha = ternary_quantize(latent)
        assert np.array_equal(trits, ref_trits) and alpha == ref_alpha
    assert np.array_equal(mlp.forward(X), trainer.forward(X))
    assert np.array_equal(mlp.forward(X[0]), trainer.forward(X[0]))
    fq = [TernaryQuantizer().forward(w).astype(np.float64) for w in (trainer.w1_latent, trainer.w2_latent)]
    np.testing.assert_allclose(mlp.forward(X), np.maximum(X @ fq[0].T, 0) @ fq[1].T, rtol=1e-5, atol=1e-5)


def test_from_mlp_then_finalize_gives_back_the_mlp(tmp_path):
    rng = np.random.default_rng(6)
    mlp = TernaryMLP([rng.integers(-1, 2, (17, 11)), rng.choice([-1, 0, 0, 0, 1], (5, 17))], [0.0371, 1.23])
    trainer = SteTrainer.from_mlp(mlp, QatConfig())
    assert (trainer.in_features, trainer.hidden_size, trainer.out_features) == (11, 17, 5)
    back = trainer.finalize()
    assert all(np.array_equal(a, b) for a, b in zip(back.trits, mlp.trits)) and back.alphas == mlp.alphas
    X = rng.normal(size=(7, 11)).astype(np.float32)
    assert np.array_equal(trainer.forward(X), mlp.forward(X))
    mlp.save(tmp_path / "m.npz")
    assert np.array_equal(TernaryMLP.load(tmp_path / "m.npz").forward(X), trainer.forward(X))


# ----------------------------------------------------------------------------- bad input

def test_from_f32_rejects_bad_weights_and_sizes():
    w1, w2 = _latents()
    with pytest.raises(ValueError, match=r"w1: expected shape \(9, 6\) \(hidden_size, in_features\), got \(6, 9\)"):
        SteTrainer.from_f32(I, H, O, w1.T, w2)
    with pytest.raises(ValueError, match=r"w2: expected shape \(4, 9\)"):
        SteTrainer.from_f32(I, H, O, w1, w2.ravel())
    bad = w2.copy()
    bad[1, 2] = np.nan
    with pytest.raises(ValueError, match="w2: contains NaN or inf"):
        SteTrainer.from_f32(I, H, O, w1, bad)
    with pytest.raises(TypeError, match="w1: expected a real numeric array"):
        SteTrainer.from_f32(I, H, O, w1.astype(str), w2)
    for name, args in (("in_features", (0, H, O)), ("hidden_size", (I, 2.5, O)), ("out_features", (I, H, True))):
        with pytest.raises(ValueError, match=name):
            SteTrainer.from_f32(*args, w1, w2)
    with pytest.raises(TypeError, match="config: expected a QatConfig"):
        SteTrainer.from_f32(I, H, O, w1, w2, config={"lr": 0.1})
    with pytest.raises(ValueError, match="ste"):
        QatConfig(ste="straight_through")
    with pytest.raises(TypeError, match="mlp: expected a TernaryMLP"):
        SteTrainer.from_mlp("model.npz")
    with pytest.raises(ValueError, match="2-layer"):
        SteTrainer.from_mlp(TernaryMLP([np.ones((2, 3), int)], [1.0]))


def test_latent_assignment_is_validated():
    w1, w2 = _latents()
    trainer = SteTrainer.from_f32(I, H, O, w1, w2)
    trainer.w1_latent = np.zeros((H, I))
    assert trainer.w1_latent.dtype == np.float32 and not trainer.w1_latent.any()
    with pytest.raises(ValueError, match=r"w2_latent: expected shape \(4, 9\)"):
        trainer.w2_latent = np.zeros((9, 4))
    with pytest.raises(ValueError, match="w2_latent: contains NaN"):
        trainer.w2_latent = np.full((O, H), np.inf)


def test_train_step_and_train_reject_bad_samples():
    w1, w2 = _latents()
    trainer = SteTrainer.from_f32(I, H, O, w1, w2, QatConfig(epochs=1, log_every=0))
    x, t = _data(3)
    with pytest.raises(ValueError, match=r"x: expected shape \(6,\) or \(B, 6\)"):
        trainer.train_step(x[:, :5], t)
    with pytest.raises(ValueError, match="t: shape"):
        trainer.train_step(x, t[:2])
    with pytest.raises(ValueError, match="t: shape"):
        trainer.train_step(x[0], t)
    x_nan = x.copy()
    x_nan[1, 1] = np.nan
    with pytest.raises(ValueError, match="x: contains NaN or inf"):
        trainer.train_step(x_nan, t)
    with pytest.raises(ValueError, match="t: contains NaN or inf"):
        trainer.train_step(x[0], np.full(O, np.inf, np.float32))
    assert np.array_equal(trainer.w1_latent, w1)   # nothing was applied
    with pytest.raises(ValueError, match="X: contains NaN"):
        trainer.train((x_nan, t))
    with pytest.raises(ValueError, match=r"T: expected shape \(3, 4\), got \(3, 5\)"):
        trainer.train((x, np.zeros((3, 5))))
    with pytest.raises(ValueError, match=r"samples\[1\]\[0\]: expected shape \(6,\), got \(5,\)"):
        trainer.train([(x[0], t[0]), (x[1][:5], t[1])])
    with pytest.raises(ValueError, match=r"samples\[0\]: expected an \(x, t\) pair"):
        trainer.train([x[0]])
    with pytest.raises(ValueError, match="samples x: expected shape"):
        trainer.train([])
    with pytest.raises(TypeError, match="samples: expected a list"):
        trainer.train(42)


@pytest.mark.slow
def test_trains_its_mlp_and_starts_from_one():
    """The latents are the Mlp's weights (views), and an Mlp [in, hidden, out] (relu, no biases) seeds a trainer."""
    from qatlab.nn import Mlp
    mlp = Mlp([I, H, O], activation="relu", bias=False, seed=2)
    trainer = SteTrainer.from_mlp(mlp, QatConfig(ste="tanh", epochs=2, log_every=0))
    assert np.array_equal(trainer.w1_latent, mlp.weights(0)) and trainer.mlp is not mlp
    assert np.shares_memory(trainer.w1_latent, trainer.mlp.flat_params())
    assert all(q.ste is SteKind.TANH for q in trainer.mlp.weight_quantizers)
    trainer.train(_data(9))
    assert np.array_equal(trainer.mlp.weights(1), trainer.w2_latent)
    X = _data(5)[0]
    assert np.array_equal(trainer.forward(X), trainer.mlp.forward(X, trainer.mlp.scratch(5)))
    with pytest.raises(ValueError, match="2-layer relu Mlp without biases"):
        SteTrainer.from_mlp(Mlp([I, H, O]))
