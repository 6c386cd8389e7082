"""VSAGradientCompressor and its kernels (project, bind/bundle, unbind/back-project) vs numpy."""
from __future__ import annotations

import tracemalloc

import numpy as np
import pytest

from qatlab.config import VSAConfig
from qatlab.kernels.phase_kernels import vsa_bind_bundle, vsa_project, vsa_unbind_backproject
from qatlab.train.vsa import VSABundle, VSAGradientCompressor, VSAHistory, expected_cosine

F32 = np.float32
U64 = np.uint64


# ----------------------------------------------------------------- numpy references
def draw_ref(key, idx):
    """splitmix64 output idx of ``key`` (same as tests/test_ternary_accumulator.py)."""
    z = np.full(np.shape(idx), key, dtype=U64) + (np.asarray(idx, dtype=U64) + U64(1)) * U64(0x9E3779B97F4A7C15)
    z ^= z >> U64(30)
    z *= U64(0xBF58476D1CE4E5B9)
    z ^= z >> U64(27)
    z *= U64(0x94D049BB133111EB)
    return z ^ (z >> U64(31))


def slots_ref(proj_key, n, k, dim):
    """(n, k) slot indices and signs of R's columns, from the counter-based hash."""
    base = draw_ref(proj_key, np.arange(n))
    h = np.stack([draw_ref(b, np.arange(k)) for b in base])
    idx = ((h >> U64(32)) * U64(dim)) >> U64(32)
    sign = np.where(h & U64(1), -1.0, 1.0)
    return idx.astype(np.int64), sign


def dense_r(proj_key, n, k, dim):
    """The explicit (D, n) projection matrix (small sizes only)."""
    idx, sign = slots_ref(proj_key, n, k, dim)
    r = np.zeros((dim, n))
    for i in range(n):
        np.add.at(r[:, i], idx[i], sign[i] / np.sqrt(k))
    return r


def key_ref(key, dim):
    return np.where(draw_ref(key, np.arange(dim)) & U64(1), -1.0, 1.0)


def test_project_matches_dense_matrix(rng):
    n, k, dim, key = 37, 5, 64, U64(99)
    g = rng.standard_normal(n).astype(F32)
    y = np.full(dim, 7.0)
    vsa_project(g, key, k, y)
    np.testing.assert_allclose(y, dense_r(key, n, k, dim) @ g.astype(np.float64), rtol=1e-12, atol=1e-12)


def test_bind_bundle_matches_numpy(rng):
    dim, key = 64, U64(12345)
    y = rng.standard_normal(dim)
    bundle = rng.standard_normal(dim).astype(F32)
    before = bundle.copy()
    scale = vsa_bind_bundle(y, key, bundle)
    q = np.clip(np.rint(y / np.abs(y).mean()), -1, 1)
    assert scale == pytest.approx(np.abs(y)[q != 0].mean(), rel=1e-12)
    np.testing.assert_array_equal(bundle, before + (key_ref(key, dim) * scale * q).astype(F32))


def test_unbind_backproject_matches_dense_transpose(rng):
    n, k, dim, key, pkey = 29, 3, 64, U64(5), U64(6)
    bundle = rng.standard_normal(dim).astype(F32)
    out = np.zeros(n, F32)
    vsa_unbind_backproject(bundle, key, pkey, k, np.zeros(dim), out)
    ref = dense_r(pkey, n, k, dim).T @ (key_ref(key, dim) * bundle)
    np.testing.assert_allclose(out, ref.astype(F32), rtol=1e-6, atol=1e-6)


# ----------------------------------------------------------------- compressor
def model(n_per=(6000, 3000, 1000)):
    return [(f"p{i}", (n,)) for i, n in enumerate(n_per)]


def sample(shapes, seed=0):
    r = np.random.default_rng(seed)
    return {name: r.standard_normal(shape).astype(F32) for name, shape in shapes}


