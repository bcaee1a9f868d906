"""The fused MoE kernels on the GPU against the torch path, their oracle (workers/models/moe.py).

At the experts' real shapes (Gemma-4-26B-A4B: 128 experts, top 8, 2816 -> 704, GELU-tanh;
gpt-oss-20b: 32 experts, top 4, 2880 -> 2880, clamped SwiGLU with biases) and the tiny test
models' (8 experts, top 2, 256 -> 32: narrower than the kernels' tiles), bf16, for batches of 1
and 8 through the GEMV-like kernels and 8, 64 and a 300-token prefill through the grouped GEMM
(each path asked for, whichever the thresholds would choose), with uneven
expert loads and experts that receive no token: within bf16 noise of the torch path, and
rounded in the same places (the mean difference far below an ulp). With an expert map (expert
parallelism: each of two ranks holds half the experts) each rank's kernels match its torch path
and the two ranks' sums add up to the whole experts'. Under a CUDA graph a replay with new
routing gives the new routing's result, with or without a map, and an eager call never
synchronises with the host. In the tiny Gemma 4 MoE and gpt-oss models (bf16, trtllm_mha, CUDA
graphs) every experts call, prefill and decode, matches the torch path on its own inputs; with
every expert chosen, so that no routing decision can flip, the logits match the torch path's
within bf16 noise, and an EAGLE-3 head over gpt-oss and the assistant over the Gemma 4 MoE keep
plain decoding's. The router of a few tokens (two kernels) chooses what the torch path's top-k
chooses over its logits, which are a rounding apart from the torch path's at most. MXFP4 experts
(gpt-oss's checkpoints' 4-bit codes, read by the kernels as stored or dequantised first for large
batches) match the torch path dequantising the same codes, with and without an expert map.
"""

import functools

import pytest
import torch

from tests.draft_models import make_eagle_head, make_gemma4_assistant
from tests.hf_models import TINY_MODELS, make_tiny_model, random_prompts
from tests.workers.test_gpu_engine import compare_bf16_runs
from tests.workers.test_gpu_gemma4 import scale_query_norms
from tests.workers.test_moe import quantize_checkpoint_mxfp4, quantize_mxfp4
from workers.engine import Engine, SamplingParams
from workers.models import moe
from workers.models.config import MoEConfig
from workers.models.moe import Activation, Router, experts_torch, route
from workers.models.mxfp4 import Mxfp4Experts

pytestmark = pytest.mark.gpu

# name -> (experts, top k, hidden, intermediate, activation, biases, SwiGLU clamp)
SHAPES = {
    "gemma-4-26b-a4b": (128, 8, 2816, 704, "gelu_pytorch_tanh", False, 7.0),
    "gpt-oss-20b": (32, 4, 2880, 2880, "swiglu_clamped", True, 7.0),
    "tiny-gemma4-moe": (8, 2, 256, 32, "gelu_pytorch_tanh", False, 7.0),  # tests/hf_models.py at hidden 256
    "tiny-gpt-oss": (8, 2, 256, 32, "swiglu_clamped", True, 0.5),
}
KERNEL_NOISE = 2.0**-6  # of the largest output: bf16 rounding of the intermediate rows and the sums
# Mean difference over mean output: the kernels and the torch path round in the same places and
# differ only in float32 summation order; rounding most outputs differently shows as ~2^-8.
ROUNDING_NOISE = 2.0**-10
# Expert parallelism: each rank's sum rounded to bf16 before the ranks' sums are added (as the
# all-reduce adds them), so most outputs differ from one rounding of the whole by ~2^-9.
RANK_SUMS_NOISE = (KERNEL_NOISE, 2.0**-7)
MODEL_NOISE = 2.0**-4  # of the largest logit, through a random tiny model's layers; a wrong kernel is off by O(1)
NEW_TOKENS = 32
# (tokens, the kernels run: gemv_tiles.MOE_PATHS): each path at batch sizes either side of the
# shapes' thresholds, whichever `moe_path` would choose
PATH_CASES = [(1, "gemv"), (8, "gemv"), (8, "gemm"), (64, "gemm"), (300, "gemm")]
MXFP4_PATH_CASES = [(1, "gemv"), (8, "gemv"), (64, "gemv"), (64, "gemm"), (300, "gemm"), (300, "dequant")]
# tiny model -> its config's (expert count, experts a token) fields
EXPERT_FIELDS = {
    "gemma4_moe": ("num_experts", "top_k_experts"),
    "gpt_oss": ("num_local_experts", "num_experts_per_tok"),
}


