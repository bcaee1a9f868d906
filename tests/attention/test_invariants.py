"""One regression test per invariant of docs/design.md §4, each run twice: as built ("fixed") and
with the upstream mistake put back ("upstream_mistake"), which must make the test's check
fail. The mistakes are re-created here, in the tests, as the bug reports describe them. Each
runs over a float32 and an FP8 KV cache; the FP8 write of §4.7 has its own upstream mistake."""

import numpy as np
import pytest
import torch

from attention import ForwardMode, create_backend, trtllm_mha
from attention.kernels import KernelContractError
from attention.kernels.calls import check_write
from attention.kv_pool import FP8_E4M3
from attention.trtllm_mha import TRTLLMMHABackend
from tests.attention.scenario import HKV, KV_DTYPES, D, H, Scenario
from workers.memory import HybridSWAPool
from workers.memory.kv_write import write_kv_torch
from workers.models.ops import TORCH_OPS

VARIANTS = ["fixed", "upstream_mistake"]
CPU = torch.device("cpu")
kv_cache_dtypes = pytest.mark.parametrize("kv_cache_dtype", sorted(KV_DTYPES))


def _busy_scenario(headroom: int = 2, kv_cache_dtype: str = "auto") -> tuple[Scenario, list[int]]:
    """SWA pool > 85% occupied, every running request's full slot ids above the SWA pool size.

    With page 4 and window 6, a request of length 4k+1 >= 9 holds 3 SWA pages (the window of a
    query at its last page boundary), the one of length 5 holds 2, and the long request that holds
    the low full pages 2: 25 SWA pages.
    """
    sc = Scenario(page_size=4, window=6, full_pages=160, swa_pages=25 + headroom, kv_cache_dtype=kv_cache_dtype)
    sc.push_full_ids_up(60)
    rows = [sc.add_request(n) for n in (13, 21, 29, 9, 17, 25, 33, 5)]
    full_pages = sc.r2t.table[rows, 0].long() // 4
    assert (full_pages > sc.alloc.swa.num_pages).all()
    if headroom <= 2:
        assert sc.swa_occupancy() > 0.85
    return sc, rows


def _expect(variant: str, check) -> None:
    if variant == "fixed":
        check()
    else:
        with pytest.raises((AssertionError, KernelContractError)):
            check()


def _close(outs, refs) -> None:
    for out, ref in zip(outs, refs):
        torch.testing.assert_close(out, ref, atol=1e-5, rtol=1e-5)


class _AllocatorDecides:
    """Upstream bug 1: the backend asked the *allocator* whether layers are SWA-translated."""

    def __init__(self, pool, allocator, windows):
        self._pool, self._alloc, self._windows = pool, allocator, windows
        self.page_size = pool.page_size

    has_swa = True
    swa_window = property(lambda self: self._alloc.sliding_window)

    def is_swa_layer(self, layer_id):
        return self._windows[layer_id] is not None  # "the allocator is a SWA allocator"

    def translate_full_to_swa(self, locs):
        return self._alloc.full_to_swa[locs.long()]

    def translate_full_to_swa_host(self, locs):
        return self._alloc.full_to_swa_host[locs]

    def kv_cache(self, layer_id):
        return self._pool.kv_cache(layer_id)

    def kv_scales(self, layer_id):
        return self._pool.kv_scales(layer_id)

    def set_kv(self, layer_id, locs, k, v):
        self._pool.set_kv(layer_id, locs, k, v)

    def write_slots(self, layer_id, locs):
        return self._pool.write_slots(layer_id, locs)


