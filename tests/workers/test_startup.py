"""Start-up: each phase is logged with counts and elapsed time (weights, kernels compiled, graphs
captured n of m), and the warm-up request that compiles the kernels leaves nothing behind: the
engine afterwards gives the same tokens (greedy, seeded and unseeded sampling) and request ids as
one that did not warm up, with every pool at its free count and an empty prefix cache."""

import logging
import re

import pytest

from tests.draft_models import make_eagle_head, make_frozen_kv_head
from tests.hf_models import WINDOW, make_tiny_model, random_prompts
from workers.engine import Engine, SamplingParams

PROMPTS = random_prompts([2 * WINDOW + 5, 9, WINDOW + 3], seed=3)
SAMPLINGS = [
    SamplingParams(max_new_tokens=12, temperature=0.0, ignore_eos=True),
    SamplingParams(max_new_tokens=12, temperature=0.9, seed=5, ignore_eos=True),
    SamplingParams(max_new_tokens=12, temperature=0.9, ignore_eos=True),  # its seed from the engine's
]


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    root = tmp_path_factory.mktemp("startup")
    target = str(root / "gemma3")
    make_tiny_model("gemma3", target)
    return {
        "target": target,
        "eagle": make_eagle_head(target, str(root / "eagle"), 1),
        "mtp": make_frozen_kv_head(target, str(root / "mtp")),
    }


def _engine(models, draft: str | None, warmup: bool, graphs=False) -> Engine:
    algorithm = {"eagle": "eagle", "mtp": "frozen_kv_mtp"}.get(draft)
    return Engine(
        model=models["target"],
        page_size=4,
        attention_backend="trtllm_mha",
        max_total_tokens=1024,
        context_length=256,
        max_running_requests=4,
        speculative={"algorithm": algorithm, "draft_model": models[draft], "num_steps": 3, "adaptive": False}
        if draft
        else None,
        cuda_graphs=graphs,
        warmup=warmup,
    )


@pytest.mark.parametrize("draft", [None, "eagle", "mtp"])
def test_the_warm_up_request_leaves_no_trace(models, draft):
    cold, warm = (_engine(models, draft, warmup) for warmup in (False, True))
    assert warm.kv_stats() == cold.kv_stats()  # every slot free again, nothing cached
    assert not warm.cache.root.children and not cold.cache.root.children
    outs = [eng.generate(prompt_token_ids=PROMPTS, sampling=SAMPLINGS) for eng in (cold, warm)]
    for a, b in zip(*outs):
        assert (a.request_id, a.token_ids, a.cached_tokens) == (b.request_id, b.token_ids, b.cached_tokens)
    for eng in (cold, warm):
        eng.check_no_leak()


def test_every_phase_is_logged_with_counts_and_elapsed_time(models, caplog):
    caplog.set_level(logging.INFO, logger="slidespec.startup")
    _engine(models, "eagle", warmup=True, graphs="emulate")
    lines = [r.getMessage() for r in caplog.records if r.name == "slidespec.startup"]
    text = "\n".join(lines)
    for phase in ("target weights", "draft weights", "kernels compiled", "graphs captured"):
        assert re.search(rf"engine start-up: {phase} done in \d+\.\d s \(\d+\.\d s since start\)", text), text
    assert (
        re.search(r"kernels compiled for 1 of 2: prefill", text)
        and "kernels compiled for 2 of 2: speculative round" in text
    )
    counted = [tuple(map(int, m)) for m in re.findall(r"graphs captured (\d+) of (\d+)", text)]
    assert counted and counted[-1][0] == counted[-1][1] and all(a < b for (a, _), (b, _) in zip(counted, counted[1:]))
    assert lines[-1].startswith("engine start-up: ready in")
