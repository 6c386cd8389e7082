"""qatlab.data: the named datasets (digits, mnist, mnist1d, Fashion-MNIST), cards and IDX files."""
from __future__ import annotations

import gzip
import os
import struct

import numpy as np
import pytest

from qatlab import data
from qatlab.config import DataConfig
from qatlab.data import shipped

IDX_CODES = {np.dtype(np.uint8): 0x08, np.dtype(np.int8): 0x09, np.dtype(">i2"): 0x0B, np.dtype(">i4"): 0x0C,
             np.dtype(">f4"): 0x0D, np.dtype(">f8"): 0x0E}


def idx_bytes(arr: np.ndarray) -> bytes:
    """The IDX encoding of ``arr`` (big-endian), written independently of the reader."""
    big = arr.astype(arr.dtype.newbyteorder(">")) if arr.dtype.itemsize > 1 else arr
    code = IDX_CODES[big.dtype]
    return bytes([0, 0, code, arr.ndim]) + struct.pack(f">{arr.ndim}I", *arr.shape) + big.tobytes()


def write_idx(path, arr: np.ndarray, gz: bool | None = None):
    raw = idx_bytes(arr)
    gz = str(path).endswith(".gz") if gz is None else gz
    path.write_bytes(gzip.compress(raw) if gz else raw)
    return path


def _same(a, b) -> bool:
    return all(np.array_equal(getattr(a, k), getattr(b, k)) for k in ("X_train", "y_train", "X_test", "y_test"))


# ----------------------------------------------------------------------------- mnist

def test_mnist_asset_raw():
    with np.load(data.MNIST_PATH, allow_pickle=False) as f:
        assert sorted(f.files) == ["X", "y"]
        X, y = f["X"], f["y"]
    assert X.shape == (5000, 28, 28) and X.dtype == np.uint8
    assert y.shape == (5000,) and y.dtype == np.uint8
    assert X.min() == 0 and X.max() == 255
    assert np.array_equal(np.bincount(y), [500] * 10)
    assert 1e6 * 0.5 < data.MNIST_PATH.stat().st_size < 1.5e6  # compressed, about 1 MB


def test_mnist_loader():
    ds = data.load_mnist()
    assert (ds.name, ds.n_classes, ds.n_features, ds.image_shape) == ("mnist", 10, 784, (1, 28, 28))
    assert (ds.n_train, ds.n_test) == (4000, 1000)
    assert ds.X_train.dtype == np.float32 and ds.y_train.dtype == np.int64
    X = np.concatenate([ds.X_train, ds.X_test])
    assert X.min() == 0.0 and X.max() == 1.0
    with np.load(data.MNIST_PATH) as f:
        raw, labels = f["X"], f["y"]
    perm = np.random.default_rng(0).permutation(5000)
    # rows are the images flattened row-major, divided by 255 in float32
    np.testing.assert_array_equal(ds.X_test[0], raw[perm[0]].reshape(-1).astype(np.float32) / np.float32(255))
    assert np.array_equal(ds.y_train, labels[perm[1000:]])
    assert ds.X_train.reshape(-1, *ds.image_shape).shape == (4000, 1, 28, 28)
    other = data.load_mnist(test_fraction=0.3, seed=2)
    assert (other.n_train, other.n_test) == (3500, 1500) and not np.array_equal(other.y_test[:100], ds.y_test[:100])
    ds.X_train[:] = 7  # copies: the cache is untouched
    assert data.load_mnist().X_train.max() == 1.0


# ----------------------------------------------------------------------------- mnist1d

def test_mnist1d_asset_and_loader():
    with np.load(data.MNIST1D_PATH, allow_pickle=False) as f:
        assert sorted(f.files) == ["X", "X_test", "y", "y_test"]
        X, Xt, y, yt = f["X"], f["X_test"], f["y"], f["y_test"]
    assert X.shape == (4000, 40) and Xt.shape == (1000, 40) and X.dtype == np.float32
    assert set(np.unique(y)) == set(np.unique(yt)) == set(range(10))
    allx = np.concatenate([X, Xt]).astype(np.float64)
    assert abs(allx.mean()) < 1e-3 and abs(allx.std() - 1) < 1e-3  # the package standardises the whole set
    ds = data.load_mnist1d()
    assert (ds.name, ds.n_train, ds.n_test, ds.n_features, ds.image_shape) == ("mnist1d", 4000, 1000, 40, (1, 1, 40))
    assert np.array_equal(ds.X_train, X) and np.array_equal(ds.y_test, yt)  # the shipped split, in order
    ds.X_test[:] = 0
    assert np.array_equal(data.load_mnist1d().X_test, Xt)


