"""CUDA graphs of a model runner's decode-side forwards: captured at start-up, replayed per step.

What a graph bakes in is its key: forward mode, query length per request, read-only query
offset, batch size, and the KV pool it was captured with — its buffer addresses and which of
its layers are SWA-translated. A forward through another pool never replays it (docs/design.md
§4.2 in graph form): frozen-KV drafts capture their graphs with the target's pool, the one
their forwards are handed. Everything else is data in static buffers that every replay
rewrites before launching: the batch's inputs and the attention metadata
(`init_forward_metadata_replay` translates this batch's page tables and SWA write slots into
the backend's static buffers: §4.4 and §4.5 hold under replay as in eager mode), all regions of
one block (`attention/staging.py`) that a replay fills with one host-to-device copy.

A greedy decode graph (`argmax=True`) also takes its tokens' argmax into a static buffer of that
block, and reads its input ids through a static index into the block: either this replay's
staged ids or the tokens an earlier replay sampled (overlapped decoding, whose next step's ids
are the last step's tokens, in any row order). Such a step costs the device one copy in, the
replay and one copy of the tokens out; its hidden states are kept only when asked
(`keep_hidden`: plain steps between speculative rounds, whose draft reads them to catch up): in
its static buffer until its next replay (a draft that reads only the last plain step's), or,
given a `HiddenRing` (an EAGLE head, which reads every plain step's), written by the graph into
the ring rows from the one row number staged with its inputs (`ForwardBatch.hidden_at`; padded
rows follow the real ones, and a replay given none writes the ring's scratch rows).

A *chain* graph runs a draft model's greedy decode steps back to back in one launch: between
steps it moves the batch on, on the device (positions, write slots gathered from the device
request->token table, the backend's lengths), and feeds each step's argmax (through a draft
vocabulary's token map, or the target ids a subset head gives each row) and hidden state to the
next. A draft whose steps all sit at one position (`drafts_in_place`: the Gemma 4 assistant)
is not moved between steps. The host prepares the chain's first step only, with page tables that
already reach its last; its slots are allocated beforehand.

Verify graphs move too, once, before their forward: a verify launched before the host has read
the round before it (`SpecWorker`) starts each request as many positions further on as that
round accepted, known only on the device (`run(..., ahead=)`); launched normally, it moves by 0.

A batch is padded to the next captured size. Padded rows use the request->token table's
padding row, whose slots are the allocator's scratch pages: they read and write KV only there,
at slots every kernel contract allows, and their logits are dropped. Nothing in a captured
region synchronises with the host.

On a CPU the same code runs with `emulate=True`: "capture" records nothing and "replay" runs
the forward eagerly on the static buffers, so the padding and rewriting logic is tested
everywhere.
"""

from __future__ import annotations

import contextlib
import dataclasses
import gc
import itertools
import logging
import time
from collections.abc import Callable, Iterator, Sequence

import numpy as np
import torch

from attention import ForwardMode, KVPool
from attention.staging import StagedBuffers
from workers.forward_batch import DeviceInputs, ForwardBatch, ForwardOutput, HostInputs
from workers.hidden_ring import HiddenRing
from workers.memory import KVAllocator
from workers.memory.allocator import cdiv

logger = logging.getLogger(__name__)

DEFAULT_BATCH_SIZES = (1, 2, 4, 8, 16, 24, 32, 40, 48, 56, 64, 80, 96, 112, 128, 160, 192, 224, 256)
PADDING_TOKEN = 0


def capture_sizes(max_batch_size: int) -> list[int]:
    """The batch sizes captured: the defaults up to `max_batch_size`, and it."""
    return sorted({*(b for b in DEFAULT_BATCH_SIZES if b < max_batch_size), max_batch_size})


@dataclasses.dataclass(frozen=True)
class GraphKey:
    mode: ForwardMode
    q_len: int
    query_offset: int
    pool: int  # id() of the KV pool captured with
    chain: int = 0  # 0: one forward; n: n greedy draft decode steps in one graph


