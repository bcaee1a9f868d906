"""The `trtllm_mha` backend: TensorRT-LLM attention kernels over hybrid SWA KV pools.

Correct by construction where the upstream engine was not (docs/design.md §4):
1. a layer's index space comes from the pool handed to this forward (`pool.is_swa_layer`),
   never from an allocator;
2. nothing about a pool is kept between forwards: `init_forward_metadata` resolves it anew,
   so a pool swapped in at forward time (frozen-KV drafts) is honoured;
3. the kernel is picked by the `ROUTING` table: the decode kernel only for uniform query
   lengths whose KV lengths include the new tokens (DECODE, TARGET_VERIFY, the padded
   DRAFT_EXTEND_V2); a ragged batch routed there is refused before any kernel runs;
4. every SWA-layer write of a forward uses the one `swa_out_loc` translated from this batch's
   `out_cache_loc`;
5. there is no translation memo: page tables and write slots are computed once per forward
   into metadata (in place into static buffers for graph replay).
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Callable

import numpy as np
import torch

from attention.base import AttentionBackend, AttentionLayer, KVDestination
from attention.batch import AttentionBatch, upload
from attention.forward_mode import ForwardMode
from attention.kernels import (
    SPLIT_DECODE,
    ContextCall,
    DecodeCall,
    KernelContractError,
    KernelSet,
    chain_mask,
    select_kernels,
    split_decode_rotating,
)
from attention.kernels.calls import NewKV, Rotary, cdiv, check_write
from attention.kv_pool import FP8_E4M3, KVPool
from attention.staging import StagedBuffers

# Forward mode -> kernel. The decode kernel only for modes whose batches have one query length
# per request, KV included: DRAFT_EXTEND_V2 is the draft's fixed window over the verified
# positions (padded, never ragged); a ragged batch in a decode mode is refused (`_build_metadata`).
ROUTING: dict[ForwardMode, str | None] = {
    ForwardMode.EXTEND: "context",
    ForwardMode.DECODE: "decode",
    ForwardMode.TARGET_VERIFY: "decode",
    ForwardMode.DRAFT_EXTEND_V2: "decode",
    ForwardMode.IDLE: None,
}

WORKSPACE_BYTES = 128 * 1024 * 1024
GRAPH_KV_BUCKETS = (1024, 4096, 16384, 65536)  # KV lengths (tokens) of the page-table widths graphs use
MAX_VERIFY_TOKENS = 17  # num_steps (at most 16) + 1 query tokens per request


@dataclasses.dataclass
class ForwardMetadata:
    mode: ForwardMode
    pool: KVPool
    kernel: str  # from ROUTING; a layer may still fall back to "context" (see _route)
    q_len_per_req: int  # uniform query length (decode kernel), 0 when ragged
    seq_lens: torch.Tensor  # [B x rows_per_req] int32, KV lengths including the new tokens
    max_seq_len: int
    cu_seq_lens_q: torch.Tensor  # [B x rows_per_req + 1] int32
    cu_seq_lens_kv: torch.Tensor  # [B x rows_per_req + 1] int32
    max_q_len: int
    out_cache_loc: torch.Tensor  # [T] full-pool write slots
    full_page_table: torch.Tensor  # [B x rows_per_req, M] int32
    swa_page_table: torch.Tensor | None  # the same shape, full pages translated through full_to_swa
    swa_out_loc: torch.Tensor | None  # [T] SWA-pool write slots, translated once
    mask: torch.Tensor | None  # packed chain mask for verify on kernels that need it
    query_offset: int  # read-only queries this far past the KV end (frozen-KV drafts)
    rows_per_req: int = 1  # a flat verify's: one decode row a query (lengths and tables per row)
    # The same forward read one query a row (each row's KV ending at its query), which every
    # layer reads in a model with layers too wide for the multi-query kernels; else None.
    rows: ForwardMetadata | None = None


class TRTLLMMHABackend(AttentionBackend):
    name = "trtllm_mha"

    def __init__(self, device: torch.device, debug_kv_checks: bool = False, kernels: KernelSet | None = None) -> None:
        super().__init__(device)
        self.kernels = kernels or select_kernels(device)
        # GPU kernels fault or read garbage on a broken contract; check first when debugging.
        self.check_contracts = debug_kv_checks and not self.kernels.self_checking
        self.check_writes = debug_kv_checks or self.kernels.self_checking
        self.workspace = (
            torch.zeros(WORKSPACE_BYTES, dtype=torch.uint8, device=device) if device.type == "cuda" else None
        )
        self._md: ForwardMetadata | None = None
        self._staging: StagedBuffers | None = None
        # `_place_static`'s, by shape: where each array is staged (name, region, offset) and its view
        self._static_views: dict[tuple, tuple[list[tuple[str, str, int]], dict[str, torch.Tensor]]] = {}
        self._layout: dict[str, int] = {}
        self._rows_layout: dict[str, int] = {}
        self._has_wide = False  # a layer reads one query a row in multi-query forwards
        self._max_pages = 0
        self._page_size = 1
        self._widths: dict[int, int] = {}  # `table_width`'s answers (asked every replay)
        self._fp8 = False  # an FP8 cache: its own split-KV routing (`KernelSet.decode_kernel`)

    # -- start-up ----------------------------------------------------------------------------
    def prepare(self, layers: list[AttentionLayer], page_size: int, kv_dtype: torch.dtype | None = None) -> None:
        """Fail at start-up on a feature combination the kernels of this device lack."""
        ks = self.kernels
        self._page_size, self._widths = page_size, {}
        self._fp8 = kv_dtype == FP8_E4M3
        if ks.page_sizes is not None and page_size not in ks.page_sizes:
            raise ValueError(f"page_size: trtllm_mha on {ks.name} supports {ks.page_sizes}, got {page_size}")
        if kv_dtype == FP8_E4M3 and not ks.fp8_kv:
            raise ValueError(
                f"kv_cache_dtype: fp8_e4m3 is not available with trtllm_mha's kernels on {ks.name} "
                f"({ks.decode_name}, {ks.context_name}): their FP8 variants are not wired there; use "
                "kv_cache_dtype auto"
            )
        if kv_dtype == FP8_E4M3 and not ks.fp8_kv_softcap_with_sinks:
            both = [a.layer_id for a in layers if a.logit_softcap and a.sinks is not None]
            if both:
                raise ValueError(
                    f"kv_cache_dtype: fp8_e4m3 with {ks.context_name} on {ks.name} gives wrong outputs for layers with "
                    f"both logit soft-capping and attention sinks (layers {both[:8]}); use kv_cache_dtype auto"
                )
        for layer in layers:
            if ks.max_head_dim is not None and layer.head_dim > ks.max_head_dim:
                raise ValueError(
                    f"attention_backend: trtllm_mha on {ks.name} has no kernel tested with heads wider than "
                    f"{ks.max_head_dim}: layer {layer.layer_id} reads {layer.num_kv_heads} KV heads of "
                    f"{layer.head_dim} ({'full attention' if layer.sliding_window is None else 'sliding window'})"
                )
            if layer.logit_softcap is not None and not ks.context_softcap:
                raise ValueError(
                    f"attention_backend: trtllm_mha on {ks.name} has no kernel with logit soft-capping "
                    f"(layer {layer.layer_id}, cap {layer.logit_softcap}); use torch_native"
                )
            if self._wide(layer) and layer.logit_softcap is not None and not ks.decode_softcap:
                raise ValueError(
                    f"attention_backend: trtllm_mha on {ks.name} reads heads of {layer.head_dim} through its "
                    f"decode kernel, which has no logit soft-capping (layer {layer.layer_id}); use torch_native"
                )
        self._has_wide = any(self._wide(layer) for layer in layers)

    def _split_decode_ok(self, md: ForwardMetadata) -> bool:
        """Whether one-query calls of this forward may take the split-KV kernel: not the rows of
        several queries a request in a model with wide layers (on an H200 such verify rows of
        several requests gave wrong logits through it, and right ones through XQA)."""
        return not (self._has_wide and (md.rows_per_req > 1 or md is not self._md))

    def _wide(self, layer: AttentionLayer) -> bool:
        """Whether the layer's heads are too wide for the multi-query kernels (it then reads one
        query a row in every multi-query forward)."""
        limit = self.kernels.multi_query_max_head_dim
        return limit is not None and layer.head_dim > limit

    # -- per forward ---------------------------------------------------------------------------
    def init_forward_metadata(self, batch: AttentionBatch, pool: KVPool) -> None:
        self._md = self._build_metadata(batch, pool)

    def init_graph_buffers(
        self, max_batch_size: int, max_tokens: int, max_pages_per_req: int, staging: StagedBuffers | None = None
    ) -> None:
        """Static metadata buffers for CUDA-graph capture: fixed addresses and shapes, so a
        graph captured for a batch size replays against whatever this forward writes there.

        Page tables come in a few widths (`GRAPH_KV_BUCKETS` tokens, and the whole context):
        the decode kernel sizes its work by the table's width, so a short batch replays the
        graph of the narrowest table that holds it. Eager forwards pad their tables to the same
        widths, so both run the same kernel configuration.

        The buffers are regions of `staging` (the graph runner's, which uploads a replay's
        inputs and this metadata in one copy; without one, this backend's own): SWA write
        slots, the verify mask, then the int32 metadata `[seq_lens | cu_seq_lens_q |
        cu_seq_lens_kv | page tables]` (a batch of b rows and width w puts its full table in
        the first b * w entries of the table region and its SWA table right after), so a small
        batch writes a short prefix of the block."""
        b = max(max_batch_size, max_tokens)  # rows: a flat verify has one a query
        self._layout = _int32_layout(b)
        self._max_pages, self._widths = max_pages_per_req, {}
        self._staging = staging if staging is not None else StagedBuffers(self.device)
        self._staging.add("swa_out_loc", max_tokens, torch.int64)
        self._staging.add("mask", max_tokens * 2 * cdiv(MAX_VERIFY_TOKENS, 32), torch.uint16)
        self._staging.add("int32", 3 * b + 2 + 2 * b * max_pages_per_req, torch.int32)
        if self._has_wide:  # the one-query-a-row view of a verify, for the wide layers
            self._rows_layout = _int32_layout(max_tokens)
            self._staging.add("int32_rows", 3 * max_tokens + 2 + 2 * max_tokens * max_pages_per_req, torch.int32)
        if staging is None:
            self._staging.allocate()

    def graph_table_widths(self) -> list[int]:
        """Page-table widths (pages) graphs are captured for; empty without graph buffers."""
        if not self._max_pages:
            return []
        return sorted({min(cdiv(t, self._page_size), self._max_pages) for t in GRAPH_KV_BUCKETS} | {self._max_pages})

    def table_width(self, pages: int) -> int:
        """The narrowest captured width that holds `pages` pages (the exact count without
        graph buffers)."""
        width = self._widths.get(pages)
        if width is None:
            width = self._widths[pages] = next((w for w in self.graph_table_widths() if w >= pages), pages)
        return width

    def init_forward_metadata_replay(
        self, batch: AttentionBatch, pool: KVPool, width: int | None = None, reach: int = 0
    ) -> None:
        """Graph replay: this forward's metadata, recomputed from the batch and staged into the
        static buffers (page tables zero-padded to `width` pages, by default the narrowest
        captured width that holds the batch; they cover each request's KV and `reach` more
        tokens, which a chain of draft steps writes and reads). Staged while a graph runner
        stages a replay (it uploads the metadata with the batch's inputs), uploaded here else."""
        if not self._max_pages:
            raise RuntimeError("trtllm_mha: init_graph_buffers() before graph replay")
        alone = not self._staging.open
        if alone:
            self._staging.begin()
        self._md = self._build_metadata(batch, pool, width, reach, place=self._place_static)
        if alone:
            self._staging.upload()

    def _place_static(self, host: dict[str, np.ndarray], region: str = "int32") -> dict[str, torch.Tensor]:
        """Host metadata staged into the static buffers (`int32_rows`: a one-query-a-row view's);
        views of them in the same shapes, made once per shape (a view is microseconds of host
        time, and every replay of a graph stages the same shape; the dict is shared: read only)."""
        b, w = host["full_page_table"].shape
        swa = "swa_page_table" in host
        shape = (region, b, w, swa, host["swa_out_loc"].size if "swa_out_loc" in host else -1)
        placed = self._static_views.get(shape)
        staging = self._staging
        if placed is None:
            at = self._rows_layout if region == "int32_rows" else self._layout
            places = [(name, region, at[name]) for name in ("seq_lens", "cu_seq_lens_q", "cu_seq_lens_kv")]
            tables = ["full_page_table", "swa_page_table"][: 1 + swa]
            places += [(name, region, at["tables"] + i * b * w) for i, name in enumerate(tables)]
            if "swa_out_loc" in host:
                places.append(("swa_out_loc", "swa_out_loc", 0))
            views = {
                name: staging.view(into)[offset : offset + host[name].size].view(host[name].shape)
                for name, into, offset in places
            }
            placed = self._static_views[shape] = (places, views)
        places, views = placed
        for name, into, offset in places:
            staging.host(into, host[name].size, offset)[:] = host[name].reshape(-1)
        return views

    def _static_mask(self, batch_size: int, q_len: int) -> torch.Tensor:
        """The chain mask, staged into the static buffer afresh for every replay (§4.5)."""
        rows = chain_mask(1, q_len, torch.device("cpu")).numpy()
        return self._staging.put("mask", np.broadcast_to(rows, (batch_size, *rows.shape[1:]))).view(
            batch_size, *rows.shape[1:]
        )

    def advance_decode(self, batch: AttentionBatch, by: torch.Tensor | int = 1) -> None:
        """Move decode metadata on, on the device: the next step of a chain of single-token draft
        steps inside one graph (`by` 1), or rows whose KV is `by[i]` longer than the host knew
        (a chain's or a verify's, launched before the host read the round that decided it).
        A forward writing KV reads that many more keys and writes at `batch.out_cache_loc`;
        read-only queries sit `batch.query_offset` past the KV end (the caller moved the batch
        on first). Page tables were built to reach that far."""
        md = self._md
        single = md is not None and md.q_len_per_req * md.rows_per_req == 1
        if md is None or md.kernel != "decode" or not (single or isinstance(by, torch.Tensor)):
            raise KernelContractError("advance_decode: decode metadata moves on by a step for single tokens only")
        if isinstance(by, torch.Tensor):  # per request: the KV grew by as much (read-only queries too)
            for view in (md, md.rows) if md.rows is not None else (md,):
                grown = by.repeat_interleave(view.rows_per_req) if view.rows_per_req > 1 else by
                view.seq_lens.add_(grown.to(torch.int32))
                view.cu_seq_lens_kv[1:].add_(grown.cumsum(0).to(torch.int32))
        elif md.query_offset:
            md.query_offset = batch.query_offset
        else:
            md.seq_lens.add_(by)
            steps = torch.arange(md.cu_seq_lens_kv.shape[0], dtype=torch.int32, device=self.device)
            md.cu_seq_lens_kv.add_(steps * by)
        if not md.query_offset and md.swa_out_loc is not None:  # writes: md.out_cache_loc is the batch's
            md.swa_out_loc.copy_(md.pool.translate_full_to_swa(batch.out_cache_loc))

    def _build_metadata(
        self,
        batch: AttentionBatch,
        pool: KVPool,
        width: int | None = None,
        reach: int = 0,
        place: Callable[[dict[str, np.ndarray]], dict[str, torch.Tensor]] | None = None,
    ) -> ForwardMetadata:
        """The forward's metadata. Lengths, page tables and SWA write slots are computed from
        the host's tables (the host is their master) and reach the device in one copy: no
        kernels, and no device read. `place` puts them there (default: fresh device tensors)."""
        mode = batch.forward_mode
        kernel = ROUTING[mode]
        q_lens, seq_lens = batch.q_lens_cpu, batch.seq_lens_cpu
        q_len_per_req = uniform_query_len(mode, kernel, q_lens)
        if batch.query_offset and (kernel != "decode" or q_len_per_req != 1):
            raise KernelContractError(
                f"{mode.name}: queries past the KV end (offset {batch.query_offset}) must be "
                f"single decode queries, got query lengths {q_lens}"
            )
        if batch.req_to_token_host is None:
            raise RuntimeError("trtllm_mha: the batch carries no host req_to_token (build it with ForwardBatch.build)")
        p = pool.page_size
        max_seq_len = max(seq_lens, default=0)
        pages_per_req = width or self.table_width(cdiv(max(max_seq_len + reach, 1), p))
        ks = self.kernels
        # A model with layers too wide for the multi-query kernels reads every multi-query
        # forward one query a row, every layer (verify-shaped ones flat, prefills through the
        # rows view): on an H200, forwards mixing FMHA-v2 or XQA's multi-query mode with
        # one-query rows gave wrong logits, and all-rows through XQA was exact.
        few = batch.batch_size <= ks.flat_verify_batch and pages_per_req * p <= ks.flat_verify_kv
        flat = kernel == "decode" and q_len_per_req > 1 and (self._has_wide or few)
        rows_per_req = q_len_per_req if flat else 1
        uniform_rows = [q_len_per_req] * batch.batch_size if flat else None
        host = self._host_tables(batch, pool, pages_per_req, reach, uniform_rows, q_len_per_req)
        dev = place(host) if place else dict(zip(host, _upload_int32(list(host.values()), self.device)))
        rows = None
        if self._has_wide and kernel is not None and not flat and (kernel == "context" or q_len_per_req > 1):
            rows = self._rows_view(batch, pool, pages_per_req, reach, q_len_per_req, place)
        if flat:
            q_len_per_req, q_lens = 1, [1]
        mask = None
        if kernel == "decode" and q_len_per_req > 1 and self.kernels.needs_chain_mask:
            args = (batch.batch_size, q_len_per_req)
            mask = chain_mask(*args, self.device) if place is None else self._static_mask(*args)
        return ForwardMetadata(
            mode=mode,
            pool=pool,
            kernel=kernel,
            q_len_per_req=q_len_per_req,
            seq_lens=dev["seq_lens"],
            max_seq_len=pages_per_req * p if self._max_pages else max_seq_len,  # graphs: the table's bound
            cu_seq_lens_q=dev["cu_seq_lens_q"],
            cu_seq_lens_kv=dev["cu_seq_lens_kv"],
            max_q_len=max(q_lens, default=0),
            out_cache_loc=batch.out_cache_loc,
            full_page_table=dev["full_page_table"],
            swa_page_table=dev.get("swa_page_table"),
            swa_out_loc=dev.get("swa_out_loc"),
            mask=mask,
            query_offset=batch.query_offset,
            rows_per_req=rows_per_req,
            rows=rows,
        )

    def _rows_view(
        self,
        batch: AttentionBatch,
        pool: KVPool,
        pages: int,
        reach: int,
        q_len_per_req: int,
        place: Callable[[dict[str, np.ndarray]], dict[str, torch.Tensor]] | None,
    ) -> ForwardMetadata:
        """This forward read one query a row, each row's KV ending at its query: what every layer
        of a model with a layer too wide for the multi-query kernels reads through the one-query
        decode kernel. Its tables come from the same host tables as the forward's (§4.5); it
        writes nothing (§4.4)."""
        host = self._host_tables(batch, pool, pages, reach, batch.q_lens_cpu)
        host.pop("swa_out_loc", None)
        if place is not None:
            dev = self._place_static(host, "int32_rows")
        else:
            dev = dict(zip(host, _upload_int32(list(host.values()), self.device)))
        max_seq_len = int(host["seq_lens"].max(initial=0))
        return ForwardMetadata(
            mode=batch.forward_mode,
            pool=pool,
            kernel="decode",
            q_len_per_req=1,
            seq_lens=dev["seq_lens"],
            max_seq_len=pages * pool.page_size if self._max_pages else max_seq_len,
            cu_seq_lens_q=dev["cu_seq_lens_q"],
            cu_seq_lens_kv=dev["cu_seq_lens_kv"],
            max_q_len=1,
            out_cache_loc=batch.out_cache_loc,
            full_page_table=dev["full_page_table"],
            swa_page_table=dev.get("swa_page_table"),
            swa_out_loc=None,
            mask=None,
            query_offset=0,
            rows_per_req=q_len_per_req,  # 0 for a ragged prefill (never advanced)
        )

    @staticmethod
    def _host_tables(
        batch: AttentionBatch,
        pool: KVPool,
        pages: int,
        reach: int = 0,
        query_rows: list[int] | None = None,
        q_len: int = 0,
    ) -> dict[str, np.ndarray]:
        """Lengths, page tables `[B, pages]` and SWA write slots on the host. A page table holds
        each request's slot at the start of every page (allocation is page aligned, so slot //
        page_size is the page); columns past a request's length (plus `reach`) are 0. With
        `query_rows` (a flat verify: its uniform query length; a wide layer's rows: the batch's
        query lengths) request i has that many rows, one a query, each row's KV ending there.
        `q_len`: the batch's one query length a request, where it has one (0: ragged)."""
        p = pool.page_size
        table = batch.req_to_token_host
        seq_lens = np.asarray(batch.seq_lens_cpu, dtype=np.int64)
        req_rows = batch.host.req_pool_indices
        q_lens = batch.q_lens_cpu
        if query_rows is not None:
            n = np.asarray(query_rows, dtype=np.int64)
            starts = np.repeat(seq_lens - n, n)  # KV before each request's first query
            within = np.arange(int(n.sum())) - np.repeat(np.cumsum(n) - n, n)
            seq_lens, req_rows = starts + within + 1, np.repeat(req_rows, n)
        cols, starts = _page_columns(pages, p, table.shape[1])
        first_slots = table[req_rows[:, None], starts[None, :]]
        used = np.greater.outer((seq_lens + (reach + p - 1)) // p, cols)  # columns within each request's pages
        if query_rows is not None or q_len:  # one query length a request: 0, q, 2q, ...
            cu_q = _uniform_starts(len(seq_lens), 1 if query_rows is not None else q_len)
        else:
            cu_q = np.zeros(len(seq_lens) + 1, dtype=np.int64)
            np.cumsum(q_lens, out=cu_q[1:])
        cu_kv = np.zeros(len(seq_lens) + 1, dtype=np.int64)
        np.cumsum(seq_lens, out=cu_kv[1:])
        out = {
            "seq_lens": seq_lens,
            "cu_seq_lens_q": cu_q,
            "cu_seq_lens_kv": cu_kv,
            "full_page_table": np.where(used, first_slots // p, 0),
        }
        if pool.has_swa:
            out["swa_page_table"] = np.where(used, pool.translate_full_to_swa_host(first_slots) // p, 0)
            out["swa_out_loc"] = pool.translate_full_to_swa_host(batch.host.out_cache_loc)
        return out

    @staticmethod
    def _window_left(md: ForwardMetadata, layer: AttentionLayer) -> int:
        """Keys left of the kernel's query position that stay visible. The kernels place each
        query at the last KV position; a query `query_offset` positions further on sees that
        many fewer keys of its window."""
        if layer.sliding_window is None:
            return -1
        window_left = layer.sliding_window - 1 - md.query_offset
        if window_left < 0:
            raise KernelContractError(
                f"{md.mode.name} layer {layer.layer_id}: queries {md.query_offset} positions past "
                f"the KV end see nothing of a {layer.sliding_window}-token window"
            )
        return window_left

    def _route(self, md: ForwardMetadata, layer: AttentionLayer) -> str:
        """The routed kernel, unless this layer needs a feature the decode kernel lacks."""
        if md.kernel == "decode" and layer.logit_softcap is not None and not self.kernels.decode_softcap:
            return "context"
        return md.kernel

    def _where(self, md: ForwardMetadata, layer: AttentionLayer, is_swa: bool) -> str:
        route = self._route(md, layer)
        return f"{md.mode.name} layer {layer.layer_id} ({'swa' if is_swa else 'full'} pool, {route} kernel)"

    def _write_slots(
        self, md: ForwardMetadata, layer: AttentionLayer, kv_cache: torch.Tensor, is_swa: bool
    ) -> torch.Tensor:
        """The layer's write slots in its pool's index space, checked when checks are on (the
        message is built only then: this runs for every layer of every forward)."""
        locs = md.swa_out_loc if is_swa else md.out_cache_loc
        if self.check_writes:
            check_write(locs, kv_cache, self._where(md, layer, is_swa))
        return locs

    @staticmethod
    def _kv_scales(pool: KVPool, layer: AttentionLayer, kv_cache: torch.Tensor) -> tuple[float, float]:
        """The scales `layer`'s KV is stored with: the pool's, resolved at use (an FP8 cache
        only; a frozen-KV draft reads the target's pool with the target's scales)."""
        return pool.kv_scales(layer.layer_id) if kv_cache.dtype == FP8_E4M3 else (1.0, 1.0)

    def kv_destination(self, layer: AttentionLayer) -> KVDestination | None:
        md = self._md
        if md is None or md.kernel is None:
            return None
        is_swa = md.pool.is_swa_layer(layer.layer_id)
        kv_cache = md.pool.kv_cache(layer.layer_id)
        locs = self._write_slots(md, layer, kv_cache, is_swa)
        scales = self._kv_scales(md.pool, layer, kv_cache)
        return KVDestination(kv_cache, md.pool.write_slots(layer.layer_id, locs), scales)

    @staticmethod
    def _is_swa(md: ForwardMetadata, layer: AttentionLayer) -> bool:
        """Whether the layer's KV is in the SWA pool (refused for a layer without a window)."""
        is_swa = md.pool.is_swa_layer(layer.layer_id)
        if is_swa and layer.sliding_window is None:
            raise KernelContractError(
                f"{md.mode.name} layer {layer.layer_id}: no sliding window but its KV is in the SWA pool"
            )
        return is_swa

    def _call_args(
        self,
        md: ForwardMetadata,
        read: ForwardMetadata,
        layer: AttentionLayer,
        query: torch.Tensor,
        kv_cache: torch.Tensor,
        is_swa: bool,
        window_left: int,
    ) -> dict:
        """What a layer's decode and context calls share: `read`'s lengths and the layer's pool's
        page tables, sinks and KV scales."""
        k_scale, v_scale = self._kv_scales(md.pool, layer, kv_cache)
        return dict(
            query=query,
            kv_cache=kv_cache,
            block_tables=read.swa_page_table if is_swa else read.full_page_table,
            seq_lens=read.seq_lens,
            bmm1_scale=layer.scaling,
            window_left=window_left,
            sinks=layer.sinks,
            where=self._where(md, layer, is_swa),
            k_scale=k_scale,
            v_scale=v_scale,
        )

    def forward_rotating(
        self,
        layer: AttentionLayer,
        q: torch.Tensor,
        k: torch.Tensor | None,
        v: torch.Tensor | None,
        rotary: Rotary,
    ) -> torch.Tensor | None:
        """A decode step through the split-KV kernel that rotates its own query and writes the
        new K and V itself (one kernel where RoPE took another); None for any other forward or
        kernel. q, k, v: the raw `[T, heads, head_dim]` views of the projection."""
        md = self._md
        if layer.head_dim not in self.kernels.rotating_head_dims:
            return None
        if md is None or md.mode is not ForwardMode.DECODE or md.rows is not None or md.rows_per_req != 1:
            return None
        if self._route(md, layer) != "decode" or (k is not None and md.query_offset):
            return None
        rows = md.seq_lens.shape[0]
        if self.kernels.decode_kernel(rows, md.q_len_per_req, self._split_decode_ok(md), self._fp8)[0] != SPLIT_DECODE:
            return None
        is_swa = self._is_swa(md, layer)
        window_left = self._window_left(md, layer)  # checked before anything is written
        common = self._call_args(md, md, layer, q, md.pool.kv_cache(layer.layer_id), is_swa, window_left)
        call = DecodeCall(**common, max_seq_len=md.max_seq_len, q_len_per_req=1, mask=None)
        new_kv = None if k is None else NewKV(k, v, self.kv_destination(layer).slots)
        if self.check_contracts:
            call.check()
        return split_decode_rotating(call, rotary, new_kv).reshape(q.shape[0], layer.num_heads * layer.head_dim)

    def forward(
        self,
        layer: AttentionLayer,
        q: torch.Tensor,
        k: torch.Tensor | None,
        v: torch.Tensor | None,
    ) -> torch.Tensor:
        md = self._md
        if md is None:
            raise RuntimeError("trtllm_mha: forward() before init_forward_metadata()")
        num_tokens = q.shape[0]
        if md.kernel is None:
            return q.new_empty(num_tokens, layer.num_heads * layer.head_dim)
        pool = md.pool
        is_swa = self._is_swa(md, layer)
        route = self._route(md, layer)
        window_left = self._window_left(md, layer)  # checked before anything is written
        kv_cache = pool.kv_cache(layer.layer_id)
        if k is not None:  # written through the forward's own metadata, whatever reads it
            pool.set_kv(
                layer.layer_id,
                self._write_slots(md, layer, kv_cache, is_swa),
                k.view(num_tokens, layer.num_kv_heads, layer.head_dim),
                v.view(num_tokens, layer.num_kv_heads, layer.head_dim),
            )
        read = md.rows if md.rows is not None else md  # a model with wide layers: every layer (see _build_metadata)
        query = q.view(num_tokens, layer.num_heads, layer.head_dim)
        common = self._call_args(md, read, layer, query, kv_cache, is_swa, window_left)
        if read is md.rows:
            route = "decode"
        if route == "decode":
            call = DecodeCall(**common, max_seq_len=read.max_seq_len, q_len_per_req=read.q_len_per_req, mask=read.mask)
            _, run = self.kernels.decode_kernel(
                call.batch_size, read.q_len_per_req, self._split_decode_ok(read), self._fp8
            )
        else:
            call = ContextCall(
                **common,
                cum_seq_lens_q=md.cu_seq_lens_q,
                cum_seq_lens_kv=md.cu_seq_lens_kv,
                max_q_len=md.max_q_len,
                max_kv_len=md.max_seq_len,
                logits_soft_cap=layer.logit_softcap,
            )
            run = self.kernels.context
        if self.check_contracts:
            call.check()
        return run(call, self.workspace).reshape(num_tokens, layer.num_heads * layer.head_dim)

    # -- introspection ---------------------------------------------------------------------------
    def kernel_name(self, mode: ForwardMode) -> str | None:
        """The kernel this device runs for a forward mode (recorded in traces): for the decode
        route, the one the last forward of that mode ran (it depends on the batch's shape)."""
        route = ROUTING[mode]
        if route is None:
            return None
        md = self._md
        if route == "decode" and md is not None and md.mode == mode:
            rows = md.seq_lens.shape[0]
            return self.kernels.decode_kernel(rows, md.q_len_per_req, self._split_decode_ok(md), self._fp8)[0]
        return getattr(self.kernels, f"{route}_name")


def uniform_query_len(mode: ForwardMode, kernel: str | None, q_lens: list[int]) -> int:
    """The batch's one query length per request (0 when ragged); a ragged batch routed to the
    decode kernel is refused here, before any kernel runs (docs/design.md §4.3)."""
    q_len = q_lens[0] if q_lens and len(set(q_lens)) == 1 else 0
    if kernel == "decode" and not q_len:
        raise KernelContractError(f"{mode.name}: the decode kernel needs one query length per batch, got {q_lens}")
    return q_len


def _int32_layout(rows: int) -> dict[str, int]:
    """Offsets in a static int32 region of `[seq_lens | cu_seq_lens_q | cu_seq_lens_kv | tables]`
    for up to `rows` rows."""
    return {"seq_lens": 0, "cu_seq_lens_q": rows, "cu_seq_lens_kv": 2 * rows + 1, "tables": 3 * rows + 2}


@functools.lru_cache(maxsize=256)
def _page_columns(pages: int, page_size: int, positions: int) -> tuple[np.ndarray, np.ndarray]:
    """Page-table columns 0..pages-1 and the table position each reads (its page's first,
    clamped to the table): the same for every forward of a width, made once (read only)."""
    cols = np.arange(pages)
    starts = np.minimum(cols * page_size, positions - 1)
    cols.flags.writeable = starts.flags.writeable = False
    return cols, starts


@functools.lru_cache(maxsize=1024)
def _uniform_starts(requests: int, q_len: int) -> np.ndarray:
    """Each request's first query row, and the total, when every request has `q_len` (read only;
    made once: a cumulative sum of a list is microseconds of a host-bound step)."""
    starts = np.arange(requests + 1, dtype=np.int64) * q_len
    starts.flags.writeable = False
    return starts


def _upload_int32(arrays: list[np.ndarray], device: torch.device) -> list[torch.Tensor]:
    """Host arrays on the device as int32, in one copy; shapes kept."""
    packed = upload(np.concatenate([a.reshape(-1) for a in arrays]).astype(np.int32), device)
    return [part.view(a.shape) for part, a in zip(packed.split([a.size for a in arrays]), arrays)]
