"""An FP8 (e4m3) KV cache measured against the model's own dtype on the shipped trained tiny
models (CPU float32 and, marked `gpu`, CUDA bf16 through trtllm_mha):

- greedy agreement: the FP8 engine, fed the reference's greedy continuation, picks the same next
  token at >= 95% of its positions (teacher-forced, so one early divergence cannot hide the rest);
- held-out perplexity within 1% (text from standard-library files the training script holds out);
- a slot holds half the bytes (the same memory holds twice the tokens);
- speculative decoding stays lossless against plain decoding over the same FP8 cache.
"""

import math
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


@pytest.fixture(scope="module")
def held_out() -> list[list[int]]:
    """Token ids of three held-out standard-library files, each cut to a prompt plus the
    reference continuation's length."""
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(TARGET_DIR)
    texts = [text for rel, text in stdlib_files() if is_held_out(rel) and len(text) > 20000][:3]
    return [tok.encode(text)[: PROMPT_TOKENS + NEW_TOKENS] for text in texts]


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


@pytest.mark.parametrize("device", DEVICES)
def test_fp8_cache_agrees_with_the_models_dtype(device, held_out):
    reference, fp8 = _engine(device, "auto"), _engine(device, "fp8_e4m3")
    prompts = [ids[:PROMPT_TOKENS] for ids in held_out]
    greedy = SamplingParams(max_new_tokens=NEW_TOKENS, temperature=0.0, ignore_eos=True)
    continued = [p + o.token_ids for p, o in zip(prompts, reference.generate(prompt_token_ids=prompts, sampling=greedy))]
    forced = _prompt_logprobs(fp8, continued)
    same = total = 0
    for ids, lp in zip(continued, forced):
        for pos in range(PROMPT_TOKENS, len(ids)):  # lp entry pos - 1 predicts token pos
            total += 1
            same += lp.top_ids[pos - 1][0] == ids[pos]
    agreement = same / total
    nll = {}
    for name, engine in (("auto", reference), ("fp8", fp8)):
        entries = [x for lp in _prompt_logprobs(engine, held_out) for x in lp.token]
        nll[name] = -sum(entries) / len(entries)
    ppl = {k: math.exp(v) for k, v in nll.items()}
    print(f"{device[0]}: greedy agreement {agreement:.2%}, held-out perplexity {ppl['auto']:.3f} -> {ppl['fp8']:.3f}")
    assert agreement >= 0.95
    assert abs(ppl["fp8"] / ppl["auto"] - 1) <= 0.01
    ref_bytes, fp8_bytes = reference.kv_slot_bytes, fp8.kv_slot_bytes
    assert all(fp8_bytes[k] * (4 if device[0] == "cpu" else 2) == ref_bytes[k] for k in ref_bytes)
    fp8.check_no_leak()


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
