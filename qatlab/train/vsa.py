r"""VSAGradientCompressor: gradients -> one D-dimensional hypervector, and back; VSAHistory: trend entries as such.

Phase training's predictor keeps its trend entries (block-mean gradients) as hypervectors when
``PhaseConfig.history_storage == "vsa"`` (:class:`VSAHistory`): D floats each whatever the model's
size. Decompression is linear, so the trend sum_i b_i G_i is decoded once from sum_i b_i bundle_i.

For each tensor t (flat g_t, n_t elements, index t in ``param_shapes``)::

    y_t    = R_t g_t                 sparse random projection (D,), R_t (D, n_t) never stored:
                                     element i hashes to k = max(1, round(compression_ratio * D))
                                     slots with signs +-1 / sqrt(k)  (phase_kernels.vsa_project)
    q_t    = absmean trits of y_t,   s_t = mean |y_t| over the non-zeros
    bundle = sum_t key_t * s_t q_t   key_t in {-1, +1}^D (bind), summed over tensors (bundle)

    decompress:  g_hat_t = R_t^T (key_t * bundle)     (unbind, back-project)

The projection keys and binding keys are hashes of (seed, t) (counter based, see
:mod:`qatlab.kernels.phase_kernels`), so only O(D) floats are ever held: a 1M-parameter model
compresses with a (D,) float64 scratch and a (D,) float32 bundle; decompress writes (n,) float32.

Expected quality. Without ternarization R^T R g = g + noise with |noise|^2 ~ (n / D) |g|^2
(n = all parameters: the other tensors leak through the bundle as noise of the same size);
absmean ternarization of a near-Gaussian y keeps a correlation of about 0.89. Hence, when
n * k >> D::

    cosine(g_hat, g) ~= 0.89 / sqrt(1 + n / D)     e.g. n = 1e6, D = 8192: ~0.08;
                                                     n = 5e4, D = 4096: ~0.24

(chance level is ~1 / sqrt(n); for n well below D the measured cosine is somewhat higher).
``compression_ratio`` sets k, i.e. the cost O(n k) of each compress / decompress and how
Gaussian y is, not the expected cosine (as long as n k >> D): the default 0.001 (k = 8 at D = 8192).
"""
from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np

from ..config import VSAConfig
from ..kernels.phase_kernels import (compare_vectors, draw, mix64, vsa_bind_bundle, vsa_project,
                                     vsa_unbind_backproject, weighted_rows)
from .predictors import ParamLayout

TERNARY_CORRELATION = 0.89   # ~ correlation of absmean trits with a Gaussian vector


@dataclass(frozen=True)
class VSABundle:
    """A compressed gradient: ``vector`` float32 (D,), ``scales`` float64 (T,) (s_t, for
    inspection only: already folded into ``vector``), ``size`` n of the source model."""

    vector: np.ndarray
    scales: np.ndarray
    size: int

    @property
    def nbytes(self) -> int:
        """Bytes needed to store / send the bundle (the vector)."""
        return self.vector.nbytes


@dataclass(frozen=True)
class VSAReport:
    """Round-trip quality: cosine(g_hat, g), the formula's expectation, bytes before / after."""

    cosine: float
    expected_cosine: float
    bytes_before: int
    bytes_after: int

    @property
    def ratio(self) -> float:
        """bytes_before / bytes_after."""
        return self.bytes_before / self.bytes_after


def expected_cosine(n: int, dimension: int) -> float:
    """0.89 / sqrt(1 + n / D): expected reconstruction cosine for n parameters (module doc)."""
    return TERNARY_CORRELATION / math.sqrt(1.0 + n / dimension)