def test_config_fields_are_used():
    c = VSAGradientCompressor(model(), VSAConfig(dimension=2048, compression_ratio=0.01, seed=1))
    assert c.dimension == 2048 and c.slots_per_element == 20
    assert VSAGradientCompressor(model(), VSAConfig(dimension=64, compression_ratio=0.001)).slots_per_element == 1
    assert c.bytes_before == 4 * 10_000 and c.bytes_after == 4 * 2048
    for field, bad in [("dimension", 32), ("compression_ratio", 0.0), ("compression_ratio", 1.5), ("seed", -1)]:
        with pytest.raises(ValueError, match=field):
            VSAConfig(**{field: bad})


def test_roundtrip_shapes_and_cosine_near_expected():
    shapes = model()
    c = VSAGradientCompressor(shapes, VSAConfig(dimension=2048, compression_ratio=0.01))
    g = sample(shapes)
    bundle = c.compress(g)
    assert bundle.vector.shape == (2048,) and bundle.vector.dtype == F32 and bundle.nbytes == 8192
    recon = c.decompress(bundle)
    assert {k: v.shape for k, v in recon.items()} == dict(shapes) and recon["p0"].dtype == F32
    rep = c.measure(g)
    assert rep.expected_cosine == pytest.approx(expected_cosine(10_000, 2048))   # 0.89 / sqrt(1 + 4.88) = 0.367
    assert abs(rep.cosine - rep.expected_cosine) < 0.04
    assert rep.bytes_before == 40_000 and rep.bytes_after == 8192 and rep.ratio == pytest.approx(40_000 / 8192)
    target = {name: np.zeros(shape, F32) for name, shape in shapes}
    assert c.decompress(bundle, out=target) is target
    np.testing.assert_array_equal(target["p1"], recon["p1"])


def test_more_dimensions_reconstruct_better():
    shapes = model()
    g = sample(shapes)
    cos = [VSAGradientCompressor(shapes, VSAConfig(dimension=d, compression_ratio=8 / d)).measure(g).cosine
           for d in (512, 4096, 32768)]
    assert cos[0] < cos[1] < cos[2]
    assert cos[2] > 0.7


def test_same_seed_same_bundle_other_seed_differs():
    shapes = model()
    g = sample(shapes)
    mk = lambda seed: VSAGradientCompressor(shapes, VSAConfig(dimension=1024, compression_ratio=0.01, seed=seed))
    a, b, other = mk(3).compress(g), mk(3).compress(g), mk(4).compress(g)
    np.testing.assert_array_equal(a.vector, b.vector)
    assert not np.array_equal(a.vector, other.vector)
    np.testing.assert_array_equal(mk(3).decompress(a)["p2"], mk(3).decompress(b)["p2"])


def test_bundle_keeps_tensors_apart():
    """Each tensor is bound to its own key: one tensor's gradient is not read back into another."""
    shapes = model((4000, 4000))
    c = VSAGradientCompressor(shapes, VSAConfig(dimension=4096, compression_ratio=0.005))
    g = sample(shapes)
    g["p1"][:] = 0.0
    recon = c.decompress(c.compress(g))
    cos = lambda a, b: float(a @ b / np.linalg.norm(a) / np.linalg.norm(b))
    assert cos(recon["p0"], g["p0"]) > 0.5
    assert abs(cos(recon["p1"], g["p0"])) < 0.05


def test_validation():
    shapes = model()
    c = VSAGradientCompressor(shapes, VSAConfig(dimension=256))
    g = sample(shapes)
    with pytest.raises(ValueError, match=r"grads\['p1'\]: expected shape \(3000,\), got \(30,\)"):
        c.compress({**g, "p1": np.zeros(30, F32)})
    with pytest.raises(ValueError, match="bundle: expected dimension 256"):
        c.decompress(VSABundle(vector=np.zeros(128, F32), scales=np.zeros(3), size=10_000))
    with pytest.raises(ValueError, match="VSABundle"):
        c.decompress(np.zeros(256, F32))
    with pytest.raises(TypeError, match="VSAConfig"):
        VSAGradientCompressor(shapes, config="x")


