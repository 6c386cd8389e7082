"""``python -m qatlab.bench SUITE``: see :mod:`qatlab.bench`."""
import sys

from . import main

sys.exit(main())