def test_load_dataset_named_sets():
    assert _same(data.load_dataset(DataConfig(dataset="mnist", seed=3)), data.load_mnist(seed=3))
    # mnist1d keeps its split whatever test_fraction and seed say
    fixed = data.load_dataset(DataConfig(dataset="mnist1d", test_fraction=0.4, seed=5))
    assert _same(fixed, data.load_mnist1d())
    assert data.load_dataset(DataConfig(dataset="digits")).image_shape == (1, 8, 8)
    assert data.load_dataset(DataConfig(dataset="synthetic", n_samples=50)).image_shape is None


def test_dataset_cards():
    assert set(data.DATASET_CARDS) == {"digits", "mnist", "mnist1d", "fashion_mnist"}
    assert set(data.DATASET_CARDS) <= set(DataConfig.param.dataset.objects)
    for name, card in data.DATASET_CARDS.items():
        assert {"size", "classes", "input_shape", "source", "licence"} <= set(card), name
        assert card["classes"] == 10 and len(card["input_shape"]) == 3
    for name, loader in (("digits", data.load_digits), ("mnist", data.load_mnist), ("mnist1d", data.load_mnist1d)):
        ds = loader()
        assert data.DATASET_CARDS[name]["input_shape"] == ds.image_shape
        assert str(ds.n_train + ds.n_test) in data.DATASET_CARDS[name]["size"].replace(" ", "") or \
            str(ds.n_train) in data.DATASET_CARDS[name]["size"]
    assert "CC BY-SA 3.0" in data.DATASET_CARDS["mnist"]["licence"]


def test_dataset_image_shape_checked():
    X = np.zeros((4, 6), np.float32)
    y = np.arange(4) % 2
    ok = data.Dataset(X, y, X, y, n_classes=2, task="classification", name="t", image_shape=(1, 2, 3))
    assert ok.image_shape == (1, 2, 3) and "image_shape=(1, 2, 3)" in repr(ok)
    for bad in [(1, 2, 2), (2, 3), (1, 2, 3.0), (0, 6, 1), [1, 2, 3]]:
        with pytest.raises(ValueError, match=r"Dataset.image_shape: must be None or a tuple of 3 ints"):
            data.Dataset(X, y, X, y, n_classes=2, task="classification", name="t", image_shape=bad)


# ----------------------------------------------------------------------------- IDX

@pytest.mark.parametrize("dtype", [np.uint8, np.int8, ">i2", ">i4", ">f4", ">f8"])
@pytest.mark.parametrize("gz", [False, True])
def test_read_idx_round_trip(tmp_path, dtype, gz):
    arr = (np.arange(2 * 3 * 5) % 120 - (0 if dtype == np.uint8 else 60)).reshape(2, 3, 5).astype(dtype)
    got = data.read_idx(write_idx(tmp_path / "a-idx3-ubyte", arr, gz=gz))
    assert got.shape == (2, 3, 5) and got.dtype == np.dtype(dtype).newbyteorder("=") and np.array_equal(got, arr)
    labels = data.read_idx(write_idx(tmp_path / "l-idx1-ubyte", np.array([3, 1, 4], np.uint8), gz=gz))
    assert labels.tolist() == [3, 1, 4]


GOOD = idx_bytes(np.arange(24, dtype=np.uint8).reshape(2, 3, 4))


@pytest.mark.parametrize("raw, match", [
    (b"", r"truncated IDX file: the magic number needs 4 bytes, only 0"),
    (b"\x00\x00\x08", r"truncated IDX file: the magic number"),
    (b"\x01" + GOOD[1:], r"not an IDX file \(the magic number must start with two zero bytes\)"),
    (b"PK\x03\x04" + GOOD[4:], r"not an IDX file"),
    (GOOD[:2] + b"\x07" + GOOD[3:], r"unknown IDX dtype code 0x07; expected one of 0x08, 0x09, 0x0B"),
    (GOOD[:3] + b"\x00" + GOOD[4:], r"IDX header gives 0 dimensions; expected 1..4"),
    (GOOD[:3] + b"\x05" + GOOD[4:], r"IDX header gives 5 dimensions"),
    (GOOD[:10], r"truncated IDX file: the dimension sizes needs 12 bytes, only 6"),
    (GOOD[:4] + struct.pack(">3I", 2, 0, 4) + GOOD[16:], r"IDX header gives an empty shape \(2, 0, 4\)"),
    (GOOD[:-1], r"truncated IDX file: shape \(2, 3, 4\) of uint8 needs 24 bytes, only 23 present"),
    (GOOD + b"\x00", r"IDX file is longer than its header's shape \(2, 3, 4\)"),
    (GOOD[:4] + struct.pack(">3I", 2_000_000, 1, 1) + GOOD[16:], r"2000000 samples, above the limit of 1000000"),
    (GOOD[:4] + struct.pack(">3I", 1, 400, 400) + GOOD[16:], r"160000 features per sample, above the limit of 100000"),
    (GOOD[:2] + b"\x0e" + GOOD[3:4] + struct.pack(">3I", 900_000, 10, 10) + GOOD[16:],
     r"its arrays would take 686.6 MB in memory once read, above the limit of 400.0 MB"),
])
@pytest.mark.parametrize("gz", [False, True])
def test_read_idx_corrupt(tmp_path, raw, match, gz):
    p = tmp_path / "bad-images-idx3-ubyte"
    p.write_bytes(gzip.compress(raw) if gz else raw)
    with pytest.raises(ValueError, match=r"bad-images-idx3-ubyte: " + match):
        data.read_idx(p)


