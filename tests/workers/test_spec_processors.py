"""Logits processors and logprobs under speculative decoding, on the shipped tiny models (a
trained target, so that drafts are accepted and every verify position is exercised): for each
algorithm its drafts support (standalone, EAGLE, frozen-KV MTP), eagerly and with emulated CUDA
graphs (device-side drafts, chains and verifies launched ahead), greedy tokens with penalties,
logit_bias and min_tokens equal plain greedy decoding's with the same parameters; the logprobs
returned under speculation are plain decoding's (the target's); prompt logprobs too; sampling
with penalties is reproducible from its seed."""

import dataclasses
import os

import pytest
import torch

from ops import MODELS_DIR
from workers.engine import Engine, SamplingParams
from workers.tokenizer import load_tokenizer

TARGET = os.path.join(MODELS_DIR, "tiny-gemma3")
DRAFTS = {
    "standalone": os.path.join(MODELS_DIR, "tiny-gemma3-draft"),
    "eagle": os.path.join(MODELS_DIR, "tiny-gemma3-eagle"),
    "frozen_kv_mtp": os.path.join(MODELS_DIR, "tiny-gemma3-mtp"),
}
TEXTS = [
    "def read_config(path):\n    with open(path) as f:\n        return json.load(f)\n\n\ndef ",
    "class Queue:\n    def __init__(self, maxsize=0):\n        self.maxsize = maxsize\n        self.",
]
N = 16
ATOL = 2e-4  # float32 logits of a verify row against a decode row


@pytest.fixture(scope="module")
def prompts() -> list[list[int]]:
    tokenizer = load_tokenizer(TARGET)
    return [tokenizer.encode(t) for t in TEXTS]


def _engine(speculative: str | None = None, graphs: bool | str = False, adaptive: bool = True) -> Engine:
    spec = None if speculative is None else {"algorithm": speculative, "draft_model": DRAFTS[speculative]}
    spec = None if spec is None else spec | {"adaptive": adaptive}
    return Engine(
        model=TARGET,
        page_size=4,
        attention_backend="trtllm_mha",
        max_total_tokens=2048,
        context_length=256,
        chunked_prefill_size=32,
        max_running_requests=24,
        speculative=None if spec is None else spec | {"num_steps": 3},
        cuda_graphs=graphs,
    )


@pytest.fixture(scope="module")
def plain() -> Engine:
    return _engine()


def _processed(prompts: list[list[int]], plain: Engine) -> list[SamplingParams]:
    """Greedy parameters, each with a processor that changes plain greedy output here, and
    logprobs: penalties, a bias against a token plain decoding picks, a minimum length before a
    stop id it picks early; and one row with logprobs alone."""
    base = SamplingParams(max_new_tokens=N, temperature=0.0, ignore_eos=True, logprobs=3)
    (first,) = plain.generate(prompt_token_ids=prompts[:1], sampling=base)
    stop = first.token_ids[2]
    return [
        dataclasses.replace(base, frequency_penalty=1.5),
        dataclasses.replace(base, presence_penalty=1.2),
        dataclasses.replace(base, repetition_penalty=1.6),
        dataclasses.replace(base, frequency_penalty=0.6, presence_penalty=-0.5, repetition_penalty=0.8),
        dataclasses.replace(base, logit_bias={first.token_ids[1]: -100.0, 17: 3.0}),
        dataclasses.replace(base, min_tokens=9, stop_token_ids=(stop,), ignore_eos=False),
        base,
    ]


def _run(eng: Engine, prompts: list[list[int]], params: list[SamplingParams]):
    """Every parameter set with every prompt, in one batch."""
    batch = [(p, sp) for sp in params for p in prompts]
    return eng.generate(prompt_token_ids=[p for p, _ in batch], sampling=[sp for _, sp in batch])


@pytest.fixture(scope="module")
def plain_outputs(plain, prompts):
    params = _processed(prompts, plain)
    return params, _run(plain, prompts, params)