@kv_cache_dtypes
@pytest.mark.parametrize("variant", VARIANTS)
def test_pool_decides_not_allocator(variant, kv_cache_dtype, monkeypatch):
    """A draft with a full-only pool on the target's SWA allocator is never translated."""
    sc, rows = _busy_scenario(kv_cache_dtype=kv_cache_dtype)
    batch = sc.batch(ForwardMode.DECODE, rows, [1] * len(rows))
    qkv = sc.qkv(len(rows))
    refs = sc.reference(sc.full_pool, batch, qkv)
    backend = TRTLLMMHABackend(CPU)
    if variant == "upstream_mistake":
        windows = {layer.layer_id: layer.sliding_window for layer in sc.layers}
        original = TRTLLMMHABackend.init_forward_metadata
        monkeypatch.setattr(
            TRTLLMMHABackend,
            "init_forward_metadata",
            lambda self, b, pool: original(self, b, _AllocatorDecides(pool, sc.alloc, windows)),
        )
    _expect(variant, lambda: _close(sc.run(backend, sc.full_pool, batch, qkv), refs))


@kv_cache_dtypes
@pytest.mark.parametrize("variant", VARIANTS)
def test_resolve_at_use_after_pool_swap(variant, kv_cache_dtype, monkeypatch):
    """Frozen-KV drafts get the target's pool swapped in per forward; the backend must follow."""
    sc, rows = _busy_scenario(kv_cache_dtype=kv_cache_dtype)
    assert sc.swa_occupancy() > 0.85
    backend = TRTLLMMHABackend(CPU)
    if variant == "upstream_mistake":  # upstream bug 2: SWA state resolved once, at construction
        original = TRTLLMMHABackend.init_forward_metadata

        class _ResolvedOnce:
            def __init__(self, first, current):
                self._first, self._current = first, current
                self.page_size = current.page_size

            has_swa = property(lambda self: self._first.has_swa)
            swa_window = property(lambda self: self._first.swa_window)
            is_swa_layer = lambda self, i: self._first.is_swa_layer(i)  # noqa: E731
            translate_full_to_swa = lambda self, locs: self._first.translate_full_to_swa(locs)  # noqa: E731
            translate_full_to_swa_host = lambda self, locs: self._first.translate_full_to_swa_host(locs)  # noqa: E731
            kv_cache = lambda self, i: self._current.kv_cache(i)  # noqa: E731
            kv_scales = lambda self, i: self._current.kv_scales(i)  # noqa: E731
            set_kv = lambda self, i, locs, k, v: self._current.set_kv(i, locs, k, v)  # noqa: E731

        def resolved_once(self, b, pool):
            first = self.__dict__.setdefault("_pool_at_construction", pool)
            original(self, b, _ResolvedOnce(first, pool))

        monkeypatch.setattr(TRTLLMMHABackend, "init_forward_metadata", resolved_once)

    def check():
        # First forward on the draft's own (full-only) pool, then the target's pool swapped in.
        for pool in (sc.full_pool, sc.hybrid_pool):
            batch = sc.batch(ForwardMode.DECODE, rows, [1] * len(rows))
            qkv = sc.qkv(len(rows))
            refs = sc.reference(pool, batch, qkv)
            _close(sc.run(backend, pool, batch, qkv), refs)

    _expect(variant, check)


