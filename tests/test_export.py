"""model.export / ql.load_exported: integer weights round trip to the fake-quantized outputs; bad files."""
from __future__ import annotations

import json
import zipfile

import numpy as np
import pytest

import qatlab as ql
from qatlab.nn import export as ex
from qatlab.train.build import build_model, set_observing

CASES = {  # name: (weights, bits, per_channel, symmetric, scale_mode)
    "float": ("float", 4, False, True, "observer"),
    "fake_per_tensor": ("fake", 4, False, True, "observer"),
    "fake_per_channel": ("fake", 4, True, True, "observer"),
    "affine_lsq": ("fake", 8, False, False, "lsq"),
    "affine_per_channel": ("fake", 3, True, False, "observer"),
    "ternary": ("ternary", 4, False, True, "observer"),
}


def _cfg(case, activations="fake"):
    weights, bits, pc, sym, mode = CASES[case]
    cfg = ql.ExperimentConfig()
    cfg.model.hidden = [24, 16]
    q = cfg.quant
    q.weights, q.weight_bits, q.per_channel, q.symmetric, q.scale_mode = weights, bits, pc, sym, mode
    q.activations = activations
    return cfg


def _x(n=40, d=12, seed=1):
    return np.random.default_rng(seed).standard_normal((n, d)).astype(np.float32)


def _trained_like(case):
    """An Mlp with its quantizers, its activation observers fed one batch, then frozen (eval mode)."""
    model = build_model(_cfg(case), 12, 5)
    rng = np.random.default_rng(2)
    for _, p in model.parameters():                          # non-zero biases, varied weights
        p += rng.standard_normal(p.shape).astype(np.float32) * 0.1
    model.forward(_x(seed=3), model.scratch(40))
    set_observing(model, False)
    return model


@pytest.mark.parametrize("case", list(CASES))
def test_mlp_round_trip_bit_for_bit(case, tmp_path):
    model = _trained_like(case)
    path = model.export(tmp_path / "m.npz")
    loaded = ql.load_exported(path)
    x = _x()
    want = model.forward(x, model.scratch(len(x))).copy()
    np.testing.assert_array_equal(loaded.forward(x), want)
    np.testing.assert_array_equal(loaded.predict(x), np.argmax(want, axis=1))
    assert loaded.architecture == {"kind": "mlp", "sizes": [12, 24, 16, 5], "activation": "relu", "bias": True}
    kinds = {"float": "float", "ternary": "ternary"}.get(case, "int")
    assert [r["quant"] for r in loaded.meta["layers"]] == [kinds] * 3


