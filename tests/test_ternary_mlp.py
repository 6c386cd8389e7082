"""TernaryMLP: forward against numpy, predict ties, sparsity, 2-bit packing, save/load validation."""
from __future__ import annotations

import os
import zipfile

import numpy as np
import pytest

from qatlab.nn.ternary_mlp import TernaryMLP, pack_trits, unpack_trits


def _random_mlp(sizes, seed=0) -> TernaryMLP:
    rng = np.random.default_rng(seed)
    trits = [rng.integers(-1, 2, size=(o, i)) for i, o in zip(sizes[:-1], sizes[1:])]
    return TernaryMLP(trits, rng.uniform(0.05, 0.5, size=len(trits)))


def _reference_forward(mlp: TernaryMLP, x) -> np.ndarray:
    """relu between layers, linear last layer, in float64."""
    a = np.asarray(x, dtype=np.float64)
    for i, (t, alpha) in enumerate(zip(mlp.trits, mlp.alphas)):
        a = a @ (t.astype(np.float64) * alpha).T
        if i < mlp.n_layers - 1:
            a = np.maximum(a, 0.0)
    return a


# ----------------------------------------------------------------------------- inference

@pytest.mark.parametrize("sizes", [(5, 7, 3), (32, 64, 8), (6, 9, 4, 2)])
def test_forward_matches_numpy(sizes):
    mlp = _random_mlp(sizes)
    x = np.random.default_rng(1).normal(size=(11, sizes[0])).astype(np.float32)
    y = mlp.forward(x)
    assert y.shape == (11, sizes[-1]) and y.dtype == np.float32
    np.testing.assert_allclose(y, _reference_forward(mlp, x), rtol=1e-5, atol=1e-5)
    single = mlp.forward(x[3])
    assert single.shape == (sizes[-1],)
    np.testing.assert_allclose(single, y[3], rtol=1e-6, atol=1e-6)
    assert mlp.sizes == tuple(sizes) and mlp.in_features == sizes[0] and mlp.out_features == sizes[-1]


def test_weights_are_alpha_times_trits():
    mlp = _random_mlp((4, 6, 3))
    for i in range(2):
        w = mlp.weights(i)
        assert w.dtype == np.float32
        assert np.array_equal(w, mlp.trits[i].astype(np.float32) * np.float32(mlp.alphas[i]))


def test_predict_ties_go_to_lowest_index():
    t1 = np.eye(3, dtype=np.int8)               # hidden = relu(x)
    t2 = np.array([[1, 0, 0], [1, 0, 0], [0, 1, 0], [0, 1, 0]])  # outputs (x0, x0, x1, x1)
    mlp = TernaryMLP([t1, t2], [1.0, 1.0])
    x = np.array([[1.0, 2.0, 0.0], [3.0, 1.0, 0.0], [0.0, 0.0, 5.0]], dtype=np.float32)
    assert mlp.predict(x).tolist() == [2, 0, 0]
    assert mlp.predict(x[0]) == 2 and isinstance(mlp.predict(x[0]), int)


def test_layer_sparsity():
    t1 = np.array([[0, 1], [0, 0], [-1, 0]])    # 4 of 6 zero
    t2 = np.array([[1, -1, 1]])
    mlp = TernaryMLP([t1, t2], [0.5, 0.25])
    assert mlp.layer_sparsity(0) == pytest.approx(4 / 6)
    assert mlp.layer_sparsity(1) == 0.0
    for bad in (2, -1, 1.0, True):
        with pytest.raises(ValueError, match="i: layer index"):
            mlp.layer_sparsity(bad)


def test_trits_are_read_only_copies():
    t1 = np.ones((3, 2), dtype=np.int8)
    mlp = TernaryMLP([t1, np.ones((1, 3), dtype=int)], [1.0, 1.0])
    t1[0, 0] = 0
    assert mlp.trits[0][0, 0] == 1
    with pytest.raises(ValueError):
        mlp.trits[0][0, 0] = 0


