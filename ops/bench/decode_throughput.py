"""Decode throughput on one GPU against the hardware limits and HF transformers, in one process.

    python -m ops.bench.decode_throughput --out results.json [--parts ceilings,decode,hf,prefill,spec,tiny]
        [--variants bf16,fp8,kv8] [--prompt 4096] [--batches 1,8,64]

1. Ceilings measured here: device-to-device copy bandwidth (bytes read + written) and the bf16
   matrix-product rate (8192^3, random data), each the median of timed repeats.
2. slidespec decode with dummy weights of real model shapes (Llama-3-8B, Gemma-3-1B,
   Gemma-3-12B by default; Gemma-4-E4B, Gemma-4-31B, Gemma-4-26B-A4B and gpt-oss-20b on request;
   bf16, greedy, prompt 128, 128 new tokens) at batches 1, 8 and 64, CUDA graphs on and off:
   tokens/s of the decode steps, ms/step, against the roofline of the bytes a step reads (copy
   bandwidth / (weights read whole + the KV the step reads): a token reads one row of an
   embedding table, Gemma 4's per-layer table too, so those count only where the table is also
   the LM head; a mixture of experts' experts count as the share a batch's tokens choose, at
   uniform routing) and HF `generate`. `--variants` runs each shape with FP8 weights (`fp8`: dummy
   weights quantised with a scale per output channel, as `quantization: fp8`; `fp8-block`: 128 x
   128 blocks, as Qwen3-FP8 ships), an FP8 KV cache (`kv8`) or both (`fp8+kv8`) beside bf16
   (`bf16`), or gpt-oss's experts in MXFP4 as its checkpoints ship them (`mxfp4`: random codes
   under one scale); the roofline counts the bytes as stored (a byte an FP8 weight or KV entry,
   half a byte an MXFP4 weight and a byte its group's scale), and each
   variant reports the KV tokens `--mem-fraction` of the GPU's memory holds beside its weights.
   `--prompt` sets the contexts (4096: the KV a step reads weighs against the weights).
3. Prefill: 8 x 2,048-token prompts on the 8B shape (`--prefill-shapes`, in each variant), model
   FLOPs over the matmul rate (tokens a second alone for a mixture of experts).
4. Speculation at batch 1: on the 8B shape an EAGLE round and a frozen-KV MTP round (4 steps),
   on the Gemma-4-31B shape (`--spec-shape gemma4-31b`) a round of its assistant's shape, on
   gpt-oss-20b an EAGLE-3 round and on Gemma-4-26B-A4B an assistant's (`--spec-shape`), each
   against a plain decode step, and the host synchronisations per step.
5. The shipped tiny models with their three trained drafts at batches 1 and 16: speculation
   against plain decoding with the measured accept lengths.

Prints one table and writes every number to `--out` (JSON).
"""

from __future__ import annotations

import argparse
import collections
import contextlib
import gc
import json
import logging
import os
import statistics
import tempfile
import time
import traceback
import warnings
from collections.abc import Callable
from typing import NamedTuple

import torch

from ops import DEFAULT_MODEL, DRAFT_MODELS
from ops.bench.record import add_record_args, record_run
from workers.engine import Engine, SamplingParams
from workers.models.layers import ParallelLMHead, VocabParallelEmbedding
from workers.models.moe import Experts

logger = logging.getLogger(__name__)

