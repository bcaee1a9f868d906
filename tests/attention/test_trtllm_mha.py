"""The trtllm_mha backend on CPU: routing, kernel contracts, reference kernels, and greedy
generation identical to torch_native for every model on a busy hybrid SWA pool."""

import dataclasses

import pytest
import torch
import torch.nn.functional as F

from attention import AttentionLayer, ForwardMode
from attention.kernels import KERNEL_SETS, ContextCall, DecodeCall, KernelContractError, chain_mask
from attention.kernels.calls import unpack_mask
from attention.kernels.reference import context as reference_context
from attention.kernels.reference import decode as reference_decode
from attention.trtllm_mha import ROUTING, TRTLLMMHABackend
from tests.attention.paged import random_paged_kv
from tests.attention.scenario import Scenario
from tests.hf_models import TINY_MODELS, WINDOW, make_tiny_model
from workers.engine import Engine, SamplingParams

CPU = torch.device("cpu")


def test_routing_table():
    table = {mode.name: ROUTING[mode] for mode in ForwardMode}
    print("\nforward mode -> kernel:")
    for mode, kernel in table.items():
        names = {ks: (getattr(KERNEL_SETS[ks], f"{kernel}_name") if kernel else "-") for ks in KERNEL_SETS}
        print(f"  {mode:16s} {str(kernel):8s} {names}")
    assert table == {
        "EXTEND": "context",
        "DECODE": "decode",
        "IDLE": None,
        "TARGET_VERIFY": "decode",
        "DRAFT_EXTEND_V2": "decode",
    }
    assert (KERNEL_SETS["sm90"].decode_name, KERNEL_SETS["sm90"].context_name) == ("xqa", "fmha_v2")
    # Hopper: one query a row runs the split-KV kernel up to its row bound, verify runs XQA
    sm90 = KERNEL_SETS["sm90"]
    assert sm90.decode_kernel(1, 1)[0] == sm90.decode_kernel(sm90.split_decode_rows, 1)[0] == "split_kv"
    assert sm90.decode_kernel(sm90.split_decode_rows + 1, 1)[0] == sm90.decode_kernel(1, 5)[0] == "xqa"
    fp8_rows = sm90.fp8_split_decode_rows
    assert 0 < fp8_rows < sm90.split_decode_rows
    assert sm90.decode_kernel(fp8_rows, 1, fp8=True)[0] == "split_kv"
    assert sm90.decode_kernel(fp8_rows + 1, 1, fp8=True)[0] == "xqa"
    assert sm90.decode_kernel(fp8_rows + 1, 1)[0] == "split_kv"
    assert KERNEL_SETS["cpu"].decode_kernel(1, 1)[0] == "reference_decode"
    backend = TRTLLMMHABackend(CPU)
    assert backend.kernel_name(ForwardMode.TARGET_VERIFY) == "reference_decode"
    assert backend.kernel_name(ForwardMode.DRAFT_EXTEND_V2) == "reference_decode"
    assert backend.kernel_name(ForwardMode.EXTEND) == "reference_context"


# -- generation on a busy pool ------------------------------------------------------------------
# (page size, chunk, long request, others): the long request holds the low full pages so the
# others' full slot ids exceed the SWA pool; the others' lengths cross page boundaries in step,
# filling the SWA pool beyond 85%. Every sequence is at least 4x the window.
BUSY = {
    16: dict(chunk=8, long=20 * 16 + 1, others=[33, 49, 65, 81] * 2, new=4 * WINDOW, swa_pages=18, full_pages=200),
    64: dict(chunk=57, long=12 * 64 + 1, others=[33] * 8, new=4 * WINDOW - 1, swa_pages=10, full_pages=40),
}


@pytest.fixture(scope="module", params=sorted(TINY_MODELS))
def model_dir(request, tmp_path_factory):
    path = str(tmp_path_factory.mktemp(request.param))
    make_tiny_model(request.param, path)
    return path