@kv_cache_dtypes
@pytest.mark.parametrize("flat", [False, True])
@pytest.mark.parametrize("variant", VARIANTS)
def test_decode_kernel_only_for_uniform_verify(variant, flat, kv_cache_dtype, monkeypatch):
    """TARGET_VERIFY and DRAFT_EXTEND_V2 with one query length per request (the drafter pads its
    catch-up to the verified window) run the decode kernel and match the reference, with the
    chain mask or flat (a decode row a query); a ragged batch in a decode-routed mode is refused
    before any kernel runs. Upstream routed a ragged draft extend (accepted lengths) to the
    decode kernel: an illegal memory access on the GPU. The mistake put back: the refusal gone,
    the ragged batch reaches the decode kernel."""
    sc, rows = _busy_scenario(headroom=24, kv_cache_dtype=kv_cache_dtype)  # verify and draft extend grow each by 8
    if variant == "upstream_mistake":
        monkeypatch.setattr(trtllm_mha, "uniform_query_len", lambda mode, kernel, q_lens: max(q_lens))
    backend = TRTLLMMHABackend(CPU)
    used = []
    for kind in ("decode", "context"):
        fn = getattr(backend.kernels, kind)
        monkeypatch.setattr(
            backend,
            "kernels",
            backend.kernels.__class__(
                **{
                    **backend.kernels.__dict__,
                    kind: (lambda f, k: lambda call, ws: used.append(k) or f(call, ws))(fn, kind),
                    "flat_verify_batch": 8 if flat else 0,
                    "flat_verify_kv": 1 << 20,
                }
            ),
        )

    def run(mode, q_lens):
        used.clear()
        batch = sc.batch(mode, rows, q_lens)
        qkv = sc.qkv(sum(q_lens))
        try:
            return batch, qkv, sc.run(backend, sc.hybrid_pool, batch, qkv)
        finally:
            for r in rows:  # accepted tokens stay; nothing else to roll back here
                sc.alloc.release_window(r, sc.alloc.allocated_len(r))

    def check():
        for mode in (ForwardMode.TARGET_VERIFY, ForwardMode.DRAFT_EXTEND_V2):
            batch, qkv, outs = run(mode, [4] * 8)
            _close(outs, sc.reference(sc.hybrid_pool, batch, qkv))
            assert set(used) == {"decode"}, f"{mode.name} ran {used}"
            assert backend._md.seq_lens.numel() == 8 * (4 if flat else 1)
        with pytest.raises(KernelContractError, match="DRAFT_EXTEND_V2: the decode kernel needs one query length"):
            run(ForwardMode.DRAFT_EXTEND_V2, [1, 3, 2, 4, 1, 1, 2, 3])
        assert not used, f"a ragged batch reached {used}"

    _expect(variant, check)


def _spy_writes(monkeypatch, pool_cls):
    writes = []
    original = pool_cls.set_kv

    def spy(self, layer_id, locs, k, v):
        writes.append((layer_id, locs))
        original(self, layer_id, locs, k, v)

    monkeypatch.setattr(pool_cls, "set_kv", spy)
    return writes


@kv_cache_dtypes
@pytest.mark.parametrize("path", ["eager", "graph"])
@pytest.mark.parametrize("variant", VARIANTS)
def test_one_swa_write_location_per_forward(variant, path, kv_cache_dtype, monkeypatch):
    """All SWA-layer writes of a forward use one write index, translated from this batch."""
    sc, rows = _busy_scenario(kv_cache_dtype=kv_cache_dtype)
    backend = TRTLLMMHABackend(CPU)
    backend.init_graph_buffers(max_batch_size=16, max_tokens=64, max_pages_per_req=32)
    init = backend.init_forward_metadata if path == "eager" else backend.init_forward_metadata_replay
    if variant == "upstream_mistake":  # upstream bug 4: a per-batch write index left on the pool
        left_on_pool = {}

        def stale_init(b, pool):
            init(b, pool)
            backend._md.swa_out_loc = left_on_pool.setdefault("swa_loc", backend._md.swa_out_loc.clone())

        monkeypatch.setattr(backend, "init_forward_metadata", stale_init)
    else:
        monkeypatch.setattr(backend, "init_forward_metadata", init)
    writes = _spy_writes(monkeypatch, HybridSWAPool)

    def check():
        for q_lens in ([1] * 8, [1] * 8):
            writes.clear()
            batch = sc.batch(ForwardMode.EXTEND, rows, q_lens)
            expected = sc.alloc.full_to_swa[batch.out_cache_loc]  # fresh from the allocator's map
            sc.run(backend, sc.hybrid_pool, batch, sc.qkv(sum(q_lens)))
            swa_writes = [locs for layer_id, locs in writes if sc.hybrid_pool.is_swa_layer(layer_id)]
            assert len(swa_writes) == 2
            assert swa_writes[0] is swa_writes[1], "SWA layers of one forward wrote through different indices"
            assert torch.equal(swa_writes[0], expected), "SWA write index is not this batch's translation"
            for r in rows:
                sc.alloc.release_window(r, sc.alloc.allocated_len(r))

    _expect(variant, check)


