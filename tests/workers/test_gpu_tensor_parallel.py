"""Tensor parallelism on two GPUs: NCCL for the model's collectives, gloo for the step plans;
trtllm_mha in bf16, with and without speculative decoding, against one GPU. Logits agree within
bf16 noise up to any first divergence (reduction order differs between 1 and 2 ranks). The tiny
mixtures of experts too, their experts split by tensor and by expert (the fused kernels under
CUDA graphs). The one-shot all-reduces over peer memory: alone against NCCL, and fused with the
residual add and RMSNorm after them against the float32 oracle, at the served models' hidden
sizes, under graph replay, and under a decode step's graphs against one GPU."""

import os
import queue

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from tests.draft_models import make_eagle_head, make_frozen_kv_head, make_gemma4_assistant, make_perturbed_copy
from tests.hf_models import TINY_MODELS, make_tiny_model
from tests.workers.rank_group import PROMPTS, free_port, run_tp, run_tp_each
from tests.workers.test_gpu_engine import compare_bf16_runs
from tests.workers.test_gpu_gemma4 import GEMMA4_NOISE, make_gpu_gemma4
from tests.workers.test_gpu_moe import EXPERT_FIELDS, MODEL_NOISE, _tiny_moe_model, assert_rounding_noise, differences
from workers.distributed import PEER_BUFFER_BYTES, TPGroup
from workers.engine import Engine, SamplingParams
from workers.models.ops import TORCH_OPS

pytestmark = pytest.mark.gpu
SAMPLING = SamplingParams(max_new_tokens=32, temperature=0.0, ignore_eos=True, return_logits=True)


def _draft(kind: str, target: str, root) -> dict:
    """Speculative settings of `kind` over `target` (fixed rounds: one rank's accept lengths are
    the group's)."""
    if kind == "standalone":
        draft = make_perturbed_copy(target, str(root / "draft"), noise=0.0)
        return {"algorithm": "standalone", "draft_model": draft, "draft_pool": "full"}
    if kind == "eagle3":
        return {"algorithm": "eagle", "draft_model": make_eagle_head(target, str(root / "eagle3"), 3)}
    if kind == "frozen_kv_mtp":
        return {"algorithm": "frozen_kv_mtp", "draft_model": make_frozen_kv_head(target, str(root / "frozen"))}
    return {"algorithm": "mtp", "draft_model": make_gemma4_assistant(target, str(root / "assistant"), copies=10.0)}


