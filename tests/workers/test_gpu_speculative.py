"""Speculative decoding on the GPU: trtllm_mha (XQA verify with the chain mask, FMHA-v2 draft
extend), bf16, greedy. A copy of the target as standalone draft is accepted in full; EAGLE and
frozen-KV heads run every forward mode; logits agree with decoding without speculation within
bf16 noise up to any first divergence (the criterion of the engine's GPU test)."""

import pytest

from tests.draft_models import make_eagle_head, make_frozen_kv_head, make_perturbed_copy
from tests.hf_models import make_tiny_model, random_prompts
from tests.workers.test_gpu_engine import compare_bf16_runs
from workers.engine import Engine, SamplingParams

pytestmark = pytest.mark.gpu
K = 4


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    root = tmp_path_factory.mktemp("gpu_spec")
    target = str(root / "gemma3")
    make_tiny_model(
        "gemma3", target, hidden_size=256, head_dim=64, num_attention_heads=4, num_key_value_heads=2, sliding_window=32
    )
    return {
        "target": target,
        "standalone": make_perturbed_copy(target, str(root / "copy"), noise=0.0),
        "eagle": make_eagle_head(target, str(root / "eagle3"), 3),
        "frozen_kv_mtp": make_frozen_kv_head(target, str(root / "frozen")),
    }


@pytest.mark.parametrize("algorithm", ["standalone", "eagle", "frozen_kv_mtp"])
def test_speculative_trtllm_mha_on_gpu(models, algorithm):
    prompts = random_prompts([150, 40, 97, 300])
    sp = SamplingParams(max_new_tokens=64, temperature=0.0, ignore_eos=True, return_logits=True)
    common = dict(
        device="cuda",
        dtype="bfloat16",
        page_size=16,
        attention_backend="trtllm_mha",
        chunked_prefill_size=64,
        debug_kv_checks=True,
    )
    base = Engine(model=models["target"], **common)
    ref = base.generate(prompt_token_ids=prompts, sampling=sp)
    spec = {"algorithm": algorithm, "draft_model": models[algorithm], "num_steps": K, "adaptive": False}
    if algorithm == "standalone":
        spec["draft_pool"] = "full"
    eng = Engine(model=models["target"], speculative=spec, **common)
    outs = eng.generate(prompt_token_ids=prompts, sampling=sp)
    eng.check_no_leak()
    diverged, worst = compare_bf16_runs(ref, outs, algorithm)
    lengths = [n for o in outs for n in o.spec.accept_lengths]
    print(
        f"{algorithm}: {diverged} of {len(prompts)} requests diverged (largest logit difference {worst:.3g}); "
        "mean accept length "
        f"{sum(lengths) / len(lengths):.2f} over {len(lengths)} verify steps"
    )
    if algorithm == "standalone":
        assert sum(lengths) / len(lengths) > K + 0.5


@pytest.mark.parametrize("algorithm", ["standalone", "eagle", "frozen_kv_mtp"])
def test_greedy_round_reads_the_device_once(models, algorithm):
    """Under CUDA graphs a greedy round keeps its drafts on the device: the host waits for the
    device once per round (the verified tokens), as in a plain decode step."""
    from ops.bench.decode_throughput import sync_sites

    spec = {"algorithm": algorithm, "draft_model": models[algorithm], "num_steps": K, "adaptive": False}
    eng = Engine(model=models["target"], device="cuda", dtype="bfloat16", page_size=16, speculative=spec)
    sp = SamplingParams(max_new_tokens=200, temperature=0.0, ignore_eos=True)
    rids = [eng.add_request(p, sp) for p in random_prompts([150, 40, 97])]
    while any(not r.prefilled for r in eng.scheduler.running):
        eng.step()
    eng.step()
    rounds = 6
    sites = sync_sites(eng, rounds)
    assert sum(sites.values()) <= rounds, f"{algorithm}: host syncs per round {sites}"
    while eng.has_unfinished():
        eng.step()
    for rid in rids:
        eng.release(rid)
    eng.check_no_leak()


@pytest.mark.parametrize("algorithm", ["standalone", "eagle", "frozen_kv_mtp"])
def test_a_round_at_the_models_last_position_under_graph_replay(models, algorithm):
    """The verify's and the drafts' positions past a request that ends at the model's last
    position (and the overlapped plain step launched past it) stay inside the RoPE tables: the
    request ends by length with the tokens of decoding without speculation (bf16 criterion), no
    error, every pool back at its free count."""
    limit = 1024  # make_tiny_model's max_position_embeddings
    prompt = random_prompts([limit - 6])[0]
    sp = SamplingParams(max_new_tokens=20, temperature=0.0, ignore_eos=True, return_logits=True)
    common = dict(device="cuda", dtype="bfloat16", page_size=16, attention_backend="trtllm_mha", max_total_tokens=4096)
    base = Engine(model=models["target"], **common)
    ref = base.generate(prompt_token_ids=[prompt], sampling=sp)
    spec = {"algorithm": algorithm, "draft_model": models[algorithm], "num_steps": K}
    eng = Engine(model=models["target"], speculative=spec, **common)
    outs = eng.generate(prompt_token_ids=[prompt], sampling=sp)
    assert eng.runner.graphs is not None and eng.runner.graphs.replays > 0  # replayed, not eager
    assert [(o.finish_reason, len(o.token_ids)) for o in ref + outs] == [("length", 6)] * 2
    diverged, _ = compare_bf16_runs(ref, outs, f"{algorithm} at the last position")
    assert diverged == 0
    base.check_no_leak()
    eng.check_no_leak()