def random_experts(shape: str, seed: int = 0, device: str = "cuda", dtype: torch.dtype = torch.bfloat16) -> tuple:
    """(experts, top k, hidden, activation, (gate_up, down, gate_up bias, down bias)): random
    experts of a `SHAPES` entry."""
    num, top_k, hidden, width, act, bias, limit = SHAPES[shape]
    g = torch.Generator(device=device).manual_seed(seed)

    def rand(*size, std=0.02):
        return (torch.randn(*size, generator=g, device=device) * std).to(dtype)

    weights = (
        rand(num, 2 * width, hidden),
        rand(num, hidden, width),
        rand(num, 2 * width, std=0.1) if bias else None,
        rand(num, hidden, std=0.1) if bias else None,
    )
    return num, top_k, hidden, Activation(act, 1.702, limit), weights


def as_mxfp4(experts: tuple) -> tuple:
    """`random_experts`' weights with the matrices quantised to MXFP4: (gate_up, down as
    `Mxfp4Experts`, biases as they were)."""
    gate_up, down, *biases = experts

    def packed(w: torch.Tensor) -> Mxfp4Experts:
        quantized = [quantize_mxfp4(expert) for expert in w]  # one at a time: the rounding's search is 8x its size
        blocks, scales = (torch.stack(parts) for parts in zip(*quantized))
        return Mxfp4Experts(blocks.flatten(2), scales)

    return (packed(gate_up), packed(down), *biases)


def random_router(family: str, dtype: torch.dtype) -> Router:
    """A router at the real shapes with random weights (Gemma 4's scales and expert scales away
    from 1, gpt-oss's bias)."""
    gemma = family == "gemma4"
    experts, top_k, hidden = (128, 8, 2816) if gemma else (32, 4, 2880)
    moe = MoEConfig(experts, top_k, 64, "gelu_pytorch_tanh", router_norm=gemma, bias=not gemma, layout="packed")
    router = Router(hidden, moe, 1e-6)
    gen = torch.Generator().manual_seed(experts)
    with torch.no_grad():
        for p in router.parameters():
            p.copy_(torch.randn(p.shape, generator=gen) * (0.5 if p.dim() == 1 else 0.05) + (p.dim() == 1) * gemma)
    return router.to(dtype)


