"""The in-process engine: one model on one device, continuous batching, Python API.

eng = Engine(model="path/to/hf_dir", device="cpu", dtype="float32", page_size=16,
             attention_backend="torch_native", max_total_tokens=8192)
outs = eng.generate(prompt_token_ids=[[...]], sampling=SamplingParams(max_new_tokens=32, temperature=0.0))
for delta in eng.stream(prompt_token_ids=[...], sampling=...): ...
eng.shutdown()
"""

from __future__ import annotations

import dataclasses
import itertools
import logging
import random
import threading
import time
from collections.abc import Iterator, Mapping, Sequence
from typing import Any

import torch

from attention import ForwardMode
from workers.cuda_graphs import CudaGraphRunner, capture_sizes
from workers.distributed import SINGLE_RANK, AllReduce, TPGroup
from workers.grammar import Compilation, GrammarCompiler, Matcher
from workers.grammar_masks import GrammarMasks
from workers.logprobs import Logprobs, of_rows
from workers.memory import HybridSWAAllocator, KVAllocator, ReqToTokenPool
from workers.memory.allocator import cdiv
from workers.memory.kv_write import resolve_kv_cache_dtype
from workers.model_runner import ModelRunner
from workers.models import load_model_config
from workers.models.config import MoEParallel, with_moe_parallel, with_quantization
from workers.models.decoder import RotaryTables
from workers.overlap import InFlight, OverlapDecoder
from workers.processors import TokenCounts
from workers.radix_cache import RadixCache
from workers.request import FinishReason, Request
from workers.sampler import draw_each
from workers.sampling_params import SamplingParams, choice_seed
from workers.scheduler import ScheduledBatch, Scheduler
from workers.speculative import SpecConfig, SpecStats
from workers.speculative.controller import AdaptiveDraftSteps, RelayedDraftSteps
from workers.speculative.cost_model import CostModel
from workers.speculative.loader import build_drafter, plan_draft
from workers.speculative.round_timing import time_rounds
from workers.speculative.worker import SpecWorker
from workers.startup import StartupProgress
from workers.step_record import ForwardRecord, StepRecord
from workers.tokenizer import load_tokenizer, unicode_problem

__all__ = ["Engine", "RequestOutput", "SamplingParams"]

logger = logging.getLogger(__name__)

MAX_FAILED_STEPS = 3  # consecutive steps whose forward raised before the engine gives up
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}

# Engine options the application settings lack, and what the Engine takes beyond a setting of the
# same name; `cluster.config.EngineArgs` describes the settings. docs/configuration.md lists every
# option from both (`python -m ops.config_docs`).
ENGINE_OPTIONS: dict[str, str] = {
    "model": "the Engine takes a directory (the application resolves shipped model names)",
    "device": 'the Engine also takes a torch.device; "cuda" is the current CUDA device',
    "speculative": "the Engine takes a mapping of the speculative options, named without the prefix "
    '({"algorithm": "eagle", "draft_model": ...}; checked by `workers.speculative.SpecConfig`)',
    "tp": "this rank's tensor-parallel group (`workers.distributed.TPGroup`): every rank of it builds an Engine "
    "with the same arguments and steps in lockstep (`workers.rank_loop`); the application builds one per "
    "replica of tp_size ranks",
    "cuda_graphs": 'the Engine also takes "emulate": the replay logic run eagerly on any device, for tests',
    "overlap_schedule": "launch each greedy decode step before the previous one's tokens reach the host "
    "(`workers/overlap.py`), so that the host's bookkeeping overlaps the GPU; a step's events then come one "
    "step later; None: on with CUDA",
}


@dataclasses.dataclass
class RequestOutput:
    request_id: str
    prompt_token_ids: list[int]
    token_ids: list[int]  # generated tokens only
    finish_reason: str | None
    text: str | None = None
    logits: list[torch.Tensor] | None = None  # per generated token, when return_logits
    logprobs: Logprobs | None = None  # per generated token, when sampling.logprobs is set
    prompt_logprobs: Logprobs | None = None  # per prompt token after the first, when sampling.prompt_logprobs is set
    spec: SpecStats | None = None  # speculative decoding record (accept lengths, per position)
    error: str | None = None  # why the request failed, when finish_reason is "error"
    cached_tokens: int = 0  # prompt tokens whose KV came from the prefix cache
    queue_s: float | None = None  # seconds from arrival at the engine to admission (KV reserved)
    prefill_s: float | None = None  # seconds from admission to the first generated token