@kv_cache_dtypes
@pytest.mark.parametrize("variant", VARIANTS)
def test_graph_replay_sees_fresh_indices(variant, kv_cache_dtype, monkeypatch):
    """Replaying with the same input buffers (same address, new contents) gives fresh indices."""
    sc, rows = _busy_scenario(kv_cache_dtype=kv_cache_dtype)
    if variant == "upstream_mistake":  # upstream bug 5: translation memoised on (buffer address, size)
        memo = {}
        original = HybridSWAPool.translate_full_to_swa_host

        def memoised(self, locs):
            key = (locs.__array_interface__["data"][0], locs.size)
            if key not in memo:
                memo[key] = original(self, locs)
            return memo[key]

        monkeypatch.setattr(HybridSWAPool, "translate_full_to_swa_host", memoised)
    backend = TRTLLMMHABackend(CPU)
    backend.init_graph_buffers(max_batch_size=16, max_tokens=64, max_pages_per_req=32)
    static_out_cache_loc = torch.zeros(len(rows), dtype=torch.int64)  # a captured graph's input buffer
    static_host_loc = np.zeros(len(rows), dtype=np.int64)  # and the host array a replay fills it from
    addresses = set()

    def check():
        for _ in range(3):
            batch = sc.batch(ForwardMode.DECODE, rows, [1] * len(rows))
            static_out_cache_loc.copy_(batch.out_cache_loc)
            batch.out_cache_loc = static_out_cache_loc
            static_host_loc[:] = batch.host.out_cache_loc
            batch.host.out_cache_loc = static_host_loc
            qkv = sc.qkv(len(rows))
            backend.init_forward_metadata_replay(batch, sc.hybrid_pool)
            md = backend._md
            addresses.add((md.swa_out_loc.data_ptr(), md.swa_page_table.data_ptr(), md.seq_lens.data_ptr()))
            assert len(addresses) == 1, "graph metadata moved: a captured graph would read stale buffers"
            assert torch.equal(md.swa_out_loc, sc.alloc.full_to_swa[static_out_cache_loc]), "stale SWA write slots"
            outs = [backend.forward(layer, *qkv) for layer in sc.layers]
            refs = sc.reference(sc.hybrid_pool, batch, qkv)
            _close(outs, refs)
            for r in rows:
                sc.alloc.release_window(r, sc.alloc.allocated_len(r))

    _expect(variant, check)


def test_torch_native_backend_is_also_pool_driven():
    """The oracle itself must obey invariant 1, or it could not catch the mistake."""
    sc, rows = _busy_scenario()
    batch = sc.batch(ForwardMode.DECODE, rows, [1] * len(rows))
    q, k, v = sc.qkv(len(rows))
    native = create_backend("torch_native", CPU)
    native.init_forward_metadata(batch, sc.full_pool)
    out = native.forward(sc.layers[0], q, k, v)
    assert torch.isfinite(out).all()


def _write_slots_from_full_locs(translate: bool):
    """The upstream FP8 write's slots for an SWA layer in a prefill: resolved from the full-pool
    locations `out_cache_loc` (translated again, `_get_layer_cache_loc(layer, out_cache_loc)` in
    SGLang before PR #24138, or used as they are) instead of the forward's `swa_out_loc`."""
    original = TRTLLMMHABackend._write_slots

    def write_slots(self, md, layer, kv_cache, is_swa):
        if not (is_swa and md.mode is ForwardMode.EXTEND and kv_cache.dtype == FP8_E4M3):
            return original(self, md, layer, kv_cache, is_swa)
        locs = md.pool.translate_full_to_swa(md.out_cache_loc) if translate else md.out_cache_loc
        check_write(locs, kv_cache, self._where(md, layer, is_swa))  # the write's contract check stays
        return locs

    return write_slots