@pytest.mark.parametrize(
    "speculative, all_reduce",
    [
        (None, "nccl"),
        (None, "one_shot"),
        ("standalone", "nccl"),
        ("standalone", "one_shot"),
        ("eagle3", "one_shot"),
        ("frozen_kv_mtp", "one_shot"),
        ("assistant", "one_shot"),
    ],
)
def test_two_gpu_tensor_parallel_matches_one_gpu(tmp_path, speculative, all_reduce):
    """Every speculative algorithm at TP 2 under CUDA graphs gives one GPU's greedy tokens (the
    Gemma 4 assistant over a tiny Gemma 4, the others over a tiny Gemma 3)."""
    if torch.cuda.device_count() < 2:
        pytest.skip("needs 2 GPUs")
    name = "gemma4" if speculative == "assistant" else "gemma3"
    target = str(tmp_path / name)
    if name == "gemma4":
        make_gpu_gemma4(target)
    else:
        make_tiny_model(
            "gemma3",
            target,
            hidden_size=256,
            head_dim=64,
            num_attention_heads=4,
            num_key_value_heads=2,
            sliding_window=32,
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
        kwargs["speculative"] = {**_draft(speculative, target, tmp_path), "num_steps": 4, "adaptive": False}
    ref = Engine(**kwargs).generate(prompt_token_ids=PROMPTS, sampling=SAMPLING)
    got = run_tp(2, {**kwargs, "tp_all_reduce": all_reduce}, SAMPLING)
    noise = {"noise": GEMMA4_NOISE} if name == "gemma4" else {}
    diverged, worst = compare_bf16_runs(ref, got, f"tp2 {all_reduce} speculative={speculative}", **noise)
    lengths = [n for o in got if o.spec for n in o.spec.accept_lengths]
    print(
        f"tp2 {all_reduce} speculative={speculative}: {diverged} of {len(PROMPTS)} diverged, "
        f"largest logit difference {worst:.3g}"
        + (f", mean accept length {sum(lengths) / len(lengths):.2f}" if lengths else "")
    )


@pytest.mark.parametrize("name", list(EXPERT_FIELDS))
def test_two_gpu_mixture_of_experts_matches_one_gpu(tmp_path, name):
    """Every expert chosen (no routing decision left to flip between reduction orders): the
    experts split by tensor and by expert (each rank's kernels skipping the other's experts) give
    one GPU's logits within bf16 noise."""
    if torch.cuda.device_count() < 2:
        pytest.skip("needs 2 GPUs")
    count, top_k = EXPERT_FIELDS[name]
    path = _tiny_moe_model(tmp_path, name, **{top_k: TINY_MODELS[name][2][count]})
    kwargs = dict(model=path, device="cuda", dtype="bfloat16", page_size=16, attention_backend="trtllm_mha")
    ref = Engine(**kwargs).generate(prompt_token_ids=PROMPTS, sampling=SAMPLING)
    modes = ("tensor", "expert")
    for mode, got in zip(modes, run_tp_each(2, [{**kwargs, "moe_parallel": m} for m in modes], SAMPLING)):
        label = f"{name} tp2 moe_parallel={mode}"
        diverged, worst = compare_bf16_runs(ref, got, label, noise=MODEL_NOISE)
        print(f"{label}: {diverged} of {len(PROMPTS)} diverged, largest logit difference {worst:.3g}")


def _one_shot_rank(rank: int, port: int, results) -> None:
    torch.cuda.set_device(rank)
    dist.init_process_group("nccl", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2)
    one_shot, nccl = TPGroup(rank, 2, dist.group.WORLD), TPGroup(rank, 2, dist.group.WORLD)
    one_shot.use_one_shot_all_reduce(torch.bfloat16, torch.device("cuda", rank))
    g = torch.Generator(device="cuda").manual_seed(rank)
    inputs = [torch.randn(n, 4096, generator=g, device="cuda").to(torch.bfloat16) for n in (1, 3, 64)]
    big = torch.randn(256, 4096, generator=g, device="cuda").to(torch.bfloat16)  # past the buffer: NCCL
    # LM-head shards (Llama 3's vocabulary over two ranks, a few rows) and one past the buffer
    shards = [torch.randn(n, 64128, generator=g, device="cuda").to(torch.bfloat16) for n in (1, 5, 9)]
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):  # warm-up outside capture (NCCL connects lazily)
        for x in inputs:
            one_shot.all_reduce(x.clone())
        nccl.all_reduce(big.clone())
        nccl.all_gather(shards[-1])
    torch.cuda.current_stream().wait_stream(stream)
    graph, outs = torch.cuda.CUDAGraph(), []
    with torch.cuda.graph(graph):
        # Back to back on one buffer, as a decode step's layers use it.
        outs = [one_shot.all_reduce(x.clone()) for x in inputs] + [one_shot.all_reduce(big.clone())]
        outs += [one_shot.all_gather(x) for x in shards]
    for _ in range(3):
        graph.replay()
    torch.cuda.synchronize()
    wants = [nccl.all_reduce(x.clone()) for x in inputs + [big]] + [nccl.all_gather(x) for x in shards]
    same = all(torch.equal(o, w) for o, w in zip(outs, wants, strict=True))
    # The reference itself: every rank's input, summed on the host in float32.
    gathered = [torch.empty_like(inputs[0]) for _ in range(2)]
    dist.all_gather(gathered, inputs[0])
    close = torch.allclose(outs[0].float(), sum(t.float() for t in gathered), rtol=1e-2, atol=1e-2)
    if rank == 0:
        results.put((same, close))
    dist.barrier()
    os._exit(0)


