"""Tensor parallelism without Ray: 2 and 4 processes (gloo) run `RankLoop` in lockstep and give
the same greedy tokens as one process, with and without speculative decoding (draft sharded or
replicated on every rank), on a hybrid SWA model (4 ranks replicate its 2 KV heads). A second
wave reuses the first's prefixes: every rank's prefix cache makes the same hits, and after a
flush broadcast in the plan every rank's pools end full. Gemma 4 (two attention geometries, KV
sharing, per-layer embeddings) on two ranks too, also drafted by its assistant (sharded, reading
each rank's shard of the target's KV), and the mixtures of experts of Gemma 4 and gpt-oss, split
by tensor and by expert. The groups are tests.workers.rank_group's (the two-rank one shared by
the suite); the same runs on GPUs with NCCL are in test_gpu_tensor_parallel.py."""

import pytest

from tests.draft_models import make_eagle_head, make_gemma4_assistant, make_perturbed_copy
from tests.hf_models import make_tiny_model
from tests.workers.rank_group import FIRST, GREEDY, PROMPTS, run_tp
from tests.workers.test_moe import quantize_checkpoint_mxfp4, record_routes
from workers.engine import Engine


@pytest.fixture(scope="module")
def model_dirs(tmp_path_factory):
    root = tmp_path_factory.mktemp("tp")
    target = str(root / "gemma3")
    make_tiny_model("gemma3", target)
    return {
        "target": target,
        "draft": make_perturbed_copy(target, str(root / "draft"), noise=0.1),
        "eagle": make_eagle_head(target, str(root / "eagle"), 1),
    }


@pytest.mark.parametrize(
    "world, speculative", [(2, None), (2, "standalone"), (2, "standalone-replicated"), (4, "eagle")]
)
def test_tensor_parallel_matches_one_rank(model_dirs, tp2, world, speculative):
    kwargs = dict(
        model=model_dirs["target"],
        page_size=4,
        chunked_prefill_size=8,
        max_total_tokens=2048,
        attention_backend="trtllm_mha",
    )
    if speculative in ("standalone", "standalone-replicated"):
        kwargs["speculative"] = {
            "algorithm": "standalone",
            "draft_model": model_dirs["draft"],
            "num_steps": 3,
            "draft_tp": "replicate" if speculative.endswith("replicated") else "shard",
            "adaptive": False,  # fixed rounds: one rank's accept lengths are the group's
        }
    elif speculative == "eagle":
        kwargs["speculative"] = {"algorithm": "eagle", "draft_model": model_dirs["eagle"], "num_steps": 3}
        kwargs["speculative"]["adaptive"] = False
    single = Engine(**kwargs)
    ref = single.generate(prompt_token_ids=FIRST, sampling=GREEDY)
    ref += single.generate(prompt_token_ids=PROMPTS[len(FIRST) :], sampling=GREEDY)
    got = tp2.run_each([kwargs])[0] if world == 2 else run_tp(world, kwargs)
    assert [o.token_ids for o in got] == [o.token_ids for o in ref]
    assert [o.cached_tokens for o in got] == [o.cached_tokens for o in ref]
    assert min(o.cached_tokens for o in got[len(FIRST) :]) >= 8
    if speculative:
        assert [o.spec.accept_lengths for o in got] == [o.spec.accept_lengths for o in ref]


def test_a_group_runs_the_draft_lengths_rank_0_chose(model_dirs, tp2):
    """Adaptive draft lengths on two ranks: each rank times its own steps, and every decode step
    runs what rank 0's controller chose (the step plan carries it), so the ranks stay in lockstep
    through rounds and plain steps; greedy tokens equal one rank's without speculation."""
    kwargs = dict(
        model=model_dirs["target"],
        page_size=4,
        chunked_prefill_size=8,
        max_total_tokens=2048,
        attention_backend="trtllm_mha",
    )
    single = Engine(**kwargs)
    ref = single.generate(prompt_token_ids=FIRST, sampling=GREEDY)
    ref += single.generate(prompt_token_ids=PROMPTS[len(FIRST) :], sampling=GREEDY)
    spec = {"algorithm": "eagle", "draft_model": model_dirs["eagle"], "num_steps": 3}  # adaptive by default
    got = tp2.run_each([{**kwargs, "speculative": spec}])[0]
    assert [o.token_ids for o in got] == [o.token_ids for o in ref]
    assert all(o.spec.verify_steps for o in got) and any(o.spec.plain_steps for o in got)