class VSAGradientCompressor:
    """Compress dicts of gradients into a (D,) hypervector and back (module doc).

    Args:
        param_shapes: list of ``(name, shape)``.
        config: :class:`~qatlab.config.VSAConfig` (validated and copied).
    """

    def __init__(self, param_shapes, config: VSAConfig | None = None):
        config = VSAConfig() if config is None else config
        if not isinstance(config, VSAConfig):
            raise TypeError(f"config: must be a VSAConfig, got {type(config).__name__}")
        config.validate()
        self.config = config.copy()
        self.layout = ParamLayout(param_shapes)
        self.dimension = int(self.config.dimension)
        self.slots_per_element = max(1, round(self.config.compression_ratio * self.dimension))
        root = np.uint64(mix64(np.uint64(self.config.seed)))
        t_count = len(self.layout.names)
        self._proj_keys = [np.uint64(draw(root, 2 * t)) for t in range(t_count)]
        self._bind_keys = [np.uint64(draw(root, 2 * t + 1)) for t in range(t_count)]
        self._scratch = np.zeros(self.dimension, dtype=np.float64)
        self._scores = np.zeros(4, dtype=np.float64)

    @property
    def nbytes(self) -> int:
        """Bytes held between calls (the (D,) float64 scratch; keys are 2 ints per tensor)."""
        return self._scratch.nbytes + self._scores.nbytes

    @staticmethod
    def scratch_nbytes(dimension: int) -> int:
        """:attr:`nbytes` of a compressor of this dimension."""
        return 8 * int(dimension) + 8 * 4

    @property
    def bytes_before(self) -> int:
        """float32 bytes of an uncompressed gradient (4 n)."""
        return 4 * self.layout.size

    @property
    def bytes_after(self) -> int:
        """Bytes of a bundle (4 D)."""
        return 4 * self.dimension

    def compress(self, grads: dict) -> VSABundle:
        """Bundle ``grads`` (dict name -> float32 array) into a new :class:`VSABundle`."""
        flats = self.layout.check(grads)
        vector = np.zeros(self.dimension, dtype=np.float32)
        scales = self._bundle(flats, vector)
        return VSABundle(vector=vector, scales=scales, size=self.layout.size)

    def compress_flat(self, flat: np.ndarray, vector: np.ndarray) -> np.ndarray:
        """vector (float32 (D,), overwritten) = the bundle of ``flat`` (float32 (n,), every parameter
        in layout order); returns the scales s_t."""
        off = self.layout.offsets
        vector[:] = 0.0
        return self._bundle([flat[off[t]:off[t + 1]] for t in range(len(self.layout.names))], vector)

    def _bundle(self, flats: list, vector: np.ndarray) -> np.ndarray:
        scales = np.zeros(len(flats))
        for t, g in enumerate(flats):
            vsa_project(g, self._proj_keys[t], self.slots_per_element, self._scratch)
            scales[t] = vsa_bind_bundle(self._scratch, self._bind_keys[t], vector)
        return scales

    def decompress(self, bundle: VSABundle, out: dict | None = None) -> dict[str, np.ndarray]:
        """g_hat per parameter: dict name -> float32 array (new arrays, or copied into ``out``)."""
        if not isinstance(bundle, VSABundle):
            raise ValueError(f"bundle: must be a VSABundle, got {type(bundle).__name__}")
        if bundle.vector.shape != (self.dimension,) or bundle.size != self.layout.size:
            raise ValueError(f"bundle: expected dimension {self.dimension} and size {self.layout.size}, "
                             f"got {bundle.vector.shape[0]} and {bundle.size}")
        flat = self.decompress_flat(bundle.vector, np.empty(self.layout.size, dtype=np.float32))
        if out is not None:
            return self.layout.copy_out(flat, out)
        return self.layout.views(flat)

    def decompress_flat(self, vector: np.ndarray, out: np.ndarray) -> np.ndarray:
        """out (float32 (n,)) = g_hat of the bundle ``vector`` (float32 (D,)), every parameter in layout
        order; returns out."""
        off = self.layout.offsets
        for t in range(len(self.layout.names)):
            vsa_unbind_backproject(vector, self._bind_keys[t], self._proj_keys[t],
                                   self.slots_per_element, self._scratch, out[off[t]:off[t + 1]])
        return out

    def measure(self, grads: dict) -> VSAReport:
        """Compress and decompress ``grads``; report the cosine of the whole flat vector."""
        flats = self.layout.check(grads)
        recon = self.decompress(self.compress(grads))
        dot = aa = pp = 0.0
        for g, name in zip(flats, self.layout.names):
            compare_vectors(g, recon[name].reshape(-1), self._scores)
            dot, aa, pp = dot + self._scores[0], aa + self._scores[1], pp + self._scores[2]
        cos = dot / math.sqrt(aa * pp) if aa > 0 and pp > 0 else 0.0
        return VSAReport(cosine=float(cos), expected_cosine=expected_cosine(self.layout.size, self.dimension),
                         bytes_before=self.bytes_before, bytes_after=self.bytes_after)


class VSAHistory:
    """``capacity`` trend entries as bundles float32 (capacity, D) (module doc); ``compressor`` codes them."""

    storage = "vsa"

    def __init__(self, capacity: int, param_shapes, config: VSAConfig | None = None):
        if isinstance(capacity, bool) or not isinstance(capacity, (int, np.integer)) or capacity < 1:
            raise ValueError(f"capacity: must be an int >= 1, got {capacity!r}")
        self.compressor = VSAGradientCompressor(param_shapes, config)
        self.rows = np.zeros((int(capacity), self.compressor.dimension), dtype=np.float32)
        self._combined = np.zeros(self.compressor.dimension, dtype=np.float32)

    @property
    def capacity(self) -> int:
        return self.rows.shape[0]

    @property
    def nbytes(self) -> int:
        """Bytes held: the bundles, the combined bundle and the compressor's scratch."""
        return self.rows.nbytes + self._combined.nbytes + self.compressor.nbytes

    def reset(self) -> None:
        """Nothing to forget: rows are written before they are read (the hashes have no state)."""

    def write(self, slot: int, flat: np.ndarray) -> None:
        """Row ``slot`` = the bundle of ``flat`` (float32 (n,), every parameter in layout order)."""
        flat = self.compressor.layout.check_flat(flat, "flat")
        if not 0 <= slot < self.capacity:
            raise ValueError(f"slot: must be in [0, {self.capacity}), got {slot}")
        self.compressor.compress_flat(flat, self.rows[slot])

    def weighted_sum(self, coeffs: np.ndarray, out: np.ndarray) -> np.ndarray:
        """out (float32 (n,)) = the decoded sum_k coeffs[k] * bundle_k (coeffs float64 (capacity,)); returns out."""
        weighted_rows(self.rows, coeffs, self._combined)
        return self.compressor.decompress_flat(self._combined, out)
