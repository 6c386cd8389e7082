"""qatlab.data: digits asset, synthetic tasks, user files, config dispatch."""
from __future__ import annotations

import subprocess
import sys

import numpy as np
import pytest

from qatlab import data
from qatlab.config import DataConfig


def _same(a: data.Dataset, b: data.Dataset) -> bool:
    return all(np.array_equal(getattr(a, k), getattr(b, k)) for k in ("X_train", "y_train", "X_test", "y_test"))


# ----------------------------------------------------------------------------- digits

def test_digits_asset_raw():
    with np.load(data.DIGITS_PATH, allow_pickle=False) as f:
        assert sorted(f.files) == ["X", "y"]
        X, y = f["X"], f["y"]
    assert X.shape == (1797, 64) and X.dtype == np.uint8
    assert y.shape == (1797,) and y.dtype == np.uint8
    assert X.min() == 0 and X.max() == 16
    assert np.array_equal(np.bincount(y), [178, 182, 177, 183, 181, 182, 181, 179, 174, 180])


def test_digits_shapes_dtypes_ranges():
    ds = data.load_digits()
    assert (ds.task, ds.name, ds.n_classes, ds.n_features, ds.n_outputs) == ("classification", "digits", 10, 64, 10)
    assert ds.X_train.shape == (1438, 64) and ds.X_test.shape == (359, 64)  # round(1797 * 0.2) = 359
    assert ds.y_train.shape == (1438,) and ds.y_test.shape == (359,)
    assert ds.X_train.dtype == ds.X_test.dtype == np.float32
    assert ds.y_train.dtype == ds.y_test.dtype == np.int64
    X = np.concatenate([ds.X_train, ds.X_test])
    y = np.concatenate([ds.y_train, ds.y_test])
    assert X.min() == 0.0 and X.max() == 1.0
    assert np.array_equal(np.unique(X * 16), np.arange(17))  # exact k/16 values
    assert set(np.unique(y)) == set(range(10))
    assert ds.X_train.flags.c_contiguous and ds.X_train.flags.writeable


def test_digits_split_is_a_partition():
    ds = data.load_digits(test_fraction=0.3, seed=5)
    assert ds.n_test == round(1797 * 0.3) and ds.n_train + ds.n_test == 1797
    with np.load(data.DIGITS_PATH) as f:
        raw = (f["X"].astype(np.float32) / 16).tolist()
    rows = sorted(np.concatenate([ds.X_train, ds.X_test]).tolist())
    assert rows == sorted(raw)


def test_digits_determinism_and_seed_difference():
    a, b = data.load_digits(seed=3), data.load_digits(seed=3)
    assert _same(a, b)
    c = data.load_digits(seed=4)
    assert not np.array_equal(a.y_train, c.y_train)
    # mutating one result does not leak into the next (cached raw arrays are protected)
    a.X_train[:] = -1
    assert data.load_digits(seed=3).X_train.min() == 0.0


@pytest.mark.parametrize("tf", [0, 1, -0.1, 1.5, float("nan"), "0.2", True])
def test_digits_bad_test_fraction(tf):
    with pytest.raises(ValueError, match=r"test_fraction: must be a number in \(0, 1\)"):
        data.load_digits(test_fraction=tf)


@pytest.mark.parametrize("seed", [-1, 1.5, "0", None])
def test_digits_bad_seed(seed):
    with pytest.raises(ValueError, match=r"seed: must be an integer >= 0"):
        data.load_digits(seed=seed)


def test_digits_numpy_int_seed_ok():
    assert _same(data.load_digits(seed=np.int64(2)), data.load_digits(seed=2))


# ----------------------------------------------------------------------------- synthetic

def test_synthetic_classification():
    ds = data.make_synthetic(n_samples=500, n_features=16, n_classes=5, seed=1)
    assert (ds.task, ds.n_classes, ds.n_features, ds.n_outputs) == ("classification", 5, 16, 5)
    assert ds.n_test == 100 and ds.n_train == 400
    assert ds.X_train.dtype == np.float32 and ds.y_train.dtype == np.int64
    y = np.concatenate([ds.y_train, ds.y_test])
    assert np.array_equal(np.bincount(y), [100] * 5)  # balanced
    assert np.all(np.abs(ds.X_train) < 10)
    # the clusters carry the label: nearest centre beats chance by far
    c = ds.meta["centres"]
    pred = np.argmin(((ds.X_test[:, None, :] - c[None]) ** 2).sum(-1), axis=1)
    assert (pred == ds.y_test).mean() > 0.6