class Engine:
    def __init__(
        self,
        model: str,
        device: str = "cpu",
        dtype: str = "auto",
        kv_cache_dtype: str = "auto",
        quantization: str | None = None,
        page_size: int = 16,
        attention_backend: str | None = None,
        max_total_tokens: int = 8192,
        swa_full_tokens_ratio: float = 0.8,
        chunked_prefill_size: int | None = 2048,
        max_running_requests: int = 64,
        context_length: int | None = None,
        load_format: str = "auto",
        seed: int = 0,
        debug_kv_checks: bool = False,
        speculative: Mapping[str, Any] | None = None,
        tp: TPGroup = SINGLE_RANK,
        tp_all_reduce: AllReduce = "nccl",
        moe_parallel: MoEParallel = "tensor",
        cuda_graphs: bool | str = True,
        cuda_graph_max_batch_size: int | None = None,
        overlap_schedule: bool | None = None,
        enable_prefix_caching: bool = True,
        warmup: bool | None = None,
    ) -> None:
        """The options' meanings: `cluster.config.EngineArgs` and `ENGINE_OPTIONS` (one place each,
        so that docs/configuration.md is generated from them)."""
        self.startup = StartupProgress(f"rank {tp.rank}" if tp.size > 1 else "engine")
        self.device = torch.device(device)
        if self.device.type == "cuda" and not torch.cuda.is_available():
            raise ValueError(f"device: {device!r}, but torch sees no CUDA device (a CPU build, or no GPU visible)")
        self.dtype = _resolve_dtype(dtype, self.device)
        self.kv_dtype = resolve_kv_cache_dtype(kv_cache_dtype, self.dtype, self.device)
        for name, value, least in (
            ("page_size", page_size, 1),
            ("chunked_prefill_size", chunked_prefill_size, 1),  # None: off
            ("max_running_requests", max_running_requests, 1),
            ("context_length", context_length, 2),  # a prompt token and a new one; None: the model's
            ("cuda_graph_max_batch_size", cuda_graph_max_batch_size, 1),  # None: max_running_requests
        ):
            if value is not None and value < least:
                raise ValueError(f"{name}: must be >= {least}, got {value}")
        if not 0.0 < swa_full_tokens_ratio <= 1.0:
            raise ValueError(f"swa_full_tokens_ratio: must be in (0, 1], got {swa_full_tokens_ratio}")
        self.cfg = with_moe_parallel(with_quantization(load_model_config(model), quantization), moe_parallel)
        self.context_length = resolve_context_length(self.cfg, context_length, max_total_tokens)
        self.tokenizer = load_tokenizer(model)
        spec = SpecConfig.from_dict(speculative) if speculative is not None else None
        draft = plan_draft(spec, self.cfg, self.context_length) if spec is not None else None
        self.overlap = overlap_schedule if overlap_schedule is not None else self.device.type == "cuda"
        # Positions a step may hold past the next token: a speculative round's drafts, or the
        # one decode step launched ahead when overlapping.
        lookahead = spec.num_steps + 1 if spec is not None else int(self.overlap)

        full_pages = max_total_tokens // page_size
        if full_pages < 1:
            raise ValueError(f"max_total_tokens: {max_total_tokens} is less than one page of {page_size}")
        self.req_to_token = ReqToTokenPool(max_running_requests, self.context_length + lookahead, self.device)
        # One allocator for target and draft, keeping SWA slots for the widest window either
        # model keeps in an SWA pool.
        windows = [w for w in (self.cfg.max_window, draft.swa_window if draft else None) if w is not None]
        window = max(windows, default=None)
        backend = attention_backend or ("trtllm_mha" if self.device.type == "cuda" else "torch_native")
        graphs = _graph_mode(cuda_graphs, self.device, backend)
        if graphs is True and debug_kv_checks:  # the checks read tensors on the host: not inside a graph
            logger.info("cuda graphs: off while debug_kv_checks is on")
            graphs = False
        scratch = cdiv(lookahead or 1, page_size) if graphs else 0  # what padded graph rows write
        if window is not None:
            swa_pages = max(1, round(full_pages * swa_full_tokens_ratio))
            self.allocator: KVAllocator = HybridSWAAllocator(
                self.req_to_token, full_pages, swa_pages, page_size, window, scratch
            )
        else:
            self.allocator = KVAllocator(self.req_to_token, full_pages, page_size, scratch)
        self.tp = tp
        if tp_all_reduce == "one_shot":
            tp.use_one_shot_all_reduce(self.dtype, self.device)
        elif tp_all_reduce != "nccl":
            raise ValueError(f"tp_all_reduce: 'nccl' or 'one_shot', got {tp_all_reduce!r}")
        with self.startup.phase("target weights", f"{self.cfg.architecture}, {self.dtype}, {self.device}"):
            self.runner = ModelRunner.load(
                self.cfg,
                model,
                self.allocator,
                backend,
                self.dtype,
                self.device,
                load_format,
                tp=tp,
                seed=seed,
                debug_kv_checks=debug_kv_checks,
                kv_dtype=self.kv_dtype,
            )
        self.scheduler = Scheduler(
            self.allocator,
            self.req_to_token,
            chunked_prefill_size,
            max_running_requests,
            self.cfg.eos_token_ids,
            lookahead,
            token_counts=TokenCounts(self.cfg.vocab_size, max_running_requests, self.device),
            # a mask per request row and verify position (the drafts before it: 0..num_steps)
            grammar_masks=GrammarMasks(
                self.cfg.vocab_size, max_running_requests, spec.num_steps + 1 if spec else 1, self.device
            ),
        )
        self.last_step = StepRecord()
        self.spec: SpecWorker | None = None
        if draft is not None:
            draft_tp = tp if spec.draft_tp == "shard" else SINGLE_RANK
            with self.startup.phase("draft weights", spec.algorithm):
                drafter = build_drafter(
                    draft,
                    self.runner,
                    self.allocator,
                    self.scheduler,
                    backend,
                    self.dtype,
                    self.device,
                    tp=draft_tp,
                    seed=seed,
                    debug_kv_checks=debug_kv_checks,
                    kv_dtype=self.kv_dtype,
                )
            drafter.runner.recorder = self._record
            self.spec = SpecWorker(spec.num_steps, self.runner, drafter, self.scheduler)
        self.adaptive = spec is not None and spec.adaptive  # draft lengths chosen per step
        if self.adaptive and self.spec.drafter.runner.pool is not None and self.spec.drafter.runner.pool.has_swa:
            # a draft behind by plain decode steps catches up reading its SWA window from there
            self.scheduler.window_from = lambda req: min(req.kv_len, req.spec.draft_len)
            self.scheduler.windows_moved = self.spec.windows_moved
            self.scheduler.draft_lag = self.spec.reserved_lag
        self.cache: RadixCache | None = None
        if enable_prefix_caching:
            shift = self.spec.drafter.shift if self.spec is not None else 0
            self.cache = self.scheduler.cache = RadixCache(self.allocator, shift)
            if self.spec is not None and self.spec.drafter.runner.pool is not None:  # the draft's own KV too
                self.scheduler.cacheable_len = lambda req: min(req.kv_len, req.spec.draft_len)
        self.runner.recorder = self._record
        runners = [self.runner] + ([self.spec.drafter.runner] if self.spec is not None else [])
        for module in (m for runner in runners for m in runner.model.modules()):
            if isinstance(module, RotaryTables):  # every position a forward may hold
                module.cover(self.req_to_token.max_context_len)
        # KV bytes a slot of each pool holds on this rank: the layers that store KV, target and
        # draft (whose entries live at the target's slots); layers reading another's hold none.
        pools = [runner.pool.kv_bytes for runner in runners if runner.pool is not None]
        self.kv_slot_bytes = {space: sum(p[space] for p in pools) for space in ("full", "swa")}
        self._requests: dict[str, Request] = {}
        self._grammars: GrammarCompiler | None = None  # built on the first structured-output request
        self._grammars_lock = threading.Lock()
        self._overlap = OverlapDecoder(self.scheduler, self.runner.forward)
        self._inflight: InFlight | None = None
        self._decode_end_ns: int | None = None  # when the decode step last told to the controller ended
        self._disturbances = 0  # the speculative worker's count when the work that step read last was launched
        self._inflight_disturbances = 0  # its count when the step in flight was launched
        if warmup if warmup is not None else self.device.type == "cuda":
            self._rng, self._ids, self.failed_steps = random.Random(seed), itertools.count(), 0
            self._warm_up()
        graph_sizes = capture_sizes(min(cuda_graph_max_batch_size or max_running_requests, max_running_requests))
        if graphs:
            self._capture_graphs(graphs == "emulate", graph_sizes[-1])
        if self.adaptive:  # after the warm-up and the capture: their steps would teach it nothing
            costs = CostModel(sorted({*capture_sizes(max_running_requests), *graph_sizes}), spec.num_steps)
            if graphs is True:
                with self.startup.phase("rounds timed", f"k in 0..{spec.num_steps} x {len(graph_sizes)} batch sizes"):
                    for (size, k), seconds in time_rounds(self.runner, self.spec.drafter, spec.num_steps).items():
                        costs.set_prior(size, k, seconds)
            # a tensor-parallel group runs what rank 0's controller chose (its step plan carries it)
            lead = AdaptiveDraftSteps(costs, leases=tp.size == 1)
            self.spec.controller = lead if tp.size == 1 else RelayedDraftSteps(lead, spec.num_steps)
        self._rng = random.Random(seed)
        self._ids = itertools.count()
        self.failed_steps = 0  # consecutive steps whose forward raised
        self.last_step = StepRecord()
        logger.info(
            "engine: %s on %s/%s, backend %s, KV %s %s, speculative %s",
            self.cfg.architecture,
            self.device,
            self.dtype,
            backend,
            self.kv_dtype,
            self.kv_stats(),
            f"{spec.algorithm} x{'0..' if spec.adaptive else ''}{spec.num_steps} ({draft.pool_kind} draft pool)"
            if spec
            else "off",
        )
        self.startup.ready()

    def _warm_up(self) -> None:
        """Compile the kernels every forward kind uses (flashinfer builds its attention kernels
        and Triton its own on first use: minutes on a fresh GPU) with one short greedy request,
        so that no client's first request pays for them; its pages leave the prefix cache."""
        rounds = 2 * (self.spec.num_steps + 1 if self.spec is not None else 1)  # a whole round, then some
        prompt = [0] * max(1, min(16, self.context_length // 4))
        new = max(1, min(rounds + 1, self.context_length - len(prompt) - 1))
        sampling = SamplingParams(max_new_tokens=new, temperature=0.0, ignore_eos=True, seed=0)
        kinds = ["prefill", "speculative round" if self.spec is not None else "decode"]
        with self.startup.phase("kernels compiled", "one short request"):
            rid = self.add_request(prompt, sampling, request_id="startup-warmup")
            for done, kind in enumerate(kinds, 1):
                self.step()
                self.startup.step("kernels compiled for", done, len(kinds), kind)
            while not self._requests[rid].finished:
                self.step()
            if self._requests[rid].error is not None:
                raise RuntimeError(f"start-up warm-up request failed: {self._requests[rid].error}")
            self.release(rid)
            self.flush_cache()

    def _capture_graphs(self, emulate: bool, max_batch_size: int) -> None:
        """Capture the target's decode (or verify), the draft's decode steps (one by one for
        sampled rounds, chained for greedy ones) and its catch-up over the verified window; with
        adaptive draft lengths, the verifies, catch-ups and chains of every k <= num_steps and
        the target's plain decode step (docs/design.md §6.1)."""
        sizes = capture_sizes(max_batch_size)
        k = self.spec.num_steps if self.spec is not None else 0
        max_q = k + 1 if self.spec is not None else 1
        max_pages = cdiv(self.req_to_token.max_context_len, self.allocator.page_size)
        used = torch.cuda.memory_allocated(self.device) if self.device.type == "cuda" else 0

        def graphs_for(runner: ModelRunner, hidden_in: int | None) -> CudaGraphRunner:
            graphs = CudaGraphRunner(runner, self.allocator, sizes, max_q, max_pages, hidden_in, self.dtype, emulate)
            runner.enable_graphs(graphs)
            return graphs

        # (graphs, capture arguments, what it is): the families to capture, in order
        target = graphs_for(self.runner, None)
        plan: list[tuple[CudaGraphRunner, tuple, dict[str, Any], str]] = []
        if self.spec is None:
            plan.append((target, (ForwardMode.DECODE, 1, self.runner.pool), {"argmax": True}, "target decode"))
        else:
            drafter = self.spec.drafter
            ks = range(1, k + 1) if self.adaptive else [k]  # the draft lengths a round may run
            if self.adaptive:  # plain decode steps between rounds keep the hidden states a draft catches up from
                ring = self.spec.keep_in_ring(self.dtype)
                kwargs = {"argmax": True, "keep_hidden": drafter.reads_hidden, "ring": ring}
                plan.append((target, (ForwardMode.DECODE, 1, self.runner.pool), kwargs, "target decode"))
            for n in ks:
                plan.append((target, (ForwardMode.TARGET_VERIFY, n + 1, self.runner.pool), {}, f"target verify x{n}"))
            head = drafter.runner.model  # the state its steps read: its own width, or the target's (an assistant's)
            draft = graphs_for(
                drafter.runner, getattr(head, "handed_on_size", head.cfg.hidden_size) if drafter.reads_hidden else None
            )
            frozen = drafter.runner.pool is None
            if frozen:  # the target's pool, one offset per draft step (one for drafts in place)
                for offset in sorted({drafter.query_offset(j) for j in range(1, k + 1)}):
                    plan.append((draft, (ForwardMode.DECODE, 1, self.runner.pool, offset), {}, f"draft step {offset}"))
            else:
                plan.append((draft, (ForwardMode.DECODE, 1, drafter.runner.pool), {}, "draft decode"))
                reads = self.runner.model.handed_on_size if drafter.reads_hidden else None
                for n in ks:
                    args = (ForwardMode.DRAFT_EXTEND_V2, n + 1, drafter.runner.pool)
                    plan.append((draft, args, {"hidden_in": reads}, f"draft catch-up x{n}"))
            for n in (n for n in ks if n > 1):  # greedy rounds: drafts 2..n in one graph
                offset = drafter.query_offset(2) if frozen else 0
                args = (ForwardMode.DECODE, 1, drafter.step_pool, offset)
                plan.append((draft, args, {"chain": n - 1}, f"draft steps 2..{n} chained"))
                if frozen:  # steps 1..n, launched a round ahead
                    args = (ForwardMode.DECODE, 1, drafter.step_pool, 1)
                    plan.append((draft, args, {"chain": n}, f"draft round of {n} ahead"))
        per_family = len(sizes) * len(self.runner.backend.graph_table_widths())
        with self.startup.phase("graphs captured", f"{len(plan)} kinds x {per_family} batch sizes and KV widths"):
            for done, (graphs, args, kwargs, what) in enumerate(plan, 1):
                graphs.capture(*args, **kwargs)
                self.startup.step("graphs captured", done * per_family, len(plan) * per_family, what)
        seconds = sum({id(g): g.capture_seconds for g, *_ in plan}.values())
        if self.device.type == "cuda":
            grown = (torch.cuda.memory_allocated(self.device) - used) / 2**20
            logger.info("cuda graphs: batch sizes %s captured in %.1f s, %.0f MiB", sizes, seconds, grown)

    # -- request lifecycle -------------------------------------------------------------
    def add_request(
        self,
        prompt_token_ids: Sequence[int],
        sampling: SamplingParams | None = None,
        request_id: str | None = None,
        grammar: Any = None,
        follows: str | None = None,
    ) -> str:
        """`grammar`: its structured outputs compiled already (`start_grammar`); otherwise they
        are compiled here, waiting for it. `follows`: the id of another choice of the same
        prompt, added before: this one waits to be admitted until that one has prefilled the
        prompt, then starts on its pages in the prefix cache (one prefill for n choices; no
        wait when that request is gone or its prompt differs)."""
        req = self._make_request(
            prompt_token_ids, sampling or SamplingParams(), request_id, "prompt_token_ids", grammar
        )
        leader = self._requests.get(follows) if follows is not None else None
        if leader is not None and not leader.finished and leader.prompt_ids == req.prompt_ids:
            req.leader = leader
        self._requests[req.rid] = req
        self.scheduler.add(req)
        return req.rid

    def add_choices(
        self, prompt_token_ids: Sequence[int], sampling: SamplingParams, n: int, request_id: str | None = None
    ) -> list[str]:
        """n choices of one prompt, prefilled once and forked (`add_request`'s `follows`): ids
        `request_id`, `request_id-1`, ...; choice i seeded `seed + i` when a seed is given (as
        vLLM); only choice 0 computes the prompt's logprobs, which are every choice's."""
        first = self.add_request(prompt_token_ids, sampling, request_id)
        rest = dataclasses.replace(sampling, prompt_logprobs=None)
        return [first] + [
            self.add_request(
                prompt_token_ids,
                dataclasses.replace(rest, seed=choice_seed(sampling.seed, i)),
                f"{first}-{i}",
                follows=first,
            )
            for i in range(1, n)
        ]

    def check_request(self, prompt: Sequence[int], sampling: SamplingParams, field: str = "prompt_token_ids") -> None:
        """Raise ValueError naming the field if this request could never run; changes nothing,
        so a front end may call it from another thread before queuing the request."""
        self._validate(list(prompt), sampling, field)
        if sampling.structured_outputs is not None:
            self._grammar_compiler()

    def start_grammar(self, sampling: SamplingParams, bounded: bool = True) -> Compilation | None:
        """Start compiling the request's structured outputs off this thread (None: it has none);
        thread-safe. `bounded`: with the compile time bound."""
        if sampling.structured_outputs is None:
            return None
        return self._grammar_compiler().start(sampling.structured_outputs, bounded)

    def _grammar_compiler(self) -> GrammarCompiler:
        with self._grammars_lock:
            if self._grammars is None:
                if self.tokenizer is None:
                    raise ValueError("structured_outputs: this model directory has no tokenizer to compile them for")
                cfg = self.cfg
                if not cfg.eos_token_ids:
                    raise ValueError(
                        "structured_outputs: this model has no stop token (eos_token_id) to end a grammar on"
                    )
                self._grammars = GrammarCompiler.of_tokenizer(self.tokenizer, cfg.vocab_size, cfg.eos_token_ids)
            return self._grammars

    def _validate(self, prompt: list[int], sampling: SamplingParams, field: str) -> int:
        """The request's maximum length, after checking it."""
        sampling.validate()
        if not prompt:
            raise ValueError(f"{field}: empty prompt")
        vocab = self.cfg.vocab_size
        bad = [t for t in prompt if not isinstance(t, int) or isinstance(t, bool) or not 0 <= t < vocab]
        if bad:
            raise ValueError(f"{field}: token ids {bad[:5]} outside the vocabulary [0, {vocab})")
        problem = sampling.vocabulary_problem(vocab)
        if problem is not None:
            raise ValueError(problem)
        if len(prompt) >= self.context_length:
            raise ValueError(
                f"{field}: prompt of {len(prompt)} tokens leaves no room in the context length {self.context_length}"
            )
        max_len = min(len(prompt) + sampling.max_new_tokens, self.context_length)
        self.scheduler.check_fits(len(prompt), max_len)
        return max_len

    def _make_request(
        self, prompt: Sequence[int], sampling: SamplingParams, rid: str | None, field: str, grammar: Any = None
    ) -> Request:
        prompt = list(prompt)
        max_len = self._validate(prompt, sampling, field)
        rid = rid if rid is not None else f"req-{next(self._ids)}"
        if rid in self._requests:
            raise ValueError(f"request_id: {rid!r} is already in use")
        if sampling.structured_outputs is not None and grammar is None:
            # bounded on rank 0 (and alone); the other ranks follow its decision however long it takes
            grammar = self.start_grammar(sampling, bounded=self.tp.rank == 0).result()
        seed = sampling.seed if sampling.seed is not None else self._rng.getrandbits(63)
        generator = torch.Generator(device=self.device).manual_seed(seed)
        req = Request(rid, prompt, sampling, generator, max_len)
        if grammar is not None:
            req.grammar = Matcher(grammar)
        if sampling.logprobs is not None:
            req.logprobs = Logprobs()
        if sampling.prompt_logprobs is not None:
            req.prompt_logprobs = Logprobs()
        if self.spec is not None:
            self.spec.add_request(req)
        return req

    def abort(self, request_id: str) -> bool:
        """Stop a request and free its KV now. Returns False when it is unknown or done."""
        req = self._requests.get(request_id)
        if req is None or req.finished:
            return False
        if self.spec is not None:  # its plain decode steps, counted before it ends
            self.spec.settle(req)
        self.scheduler.finish(req, FinishReason.ABORT)
        return True

    def step(self) -> list[tuple[str, list[int], bool]]:
        """Run one scheduler step; returns (request id, new token ids, finished) per request.

        A request whose own processing raises (its sampling, its verification) ends with finish
        reason "error" and the rest of the batch goes on. When the forward itself raises, the
        batch's requests fail and the engine goes on, unless it is one rank of several (the
        ranks may have diverged) or steps keep failing: then the exception propagates."""
        self.last_step = StepRecord(start_ns=time.time_ns())
        if self._inflight is not None:
            return self._overlapped_step()
        sb = self.scheduler.schedule()
        if sb is None:
            return []
        k = self.spec.draft_steps(sb.reqs) if self.spec is not None and sb.mode is ForwardMode.DECODE else None
        self.last_step.draft_steps = k
        launched = self.spec.disturbances if self.spec is not None else 0
        if self.overlap and not k and self._overlap.eligible(sb):
            launch = self._overlap.launch(sb.reqs, None, self._hidden_at(len(sb.reqs)))
            self._inflight, self._inflight_disturbances = launch, launched
            self._overlap.choose(self._inflight)
            return self._end_step(sb.reqs, [], timing="launch")
        try:
            events = self._run(sb, k)
            self.failed_steps = 0
        except Exception as exc:
            self.failed_steps += 1
            if self.tp.size > 1 or self.failed_steps >= MAX_FAILED_STEPS:
                raise
            logger.exception("step failed; failing its %d request(s)", len(sb.reqs))
            for req in sb.reqs:
                self.scheduler.fail(req, f"the batch's forward failed: {type(exc).__name__}: {exc}")
            events = []
            self.last_step.draft_steps = None
        self.scheduler.release_windows(sb.reqs)
        # what the step read last: a round's verify, after the draft caught up; a plain step's
        # forward, before the draft catches up after it
        read = self.spec.disturbances_read if k else launched
        return self._end_step(sb.reqs, events, read=read)

    def _overlapped_step(self) -> list[tuple[str, list[int], bool]]:
        """Launch the next decode step if nothing else waits, then commit the one in flight."""
        flight, self._inflight = self._inflight, None
        read = self._inflight_disturbances
        live = [r for r in flight.reqs if not r.finished]  # the others ended (and were reported) already
        following = self._overlap.can_continue(flight)
        if following and self.spec is not None and self.spec.draft_steps(following):
            following = []  # the next step drafts: the pipeline drains first
        hidden = flight.hidden  # kept before the next replay
        if hidden is not None and self.spec is not None:
            hidden = self.spec.hold(hidden)
        if following:
            self._inflight_disturbances = self.spec.disturbances if self.spec is not None else 0
            self._inflight = self._overlap.launch(following, flight, self._hidden_at(len(following)))
            self.last_step.draft_steps = 0 if self.spec is not None else None
        events = self._overlap.collect(flight)
        if self._inflight is not None:  # its grammar masks follow the tokens just committed
            self._overlap.choose(self._inflight)
        if self.spec is not None:
            self.spec.after_plain(flight.reqs, hidden, flight.hidden_at)
        self.scheduler.release_windows(live)
        return self._end_step(live, events, timing="step" if following else "drain", read=read)

    def _end_step(
        self, reqs: list[Request], events: list[tuple[Request, list[int]]], timing: str = "step", read: int = 0
    ) -> list[tuple[str, list[int], bool]]:
        """Close the step's record; a decode step of a speculative engine tells the controller
        (`_tell_controller`) what it ran (`read`: the speculative worker's count of disturbances
        when the work the step read last was launched)."""
        step = self.last_step
        step.request_ids = [r.rid for r in reqs]
        step.seq_lens = [r.num_tokens for r in reqs]
        step.cached_tokens = [r.cached_tokens for r in reqs]
        step.end_ns = time.time_ns()
        if self.spec is not None:
            self._tell_controller(len(reqs), step, timing, read)
        reported = {req.rid for req, _ in events}
        return [(req.rid, new, req.finished) for req, new in events] + [
            (req.rid, [], True) for req in reqs if req.finished and req.rid not in reported
        ]

    def _tell_controller(self, batch_size: int, step: StepRecord, timing: str, read: int) -> None:
        """Tell the controller the draft steps a decode step ran and how long it took: from the
        end of the decode step told before, so that whatever runs between steps (a rank loop's
        plan and hand-over) counts per step, as it costs; clean when the speculative worker ran
        nothing besides (`SpecWorker.disturbances`) since the work that the step before read last
        was launched (`read`, its count then): on a GPU, work launched after a step's last read
        runs in the time of the step that next reads past it, so a catch-up after an overlapped
        plain step, launched behind the next step in flight, holds up the step after that one.
        `timing`: "step"; "launch", a plain step launched alone, whose time goes with the next
        step's (the one that commits its tokens; a round launched ahead and dropped before it
        too); "drain", the commit of the last plain step launched, with nothing launched after
        it: a plain step's time, not told, the next step's counted from its end."""
        if timing == "launch":
            return
        if step.draft_steps is None and timing != "drain":  # no decode step: the next one's time is unknown
            self._decode_end_ns = None
            return
        if timing == "step":
            before = self._decode_end_ns
            seconds = (step.end_ns - before) / 1e9 if before is not None else None
            clean = self.spec.disturbances == self._disturbances
            lease = self.spec.lease  # a leased plain step's time: kept for the controller's next look
            leased = lease.seconds is not None and batch_size == lease.batch_size and step.draft_steps == 0
            if leased and clean and seconds is not None:
                lease.seconds.append(seconds)
            else:
                self.spec.controller.observe(batch_size, step.draft_steps, seconds, clean)
        self._decode_end_ns, self._disturbances = step.end_ns, read

    def _run(self, sb: ScheduledBatch, k: int | None) -> list[tuple[Request, list[int]]]:
        """One forward (or a speculative round of `k` draft steps) and its commits."""
        if k:
            events = self.spec.decode_round(sb.reqs, k)
            self.last_step.accept_lengths = self.spec.last_accept_lengths
            self.last_step.drafts = self.spec.last_drafts
            return events
        batch = self.scheduler.build(sb)
        if sb.mode is ForwardMode.DECODE:
            batch.hidden_at = self._hidden_at(batch.batch_size)
        out = self.runner.forward(batch)
        rows = self.scheduler.logit_rows(sb)
        ends = list(itertools.accumulate(len(r) for r in rows))  # each request's logits rows end there
        sampled = [r for r, s in zip(sb.reqs, sb.samples) if s]
        if sb.mode is ForwardMode.EXTEND and any(r.prompt_logprobs is not None for r in sb.reqs):
            self._prompt_logprobs(sb, rows, ends, out.logits)
        picks = [end - 1 for end, s in zip(ends, sb.samples) if s]
        logits = out.logits if picks == list(range(ends[-1] if ends else 0)) else out.logits[picks]
        drawn, errors = draw_each(
            logits,
            [r.sampling for r in sampled],
            [r.generator for r in sampled],
            self.scheduler.history(sampled),
            logprobs=True,
        )
        for i, exc in errors.items():
            self.scheduler.fail(sampled[i], exc)
        for req, row, lp in zip(sampled, logits, drawn.logprobs):
            if req.finished:
                continue
            if req.sampling.return_logits:  # a copy: graphs rewrite their rows
                req.logits.append(row.to("cpu", copy=True))
            if lp is not None:
                req.logprobs.extend(lp)
        live = [(r, n, s) for r, n, s in zip(sb.reqs, sb.q_lens, sb.samples) if not r.finished]
        events = self.scheduler.process(
            ScheduledBatch(sb.mode, [r for r, _, _ in live], [n for _, n, _ in live], [s for _, _, s in live]),
            [t for t in drawn.tokens if t is not None],
        )
        if self.spec is not None and sb.mode is ForwardMode.DECODE:
            self.spec.after_plain(sb.reqs, self.spec.hold(out.hidden), batch.hidden_at)
        elif self.spec is not None:
            self.spec.after_extend(sb, out.hidden)
        if sb.mode is ForwardMode.EXTEND:
            self.scheduler.cache_prompts(sb.reqs)
        return events

    def _hidden_at(self, rows: int) -> int | None:
        """Where a plain decode step of `rows` requests keeps its target hidden states for the
        draft: the ring row number of its first (None: no ring)."""
        ring = self.spec.ring if self.spec is not None else None
        return ring.take(rows) if ring is not None else None

    def _prompt_logprobs(self, sb: ScheduledBatch, rows: list[range], ends: list[int], logits: torch.Tensor) -> None:
        """The logprobs of the prompt tokens this prefill chunk predicts: its row at position p
        gives the model's log_softmax for the prompt token at p + 1 (the last prompt position's
        row samples the first generated token instead)."""
        picks, tokens, ks, owners = [], [], [], []
        for req, n, r, end in zip(sb.reqs, sb.q_lens, rows, ends):
            if req.prompt_logprobs is None or req.finished:
                continue
            first = end - len(r)  # the logits row of the chunk's first position, req.kv_len
            count = min(n, len(req.prompt_ids) - 1 - req.kv_len)  # positions whose next token is a prompt token
            picks += range(first, first + count)
            tokens += req.prompt_ids[req.kv_len + 1 : req.kv_len + 1 + count]
            ks += [req.sampling.prompt_logprobs] * count
            owners.append((req, count))
        got = of_rows(logits[picks], tokens, ks) if picks else Logprobs()
        start = 0
        for req, count in owners:
            req.prompt_logprobs.extend(got.part(start, start + count))
            start += count

    def _record(self, forward: ForwardRecord) -> None:
        self.last_step.forwards.append(forward)

    def has_unfinished(self) -> bool:
        return self.scheduler.has_work or self._inflight is not None

    @property
    def step_in_flight(self) -> bool:
        """Whether the device already has the next decode step (overlapped)."""
        return self._inflight is not None

    @property
    def host_can_pause(self) -> bool:
        """Whether the host may pause between steps without the device idling: the next decode
        step already runs on it, or the device is this host's CPU (a pause there only hands the
        interpreter lock to another thread)."""
        return self.step_in_flight or self.device.type == "cpu"

    def output(self, request_id: str) -> RequestOutput:
        req = self._requests[request_id]
        queue, prefill = req.phase_seconds()
        return RequestOutput(
            request_id=req.rid,
            prompt_token_ids=req.prompt_ids,
            token_ids=list(req.output_ids),
            finish_reason=req.finish_reason.value if req.finish_reason else None,
            text=self.tokenizer.decode(req.output_ids, skip_special_tokens=True) if self.tokenizer else None,
            logits=list(req.logits) if req.sampling.return_logits else None,
            logprobs=req.logprobs.copy() if req.logprobs is not None else None,
            prompt_logprobs=req.prompt_logprobs.copy() if req.prompt_logprobs is not None else None,
            spec=req.spec.stats.copy() if req.spec is not None else None,
            error=req.error,
            cached_tokens=req.cached_tokens,
            queue_s=queue,
            prefill_s=prefill,
        )

    def first_token_phases(self, request_id: str, new_tokens: list[int]) -> tuple[float | None, float | None] | None:
        """(queue, prefill) seconds of a request whose latest tokens `new_tokens` are its first:
        reported with its first token, so that a request is timed however it ends later (aborted,
        its client gone). None for later tokens."""
        req = self._requests[request_id]
        if not new_tokens or len(req.output_ids) != len(new_tokens):
            return None
        return req.phase_seconds()

    def step_logprobs(self, request_id: str, new_tokens: list[int]) -> tuple[Logprobs | None, Logprobs | None]:
        """(logprobs of `new_tokens`, the request's latest tokens; its prompt logprobs when these
        are its first tokens): what a step's update carries for a request that asked."""
        req = self._requests[request_id]
        own = req.logprobs.tail(len(new_tokens)) if req.logprobs is not None and new_tokens else None
        first = bool(new_tokens) and len(req.output_ids) == len(new_tokens)
        return own, req.prompt_logprobs.copy() if req.prompt_logprobs is not None and first else None

    def release(self, request_id: str) -> None:
        """Forget a finished request's record."""
        req = self._requests.get(request_id)
        if req is not None and req.finished:
            del self._requests[request_id]

    # -- convenience APIs ----------------------------------------------------------------
    def generate(
        self,
        prompt_token_ids: Sequence[Sequence[int]] | None = None,
        sampling: SamplingParams | Sequence[SamplingParams] | None = None,
        prompts: Sequence[str] | None = None,
    ) -> list[RequestOutput]:
        """Run a batch of prompts to completion; outputs come back in prompt order."""
        ids = self._prompt_ids(prompt_token_ids, prompts)
        params = list(sampling) if isinstance(sampling, (list, tuple)) else [sampling or SamplingParams()] * len(ids)
        if len(params) != len(ids):
            raise ValueError(f"sampling: {len(params)} sampling params for {len(ids)} prompts")
        field = "prompts" if prompts is not None else "prompt_token_ids"
        reqs = [self._make_request(p, sp, None, f"{field}[{i}]") for i, (p, sp) in enumerate(zip(ids, params))]
        for req in reqs:
            self._requests[req.rid] = req
            self.scheduler.add(req)
        try:
            while any(not r.finished for r in reqs):
                self.step()
        except BaseException:
            for req in reqs:
                self.abort(req.rid)
            raise
        outputs = [self.output(r.rid) for r in reqs]
        for req in reqs:
            self.release(req.rid)
        return outputs

    def stream(
        self,
        prompt_token_ids: Sequence[int] | None = None,
        sampling: SamplingParams | None = None,
        prompt: str | None = None,
    ) -> Iterator[list[int]]:
        """Yield a request's new token ids as they are sampled. Closing the iterator aborts it."""
        (ids,) = self._prompt_ids(
            None if prompt_token_ids is None else [prompt_token_ids], None if prompt is None else [prompt]
        )
        rid = self.add_request(ids, sampling)
        try:
            while True:
                for event_rid, new, _ in self.step():
                    if event_rid == rid:
                        yield new
                if self._requests[rid].finished:
                    return
        finally:
            self.abort(rid)
            self.release(rid)

    def _prompt_ids(
        self, prompt_token_ids: Sequence[Sequence[int]] | None, prompts: Sequence[str] | None
    ) -> list[list[int]]:
        if (prompt_token_ids is None) == (prompts is None):
            raise ValueError("prompt_token_ids / prompts: give exactly one of them")
        if prompts is None:
            return [list(p) for p in prompt_token_ids]
        if self.tokenizer is None:
            raise ValueError("prompts: this model directory has no tokenizer; pass prompt_token_ids")
        for i, text in enumerate(prompts):
            problem = "must be text" if not isinstance(text, str) else unicode_problem(text)
            if problem is not None:
                raise ValueError(f"prompts[{i}]: {problem}")
        return [self.tokenizer.encode(p) for p in prompts]

    # -- memory ----------------------------------------------------------------------------
    def kv_stats(self) -> dict[str, int]:
        """Free and total slots of both pools. Pages only the prefix cache holds count as free
        (a request needing them evicts them); `*_cached` says how many slots the cache holds;
        `*_slot_bytes` what one slot holds on this rank (`kv_slot_bytes`)."""
        stats = {**self.allocator.stats(), **{f"{k}_slot_bytes": n for k, n in self.kv_slot_bytes.items()}}
        if self.cache is not None:
            p = self.allocator.page_size
            full_cached, swa_cached, full, swa = self.cache.usage()
            stats.update(
                full_free=stats["full_free"] + full * p,
                swa_free=stats["swa_free"] + swa * p,
                full_cached=full_cached * p,
                swa_cached=swa_cached * p,
            )
        return stats

    def check_no_leak(self) -> None:
        """Assert that no request holds KV: every page in use is the prefix cache's alone, so
        `flush_cache()` brings both pools back to their initial free counts."""
        if self.scheduler.running:
            raise AssertionError(f"{len(self.scheduler.running)} requests are still running")
        if self.cache is not None:
            self.cache.check_sole_holder()
        else:
            self.allocator.check_no_leak()
        self.req_to_token.check_no_leak()

    def flush_cache(self) -> None:
        """Drop the prefix cache's pages that no running request uses (all of them when idle)."""
        if self.cache is not None:
            self.cache.flush()

    def shutdown(self) -> None:
        for rid, req in list(self._requests.items()):
            if not req.finished:
                self.abort(rid)
        self._requests.clear()
        if self._grammars is not None:
            self._grammars.shutdown()


def _graph_mode(setting: bool | str, device: torch.device, backend: str) -> bool | str:
    """False, True or "emulate": whether this engine captures and replays CUDA graphs."""
    if setting == "emulate":
        if backend != "trtllm_mha":
            raise ValueError("cuda_graphs: 'emulate' replays trtllm_mha's static metadata; use that backend")
        return "emulate"
    if setting not in (True, False):
        raise ValueError(f"cuda_graphs: true, false or 'emulate', got {setting!r}")
    if setting and device.type == "cuda" and backend != "trtllm_mha":
        logger.info("cuda graphs: off (the %s backend has no static metadata for replay)", backend)
    return bool(setting) and device.type == "cuda" and backend == "trtllm_mha"


def resolve_context_length(cfg, context_length: int | None, max_total_tokens: int) -> int:
    """The longest sequence an engine serves: the model's, or the one asked for, within the pool."""
    if context_length is not None and context_length > cfg.max_position_embeddings:
        raise ValueError(
            f"context_length: {context_length} is longer than the model's max_position_embeddings "
            f"{cfg.max_position_embeddings}"
        )
    return min(context_length or cfg.max_position_embeddings, max_total_tokens)


def _resolve_dtype(dtype: str, device: torch.device) -> torch.dtype:
    if dtype == "auto":
        return torch.bfloat16 if device.type == "cuda" else torch.float32
    if dtype not in DTYPES:
        raise ValueError(f"dtype: unknown {dtype!r}; choose from {['auto', *DTYPES]}")
    return DTYPES[dtype]
