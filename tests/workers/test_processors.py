"""The logits processor stage and logprobs against independent references: transformers' logits
processors (repetition penalty, min_p, minimum length, sequence bias) and `generate`, OpenAI's
formula for frequency and presence penalties, and log_softmax of transformers' logits for
returned logprobs and prompt logprobs (chunked prefill, prefix-cache hits). Speculative decoding
with processors is tested with the speculative tests."""

import dataclasses
import json
import os
import shutil
import threading

import pytest
import torch
from transformers import (
    MinNewTokensLengthLogitsProcessor,
    MinPLogitsWarper,
    RepetitionPenaltyLogitsProcessor,
    SequenceBiasLogitsProcessor,
    TemperatureLogitsWarper,
    TopKLogitsWarper,
)

from tests.hf_models import make_tiny_model, random_prompts
from workers.engine import Engine, SamplingParams
from workers.processors import TokenHistory, process
from workers.rank_loop import RankLoop
from workers.sampler import sampling_probs

VOCAB = 64
EOS = 3


def _logits(rows: int, seed: int = 0) -> torch.Tensor:
    return torch.randn(rows, VOCAB, generator=torch.Generator().manual_seed(seed)) * 3


def _history(seed: int = 0) -> TokenHistory:
    """Three rows: prompts and outputs with repeats, one row with nothing generated yet."""
    g = torch.Generator().manual_seed(seed)
    prompts = [torch.randint(0, VOCAB, (n,), generator=g).tolist() for n in (7, 3, 12)]
    outputs = [torch.randint(0, VOCAB // 4, (n,), generator=g).tolist() for n in (9, 0, 4)]
    return TokenHistory(prompts, outputs, frozenset({EOS}))


def _openai_penalties(logits: torch.Tensor, output: list[int], frequency: float, presence: float) -> torch.Tensor:
    counts = torch.bincount(torch.tensor(output, dtype=torch.int64), minlength=logits.shape[-1]).float()
    return logits - frequency * counts - presence * (counts > 0).float()


def _reference(logits: torch.Tensor, sp: SamplingParams, prompt: list[int], output: list[int]) -> torch.Tensor:
    """One row through transformers' processors (minimum length, bias, repetition) and OpenAI's
    frequency/presence formula, in vLLM's order."""
    ids = torch.tensor([prompt + output])
    row = logits[None].clone()
    if sp.min_tokens:
        row = MinNewTokensLengthLogitsProcessor(len(prompt), sp.min_tokens, [EOS, *sp.stop_token_ids])(ids, row)
    if sp.logit_bias:
        row = SequenceBiasLogitsProcessor([[[t], float(b)] for t, b in sp.logit_bias])(ids, row)
    if sp.repetition_penalty != 1.0:
        row = RepetitionPenaltyLogitsProcessor(sp.repetition_penalty)(ids, row)
    return _openai_penalties(row[0], output, sp.frequency_penalty, sp.presence_penalty)


@pytest.mark.parametrize(
    "sp",
    [
        SamplingParams(repetition_penalty=1.4),
        SamplingParams(repetition_penalty=0.6),
        SamplingParams(frequency_penalty=0.7),
        SamplingParams(presence_penalty=-1.5),
        SamplingParams(frequency_penalty=-0.4, presence_penalty=1.2),
        SamplingParams(logit_bias={5: 7.5, 40: -100, 2: 0.25}),
        SamplingParams(min_tokens=5, stop_token_ids=(9,)),
        SamplingParams(
            min_tokens=10,
            logit_bias={EOS: 4.0, 11: 2.0},
            repetition_penalty=1.3,
            frequency_penalty=0.5,
            presence_penalty=0.5,
        ),
    ],
    ids=["repetition", "repetition_below_1", "frequency", "presence", "both", "logit_bias", "min_tokens", "all"],
)
def test_the_stage_matches_transformers_processors(sp):
    logits, history = _logits(3), _history()
    ours = process(logits, [sp] * 3, history)
    for i in range(3):
        ref = _reference(logits[i], sp, history.prompts[i], history.outputs[i])
        torch.testing.assert_close(ours[i], ref, atol=1e-5, rtol=1e-5)


def test_min_tokens_masks_only_until_it_is_reached_and_honours_ignore_eos():
    logits = _logits(3)
    history = TokenHistory([[1]] * 3, [[4] * 4, [4] * 5, [4] * 4], frozenset({EOS}))
    ours = process(
        logits,
        [SamplingParams(min_tokens=5, stop_token_ids=(9,)) for _ in range(2)]
        + [SamplingParams(min_tokens=5, stop_token_ids=(9,), ignore_eos=True)],
        history,
    )
    assert ours[0, EOS] == ours[0, 9] == float("-inf")
    torch.testing.assert_close(ours[1], logits[1])  # five generated: nothing masked
    assert ours[2, 9] == float("-inf") and ours[2, EOS] == logits[2, EOS]  # EOS would not stop it


def test_rows_without_processors_are_left_alone():
    logits = _logits(3)
    plain = [SamplingParams(), SamplingParams(temperature=0.0, top_k=5, min_p=0.2)]
    view = logits[:2]
    assert process(view, plain, _history()) is view  # no copy, no kernel
    assert process(logits, [*plain, SamplingParams(min_tokens=2)]) is logits  # nothing it could hold back
    assert process(logits, [*plain, SamplingParams(min_tokens=2, stop_token_ids=(1,))]) is not logits
    mixed = process(logits, [SamplingParams(presence_penalty=1.0), *plain], _history())
    assert torch.equal(mixed[1:], logits[1:]) and not torch.equal(mixed[0], logits[0])


@pytest.mark.parametrize("temperature, min_p, top_k", [(1.0, 0.1, -1), (0.7, 0.3, -1), (1.3, 0.05, 6), (1.0, 1.0, -1)])
def test_min_p_matches_transformers_warper(temperature, min_p, top_k):
    """min_p after temperature (vLLM's and transformers' order); with top-k, which commutes with it."""
    logits = _logits(3, seed=1)
    ours = sampling_probs(logits, [SamplingParams(temperature=temperature, min_p=min_p, top_k=top_k)] * 3)
    ref = TemperatureLogitsWarper(temperature)(None, logits.clone())
    if top_k > 0:
        ref = TopKLogitsWarper(top_k)(None, ref)
    ref = MinPLogitsWarper(min_p)(None, ref)
    torch.testing.assert_close(ours, torch.softmax(ref, dim=-1), atol=1e-6, rtol=1e-5)


# -- the engine --------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    """A tiny Gemma 3 (transformers' model of it and its directory)."""
    path = str(tmp_path_factory.mktemp("gemma3"))
    return make_tiny_model("gemma3", path), path


def _engine(path: str, **kw) -> Engine:
    return Engine(model=path, page_size=4, max_total_tokens=2048, chunked_prefill_size=5, **kw)


PROMPTS = random_prompts([13, 6, 21], seed=11)


def _generate(hf, prompt: list[int], n: int, **kw) -> list[int]:
    out = hf.generate(torch.tensor([prompt]), max_new_tokens=n, do_sample=False, pad_token_id=0, **kw)
    return out[0, len(prompt) :].tolist()


@pytest.mark.parametrize(
    "kw, hf_kw",
    [
        (dict(repetition_penalty=1.3), dict(repetition_penalty=1.3)),
        (dict(repetition_penalty=0.7), dict(repetition_penalty=0.7)),
        (dict(logit_bias={17: -3.0, 93: 2.5, 200: 1.0}), dict(sequence_bias=[[[17], -3.0], [[93], 2.5], [[200], 1.0]])),
    ],
    ids=["repetition", "repetition_below_1", "logit_bias"],
)
def test_greedy_tokens_equal_transformers_generate(tiny, kw, hf_kw):
    """Rows with the processor batched with a plain greedy row, over chunked prefill."""
    hf, path = tiny
    eng = _engine(path)
    n = 14
    sp = SamplingParams(max_new_tokens=n, temperature=0.0, ignore_eos=True, **kw)
    plain = SamplingParams(max_new_tokens=n, temperature=0.0, ignore_eos=True)
    outs = eng.generate(prompt_token_ids=PROMPTS, sampling=[sp, plain, sp])
    for prompt, out, extra in zip(PROMPTS, outs, [hf_kw, {}, hf_kw]):
        assert out.token_ids == _generate(hf, prompt, n, **extra)
    assert outs[0].token_ids != _generate(hf, PROMPTS[0], n), "the processor changed nothing here"
    eng.check_no_leak()


def test_min_tokens_equals_transformers_generate(tiny, tmp_path):
    """The model's EOS (and a stop id) held back until min_tokens tokens were generated, as
    transformers' min_new_tokens holds back its EOS ids; then they stop the request."""
    hf, path = tiny
    prompt = PROMPTS[0]
    plain = _generate(hf, prompt, 12)
    eos = plain[1]  # plain decoding would stop at once
    stop = next(t for t in plain[2:] if t != eos)
    eos_dir = str(tmp_path / "eos")
    shutil.copytree(path, eos_dir)
    cfg = json.load(open(os.path.join(path, "config.json")))
    json.dump({**cfg, "eos_token_id": eos}, open(os.path.join(eos_dir, "config.json"), "w"))
    eng = _engine(eos_dir)
    for min_tokens in (0, 4, 9):
        sp = SamplingParams(max_new_tokens=12, temperature=0.0, min_tokens=min_tokens, stop_token_ids=(stop,))
        (out,) = eng.generate(prompt_token_ids=[prompt], sampling=sp)
        ref = _generate(hf, prompt, 12, min_new_tokens=min_tokens, eos_token_id=[eos, stop])
        ref = ref[: next((i + 1 for i, t in enumerate(ref) if t in (eos, stop)), len(ref))]
        assert out.token_ids == ref and out.finish_reason == ("stop" if ref[-1] in (eos, stop) else "length")
        assert len(out.token_ids) > min_tokens or min_tokens == 0
    eng.check_no_leak()


def test_frequency_and_presence_penalties_equal_openais_formula(tiny):
    """Greedy decoding with the penalties against a loop over transformers' logits."""
    hf, path = tiny
    eng = _engine(path)
    sps = [
        SamplingParams(max_new_tokens=12, temperature=0.0, ignore_eos=True, frequency_penalty=f, presence_penalty=p)
        for f, p in ((1.5, 0.0), (0.0, 2.0), (0.8, -0.5))
    ]
    outs = eng.generate(prompt_token_ids=PROMPTS, sampling=sps)
    for prompt, sp, out in zip(PROMPTS, sps, outs):
        tokens = []
        with torch.no_grad():
            for _ in range(sp.max_new_tokens):
                logits = hf(torch.tensor([prompt + tokens])).logits[0, -1]
                tokens.append(
                    int(_openai_penalties(logits, tokens, sp.frequency_penalty, sp.presence_penalty).argmax())
                )
        assert out.token_ids == tokens
    eng.check_no_leak()


def test_logprobs_and_prompt_logprobs_equal_transformers_log_softmax(tiny):
    """Over chunked prefill (chunks of 5), then with the prompt in the prefix cache: a request
    asking for prompt logprobs recomputes its prompt (no hit) and gets the same; one that does
    not ask takes the hit; both get the same logprobs."""
    hf, path = tiny
    eng = _engine(path)
    prompt = PROMPTS[2]
    asks = SamplingParams(max_new_tokens=6, temperature=0.0, ignore_eos=True, logprobs=5, prompt_logprobs=3)
    first = eng.generate(prompt_token_ids=[prompt], sampling=asks)[0]
    again = eng.generate(prompt_token_ids=[prompt], sampling=asks)[0]
    hit = eng.generate(prompt_token_ids=[prompt], sampling=dataclasses.replace(asks, prompt_logprobs=None))[0]
    assert first.cached_tokens == again.cached_tokens == 0 and hit.cached_tokens >= 16
    assert hit.prompt_logprobs is None and first.token_ids == again.token_ids == hit.token_ids
    with torch.no_grad():
        ref = torch.log_softmax(hf(torch.tensor([prompt + first.token_ids])).logits[0].float(), dim=-1)
    n = len(prompt)
    for out in (first, again):
        lp = out.prompt_logprobs
        assert len(lp) == n - 1 and all(len(ids) == 3 for ids in lp.top_ids)
        want = ref[torch.arange(n - 1), torch.tensor(prompt[1:])]
        torch.testing.assert_close(torch.tensor(lp.token), want, atol=2e-5, rtol=0)
        assert lp.top_ids == ref[: n - 1].topk(3).indices.tolist()
        torch.testing.assert_close(torch.tensor(lp.top), ref[: n - 1].topk(3).values, atol=2e-5, rtol=0)
    for out in (first, again, hit):
        lp = out.logprobs
        assert len(lp) == len(out.token_ids) == 6
        want = ref[torch.arange(n - 1, n + 5), torch.tensor(out.token_ids)]
        torch.testing.assert_close(torch.tensor(lp.token), want, atol=2e-5, rtol=0)
        assert lp.top_ids == ref[n - 1 : n + 5].topk(5).indices.tolist()
    eng.check_no_leak()


def test_logprobs_are_those_of_the_processed_distribution(tiny):
    """A greedy row's logprobs are the log_softmax of its processed logits; a sampled row's those
    of the distribution it was drawn from (temperature, top-k: -inf off it)."""
    hf, path = tiny
    eng = _engine(path)
    sps = [
        SamplingParams(max_new_tokens=5, temperature=0.0, ignore_eos=True, repetition_penalty=1.5, logprobs=2),
        SamplingParams(max_new_tokens=5, temperature=0.7, top_k=4, seed=3, ignore_eos=True, logprobs=6),
    ]
    outs = eng.generate(prompt_token_ids=PROMPTS[:2], sampling=sps)
    for prompt, sp, out in zip(PROMPTS, sps, outs):
        with torch.no_grad():
            logits = hf(torch.tensor([prompt + out.token_ids])).logits[0]
        for i, token in enumerate(out.token_ids):
            ids = torch.tensor([prompt + out.token_ids[:i]])
            row = RepetitionPenaltyLogitsProcessor(sp.repetition_penalty)(ids, logits[None, len(prompt) - 1 + i])
            if not sp.greedy:
                row = TopKLogitsWarper(sp.top_k)(ids, TemperatureLogitsWarper(sp.temperature)(ids, row))
            ref = torch.log_softmax(row[0], dim=-1)
            assert out.logprobs.token[i] == pytest.approx(ref[token].item(), abs=2e-5)
            top = ref.topk(sp.logprobs)
            torch.testing.assert_close(torch.tensor(out.logprobs.top[i]), top.values, atol=2e-5, rtol=0)
            if sp.greedy:
                assert out.logprobs.top_ids[i] == top.indices.tolist()
            else:  # 4 tokens kept, the rest ruled out
                assert set(out.logprobs.top_ids[i][:4]) == set(top.indices[:4].tolist())
                assert out.logprobs.top[i][4:] == [float("-inf")] * 2
    eng.check_no_leak()


def test_rank_loop_updates_carry_each_steps_logprobs(tiny):
    """What goes out per update: the new tokens' logprobs, the prompt's with the first token."""
    _, path = tiny
    eng = _engine(path)
    updates, done = [], threading.Event()

    def on_updates(batch):
        updates.extend(batch)
        if any(u.finished for u in batch):
            done.set()

    loop = RankLoop(eng, 0, on_updates=on_updates, idle_wait_s=0.05)
    thread = threading.Thread(target=loop.run, daemon=True)
    thread.start()
    sp = SamplingParams(max_new_tokens=5, temperature=0.0, ignore_eos=True, logprobs=1, prompt_logprobs=0)
    try:
        loop.submit("r", PROMPTS[0], sp)
        assert done.wait(60)
    finally:
        loop.stop()
        thread.join(30)
    final = updates[-1].output
    assert [len(u.logprobs) for u in updates if u.token_ids] == [len(u.token_ids) for u in updates if u.token_ids]
    assert [t for u in updates if u.token_ids for t in u.logprobs.token] == final.logprobs.token
    with_prompt = [u for u in updates if u.prompt_logprobs is not None]
    assert (
        len(with_prompt) == 1
        and with_prompt[0] is updates[0]
        and with_prompt[0].prompt_logprobs == final.prompt_logprobs
    )
    assert len(final.prompt_logprobs) == len(PROMPTS[0]) - 1 and final.prompt_logprobs.top_ids[0] == []
    eng.check_no_leak()


def test_overlapped_greedy_decoding_leaves_rows_with_processors_to_the_processed_path(tiny):
    """Emulated decode graphs with their fused argmax, launched one step ahead: a batch with a
    penalised row takes the processed path (never launched ahead), a plain batch the fused one;
    both give transformers' tokens."""
    hf, path = tiny
    eng = _engine(path, attention_backend="trtllm_mha", cuda_graphs="emulate", overlap_schedule=True)
    n = 10
    sps = [
        SamplingParams(max_new_tokens=n, temperature=0.0, ignore_eos=True, repetition_penalty=1.4),
        SamplingParams(max_new_tokens=n, temperature=0.0, ignore_eos=True),
    ]
    for batch, want_ahead in ((sps, False), (sps[1:] * 2, True)):
        rids = [eng.add_request(p, sp) for p, sp in zip(PROMPTS, batch)]
        ahead = False
        while eng.has_unfinished():
            eng.step()
            ahead |= eng.step_in_flight
        assert ahead == want_ahead
        for rid, prompt, sp in zip(rids, PROMPTS, batch):
            extra = {"repetition_penalty": sp.repetition_penalty} if sp.penalized else {}
            assert eng.output(rid).token_ids == _generate(hf, prompt, n, **extra)
            eng.release(rid)
    eng.check_no_leak()