def test_synthetic_regression_teacher():
    ds = data.make_synthetic("regression", n_samples=300, n_features=32, hidden=64, n_outputs=8, seed=2)
    assert (ds.task, ds.n_classes, ds.n_features, ds.n_outputs) == ("regression", 0, 32, 8)
    assert ds.y_train.shape == (240, 8) and ds.y_train.dtype == np.float32
    assert ds.X_train.min() >= -1 and ds.X_train.max() <= 1
    w1, w2, s = ds.meta["teacher_w1"], ds.meta["teacher_w2"], ds.meta["teacher_scale"]
    assert w1.shape == (64, 32) and w2.shape == (8, 64)
    assert set(np.unique(w1)) <= {-1, 0, 1} and set(np.unique(w2)) <= {-1, 0, 1}
    assert w1.any(axis=1).all()
    t = s * (np.sign(ds.X_test.astype(np.float64) @ w1.T) @ w2.T)
    np.testing.assert_allclose(ds.y_test, t, rtol=0, atol=1e-6)  # noise=0: exactly the teacher
    noisy = data.make_synthetic("regression", n_samples=300, n_features=32, seed=2, noise=0.1)
    assert np.array_equal(noisy.X_train, ds.X_train) and not np.array_equal(noisy.y_train, ds.y_train)


@pytest.mark.parametrize("kind", ["classification", "regression"])
def test_synthetic_determinism(kind):
    a = data.make_synthetic(kind, n_samples=200, seed=7)
    b = data.make_synthetic(kind, n_samples=200, seed=7)
    c = data.make_synthetic(kind, n_samples=200, seed=8)
    assert _same(a, b)
    assert not np.array_equal(a.X_train, c.X_train)


@pytest.mark.parametrize("kwargs, match", [
    (dict(kind="clustering"), r"kind: must be one of"),
    (dict(n_samples=1), r"n_samples: must be an integer >= 2"),
    (dict(n_features=0), r"n_features: must be an integer >= 1"),
    (dict(n_classes=1), r"n_classes: must be an integer >= 2"),
    (dict(noise=-1.0), r"noise: must be a finite number >= 0"),
    (dict(kind="regression", n_outputs=0), r"n_outputs: must be an integer >= 1"),
    (dict(kind="regression", hidden=0), r"hidden: must be an integer >= 1"),
    (dict(test_fraction=1.0), r"test_fraction: must be a number in \(0, 1\)"),
    (dict(n_samples=3, test_fraction=0.1), r"test_fraction: .* both must be >= 1"),
])
def test_synthetic_bad_args(kwargs, match):
    with pytest.raises(ValueError, match=match):
        data.make_synthetic(**kwargs)


# ----------------------------------------------------------------------------- load_arrays

def _toy(n=40, d=3, seed=0):
    rng = np.random.default_rng(seed)
    X = rng.standard_normal((n, d)).astype(np.float32)
    y = np.arange(n) % 3
    return X, y


def test_load_arrays_npz_round_trip(tmp_path):
    X, y = _toy()
    p = tmp_path / "toy.npz"
    np.savez(p, X=X, y=y)
    ds = data.load_arrays(p, test_fraction=0.25, seed=1)
    assert (ds.name, ds.task, ds.n_classes, ds.n_features, ds.n_train, ds.n_test) == ("toy.npz", "classification", 3, 3, 30, 10)
    perm = np.random.default_rng(1).permutation(40)
    assert np.array_equal(ds.X_test, X[perm[:10]]) and np.array_equal(ds.y_train, y[perm[10:]])
    assert ds.y_train.dtype == np.int64 and ds.X_train.dtype == np.float32
    assert _same(ds, data.load_arrays(str(p), test_fraction=0.25, seed=1))


