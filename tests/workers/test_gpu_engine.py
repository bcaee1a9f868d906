"""End to end on the GPU: trtllm_mha (XQA + FMHA-v2) against torch_native, bf16, greedy.

bf16 rounding differs between the two paths, so a token may differ where the reference's top
two logits (nearly) tie; every first divergence must be such a tie, and the count is printed.
Logits come out of a bf16 LM head, so they are bf16 values: a tie is a gap within 1e-3 of the
top logit or within one bf16 step (ulp) of it, the finest gap bf16 can show.
"""

import math


import pytest
import torch

from tests.hf_models import make_tiny_model, random_prompts
from workers.engine import Engine, SamplingParams

pytestmark = pytest.mark.gpu


def tie_threshold(top: float) -> float:
    ulp = torch.finfo(torch.bfloat16).eps * 2.0 ** math.floor(math.log2(max(abs(top), 1e-30)))
    return max(1e-3 * abs(top), ulp)


@pytest.mark.parametrize("name", ["gemma3", "gemma2", "mistral", "qwen3"])
@pytest.mark.parametrize("page_size", [16, 64])
def test_trtllm_mha_matches_torch_native_on_gpu(tmp_path, name, page_size):
    if not torch.cuda.is_available():
        pytest.skip("needs CUDA")
    path = str(tmp_path / name)
    make_tiny_model(name, path, hidden_size=256, head_dim=64, num_attention_heads=4, num_key_value_heads=2,
                    sliding_window=32 if name != "qwen3" else None)
    prompts = random_prompts([150, 40, 97, 300])
    sp = SamplingParams(max_new_tokens=64, temperature=0.0, ignore_eos=True, return_logits=True)
    runs = {}
    for backend in ("torch_native", "trtllm_mha"):
        eng = Engine(model=path, device="cuda", dtype="bfloat16", page_size=page_size, attention_backend=backend,
                     chunked_prefill_size=64, debug_kv_checks=True)
        runs[backend] = eng.generate(prompt_token_ids=prompts, sampling=sp)
        eng.check_no_leak()
    differing, near_ties = 0, 0
    for ref, out in zip(runs["torch_native"], runs["trtllm_mha"]):
        for step, (a, b) in enumerate(zip(ref.token_ids, out.token_ids)):
            if a != b:
                top2 = ref.logits[step].float().topk(2).values
                gap, tie = (top2[0] - top2[1]).item(), tie_threshold(top2[0].item())
                differing += 1
                near_ties += gap <= tie
                assert gap <= tie, f"{name} page {page_size}: step {step} differs with a logit gap of {gap:.3g} (tie: {tie:.3g})"
                break
    print(f"{name} page {page_size}: {differing} of {len(prompts)} requests diverged (all at ties: {near_ties})")