def _busy_run(model_dir: str, backend: str, page_size: int):
    b = BUSY[page_size]
    eng = Engine(
        model=model_dir,
        page_size=page_size,
        attention_backend=backend,
        chunked_prefill_size=b["chunk"],
        max_total_tokens=b["full_pages"] * page_size,
        swa_full_tokens_ratio=b["swa_pages"] / b["full_pages"],
        max_running_requests=16,
    )
    g = torch.Generator().manual_seed(11)
    sp = SamplingParams(max_new_tokens=b["new"], temperature=0.0, ignore_eos=True)
    rids = [eng.add_request(torch.randint(0, 256, (n,), generator=g).tolist(), sp) for n in [b["long"]] + b["others"]]
    peak, high_ids = 0.0, False
    while eng.has_unfinished():
        eng.step()
        s = eng.kv_stats()
        if s["swa_total"]:
            peak = max(peak, 1 - s["swa_free"] / s["swa_total"])
            rows = [r.row for r in eng.scheduler.running if r.rid != rids[0] and r.kv_len]
            first_pages = eng.req_to_token.table[rows, 0].long() // page_size
            high_ids |= bool(rows) and bool((first_pages > eng.allocator.swa.num_pages).all())
    tokens = [eng.output(r).token_ids for r in rids]
    eng.check_no_leak()
    return tokens, peak, high_ids, eng.allocator.is_hybrid


@pytest.mark.parametrize("page_size", [16, 64])
def test_generation_matches_torch_native_on_busy_swa_pool(model_dir, page_size):
    ref, *_ = _busy_run(model_dir, "torch_native", page_size)
    tokens, peak, high_ids, hybrid = _busy_run(model_dir, "trtllm_mha", page_size)
    assert tokens == ref
    if hybrid:
        assert peak > 0.85, f"SWA pool peaked at {peak:.0%}"
        assert high_ids, "full slot ids never exceeded the SWA pool size"