def test_load_arrays_npz_given_test_set(tmp_path):
    X, y = _toy()
    Xt, yt = _toy(n=7, seed=1)
    yt = np.full(7, 4)  # labels absent from train still count: n_classes = 5
    p = tmp_path / "split.npz"
    np.savez(p, X=X, y=y, X_test=Xt, y_test=yt)
    ds = data.load_arrays(p)
    assert np.array_equal(ds.X_train, X) and np.array_equal(ds.X_test, Xt)
    assert np.array_equal(ds.y_test, yt) and ds.n_classes == 5


def test_load_arrays_csv_round_trip(tmp_path):
    X, y = _toy(n=20)
    rows = [",".join(f"{v!r}" for v in x) + f",{lab}" for x, lab in zip(X.tolist(), y)]
    with_header = tmp_path / "with_header.CSV"
    with_header.write_text("a,b,c,label\n" + "\n".join(rows) + "\n")
    bare = tmp_path / "bare.csv"
    bare.write_text("\n".join(rows))
    a = data.load_arrays(with_header, test_fraction=0.2, seed=3)
    b = data.load_arrays(bare, test_fraction=0.2, seed=3)
    assert _same(a, b) and a.n_classes == 3 and a.n_train == 16
    perm = np.random.default_rng(3).permutation(20)
    assert np.array_equal(a.X_train, X[perm[4:]]) and np.array_equal(a.y_test, y[perm[:4]])


def test_load_arrays_regression(tmp_path):
    X, _ = _toy()
    t = np.linspace(-1, 1, 80).reshape(40, 2)
    p = tmp_path / "reg.npz"
    np.savez(p, X=X, y=t)
    ds = data.load_arrays(p, task="regression")
    assert ds.task == "regression" and ds.n_outputs == 2 and ds.y_train.dtype == np.float32
    np.savez(p, X=X, y=t[:, 0])
    assert data.load_arrays(p, task="regression").y_test.shape == (8, 1)


def _npz(tmp_path, **arrays):
    p = tmp_path / "bad.npz"
    np.savez(p, **arrays)
    return p


X0, Y0 = _toy()


@pytest.mark.parametrize("arrays, match", [
    (dict(y=Y0), r"missing key 'X'"),
    (dict(X=X0), r"missing key 'y'"),
    (dict(X=X0, y=Y0, X_test=X0), r"has 'X_test' but missing key 'y_test'"),
    (dict(X=X0[:, 0], y=Y0), r"X: must be 2-D"),
    (dict(X=X0, y=Y0[:-1]), r"y: has 39 labels but X has 40 rows; len\(X\) must equal len\(y\)"),
    (dict(X=np.zeros((0, 3)), y=np.zeros(0, int)), r"X: empty data"),
    (dict(X=np.where(np.arange(120).reshape(40, 3) == 7, np.nan, X0), y=Y0), r"X: contains NaN or inf .* first at \[2, 1\]"),
    (dict(X=np.where(np.arange(120).reshape(40, 3) == 7, np.inf, X0), y=Y0), r"X: contains NaN or inf"),
    (dict(X=X0, y=Y0 + 0.5), r"y: classification labels must be integers"),
    (dict(X=X0, y=Y0 - 1), r"y: classification labels must be integers in 0\.\.999 \(at most 1000 classes\); label at index 0 is outside"),
    (dict(X=X0, y=Y0 * 10**7), r"y: .*at most 1000 classes\); label at index 1 is outside"),
    (dict(X=X0, y=(Y0 * 1000).astype(float)), r"y: .*at most 1000 classes\); label at index 1 is not"),
    (dict(X=X0, y=np.zeros(40, int)), r"y: classification needs at least 2 classes"),
    (dict(X=X0, y=Y0.reshape(20, 2)), r"y: classification labels must be 1-D"),
    (dict(X=X0, y=Y0, X_test=X0[:, :2], y_test=Y0), r"X_test: has shape \(2,\) per sample but X has \(3,\)"),
    (dict(X=X0.astype(str), y=Y0), r"X: must be real numeric"),
    (dict(X=np.array([[1, 2], [3, None]], dtype=object), y=np.array([0, 1])), r"X holds Python objects, which would need pickle"),
])
def test_load_arrays_bad_npz(tmp_path, arrays, match):
    with pytest.raises(ValueError, match=match):
        data.load_arrays(_npz(tmp_path, **arrays))


