"""qatlab.data: digits asset, synthetic tasks, user files, config dispatch."""
from __future__ import annotations

import io
import re
import struct
import subprocess
import sys
import tracemalloc
import zipfile
import zlib

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


@pytest.mark.slow
def test_data_imports_numpy_only():
    code = ("import sys, qatlab.data; bad = [m for m in ('sklearn', 'panel', 'bokeh') "
            "if m in sys.modules]; print(bad); sys.exit(bool(bad))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert out.returncode == 0, out.stdout + out.stderr


# ----------------------------------------------------------------------------- file safety (issue #19)

PASSWD = ("root:x:0:0:root:/root:/bin/bash\ndaemon:x:1:1:daemon:/usr/sbin:/usr/sbin/nologin\n"
          "bin:x:2:2:bin:/bin:/usr/sbin/nologin\n")


def _message(fn, *args, **kwargs) -> str:
    with pytest.raises(ValueError) as info:
        fn(*args, **kwargs)
    return str(info.value)


@pytest.mark.parametrize("text, where", [
    (PASSWD, r"secret.csv: CSV needs at least 2 columns \(features..., label\), got 1"),
    (PASSWD.replace(":", ","), r"row 2, column 1: not a number"),
    ("f1,f2,label\n1,2,0\n3,4,1\n5,daemon:x:1,1\n", r"row 4, column 2: not a number"),
    ("1,2,0\n3,4,1\n5,6\n", r"row 3: has 2 columns, expected 3"),
])
def test_csv_errors_never_quote_contents(tmp_path, text, where):
    p = tmp_path / "secret.csv"
    p.write_text(text)
    msg = _message(data.load_arrays, p)
    assert re.search(where, msg), msg
    assert "daemon" not in msg and "root" not in msg and "5,6" not in msg
    assert str(tmp_path) not in msg  # the file's name only, not the server's directories


def test_binary_csv_and_directory(tmp_path):
    p = tmp_path / "bin.csv"
    p.write_bytes(b"1,2,0\n\xff\xfesecret\n")
    msg = _message(data.load_arrays, p)
    assert "not a UTF-8 text CSV (undecodable byte at offset 6)" in msg and "secret" not in msg
    d = tmp_path / "folder.npz"
    d.mkdir()
    assert "'folder.npz' is a directory" in _message(data.load_arrays, d)
    assert f"{tmp_path.name!r} is a directory" in _message(data.load_arrays, tmp_path)


def test_npz_errors_name_only_the_expected_keys(tmp_path):
    p = tmp_path / "keys.npz"
    np.savez(p, features_secret_name=X0, y=Y0)
    msg = _message(data.load_arrays, p)
    assert "missing key 'X'" in msg and "secret" not in msg


def test_npz_member_not_npy(tmp_path):
    p = tmp_path / "fake.npz"
    with zipfile.ZipFile(p, "w") as zf:
        zf.writestr("X.npy", "root:x:0:0:root:/root:/bin/bash\n")
        zf.writestr("y.npy", "")
    msg = _message(data.load_arrays, p)
    assert "fake.npz: member 'X' is not a .npy array" in msg and "root" not in msg


def test_npz_truncated_or_corrupt(tmp_path):
    good = tmp_path / "good.npz"
    np.savez_compressed(good, X=X0, y=Y0)
    raw = good.read_bytes()
    cut = tmp_path / "cut.npz"
    cut.write_bytes(raw[: len(raw) // 2])
    assert "cut.npz: not a readable .npz file" in _message(data.load_arrays, cut)
    # a flipped byte in the compressed X data: a bad CRC or a broken deflate stream, not a crash
    with zipfile.ZipFile(good) as zf:
        info = zf.getinfo("X.npy")
    start = info.header_offset + 30 + len(info.filename) + len(info.extra) + 200
    flipped = tmp_path / "flipped.npz"
    flipped.write_bytes(raw[:start] + bytes([raw[start] ^ 0xFF]) + raw[start + 1:])
    msg = _message(data.load_arrays, flipped)
    assert "flipped.npz" in msg
    # a header that promises more than the member holds
    short = tmp_path / "short.npz"
    with zipfile.ZipFile(short, "w") as zf:
        with zf.open("X.npy", "w") as f:
            np.lib.format.write_array_header_1_0(f, {"descr": "<f4", "fortran_order": False, "shape": (40, 3)})
            f.write(X0[:10].tobytes())
        with zf.open("y.npy", "w") as f:
            np.lib.format.write_array(f, Y0)
    assert "short.npz: member 'X' is shorter than its .npy header says" in _message(data.load_arrays, short)


def _zip_bomb(path, shape=(100_000, 1000), chunk=8_000_000):
    """An honest .npz whose X.npy holds float64 zeros of ``shape`` (800 MB), deflated ~1000:1
    by repeating one self-contained deflate block, so the big array is never built."""
    buf = io.BytesIO()
    np.lib.format.write_array_header_1_0(buf, {"descr": "<f8", "fortran_order": False, "shape": shape})
    header = buf.getvalue()
    reps, rest = divmod(int(np.prod(shape)) * 8, chunk)
    assert rest == 0
    c = zlib.compressobj(9, zlib.DEFLATED, -15)
    head = c.compress(header) + c.flush(zlib.Z_FULL_FLUSH)
    zeros = bytes(chunk)
    block = c.compress(zeros) + c.flush(zlib.Z_FULL_FLUSH)  # no back-references across a full flush
    tail = c.flush()
    crc = zlib.crc32(header)
    for _ in range(reps):
        crc = zlib.crc32(zeros, crc)
    comp, size, name = len(head) + reps * len(block) + len(tail), len(header) + reps * chunk, b"X.npy"
    with open(path, "wb") as f:
        f.write(struct.pack("<IHHHHHIIIHH", 0x04034B50, 20, 0, 8, 0, 0x21, crc, comp, size, len(name), 0) + name)
        f.write(head + block * reps + tail)
        central = struct.pack("<IHHHHHHIIIHHHHHII", 0x02014B50, 20, 20, 0, 8, 0, 0x21, crc, comp, size,
                              len(name), 0, 0, 0, 0, 0, 0) + name
        offset = f.tell()
        f.write(central + struct.pack("<IHHHHIIH", 0x06054B50, 0, 0, 1, 1, len(central), offset, 0))
    with zipfile.ZipFile(path, "a", compression=zipfile.ZIP_DEFLATED) as zf:
        zf.writestr("y.npy", _npy_bytes((np.arange(shape[0]) % 10).astype(np.uint8)))
    return path


def _npy_bytes(a):
    buf = io.BytesIO()
    np.lib.format.write_array(buf, a)
    return buf.getvalue()


def test_npz_bomb_refused_before_loading(tmp_path):
    p = _zip_bomb(tmp_path / "bomb.npz")
    assert p.stat().st_size < 1_000_000
    with zipfile.ZipFile(p) as zf:
        assert zf.getinfo("X.npy").file_size > 800_000_000
    tracemalloc.start()
    try:
        msg = _message(data.load_arrays, p)
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert "bomb.npz: its arrays would take 763.0 MB in memory once read, above the limit of 400.0 MB" in msg
    assert peak < 20 * 2**20  # refused from the headers: nothing near the array's size was allocated


@pytest.mark.parametrize("arrays, match", [
    (dict(X=np.zeros((1, data.MAX_FEATURES + 1), np.float32), y=np.zeros(1, np.uint8)),
     r"X: 100001 features per sample, above the limit of 100000"),
    (dict(X=np.zeros((data.MAX_SAMPLES + 1, 1), np.uint8), y=np.zeros(data.MAX_SAMPLES + 1, np.uint8)),
     r"X: 1000001 samples, above the limit of 1000000"),
    (dict(X=np.zeros((4, 2)), y=np.array([0, 1, 2, 999])), None),
    (dict(X=np.zeros((4, 2)), y=np.array([0, 1, 2, 1000])), r"y: .*\(at most 1000 classes\); label at index 3"),
    (dict(X=np.zeros((4, 2)), y=np.array([0.0, 1.0, 2.0, 999999.0])), r"at most 1000 classes"),
])
def test_npz_limits(tmp_path, arrays, match):
    p = tmp_path / "big.npz"
    np.savez_compressed(p, **arrays)
    if match is None:
        assert data.load_arrays(p, test_fraction=0.25).n_classes == 1000
    else:
        with pytest.raises(ValueError, match=match):
            data.load_arrays(p)


def test_file_size_limits(tmp_path, monkeypatch):
    from qatlab.data import files
    p = _npz(tmp_path, X=X0, y=Y0)
    monkeypatch.setattr(files, "MAX_FILE_BYTES", p.stat().st_size - 1)
    assert re.search(r"bad.npz: file is 0.0 MB, above the limit of 0.0 MB", _message(data.load_arrays, p))
    c = tmp_path / "big.csv"
    c.write_text("1,0\n2,1\n" * 10)
    monkeypatch.setattr(files, "MAX_CSV_BYTES", 50)
    assert "big.csv: file is" in _message(data.load_arrays, c)
    assert data.MAX_FILE_BYTES == 200 * 2**20 and data.MAX_CSV_BYTES == 50 * 2**20


def test_csv_huge_label_refused_before_building_a_model(tmp_path):
    p = tmp_path / "four.csv"
    p.write_text("1,2,0\n3,4,1\n5,6,2\n7,8,999999\n")
    assert "at most 1000 classes); label at index" in _message(data.load_arrays, p)


def test_npz_image_arrays_keep_their_shape(tmp_path):
    X = np.random.default_rng(0).random((20, 2, 5, 6)).astype(np.float32)
    y = np.arange(20) % 4
    p = _npz(tmp_path, X=X, y=y, X_test=X[:5], y_test=y[:5])
    ds = data.load_arrays(p)
    assert ds.image_shape == (2, 5, 6) and ds.X_train.shape == (20, 60)
    assert np.array_equal(ds.X_train.reshape(-1, 2, 5, 6), X)
    gray = data.load_arrays(_npz(tmp_path, X=X[:, 0], y=y))
    assert gray.image_shape == (1, 5, 6) and gray.n_features == 30
    pixels = (X[:, 0] * 255).astype(np.uint8)
    scaled = data.load_arrays(_npz(tmp_path, X=pixels, y=y, X_test=pixels[:3], y_test=y[:3]))
    np.testing.assert_array_equal(scaled.X_test, pixels[:3].reshape(3, 30).astype(np.float32) / np.float32(255))
    table = data.load_arrays(_npz(tmp_path, X=pixels.reshape(20, 30), y=y))  # a 2-D uint8 table keeps its values
    assert table.X_train.max() == pixels.max() and table.image_shape is None
    with pytest.raises(ValueError, match=r"X_test: has shape \(30,\) per sample but X has \(5, 6\)"):
        data.load_arrays(_npz(tmp_path, X=X[:, 0], y=y, X_test=X[:, 0].reshape(20, 30), y_test=y))
    with pytest.raises(ValueError, match=r"X: must be 2-D \(n_samples, n_features\), 3-D \(n, H, W\) or 4-D"):
        data.load_arrays(_npz(tmp_path, X=X[..., None], y=y))


# ----------------------------------------------------------------------------- the server's data directory

@pytest.fixture
def data_dir(tmp_path):
    root = tmp_path / "data"
    (root / "sub" / "deeper").mkdir(parents=True)
    (root / ".hidden").mkdir()
    np.savez(root / "a.npz", X=X0, y=Y0)
    (root / "sub" / "b.csv").write_text("1,2,0\n3,4,1\n5,6,0\n7,8,1\n9,1,0\n")
    (root / "sub" / "deeper" / "train-images-idx3-ubyte.gz").write_bytes(b"")
    (root / "sub" / "deeper" / "train-labels-idx1-ubyte.gz").write_bytes(b"")  # found beside, not listed
    (root / "sub" / "notes.txt").write_text("x")
    (root / ".hidden" / "c.npz").write_bytes(b"")
    (root / ".d.npz").write_bytes(b"")
    outside = tmp_path / "outside"
    outside.mkdir()
    (outside / "secret.csv").write_text(PASSWD)
    (root / "link_out.csv").symlink_to(outside / "secret.csv")
    (root / "linked_dir").symlink_to(outside, target_is_directory=True)
    (root / "link_in.npz").symlink_to(root / "a.npz")
    return root


def test_list_data_files(data_dir):
    assert data.list_data_files(data_dir) == ["a.npz", "link_in.npz", "sub/b.csv",
                                              "sub/deeper/train-images-idx3-ubyte.gz"]
    assert data.list_data_files(str(data_dir)) == data.list_data_files(data_dir)
    with pytest.raises(ValueError, match=r"data_dir: .* is not a directory"):
        data.list_data_files(data_dir / "a.npz")


def test_resolve_data_file(data_dir, tmp_path):
    assert data.resolve_data_file(data_dir, "sub/b.csv") == (data_dir / "sub" / "b.csv").resolve()
    assert data.resolve_data_file(data_dir, "link_in.npz") == (data_dir / "a.npz").resolve()
    assert data.resolve_data_file(data_dir, "sub/../a.npz") == (data_dir / "a.npz").resolve()
    refused = ["missing.npz", "../outside/secret.csv", str(tmp_path / "outside" / "secret.csv"), "/etc/passwd",
               "link_out.csv", "linked_dir/secret.csv", "sub", "", ".", "a.npz\x00"]
    messages = set()
    for name in refused:
        msg = _message(data.resolve_data_file, data_dir, name)
        messages.add(msg.replace(repr(name), "NAME"))
    assert messages == {"name: no data file NAME in the data directory"}  # missing and outside look the same
    with pytest.raises(TypeError, match=r"name: must be a str"):
        data.resolve_data_file(data_dir, None)


def _listing(d):
    return sorted(p.name for p in d.iterdir())


def test_save_upload(tmp_path):
    dest = tmp_path / "uploads"
    dest.mkdir()
    payload = _npy_bytes(X0)  # not a zip: must not be kept
    good = io.BytesIO()
    np.savez_compressed(good, X=X0, y=Y0)
    p = data.save_upload("../../etc/my data (1).npz", good.getvalue(), dest)
    assert p == dest / "my_data_1_.npz" and data.load_arrays(p).n_classes == 3
    again = data.save_upload("my data (1).npz", good.getvalue(), dest)
    assert again == dest / "my_data_1_-1.npz"  # never overwrites
    c = data.save_upload("C:\\Users\\x\\table.CSV", b"1,2,0\n3,4,1\n5,6,0\n7,8,1\n9,1,0\n", dest)
    assert c.name == "table.CSV"
    before = _listing(dest)
    cases = [("bad.npz", payload, r"bad.npz: not a readable .npz file"),
             ("pw.csv", PASSWD.replace(":", ",").encode(), r"pw.csv: CSV must be numeric .* row 2, column 1: not a number"),
             ("script.py", b"print(1)", r"filename: must end in .npz or .csv, or be an IDX file"),
             ("../", good.getvalue(), r"filename: must end in .npz or .csv"),
             ("x" * 120 + ".csv", b"1,0\n", r"filename: at most 100 characters"),
             ("huge.npz", b"\0" * (data.MAX_UPLOAD_BYTES + 1), r"content: upload is 20.0 MB, above the limit of 20 MB")]
    for name, content, match in cases:
        msg = _message(data.save_upload, name, content, dest)
        assert re.search(match, msg), msg
        assert "daemon" not in msg and ".upload-" not in msg
    assert _listing(dest) == before  # nothing kept, no temporary left behind
    with pytest.raises(TypeError, match=r"content: must be bytes"):
        data.save_upload("a.csv", "1,0\n", dest)
    with pytest.raises(ValueError, match=r"data_dir: .* is not a directory"):
        data.save_upload("a.csv", b"1,0\n2,1\n", tmp_path / "nope")
    listed = data.list_data_files(dest)
    assert listed == ["my_data_1_-1.npz", "my_data_1_.npz", "table.CSV"]
