"""The live-storage tracker follows storages resized in place (FSDP2 frees and re-allocates its
unsharded parameters with UntypedStorage.resize_, which no dispatch mode sees)."""

from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")

from validate.tracker import LiveStorageTracker  # noqa: E402


def test_resize_in_place_is_tracked() -> None:
    keep = torch.empty(1024)  # 4 KiB, allocated before tracking
    tracker = LiveStorageTracker()
    tracker.track([keep])
    assert tracker.live_bytes == 4096
    with tracker:
        keep.untyped_storage().resize_(0)  # freed in place
        assert tracker.live_bytes == 0
        keep.untyped_storage().resize_(8192)  # re-allocated, larger
        assert tracker.live_bytes == 8192
        grown = torch.empty(0)
        grown.untyped_storage().resize_(1000)  # first seen when it grows: rounded to 512 B blocks
        assert tracker.live_bytes == 8192 + 1024
    assert tracker.peak_bytes == 8192 + 1024
    assert torch.UntypedStorage.resize_ is not None  # the original method is back
    empty = torch.empty(0)
    empty.untyped_storage().resize_(64)  # outside the tracker: not counted
    assert tracker.live_bytes == 8192 + 1024


def test_views_of_untracked_storages_are_counted_unless_tracked_first() -> None:
    """Documented pitfall: register what exists before tracking (parameters, batches)."""
    weight = torch.randn(256, 256)
    tracker = LiveStorageTracker()
    tracker.track([weight])
    with tracker:
        _ = weight.t()  # a view: no new storage
    assert tracker.live_bytes == 256 * 256 * 4
