"""An FP8 (e4m3) KV cache on the shipped trained tiny models (CPU float32 and, marked `gpu`, CUDA
bf16 through trtllm_mha): speculative decoding stays lossless against plain decoding over the same
FP8 cache. Its greedy agreement with the model's dtype, held-out perplexity and slot bytes are
measured beside FP8 weights' in test_fp8_quality.py, from this module's held-out text."""

import os

import pytest
import torch

from ops import MODELS_DIR
from ops.train_tiny_models import DRAFTS, TARGET, is_held_out, stdlib_files
from workers.engine import Engine, SamplingParams

TARGET_DIR = os.path.join(MODELS_DIR, TARGET)
NEW_TOKENS = 256
PROMPT_TOKENS = 128
DEVICES = [
    pytest.param(("cpu", "float32", "torch_native"), id="cpu"),
    pytest.param(("cuda", "bfloat16", "trtllm_mha"), id="cuda", marks=pytest.mark.gpu),
]


def held_out_ids() -> list[list[int]]:
    """Token ids of three held-out standard-library files, each cut to a prompt plus the
    reference continuation's length."""
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(TARGET_DIR)
    texts = [text for rel, text in stdlib_files() if is_held_out(rel) and len(text) > 20000][:3]
    return [tok.encode(text)[: PROMPT_TOKENS + NEW_TOKENS] for text in texts]


@pytest.fixture(scope="module")
def held_out() -> list[list[int]]:
    return held_out_ids()


def _engine(device: tuple, kv: str, **kw) -> Engine:
    dev, dtype, backend = device
    if dev == "cuda" and not torch.cuda.is_available():
        pytest.skip("needs CUDA")
    return Engine(
        model=TARGET_DIR,
        device=dev,
        dtype=dtype,
        attention_backend=backend,
        kv_cache_dtype=kv,
        max_total_tokens=4096,
        **kw,
    )


def _prompt_logprobs(engine: Engine, ids: list[list[int]]) -> list:
    sp = SamplingParams(max_new_tokens=1, temperature=0.0, prompt_logprobs=1)
    return [o.prompt_logprobs for o in engine.generate(prompt_token_ids=ids, sampling=sp)]


@pytest.mark.parametrize("algorithm", ["standalone", "eagle", "frozen_kv_mtp"])
@pytest.mark.parametrize("device", DEVICES)
def test_speculation_over_an_fp8_cache_is_lossless(device, algorithm, held_out):
    """Greedy tokens with each shipped draft equal plain decoding's over the same FP8 cache (on
    the GPU: up to a first divergence where the two paths' bf16 logits tie, as the engine's GPU
    tests measure it)."""
    from tests.workers.test_gpu_engine import compare_bf16_runs

    prompts = [ids[:PROMPT_TOKENS] for ids in held_out]
    sp = SamplingParams(max_new_tokens=48, temperature=0.0, ignore_eos=True, return_logits=device[0] == "cuda")
    plain = _engine(device, "fp8_e4m3").generate(prompt_token_ids=prompts, sampling=sp)
    spec = {"algorithm": algorithm, "draft_model": os.path.join(MODELS_DIR, DRAFTS[algorithm]), "num_steps": 3}
    engine = _engine(device, "fp8_e4m3", speculative=spec)
    outs = engine.generate(prompt_token_ids=prompts, sampling=sp)
    engine.check_no_leak()
    lengths = [n for o in outs for n in o.spec.accept_lengths]
    print(f"{device[0]} {algorithm}: mean accept length {sum(lengths) / len(lengths):.2f}")
    if device[0] == "cpu":
        assert [o.token_ids for o in outs] == [o.token_ids for o in plain]
    else:
        compare_bf16_runs(plain, outs, algorithm)
