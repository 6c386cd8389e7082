"""Regenerate ``assets/mnist1d.npz`` with the ``mnist1d`` package (Greydanus, 2020).

mnist1d (with matplotlib, which it imports) is *not* a dependency of qatlab;
install both into a throwaway directory and point this script at it (from the
repository root)::

    python -m pip install --target /tmp/m1d mnist1d matplotlib
    python assets/make_mnist1d.py /tmp/m1d

Runs in its own process because ``make_dataset`` reseeds numpy's and Python's
global RNGs. Uses ``make_dataset(get_dataset_args())`` (the package's defaults,
seed 42: 5000 signals of length 40, 10 classes) rather than ``get_dataset()``,
which downloads a pickle. Output: ``X`` (4000, 40) float32, ``y`` (4000,) uint8,
``X_test`` (1000, 40) float32, ``y_test`` (1000,) uint8: the package's own
4000/1000 split, saved with ``np.savez_compressed``.
"""
import sys
from pathlib import Path

import numpy as np


def main(site: str) -> None:
    sys.path.append(site)  # after the project's own packages: its numpy wins
    from mnist1d.data import get_dataset_args, make_dataset

    d = make_dataset(get_dataset_args())
    X, y, Xt, yt = (np.asarray(d[k]) for k in ("x", "y", "x_test", "y_test"))
    assert X.shape == (4000, 40) and Xt.shape == (1000, 40), (X.shape, Xt.shape)
    assert set(np.unique(y)) == set(range(10)) and set(np.unique(yt)) == set(range(10))
    assert np.isfinite(X).all() and np.isfinite(Xt).all()
    out = Path(__file__).resolve().parent / "mnist1d.npz"
    np.savez_compressed(out, X=X.astype(np.float32), y=y.astype(np.uint8),
                        X_test=Xt.astype(np.float32), y_test=yt.astype(np.uint8))
    print(f"wrote {out} ({out.stat().st_size} bytes)")


if __name__ == "__main__":
    if len(sys.argv) != 2:
        sys.exit("usage: python assets/make_mnist1d.py SITE_DIR  (the --target dir mnist1d and matplotlib were installed into)")
    main(sys.argv[1])
