"""Start-up on the GPU: the warm-up request compiles every forward kind's kernels before the
engine is ready (a first request then compiles nothing: its prefill runs at the speed of later
ones) and leaves no trace: tokens, request ids, pools and the prefix cache are as without it, with
CUDA graphs captured after it."""

import logging
import re
import time

import pytest
import torch

from tests.draft_models import make_eagle_head
from tests.hf_models import make_tiny_model, random_prompts
from workers.engine import Engine, SamplingParams

pytestmark = pytest.mark.gpu

GREEDY = SamplingParams(max_new_tokens=24, temperature=0.0, ignore_eos=True)
SAMPLED = SamplingParams(max_new_tokens=24, temperature=0.8, ignore_eos=True)  # seeds from the engine


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    if not torch.cuda.is_available():
        pytest.skip("needs CUDA")
    root = tmp_path_factory.mktemp("gpu-startup")
    target = str(root / "gemma3")
    make_tiny_model("gemma3", target, hidden_size=256, head_dim=64, num_attention_heads=4, num_key_value_heads=2)
    return {"target": target, "eagle": make_eagle_head(target, str(root / "eagle"), 1)}


def _engine(models, warmup: bool, draft: bool) -> Engine:
    spec = {"algorithm": "eagle", "draft_model": models["eagle"], "num_steps": 3, "adaptive": False} if draft else None
    return Engine(
        model=models["target"],
        device="cuda",
        dtype="bfloat16",
        page_size=16,
        max_total_tokens=8192,
        context_length=1024,
        max_running_requests=8,
        speculative=spec,
        warmup=warmup,
    )


@pytest.mark.parametrize("draft", [False, True], ids=["plain", "eagle"])
def test_warm_engine_gives_the_cold_engines_tokens_and_state(models, draft, caplog):
    caplog.set_level(logging.INFO, logger="slidespec.startup")
    prompts = random_prompts([200, 31, 77], seed=11)
    outs = []
    for warmup in (False, True):
        eng = _engine(models, warmup, draft)
        free = eng.kv_stats()
        start = time.perf_counter()
        first = eng.generate(prompt_token_ids=prompts[:1], sampling=GREEDY)
        first_s = time.perf_counter() - start
        outs.append((first, eng.generate(prompt_token_ids=prompts, sampling=[GREEDY, SAMPLED, GREEDY]), first_s))
        eng.flush_cache()
        assert eng.kv_stats() == free
        eng.check_no_leak()
        eng.shutdown()
    (cold_first, cold, _), (warm_first, warm, warm_first_s) = outs
    assert [o.token_ids for o in warm_first] == [o.token_ids for o in cold_first]
    assert [(o.request_id, o.token_ids) for o in warm] == [(o.request_id, o.token_ids) for o in cold]
    text = "\n".join(r.getMessage() for r in caplog.records)
    assert re.search(r"kernels compiled done in \d+\.\d s", text), text
    assert re.search(r"graphs captured (\d+) of \1", text), text
    print(f"first request after a warm start: {warm_first_s * 1e3:.0f} ms")