@pytest.mark.parametrize("trits, alphas, exc, match", [
    ([], [], ValueError, "at least one layer"),
    ([np.ones((3, 2))], [1.0, 2.0], ValueError, "alphas: expected 1"),
    ([np.ones((3, 2), dtype=np.float32)], [1.0], TypeError, "integer array"),
    ([np.ones(3, dtype=int)], [1.0], ValueError, r"trits\[0\]: expected a non-empty 2-D"),
    ([np.ones((3, 2), dtype=int), np.ones((1, 4), dtype=int)], [1.0, 1.0], ValueError, r"trits\[1\]: has 4 inputs"),
    ([np.full((3, 2), 2)], [1.0], ValueError, "-1, 0 or \\+1"),
    ([np.ones((3, 2), dtype=int)], [0.0], ValueError, r"alphas\[0\]"),
    ([np.ones((3, 2), dtype=int)], [float("nan")], ValueError, r"alphas\[0\]"),
])
def test_constructor_rejects_bad_input(trits, alphas, exc, match):
    with pytest.raises(exc, match=match):
        TernaryMLP(trits, alphas)


def test_forward_rejects_bad_shapes():
    mlp = _random_mlp((4, 5, 2))
    for bad in (np.zeros(3), np.zeros((2, 5)), np.zeros((0, 4)), np.zeros((1, 2, 4))):
        with pytest.raises(ValueError, match=r"x: expected shape \(4,\) or \(B, 4\)"):
            mlp.forward(bad)


# ----------------------------------------------------------------------------- packing

@pytest.mark.parametrize("n", range(1, 14))
def test_pack_round_trip_and_size(n):
    trits = np.random.default_rng(n).integers(-1, 2, size=n).astype(np.int8)
    packed = pack_trits(trits)
    assert packed.dtype == np.uint8 and packed.nbytes == (n + 3) // 4
    assert np.array_equal(unpack_trits(packed, (n,)), trits)


def test_pack_layout_is_documented_one():
    # codes (trit + 1) of [-1, 0, 1, 1] are 0, 1, 2, 2 -> 0 | 1<<2 | 2<<4 | 2<<6
    assert pack_trits(np.array([-1, 0, 1, 1])).tolist() == [0 | 4 | 32 | 128]
    assert pack_trits(np.array([1])).tolist() == [2 | 4 | 16 | 64]  # padding encodes 0


def test_unpack_rejects_bad_codes():
    with pytest.raises(ValueError, match="invalid 2-bit code 3"):
        unpack_trits(np.array([3], dtype=np.uint8), (4,))
    with pytest.raises(ValueError, match="padding"):
        unpack_trits(np.array([1 | 4 | 16 | 0], dtype=np.uint8), (3,))
    with pytest.raises(ValueError, match="expected uint8 of shape"):
        unpack_trits(np.zeros(3, dtype=np.uint8), (5,))
    with pytest.raises(ValueError, match="-1, 0 or"):
        pack_trits(np.array([2]))


# ----------------------------------------------------------------------------- save / load

@pytest.mark.parametrize("sizes", [(5, 7, 3), (3, 1, 1), (6, 9, 4, 2)])
def test_save_load_round_trip_exact(tmp_path, sizes):
    mlp = _random_mlp(sizes, seed=3)
    path = tmp_path / "model"  # no suffix: saved under exactly this name
    mlp.save(path)
    assert path.exists() and not (tmp_path / "model.npz").exists()
    back = TernaryMLP.load(path)
    assert back.sizes == mlp.sizes
    assert all(np.array_equal(a, b) and b.dtype == np.int8 for a, b in zip(mlp.trits, back.trits))
    assert back.alphas == mlp.alphas
    x = np.random.default_rng(0).normal(size=(9, sizes[0])).astype(np.float32)
    assert np.array_equal(back.forward(x), mlp.forward(x))


