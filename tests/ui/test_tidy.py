"""qatlab.ui.tidy: the server collects dropped figures and trims its heap, only when figures were dropped."""
from __future__ import annotations

import gc
import platform
import weakref

import pytest

pytest.importorskip("panel")

from qatlab.ui import RunView, tidy  # noqa: E402


class _Cycle:
    def __init__(self):
        self.me = self


@pytest.fixture
def no_auto_gc():
    tidy.tidy_if_needed()          # (start clean)
    gc.disable()
    try:
        yield
    finally:
        gc.enable()


def test_garbage_is_collected_only_after_it_was_noted(no_auto_gc):
    cycle = _Cycle()
    ref = weakref.ref(cycle)
    del cycle
    assert not tidy.tidy_if_needed() and ref() is not None     # nothing noted: no collection
    tidy.note_garbage()
    assert tidy.tidy_if_needed() and ref() is None
    assert not tidy.tidy_if_needed()                            # once per note


def test_a_rebuild_notes_the_figures_it_drops(no_auto_gc):
    view = RunView()
    tidy.tidy_if_needed()
    view.request_rebuild()
    assert tidy.tidy_if_needed()


@pytest.mark.skipif(platform.libc_ver()[0] != "glibc", reason="malloc_trim is glibc's")
def test_the_heap_is_trimmed_on_glibc():
    assert tidy.trim_heap()