def test_read_idx_broken_gzip_and_paths(tmp_path):
    whole = gzip.compress(GOOD)
    for name, raw in [("cut", whole[: len(whole) // 2]), ("flipped", whole[:12] + bytes([whole[12] ^ 0xFF]) + whole[13:]),
                      ("crc", whole[:-8] + bytes(8))]:
        p = tmp_path / f"{name}-idx3-ubyte.gz"
        p.write_bytes(raw)
        with pytest.raises(ValueError, match=rf"{name}-idx3-ubyte.gz: (corrupt or truncated gzip stream|truncated IDX)"):
            data.read_idx(p)
    with pytest.raises(ValueError, match=r"is a directory, not an IDX file"):
        data.read_idx(tmp_path)
    with pytest.raises(ValueError, match=r"no such file 'missing-idx1-ubyte'"):
        data.read_idx(tmp_path / "missing-idx1-ubyte")


def _idx_set(folder, n_train=30, n_test=12, gz=True, seed=0, prefix=("train", "t10k")):
    rng = np.random.default_rng(seed)
    folder.mkdir(parents=True, exist_ok=True)
    ext = ".gz" if gz else ""
    out = {}
    for part, n in zip(prefix, (n_train, n_test)):
        X = rng.integers(0, 256, (n, 28, 28), dtype=np.uint8)
        y = (np.arange(n) % 10).astype(np.uint8)
        write_idx(folder / f"{part}-images-idx3-ubyte{ext}", X)
        write_idx(folder / f"{part}-labels-idx1-ubyte{ext}", y)
        out[part] = (X, y)
    return out


def test_load_arrays_idx_pair(tmp_path):
    raw = _idx_set(tmp_path, n_train=40, gz=False)
    ds = data.load_arrays(tmp_path / "train-images-idx3-ubyte", test_fraction=0.25, seed=1)
    X, y = raw["train"]
    perm = np.random.default_rng(1).permutation(40)
    assert (ds.n_train, ds.n_test, ds.image_shape, ds.n_classes) == (30, 10, (1, 28, 28), 10)
    np.testing.assert_array_equal(ds.X_test, X[perm[:10]].reshape(10, -1).astype(np.float32) / np.float32(255))
    assert np.array_equal(ds.y_train, y[perm[10:]])
    (tmp_path / "t10k-labels-idx1-ubyte").unlink()
    with pytest.raises(ValueError, match=r"t10k-images-idx3-ubyte: no labels file t10k-labels-idx1-ubyte\[.gz\] beside it"):
        data.load_arrays(tmp_path / "t10k-images-idx3-ubyte")
    write_idx(tmp_path / "t10k-labels-idx1-ubyte", np.zeros(5, np.uint8))
    with pytest.raises(ValueError, match=r"has 12 images but t10k-labels-idx1-ubyte has 5 labels"):
        data.load_arrays(tmp_path / "t10k-images-idx3-ubyte")


def test_idx_labels_symlinked_elsewhere_are_refused(tmp_path):
    inside, outside = tmp_path / "in", tmp_path / "out"
    _idx_set(outside, gz=False)
    inside.mkdir()
    os.link(outside / "train-images-idx3-ubyte", inside / "train-images-idx3-ubyte")  # a real file inside
    (inside / "train-labels-idx1-ubyte").symlink_to(outside / "train-labels-idx1-ubyte")
    with pytest.raises(ValueError, match=r"no labels file"):
        data.load_arrays(inside / "train-images-idx3-ubyte")


# ----------------------------------------------------------------------------- fashion-mnist

def test_fashion_mnist_from_a_directory(tmp_path, monkeypatch):
    raw = _idx_set(tmp_path / "fm")
    ds = data.load_fashion_mnist(tmp_path / "fm")
    assert (ds.name, ds.n_train, ds.n_test, ds.image_shape, ds.n_classes) == ("fashion_mnist", 30, 12, (1, 28, 28), 10)
    Xt, yt = raw["t10k"]
    np.testing.assert_array_equal(ds.X_test, Xt.reshape(12, -1).astype(np.float32) / np.float32(255))
    assert np.array_equal(ds.y_test, yt) and ds.X_train.flags.writeable
    via_cfg = data.load_dataset(DataConfig(dataset="fashion_mnist", path=str(tmp_path / "fm")))
    assert _same(ds, via_cfg)
    # the server's data directory: $QATLAB_DATA_DIR/fashion-mnist, uncompressed files also work
    _idx_set(tmp_path / "srv" / "fashion-mnist", n_train=20, n_test=10, gz=False, seed=1)
    monkeypatch.setenv("QATLAB_DATA_DIR", str(tmp_path / "srv"))
    assert data.load_dataset(DataConfig(dataset="fashion_mnist")).n_train == 20


def test_fashion_mnist_absent_says_how_to_get_it(tmp_path, monkeypatch):
    monkeypatch.setattr(shipped, "FASHION_MNIST_SYSTEM_DIR", tmp_path / "nowhere")
    monkeypatch.delenv("QATLAB_DATA_DIR", raising=False)
    with pytest.raises(ValueError, match=r"apt-get install dataset-fashion-mnist.*train-images-idx3-ubyte.gz"):
        data.load_dataset(DataConfig(dataset="fashion_mnist"))
    partial = tmp_path / "partial"
    _idx_set(partial)
    (partial / "t10k-labels-idx1-ubyte.gz").unlink()
    with pytest.raises(ValueError, match=r"Fashion-MNIST IDX files are not in .*partial"):
        data.load_fashion_mnist(partial)


def test_fashion_mnist_wrong_images_refused(tmp_path):
    _idx_set(tmp_path)
    write_idx(tmp_path / "t10k-images-idx3-ubyte.gz", np.zeros((12, 27, 28), np.uint8))
    with pytest.raises(ValueError, match=r"t10k files in .* are not uint8 28x28 images"):
        data.load_fashion_mnist(tmp_path)


def test_fashion_mnist_debian_package():
    """The real files from Debian's dataset-fashion-mnist (CI installs it)."""
    if not all((data.FASHION_MNIST_SYSTEM_DIR / n).is_file() for n in data.FASHION_MNIST_FILES):
        if os.environ.get("QATLAB_REQUIRE_DATASETS") == "1":
            pytest.fail(f"QATLAB_REQUIRE_DATASETS=1 but {data.FASHION_MNIST_SYSTEM_DIR} lacks the IDX files")
        pytest.skip("Fashion-MNIST not installed: apt-get install dataset-fashion-mnist")
    ds = data.load_fashion_mnist(data.FASHION_MNIST_SYSTEM_DIR)
    assert (ds.n_train, ds.n_test, ds.n_features, ds.image_shape) == (60000, 10000, 784, (1, 28, 28))
    assert ds.X_train.dtype == np.float32 and ds.X_train.min() == 0.0 and ds.X_train.max() == 1.0
    assert np.array_equal(np.bincount(ds.y_train), [6000] * 10)
    assert np.array_equal(np.bincount(ds.y_test), [1000] * 10)
    assert ds.y_train[:5].tolist() == [9, 0, 0, 3, 0] and ds.y_test[:5].tolist() == [9, 2, 1, 1, 6]


def test_save_upload_idx(tmp_path):
    imgs = np.arange(2 * 28 * 28, dtype=np.uint8).reshape(2, 28, 28)
    body = gzip.compress(idx_bytes(imgs))
    p = data.save_upload("train-images-idx3-ubyte.gz", body, tmp_path)
    assert p == tmp_path / "train-images-idx3-ubyte.gz" and np.array_equal(data.read_idx(p), imgs)
    again = data.save_upload("train-images-idx3-ubyte.gz", body, tmp_path)
    assert again.name == "train-1-images-idx3-ubyte.gz"  # still an images file that finds its labels
    assert data.save_upload("images-idx3-ubyte.gz", body, tmp_path).name == "images-idx3-ubyte.gz"
    assert data.save_upload("images-idx3-ubyte.gz", body, tmp_path).name == "1-images-idx3-ubyte.gz"
    assert data.save_upload("SHOUT-IMAGES-IDX3-UBYTE.GZ", body, tmp_path).name == "SHOUT-IMAGES-IDX3-UBYTE.GZ"
    labels = data.save_upload("train-labels-idx1-ubyte", idx_bytes(np.array([1, 2], np.uint8)), tmp_path)
    assert data.load_arrays(p, test_fraction=0.5).n_classes == 3 and labels.is_file()
    before = sorted(tmp_path.iterdir())
    with pytest.raises(ValueError, match=r"t10k-images-idx3-ubyte.gz: truncated IDX file"):
        data.save_upload("t10k-images-idx3-ubyte.gz", gzip.compress(idx_bytes(imgs)[:-5]), tmp_path)
    assert sorted(tmp_path.iterdir()) == before
