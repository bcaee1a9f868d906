"""slidespec's models against Hugging Face transformers, float32 on CPU.

For every architecture: prefill and per-step decode logits match within 1e-4 and greedy
generation equals `model.generate(do_sample=False)`, for a batch of prompts of different
lengths (longer than the window), with chunked prefill on and off, page sizes 1 and 16.
"""

import pytest
import torch

from tests.hf_models import TINY_MODELS, WINDOW, make_tiny_model, random_prompts
from workers.engine import Engine, SamplingParams

NEW_TOKENS = 48
PROMPT_LENS = [3 * WINDOW + 5, WINDOW + 3, 2 * WINDOW + 1]


@pytest.fixture(scope="module", params=sorted(TINY_MODELS))
def reference(request, tmp_path_factory):
    """(model dir, prompts, HF greedy continuations, HF logits per generated step)."""
    name = request.param
    path = str(tmp_path_factory.mktemp(name))
    hf = make_tiny_model(name, path)
    prompts = random_prompts(PROMPT_LENS)
    outputs, logits = [], []
    with torch.no_grad():
        for prompt in prompts:
            ids = torch.tensor([prompt])
            gen = hf.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=NEW_TOKENS, do_sample=False)
            new = gen[0, len(prompt) :].tolist()
            outputs.append(new)
            full = hf(gen[:, :-1]).logits[0].float()
            logits.append(full[len(prompt) - 1 :])
    return name, path, prompts, outputs, logits


@pytest.mark.parametrize("page_size", [1, 16])
@pytest.mark.parametrize("chunk", [None, 5])
def test_matches_transformers(reference, page_size, chunk):
    name, path, prompts, hf_tokens, hf_logits = reference
    eng = Engine(
        model=path,
        device="cpu",
        dtype="float32",
        page_size=page_size,
        attention_backend="torch_native",
        max_total_tokens=4096,
        chunked_prefill_size=chunk,
    )
    outs = eng.generate(
        prompt_token_ids=prompts,
        sampling=SamplingParams(max_new_tokens=NEW_TOKENS, temperature=0.0, ignore_eos=True, return_logits=True),
    )
    for i, out in enumerate(outs):
        ours = torch.stack(out.logits)
        diff = (ours - hf_logits[i]).abs().max().item()
        assert diff <= 1e-4, f"{name} prompt {i}: max |logit diff| {diff:.2e}"
        assert out.token_ids == hf_tokens[i], f"{name} prompt {i}: greedy tokens differ from transformers"
    eng.check_no_leak()
