"""Decode attention bandwidth (XQA, and the split-KV Triton kernel) against a device-to-device
copy, measured in the same run.

Bytes counted for decode: every K and V element of every request read once (queries, outputs
and page tables are < 0.1% and left out). Bytes counted for the copy: read plus written.
Decode is timed as CUDA-graph replays of back-to-back calls, so host dispatch (the Python
wrapper, ~30-60 us a call) is not counted; the eager per-call time is reported beside it. The
copy is timed eagerly (a graph turns it into a copy-engine memcpy node, which is slower than the
copy kernel); for KV that fits in L2 (batch 1-8 x 4096) the copy runs from cache and the
fraction understates the decode kernel. Back-to-back calls also find the page tables and the
kernel's semaphores in L2 and overlap each call's start with the previous one's end (XQA
launches with programmatic dependent launch), which a decode step does not allow: `--flush-mb N`
puts an N MB copy (a layer's weight reads, say) between the calls and reports the calls' cost
on top of the copies alone (`decode_ms_cold`); `--flush-kind linear` makes that a batch-1
projection over an N MB bf16 weight instead (the cuBLAS kernels a decode step runs around XQA).
Prints one JSON line per configuration and a table; `--out FILE` also writes the JSON lines.

    python -m ops.bench.xqa_decode_bandwidth --batch 64 --kv-len 4096 --kv-heads 8 --head-dim 128

`--kernels xqa split` times both kernels on the same calls (`split`:
`attention/kernels/split_decode.py`); `rope+split` and `rotating` time a decode step's RoPE and
attention from raw projections, as the RoPE kernel then the split decode and as the split
decode that rotates its own query (`--flush-kind gemv` puts the one-row Triton GEMV, launched
with PDL as in a step, before each). `--kv-dtype bf16 fp8` times each with a bf16 and an FP8
(e4m3) cache; `--split-tiles 64x4x3 128x4x3` times the split kernel at each (keys a block,
warps, stages) instead of its default.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import statistics
from collections.abc import Callable

import torch

from attention.kernels import DecodeCall, flashinfer_hopper
from attention.kv_pool import FP8_E4M3
from attention.trtllm_mha import WORKSPACE_BYTES
from ops.bench.record import add_record_args, record_run

# a decode step's RoPE and attention from the raw projections (`_rotating_runs`)
ROTATING = ("rope+split", "rotating")
COLUMNS = ["decode_ms", "decode_ms_eager", "decode_ms_cold", "decode_GBps", "copy_GBps", "fraction_of_copy"]


def _kernel(name: str, tile: tuple[int, int, int] | None = None) -> Callable[[DecodeCall, torch.Tensor], torch.Tensor]:
    if name == "xqa":
        return flashinfer_hopper.decode
    from attention.kernels import split_decode

    return lambda call, workspace: split_decode.decode(call, tile=tile)


def time_ms(fn: Callable[[], object], warmup: int = 5, iters: int = 30) -> float:
    """Median wall time of one eager call (host dispatch included)."""
    for _ in range(warmup):
        fn()
    torch.cuda.synchronize()
    times = []
    for _ in range(iters):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end))
    return statistics.median(times)


def graph_ms(steps: list[Callable[[], object]], replays: int = 10) -> float:
    """Median device time of one replay of a CUDA graph of `steps` run in a row (run once on a
    side stream first: compilation, lazy state), so host dispatch is not counted."""
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        for step in steps:
            step()
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for step in steps:
            step()
    return time_ms(graph.replay, warmup=2, iters=replays)


def _time_graph_ms(fn: Callable[[], object], calls: int = 20, between: Callable[[], object] | None = None) -> float:
    """Median device time of one call, from a graph of `calls` back-to-back calls (each
    followed by `between`, if given)."""
    return graph_ms(([fn] if between is None else [fn, between]) * calls) / calls


def copy_bandwidth(nbytes: int) -> float:
    """GB/s of a device-to-device copy, counting bytes read plus bytes written."""
    src = torch.randn(nbytes // 2, dtype=torch.bfloat16, device="cuda")
    dst = torch.empty_like(src)
    ms = time_ms(lambda: dst.copy_(src))
    return 2 * nbytes / ms / 1e6


def _flush(mb: int, kind: str):
    """Device work of `mb` MB of reads between two timed calls: a copy, or a batch-1 projection
    over a bf16 weight of that size (what a decode step runs between attention calls): cuBLAS's
    (`linear`) or the one-row Triton GEMV launched as a step launches it, with PDL (`gemv`)."""
    if kind == "copy":
        src = torch.empty(mb << 20, dtype=torch.uint8, device="cuda")
        dst = torch.empty_like(src)
        return lambda: dst.copy_(src)
    hidden = 4096
    weight = torch.randn((mb << 20) // (2 * hidden), hidden, dtype=torch.bfloat16, device="cuda")
    x = torch.randn(1, hidden, dtype=torch.bfloat16, device="cuda")
    if kind == "gemv":
        from workers.models import gemv

        tile = gemv.Tile(8, 512, 4, 4)
        return lambda: gemv.gemv(x, weight, tile=tile)
    return lambda: torch.nn.functional.linear(x, weight)


def _rotating_runs(call: DecodeCall, kernel: str, group: int) -> Callable[[DecodeCall, torch.Tensor], torch.Tensor]:
    """A decode step's RoPE and attention from raw projections: the RoPE kernel writing the new K
    and V, then the split decode (`rope+split`), or the split decode that does both (`rotating`)."""
    from attention.kernels import split_decode
    from attention.kernels.calls import NewKV, Rotary
    from workers.models import rope
    from workers.models.layers import rope_cache

    rows, _, head_dim = call.query.shape
    kv_heads, page = call.kv_cache.shape[2], call.kv_cache.shape[3]
    device = call.query.device
    qkv = torch.randn(rows, (group + 2) * kv_heads * head_dim, dtype=torch.bfloat16, device=device)
    q = qkv[:, : group * kv_heads * head_dim].view(rows, group * kv_heads, head_dim)
    k = qkv[:, group * kv_heads * head_dim : (group + 1) * kv_heads * head_dim].view(rows, kv_heads, head_dim)
    v = qkv[:, (group + 1) * kv_heads * head_dim :].view(rows, kv_heads, head_dim)
    positions = call.seq_lens.long() - 1
    slots = call.block_tables[torch.arange(rows, device=device), positions // page].long() * page + positions % page
    inv_freq = 1.0 / (10000.0 ** (torch.arange(0, head_dim, 2, device=device).float() / head_dim))
    cos_sin = rope_cache(inv_freq, 1.0, int(call.seq_lens.max()) + 1)
    if kernel == "rotating":
        raw = dataclasses.replace(call, query=q)
        return lambda c, workspace: split_decode.decode_rotating(raw, Rotary(positions, cos_sin), NewKV(k, v, slots))

    def rope_then_split(c: DecodeCall, workspace: torch.Tensor) -> torch.Tensor:
        rotated, _ = rope.rope(positions, q, k, cos_sin, None, (call.kv_cache, slots, v, (1.0, 1.0)))
        return split_decode.decode(dataclasses.replace(call, query=rotated))

    return rope_then_split


def paged_kv(
    batch: int, kv_len: int, kv_heads: int, head_dim: int, page: int, width: int, device: str = "cuda"
) -> tuple[torch.Tensor, torch.Tensor]:
    """A random bf16 paged cache (HND, page 0 unused) holding `kv_len` tokens a request on
    pages in random order, and its page tables zero-padded to `width` pages."""
    pages = -(-kv_len // page)
    cache = torch.randn(batch * pages + 1, 2, kv_heads, page, head_dim, dtype=torch.bfloat16, device=device)
    tables = torch.zeros(batch, width, dtype=torch.int32, device=device)
    tables[:, :pages] = (torch.randperm(batch * pages, device=device) + 1).to(torch.int32).view(batch, pages)
    return cache, tables


def decode_bandwidth(
    batch: int,
    kv_len: int,
    kv_heads: int,
    head_dim: int,
    group: int,
    page: int,
    window_left: int,
    table_tokens: int | None = None,
    flush_mb: int = 0,
    flush_kind: str = "copy",
    kernel: str = "xqa",
    kv_dtype: str = "bf16",
    tile: tuple[int, int, int] | None = None,
) -> dict:
    """One configuration; `table_tokens` widens the page tables (zero-padded) past the KV, as a
    captured graph's tables are: the kernel sizes its grid by that width. `flush_mb`: see the
    module's docstring."""
    pages_per_req = -(-kv_len // page)
    width = max(pages_per_req, -(-(table_tokens or 0) // page))
    cache, tables = paged_kv(batch, kv_len, kv_heads, head_dim, page, width)
    if kv_dtype == "fp8":
        cache = cache.to(FP8_E4M3)
    call = DecodeCall(
        query=torch.randn(batch, kv_heads * group, head_dim, dtype=torch.bfloat16, device="cuda"),
        kv_cache=cache,
        block_tables=tables,
        seq_lens=torch.full((batch,), kv_len, dtype=torch.int32, device="cuda"),
        bmm1_scale=head_dim**-0.5,
        window_left=window_left,
        sinks=None,
        where="bench",
        max_seq_len=width * page,
    )
    call.check()
    workspace = torch.zeros(WORKSPACE_BYTES, dtype=torch.uint8, device="cuda")
    run = _rotating_runs(call, kernel, group) if kernel in ROTATING else _kernel(kernel, tile)
    eager_ms = time_ms(lambda: run(call, workspace))
    ms = _time_graph_ms(lambda: run(call, workspace))
    cold = {}
    if flush_mb:
        flush = _flush(flush_mb, flush_kind)
        both = _time_graph_ms(lambda: run(call, workspace), between=flush)
        cold = {
            "flush_mb": flush_mb,
            "flush_kind": flush_kind,
            "decode_ms_cold": round(both - _time_graph_ms(flush), 4),
        }
    visible = kv_len if window_left < 0 else min(kv_len, window_left + 1)
    kv_bytes = batch * visible * kv_heads * head_dim * 2 * cache.element_size()
    copy = copy_bandwidth(kv_bytes)
    return {
        "kernel": kernel + (f"@{'x'.join(map(str, tile))}" if tile else ""),
        "kv_dtype": kv_dtype,
        "batch": batch,
        "kv_len": kv_len,
        "kv_heads": kv_heads,
        "head_dim": head_dim,
        "group": group,
        "page": page,
        "table_tokens": width * page,
        "window_left": window_left,
        "decode_ms": round(ms, 4),
        "decode_ms_eager": round(eager_ms, 4),
        "decode_GBps": round(kv_bytes / ms / 1e6, 1),
        "copy_GBps": round(copy, 1),
        "fraction_of_copy": round(kv_bytes / ms / 1e6 / copy, 3),
        **cold,
    }


def case(row: dict) -> str:
    """A configuration's name in a record: kernel, heads (KV heads x head dim, group), batch, KV
    length, page, table width, and the window and flush where set."""
    name = f"{row['kernel']} {row['kv_heads']}x{row['head_dim']}g{row['group']} b{row['batch']} kv{row['kv_len']}"
    if row.get("kv_dtype", "bf16") != "bf16":
        name += f" {row['kv_dtype']}"
    name += f" page{row['page']} table{row['table_tokens']}"
    if row["window_left"] >= 0:
        name += f" window{row['window_left']}"
    if "flush_mb" in row:
        name += f" flush{row['flush_mb']}{row['flush_kind']}"
    return name


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--batch", type=int, nargs="+", default=[64])
    p.add_argument("--kv-len", type=int, nargs="+", default=[4096])
    p.add_argument("--kv-heads", type=int, default=8)
    p.add_argument("--head-dim", type=int, default=128)
    p.add_argument("--group", type=int, default=4)
    p.add_argument("--page", type=int, nargs="+", default=[64])
    p.add_argument("--window-left", type=int, default=-1)
    p.add_argument("--table-tokens", type=int, nargs="+", default=[0], help="page-table widths (tokens); 0: the KV")
    p.add_argument("--flush-mb", type=int, default=0, help="this many MB of reads between the timed calls")
    p.add_argument("--flush-kind", choices=["copy", "linear", "gemv"], default="copy", help="what reads them")
    p.add_argument("--kernels", nargs="+", choices=["xqa", "split", *ROTATING], default=["xqa"])
    p.add_argument("--kv-dtype", nargs="+", choices=["bf16", "fp8"], default=["bf16"])
    p.add_argument("--split-tiles", nargs="+", default=[], help="the split kernel's (keys, warps, stages), e.g. 64x4x3")
    p.add_argument("--out", default=None)
    add_record_args(p)
    args = p.parse_args()
    tiles = [tuple(int(v) for v in t.split("x")) for t in args.split_tiles]
    kernels = [(k, None) for k in args.kernels if k != "split" or not tiles]
    kernels += [("split", t) for t in tiles if "split" in args.kernels]
    rows = [
        decode_bandwidth(
            b,
            n,
            args.kv_heads,
            args.head_dim,
            args.group,
            pg,
            args.window_left,
            t,
            args.flush_mb,
            args.flush_kind,
            k,
            dtype,
            tile,
        )
        for k, tile in kernels
        for dtype in args.kv_dtype
        for b in args.batch
        for n in args.kv_len
        for pg in args.page
        for t in args.table_tokens
    ]
    lines = [json.dumps({"device": torch.cuda.get_device_name(), **r}) for r in rows]
    if args.out:
        with open(args.out, "w") as f:
            f.write("\n".join(lines) + "\n")
    print("\n".join(lines))
    header = (
        ("kernel", 14),
        ("kv", 4),
        ("batch", 5),
        ("kv_len", 6),
        ("page", 4),
        ("table", 6),
        ("ms", 8),
        ("eager ms", 8),
        ("decode GB/s", 11),
        ("copy GB/s", 9),
    )
    print(" ".join(f"{name:>{width}}" for name, width in header) + f" {'frac':>5}")
    for r in rows:
        print(
            f"{r['kernel']:>14} {r['kv_dtype']:>4} {r['batch']:>5} {r['kv_len']:>6} {r['page']:>4} "
            f"{r['table_tokens']:>6} "
            f"{r['decode_ms']:>8.3f} {r['decode_ms_eager']:>8.3f} "
            f"{r['decode_GBps']:>11.0f} {r['copy_GBps']:>9.0f} {r['fraction_of_copy']:>5.2f}"
        )
    record_run(args, "xqa_decode_bandwidth", {case(r): r for r in rows}, COLUMNS)


if __name__ == "__main__":
    main()