def test_million_parameter_model_under_100mb():
    """1M parameters, D = 8192: < 100 MB extra (traced) and the cosine the formula predicts."""
    shapes = [("w1", (784, 1024)), ("b1", (1024,)), ("w2", (1024, 230)), ("b2", (230,))]
    g = sample(shapes, seed=1)
    n = sum(v.size for v in g.values())
    assert n >= 1_000_000
    cfg = VSAConfig(dimension=8192, compression_ratio=0.001)    # k = 8 slots per element
    VSAGradientCompressor([("x", (8,))], cfg).measure({"x": np.ones(8, F32)})   # compile outside the trace
    tracemalloc.start()
    try:
        c = VSAGradientCompressor(shapes, cfg)
        rep = c.measure(g)
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert peak < 100 * 2**20
    assert peak < 4 * n + 2**20          # the (n,) float32 reconstruction + O(D)
    assert c.nbytes < 2**20 and rep.bytes_after == 32768
    print(f"\n1M-parameter VSA: cosine {rep.cosine:.4f} (expected {rep.expected_cosine:.4f}, "
          f"chance ~{1 / np.sqrt(n):.4f}), {rep.bytes_before} -> {rep.bytes_after} bytes, peak {peak / 2**20:.1f} MB")
    assert abs(rep.cosine - rep.expected_cosine) < 0.015
    assert rep.cosine > 50 / np.sqrt(n)       # 50 standard deviations above chance


# ----------------------------------------------------------------- VSAHistory (phase training's trend entries)
def test_history_weighted_sum_is_the_decoded_weighted_bundle():
    """Decoding is linear: weighted_sum = sum_k c_k decompress(bundle_k), and close to sum_k c_k g_k."""
    shapes = model()
    cfg = VSAConfig(dimension=2048, compression_ratio=0.01)
    hist, codec = VSAHistory(3, shapes, cfg), VSAGradientCompressor(shapes, cfg)
    rng = np.random.default_rng(5)
    base = rng.standard_normal(10_000)
    flats = [(base + 0.1 * rng.standard_normal(10_000)).astype(F32) for _ in range(3)]
    for slot, f in enumerate(flats):
        hist.write(slot, f)
        np.testing.assert_array_equal(hist.rows[slot], codec.compress(codec.layout.views(f)).vector)
    coeffs = np.array([0.5, 0.0, 2.0])
    out = np.full(10_000, np.nan, F32)
    assert hist.weighted_sum(coeffs, out) is out
    decoded = [codec.decompress_flat(hist.rows[k], np.zeros(10_000, F32)).astype(np.float64) for k in (0, 2)]
    np.testing.assert_allclose(out, 0.5 * decoded[0] + 2.0 * decoded[1], rtol=1e-4, atol=1e-4)
    truth = 0.5 * flats[0].astype(np.float64) + 2.0 * flats[2]
    cos = float(out @ truth / np.linalg.norm(out) / np.linalg.norm(truth))
    assert abs(cos - expected_cosine(10_000, 2048)) < 0.05


def test_history_bytes_do_not_grow_with_the_model():
    small, big = VSAHistory(5, model(), VSAConfig(dimension=1024)), VSAHistory(5, model((40_000, 40_000)),
                                                                              VSAConfig(dimension=1024))
    assert small.nbytes == big.nbytes == 5 * 1024 * 4 + 1024 * 4 + big.compressor.nbytes
    assert small.capacity == 5


def test_history_validation():
    hist = VSAHistory(2, model(), VSAConfig(dimension=256))
    before = hist.rows.copy()
    with pytest.raises(ValueError, match=r"flat: a flat array must be float32 of shape \(10000,\)"):
        hist.write(0, np.zeros(10, F32))
    with pytest.raises(ValueError, match="NaN"):
        hist.write(0, np.full(10_000, np.inf, F32))
    with pytest.raises(ValueError, match=r"slot: must be in \[0, 2\), got 2"):
        hist.write(2, np.ones(10_000, F32))
    np.testing.assert_array_equal(hist.rows, before)
    with pytest.raises(ValueError, match="capacity"):
        VSAHistory(0, model())