def test_saved_trits_take_two_bits(tmp_path):
    mlp = _random_mlp((129, 257, 3), seed=4)  # 33153 + 771 trits, both not multiples of 4
    path = tmp_path / "m.npz"
    mlp.save(path)
    with np.load(path, allow_pickle=False) as f:
        assert f["trits_0"].nbytes == (257 * 129 + 3) // 4 and f["trits_0"].dtype == np.uint8
        assert f["trits_1"].nbytes == (3 * 257 + 3) // 4
    n_trits = 257 * 129 + 3 * 257
    assert os.path.getsize(path) < n_trits / 4 + 2048  # vs n_trits bytes for int8


def _write_npz(path, **arrays):
    with open(path, "wb") as f:
        np.savez(f, **arrays)


def _valid_arrays():
    t1, t2 = np.array([[1, 0], [-1, 1], [0, 0]]), np.array([[1, -1, 0]])
    return {"format": np.array("qatlab.TernaryMLP"), "version": np.array(1), "sizes": np.array([2, 3, 1]),
            "alphas": np.array([0.5, 0.25], dtype=np.float32), "trits_0": pack_trits(t1), "trits_1": pack_trits(t2)}


@pytest.mark.parametrize("change, match", [
    ({"format": np.array("something else")}, "format: expected"),
    ({"version": np.array(2)}, "version: this reader supports 1"),
    ({"version": np.array(1.9)}, "version: this reader supports 1"),
    ({"version": np.array(1.0)}, "version: this reader supports 1"),
    ({"version": np.array("1")}, "version: this reader supports 1"),
    ({"version": np.array([1])}, "version: this reader supports 1"),
    ({"sizes": np.array([2, 0, 1])}, "sizes: expected"),
    ({"sizes": np.array([2.0, 3.0, 1.0])}, "sizes: expected"),
    ({"alphas": np.array([0.5, np.nan], dtype=np.float32)}, r"alphas\[1\]"),
    ({"alphas": np.array([0.5, -1.0], dtype=np.float32)}, r"alphas\[1\]"),
    ({"alphas": np.array([0.5, 0.25])}, "alphas: expected float32"),
    ({"trits_1": np.array([3], dtype=np.uint8)}, "trits_1: contains the invalid 2-bit code 3"),
    ({"trits_0": np.zeros(1, dtype=np.uint8)}, "trits_0: expected uint8 of shape"),
    ({"extra": np.zeros(1)}, "unexpected arrays"),
])
def test_load_rejects_malformed_content(tmp_path, change, match):
    arrays = _valid_arrays()
    arrays.update(change)
    path = tmp_path / "bad.npz"
    _write_npz(path, **arrays)
    with pytest.raises(ValueError, match=match):
        TernaryMLP.load(path)


def test_load_rejects_missing_arrays_pickles_and_non_npz(tmp_path):
    arrays = _valid_arrays()
    del arrays["trits_1"]
    _write_npz(tmp_path / "missing.npz", **arrays)
    with pytest.raises(ValueError, match="missing array 'trits_1'"):
        TernaryMLP.load(tmp_path / "missing.npz")
    arrays = _valid_arrays()
    arrays["format"] = np.array([{"evil": 1}], dtype=object)
    with open(tmp_path / "pickled.npz", "wb") as f:
        np.savez(f, **arrays)  # object arrays are pickled by np.save
    with pytest.raises(ValueError, match="not a readable TernaryMLP"):
        TernaryMLP.load(tmp_path / "pickled.npz")
    (tmp_path / "text.npz").write_text("not a zip")
    with pytest.raises(ValueError, match="not a readable TernaryMLP"):
        TernaryMLP.load(tmp_path / "text.npz")
    with zipfile.ZipFile(tmp_path / "empty.npz", "w"):
        pass
    with pytest.raises(ValueError, match="missing array 'format'"):
        TernaryMLP.load(tmp_path / "empty.npz")
    _write_npz(tmp_path / "good.npz", **_valid_arrays())
    assert TernaryMLP.load(tmp_path / "good.npz").sizes == (2, 3, 1)