PROMPT, NEW = 128, 128
BATCHES = (1, 8, 64)
MEM_FRACTION = 0.9  # of the GPU's memory, weights and KV together, for the KV capacity figures
# How a shape stores its weights and KV: variant -> (engine options, config.json fields); FP8
# weights are dummy values quantised as a checkpoint's are, so their scales are realistic.
FP8_BLOCKS = {"quant_method": "fp8", "activation_scheme": "dynamic", "weight_block_size": [128, 128]}
VARIANTS: dict[str, tuple[dict, dict]] = {
    "bf16": ({}, {}),
    "fp8": ({"quantization": "fp8"}, {}),
    "fp8-block": ({}, {"quantization_config": FP8_BLOCKS}),
    "kv8": ({"kv_cache_dtype": "fp8_e4m3"}, {}),
    "fp8+kv8": ({"quantization": "fp8", "kv_cache_dtype": "fp8_e4m3"}, {}),
    "mxfp4": ({}, {"quantization_config": {"quant_method": "mxfp4"}}),  # gpt-oss's experts as it ships them
}
GEMMA4_ROPE = {
    "sliding_attention": {"rope_type": "default", "rope_theta": 10000.0},
    "full_attention": {"rope_type": "proportional", "partial_rotary_factor": 0.25, "rope_theta": 1000000.0},
}
SHAPES = {
    "llama3-8b": dict(
        model_type="llama",
        architectures=["LlamaForCausalLM"],
        hidden_size=4096,
        intermediate_size=14336,
        num_hidden_layers=32,
        num_attention_heads=32,
        num_key_value_heads=8,
        head_dim=128,
        vocab_size=128256,
        rope_theta=500000.0,
        max_position_embeddings=8192,
        rms_norm_eps=1e-5,
        tie_word_embeddings=False,
        hidden_act="silu",
    ),
    "gemma3-1b": dict(
        model_type="gemma3_text",
        architectures=["Gemma3ForCausalLM"],
        hidden_size=1152,
        intermediate_size=6912,
        num_hidden_layers=26,
        num_attention_heads=4,
        num_key_value_heads=1,
        head_dim=256,
        vocab_size=262144,
        sliding_window=512,
        query_pre_attn_scalar=256,
        max_position_embeddings=32768,
        rms_norm_eps=1e-6,
        hidden_activation="gelu_pytorch_tanh",
        tie_word_embeddings=True,
        layer_types=(["sliding_attention"] * 5 + ["full_attention"]) * 4 + ["sliding_attention"] * 2,
        rope_parameters={
            "sliding_attention": {"rope_type": "default", "rope_theta": 10000.0},
            "full_attention": {"rope_type": "default", "rope_theta": 1000000.0},
        },
    ),
    "gemma3-12b": dict(
        model_type="gemma3_text",
        architectures=["Gemma3ForCausalLM"],
        hidden_size=3840,
        intermediate_size=15360,
        num_hidden_layers=48,
        num_attention_heads=16,
        num_key_value_heads=8,
        head_dim=256,
        vocab_size=262144,
        sliding_window=1024,
        query_pre_attn_scalar=256,
        max_position_embeddings=131072,
        rms_norm_eps=1e-6,
        hidden_activation="gelu_pytorch_tanh",
        tie_word_embeddings=True,
        layer_types=(["sliding_attention"] * 5 + ["full_attention"]) * 8,
        rope_parameters={
            "sliding_attention": {"rope_type": "default", "rope_theta": 10000.0},
            "full_attention": {"rope_type": "linear", "rope_theta": 1000000.0, "factor": 8.0},
        },
    ),
    # google/gemma-4-E4B-it's text model: per-layer embeddings (a 262144 x 42 x 256 table), the
    # last 18 layers reading the KV of layers 22 (sliding) and 23 (full), 512-wide full heads.
    "gemma4-e4b": dict(
        model_type="gemma4_text",
        architectures=["Gemma4ForCausalLM"],
        hidden_size=2560,
        intermediate_size=10240,
        num_hidden_layers=42,
        num_attention_heads=8,
        num_key_value_heads=2,
        head_dim=256,
        global_head_dim=512,
        attention_k_eq_v=False,
        num_kv_shared_layers=18,
        hidden_size_per_layer_input=256,
        vocab_size_per_layer_input=262144,
        use_double_wide_mlp=False,
        vocab_size=262144,
        sliding_window=512,
        layer_types=(["sliding_attention"] * 5 + ["full_attention"]) * 7,
        rope_parameters=GEMMA4_ROPE,
        final_logit_softcapping=30.0,
        max_position_embeddings=131072,
        rms_norm_eps=1e-6,
        hidden_activation="gelu_pytorch_tanh",
        tie_word_embeddings=True,
    ),
    # google/gemma-4-31B-it's text model: full layers of 4 KV heads of 512 with V from the K
    # projection, no per-layer embeddings, no KV sharing.
    "gemma4-31b": dict(
        model_type="gemma4_text",
        architectures=["Gemma4ForCausalLM"],
        hidden_size=5376,
        intermediate_size=21504,
        num_hidden_layers=60,
        num_attention_heads=32,
        num_key_value_heads=16,
        num_global_key_value_heads=4,
        head_dim=256,
        global_head_dim=512,
        attention_k_eq_v=True,
        num_kv_shared_layers=0,
        hidden_size_per_layer_input=0,
        vocab_size_per_layer_input=262144,
        use_double_wide_mlp=False,
        vocab_size=262144,
        sliding_window=1024,
        layer_types=(["sliding_attention"] * 5 + ["full_attention"]) * 10,
        rope_parameters=GEMMA4_ROPE,
        final_logit_softcapping=30.0,
        max_position_embeddings=262144,
        rms_norm_eps=1e-6,
        hidden_activation="gelu_pytorch_tanh",
        tie_word_embeddings=True,
    ),
    # google/gemma-4-26B-A4B's text model: 128 experts (8 a token, 704 wide) beside each layer's
    # 2112-wide MLP, full layers of 2 KV heads of 512 with V from the K projection.
    "gemma4-26b-a4b": dict(
        model_type="gemma4_text",
        architectures=["Gemma4ForCausalLM"],
        hidden_size=2816,
        intermediate_size=2112,
        num_hidden_layers=30,
        num_attention_heads=16,
        num_key_value_heads=8,
        num_global_key_value_heads=2,
        head_dim=256,
        global_head_dim=512,
        attention_k_eq_v=True,
        num_kv_shared_layers=0,
        hidden_size_per_layer_input=0,
        vocab_size_per_layer_input=262144,
        use_double_wide_mlp=False,
        enable_moe_block=True,
        num_experts=128,
        top_k_experts=8,
        moe_intermediate_size=704,
        vocab_size=262144,
        sliding_window=1024,
        layer_types=(["sliding_attention"] * 5 + ["full_attention"]) * 5,
        rope_parameters=GEMMA4_ROPE,
        final_logit_softcapping=30.0,
        max_position_embeddings=262144,
        rms_norm_eps=1e-6,
        hidden_activation="gelu_pytorch_tanh",
        tie_word_embeddings=True,
    ),
    # openai/gpt-oss-20b: 32 experts (4 a token, 2880 wide, clamped SwiGLU with biases), sliding
    # layers of 128 keys alternating with full ones, sinks, YaRN; its experts dummy bf16 weights,
    # or in MXFP4 as the checkpoint ships them (variant `mxfp4`).
    "gpt-oss-20b": dict(
        model_type="gpt_oss",
        architectures=["GptOssForCausalLM"],
        hidden_size=2880,
        intermediate_size=2880,
        num_hidden_layers=24,
        num_attention_heads=64,
        num_key_value_heads=8,
        head_dim=64,
        num_local_experts=32,
        num_experts_per_tok=4,
        swiglu_limit=7.0,
        attention_bias=True,
        vocab_size=201088,
        sliding_window=128,
        layer_types=["sliding_attention", "full_attention"] * 12,
        rope_parameters={
            "rope_type": "yarn",
            "rope_theta": 150000.0,
            "factor": 32.0,
            "beta_fast": 32.0,
            "beta_slow": 1.0,
            "truncate": False,
            "original_max_position_embeddings": 4096,
        },
        max_position_embeddings=131072,
        rms_norm_eps=1e-5,
        tie_word_embeddings=False,
    ),
}
DEFAULT_SHAPES = ("llama3-8b", "gemma3-1b", "gemma3-12b")
# google/gemma-4-31B-it-assistant: four query-only layers (three sliding, one full) of the
# target's head shapes reading its KV, 1024 wide, its own 262144-token LM head.
GEMMA4_31B_ASSISTANT = dict(
    model_type="gemma4_assistant",
    architectures=["Gemma4AssistantForCausalLM"],
    backbone_hidden_size=5376,
    use_ordered_embeddings=False,
    num_centroids=2048,
    centroid_intermediate_top_k=32,
    tie_word_embeddings=True,
    text_config=dict(
        model_type="gemma4_text",
        hidden_size=1024,
        intermediate_size=8192,
        num_hidden_layers=4,
        num_attention_heads=32,
        num_key_value_heads=16,
        num_global_key_value_heads=4,
        head_dim=256,
        global_head_dim=512,
        attention_k_eq_v=True,
        num_kv_shared_layers=4,
        hidden_size_per_layer_input=0,
        vocab_size_per_layer_input=0,
        vocab_size=262144,
        sliding_window=1024,
        layer_types=["sliding_attention"] * 3 + ["full_attention"],
        rope_parameters=GEMMA4_ROPE,
        max_position_embeddings=262144,
        rms_norm_eps=1e-6,
        hidden_activation="gelu_pytorch_tanh",
        tie_word_embeddings=True,
    ),
)