@pytest.mark.parametrize("draft", [None, "assistant"])
def test_gemma4_tensor_parallel_matches_one_rank(tmp_path, tp2, draft):
    """Gemma 4's two geometries on two ranks: the sliding layers' 2 KV heads split, the full
    layers' one KV head replicated, the per-layer embedding table split by vocabulary, and the
    KV-sharing layers reading their rank's shard of the layers they share; its assistant (with
    its centroid head) drafting from those shards gives the same accept lengths."""
    path = str(tmp_path / "gemma4")
    make_tiny_model("gemma4", path)
    kwargs = dict(
        model=path, page_size=16, chunked_prefill_size=8, max_total_tokens=2048, attention_backend="trtllm_mha"
    )
    if draft == "assistant":
        assistant = make_gemma4_assistant(path, str(tmp_path / "assistant"), copies=10.0)
        kwargs["speculative"] = {"algorithm": "mtp", "draft_model": assistant, "num_steps": 3, "adaptive": False}
    single = Engine(**kwargs)
    ref = single.generate(prompt_token_ids=FIRST, sampling=GREEDY)
    ref += single.generate(prompt_token_ids=PROMPTS[len(FIRST) :], sampling=GREEDY)
    got = tp2.run_each([kwargs])[0]
    assert [o.token_ids for o in got] == [o.token_ids for o in ref]
    assert [o.cached_tokens for o in got] == [o.cached_tokens for o in ref]
    if draft:
        assert [o.spec.accept_lengths for o in got] == [o.spec.accept_lengths for o in ref]
        assert any(n > 1 for o in ref for n in o.spec.accept_lengths)


@pytest.mark.parametrize("name", ["gemma4_moe", "gpt_oss"])
def test_mixture_of_experts_tensor_parallel_matches_one_rank(tmp_path, tp2, name):
    """The experts shared by two ranks both ways, the router on every rank: split by their
    intermediate dimension (gpt-oss's down-projection bias added by one rank), and by expert
    (`moe_parallel: expert`, four whole experts a rank, each adding its experts' biases), gpt-oss's
    sinks split with the heads and its experts loaded from MXFP4 (one rank and whole experts in 4
    bits, 16-column shares dequantised as they load): the same tokens as one rank.
    Every expert of every layer is chosen by some token, so every rank's experts take part."""
    path = str(tmp_path / name)
    make_tiny_model(name, path)
    if name == "gpt_oss":
        quantize_checkpoint_mxfp4(path)
    kwargs = dict(
        model=path, page_size=16, chunked_prefill_size=8, max_total_tokens=2048, attention_backend="trtllm_mha"
    )
    single = Engine(**kwargs)
    chosen = record_routes(single.runner.model)
    ref = single.generate(prompt_token_ids=FIRST, sampling=GREEDY)
    ref += single.generate(prompt_token_ids=PROMPTS[len(FIRST) :], sampling=GREEDY)
    assert all(seen == set(range(single.cfg.moe.num_experts)) for seen in chosen.values())
    modes = ("tensor", "expert")
    for moe_parallel, got in zip(modes, tp2.run_each([{**kwargs, "moe_parallel": m} for m in modes])):
        assert [o.token_ids for o in got] == [o.token_ids for o in ref], moe_parallel
        assert [o.cached_tokens for o in got] == [o.cached_tokens for o in ref], moe_parallel


def test_tp_all_reduce_setting_is_checked(model_dirs):
    with pytest.raises(ValueError, match="tp_all_reduce"):
        Engine(model=model_dirs["target"], max_total_tokens=256, tp_all_reduce="ring")
