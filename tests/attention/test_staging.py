"""`attention/staging.py`: static buffers carved from one block, filled by one copy of the
prefix a replay wrote; every region aligned for its dtype and read back as staged."""

import numpy as np
import pytest
import torch

from attention.staging import ALIGN, StagedBuffers


def _buffers() -> StagedBuffers:
    staged = StagedBuffers(torch.device("cpu"))
    staged.add("ids", 5, torch.int64)
    staged.add("lens", 3, torch.int32)
    staged.add("mask", 7, torch.uint16)
    staged.add("out", 4, torch.int64)
    staged.allocate()
    return staged


def test_regions_are_aligned_views_of_one_block_at_fixed_addresses():
    staged = _buffers()
    assert all(region.offset % ALIGN == 0 for region in staged.regions.values())
    views = {name: staged.view(name) for name in staged.regions}
    assert [v.dtype for v in views.values()] == [torch.int64, torch.int32, torch.uint16, torch.int64]
    assert all(v.untyped_storage().data_ptr() == staged.block.untyped_storage().data_ptr() for v in views.values())
    staged.begin()
    staged.put("lens", np.array([4, 5]))
    staged.upload()
    assert staged.view("lens").data_ptr() == views["lens"].data_ptr()


def test_one_upload_writes_what_was_staged_and_only_the_prefix_it_reached():
    staged = _buffers()
    staged.view("out").fill_(-1)  # past every staged region: written only by the device
    staged.begin()
    ids = staged.put("ids", np.array([7, 8, 9]))
    lens = staged.put("lens", np.array([2, 3]), at=1)
    mask = staged.put("mask", np.array([[1, 2], [3, 65535]], dtype=np.uint16))
    assert ids.shape == (3,) and lens.shape == (2,) and mask.shape == (4,)
    staged.upload()
    assert ids.tolist() == [7, 8, 9] and lens.tolist() == [2, 3] and mask.tolist() == [1, 2, 3, 65535]
    assert staged.view("out").tolist() == [-1] * 4
    staged.begin()  # the next replay stages only its own values: nothing stale is relied on
    staged.put("ids", np.array([1]))
    staged.upload()
    assert staged.view("ids")[:1].tolist() == [1] and staged.view("mask")[:4].tolist() == [1, 2, 3, 65535]


def test_a_region_written_in_place_is_uploaded_with_the_rest():
    """`host`: the staged host memory of a region, written by the caller (no array of its own):
    uploaded by the same copy, up to the prefix it reached."""
    staged = _buffers()
    staged.view("out").fill_(-1)
    staged.begin()
    lens = staged.host("lens", 2, at=1)
    assert lens.dtype == np.int32 and lens.shape == (2,)
    lens[:] = 6
    np.add(np.arange(2, dtype=np.int32), 10, out=lens)
    staged.upload()
    assert staged.view("lens")[1:].tolist() == [10, 11] and staged.view("out").tolist() == [-1] * 4


def test_misuse_is_refused_with_the_region_named():
    staged = _buffers()
    with pytest.raises(RuntimeError, match="'lens'"):
        staged.put("lens", np.array([1]))
    staged.begin()
    with pytest.raises(ValueError, match="'lens'"):
        staged.put("lens", np.arange(3), at=1)
    with pytest.raises(ValueError, match="'mask'"):
        staged.host("mask", 8)
    with pytest.raises(RuntimeError, match="'late'"):
        staged.add("late", 1, torch.int64)


def test_replays_reuse_one_host_block_once_its_copy_ran():
    """On a CPU the copy has run by the time `upload` returns: every replay stages into the same
    host block (no allocation and no views made a replay), and each uploads its own values."""
    staged = _buffers()
    addresses = set()
    for value in (3, 4, 5):
        staged.begin()
        ids = staged.host("ids", 2)
        addresses.add(ids.ctypes.data)
        ids[:] = value
        staged.upload()
        assert staged.view("ids")[:2].tolist() == [value, value]
    assert len(addresses) == 1
