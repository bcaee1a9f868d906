"""Tensor parallelism on two GPUs: NCCL for the model's collectives, gloo for the step plans;
trtllm_mha in bf16, with and without speculative decoding, against one GPU. Logits agree within
bf16 noise up to any first divergence (reduction order differs between 1 and 2 ranks)."""

import pytest
import torch

from tests.draft_models import make_perturbed_copy
from tests.hf_models import make_tiny_model
from tests.workers.test_gpu_engine import compare_bf16_runs
from tests.workers.test_tensor_parallel import PROMPTS, run_tp
from workers.engine import Engine, SamplingParams

pytestmark = pytest.mark.gpu
SAMPLING = SamplingParams(max_new_tokens=32, temperature=0.0, ignore_eos=True, return_logits=True)


@pytest.mark.parametrize("speculative", [False, True])
def test_two_gpu_tensor_parallel_matches_one_gpu(tmp_path, speculative):
    if torch.cuda.device_count() < 2:
        pytest.skip("needs 2 GPUs")
    target = str(tmp_path / "gemma3")
    make_tiny_model(
        "gemma3", target, hidden_size=256, head_dim=64, num_attention_heads=4, num_key_value_heads=2, sliding_window=32
    )
    kwargs = dict(
        model=target,
        device="cuda",
        dtype="bfloat16",
        page_size=16,
        chunked_prefill_size=64,
        attention_backend="trtllm_mha",
        debug_kv_checks=True,
    )
    if speculative:
        draft = make_perturbed_copy(target, str(tmp_path / "draft"), noise=0.0)
        kwargs["speculative"] = {"algorithm": "standalone", "draft_model": draft, "num_steps": 4, "draft_pool": "full"}
    ref = Engine(**kwargs).generate(prompt_token_ids=PROMPTS, sampling=SAMPLING)
    got = run_tp(2, kwargs, SAMPLING)
    diverged, worst = compare_bf16_runs(ref, got, f"tp2 speculative={speculative}")
    lengths = [n for o in got if o.spec for n in o.spec.accept_lengths]
    print(
        f"tp2 speculative={speculative}: {diverged} of {len(PROMPTS)} diverged, largest logit difference {worst:.3g}"
        + (f", mean accept length {sum(lengths) / len(lengths):.2f}" if lengths else "")
    )