def test_stored_integer_formats(tmp_path):
    with np.load(_trained_like("ternary").export(tmp_path / "t")) as z:
        assert z["dense0.trits"].dtype == np.uint8 and z["dense0.trits"].shape == (-(-12 * 24 // 4),)
        assert z["dense0.scale"].shape == () and "dense0.weight" not in z.files
        assert z["dense0.bias"].dtype == np.float32
    with np.load(_trained_like("fake_per_channel").export(tmp_path / "p")) as z:
        assert z["dense0.qweight"].dtype == np.int8 and z["dense0.qweight"].shape == (24, 12)
        assert z["dense0.scale"].shape == (24,) and z["dense0.zero_point"].dtype == np.int32
        assert z["dense0.qweight"].min() >= -8 and z["dense0.qweight"].max() <= 7
    with np.load(_trained_like("affine_lsq").export(tmp_path / "a")) as z:
        assert z["dense1.qweight"].dtype == np.uint8 and int(z["dense1.zero_point"]) == 128
        assert z["act0.scale"].dtype == np.float32


def test_export_without_bias_or_activation_quantizers(tmp_path):
    model = ql.Mlp([6, 5, 3], bias=False, weight_quantizers=[ql.TernaryQuantizer(), None])
    path = model.export(str(tmp_path / "nb"))
    assert path.endswith("nb.npz")
    x = _x(7, 6)
    np.testing.assert_array_equal(ql.load_exported(path).forward(x), model.forward(x, model.scratch(7)))


def _reference_trit_pack(trits):
    codes = [{0: 0, 1: 1, -1: 2}[int(t)] for t in trits.reshape(-1)]
    codes += [0] * (-len(codes) % 4)
    return np.array([sum(c << (2 * k) for k, c in enumerate(codes[i:i + 4])) for i in range(0, len(codes), 4)],
                    np.uint8)


@pytest.mark.parametrize("n", [1, 4, 7, 33])
def test_trit_packing_against_reference(n):
    trits = np.random.default_rng(n).integers(-1, 2, n).astype(np.int8)
    packed = ex.pack_trits(trits)
    np.testing.assert_array_equal(packed, _reference_trit_pack(trits))
    np.testing.assert_array_equal(ex.unpack_trits(packed, n), trits)


def test_unpack_rejects_bad_codes():
    with pytest.raises(ValueError, match="code"):
        ex.unpack_trits(np.array([0b11], np.uint8), 1)
    with pytest.raises(ValueError, match="padding"):
        ex.unpack_trits(np.array([0b0100], np.uint8), 1)
    with pytest.raises(ValueError, match="uint8"):
        ex.unpack_trits(np.zeros(3, np.uint8), 4)


def test_int_dtype():
    assert ex.int_dtype(-8, 7) == np.int8 and ex.int_dtype(0, 255) == np.uint8
    assert ex.int_dtype(-512, 511) == np.int16 and ex.int_dtype(0, 65535) == np.uint16


# ----------------------------------------------------------------------------- bad files


def _rewrite(path, out, change):
    """Copy the export at ``path`` to ``out`` after ``change(meta, arrays)``."""
    with np.load(path) as z:
        arrays = {k: z[k] for k in z.files}
    meta = json.loads(str(arrays.pop("meta")))
    change(meta, arrays)
    np.savez(out, meta=np.array(json.dumps(meta)), **arrays)
    return out


@pytest.fixture
def exported(tmp_path):
    return _trained_like("fake_per_channel").export(tmp_path / "good.npz"), tmp_path


def test_missing_and_not_npz(tmp_path):
    with pytest.raises(ValueError, match="no such file"):
        ql.load_exported(tmp_path / "absent.npz")
    (tmp_path / "junk.npz").write_bytes(b"not a zip file at all")
    with pytest.raises(ValueError, match="not a valid qatlab export"):
        ql.load_exported(tmp_path / "junk.npz")
    np.savez(tmp_path / "plain.npz", x=np.zeros(3))
    with pytest.raises(ValueError, match="meta"):
        ql.load_exported(tmp_path / "plain.npz")
    with pytest.raises(TypeError, match="path"):
        ql.load_exported(3)


def test_truncated_and_flipped_bytes(exported):
    path, tmp = exported
    data = open(path, "rb").read()
    (tmp / "cut.npz").write_bytes(data[: len(data) // 2])
    with pytest.raises(ValueError, match="not a valid qatlab export"):
        ql.load_exported(tmp / "cut.npz")
    with zipfile.ZipFile(path) as z:                    # flip a byte inside the stored weights
        info = z.getinfo("dense0.qweight.npy")
    bad = bytearray(data)
    bad[info.header_offset + 30 + len(info.filename) + 40] ^= 0xFF
    (tmp / "flip.npz").write_bytes(bytes(bad))
    with pytest.raises(ValueError, match="not a valid qatlab export"):
        ql.load_exported(tmp / "flip.npz")


@pytest.mark.parametrize("change, match", [
    (lambda m, a: m.update(format="other"), "format"),
    (lambda m, a: m.update(version=99), "version"),
    (lambda m, a: a.pop("dense1.scale"), "missing array 'dense1.scale'"),
    (lambda m, a: a.update({"dense0.scale": -a["dense0.scale"]}), "finite and > 0"),
    (lambda m, a: a.update({"dense0.qweight": a["dense0.qweight"].astype(np.int16)}), "dtype"),
    (lambda m, a: a.update({"dense0.qweight": np.full_like(a["dense0.qweight"], -8)})
     or m["layers"][0].update(qmin=-7), "outside"),
    (lambda m, a: m["layers"][1].update(weight_shape=[3, 3]), "shape"),
    (lambda m, a: m["layers"][0].update(quant="int2"), "unknown quant"),
    (lambda m, a: m["architecture"].update(sizes=[12, 24, 5]), "activation_quantizers"),
    (lambda m, a: m["architecture"].update(kind="rnn"), "unknown architecture"),
    (lambda m, a: a.update({"dense2.bias": a["dense2.bias"] * np.nan}), "NaN"),
])
def test_inconsistent_files(exported, change, match):
    path, tmp = exported
    bad = _rewrite(path, tmp / "bad.npz", change)
    with pytest.raises(ValueError, match=match):
        ql.load_exported(bad)


def test_corrupt_trits(tmp_path):
    path = _trained_like("ternary").export(tmp_path / "t.npz")

    def poison(meta, arrays):
        arrays["dense0.trits"] = arrays["dense0.trits"] | np.uint8(0b11)
    with pytest.raises(ValueError, match="corrupt"):
        ql.load_exported(_rewrite(path, tmp_path / "bad.npz", poison))


def test_export_rejects_bad_path_and_axis(tmp_path):
    model = ql.Mlp([4, 3])
    with pytest.raises(TypeError, match="path"):
        model.export(None)
    fq = ql.FakeQuantize(bits=4, axis=1, scale=np.ones(4, np.float32), zero_point=np.zeros(4, np.int64))
    model.set_quantizers([fq])
    with pytest.raises(ValueError, match="axis"):
        model.export(tmp_path / "x")
    assert not list(tmp_path.iterdir())            # nothing written


# ----------------------------------------------------------------------------- Cnn


@pytest.mark.parametrize("case", list(CASES))
def test_cnn_round_trip_bit_for_bit(case, tmp_path):
    from qatlab.nn.cnn import Cnn
    from qatlab.train.build import activation_quantizer, weight_quantizer

    cfg = _cfg(case)
    model = Cnn((1, 10, 10), [3, 4], 5, hidden=[6], kernel_size=3, pool=2, seed=4)
    rng = np.random.default_rng(5)
    for _, p in model.parameters():
        p += rng.standard_normal(p.shape).astype(np.float32) * 0.1
    model.set_quantizers([weight_quantizer(cfg, model.weights(i)) for i in range(model.num_layers)],
                         [activation_quantizer(cfg) for _ in range(model.num_layers - 1)])
    x = _x(9, 100, seed=6)
    model.forward(x, model.scratch(9))
    set_observing(model, False)
    loaded = ql.load_exported(model.export(tmp_path / "cnn"))
    np.testing.assert_array_equal(loaded.forward(x), model.forward(x, model.scratch(9)))
    np.testing.assert_array_equal(loaded.forward(x.reshape(9, 1, 10, 10)), loaded.forward(x))
    assert [r["name"] for r in loaded.meta["layers"]] == ["conv0", "conv1", "dense0", "dense1"]
    assert loaded.meta["layers"][0]["weight_shape"] == [3, 1, 3, 3]
    assert loaded.architecture["kind"] == "cnn" and loaded.architecture["conv_channels"] == [3, 4]


def test_cnn_file_with_wrong_architecture(tmp_path):
    from qatlab.nn.cnn import Cnn

    path = Cnn((1, 10, 10), [3], 5, kernel_size=3, pool=2).export(tmp_path / "c")
    bad = _rewrite(path, tmp_path / "bad.npz", lambda m, a: m["architecture"].update(conv_channels=[4]))
    with pytest.raises(ValueError, match="do not fit"):
        ql.load_exported(bad)
    bad = _rewrite(path, tmp_path / "bad2.npz", lambda m, a: m["architecture"].update(kernel_size=[11, 11]))
    with pytest.raises(ValueError, match="kernel_size"):
        ql.load_exported(bad)
