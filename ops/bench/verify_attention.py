"""Verify attention: XQA's multi-query mode (q_len queries a request, chain mask) against the
flat layout (one decode row a query, each row's KV ending at its query) on XQA and on the
split-KV kernel, per head shape, batch and KV length. What `attention/kernels`' `FLAT_VERIFY`
bounds were chosen from.

    python -m ops.bench.verify_attention [--out FILE]

Each figure is one call's device time from a CUDA graph of 32 back-to-back calls (KV hot in
L2, as for the short contexts where the choice matters); `rel_diff` compares the two outputs.
"""

from __future__ import annotations

import argparse
import itertools
import logging

import torch

from attention.kernels import DecodeCall, chain_mask, flashinfer_hopper, split_decode
from attention.trtllm_mha import WORKSPACE_BYTES
from ops.bench.record import add_record_args, record_run, write_out
from ops.bench.xqa_decode_bandwidth import graph_ms, paged_kv

logger = logging.getLogger(__name__)

HEADS = {"llama3-8b": (8, 128, 4), "gemma3": (1, 256, 4)}  # KV heads, head dim, queries per KV head
PAGE, Q_LEN, CALLS = 16, 5, 32


def layouts(
    batch: int, kv_len: int, kv_heads: int, head_dim: int, group: int, device: str = "cuda"
) -> tuple[DecodeCall, DecodeCall]:
    """The same verify as a multi-query call and as a flat one."""
    width = (1024 if kv_len <= 1024 else 4096) // PAGE
    cache, tables = paged_kv(batch, kv_len, kv_heads, head_dim, PAGE, width, device)
    common = dict(
        query=torch.randn(batch * Q_LEN, kv_heads * group, head_dim, dtype=torch.bfloat16, device=device),
        kv_cache=cache,
        bmm1_scale=head_dim**-0.5,
        window_left=-1,
        sinks=None,
        where="bench",
        max_seq_len=width * PAGE,
    )
    multi = DecodeCall(
        **common,
        block_tables=tables,
        seq_lens=torch.full((batch,), kv_len, dtype=torch.int32, device=device),
        q_len_per_req=Q_LEN,
        mask=chain_mask(batch, Q_LEN, torch.device(device)),
    )
    rows = torch.arange(batch, device=device).repeat_interleave(Q_LEN)
    ends = (kv_len - Q_LEN + 1 + torch.arange(Q_LEN, device=device)).repeat(batch).to(torch.int32)
    flat = DecodeCall(**common, block_tables=tables[rows].contiguous(), seq_lens=ends)
    return multi, flat


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out", default=None)
    add_record_args(p)
    args = p.parse_args()
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    workspace = torch.zeros(WORKSPACE_BYTES, dtype=torch.uint8, device="cuda")
    results = {}
    xqa = lambda call: flashinfer_hopper.decode(call, workspace)  # noqa: E731
    for (name, shape), batch, kv_len in itertools.product(HEADS.items(), (1, 8, 64), (260, 2000)):
        multi, flat = layouts(batch, kv_len, *shape)
        runs = {"multi_query": (xqa, multi), "flat": (xqa, flat), "flat_split": (split_decode.decode, flat)}
        us = {label: graph_ms([lambda f=fn, c=call: f(c)] * CALLS) * 1e3 / CALLS for label, (fn, call) in runs.items()}
        a = xqa(multi).float()
        diffs = {f"rel_diff_{label}": ((fn(c).float() - a).norm() / a.norm()).item() for label, (fn, c) in runs.items()}
        key = f"{name} b{batch} kv{kv_len}"
        results[key] = {**us, **diffs}
        logger.info(
            f"{key:24} multi-query {us['multi_query']:6.1f} us  flat {us['flat']:6.1f} us  "
            f"flat split {us['flat_split']:6.1f} us"
        )
    write_out(args.out, {"device": torch.cuda.get_device_name(), "results": results})
    record_run(args, "verify_attention", results, ["multi_query", "flat", "flat_split"])


if __name__ == "__main__":
    main()
