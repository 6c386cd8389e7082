"""Shared fixtures for the qatlab test suite."""
from __future__ import annotations

import os
import sys

import numpy as np
import pytest

# `tests/reference.py` (slow numpy references) is imported as `reference` by the test modules.
sys.path.insert(0, os.path.dirname(__file__))


@pytest.fixture
def rng() -> np.random.Generator:
    """A fresh, seeded generator per test (deterministic data)."""
    return np.random.default_rng(20240601)


@pytest.fixture
def torch():
    """PyTorch, or skip the test cleanly when it is not installed."""
    return pytest.importorskip("torch")