@pytest.mark.parametrize("path", ["eager", "graph"])
@pytest.mark.parametrize("variant", [*VARIANTS, "untranslated"])
def test_fp8_prefill_writes_swa_layers_at_the_forwards_swa_slots(variant, path, monkeypatch):
    """A prefill's quantising KV write (the fused path: `kv_destination`, then the torch RoPE op's
    write through `quantize`) puts every SWA layer's FP8 K and V at the forward's one
    `swa_out_loc` (§4.4, §4.7): those slots, and no other, hold this batch's quantised keys and
    values, and attention matches the reference. Upstream (SGLang PR #24138) the FP8 write
    recomputed SWA layers' slots from the full-pool locations. Put back under replay, where the
    device's copy of full_to_swa still lacks this batch's entries (a replay takes its tables from
    the host and leaves the device's pending, workers/memory/host_mirror.py), it writes
    elsewhere; in eager mode its slots are not the forward's. Written untranslated, the full-pool
    slots leave the SWA pool."""
    sc, rows = _busy_scenario(headroom=24, kv_cache_dtype="fp8_e4m3")
    backend = TRTLLMMHABackend(CPU)
    backend.init_graph_buffers(max_batch_size=16, max_tokens=64, max_pages_per_req=32)
    if variant != "fixed":
        mistake = _write_slots_from_full_locs(translate=variant == "upstream_mistake")
        monkeypatch.setattr(TRTLLMMHABackend, "_write_slots", mistake)
    target = sc.hybrid_pool
    cos_sin = torch.cat([torch.ones(512, D // 2), torch.zeros(512, D // 2)], dim=-1)  # RoPE at angle 0: k as given

    def check():
        for q_lens in ([4, 1, 3, 2, 4, 1, 2, 3], [2, 3, 1, 4, 2, 2, 1, 1]):
            pool = target
            if path == "graph":  # the buffers, with the device's map as it was before this batch
                device_map = sc.alloc.full_to_swa.clone()
                pool = HybridSWAPool(target.full, target.swa, device_map, sc.alloc.full_to_swa_host, sc.window)
            batch = sc.batch(ForwardMode.EXTEND, rows, q_lens)
            swa_slots = sc.alloc.full_to_swa[batch.out_cache_loc]  # this batch's, from the allocator's map
            (backend.init_forward_metadata if path == "eager" else backend.init_forward_metadata_replay)(batch, pool)
            md, (q, k, v), n = backend._md, sc.qkv(sum(q_lens)), sum(q_lens)
            before = {layer.layer_id: target.kv_cache(layer.layer_id).clone() for layer in sc.layers}
            outs = []
            for layer in sc.layers:
                dest = backend.kv_destination(layer)
                kv = (dest.cache, dest.slots, v, dest.scales)
                TORCH_OPS.rope(batch.positions, q.view(n, H, D), k.view(n, HKV, D), cos_sin, None, kv)
                outs.append(backend.forward(layer, q, None, None))
                if target.is_swa_layer(layer.layer_id):
                    assert dest.slots is md.swa_out_loc, "an SWA layer's FP8 write took slots other than the forward's"
                    expected = before[layer.layer_id].clone()
                    write_kv_torch(expected, swa_slots, k.view(n, HKV, D), v.view(n, HKV, D), *dest.scales)
                    got = target.kv_cache(layer.layer_id)
                    assert torch.equal(got.view(torch.uint8), expected.view(torch.uint8)), "FP8 KV written elsewhere"
            _close(outs, sc.reference(target, batch, (q, k, v)))
            for r in rows:
                sc.alloc.release_window(r, sc.alloc.allocated_len(r))

    _expect(variant, check)