# An EAGLE-3 head for gpt-oss-20b in the layout of the published speculators-format heads for it
# (one Llama layer 2880 wide, 64 query heads of 64, 8 KV heads, a 32K-token draft vocabulary).
GPT_OSS_20B_EAGLE3 = dict(
    model_type="llama",
    architectures=["LlamaForCausalLMEagle3"],
    hidden_size=2880,
    intermediate_size=2880,
    num_hidden_layers=1,
    num_attention_heads=64,
    num_key_value_heads=8,
    head_dim=64,
    vocab_size=201088,
    draft_vocab_size=32000,
    rope_theta=500000.0,
    max_position_embeddings=131072,
    rms_norm_eps=1e-5,
    hidden_act="silu",
    tie_word_embeddings=False,
)
# An assistant for Gemma-4-26B-A4B in the 31B assistant's layout (four query-only layers, 1024
# wide) over the 26B-A4B's KV geometry (8 sliding KV heads of 256, 2 full of 512) and width: a
# stand-in of the same cost structure where no published shape is at hand.
GEMMA4_26B_A4B_ASSISTANT = dict(
    GEMMA4_31B_ASSISTANT,
    backbone_hidden_size=2816,
    text_config=dict(
        GEMMA4_31B_ASSISTANT["text_config"], num_attention_heads=16, num_key_value_heads=8, num_global_key_value_heads=2
    ),
)


# -- helpers ------------------------------------------------------------------------------------------
def write_config(root: str, name: str, config: dict) -> str:
    path = os.path.join(root, name)
    os.makedirs(path, exist_ok=True)
    with open(os.path.join(path, "config.json"), "w") as f:
        json.dump({"torch_dtype": "bfloat16", "bos_token_id": None, "eos_token_id": None, **config}, f)
    return path


def timed(fn, repeats: int = 10, warmup: int = 3) -> float:
    """Median seconds of `fn` over CUDA events."""
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(repeats):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) / 1e3)
    return statistics.median(times)


def ceilings() -> dict:
    n = 1 << 30  # 2 GiB of bf16 per buffer, far past the L2
    src = torch.randn(n, dtype=torch.bfloat16, device="cuda")
    dst = torch.empty_like(src)
    copy_s = timed(lambda: dst.copy_(src))
    a = torch.randn(8192, 8192, dtype=torch.bfloat16, device="cuda")
    b = torch.randn(8192, 8192, dtype=torch.bfloat16, device="cuda")
    mm_s = timed(lambda: a @ b)
    return {"copy_bytes_per_s": 2 * n * 2 / copy_s, "matmul_flops_per_s": 2 * 8192**3 / mm_s}