def test_load_of_a_truncated_or_bit_flipped_file_raises_value_error(tmp_path):
    """Every damaged copy of a saved model either loads the same model (a flip in a byte the zip
    reader ignores) or raises the documented ValueError, never zipfile.BadZipFile or a CRC error."""
    mlp = _random_mlp((5, 7, 3), seed=3)
    good = tmp_path / "good.npz"
    mlp.save(good)
    raw = good.read_bytes()
    bad = tmp_path / "bad.npz"
    refused = 0
    damaged = [raw[:n] for n in range(0, len(raw), 7)]
    damaged += [raw[:i] + bytes([raw[i] ^ (1 << (i % 8))]) + raw[i + 1:] for i in range(len(raw))]
    for data in damaged:
        bad.write_bytes(data)
        try:
            back = TernaryMLP.load(bad)
        except ValueError:
            refused += 1
            continue
        assert back.sizes == mlp.sizes and back.alphas == mlp.alphas
        assert all(np.array_equal(a, b) for a, b in zip(mlp.trits, back.trits))
    assert refused > len(damaged) // 2     # most damage is caught (CRC, headers), none escapes


# ----------------------------------------------------------------------------- Mlp conversions

def test_forward_is_the_mlp_forward_of_its_weights():
    from qatlab.nn import Mlp
    tm = _random_mlp((6, 9, 4, 2), seed=4)
    mlp = Mlp(tm.sizes, activation="relu", bias=False)
    for i in range(tm.n_layers):
        mlp.weights(i)[:] = tm.weights(i)
    x = np.random.default_rng(2).normal(size=(13, 6)).astype(np.float32)
    assert np.array_equal(tm.forward(x), mlp.forward(x, mlp.scratch(13)))


@pytest.mark.parametrize("sizes", [(5, 7, 3), (4, 2)])
def test_to_mlp_then_from_mlp_gives_back_the_model(sizes):
    from qatlab.quant import SteKind, TernaryQuantizer
    tm = _random_mlp(sizes, seed=5)
    trits = list(tm.trits)
    trits[0] = np.zeros_like(trits[0])                 # an all-zero layer: its alpha comes back as eps
    tm = TernaryMLP(trits, tm.alphas)
    mlp = tm.to_mlp(ste="tanh")
    assert mlp.sizes == tm.sizes and not mlp.bias and mlp.activation == "relu"
    assert all(type(q) is TernaryQuantizer and q.ste is SteKind.TANH for q in mlp.weight_quantizers)
    back = TernaryMLP.from_mlp(mlp)
    assert all(np.array_equal(a, b) for a, b in zip(back.trits, tm.trits))
    assert back.alphas[1:] == tm.alphas[1:] and back.alphas[0] == np.finfo(np.float32).eps
    x = np.random.default_rng(3).normal(size=(6, sizes[0])).astype(np.float32)
    y = mlp.forward(x, mlp.scratch(6))               # the fake-quant forward of the latents
    assert np.array_equal(y, back.forward(x))


def test_from_mlp_ternarizes_each_layer_by_absmean_and_checks_the_model():
    from qatlab.nn import Mlp
    from qatlab.quant import ternary_quantize
    mlp = Mlp([8, 6, 3], activation="relu", bias=False, seed=3)
    tm = TernaryMLP.from_mlp(mlp)
    for i in range(2):
        trits, alpha = ternary_quantize(mlp.weights(i))
        assert np.array_equal(tm.trits[i], trits) and tm.alphas[i] == alpha
    with pytest.raises(TypeError, match="mlp: expected an Mlp"):
        TernaryMLP.from_mlp(tm)
    with pytest.raises(ValueError, match="mlp: .*no biases"):
        TernaryMLP.from_mlp(Mlp([8, 6, 3]))
    with pytest.raises(ValueError, match="mlp: .*relu"):
        TernaryMLP.from_mlp(Mlp([8, 6, 3], activation="tanh", bias=False))