@pytest.mark.parametrize("graphs", [False, "emulate"])
@pytest.mark.parametrize("algorithm", sorted(DRAFTS))
def test_greedy_tokens_and_logprobs_with_processors_equal_plain_decoding(prompts, plain_outputs, algorithm, graphs):
    params, want = plain_outputs
    eng = _engine(algorithm, graphs)
    got = _run(eng, prompts, params)
    plain_tokens = [o.token_ids for o in want[-len(prompts) :]]
    for i, (a, b) in enumerate(zip(want, got)):
        sp = params[i // len(prompts)]
        assert (b.token_ids, b.finish_reason) == (a.token_ids, a.finish_reason), f"row {i}: {sp}"
        assert b.logprobs.top_ids == a.logprobs.top_ids
        torch.testing.assert_close(torch.tensor(b.logprobs.token), torch.tensor(a.logprobs.token), atol=ATOL, rtol=0)
        torch.testing.assert_close(torch.tensor(b.logprobs.top), torch.tensor(a.logprobs.top), atol=ATOL, rtol=0)
    for k, sp in enumerate(params[:-1]):  # each processor changed something
        assert [o.token_ids for o in want[k * len(prompts) : (k + 1) * len(prompts)]] != plain_tokens, sp
    accepted = [n for o in got for n in o.spec.accept_lengths]
    assert max(accepted) > 2 and min(accepted) < 4, f"drafts never partly accepted: {accepted}"
    eng.check_no_leak()


@pytest.mark.parametrize("algorithm", sorted(DRAFTS))
def test_prompt_logprobs_and_sampled_logprobs_are_the_targets(prompts, plain, algorithm):
    """Prompt logprobs as plain decoding's; a sampled token's logprob (temperature 1, nothing
    else) is the target's log_softmax at its position: plain decoding's prompt logprobs of the
    prompt and the sampled tokens."""
    eng = _engine(algorithm)
    sp = SamplingParams(max_new_tokens=N, temperature=1.0, seed=5, ignore_eos=True, logprobs=2, prompt_logprobs=2)
    got = eng.generate(prompt_token_ids=prompts, sampling=sp)
    full = [p + o.token_ids for p, o in zip(prompts, got)]
    ref = plain.generate(
        prompt_token_ids=full, sampling=SamplingParams(max_new_tokens=1, temperature=0.0, prompt_logprobs=2)
    )
    for prompt, out, r in zip(prompts, got, ref):
        n = len(prompt) - 1
        assert out.prompt_logprobs.top_ids == r.prompt_logprobs.top_ids[:n]
        torch.testing.assert_close(
            torch.tensor(out.prompt_logprobs.token), torch.tensor(r.prompt_logprobs.token[:n]), atol=ATOL, rtol=0
        )
        torch.testing.assert_close(
            torch.tensor(out.logprobs.token), torch.tensor(r.prompt_logprobs.token[n:]), atol=ATOL, rtol=0
        )
        assert out.logprobs.top_ids == r.prompt_logprobs.top_ids[n:]
    assert any(n > 1 for o in got for n in o.spec.accept_lengths)
    eng.check_no_leak()


@pytest.mark.parametrize("algorithm", sorted(DRAFTS))
def test_sampling_with_penalties_is_reproducible_from_its_seed(prompts, algorithm):
    """The same seeded requests alone and batched with others, twice: the same tokens (with fixed
    rounds: a seeded request's tokens follow the draft lengths its rounds ran, which an adaptive
    engine chooses from measured time)."""
    eng = _engine(algorithm, adaptive=False)
    sps = [
        SamplingParams(
            max_new_tokens=N,
            temperature=0.8,
            top_p=0.95,
            seed=seed,
            ignore_eos=True,
            frequency_penalty=0.7,
            presence_penalty=0.3,
            repetition_penalty=1.2,
            logit_bias={5: 2.0},
        )
        for seed in (1, 2)
    ]
    together = eng.generate(prompt_token_ids=prompts, sampling=sps)
    alone = [eng.generate(prompt_token_ids=[p], sampling=sp)[0] for p, sp in zip(prompts, sps)]
    assert [o.token_ids for o in together] == [o.token_ids for o in alone]
    other = dataclasses.replace(sps[0], seed=99)
    assert eng.generate(prompt_token_ids=prompts[:1], sampling=other)[0].token_ids != together[0].token_ids
    eng.check_no_leak()