def weight_bytes(engine: Engine, batch: int = 1) -> int:
    """Bytes of the weights a decode step of `batch` tokens reads: every weight whole but the
    tables a token reads one row of (embedding tables, `read_by_row` ones such as Gemma 4's
    per-layer table), unless the table is also an LM head (tied), which every step reads whole
    for the logits; of a mixture of experts, the share of experts the batch's tokens choose, at
    uniform routing (`1 - (1 - k / E)^batch`)."""
    models = [engine.runner.model] + ([engine.spec.drafter.runner.model] if engine.spec else [])
    modules = [mod for m in models for mod in m.modules()]
    heads = {id(mod.weight) for mod in modules if isinstance(mod, ParallelLMHead)}
    tables = {id(mod.weight) for mod in modules if type(mod) is VocabParallelEmbedding}
    weights = {id(p): p for m in models for p in m.parameters()}
    by_row = {i for i, p in weights.items() if i in tables or getattr(p, "read_by_row", False)} - heads
    share = {
        id(p): 1.0 - (1.0 - e.top_k / e.num_experts) ** batch
        for e in modules
        if isinstance(e, Experts)
        for p in e.parameters()
    }
    return round(sum(p.numel() * p.element_size() * share.get(i, 1.0) for i, p in weights.items() if i not in by_row))


def kv_bytes_per_token(engine: Engine) -> int:
    """KV bytes of one token over the layers that store KV (each in its own geometry)."""
    return sum(engine.kv_slot_bytes.values())


class TimedDecode(NamedTuple):
    outputs: list  # each request's RequestOutput
    tokens: int  # generated in the timed decode steps
    steps: int
    seconds: float


def prefill(engine: Engine) -> None:
    """Step until every request submitted is admitted and prefilled (decode steps may run meanwhile)."""
    while any(not r.prefilled for r in engine.scheduler.running) or engine.scheduler.waiting:
        engine.step()


def timed_decode(
    engine: Engine, prompts: list[list[int]], sampling: SamplingParams, each_step: Callable[[], None] | None = None
) -> TimedDecode:
    """Submit, prefill every request, then time the decode steps until all have their tokens
    (`each_step`: called after each timed step, which `engine.last_step` describes); the
    requests' records are released."""
    rids = [engine.add_request(p, sampling) for p in prompts]
    prefill(engine)
    _sync(engine)
    start, steps, tokens = time.perf_counter(), 0, 0
    while engine.has_unfinished():
        tokens += sum(len(new) for _, new, _ in engine.step())
        steps += 1
        if each_step is not None:
            each_step()
    _sync(engine)
    elapsed = time.perf_counter() - start
    outs = [engine.output(r) for r in rids]
    for r in rids:
        engine.release(r)
    return TimedDecode(outs, tokens, steps, elapsed)


def _sync(engine: Engine) -> None:
    if engine.device.type == "cuda":
        torch.cuda.synchronize()


def run_batch(engine: Engine, prompts: list[list[int]], new: int) -> dict:
    """Submit, prefill, then time the decode steps: tokens/s and ms per step."""
    sampling = SamplingParams(max_new_tokens=new, temperature=0.0, ignore_eos=True)
    outs, tokens, steps, elapsed = timed_decode(engine, prompts, sampling)
    lengths = [n for o in outs if o.spec for n in o.spec.accept_lengths]
    return {
        "tokens": tokens,
        "steps": steps,
        "seconds": elapsed,
        "tok_per_s": tokens / elapsed,
        "ms_per_step": 1e3 * elapsed / max(1, steps),
        "accept_length": sum(lengths) / len(lengths) if lengths else None,
    }


def sync_sites(engine: Engine, steps: int) -> dict[str, int]:
    """Where the host waits for the device: the project's frames at each synchronisation torch's
    sync debug mode reports, counted over `steps` steps."""
    sites: collections.Counter = collections.Counter()
    show = warnings.showwarning
    stepping = False  # only inside engine.step(): switching the mode itself may report one

    def record(message, category, filename, lineno, file=None, line=None):
        if stepping and "synchroniz" in str(message):
            frames = [f for f in traceback.extract_stack()[:-1] if "/torch/" not in f.filename]
            sites[" <- ".join(f"{f.filename.rsplit('/', 2)[-1]}:{f.lineno}" for f in frames[-4:][::-1])] += 1

    with warnings.catch_warnings():
        warnings.simplefilter("always")
        warnings.showwarning = record
        torch.cuda.set_sync_debug_mode("warn")
        try:
            for _ in range(steps):
                stepping = True
                engine.step()
                stepping = False
        finally:
            stepping = False
            torch.cuda.set_sync_debug_mode("default")
            warnings.showwarning = show
    return dict(sites.most_common())