# -- reference kernels against an independent dense computation ------------------------------
def _dense(q, k, v, q_pos, scale, window_left, softcap=None, sinks=None):
    kv_pos = torch.arange(k.shape[0])
    mask = kv_pos[None] <= q_pos[:, None]
    if window_left >= 0:
        mask &= kv_pos[None] >= q_pos[:, None] - window_left
    qh, kh, vh = q.transpose(0, 1), k.transpose(0, 1), v.transpose(0, 1)
    kh = kh.repeat_interleave(qh.shape[0] // kh.shape[0], 0)
    vh = vh.repeat_interleave(qh.shape[0] // vh.shape[0], 0)
    if softcap is None and sinks is None:
        return F.scaled_dot_product_attention(qh, kh, vh, attn_mask=mask, scale=scale).transpose(0, 1)
    s = qh @ kh.transpose(1, 2) * scale
    if softcap is not None:
        s = softcap * torch.tanh(s / softcap)
    s = s.masked_fill(~mask, float("-inf"))
    out = torch.softmax(s, -1) @ vh
    if sinks is not None:
        out = out * torch.sigmoid(torch.logsumexp(s, -1, keepdim=True) - sinks.view(-1, 1, 1))
    return out.transpose(0, 1)


def _paged(kv_lens, page=4, hkv=2, d=8, seed=0):
    return random_paged_kv(kv_lens, page, hkv, d, seed=seed)


@pytest.mark.parametrize(
    "q_len, window_left, sinks", [(1, -1, False), (1, 5, True), (4, -1, False), (5, 6, False), (3, 2, True)]
)
def test_reference_decode_kernel(q_len, window_left, sinks):
    kv_lens = [9, 17, 6]
    cache, tables, dense = _paged(kv_lens)
    h = 4
    g = torch.Generator().manual_seed(1)
    query = torch.randn(len(kv_lens) * q_len, h, 8, generator=g)
    sink = torch.randn(h, generator=g) if sinks else None
    call = DecodeCall(
        query=query,
        kv_cache=cache,
        block_tables=tables,
        seq_lens=torch.tensor(kv_lens, dtype=torch.int32),
        bmm1_scale=0.3,
        window_left=window_left,
        sinks=sink,
        where="TEST",
        max_seq_len=max(kv_lens),
        q_len_per_req=q_len,
        mask=chain_mask(len(kv_lens), q_len, CPU) if q_len > 1 else None,
    )
    out = reference_decode(call)
    for b, (n, (k, v)) in enumerate(zip(kv_lens, dense)):
        ref = _dense(query[b * q_len : (b + 1) * q_len], k, v, torch.arange(n - q_len, n), 0.3, window_left, sinks=sink)
        torch.testing.assert_close(out[b * q_len : (b + 1) * q_len], ref, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize(
    "window_left, softcap, sinks", [(-1, None, False), (4, None, False), (-1, 10.0, False), (3, None, True)]
)
def test_reference_context_kernel_with_cached_prefix(window_left, softcap, sinks):
    kv_lens, q_lens = [9, 17, 6, 5], [3, 17, 1, 0]
    cache, tables, dense = _paged(kv_lens)
    h = 4
    g = torch.Generator().manual_seed(2)
    query = torch.randn(sum(q_lens), h, 8, generator=g)
    sink = torch.randn(h, generator=g) if sinks else None
    cu = lambda xs: torch.tensor([0] + torch.tensor(xs).cumsum(0).tolist(), dtype=torch.int32)  # noqa: E731
    call = ContextCall(
        query=query,
        kv_cache=cache,
        block_tables=tables,
        seq_lens=torch.tensor(kv_lens, dtype=torch.int32),
        bmm1_scale=0.4,
        window_left=window_left,
        sinks=sink,
        where="TEST",
        cum_seq_lens_q=cu(q_lens),
        cum_seq_lens_kv=cu(kv_lens),
        max_q_len=max(q_lens),
        max_kv_len=max(kv_lens),
        logits_soft_cap=softcap,
    )
    out = reference_context(call)
    start = 0
    for n, m, (k, v) in zip(kv_lens, q_lens, dense):
        if m:
            ref = _dense(query[start : start + m], k, v, torch.arange(n - m, n), 0.4, window_left, softcap, sink)
            torch.testing.assert_close(out[start : start + m], ref, atol=1e-5, rtol=1e-5)
        start += m


def test_chain_mask_packing():
    m = chain_mask(2, 5, CPU)
    assert m.dtype == torch.uint16 and m.shape == (2, 5, 2)
    assert [int(x) for x in m[0, :, 0]] == [0b1, 0b11, 0b111, 0b1111, 0b11111] and not m[..., 1].any()
    big = chain_mask(1, 40, CPU)
    assert big.shape == (1, 40, 4)
    row = big[0, 39].to(torch.int64).tolist()  # bits 0..39: word0 all ones, word1 low 8 bits
    assert row == [0xFFFF, 0xFFFF, 0xFF, 0]
    assert torch.equal(unpack_mask(big, 40)[0], torch.ones(40, 40).tril().bool())


def _valid_decode():
    cache, tables, _ = _paged([9, 6])
    return DecodeCall(
        query=torch.randn(4, 4, 8),
        kv_cache=cache,
        block_tables=tables,
        seq_lens=torch.tensor([9, 6], dtype=torch.int32),
        bmm1_scale=1.0,
        window_left=-1,
        sinks=None,
        where="TARGET_VERIFY layer 3 (swa pool, decode kernel)",
        max_seq_len=9,
        q_len_per_req=2,
        mask=chain_mask(2, 2, CPU),
    )


@pytest.mark.parametrize(
    "change, tensor",
    [
        (dict(query=torch.randn(5, 4, 8)), "query"),
        (dict(seq_lens=torch.tensor([9, 1], dtype=torch.int32)), "seq_lens"),
        (dict(block_tables=torch.tensor([[1, 2, 3], [99, 4, 0]], dtype=torch.int32)), "block_tables"),
        (dict(block_tables=torch.tensor([[1, 2, 3], [4, 5, 0]], dtype=torch.int64)), "block_tables"),
        (dict(mask=None), "mask"),
        (dict(max_seq_len=6), "max_seq_len"),
    ],
)
def test_decode_contract_violations_name_mode_layer_and_tensor(change, tensor):
    _valid_decode().check()
    call = dataclasses.replace(_valid_decode(), **change)
    with pytest.raises(KernelContractError, match=rf"TARGET_VERIFY layer 3 .*{tensor}"):
        call.check()


def test_reading_padding_page_inside_window_is_a_contract_violation():
    call = _valid_decode()
    call.block_tables[1, 1] = 0  # request 1's last page evicted while still inside its window
    with pytest.raises(KernelContractError, match="padding page"):
        call.check()
    call.window_left = 0  # queries at 4, 5 that see only themselves read only page index 1
    call.block_tables[1, 0], call.block_tables[1, 1] = 0, 5
    call.check()


def test_kv_destination_names_the_pools_write_slots_and_checks_them():
    """The slots a caller writing K and V itself gets are the ones `forward` writes (SWA layers:
    translated into the SWA pool), in the layer's own buffer; a slot in padding page 0 is refused
    before anything is written."""
    sc = Scenario()
    rows = [sc.add_request(n) for n in (13, 9, 21)]
    batch = sc.batch(ForwardMode.DECODE, rows, [1, 1, 1])
    pool, backend = sc.hybrid_pool, TRTLLMMHABackend(CPU)
    backend.init_forward_metadata(batch, pool)
    for layer in sc.layers:
        cache, slots, scales = backend.kv_destination(layer)
        swa = pool.is_swa_layer(layer.layer_id)
        expected = pool.translate_full_to_swa(batch.out_cache_loc) if swa else batch.out_cache_loc
        assert cache is pool.kv_cache(layer.layer_id) and torch.equal(slots, expected) and scales == (1.0, 1.0)
    batch.out_cache_loc[0] = 1  # inside padding page 0 of the full pool
    before = pool.kv_cache(1).clone()
    with pytest.raises(KernelContractError, match="DECODE layer 1 .*write slots"):
        backend.kv_destination(sc.layers[1])
    assert torch.equal(pool.kv_cache(1), before)


def test_start_up_rejects_unsupported_combinations():
    layer = AttentionLayer(0, 4, 2, 8, 1.0, sliding_window=None, logit_softcap=30.0)
    with pytest.raises(ValueError, match="page_size"):
        TRTLLMMHABackend(CPU, kernels=KERNEL_SETS["sm90"]).prepare([], page_size=1)
    with pytest.raises(ValueError, match="soft-capping"):
        TRTLLMMHABackend(CPU, kernels=KERNEL_SETS["sm100"]).prepare([layer], page_size=16)
    TRTLLMMHABackend(CPU, kernels=KERNEL_SETS["sm90"]).prepare([layer], page_size=16)


def test_soft_capped_layers_take_the_context_kernel_for_decode():
    sc = Scenario()
    rows = [sc.add_request(n) for n in (9, 14)]
    layers = [dataclasses.replace(layer, logit_softcap=20.0) for layer in sc.layers]
    backend = TRTLLMMHABackend(CPU)
    used = []
    ks = backend.kernels
    backend.kernels = dataclasses.replace(
        ks,
        decode=lambda c, w: used.append("decode") or ks.decode(c, w),
        context=lambda c, w: used.append("context") or ks.context(c, w),
    )
    batch = sc.batch(ForwardMode.DECODE, rows, [1, 1])
    q, k, v = sc.qkv(2)
    outs = sc.run(backend, sc.hybrid_pool, batch, (q, k, v), layers)
    from attention import create_backend

    refs = sc.run(create_backend("torch_native", CPU), sc.hybrid_pool, batch, (q, k, v), layers)
    assert used == ["context"] * 3
    for out, ref in zip(outs, refs):
        torch.testing.assert_close(out, ref, atol=1e-5, rtol=1e-5)


def test_the_rotating_head_dims_override_reads_head_dims_or_none():
    from attention.kernels import ROTATING_HEAD_DIMS, rotating_head_dims

    assert rotating_head_dims("") == ROTATING_HEAD_DIMS
    assert rotating_head_dims("128,256") == (128, 256)
    assert rotating_head_dims("none") == ()
    for bad in ("128;256", "x", "0"):
        with pytest.raises(ValueError, match="SLIDESPEC_ROTATING_HEAD_DIMS"):
            rotating_head_dims(bad)
