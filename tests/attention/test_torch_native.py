"""The reference backend against PyTorch's scaled_dot_product_attention on dense tensors."""

import math

import pytest
import torch
import torch.nn.functional as F

from attention import AttentionLayer, ForwardMode, create_backend
from attention.dense import GROUP_PAIRS, padded_groups
from workers.forward_batch import ForwardBatch
from workers.memory import HybridSWAAllocator, KVLayout, ReqToTokenPool, build_pool

H, HKV, D, PAGE, WINDOW = 4, 2, 8, 4, 5


def _setup(prefix_lens, q_lens, seed=0):
    """A hybrid pool holding random KV for every request's prefix, and the batch of new tokens."""
    g = torch.Generator().manual_seed(seed)
    r2t = ReqToTokenPool(8, 64, "cpu")
    alloc = HybridSWAAllocator(r2t, 40, 24, PAGE, WINDOW)
    pool = build_pool({0: KVLayout(WINDOW, HKV, D), 1: KVLayout(None, HKV, D)}, alloc, torch.float32, "cpu")
    rows, dense_k, dense_v = [], [], []
    for prefix, q in zip(prefix_lens, q_lens):
        row = r2t.alloc()
        # interleave a throwaway request so slots are not simply 0..n
        junk = r2t.alloc()
        alloc.extend(junk, 3)
        locs = alloc.extend(row, prefix)
        k = torch.randn(prefix + q, HKV, D, generator=g)
        v = torch.randn(prefix + q, HKV, D, generator=g)
        pool.set_kv(1, locs, k[:prefix], v[:prefix])
        pool.set_kv(0, pool.translate_full_to_swa(locs), k[:prefix], v[:prefix])
        alloc.release_window(row, prefix)
        rows.append(row)
        dense_k.append(k)
        dense_v.append(v)
    locs = torch.cat([alloc.extend(r, q) for r, q in zip(rows, q_lens)])
    batch = ForwardBatch.build(ForwardMode.EXTEND, rows, prefix_lens, [[0] * q for q in q_lens], locs, r2t, [])
    return pool, batch, dense_k, dense_v, alloc


def _reference(q, k, v, prefix, layer):
    """Dense attention of one request's queries (positions prefix..) over keys 0..prefix+q-1."""
    m, n = q.shape[0], k.shape[0]
    qpos = torch.arange(prefix, prefix + m)[:, None]
    kpos = torch.arange(n)[None, :]
    mask = kpos <= qpos
    if layer.sliding_window:
        mask &= kpos > qpos - layer.sliding_window
    qh, kh, vh = q.transpose(0, 1), k.transpose(0, 1), v.transpose(0, 1)
    if layer.logit_softcap is None and layer.sinks is None:
        out = F.scaled_dot_product_attention(qh, kh, vh, attn_mask=mask, scale=layer.scaling, enable_gqa=True)
        return out.transpose(0, 1)
    kh = kh.repeat_interleave(H // HKV, 0)
    vh = vh.repeat_interleave(H // HKV, 0)
    s = qh @ kh.transpose(1, 2) * layer.scaling
    if layer.logit_softcap is not None:
        s = layer.logit_softcap * torch.tanh(s / layer.logit_softcap)
    s = s.masked_fill(~mask, -math.inf)
    out = torch.softmax(s, -1) @ vh
    if layer.sinks is not None:  # a sink adds exp(sink) to the softmax denominator only
        out = out * torch.sigmoid(torch.logsumexp(s, -1, keepdim=True) - layer.sinks.view(-1, 1, 1))
    return out.transpose(0, 1)


@pytest.mark.parametrize("swa_layer", [True, False])
@pytest.mark.parametrize("softcap, sinks", [(None, False), (20.0, False), (None, True)])
def test_matches_dense_reference(swa_layer, softcap, sinks):
    prefix_lens, q_lens = [7, 12, 0], [3, 1, 6]
    pool, batch, dense_k, dense_v, _ = _setup(prefix_lens, q_lens)
    layer = AttentionLayer(
        0 if swa_layer else 1,
        H,
        HKV,
        D,
        scaling=D**-0.5,
        sliding_window=WINDOW if swa_layer else None,
        logit_softcap=softcap,
        sinks=torch.randn(H) if sinks else None,
    )
    backend = create_backend("torch_native", torch.device("cpu"))
    backend.init_forward_metadata(batch, pool)
    g = torch.Generator().manual_seed(1)
    q = torch.randn(sum(q_lens), H * D, generator=g)
    new_k = torch.cat([k[p:] for k, p in zip(dense_k, prefix_lens)])
    new_v = torch.cat([v[p:] for v, p in zip(dense_v, prefix_lens)])
    out = backend.forward(layer, q, new_k.reshape(-1, HKV * D), new_v.reshape(-1, HKV * D)).view(-1, H, D)
    start = 0
    for prefix, n, k, v in zip(prefix_lens, q_lens, dense_k, dense_v):
        ref = _reference(q[start : start + n].view(n, H, D), k, v, prefix, layer)
        torch.testing.assert_close(out[start : start + n], ref, atol=1e-5, rtol=1e-5)
        start += n


def test_reading_an_evicted_slot_fails_loudly():
    pool, batch, *_, alloc = _setup([12], [1])
    alloc.release_window(batch.req_pool_indices[0].item(), 20)  # evict more than the window allows
    backend = create_backend("torch_native", torch.device("cpu"))
    backend.init_forward_metadata(batch, pool)
    layer = AttentionLayer(0, H, HKV, D, scaling=1.0, sliding_window=WINDOW)
    with pytest.raises(RuntimeError, match="evicted SWA slot"):
        backend.forward(layer, torch.randn(1, H * D), None, None)


def test_requests_are_grouped_in_order_within_the_padding_bound():
    """Requests without queries are left out; a long prefill starts a group of its own rather
    than padding the short requests around it to its size; every group's padded product fits."""
    q_lens = [1, 0, 1, 2048, 1, 1]
    kv_lens = [100, 50, 120, 2048, 90, 130]
    groups = padded_groups(q_lens, kv_lens)
    assert groups == [[0, 2], [3], [4, 5]]
    for group in groups:
        size = len(group) * max(q_lens[i] for i in group) * max(kv_lens[i] for i in group)
        assert size <= GROUP_PAIRS or len(group) == 1
    assert padded_groups([1] * 64, [300] * 64) == [list(range(64))]