def skewed_routing(
    tokens: int, num: int, top_k: int, seed: int, device: str = "cuda"
) -> tuple[torch.Tensor, torch.Tensor]:
    """Skewed routing: the first experts take most tokens, the last quarter none."""
    g = torch.Generator(device=device).manual_seed(seed)
    logits = torch.randn(tokens, num, generator=g, device=device) + torch.linspace(4.0, -4.0, num, device=device)
    logits[:, -num // 4 :] = -1e4
    return route(logits, top_k)


def dealt_routing(
    tokens: int, num: int, top_k: int, seed: int, device: str = "cuda"
) -> tuple[torch.Tensor, torch.Tensor]:
    """`skewed_routing` with its experts dealt alternately to the two halves of the ids, so that
    under expert parallelism over two ranks each holds busy experts and experts no token chose."""
    weights, ids = skewed_routing(tokens, num, top_k, seed, device)
    dealt = torch.arange(num, device=device).view(2, -1).t().reshape(-1)  # 0, num/2, 1, num/2 + 1, ...
    return weights, dealt[ids]


def held_by(rank: int, ranks: int, experts: tuple) -> tuple[tuple, torch.Tensor]:
    """(the weights and biases of rank `rank`'s experts, its expert map): `moe_parallel: expert`
    gives each rank a contiguous run of num / ranks experts; the map sends the others to -1."""
    num = experts[0].shape[0]
    count = num // ranks

    def part(t):
        if isinstance(t, Mxfp4Experts):
            return Mxfp4Experts(part(t.blocks), part(t.scales))
        return None if t is None else t[rank * count : (rank + 1) * count]

    held = tuple(part(t) for t in experts)
    device = experts[1].blocks.device if isinstance(experts[1], Mxfp4Experts) else experts[1].device
    index = torch.arange(num, device=device) - rank * count
    return held, torch.where((index >= 0) & (index < count), index, -1)


def differences(got: torch.Tensor, ref: torch.Tensor) -> torch.Tensor:
    """[largest difference over the largest output, mean difference over the mean output],
    computed on the device (no host read, so it can run inside a captured graph)."""
    diff, ref = (got.float() - ref.float()).abs(), ref.float().abs()
    tiny = torch.finfo(torch.float32).tiny
    return torch.stack([diff.amax() / ref.amax().clamp_min(tiny), diff.mean() / ref.mean().clamp_min(tiny)])


def assert_rounding_noise(
    rel: torch.Tensor, what: str, bounds: tuple[float, float] = (KERNEL_NOISE, ROUNDING_NOISE)
) -> None:
    """`differences` within (largest, mean) bounds."""
    (worst, mean), (worst_bound, mean_bound) = rel.tolist(), bounds
    assert worst <= worst_bound, f"{what}: {worst:.3g} of the largest output (bound {worst_bound:.3g})"
    assert mean <= mean_bound, f"{what}: mean difference {mean:.3g} of the mean output (bound {mean_bound:.3g})"


@pytest.mark.parametrize("family", ["gemma4", "gpt-oss"])
@pytest.mark.parametrize("tokens", [1, 8, 9])
def test_router_kernels_match_the_torch_path(family, tokens):
    """The router of a few tokens (Gemma 4's norm and scales, gpt-oss's bias) at the real shapes,
    bf16: logits a rounding apart from the float32 product's at most (or, for a logit near zero,
    the float32 noise of a sum in another order), and over them the experts the
    torch path's top-k chooses, in its order, with its weights (rows whose top k + 1 logits hold
    a tie choose among the tied by id; their chosen logits still match); past MAX_ROWS tokens the
    torch path routes."""
    from workers.models import fused_router

    router = random_router(family, torch.bfloat16).cuda()
    gen = torch.Generator(device="cuda").manual_seed(tokens)
    x = torch.randn(tokens, router.proj.weight.shape[1], device="cuda", generator=gen).to(torch.bfloat16)
    gemma, k = router.norm is not None, router.top_k
    expert_scale = router.per_expert_scale if gemma else None
    with torch.no_grad():
        inputs = router.norm(x) * router.scale * router.input_scale if gemma else x
        # the float32 product rounded once (cuBLAS may reduce bf16 products in bf16 partial sums)
        weight, bias = router.proj.weight.float(), router.proj.bias
        ref_logits = (inputs.float() @ weight.t() + (0.0 if bias is None else bias.float())).to(torch.bfloat16)
        # float32 noise of the products' sum in another order, and of the input's rounding (Gemma 4)
        noise = (inputs.float().abs() @ weight.abs().t()) * 2**-14
        weights, ids = router(x)
        if tokens > fused_router.MAX_ROWS:
            ref_weights, ref_ids = route(router.proj(inputs), k, expert_scale)  # the same ops on the same device
            assert torch.equal(ids, ref_ids) and torch.equal(weights, ref_weights)
            return
        norm = (router.scale, router.norm.eps, router.input_scale) if gemma else None
        logits = fused_router.logits(x, router.proj.weight, router.proj.bias, norm)
        ref_weights, ref_ids = route(logits, k, expert_scale)
    assert ((logits.float() - ref_logits.float()).abs() <= ref_logits.float().abs() * 2**-7 + noise).all()
    assert torch.equal(logits.gather(1, ids), logits.gather(1, ref_ids))
    top = logits.float().sort(dim=1, descending=True).values[:, : k + 1]
    distinct = (top[:, 1:] != top[:, :-1]).all(dim=1)
    assert torch.equal(ids[distinct], ref_ids[distinct])
    assert torch.allclose(weights[distinct], ref_weights[distinct], atol=1e-6)


@pytest.mark.parametrize("shape", list(SHAPES))
@pytest.mark.parametrize("tokens,path", PATH_CASES)
def test_fused_experts_match_the_torch_path(shape, tokens, path):
    from workers.models.fused_moe import fused_experts

    num, top_k, hidden, act, (gate_up, down, gate_up_bias, down_bias) = random_experts(shape)
    x = torch.randn(tokens, hidden, device="cuda").to(torch.bfloat16)
    weights, ids = skewed_routing(tokens, num, top_k, seed=tokens)
    ref = experts_torch(x, gate_up, down, weights, ids, act, gate_up_bias, down_bias)
    got = fused_experts(x, gate_up, down, weights, ids, act, gate_up_bias, down_bias, path=path)
    assert_rounding_noise(differences(got, ref), f"{shape} {tokens} tokens, {path}")
    assert ids.unique().numel() < num, "some expert should receive no token"


@pytest.mark.parametrize("shape", list(SHAPES))
@pytest.mark.parametrize("tokens,path", PATH_CASES)
def test_fused_experts_with_an_expert_map_match_the_torch_path(shape, tokens, path):
    """Expert parallelism over two ranks: each rank's kernels, skipping the pairs of the other
    rank's experts, against its torch path; the two ranks' sums against the whole experts'."""
    from workers.models.fused_moe import fused_experts

    num, top_k, hidden, act, experts = random_experts(shape)
    x = torch.randn(tokens, hidden, device="cuda").to(torch.bfloat16)
    weights, ids = dealt_routing(tokens, num, top_k, seed=tokens)
    total = torch.zeros(tokens, hidden, device="cuda")
    for rank in range(2):
        (gate_up, down, gate_up_bias, down_bias), expert_map = held_by(rank, 2, experts)
        args = (x, gate_up, down, weights, ids, act, gate_up_bias, down_bias, expert_map)
        got = fused_experts(*args, path=path)
        assert_rounding_noise(differences(got, experts_torch(*args)), f"{shape} {tokens} tokens, {path}, rank {rank}")
        total += got.float()
        held = expert_map[ids] >= 0
        assert ids.numel() < 16 or (held.any() and not held.all()), "each rank should skip some pairs and run some"
    whole = experts_torch(x, *experts[:2], weights, ids, act, *experts[2:])
    assert_rounding_noise(differences(total, whole), f"{shape} {tokens} tokens, two ranks' sums", RANK_SUMS_NOISE)


@pytest.mark.parametrize("shape", ["gpt-oss-20b", "tiny-gpt-oss"])
@pytest.mark.parametrize("tokens,path", MXFP4_PATH_CASES)
@pytest.mark.parametrize("expert_parallel", [False, True])
def test_mxfp4_fused_experts_match_the_torch_path(shape, tokens, path, expert_parallel):
    """gpt-oss's MXFP4 experts read as stored (the GEMV kernels and the grouped GEMM) or
    dequantised first, against the torch path dequantising the same codes; under expert
    parallelism each of two ranks against its own torch path."""
    from workers.models.fused_moe import fused_experts

    num, top_k, hidden, act, experts = random_experts(shape)
    experts = as_mxfp4(experts)
    x = torch.randn(tokens, hidden, device="cuda").to(torch.bfloat16)
    weights, ids = dealt_routing(tokens, num, top_k, seed=tokens)
    for rank in range(2 if expert_parallel else 1):
        held, expert_map = held_by(rank, 2, experts) if expert_parallel else (experts, None)
        args = (x, *held[:2], weights, ids, act, *held[2:], expert_map)
        got = fused_experts(*args, path=path)
        assert_rounding_noise(differences(got, experts_torch(*args)), f"{shape} {tokens}, {path}, rank {rank}")


@pytest.mark.parametrize("shape", list(SHAPES))
@pytest.mark.parametrize("tokens", [1, 64])
@pytest.mark.parametrize("expert_parallel", [False, True])
def test_fused_experts_replay_new_routing_and_never_synchronise(shape, tokens, expert_parallel):
    from workers.models.fused_moe import fused_experts

    num, top_k, hidden, act, experts = random_experts(shape)
    held, expert_map = held_by(1, 2, experts) if expert_parallel else (experts, None)
    gate_up, down, gate_up_bias, down_bias = held
    x = torch.randn(tokens, hidden, device="cuda").to(torch.bfloat16)
    weights, ids = dealt_routing(tokens, num, top_k, seed=1)

    def run():
        return fused_experts(x, gate_up, down, weights, ids, act, gate_up_bias, down_bias, expert_map)

    torch.cuda.set_sync_debug_mode("error")
    try:
        run()
    finally:
        torch.cuda.set_sync_debug_mode("default")
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        run()  # warm-up outside the capture (Triton compiles here)
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = run()
    new_weights, new_ids = dealt_routing(tokens, num, top_k, seed=2)
    weights.copy_(new_weights)
    ids.copy_(new_ids)
    x.copy_(torch.randn(tokens, hidden, device="cuda").to(torch.bfloat16))
    graph.replay()
    ref = experts_torch(x, gate_up, down, weights, ids, act, gate_up_bias, down_bias, expert_map)
    assert_rounding_noise(differences(out, ref), f"{shape} {tokens} tokens, replayed")


def _tiny_moe_model(tmp_path, name: str, **overrides) -> str:
    path = str(tmp_path / name)
    make_tiny_model(name, path, hidden_size=256, head_dim=64, num_attention_heads=4, num_key_value_heads=2, **overrides)
    return path


def _generate(path: str, speculative: dict | None = None) -> list:
    """Greedy continuations of three prompts batched into one prefill, bf16, trtllm_mha, CUDA graphs."""
    eng = Engine(
        model=path,
        device="cuda",
        dtype="bfloat16",
        page_size=16,
        attention_backend="trtllm_mha",
        max_total_tokens=8192,
        context_length=1024,
        max_running_requests=4,
        speculative=speculative,
    )
    sp = SamplingParams(max_new_tokens=NEW_TOKENS, temperature=0.0, ignore_eos=True, return_logits=True)
    outs = eng.generate(prompt_token_ids=random_prompts([150, 40, 97]), sampling=sp)
    eng.flush_cache()
    eng.check_no_leak()
    del eng
    torch.cuda.empty_cache()
    return outs


@pytest.mark.parametrize("name", list(EXPERT_FIELDS))
def test_tiny_moe_models_match_the_torch_path(tmp_path, monkeypatch, name):
    """Whole models with every expert chosen, prefill (grouped GEMM) and decode (GEMV) under CUDA
    graphs: the fused experts' logits against the torch path's, up to each request's first
    differing token. At the models' own 2 of 8, about one token in a hundred per layer has its
    second and third router logits within one bf16 step of each other (three within four), so
    a difference in summation order upstream picks another expert for some token and moves its
    logits by 0.1 or more of the largest with both paths right; choosing every expert leaves
    no decision to flip (the next test keeps the models' routing)."""
    count, top_k = EXPERT_FIELDS[name]
    path = _tiny_moe_model(tmp_path, name, **{top_k: TINY_MODELS[name][2][count]})
    runs = {}
    for fused in (False, True):
        monkeypatch.setattr(moe, "FUSED_MOE", fused)
        runs[fused] = _generate(path)
    compare_bf16_runs(runs[False], runs[True], f"{name} fused experts", noise=MODEL_NOISE)


@pytest.mark.parametrize("name,draft", [("gpt_oss", "eagle3"), ("gemma4_moe", "assistant")])
def test_drafts_over_moe_targets_keep_plain_decoding_under_graphs(tmp_path, name, draft):
    """EAGLE-3 over gpt-oss and Gemma 4's assistant over the Gemma 4 MoE, 4 draft steps a round,
    bf16, trtllm_mha, CUDA graphs: each verify forward routes a request's five tokens at once,
    and the logits stay plain decoding's within bf16 noise up to each request's first differing
    token (every expert chosen, as above, so that no routing decision can flip) over at least half
    the steps, the assistant's drafts accepted, no KV leaked."""
    count, top_k = EXPERT_FIELDS[name]
    path = _tiny_moe_model(tmp_path, name, **{top_k: TINY_MODELS[name][2][count]})
    if name == "gemma4_moe":
        scale_query_norms(path)  # attention not one-hot: a verify's rounding then moves logits by noise, not units
    if draft == "eagle3":
        algorithm, draft_model = "eagle", make_eagle_head(path, str(tmp_path / "eagle3"), 3)
    else:
        algorithm, draft_model = "mtp", make_gemma4_assistant(path, str(tmp_path / "assistant"), copies=10.0)
    plain = _generate(path)
    spec = {"algorithm": algorithm, "draft_model": draft_model, "num_steps": 4, "adaptive": False}
    drafted = _generate(path, spec)
    diverged, worst = compare_bf16_runs(plain, drafted, f"{name} drafted by {draft}", noise=MODEL_NOISE)
    print(f"{name} drafted by {draft}: {diverged} of {len(plain)} diverged, worst {worst:.3g}")
    # a divergence is a bf16 near-tie flipping (gaps of 0 occur): they come late, so most steps compare
    same = [
        next((i for i, (a, b) in enumerate(zip(p.token_ids, d.token_ids)) if a != b), NEW_TOKENS)
        for p, d in zip(plain, drafted)
    ]
    assert sum(same) >= len(plain) * NEW_TOKENS // 2, f"steps before each request's first differing token: {same}"
    lengths = [n for out in drafted for n in out.spec.accept_lengths]
    assert len(lengths) >= NEW_TOKENS // 5, f"{len(lengths)} rounds: the requests were not drafted for"
    if draft == "assistant":  # its layers copy the target's (a random EAGLE-3 head's drafts are rejected)
        assert max(lengths) > 1, "no draft accepted"


@pytest.mark.parametrize("name", [*EXPERT_FIELDS, "gpt_oss-mxfp4"])
def test_every_experts_call_of_a_tiny_moe_model_matches_the_torch_path(tmp_path, monkeypatch, name):
    """The models' own routing (2 of 8 experts a token, uneven loads, experts left empty): every
    experts call of a fused run, the prefill's grouped GEMM and the decode steps' GEMVs replayed
    from CUDA graphs, against the torch path on the same inputs, the worst kept on the device;
    gpt-oss also from an MXFP4 checkpoint, its experts held and read in 4 bits."""
    from workers.models.fused_moe import fused_experts

    worst = torch.zeros(2, device="cuda")
    calls = torch.zeros((), dtype=torch.int64, device="cuda")
    formats = set()  # whether each call's experts were MXFP4 (known on the host: no sync)

    def checked(x: torch.Tensor, *args, routed_early: bool = False) -> torch.Tensor:
        out = fused_experts(x, *args, routed_early=routed_early)
        torch.maximum(worst, differences(out, experts_torch(x, *args)), out=worst)
        calls.add_(1)
        formats.add(isinstance(args[0], Mxfp4Experts))
        return out

    monkeypatch.setattr(moe, "experts_for", lambda x, early=False: functools.partial(checked, routed_early=early))
    family, _, quantized = name.partition("-")
    path = _tiny_moe_model(tmp_path, family)
    if quantized:
        quantize_checkpoint_mxfp4(path)
    _generate(path)
    assert formats == {bool(quantized)}
    layers = TINY_MODELS[family][2]["num_hidden_layers"]
    assert calls.item() >= layers * (NEW_TOKENS - 1), f"{calls.item()} experts calls: decode steps went unchecked"
    assert_rounding_noise(worst.cpu(), f"{name}'s experts calls")
