"""Updating a Tabulator in place: patch the cells that changed and stream the new rows, since
replacing its value re-renders the whole table (and loses the reader's scroll position)."""
from __future__ import annotations

import math

import pandas as pd


def same(a, b) -> bool:
    """Equal cells, NaN equal to NaN; values that cannot be compared are different."""
    if isinstance(a, float) and isinstance(b, float) and math.isnan(a) and math.isnan(b):
        return True
    try:
        return bool(a == b)
    except (TypeError, ValueError):
        return False


def patch_and_stream(table, old: pd.DataFrame, new: pd.DataFrame) -> None:
    """Bring ``table`` (showing ``old``) to ``new``, whose first ``len(old)`` rows are the same rows
    in the same order, with the same columns."""
    n = len(old)
    patch = {}
    for col in new.columns:
        changed = [(i, v) for i, (v, o) in enumerate(zip(new[col].iloc[:n], old[col])) if not same(v, o)]
        if changed:
            patch[col] = changed
    if patch:
        table.patch(patch)
    if len(new) > n:
        table.stream(new.iloc[n:])
