"""Building a draft worker: check the draft against the target at start-up, then load it."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable

import torch
from torch import nn

from workers.distributed import SINGLE_RANK, TPGroup
from workers.memory import KVAllocator, build_pool, kv_layouts
from workers.model_runner import ModelRunner
from workers.models import ModelConfig, load_model_config
from workers.models.eagle import EagleHead, load_eagle_config
from workers.models.frozen_kv_mtp import FrozenKVMTPHead, frozen_kv_config
from workers.models.gemma4_assistant import Gemma4Assistant, assistant_config, is_assistant
from workers.models.loader import build_module
from workers.scheduler import Scheduler
from workers.speculative.config import DRAFT_POOLS, SpecConfig
from workers.speculative.drafter import DRAFTERS, Drafter
from workers.speculative.token_map import apply_token_map, load_token_map


@dataclasses.dataclass(frozen=True)
class DraftPlan:
    """What the draft needs, known before the allocator is built."""

    spec: SpecConfig
    pool_kind: str  # swa | full | target
    cfg: ModelConfig  # the draft's layer shapes
    build: Callable[[nn.Module, TPGroup], nn.Module] | None  # (target model, tp) -> draft head; None: a causal LM
    swa_window: int | None  # widest window the draft keeps or reads in an SWA pool (sizes the allocator)
    capture_layers: tuple[int, ...] = ()  # target layers whose outputs the draft reads (EAGLE-3)
    token_map: torch.Tensor | None = None  # target token ids the draft proposes from


def plan_draft(spec: SpecConfig, target: ModelConfig, context_length: int) -> DraftPlan:
    """Check the draft against the target; raise ValueError naming the offending setting."""
    if spec.algorithm == "standalone":
        cfg = load_model_config(spec.draft_model)
        if cfg.vocab_size != target.vocab_size:
            raise ValueError(
                f"speculative.draft_model: vocabulary of {cfg.vocab_size} tokens, the target has {target.vocab_size}"
            )
        pool_kind = spec.draft_pool or ("swa" if cfg.max_window is not None else "full")
        if pool_kind == "swa" and cfg.max_window is None:
            raise ValueError("speculative.draft_pool: 'swa' needs sliding-window layers; the draft has none")
        plan = DraftPlan(spec, pool_kind, cfg, None, cfg.max_window if pool_kind == "swa" else None)
    elif spec.algorithm == "eagle":
        ec = load_eagle_config(spec.draft_model, target, spec.draft_load_format)
        plan = DraftPlan(spec, "full", ec.cfg, lambda t, tp: EagleHead(ec, t, tp), None, ec.aux_layer_ids)
    elif is_assistant(spec.draft_model):  # its steps all sit at the pending token: any window >= 2 serves
        ac = assistant_config(spec.draft_model, target)
        if ac.num_centroids and spec.token_map is not None:
            raise ValueError(
                "speculative.token_map: the draft's centroid head (use_ordered_embeddings) already scores a subset "
                "of the vocabulary per row; leave token_map unset"
            )
        plan = DraftPlan(spec, "target", ac.cfg, lambda t, tp: Gemma4Assistant(ac, t, tp), ac.cfg.max_window)
    else:
        cfg, sources = frozen_kv_config(spec.draft_model, target)
        windows = [target.layer_windows[i] for i in sources if target.layer_windows[i] is not None]
        if windows and spec.num_steps > min(windows) - 1:
            raise ValueError(
                f"speculative.num_steps: frozen-KV draft steps past the verified tokens must stay inside "
                f"the {min(windows)}-token window of the layers they read: at most {min(windows) - 1}"
            )
        plan = DraftPlan(spec, "target", cfg, lambda t, tp: FrozenKVMTPHead(cfg, sources, t, tp), None)
    if plan.pool_kind not in DRAFT_POOLS[spec.algorithm]:
        raise ValueError(f"speculative.draft_pool: {plan.pool_kind!r} is not supported by {spec.algorithm}")
    if plan.cfg.max_window is not None and plan.cfg.max_window > context_length:
        raise ValueError(
            f"speculative.draft_model: sliding window {plan.cfg.max_window} is larger than the target's "
            f"context length {context_length}"
        )
    if spec.token_map is not None:
        plan = dataclasses.replace(plan, token_map=load_token_map(spec.token_map, target.vocab_size))
    return plan


def build_drafter(
    plan: DraftPlan,
    target: ModelRunner,
    allocator: KVAllocator,
    scheduler: Scheduler,
    attention_backend: str,
    dtype: torch.dtype,
    device: torch.device,
    tp: TPGroup = SINGLE_RANK,
    seed: int = 0,
    debug_kv_checks: bool = False,
    kv_dtype: torch.dtype | None = None,
) -> Drafter:
    """Load the draft model on the target's allocator, with its own attention backend; its own
    pool (if any) holds `kv_dtype` as the target's does (None: the model's dtype), and a draft
    reading the target's KV reads that."""
    kv_dtype = kv_dtype or dtype
    spec = plan.spec
    if plan.build is None:
        runner = ModelRunner.load(
            plan.cfg,
            spec.draft_model,
            allocator,
            attention_backend,
            dtype,
            device,
            spec.draft_load_format,
            tp,
            use_swa_pool=plan.pool_kind == "swa",
            seed=seed,
            debug_kv_checks=debug_kv_checks,
            role="draft",
            kv_dtype=kv_dtype,
        )
    else:
        model = build_module(
            lambda: plan.build(target.model, tp),
            f"{spec.algorithm} draft head",
            spec.draft_model,
            spec.draft_load_format,
            dtype,
            device,
            seed,
            plan.cfg.initializer_range,
        )
        pool = None
        if plan.pool_kind == "full":
            pool = build_pool(kv_layouts(model.attention_layers), allocator, kv_dtype, device, use_swa_pool=False)
        runner = ModelRunner(
            model,
            pool,
            attention_backend,
            device,
            allocator.page_size,
            debug_kv_checks,
            role="draft",
            allocator=allocator,
            kv_dtype=kv_dtype,
        )
    if plan.token_map is not None:
        apply_token_map(runner.model, target.model, plan.token_map, tp)
    target.model.model.capture_layers = plan.capture_layers
    return DRAFTERS[spec.algorithm](spec.algorithm, plan.pool_kind, runner, target, scheduler)