@pytest.mark.parametrize("text, match", [
    ("", r"empty data"),
    ("a,b,label\n", r"empty data"),
    ("1,2,0\n3,4\n", r"CSV must be numeric with the same number of columns"),
    ("a,b,label\n1,2,0\n3,x,1\n", r"CSV must be numeric"),
    ("1\n2\n", r"CSV needs at least 2 columns"),
    ("1,nan,0\n2,3,1\n", r"X: contains NaN or inf"),
    ("1,2,0.5\n2,3,1\n", r"y: classification labels must be integers"),
    ("1,2,-1\n2,3,1\n", r"y: classification labels must be integers in 0\.\.999"),
])
def test_load_arrays_bad_csv(tmp_path, text, match):
    p = tmp_path / "bad.csv"
    p.write_text(text)
    with pytest.raises(ValueError, match=match):
        data.load_arrays(p)


def test_load_arrays_bad_path_and_args(tmp_path):
    with pytest.raises(ValueError, match=r"path: unknown extension '.txt'.*expected .npz, .csv or an IDX images file"):
        data.load_arrays(tmp_path / "x.txt")
    with pytest.raises(FileNotFoundError, match=r"path: no such file"):
        data.load_arrays(tmp_path / "missing.npz")
    notzip = tmp_path / "junk.npz"
    notzip.write_bytes(b"not a zip file")
    with pytest.raises(ValueError, match=r"junk.npz"):
        data.load_arrays(notzip)
    p = _npz(tmp_path, X=X0, y=Y0)
    with pytest.raises(ValueError, match=r"task: must be one of"):
        data.load_arrays(p, task="ranking")
    with pytest.raises(ValueError, match=r"test_fraction: must be a number in \(0, 1\)"):
        data.load_arrays(p, test_fraction=0.0)
    with pytest.raises(ValueError, match=r"seed: must be an integer >= 0"):
        data.load_arrays(p, seed=-3)


# ----------------------------------------------------------------------------- Dataset, config

def test_dataset_checks_its_fields():
    X = np.zeros((4, 2), np.float32)
    y = np.zeros(4, np.int64)
    with pytest.raises(ValueError, match=r"Dataset.task"):
        data.Dataset(X, y, X, y, n_classes=2, task="ranking", name="t")
    with pytest.raises(ValueError, match=r"Dataset.X_train: must be a 2-D float32 array"):
        data.Dataset(X.astype(np.float64), y, X, y, n_classes=2, task="classification", name="t")
    with pytest.raises(ValueError, match=r"Dataset.y_test: regression needs a 2-D float32"):
        data.Dataset(X, X, X, y, n_classes=0, task="regression", name="t")
    with pytest.raises(ValueError, match=r"len\(X_train\) = 4 != len\(y_train\) = 3"):
        data.Dataset(X, y[:3], X, y, n_classes=2, task="classification", name="t")
    assert "n_train=4" in repr(data.Dataset(X, y, X, y, n_classes=2, task="classification", name="t"))


def test_load_dataset_dispatch(tmp_path):
    assert _same(data.load_dataset(DataConfig(dataset="digits", test_fraction=0.25, seed=9)),
                 data.load_digits(test_fraction=0.25, seed=9))
    cfg = DataConfig(dataset="synthetic", n_samples=100, n_features=5, n_classes=4, seed=2)
    ds = data.load_dataset(cfg)
    assert _same(ds, data.make_synthetic(n_samples=100, n_features=5, n_classes=4, seed=2))
    assert (ds.n_features, ds.n_classes) == (5, 4)
    p = _npz(tmp_path, X=X0, y=Y0)
    assert _same(data.load_dataset(DataConfig(dataset="file", path=str(p), seed=1)), data.load_arrays(p, seed=1))
    with pytest.raises(ValueError, match=r"DataConfig.path: required"):
        data.load_dataset(DataConfig(dataset="file"))
    with pytest.raises(TypeError, match=r"cfg: expected a qatlab.config.DataConfig"):
        data.load_dataset({"dataset": "digits"})


def test_data_imports_numpy_only():
    code = ("import sys, qatlab.data; bad = [m for m in ('sklearn', 'panel', 'bokeh') "
            "if m in sys.modules]; print(bad); sys.exit(bool(bad))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert out.returncode == 0, out.stdout + out.stderr
