"""n choices of one prompt (`Engine.add_choices`): the prompt is prefilled once and forked, the
other choices starting on its pages through the prefix cache's reference counts; each choice
equals a request of its own seed (seed + i); every pool is back at its free count afterwards.
With a speculative draft keeping KV of its own, forked choices draft from the shared pages and
stay lossless."""

import collections
import dataclasses

import pytest
import torch

from attention import ForwardMode
from ops import DEFAULT_MODEL, DRAFT_MODELS
from tests.hf_models import make_tiny_model, random_prompts
from workers.engine import Engine, SamplingParams

PAGE = 4
N = 4


@pytest.fixture(scope="module")
def target(tmp_path_factory) -> str:
    path = str(tmp_path_factory.mktemp("choices") / "gemma3")
    make_tiny_model("gemma3", path)
    return path


def _engine(model: str, **kw) -> Engine:
    return Engine(model=model, page_size=PAGE, max_total_tokens=2048, chunked_prefill_size=8, **kw)


def _prefilled(eng: Engine) -> collections.Counter:
    """Prompt tokens each request's prefill chunks compute, counted as the scheduler plans them."""
    counts: collections.Counter = collections.Counter()
    schedule = eng.scheduler.schedule

    def recording():
        sb = schedule()
        if sb is not None and sb.mode is ForwardMode.EXTEND:
            counts.update({req.rid: n for req, n in zip(sb.reqs, sb.q_lens)})
        return sb

    eng.scheduler.schedule = recording
    return counts


def _finish(eng: Engine, rids: list[str], steps: int = 500) -> list:
    for _ in range(steps):
        if all(eng._requests[r].finished for r in rids):
            break
        eng.step()
    assert all(eng._requests[r].finished for r in rids), "requests still waiting"
    outs = [eng.output(r) for r in rids]
    for r in rids:
        eng.release(r)
    return outs


def _all_free(eng: Engine) -> None:
    eng.check_no_leak()
    eng.flush_cache()
    stats = eng.kv_stats()
    assert stats["full_free"] == stats["full_total"] and stats["swa_free"] == stats["swa_total"], stats


def test_n_choices_prefill_once_and_equal_requests_of_their_seeds(target):
    prompt = random_prompts([37], seed=5)[0]
    sp = SamplingParams(max_new_tokens=10, temperature=0.9, seed=7, ignore_eos=True, logprobs=2, prompt_logprobs=1)
    eng = _engine(target)
    prefilled = _prefilled(eng)
    rids = eng.add_choices(prompt, sp, N, request_id="r")
    outs = _finish(eng, rids)
    shared = (len(prompt) - 1) // PAGE * PAGE  # the last prompt token is always computed
    assert rids == ["r", "r-1", "r-2", "r-3"]
    assert [prefilled[r] for r in rids] == [len(prompt)] + [len(prompt) - shared] * (N - 1)
    assert [o.cached_tokens for o in outs] == [0] + [shared] * (N - 1)
    assert outs[0].prompt_logprobs is not None and all(o.prompt_logprobs is None for o in outs[1:])
    assert len({tuple(o.token_ids) for o in outs}) > 1
    _all_free(eng)
    alone = _engine(target)
    for i, out in enumerate(outs):
        (ref,) = alone.generate(
            prompt_token_ids=[prompt], sampling=dataclasses.replace(sp, seed=7 + i, prompt_logprobs=None)
        )
        assert out.token_ids == ref.token_ids, f"choice {i}"
        lp, ref_lp = torch.tensor(out.logprobs.token), torch.tensor(ref.logprobs.token)
        torch.testing.assert_close(lp, ref_lp, atol=1e-5, rtol=0)


def test_choices_of_a_leader_that_ends_before_its_prefill_run_on(target):
    """Aborted while waiting, the leader holds nobody back: its choices prefill themselves."""
    prompt = random_prompts([21], seed=6)[0]
    eng = _engine(target, max_running_requests=2)
    busy = [
        eng.add_request(random_prompts([9], seed=s)[0], SamplingParams(max_new_tokens=30, ignore_eos=True))
        for s in (7, 8)
    ]
    eng.step()
    rids = eng.add_choices(prompt, SamplingParams(max_new_tokens=4, temperature=0.0, ignore_eos=True), 3)
    assert eng.abort(rids[0])
    eng.release(rids[0])
    outs = _finish(eng, rids[1:] + busy)
    assert [len(o.token_ids) for o in outs[:2]] == [4, 4] and outs[0].token_ids == outs[1].token_ids
    _all_free(eng)


def test_forked_choices_under_speculation_are_lossless():
    """A standalone draft (KV of its own, at the target's slots) over the shipped tiny models:
    greedy choices forked from one prefill equal plain greedy decoding."""
    spec = {"algorithm": "standalone", "draft_model": DRAFT_MODELS["standalone"], "num_steps": 3}
    prompt = random_prompts([29], seed=9)[0]
    greedy = SamplingParams(max_new_tokens=12, temperature=0.0, ignore_eos=True)
    (want,) = _engine(DEFAULT_MODEL).generate(prompt_token_ids=[prompt], sampling=greedy)
    eng = _engine(DEFAULT_MODEL, speculative=spec)
    outs = _finish(eng, eng.add_choices(prompt, greedy, 3))
    assert all(o.token_ids == want.token_ids for o in outs)
    assert [o.cached_tokens > 0 for o in outs] == [False, True, True]
    assert any(n > 1 for o in outs for n in o.spec.accept_lengths)
    _all_free(eng)