@dataclasses.dataclass
class _Family:
    """Graphs of one key for every captured batch size and page-table width, sharing static
    outputs (a graph copies its results into them, so the graphs' own temporaries share one
    memory pool). Their inputs are the runner's staged block, which every family shares:
    replays run one at a time on one stream, and each stages all it reads."""

    pool: KVPool
    spec_hidden: torch.Tensor | None
    argmax: bool = False  # a greedy decode graph: tokens into the runner's static tokens, ids through `select`
    keep_hidden: bool = True  # hidden states copied out (an argmax graph's only when asked)
    ring: HiddenRing | None = None  # an argmax graph's: its hidden states written there, not to `hidden`
    logits: torch.Tensor | None = None  # [max rows, vocab] float32
    hidden: torch.Tensor | None = None  # [max rows, hidden handed on]
    ids: torch.Tensor | None = None  # [max rows, columns] the logits' target ids (a subset head's)
    drafts: torch.Tensor | None = None  # chains: [max batch, steps] int64, each step's token
    ahead: torch.Tensor | None = None  # chains, verifies: [max batch] positions each row starts further on
    graphs: dict[tuple[int, int], object] = dataclasses.field(default_factory=dict)  # (batch size, width)
    # rows -> a replay's outputs (logits, ids, hidden states): views of the static outputs, made
    # once (a slice is microseconds of host time; every replay of a size makes the same ones)
    outputs: dict[int, tuple[torch.Tensor, torch.Tensor | None, torch.Tensor | None]] = dataclasses.field(
        default_factory=dict
    )


