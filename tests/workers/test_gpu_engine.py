"""End to end on the GPU: trtllm_mha (XQA + FMHA-v2) against torch_native, bf16, greedy.

bf16 rounding differs between the two paths. At every step until a request's tokens first differ
(same prefix, so the same question), both paths' logits must agree within bf16 noise: max
|difference| <= 2^-5 of the largest logit (bf16 keeps 8 significant bits; a few roundings pile up
over the layers), where a wrong kernel is off by O(1). A first divergence is then a near-tie by
construction (the reference's gap is at most twice that difference); the count is printed.
"""

import pytest
import torch

from tests.hf_models import make_tiny_model, random_prompts
from workers.engine import Engine, SamplingParams

pytestmark = pytest.mark.gpu


BF16_NOISE = 2.0**-5


def compare_bf16_runs(ref_outs, outs, label: str, noise: float = BF16_NOISE) -> tuple[int, float]:
    """Assert the logits of two runs agree within `noise` (of the largest logit) up to each
    request's first differing token; returns (requests that diverged, largest relative logit
    difference seen)."""
    diverged, worst = 0, 0.0
    for i, (ref, out) in enumerate(zip(ref_outs, outs)):
        for step, (a, b) in enumerate(zip(ref.token_ids, out.token_ids)):
            r, o = ref.logits[step].float(), out.logits[step].float()
            rel = ((r - o).abs().max() / r.abs().max()).item()
            worst = max(worst, rel)
            assert rel <= noise, f"{label} request {i} step {step}: logits differ by {rel:.3g} of the largest"
            if a != b:
                top2 = r.topk(2).values
                print(
                    f"{label} request {i}: first divergence at step {step}, "
                    f"reference gap {(top2[0] - top2[1]).item():.3g}, "
                    f"logit difference {rel:.3g} of the largest"
                )
                diverged += 1
                break
    return diverged, worst


# 128-dim heads: decode steps whose split-KV kernel rotates its own query (on Hopper: ROTATING_HEAD_DIMS)
@pytest.mark.parametrize(
    "name, head_dim", [("gemma3", 64), ("gemma2", 64), ("mistral", 64), ("qwen3", 64), ("mistral", 128), ("qwen3", 128)]
)
@pytest.mark.parametrize("page_size", [16, 64])
def test_trtllm_mha_matches_torch_native_on_gpu(tmp_path, monkeypatch, name, head_dim, page_size):
    if not torch.cuda.is_available():
        pytest.skip("needs CUDA")
    import attention.trtllm_mha as trtllm_mha
    from attention.kernels import select_kernels

    rotating = []  # decode calls (eager, or captured into a graph) of the kernel that rotates its query
    kernel = trtllm_mha.split_decode_rotating
    monkeypatch.setattr(trtllm_mha, "split_decode_rotating", lambda *a: rotating.append(1) or kernel(*a))
    path = str(tmp_path / name)
    make_tiny_model(
        name,
        path,
        hidden_size=256,
        head_dim=head_dim,
        num_attention_heads=4,
        num_key_value_heads=2,
        sliding_window=32 if name != "qwen3" else None,
    )
    prompts = random_prompts([150, 40, 97, 300])
    sp = SamplingParams(max_new_tokens=64, temperature=0.0, ignore_eos=True, return_logits=True)
    runs = {}
    for backend in ("torch_native", "trtllm_mha"):
        eng = Engine(
            model=path,
            device="cuda",
            dtype="bfloat16",
            page_size=page_size,
            attention_backend=backend,
            chunked_prefill_size=64,
            debug_kv_checks=True,
        )
        runs[backend] = eng.generate(prompt_token_ids=prompts, sampling=sp)
        eng.check_no_leak()
    assert bool(rotating) == (head_dim in select_kernels(torch.device("cuda")).rotating_head_dims)
    label = f"{name} head {head_dim} page {page_size}"
    diverged, worst = compare_bf16_runs(runs["torch_native"], runs["trtllm_mha"], label)
    print(f"{label}: {diverged} of {len(prompts)} requests diverged; largest logit difference {worst:.3g}")