def test_one_shot_all_reduce_equals_nccl_under_graph_replay():
    """Two ranks' sums through peer memory, captured and replayed back to back on one buffer,
    equal NCCL's bit for bit (a sum of two bf16 values rounds once either way), and so do the
    LM head's gathered vocabulary shards; messages past the buffer take NCCL."""
    if torch.cuda.device_count() < 2:
        pytest.skip("needs 2 GPUs")
    same, close = _on_two_gpus(_one_shot_rank, timeout=300)
    assert same and close


def _on_two_gpus(rank_main, timeout: float):
    """What rank 0 of `rank_main(rank, port, results)` on each of two GPUs put on `results`; a
    rank stuck waiting for its peer (it would spin for ever) is killed after `timeout` s."""
    ctx = mp.get_context("spawn")
    results = ctx.Queue()
    port = free_port()
    procs = [ctx.Process(target=rank_main, args=(r, port, results)) for r in range(2)]
    for p in procs:
        p.start()
    try:
        found = results.get(timeout=timeout)
    except queue.Empty:
        for p in procs:
            p.kill()
        raise
    for p in procs:
        p.join(timeout=60)
    return found


# Hidden sizes of the served shapes: Llama-3-8B, Gemma-3-27B (and Gemma-4-31B), Gemma-3-12B,
# Gemma-3-4B (and Gemma-4-E4B), Gemma-4-E2B, Gemma-3-1B
FUSED_HIDDEN = (4096, 5376, 3840, 2560, 1536, 1152)
FUSED_ROWS = (1, 2, 7, 64)
# Gemma: 1 + w; sandwich: a norm before the add; scaled: Gemma 4's (w, a sandwich, then the layer scalar)
NORM_VARIANTS = ("llama", "gemma", "sandwich", "bias", "scaled")


def _fused_case(variant: str, hidden: int, rows: int, rank: int) -> tuple:
    """(this rank's partial sums, residual, norm weight, eps, gemma, before weight, bias, scale):
    the partial sums differ between ranks, the rest is the same on each."""
    mine = torch.Generator(device="cuda").manual_seed(1000 * rank + hidden + rows)
    shared = torch.Generator(device="cuda").manual_seed(hidden + rows)
    gemma = variant in ("gemma", "sandwich")

    def weight() -> torch.Tensor:
        return (torch.randn(hidden, device="cuda", generator=shared) * 0.1 + (0 if gemma else 1)).bfloat16()

    x = torch.randn(rows, hidden, device="cuda", generator=mine).bfloat16()
    residual = torch.randn(rows, hidden, device="cuda", generator=shared).bfloat16()
    norm = weight()
    before = weight() if variant in ("sandwich", "scaled") else None
    bias = torch.randn(hidden, device="cuda", generator=shared).bfloat16() if variant == "bias" else None
    scale = torch.tensor([0.75], device="cuda").bfloat16() if variant == "scaled" else None
    return x, residual, norm, 1e-6, gemma, before, bias, scale


