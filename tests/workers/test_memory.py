"""KV memory: page allocator, full and hybrid-SWA allocators, pools."""

import pytest
import torch

from attention import AttentionLayer
from workers.memory import (
    HybridSWAAllocator,
    HybridSWAPool,
    KVAllocator,
    KVLayout,
    MHAPool,
    OutOfKVError,
    PageAllocator,
    ReqToTokenPool,
    build_pool,
    kv_layouts,
)


def test_page_allocator_counts_and_double_free():
    pa = PageAllocator(8, 4, "test pool")
    pages = pa.alloc(3)
    assert 0 not in pages and pa.num_free == 5
    with pytest.raises(OutOfKVError):
        pa.alloc(6)
    pa.free(pages[:2])
    with pytest.raises(RuntimeError, match="double free"):
        pa.free(pages[:1])
    pa.free(pages[2:])
    pa.check_no_leak()


@pytest.mark.parametrize("page_size", [1, 4])
def test_full_allocator_pages_are_per_request_and_contiguous(page_size):
    r2t = ReqToTokenPool(4, 64, "cpu")
    alloc = KVAllocator(r2t, 32, page_size)
    a, b = r2t.alloc(), r2t.alloc()
    locs_a = torch.cat([alloc.extend(a, 3), alloc.extend(a, 6)])
    locs_b = alloc.extend(b, 5)
    assert torch.equal(r2t.table[a, :9].long(), locs_a) and torch.equal(r2t.table[b, :5].long(), locs_b)
    assert len(set(locs_a.tolist()) | set(locs_b.tolist())) == 14
    for locs in (locs_a, locs_b):  # position p sits at offset p % page_size of its page
        assert torch.equal(locs % page_size, torch.arange(len(locs)) % page_size)
        assert (locs >= page_size).all()  # page 0 is padding
    pages_a = (locs_a // page_size).unique()
    assert len(pages_a) == -(-9 // page_size)
    alloc.truncate(a, 4)
    assert alloc.stats()["full_free"] == (32 - (-(-4 // page_size)) - (-(-5 // page_size))) * page_size
    alloc.free(a)
    alloc.free(b)
    alloc.check_no_leak()


def test_hybrid_allocator_maps_pages_and_evicts_outside_window():
    page, window = 4, 6
    r2t = ReqToTokenPool(2, 64, "cpu")
    alloc = HybridSWAAllocator(r2t, 16, 6, page, window)
    row = r2t.alloc()
    locs = alloc.extend(row, 13)  # positions 0..12 -> 4 pages
    swa = alloc.full_to_swa[locs]
    assert torch.equal(swa % page, locs % page)  # page-aligned
    assert (swa >= page).all() and len((swa // page).unique()) == 4
    # The window of a query at the last page boundary (12) is positions 7..12: page 0 can go,
    # page 1 stays (the prefix cache may keep the window before a page boundary whole).
    alloc.release_window(row, 13)
    assert alloc.stats()["swa_free"] == (6 - 3) * page
    assert (alloc.full_to_swa[locs[:4]] // page == 0).all()  # evicted -> padding page
    assert torch.equal(alloc.full_to_swa[locs[4:]], swa[4:])
    with pytest.raises(OutOfKVError):
        alloc.extend(row, 20)  # needs 5 more SWA pages, only 3 free
    assert alloc.allocated_len(row) == 13 and alloc.stats()["full_free"] == (16 - 4) * page
    with pytest.raises(AssertionError, match="still hold"):
        alloc.check_no_leak()
    alloc.free(row)
    r2t.free(row)
    alloc.check_no_leak()
    r2t.check_no_leak()


def test_a_batchs_window_release_frees_what_each_requests_own_would():
    """`release_windows` over a batch (rows at lengths on and off page boundaries, some released
    before, some short of any release) leaves the allocator as `release_window` row by row does:
    the same SWA pages free, the same full->SWA map, the same evicted pages a row."""
    page, window = 4, 6
    states = []
    for batched in (False, True):
        r2t = ReqToTokenPool(6, 64, "cpu")
        alloc = HybridSWAAllocator(r2t, 64, 64, page, window)
        rows = [r2t.alloc() for _ in range(6)]
        for row, n in zip(rows, (3, 12, 13, 20, 29, 40)):
            alloc.extend(row, n)
        alloc.release_window(rows[3], 16)  # released up to an earlier length already
        lens = [3, 12, 13, 21, 29, 40]
        if batched:
            alloc.release_windows(rows, lens)
        else:
            for row, n in zip(rows, lens):
                alloc.release_window(row, n)
        states.append((alloc.stats(), alloc.full_to_swa.clone(), dict(alloc._evicted)))
    assert states[0][0] == states[1][0] and torch.equal(states[0][1], states[1][1])
    assert states[0][2] == states[1][2] and len(states[0][2]) == 5  # all but the 3-token row let pages go


def test_truncate_returns_swa_pages_of_rejected_tokens():
    page = 2
    r2t = ReqToTokenPool(2, 64, "cpu")
    alloc = HybridSWAAllocator(r2t, 32, 32, page, 4)
    row = r2t.alloc()
    alloc.extend(row, 10)
    alloc.release_window(row, 10)
    before = alloc.stats()
    alloc.extend(row, 5)
    alloc.truncate(row, 11)
    after = alloc.stats()
    assert after["full_free"] == before["full_free"] - page and after["swa_free"] == before["swa_free"] - page
    alloc.free(row)
    alloc.check_no_leak()


def test_pool_kind_comes_from_the_models_layers_not_the_allocator():
    r2t = ReqToTokenPool(2, 32, "cpu")
    hybrid = HybridSWAAllocator(r2t, 8, 4, 4, 8)
    layouts = {i: KVLayout(w, 2, 16) for i, w in {0: 8, 1: None, 2: 8}.items()}
    pool = build_pool(layouts, hybrid, torch.float32, "cpu")
    assert isinstance(pool, HybridSWAPool)
    assert [pool.is_swa_layer(i) for i in range(3)] == [True, False, True]
    assert pool.swa.kv_buffers[0].shape == (5, 2, 2, 4, 16) and pool.full.kv_buffers[0].shape == (9, 2, 2, 4, 16)
    full_only = build_pool(layouts, hybrid, torch.float32, "cpu", use_swa_pool=False)
    assert isinstance(full_only, MHAPool) and not full_only.has_swa
    assert not any(full_only.is_swa_layer(i) for i in range(3))
    plain = build_pool(layouts, KVAllocator(r2t, 8, 4), torch.float32, "cpu")
    assert isinstance(plain, MHAPool)
    with pytest.raises(KeyError, match="not layer 7"):
        pool.kv_cache(7)
    with pytest.raises(ValueError, match="sliding_window"):
        build_pool({0: KVLayout(16, 2, 16)}, hybrid, torch.float32, "cpu")


def test_each_kv_layer_keeps_its_own_geometry_and_layers_reading_it_add_nothing():
    """Gemma 4's shape: sliding layers of 2 KV heads x 16, full layers of 1 x 32, and two layers
    reading layers 0 and 1's KV (KV sharing)."""
    r2t = ReqToTokenPool(2, 32, "cpu")
    hybrid = HybridSWAAllocator(r2t, 8, 4, 4, 8)
    sliding, full = dict(num_kv_heads=2, head_dim=16, sliding_window=8), dict(num_kv_heads=1, head_dim=32)
    layers = [AttentionLayer(i, 4, scaling=1.0, **geometry) for i, geometry in [(0, sliding), (1, full)] * 2]
    layouts = kv_layouts(layers)
    assert layouts == {0: KVLayout(8, 2, 16), 1: KVLayout(None, 1, 32)}
    pool = build_pool(layouts, hybrid, torch.float32, "cpu")
    assert len(pool.swa.kv_buffers) == len(pool.full.kv_buffers) == 1
    assert pool.swa.kv_cache(0).shape == (5, 2, 2, 4, 16) and pool.full.kv_cache(1).shape == (9, 2, 1, 4, 32)
    assert pool.kv_bytes == {"full": 2 * 1 * 32 * 4, "swa": 2 * 2 * 16 * 4}  # float32, K and V
    with pytest.raises(ValueError, match="KV layer 1: read as"):
        kv_layouts([*layers, AttentionLayer(1, 4, num_kv_heads=2, head_dim=16, scaling=1.0)])


def test_set_kv_writes_hnd_layout():
    pool = MHAPool({0: (2, 3)}, 4, 4, torch.float32, "cpu")
    locs = torch.tensor([5, 6, 13])
    k = torch.arange(18, dtype=torch.float32).view(3, 2, 3)
    pool.set_kv(0, locs, k, -k)
    buf = pool.kv_cache(0)
    assert buf.shape == (5, 2, 2, 4, 3)
    for i, loc in enumerate(locs.tolist()):
        assert torch.equal(buf[loc // 4, 0, :, loc % 4, :], k[i])
        assert torch.equal(buf[loc // 4, 1, :, loc % 4, :], -k[i])