def syncs_per_step(engine: Engine, prompts: list[list[int]], steps: int = 8) -> float:
    """Host synchronisations per decode step, counted by torch's sync debug mode."""
    sampling = SamplingParams(max_new_tokens=steps + 2, temperature=0.0, ignore_eos=True)
    rids = [engine.add_request(p, sampling) for p in prompts]
    while any(not r.prefilled for r in engine.scheduler.running):
        engine.step()
    engine.step()
    count = sum(sync_sites(engine, steps).values())
    while engine.has_unfinished():
        engine.step()
    for r in rids:
        engine.release(r)
    return count / steps


def random_prompts(vocab: int, batch: int, length: int, seed: int = 0) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(1, vocab, (batch, length), generator=g).tolist()


def engine_for(path: str, graphs: bool, max_batch: int = 64, prompt: int = PROMPT, **kw) -> Engine:
    """An engine of a dummy-weight shape, its pools sized for `max_batch` requests of `prompt`
    tokens and NEW more. Engines hold reference cycles: their device memory comes back only after
    a collection, so one runs first (callers drop the engine they freed before asking for the
    next one)."""
    gc.collect()
    torch.cuda.empty_cache()
    return Engine(
        model=path,
        device="cuda",
        dtype="bfloat16",
        load_format="dummy",
        page_size=16,
        swa_full_tokens_ratio=1.0,  # windows here are wider than the requests: SWA holds what full holds
        max_total_tokens=max_batch * (prompt + NEW + 64),
        max_running_requests=max_batch,
        chunked_prefill_size=8192,
        cuda_graphs=graphs,
        **kw,
    )


def free(engine: Engine | None) -> None:
    if engine is not None:
        engine.shutdown()
    torch.cuda.synchronize()
    torch.cuda.empty_cache()


