"""Lifetime probes that bite: buffers large enough (>= 1 MiB) that freeing them returns the pages to the OS, so a
use-after-free reads unmapped memory and faults instead of reading stale bytes back by luck.

Every probe reads and writes every byte of every surviving view. They run in an isolated child (``isolated``):
an implementation that frees too early crashes, and that crash is this test's failure, not the end of the run.
"""

from __future__ import annotations

import gc

import pytest
import torch

from conformance.areas.assertions import assert_bitwise_equal
from conformance.harness.observation import vm_locked_kib

pytestmark = [
    pytest.mark.conformance_area("pinning"),
    pytest.mark.requires(pin_backends="native"),
    pytest.mark.isolated,
]

MIB = 1 << 20
ELEMENTS = 4 * MIB // 4  # 4 MiB of float32


@pytest.fixture
def native(accelerator, monkeypatch):
    monkeypatch.setenv("HOSTOFFLOAD_PIN_BACKEND", "native")
    monkeypatch.setenv("HOSTOFFLOAD_PIN_REGISTER_DEVICE", "0")


def _exercise(view: torch.Tensor, expected: torch.Tensor, what: str) -> None:
    """Read every element (compare), then write every element and read it back."""
    assert_bitwise_equal(view, expected, what)
    view.fill_(-3.0)
    assert bool((view == -3.0).all()), f"{what}: a write did not stick"


def test_views_survive_unpin_and_gc_of_the_base(area_api, native):
    """unpin() unlocks at once (VmLck drops by the buffer's size) yet every view, at the start, middle and last
    page, stays readable and writable after the base tensor is gone; the pages go back only with the last
    view, and then nothing stays locked or counted."""
    gc.collect()
    stats0, locked0 = area_api.pinned_stats(), vm_locked_kib()
    buf = area_api.pin_empty(ELEMENTS, dtype=torch.float32)
    buf.copy_(torch.arange(ELEMENTS, dtype=torch.float32))
    locked_pinned = vm_locked_kib()
    views = {"head": buf[:1024], "middle": buf[ELEMENTS // 2 : ELEMENTS // 2 + 4096], "tail": buf[-1000:]}
    expected = {k: v.clone() for k, v in views.items()}
    assert area_api.unpin(buf) is True
    if locked_pinned - locked0 >= 4 * 1024:  # where this process can observe its own locking
        assert vm_locked_kib() <= locked_pinned - 4 * 1024, "unpin() did not unlock the pages now"
    del buf
    gc.collect()
    for name, view in views.items():
        _exercise(view, expected[name], f"{name} view after unpin and gc of the base")
    del view
    views.clear()
    gc.collect()
    assert area_api.pinned_stats() == stats0, "the allocation outlived its last view"
    assert vm_locked_kib() <= locked0, "pages stayed locked after the last view died"


def test_storage_taken_through_data_outlives_the_pinned_tensor(area_api, native):
    """``x = pinned.data; del pinned``: ``x`` shares the storage, so it keeps the allocation alive and fully
    usable (a deleter tied to the Python wrapper instead of the storage frees it here)."""
    gc.collect()
    stats0 = area_api.pinned_stats()
    pinned = area_api.pin_empty(ELEMENTS, dtype=torch.float32)
    pinned.copy_(torch.arange(ELEMENTS, dtype=torch.float32))
    x = pinned.data
    del pinned
    gc.collect()
    _exercise(x, torch.arange(ELEMENTS, dtype=torch.float32), "storage taken through .data")
    del x
    gc.collect()
    assert area_api.pinned_stats() == stats0


def test_data_replacement_releases_the_old_storage_and_keeps_old_views(area_api, native):
    """``pin_memory(t, make_copy=False)`` replaces ``t.data``; replacing it again (``t.data = other``) lets the
    pinned storage go once its last view dies, while a view taken before stays valid."""
    gc.collect()
    stats0 = area_api.pinned_stats()
    t = torch.arange(ELEMENTS, dtype=torch.float32)
    assert area_api.pin_memory(t, make_copy=False) is t and area_api.is_pinned(t)
    old_view = t[ELEMENTS // 3 : ELEMENTS // 3 + MIB // 4]
    expected = old_view.clone()
    t.data = torch.zeros(8)
    gc.collect()
    assert not area_api.is_pinned(t)
    _exercise(old_view, expected, "view of the replaced pinned storage")
    del old_view
    gc.collect()
    assert area_api.pinned_stats() == stats0, "the replaced storage was not released with its last view"
