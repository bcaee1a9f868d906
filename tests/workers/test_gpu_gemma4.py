"""Gemma 4 on the GPU: trtllm_mha at both of its head widths (256 on sliding layers: FMHA-v2 and
XQA; 512 on full layers whose V is the K projection: one query a row through XQA and the
split-KV decode) against torch_native, bf16, greedy, with per-layer embeddings and KV-shared
layers; plain decoding, a standalone draft (verify batches of several requests) and the Gemma 4
assistant over the target's KV, CUDA graphs on, no KV leaked. Logits agree within bf16 noise up
to each request's first differing token (tests/workers/test_gpu_engine.py).

Gemma 4 scales attention logits by 1 (its q/k norms stand in for 1/sqrt(d)); with the norms'
weights at their initial ones, a random tiny model's logits reach the head size and bf16's
rounding of q alone moves them by units. The tiny model's q-norm weights are set to
1/sqrt(head size), as a trained model's keep its logits in range."""

import os

import pytest
import torch
import transformers
from safetensors.torch import load_file, save_file

from tests.draft_models import make_gemma4_assistant, make_perturbed_copy
from tests.hf_models import WINDOW, make_tiny_model, random_prompts
from tests.workers.test_gpu_engine import compare_bf16_runs
from workers.engine import Engine, SamplingParams

pytestmark = pytest.mark.gpu

# Twice the bf16 bound of the other models' test: a random Gemma 4 (per-layer inputs, layer
# scalars, double-wide MLPs) carries more rounding through a step; a wrong kernel is off by O(1).
GEMMA4_NOISE = 2.0**-4
HAS_ASSISTANT = hasattr(transformers, "Gemma4AssistantForCausalLM")
GREEDY = SamplingParams(max_new_tokens=48, temperature=0.0, ignore_eos=True, return_logits=True)


def make_gpu_gemma4(target: str) -> str:
    """A tiny Gemma 4 of the widths the GPU kernels take (sliding head dim 256, full 512, one
    global KV head), its query norms scaled down so that attention is not one-hot."""
    make_tiny_model(
        "gemma4",
        target,
        hidden_size=256,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=256,
        global_head_dim=512,
        num_global_key_value_heads=1,
    )
    return scale_query_norms(target)


def scale_query_norms(target: str) -> str:
    """A tiny Gemma 4's query-norm weights scaled by 1/sqrt(head size), as a trained model's keep
    its attention logits in range (at their initial ones bf16's rounding of q moves them by units)."""
    weights = os.path.join(target, "model.safetensors")
    tensors = load_file(weights)
    for name, w in tensors.items():
        if name.endswith("q_norm.weight"):
            tensors[name] = w / w.numel() ** 0.5
    save_file(tensors, weights, metadata={"format": "pt"})
    return target


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    if not torch.cuda.is_available():
        pytest.skip("needs CUDA")
    root = tmp_path_factory.mktemp("gpu-gemma4")
    target = make_gpu_gemma4(str(root / "gemma4"))
    return {
        "target": target,
        "standalone": make_perturbed_copy(target, str(root / "draft"), noise=0.05),
        # transformers' assistant classes came after its Gemma 4 (an older install skips that case)
        "assistant": make_gemma4_assistant(target, str(root / "assistant")) if HAS_ASSISTANT else None,
    }


def _engine(models, backend: str, draft: str | None, page_size: int) -> Engine:
    algorithm = {"standalone": "standalone", "assistant": "mtp"}.get(draft)
    spec = {"algorithm": algorithm, "draft_model": models[draft], "num_steps": 4, "adaptive": False} if draft else None
    return Engine(
        model=models["target"],
        device="cuda",
        dtype="bfloat16",
        page_size=page_size,
        attention_backend=backend,
        max_total_tokens=16384,
        context_length=1024,
        max_running_requests=8,
        speculative=spec,
    )


@pytest.mark.parametrize("page_size", [16, 64])
@pytest.mark.parametrize("draft", [None, "standalone", "assistant"], ids=["plain", "standalone", "assistant"])
def test_trtllm_mha_matches_torch_native_on_both_head_widths(models, draft, page_size):
    if draft is not None and models[draft] is None:
        pytest.skip(f"transformers {transformers.__version__} has no Gemma 4 assistant")
    prompts = random_prompts([3 * WINDOW + 7, 40, 2 * WINDOW + 1, 300], seed=5)
    runs = []
    for backend in ("torch_native", "trtllm_mha"):
        eng = _engine(models, backend, draft, page_size)
        runs.append(eng.generate(prompt_token_ids=prompts, sampling=GREEDY))
        eng.flush_cache()
        eng.check_no_leak()
        eng.shutdown()
    diverged, worst = compare_bf16_runs(*runs, f"gemma4 draft={draft} page={page_size}", noise=GEMMA4_NOISE)
    print(f"gemma4 draft={draft} page={page_size}: {diverged} of {len(prompts)} diverged, worst {worst:.3g}")
    assert diverged <= 1