def kv_capacity(engine: Engine, mem_fraction: float) -> int:
    """KV tokens `mem_fraction` of this GPU's memory holds beside the engine's weights (every
    parameter, as stored): what a pool sized by memory would hold, in this engine's KV format."""
    total = torch.cuda.get_device_properties(engine.device).total_memory
    weights = sum(p.numel() * p.element_size() for p in engine.runner.model.parameters())
    return max(0, int(mem_fraction * total - weights) // kv_bytes_per_token(engine))


def case_name(shape: str, variant: str, prompt: int) -> str:
    """A decode case's name: the shape, its variant past bf16, its prompt length past PROMPT."""
    return shape + ("" if variant == "bf16" else f"+{variant}") + ("" if prompt == PROMPT else f"@{prompt}")


# -- parts -----------------------------------------------------------------------------------------------
def decode_part(
    root: str,
    limits: dict,
    shapes: list[str],
    modes: list[str],
    variants: list[str] = ("bf16",),
    prompt: int = PROMPT,
    batches: tuple[int, ...] = BATCHES,
    mem_fraction: float = MEM_FRACTION,
) -> dict:
    """Decode steps of every shape in every variant (`VARIANTS`) at each batch, `prompt` tokens a
    request; per variant its KV capacity at `mem_fraction` (and against bf16's when both ran)."""
    out = {}
    for name in shapes:
        for variant in variants:
            options, fields = VARIANTS[variant]
            label = case_name(name, variant, prompt)
            path = write_config(root, label, {**SHAPES[name], **fields})
            for graphs in [mode == "graphs" for mode in modes]:
                engine = engine_for(path, graphs, max_batch=max(batches), prompt=prompt, **options)
                wb, kvb = weight_bytes(engine), kv_bytes_per_token(engine)
                run_batch(engine, random_prompts(engine.cfg.vocab_size, 1, 16), 4)  # warm-up, as the other parts
                for batch in batches:
                    r = run_batch(engine, random_prompts(engine.cfg.vocab_size, batch, prompt), NEW)
                    r["weight_read_GB"] = weight_bytes(engine, batch) / 1e9
                    r["kv_read_GB"] = batch * kvb * (prompt + NEW // 2) / 1e9
                    r["roofline_tok_per_s"] = (
                        batch * limits["copy_bytes_per_s"] / (1e9 * (r["weight_read_GB"] + r["kv_read_GB"]))
                    )
                    r["of_roofline"] = r["tok_per_s"] / r["roofline_tok_per_s"]
                    out[f"{label}/b{batch}/{'graphs' if graphs else 'eager'}"] = r
                    logger.info(
                        "%s batch %d graphs %s: %.1f tok/s (%.0f%% of roofline)",
                        label,
                        batch,
                        graphs,
                        r["tok_per_s"],
                        100 * r["of_roofline"],
                    )
                out[f"{label}/weight_bytes"] = wb
                out[f"{label}/kv_capacity"] = {
                    "kv_capacity_tokens": kv_capacity(engine, mem_fraction),
                    "kv_bytes_per_token": kvb,
                    "mem_fraction": mem_fraction,
                }
                free(engine)
                del engine
            bf16 = out.get(f"{case_name(name, 'bf16', prompt)}/kv_capacity")
            if bf16 is not None:
                cap = out[f"{label}/kv_capacity"]
                cap["kv_capacity_vs_bf16"] = cap["kv_capacity_tokens"] / max(1, bf16["kv_capacity_tokens"])
    return out


def hf_part(root: str, shapes: list[str], new: int = 64) -> dict:
    import transformers

    out = {}
    for name in shapes:
        path = write_config(root, name, SHAPES[name])
        cfg = transformers.AutoConfig.from_pretrained(path)
        with torch.device("cuda"):
            model = transformers.AutoModelForCausalLM.from_config(cfg, dtype=torch.bfloat16).eval()
        for batch in (1, 64):
            ids = torch.tensor(random_prompts(cfg.vocab_size, batch, PROMPT), device="cuda")
            kwargs = dict(max_new_tokens=new, min_new_tokens=new, do_sample=False, pad_token_id=0)
            with torch.inference_mode():
                model.generate(ids[:, :16], max_new_tokens=4, min_new_tokens=4, do_sample=False, pad_token_id=0)
                torch.cuda.synchronize()
                start = time.perf_counter()
                model.generate(ids, **kwargs)
                torch.cuda.synchronize()
            elapsed = time.perf_counter() - start
            out[f"{name}/b{batch}/hf"] = {"tok_per_s": batch * new / elapsed, "seconds": elapsed}
            logger.info("HF %s batch %d: %.1f tok/s", name, batch, batch * new / elapsed)
        del model
        torch.cuda.empty_cache()
    return out


def prefill_part(root: str, limits: dict, shapes: list[str] = ("llama3-8b",), variants: list[str] = ("bf16",)) -> dict:
    """8 x 2,048-token prompts prefilled at once on each shape in each variant: tokens a second,
    and for a dense shape the model FLOPs over the matmul rate (a mixture of experts' depend on
    the routing: its rate alone)."""
    out = {}
    for name in shapes:
        for variant in variants:
            options, fields = VARIANTS[variant]
            label = case_name(name, variant, PROMPT)
            engine = engine_for(write_config(root, label, {**SHAPES[name], **fields}), True, max_batch=8, **options)
            cfg = engine.cfg
            prompts = random_prompts(cfg.vocab_size, 8, 2048, seed=1)
            sampling = SamplingParams(max_new_tokens=1, temperature=0.0, ignore_eos=True)
            engine.generate(prompt_token_ids=[p[:256] for p in prompts], sampling=sampling)  # warm-up (JIT)
            torch.cuda.synchronize()
            start = time.perf_counter()
            engine.generate(prompt_token_ids=prompts, sampling=sampling)
            torch.cuda.synchronize()
            elapsed = time.perf_counter() - start
            tokens = 8 * 2048
            figures = {"seconds": elapsed, "tok_per_s": tokens / elapsed}
            if cfg.moe is None and variant == "bf16":
                non_embedding = weight_bytes(engine) // 2 - cfg.vocab_size * cfg.hidden_size
                attn = 8 * 2 * 2 * cfg.num_layers * cfg.num_heads * cfg.head_dim * 2048 * 2049 // 2
                figures["flops"] = 2 * non_embedding * tokens + attn
                figures["of_matmul_peak"] = figures["flops"] / elapsed / limits["matmul_flops_per_s"]
            free(engine)
            out["prefill/8x2048" if label == "llama3-8b" else f"prefill/{label}/8x2048"] = figures
    return out


def draft_specs(root: str) -> dict[str, dict]:
    """Speculative settings for dummy 8B-shape drafts, 4 steps: a one-layer EAGLE head (the
    target's LM head), an EAGLE-3 head with a 32K-token draft vocabulary and its own LM head
    (as published EAGLE-3 heads for Llama-3.1-8B), a frozen-KV MTP head reading the last
    layer's KV, and the EAGLE-1 and MTP heads again with a 32K hot-token map
    (`speculative.token_map`)."""
    t = SHAPES["llama3-8b"]
    drafts = {
        "eagle": {**t, "architectures": ["LlamaForCausalLMEagle"], "num_hidden_layers": 1},
        "eagle3": {
            **t,
            "architectures": ["LlamaForCausalLMEagle3"],
            "num_hidden_layers": 1,
            "draft_vocab_size": 32000,
        },
        "frozen_kv_mtp": {**t, "architectures": ["FrozenKVMTPForCausalLM"], "kv_source_layers": [31]},
    }
    specs = {
        name: dummy_draft(root, f"llama3-8b-{name}", "eagle" if name == "eagle3" else name, config)
        for name, config in drafts.items()
    }
    hot = os.path.join(root, "hot-32k.json")
    with open(hot, "w") as f:
        json.dump(list(range(32000)), f)
    for name in ("eagle", "frozen_kv_mtp"):
        specs[f"{name}+map32k"] = {**specs[name], "token_map": hot}
    return specs


def assistant_specs(root: str) -> dict[str, dict]:
    """Gemma-4-31B's assistant (dummy weights of google/gemma-4-31B-it-assistant's shape), 4
    drafts a round."""
    return {"assistant": dummy_draft(root, "gemma4-31b-assistant", "mtp", GEMMA4_31B_ASSISTANT)}


def dummy_draft(root: str, name: str, algorithm: str, config: dict) -> dict:
    """The speculative settings of a dummy-weight draft of `config` (written as `name`), 4
    drafts every round: what a round costs (`ops.bench.adaptive_spec` measures adaptive)."""
    return {
        "algorithm": algorithm,
        "draft_model": write_config(root, name, config),
        "num_steps": 4,
        "adaptive": False,
        "draft_load_format": "dummy",
    }


# shape -> (case prefix, its drafts' settings)
SPEC_TARGETS = {
    "llama3-8b": ("spec", draft_specs),
    "gemma4-31b": ("spec/gemma4-31b", assistant_specs),
    "gpt-oss-20b": (
        "spec/gpt-oss-20b",
        lambda root: {"eagle3": dummy_draft(root, "gpt-oss-20b-eagle3", "eagle", GPT_OSS_20B_EAGLE3)},
    ),
    "gemma4-26b-a4b": (
        "spec/gemma4-26b-a4b",
        lambda root: {"assistant": dummy_draft(root, "gemma4-26b-a4b-assistant", "mtp", GEMMA4_26B_A4B_ASSISTANT)},
    ),
}


def spec_part(root: str, batch: int, drafts: list[str] | None, shape: str = "llama3-8b") -> dict:
    """Rounds against plain steps at `batch` requests on `shape` (one of `SPEC_TARGETS`);
    `drafts`: a subset of its drafts' names (default all); EAGLE-3 also runs with the verify
    ahead off, for comparison."""
    prefix, specs_of = SPEC_TARGETS[shape]
    target = write_config(root, shape, SHAPES[shape])
    out = {}
    prompts = random_prompts(SHAPES[shape]["vocab_size"], batch, PROMPT)
    at = "" if batch == 1 else f" b{batch}"
    plain = engine_for(target, True, max_batch=max(8, batch))
    run_batch(plain, prompts, 8)  # warm-up: first replays, lazy library state
    plain_r = {**run_batch(plain, prompts, NEW), "syncs_per_step": syncs_per_step(plain, prompts)}
    out[f"{prefix}/plain{at}"] = plain_r
    free(plain)
    del plain
    specs = {name: spec for name, spec in specs_of(root).items() if drafts is None or name in drafts}
    runs = [(name, spec, True) for name, spec in specs.items()]
    if "eagle3" in specs:
        runs.append(("eagle3 (no verify ahead)", specs["eagle3"], False))
    for name, spec, verify_ahead in runs:
        engine = engine_for(target, True, max_batch=max(8, batch), speculative=spec)
        engine.spec.verify_ahead = verify_ahead
        run_batch(engine, prompts, 8)
        r = run_batch(engine, prompts, NEW)
        r["syncs_per_step"] = syncs_per_step(engine, prompts)
        r["round_over_plain_step"] = r["ms_per_step"] / plain_r["ms_per_step"]
        r["rounds_verified_ahead"] = engine.spec.rounds_verified_ahead
        out[f"{prefix}/{name}{at}"] = r
        free(engine)
        del engine
    return out


def tiny_part() -> dict:
    import textwrap

    from workers.tokenizer import load_tokenizer

    tok = load_tokenizer(DEFAULT_MODEL)
    texts = [open(m.__file__).read() for m in (textwrap, json.decoder, argparse, contextlib)]
    out = {}
    for batch in (1, 16):
        prompts = [tok.encode(texts[i % len(texts)][(i // len(texts)) * 2000 :])[:192] for i in range(batch)]
        for algorithm in (None, *DRAFT_MODELS):
            drafts = {"algorithm": algorithm, "draft_model": DRAFT_MODELS.get(algorithm), "num_steps": 4}
            spec = {**drafts, "adaptive": False} if algorithm else None  # fixed rounds (adaptive: adaptive_spec)
            engine = Engine(
                model=DEFAULT_MODEL,
                device="cuda",
                page_size=16,
                max_total_tokens=16 * 1024,
                max_running_requests=16,
                speculative=spec,
            )
            run_batch(engine, prompts[:1], 8)  # warm-up
            out[f"tiny/b{batch}/{algorithm or 'plain'}"] = run_batch(engine, prompts, NEW)
            free(engine)
        plain = out[f"tiny/b{batch}/plain"]["tok_per_s"]
        for algorithm in DRAFT_MODELS:
            r = out[f"tiny/b{batch}/{algorithm}"]
            r["speedup"] = r["tok_per_s"] / plain
    return out


# -- report -------------------------------------------------------------------------------------------------
def table(results: dict) -> str:
    lim = results.get("ceilings", {})
    lines = []
    if lim:
        copy, mm = lim["copy_bytes_per_s"] / 1e12, lim["matmul_flops_per_s"] / 1e12
        lines.append(f"copy {copy:.2f} TB/s, bf16 matmul {mm:.0f} TFLOP/s")
    lines.append(f"{'case':<28} {'tok/s':>9} {'ms/step':>8} {'roofline':>9} {'of roof':>8} {'x HF':>6}")
    for key, r in results.items():
        if not isinstance(r, dict) or "tok_per_s" not in r or key.endswith("/hf"):
            continue
        name = key.split("/")[0]
        batch = key.split("/")[1] if len(key.split("/")) > 2 else ""
        hf = results.get(f"{name}/{batch}/hf", {}).get("tok_per_s")
        x_hf = f"{r['tok_per_s'] / hf:.1f}" if hf and key.endswith("graphs") else ""
        roof = f"{r['roofline_tok_per_s']:.0f}" if "roofline_tok_per_s" in r else ""
        of = f"{100 * r['of_roofline']:.0f}%" if "of_roofline" in r else ""
        extra = ""
        if "of_matmul_peak" in r:
            extra = f"  {100 * r['of_matmul_peak']:.0f}% of matmul peak"
        if "round_over_plain_step" in r:
            extra = f"  round = {r['round_over_plain_step']:.2f} x plain step, {r['syncs_per_step']:.1f} syncs"
        if "syncs_per_step" in r and "round_over_plain_step" not in r:
            extra = f"  {r['syncs_per_step']:.1f} syncs/step"
        if r.get("accept_length"):
            extra += f"  accept {r['accept_length']:.2f}"
        if "speedup" in r:
            extra += f"  speedup {r['speedup']:.2f}"
        lines.append(
            f"{key:<28} {r['tok_per_s']:>9.1f} {r.get('ms_per_step', 0):>8.2f} {roof:>9} {of:>8} {x_hf:>6}{extra}"
        )
    for key, r in results.items():
        if key.endswith("/hf"):
            lines.append(f"{key:<28} {r['tok_per_s']:>9.1f}")
        if key.endswith("/kv_capacity"):
            vs = f" ({r['kv_capacity_vs_bf16']:.2f}x bf16's)" if "kv_capacity_vs_bf16" in r else ""
            lines.append(f"{key:<28} {r['kv_capacity_tokens']:,} KV tokens in {r['mem_fraction']:.0%} of memory{vs}")
    return "\n".join(lines)


COLUMNS = [
    "tok_per_s",
    "ms_per_step",
    "roofline_tok_per_s",
    "of_roofline",
    "round_over_plain_step",
    "syncs_per_step",
    "accept_length",
    "speedup",
    "of_matmul_peak",
    "weight_read_GB",
    "kv_read_GB",
    "kv_capacity_tokens",
    "kv_capacity_vs_bf16",
    "copy_TBps",
    "matmul_TFLOPs",
]


def cases(results: dict) -> dict[str, dict]:
    """The recorded figures: every measured case, and the ceilings its ratios were taken against."""
    out = {k: v for k, v in results.items() if isinstance(v, dict) and k != "ceilings"}
    lim = results["ceilings"]
    return {
        "ceilings": {"copy_TBps": lim["copy_bytes_per_s"] / 1e12, "matmul_TFLOPs": lim["matmul_flops_per_s"] / 1e12},
        **out,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", required=True)
    parser.add_argument("--parts", default="ceilings,decode,hf,prefill,spec,tiny")
    parser.add_argument("--shapes", default=",".join(DEFAULT_SHAPES), help=f"of {', '.join(SHAPES)}")
    parser.add_argument("--modes", default="graphs,eager", help="decode with CUDA graphs, eagerly, or both")
    parser.add_argument(
        "--variants", default="bf16", help=f"the decode part's weights and KV, of {', '.join(VARIANTS)}"
    )
    parser.add_argument("--prompt", type=int, default=PROMPT, help="the decode part's prompt tokens a request")
    parser.add_argument("--prefill-shapes", default="llama3-8b", help="the prefill part's shapes (in --variants)")
    parser.add_argument("--batches", default=",".join(map(str, BATCHES)), help="the decode part's batch sizes")
    parser.add_argument("--mem-fraction", type=float, default=MEM_FRACTION, help="of GPU memory, for KV capacity")
    parser.add_argument("--spec-batch", type=int, default=1, help="requests a speculative round serves")
    parser.add_argument("--spec-drafts", default=None, help="the spec part's drafts, comma-separated (default all)")
    parser.add_argument("--spec-shape", default="llama3-8b", choices=sorted(SPEC_TARGETS), help="spec part target")
    add_record_args(parser)
    args = parser.parse_args()
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    parts, shapes = args.parts.split(","), args.shapes.split(",")
    unknown = sorted(set(args.variants.split(",")) - set(VARIANTS))
    if unknown:
        parser.error(f"--variants: unknown {unknown}; choose from {list(VARIANTS)}")
    results: dict = {"device": torch.cuda.get_device_name(), "torch": torch.__version__}
    root = tempfile.mkdtemp(prefix="shapes-")
    results["ceilings"] = ceilings()
    steps = {
        "decode": lambda: decode_part(
            root,
            results["ceilings"],
            shapes,
            args.modes.split(","),
            args.variants.split(","),
            args.prompt,
            tuple(int(b) for b in args.batches.split(",")),
            args.mem_fraction,
        ),
        "hf": lambda: hf_part(root, [s for s in shapes if s in ("llama3-8b", "gemma3-1b")]),
        "prefill": lambda: prefill_part(
            root, results["ceilings"], args.prefill_shapes.split(","), args.variants.split(",")
        ),
        "spec": lambda: spec_part(
            root, args.spec_batch, args.spec_drafts and args.spec_drafts.split(","), args.spec_shape
        ),
        "tiny": tiny_part,
    }
    for part in parts:
        if part in steps:
            results.update(steps[part]())
            with open(args.out, "w") as f:
                json.dump(results, f, indent=1)
    print(table(results))
    record_run(args, "decode_throughput", cases(results), COLUMNS)


if __name__ == "__main__":
    main()