def _fused_rank(rank: int, port: int, results) -> None:
    torch.cuda.set_device(rank)
    dist.init_process_group("nccl", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2)
    tp = TPGroup(rank, 2, dist.group.WORLD)
    tp.use_one_shot_all_reduce(torch.bfloat16, torch.device("cuda", rank))
    cases = {
        f"{variant}-{hidden}-{rows}": _fused_case(variant, hidden, rows, rank)
        for hidden in FUSED_HIDDEN
        for rows in FUSED_ROWS
        for variant in NORM_VARIANTS
    }
    cases["past-the-table"] = _fused_case("sandwich", 4096, PEER_BUFFER_BYTES // 8192 + 1, rank)  # NCCL
    plain = torch.randn(3, 4096, device="cuda").bfloat16()  # a plain one-shot all-reduce between the fused ones
    methods = {name: tp.method(case[0], then_norm=True) for name, case in cases.items()}
    # The oracle: every rank's partial sums summed in float32 and rounded (the all-reduce), then
    # the torch op set's add and norm.
    oracle = {}
    for name, (x, residual, norm, eps, gemma, before, bias, scale) in cases.items():
        parts = [torch.empty_like(x) for _ in range(2)]
        dist.all_gather(parts, x)
        total = sum(p.float() for p in parts).bfloat16()
        total = total + bias if bias is not None else total
        oracle[name] = TORCH_OPS.add_rms_norm(total, residual.clone(), norm, eps, gemma, before, scale)

    def run_all() -> dict[str, tuple[torch.Tensor, torch.Tensor]]:
        """Every case back to back on the one buffer, a plain all-reduce between each two."""
        out = {}
        for name, (x, residual, *rest) in cases.items():
            out[name] = tp.all_reduce_add_rms_norm(x.clone(), residual.clone(), *rest)  # NCCL sums in place
            tp.all_reduce(plain.clone())
        return out

    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):  # warm-up outside capture: compiles, and NCCL connects lazily
        eager = run_all()
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        replayed = run_all()
    for _ in range(3):
        graph.replay()
    torch.cuda.synchronize()
    found = {}
    for name, (ref_out, ref_res) in oracle.items():
        agree = []
        for tensor in (*eager[name], *replayed[name]):
            gathered = [torch.empty_like(tensor) for _ in range(2)]
            dist.all_gather(gathered, tensor)
            agree.append(torch.equal(gathered[0], gathered[1]))
        found[name] = {
            "method": methods[name],
            "out": differences(replayed[name][0], ref_out).tolist(),
            "residual": differences(replayed[name][1], ref_res).tolist(),
            "eager_equals_replay": all(torch.equal(e, r) for e, r in zip(eager[name], replayed[name], strict=True)),
            "ranks_agree": all(agree),
        }
    if rank == 0:
        results.put(found)
    dist.barrier()
    os._exit(0)


def test_fused_all_reduce_add_norm_matches_the_float32_oracle():
    """The one-shot all-reduce fused with the residual add and RMSNorm (Llama's, Gemma's 1 + w,
    Gemma's sandwich with its norm before the add, a projection bias) at the served models' hidden
    sizes and 1 to 64 rows, eager and replayed in a CUDA graph back to back on one buffer with
    plain one-shot all-reduces between: within bf16 rounding of the oracle (every rank's partial
    sums summed in float32, then the torch op set's add and norm), the same bits on both ranks
    and in both runs; a message past the size table takes NCCL and the add and norm apart."""
    if torch.cuda.device_count() < 2:
        pytest.skip("needs 2 GPUs")
    found = _on_two_gpus(_fused_rank, timeout=600)
    for name, got in found.items():
        assert got["method"] == ("nccl" if name == "past-the-table" else "one_shot_fused"), (name, got)
        assert_rounding_noise(torch.tensor(got["out"]), f"{name} out")
        assert_rounding_noise(torch.tensor(got["residual"]), f"{name} residual")
        assert got["eager_equals_replay"] and got["ranks_agree"], (name, got)


@pytest.mark.parametrize("name", ["llama", "gemma3"])
def test_two_gpu_fused_all_reduce_norm_under_graphs_matches_one_gpu(tmp_path, name):
    """Greedy decode on two GPUs with `tp_all_reduce: one_shot` and CUDA graphs on (every
    all-reduce followed by a norm is the fused kernel, inside the decode graphs) against one GPU:
    logits within bf16 noise up to any first divergence."""
    if torch.cuda.device_count() < 2:
        pytest.skip("needs 2 GPUs")
    target = str(tmp_path / name)
    window = {"sliding_window": 32} if name == "gemma3" else {}
    make_tiny_model(name, target, hidden_size=256, head_dim=64, num_attention_heads=4, num_key_value_heads=2, **window)
    kwargs = dict(
        model=target,
        device="cuda",
        dtype="bfloat16",
        page_size=16,
        chunked_prefill_size=64,
        attention_backend="trtllm_mha",
    )
    ref = Engine(**kwargs).generate(prompt_token_ids=PROMPTS, sampling=SAMPLING)
    got = run_tp(2, {**kwargs, "tp_all_reduce": "one_shot"}, SAMPLING)
    label = f"{name} tp2 one_shot fused under graphs"
    diverged, worst = compare_bf16_runs(ref, got, label)
    print(f"{label}: {diverged} of {len(PROMPTS)} diverged, largest logit difference {worst:.3g}")
