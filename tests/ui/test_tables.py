"""qatlab.ui.tables: a Tabulator brought up to date by patches and streamed rows."""
from __future__ import annotations

import math

import pandas as pd

from qatlab.ui.tables import patch_and_stream, same


class _Table:
    def __init__(self):
        self.patches, self.streamed = [], []

    def patch(self, patch):
        self.patches.append(patch)

    def stream(self, rows):
        self.streamed.append(rows)


def test_changed_cells_are_patched_and_new_rows_streamed():
    old = pd.DataFrame({"id": ["a", "b"], "loss": [1.0, math.nan], "status": ["running", "running"]})
    new = pd.DataFrame({"id": ["a", "b", "c"], "loss": [0.5, math.nan, 2.0], "status": ["running", "finished", "created"]})
    table = _Table()
    patch_and_stream(table, old, new)
    assert table.patches == [{"loss": [(0, 0.5)], "status": [(1, "finished")]}]     # NaN == NaN: not patched
    assert len(table.streamed) == 1 and list(table.streamed[0]["id"]) == ["c"]
    quiet = _Table()
    patch_and_stream(quiet, new, new.copy())
    assert quiet.patches == [] and quiet.streamed == []


def test_same_treats_nan_alike_and_uncomparable_values_as_different():
    assert same(math.nan, math.nan) and same(1, 1.0) and not same(1.0, 2.0)
    assert not same(pd.Series([1, 2]), pd.Series([1, 2]))          # (ambiguous truth: different)