class CudaGraphRunner:
    def __init__(
        self,
        runner,
        allocator: KVAllocator,
        batch_sizes: Sequence[int],
        max_q_len: int,
        max_pages: int,
        hidden_in: int | None,
        dtype: torch.dtype,
        emulate: bool = False,
    ) -> None:
        """`runner`: the `ModelRunner` whose forwards are captured (its backend's static
        metadata buffers are set up here, `max_pages` page-table columns a request);
        `max_q_len`: the most query tokens a request of any captured graph; `hidden_in`: the
        width of the hidden states a draft head reads per token (None for models that read
        none)."""
        self.runner = runner
        self.allocator = allocator
        self.batch_sizes = sorted(batch_sizes)
        self.max_batch_size = self.batch_sizes[-1]
        # n -> the smallest captured size holding n rows (looked up every replay)
        self._padded_size = [next(b for b in self.batch_sizes if b >= n) for n in range(self.max_batch_size + 1)]
        self.max_q_len = max_q_len
        rows = self.max_batch_size * max_q_len
        self.staging = StagedBuffers(runner.device)
        self.staging.add("inputs", 4 * rows + self.max_batch_size, torch.int64)  # ids|positions|slots|rows|logits
        self.staging.add("select", rows, torch.int64)  # argmax graphs: each input id's word in the block
        self.staging.add("ring_at", 1, torch.int64)  # argmax graphs with a ring: the row of the batch's first
        runner.backend.init_graph_buffers(self.max_batch_size, rows, max_pages, self.staging)
        self.staging.add("tokens", rows, torch.int64)  # never staged: argmax graphs write it
        self.staging.allocate()
        self.tokens = self.staging.view("tokens")
        self._select = self.staging.view("select")
        self._words = self.staging.block.view(torch.int64)
        self._ring_at = self.staging.view("ring_at")
        self._ring_offsets = torch.arange(self.max_batch_size, device=runner.device)  # each row's from the first
        self._counting = np.arange(rows, dtype=np.int64)  # 0, 1, ...: row numbers staged without an array each
        self._padded: dict[tuple[int, int, int], np.ndarray] = {}  # (q_len, query offset, bs) -> all padding
        self._input_views: dict[tuple[GraphKey, int], tuple[torch.Tensor, ...]] = {}  # `_static_batch`'s
        self._token_views: dict[int, torch.Tensor] = {}  # `_tokens_of`'s
        self.hidden_in = hidden_in
        self.dtype = dtype
        self.emulate = emulate
        self.device = runner.device
        self.families: dict[GraphKey, _Family] = {}
        self.mempool = None if emulate else torch.cuda.graph_pool_handle()
        self.capture_seconds = 0.0
        self.replays = 0

    # -- start-up ----------------------------------------------------------------------------
    @torch.inference_mode()
    def capture(
        self,
        mode: ForwardMode,
        q_len: int,
        pool: KVPool,
        query_offset: int = 0,
        hidden_in: int | None = None,
        chain: int = 0,
        argmax: bool = False,
        keep_hidden: bool = False,
        ring: HiddenRing | None = None,
    ) -> None:
        """Capture this key's graphs for every page-table width and batch size (largest first);
        `hidden_in` overrides the width of the hidden states read per token (a draft head's
        catch-up reads the target's, its decode steps its own); `chain`: that many greedy
        draft decode steps in each graph instead of one forward; `argmax`: a greedy decode
        graph (see the module's docstring), which keeps its hidden states if `keep_hidden`, in
        `ring` if given."""
        key = GraphKey(mode, q_len, query_offset, id(pool), chain)
        if key in self.families:
            return
        if chain and (mode != ForwardMode.DECODE or q_len != 1 or argmax):
            raise ValueError(f"cuda graphs: a chain of draft steps is single-token DECODE, not {mode.name} x{q_len}")
        if ring is not None and not (argmax and keep_hidden and q_len == 1):
            raise ValueError("cuda graphs: a hidden ring is for single-token argmax graphs keeping hidden states")
        if ring is not None and ring.slack < self.max_batch_size:
            raise ValueError(
                f"cuda graphs: a hidden ring with {ring.slack} slack rows; a padded batch of up to "
                f"{self.max_batch_size} writes that many"
            )
        if q_len > self.max_q_len:
            raise ValueError(f"cuda graphs: {q_len} query tokens a request, the staged buffers hold {self.max_q_len}")
        if max(q_len, chain) > len(self.allocator.scratch_slots):
            raise ValueError(f"cuda graphs: {max(q_len, chain)} tokens per padded row need more scratch pages")
        rows = self.max_batch_size * q_len
        width = hidden_in or self.hidden_in
        spec_hidden = torch.zeros(rows, width, dtype=self.dtype, device=self.device) if width else None
        family = _Family(pool, spec_hidden, argmax, keep_hidden=not argmax or keep_hidden, ring=ring)
        if argmax:  # written by the graph's last kernel, which takes the argmax too
            vocab = self.runner.model.lm_head.vocab_size
            family.logits = torch.empty(rows, vocab, dtype=torch.float32, device=self.device)
        if chain:
            family.drafts = torch.zeros(self.max_batch_size, chain, dtype=torch.int64, device=self.device)
        if chain or mode == ForwardMode.TARGET_VERIFY:
            family.ahead = torch.zeros(self.max_batch_size, dtype=torch.int64, device=self.device)
        self.families[key] = family
        start = time.perf_counter()
        with contextlib.nullcontext() if self.emulate else _collector_paused():
            for width in reversed(self.runner.backend.graph_table_widths()):
                for bs in reversed(self.batch_sizes):

                    def prepare(bs: int = bs, width: int = width) -> ForwardBatch:
                        return self._prepare(key, family, bs, self._padding(key, bs, 0), width, _reach(key))

                    if self.emulate:
                        prepare()
                    else:
                        family.graphs[(bs, width)] = self._capture_one(key, family, prepare)
        elapsed = time.perf_counter() - start
        self.capture_seconds += elapsed
        logger.info(
            "cuda graphs: %s q_len %d offset %d chain %d captured for batch sizes %s and KV widths %s pages in %.1f s",
            mode.name,
            q_len,
            query_offset,
            chain,
            self.batch_sizes,
            self.runner.backend.graph_table_widths(),
            elapsed,
        )

    def _capture_one(self, key: GraphKey, family: _Family, prepare: Callable[[], ForwardBatch]) -> object:
        """`prepare` rewrites the static inputs and metadata (a chain moves them on as it runs)."""
        stream = torch.cuda.Stream()
        stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(stream):
            for _ in range(2):  # warm up: JIT compilation, allocator, lazy module state
                out = self._forward(key, family, prepare())
        torch.cuda.current_stream().wait_stream(stream)
        rows = self.max_batch_size * key.q_len
        if family.ring is not None:
            family.ring.match(out.hidden)
        if family.hidden is None and family.keep_hidden and family.ring is None:
            family.hidden = torch.empty(rows, out.hidden.shape[-1], dtype=out.hidden.dtype, device=self.device)
        if family.logits is None and not key.chain:
            family.logits = torch.empty(rows, out.logits.shape[-1], dtype=out.logits.dtype, device=self.device)
        if family.ids is None and out.ids is not None and not key.chain:
            family.ids = torch.empty(rows, out.ids.shape[-1], dtype=out.ids.dtype, device=self.device)
        del out
        batch = prepare()
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, pool=self.mempool):
            out = self._forward(key, family, batch)
            if not key.chain and not family.argmax:
                family.logits[: out.logits.shape[0]].copy_(out.logits)
            if family.ids is not None:
                family.ids[: out.ids.shape[0]].copy_(out.ids)
            if family.hidden is not None and not key.chain:
                family.hidden[: out.hidden.shape[0]].copy_(out.hidden)
            self._write_ring(family, out.hidden)
        return graph

    def _write_ring(self, family: _Family, hidden: torch.Tensor) -> None:
        """An argmax graph with a ring: its hidden states into the ring rows from the one staged."""
        if family.ring is not None:
            rows = self._ring_at + self._ring_offsets[: hidden.shape[0]]
            family.ring.buffer.index_copy_(0, rows, hidden)

    def _forward(self, key: GraphKey, family: _Family, batch: ForwardBatch) -> ForwardOutput:
        """What a graph of `key` runs on the static `batch`: one forward, or a chain of greedy
        draft steps, each moving the batch one token on first (unless the draft's steps stay in
        place; no host sync anywhere); a chain keeps its tokens and its first step's hidden
        state (a draft state to go on from)."""
        if not key.chain:
            if family.ahead is not None:  # a verify: rows further on than the host built them
                self._move(key, batch, family.ahead[: batch.batch_size])
            if not family.argmax:
                return self.runner.run_model(batch)
            batch.input_ids = self._words[self._select[: batch.input_ids.shape[0]]]
            return self.runner.run_model(batch, greedy=(family.logits, self.tokens))
        token_map = getattr(self.runner.model, "draft_to_target", None)
        in_place = getattr(self.runner.model, "drafts_in_place", False)
        self._move(key, batch, family.ahead[: batch.batch_size])  # rows further on than the host built them
        for step in range(key.chain):
            if step and not in_place:
                self._move(key, batch, 1)
            out = self.runner.run_model(batch)
            if step == 0:
                if family.hidden is None:  # first run: a warm-up, outside any capture
                    family.hidden = out.hidden.new_empty(self.max_batch_size, out.hidden.shape[-1])
                family.hidden[: batch.batch_size].copy_(out.hidden)
            tokens = out.logits.argmax(dim=-1)
            if out.ids is not None:
                tokens = out.ids.gather(1, tokens[:, None]).squeeze(1)
            elif token_map is not None:
                tokens = token_map[tokens]
            family.drafts[: batch.batch_size, step].copy_(tokens)
            batch.input_ids.copy_(tokens)
            if batch.spec_hidden is not None:
                batch.spec_hidden.copy_(out.hidden)
        return out

    def _move(self, key: GraphKey, batch: ForwardBatch, by: torch.Tensor | int) -> None:
        """Move a batch on, on the device: a chain's one position (the next step), or each row
        (all its `q_len` queries) by its own count (rows whose requests hold that many more
        tokens than the host knew: their KV ends further on too)."""
        per_row = batch.positions.view(-1, key.q_len)
        per_row.add_(by[:, None] if isinstance(by, torch.Tensor) else by)
        if key.query_offset and not isinstance(by, torch.Tensor):  # one more position past the KV end
            batch.query_offset += by
        if not key.query_offset:  # the moved positions' slots
            batch.out_cache_loc.copy_(batch.req_to_token[batch.req_pool_indices[:, None], per_row].view(-1))
        self.runner.backend.advance_decode(batch, by)

    # -- per step ------------------------------------------------------------------------------
    def can_run(self, batch: ForwardBatch, pool: KVPool, chain: int = 0) -> bool:
        q = batch.q_lens_cpu[0] if batch.q_lens_cpu else 0
        return (
            batch.host is not None
            and 0 < batch.batch_size <= self.max_batch_size
            and self._key(batch, pool, chain) in self.families
            and all(n == q for n in batch.q_lens_cpu)
            and len(batch.host.logits_indices) == batch.batch_size * q
        )

    def reads_tables(self, batch: ForwardBatch, pool: KVPool, chain: int = 0) -> bool:
        """Whether the graph for `batch` reads the allocator's device tables: only graphs that
        move their batch on, on the device (chains and verifies); the others take their slots
        and page tables from the host."""
        return self.families[self._key(batch, pool, chain)].ahead is not None

    def run(self, batch: ForwardBatch, pool: KVPool, ahead: torch.Tensor | None = None, most: int = 0) -> ForwardOutput:
        """The logits of every query row (and their target ids, for a subset head), hidden
        states handed on and greedy tokens of `batch`; logits, ids, tokens and an argmax graph's
        hidden states are views valid until this runner's next replay (of that graph, for hidden
        states); argmax graphs keep hidden states only when captured to (with a ring: none here,
        they are in the ring from `batch.hidden_at`), other graphs no tokens (None). `ahead`
        (a verify's; device, `[B]`, at most `most`): each row starts that many positions
        further on, as in `run_chain`."""
        key, family, graph, static = self._stage(batch, pool, 0, most)
        if family.ahead is not None:
            self._set_ahead(family, batch.batch_size, ahead)
        rows = batch.batch_size * key.q_len
        tokens = self._tokens_of(rows) if family.argmax else None
        ring = family.ring
        if self.emulate:  # outputs in static buffers, as a replay leaves them: the next one overwrites them
            out, most = self._forward(key, family, static), self.max_batch_size * key.q_len
            logits = out.logits[:rows] if family.argmax else _static(family, "logits", out.logits, rows, most)
            ids = None if out.ids is None else _static(family, "ids", out.ids, rows, most)
            if ring is not None and not ring.head:  # (before any row is taken)
                ring.match(out.hidden)
            self._write_ring(family, out.hidden)
            hidden = _static(family, "hidden", out.hidden, rows, most) if family.keep_hidden and not ring else None
        else:
            graph.replay()
            outputs = family.outputs.get(rows)
            if outputs is None:
                outputs = family.outputs[rows] = (
                    family.logits[:rows],
                    None if family.ids is None else family.ids[:rows],
                    family.hidden[:rows] if family.keep_hidden and not ring else None,
                )
            logits, ids, hidden = outputs
        if ring is not None:  # a plain step's: in the ring, from the row number it was given
            hidden = None
        elif hidden is not None and not family.argmax:  # an argmax graph's is read before its next replay
            hidden = hidden.clone()
        return ForwardOutput(logits, hidden, tokens, ids)

    def _tokens_of(self, rows: int) -> torch.Tensor:
        """The static tokens of an argmax replay of `rows` rows (a view made once per size)."""
        view = self._token_views.get(rows)
        if view is None:
            view = self._token_views[rows] = self.tokens[:rows]
        return view

    def run_chain(
        self, batch: ForwardBatch, pool: KVPool, steps: int, ahead: torch.Tensor | None = None, most: int = 0
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """`[B, steps]` greedy draft tokens (target ids) and the first step's hidden states,
        `batch` being the chain's first step; `ahead` (device, `[B]`, at most `most`): each row
        starts that many positions further on, its KV that much longer (known only on the
        device when the chain is launched)."""
        key, family, graph, static = self._stage(batch, pool, steps, most)
        self._set_ahead(family, batch.batch_size, ahead)
        if self.emulate:
            self._forward(key, family, static)
        else:
            graph.replay()
        b = batch.batch_size
        return family.drafts[:b].clone(), family.hidden[:b].clone()

    def replayer(
        self,
        mode: ForwardMode,
        q_len: int,
        pool: KVPool,
        query_offset: int = 0,
        chain: int = 0,
        batch_size: int = 1,
    ) -> Callable[[], None]:
        """A replay of this key's graph for `batch_size` rows of padding (in the smallest captured
        size holding them) at the narrowest page-table width, staged anew every call as a step
        stages its batch: what the start-up timing of a round replays."""
        key = GraphKey(mode, q_len, query_offset, id(pool), chain)
        family = self.families[key]
        bs = self._padded_size[batch_size]
        width = min(self.runner.backend.graph_table_widths())
        graph = family.graphs[(bs, width)]

        def replay() -> None:
            self._prepare(key, family, bs, self._padding(key, bs, 0), width, _reach(key))
            graph.replay()

        return replay

    @staticmethod
    def _set_ahead(family: _Family, batch_size: int, ahead: torch.Tensor | None) -> None:
        """Each row's move (padded rows: none)."""
        family.ahead.zero_()
        if ahead is not None:
            family.ahead[:batch_size].copy_(ahead)

    def _stage(
        self, batch: ForwardBatch, pool: KVPool, chain: int, most: int = 0
    ) -> tuple[GraphKey, _Family, object, ForwardBatch]:
        """Write `batch` (padded) and its metadata into the static buffers of its graph; page
        tables reach `most` more positions for batches that start further on."""
        key = self._key(batch, pool, chain)
        family = self.families[key]
        bs = self._padded_size[batch.batch_size]
        reach = _reach(key) + most
        width = self.runner.backend.table_width(cdiv(max(batch.seq_lens_cpu) + reach, self.allocator.page_size))
        static = self._prepare(key, family, bs, self._padding(key, bs, batch.batch_size, batch), width, reach, batch)
        if family.spec_hidden is not None:
            family.spec_hidden[: batch.spec_hidden.shape[0]].copy_(batch.spec_hidden)
        self.replays += 1
        return key, family, family.graphs.get((bs, width)), static

    def _key(self, batch: ForwardBatch, pool: KVPool, chain: int = 0) -> GraphKey:
        q = batch.q_lens_cpu[0] if batch.q_lens_cpu else 0
        return GraphKey(batch.forward_mode, q, batch.query_offset, id(pool), chain)

    def _prepare(
        self,
        key: GraphKey,
        family: _Family,
        bs: int,
        packed: np.ndarray,
        width: int,
        reach: int,
        batch: ForwardBatch | None = None,
    ) -> ForwardBatch:
        """The static batch holding `packed`, with its attention metadata in place: staged and
        uploaded in one copy; device input ids of `batch` (if any) read in place by an argmax
        graph, copied in after the upload otherwise."""
        self.staging.begin()
        static = self._static_batch(key, family, bs, packed)
        self.runner.backend.init_forward_metadata_replay(static, family.pool, width, reach=reach)
        device_ids, select = None, None
        if family.argmax:  # each input id's word in the block: the staged ids'
            select = self.staging.host("select", bs * key.q_len)
            np.add(self._counting[: bs * key.q_len], self.staging.regions["inputs"].offset // 8, out=select)
        if batch is not None and batch.ids_on_device:
            ids, rows = batch.device_ids
            if select is not None and self._in_tokens(ids):  # or the tokens a replay left
                real = ids.shape[0] if rows is None else len(rows)
                select[:real] = ids.storage_offset() + (self._counting[:real] if rows is None else rows)
            else:
                device_ids = batch.device_input_ids()
        if family.ring is not None:  # the ring row of the batch's first row (none: the scratch rows)
            at = batch.hidden_at if batch is not None else None
            self.staging.host("ring_at", 1)[0] = family.ring.scratch if at is None else at % family.ring.capacity
        self.staging.upload()
        if device_ids is not None:
            static.input_ids[: device_ids.shape[0]].copy_(device_ids)
        return static

    def _in_tokens(self, ids: torch.Tensor) -> bool:
        """Whether `ids` are (some of) the tokens an argmax replay left in the static buffer."""
        lo = self.tokens.storage_offset()
        return (
            ids.dtype == torch.int64
            and ids.is_contiguous()
            and ids.untyped_storage().data_ptr() == self.tokens.untyped_storage().data_ptr()
            and lo <= ids.storage_offset() <= lo + self.tokens.numel() - ids.numel()
        )

    def _padding(self, key: GraphKey, bs: int, real: int, batch: ForwardBatch | None = None) -> np.ndarray:
        """The packed static inputs of a batch of `bs` rows whose first `real` come from `batch`
        and the rest are padding (the padding row's scratch slots, positions 0..q-1), then the
        rows' KV lengths (kept on the host): a copy of the all-padding inputs of its shape, made
        once, with the batch's rows written over its first."""
        shape = (key.q_len, key.query_offset, bs)
        padded = self._padded.get(shape)
        if padded is None:
            padded = self._padded[shape] = self._all_padding(key, bs)
        packed = padded.copy()
        if not real:
            return packed
        q, n, host = key.q_len, bs * key.q_len, batch.host
        m, writes = real * q, 0 if key.query_offset else n
        packed[:m] = host.input_ids
        packed[n : n + m] = host.positions  # (read-only queries: the batch's own, already past the KV)
        if writes:
            packed[2 * n : 2 * n + m] = host.out_cache_loc
        rows = 2 * n + writes
        packed[rows : rows + real] = host.req_pool_indices
        packed[rows + bs + n : rows + bs + n + real] = batch.seq_lens_cpu
        return packed

    def _all_padding(self, key: GraphKey, bs: int) -> np.ndarray:
        """`_padding`'s layout with every row padding: ids, positions, slots (none for read-only
        queries, whose positions sit past the KV), rows, logits rows 0..bs*q-1, KV lengths."""
        q = key.q_len
        positions = np.tile(np.arange(q), bs) + key.query_offset
        locs = np.zeros(0) if key.query_offset else np.tile(self.allocator.scratch_slots[:q], bs)
        rows = np.full(bs, self.allocator.req_to_token.padding_row)
        parts = [np.full(bs * q, PADDING_TOKEN), positions, locs, rows, np.arange(bs * q), np.full(bs, q)]
        return np.concatenate(parts).astype(np.int64)

    def _static_batch(self, key: GraphKey, family: _Family, bs: int, packed: np.ndarray) -> ForwardBatch:
        """A ForwardBatch of `bs` rows over the static buffers, holding `packed` (staged)."""
        q, n = key.q_len, bs * key.q_len
        writes = 0 if key.query_offset else n
        sizes = [n, n, writes, bs, n]
        self.staging.host("inputs", packed.size - bs)[:] = packed[:-bs]
        views = self._input_views.get((key, bs))
        if views is None:  # made once per graph: slicing tensors is microseconds of host time a replay
            views = self._input_views[(key, bs)] = self.staging.view("inputs")[: packed.size - bs].split(sizes)
        ids, positions, locs, rows, logits = views
        return ForwardBatch(
            forward_mode=key.mode,
            batch_size=bs,
            q_lens_cpu=[q] * bs,
            seq_lens_cpu=packed[-bs:].tolist(),
            req_to_token=self.allocator.req_to_token.table,
            inputs=DeviceInputs(ids, positions, locs, rows, logits),
            req_to_token_host=self.allocator.req_to_token.host,
            query_offset=key.query_offset,
            attn_backend=self.runner.backend,
            spec_hidden=family.spec_hidden[:n] if family.spec_hidden is not None else None,
            host=HostInputs(*_split(packed, sizes), every_row=True),
        )


def _split(packed: np.ndarray, sizes: list[int]) -> list[np.ndarray]:
    """Consecutive views of `packed` of these sizes."""
    ends = list(itertools.accumulate(sizes))
    return [packed[end - size : end] for size, end in zip(sizes, ends)]


@contextlib.contextmanager
def _collector_paused() -> Iterator[None]:
    """Python's cycle collector off while graphs are captured: a collection inside a capture
    could free CUDA objects of unreachable engines (graphs, events, pinned host blocks), whose
    release calls the driver in a way a capturing stream does not permit. Collected first (a
    collection takes about half a second with torch loaded: emulated captures, which record
    nothing, skip it)."""
    was_enabled = gc.isenabled()
    gc.collect()
    gc.disable()
    try:
        yield
    finally:
        if was_enabled:
            gc.enable()


def _reach(key: GraphKey) -> int:
    """Tokens a graph's KV grows by after its first forward: a chain writing KV reads one more
    key at each step, so its page tables are built to cover them."""
    return key.chain - 1 if key.chain and not key.query_offset else 0


def _static(family: _Family, name: str, out: torch.Tensor, rows: int, most: int) -> torch.Tensor:
    """An emulated replay's output `name` copied into the family's static buffer (allocated at
    the first replay, `most` rows): its first `rows` rows, a view."""
    buffer = getattr(family, name)
    if buffer is None:
        buffer = out.new_empty(most, *out.shape[1:])
        setattr(family, name, buffer)
    return buffer[:rows].copy_(out[:rows])
