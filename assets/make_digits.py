"""Regenerate ``assets/digits.npz`` from scikit-learn's bundled copy of the digits.

Run once (from the repository root) with scikit-learn installed::

    python assets/make_digits.py

scikit-learn is *not* a dependency of qatlab; only this script imports it.
Output: ``X`` (1797, 64) uint8 with the original pixel counts 0..16, and
``y`` (1797,) uint8 with labels 0..9, in scikit-learn's order, compressed.
"""
from pathlib import Path

import numpy as np
from sklearn.datasets import load_digits


def main() -> None:
    bunch = load_digits()
    X = np.asarray(bunch.data)
    y = np.asarray(bunch.target)
    assert X.shape == (1797, 64) and y.shape == (1797,)
    assert np.array_equal(X, np.rint(X)) and X.min() >= 0 and X.max() <= 16
    assert y.min() == 0 and y.max() == 9
    out = Path(__file__).resolve().parent / "digits.npz"
    np.savez_compressed(out, X=X.astype(np.uint8), y=y.astype(np.uint8))
    print(f"wrote {out} ({out.stat().st_size} bytes)")


if __name__ == "__main__":
    main()
