"""One request must never take the engine loop down: sampling parameters the sampler cannot use
are refused up front, and a request whose own processing raises (its sampling, its verification,
building its output, its admission) fails alone while the other requests and the loop go on.
Other requests' greedy tokens are compared with a run that never saw the bad request."""

import math
import threading

import pytest
import torch

import workers.sampler as sampler_module
from tests.draft_models import make_target_and_draft
from tests.hf_models import make_tiny_model, random_prompts
from workers.engine import Engine, SamplingParams
from workers.rank_loop import ErrorCode, RankLoop
from workers.sampling_params import MIN_TEMPERATURE

GREEDY = SamplingParams(max_new_tokens=10, temperature=0.0, ignore_eos=True)
POISON_SEED = 666


@pytest.fixture(scope="module")
def gemma3_dir(tmp_path_factory):
    path = str(tmp_path_factory.mktemp("gemma3"))
    make_tiny_model("gemma3", path)
    return path


@pytest.fixture(scope="module")
def draft_models(tmp_path_factory):
    return make_target_and_draft(tmp_path_factory.mktemp("isolation"), noise=0.1)


def _engine(model: str, **kwargs) -> Engine:
    return Engine(
        model=model, page_size=4, max_total_tokens=2048, chunked_prefill_size=16, context_length=256, **kwargs
    )


@pytest.mark.parametrize(
    "field, value",
    [
        ("temperature", math.nan),
        ("temperature", math.inf),
        ("temperature", -math.inf),
        ("temperature", 1e-38),
        ("temperature", 1e-45),
        ("temperature", 5e-324),
        ("temperature", 1e30),
        ("top_p", math.nan),
        ("seed", 2**64),
        ("seed", 2**70),
        ("max_new_tokens", True),
        ("top_k", False),
        ("top_k", 2**40),
        ("temperature", "0.5"),
        ("ignore_eos", 1),
        ("stop_token_ids", (1, True)),
        ("stop_token_ids", tuple(range(2000))),
    ],
)
def test_sampling_params_refuse_what_the_sampler_cannot_use(field, value):
    with pytest.raises(ValueError, match=field):
        SamplingParams(**{field: value}).validate()


def test_the_smallest_temperature_allowed_samples_finite_tokens(gemma3_dir):
    eng = _engine(gemma3_dir)
    (ref,) = eng.generate(prompt_token_ids=[[3, 1, 4]], sampling=GREEDY)
    (out,) = eng.generate(
        prompt_token_ids=[[3, 1, 4]],
        sampling=SamplingParams(max_new_tokens=10, temperature=MIN_TEMPERATURE, ignore_eos=True, seed=1),
    )
    assert out.token_ids == ref.token_ids  # this cold a distribution is the argmax
    eng.check_no_leak()


class Loop:
    """A rank loop in a thread, collecting every request's updates."""

    def __init__(self, engine: Engine) -> None:
        self.updates: dict[str, list] = {}
        self.done: dict[str, threading.Event] = {}
        self.loop = RankLoop(engine, 0, on_updates=self._on_updates, idle_wait_s=0.05)
        self.thread = threading.Thread(target=self.loop.run, daemon=True)
        self.thread.start()

    def _on_updates(self, updates) -> None:
        for update in updates:
            self.updates.setdefault(update.rid, []).append(update)
            if update.finished:
                self.done.setdefault(update.rid, threading.Event()).set()

    def submit(self, rid: str, prompt: list[int], sampling: SamplingParams) -> None:
        self.done.setdefault(rid, threading.Event())
        self.loop.submit(rid, prompt, sampling)

    def result(self, rid: str):
        assert self.done[rid].wait(60), f"{rid} never finished"
        updates = self.updates[rid]
        return [t for u in updates for t in u.token_ids], updates[-1]

    def stop(self) -> None:
        self.loop.stop()
        self.thread.join(30)


def _poison_rows(monkeypatch) -> None:
    """The distribution of requests seeded with POISON_SEED turns to NaN, as a broken sampling
    parameter would make it: their draws raise, everybody else's do not."""
    real = sampler_module.distribution_logits

    def poisoned(logits, params):
        out = real(logits, params)
        bad = torch.tensor([p.seed == POISON_SEED for p in params], device=out.device)
        return torch.where(bad[:, None], torch.full_like(out, math.nan), out)

    monkeypatch.setattr(sampler_module, "distribution_logits", poisoned)
    import workers.speculative.worker as spec_worker

    monkeypatch.setattr(spec_worker, "distribution_logits", poisoned)


@pytest.mark.parametrize("algorithm", [None, "standalone"])
def test_an_exception_in_one_requests_sampling_fails_only_that_request(draft_models, monkeypatch, algorithm):
    target, draft = draft_models
    spec = {"algorithm": algorithm, "draft_model": draft, "num_steps": 3} if algorithm else None
    prompts = random_prompts([9, 14, 6], seed=5)
    ref = _engine(target, speculative=spec).generate(prompt_token_ids=prompts, sampling=GREEDY)
    _poison_rows(monkeypatch)
    engine = _engine(target, speculative=spec)
    loop = Loop(engine)
    try:
        loop.submit("poisoned", [7, 7, 7], SamplingParams(max_new_tokens=10, temperature=0.8, seed=POISON_SEED))
        for i, prompt in enumerate(prompts):
            loop.submit(f"ok{i}", prompt, GREEDY)
        loop.submit("sampled", [8, 8, 8], SamplingParams(max_new_tokens=10, temperature=0.8, seed=3, ignore_eos=True))
        _, last = loop.result("poisoned")
        assert last.code is ErrorCode.INTERNAL and "probability" in last.error
        for i, r in enumerate(ref):
            tokens, last = loop.result(f"ok{i}")
            assert tokens == r.token_ids and last.error is None and last.output.finish_reason == "length"
        tokens, last = loop.result("sampled")
        assert len(tokens) == 10 and last.error is None
        loop.submit("after", prompts[0], GREEDY)  # the loop goes on
        assert loop.result("after")[0] == ref[0].token_ids
        assert loop.loop.error is None and loop.loop.in_flight == 0
        engine.check_no_leak()
    finally:
        loop.stop()


def test_an_exception_building_one_output_fails_only_that_request(gemma3_dir, monkeypatch):
    engine = _engine(gemma3_dir)
    real = engine.output
    monkeypatch.setattr(
        engine, "output", lambda rid: (_ for _ in ()).throw(RuntimeError("no text")) if rid == "bad" else real(rid)
    )
    loop = Loop(engine)
    try:
        loop.submit("bad", [1, 2, 3], GREEDY)
        loop.submit("good", [1, 2, 3], GREEDY)
        _, bad = loop.result("bad")
        tokens, good = loop.result("good")
        assert bad.code is ErrorCode.INTERNAL and "no text" in bad.error
        assert len(tokens) == 10 and good.error is None
        engine.check_no_leak()
    finally:
        loop.stop()


def test_a_request_that_cannot_be_admitted_fails_alone(gemma3_dir, monkeypatch):
    engine = _engine(gemma3_dir)
    real = engine.add_request

    def add(prompt, sampling, request_id, **kw):
        if request_id == "bad":
            raise RuntimeError("Overflow when unpacking long")  # what a 65-bit seed did to the generator
        return real(prompt, sampling, request_id=request_id, **kw)

    monkeypatch.setattr(engine, "add_request", add)
    loop = Loop(engine)
    try:
        loop.submit("bad", [1, 2, 3], GREEDY)
        loop.submit("good", [1, 2, 3], GREEDY)
        assert loop.result("bad")[1].code is ErrorCode.INTERNAL
        assert len(loop.result("good")[0]) == 10 and loop.loop.error is None
        engine.check_no_leak()
    finally:
        loop.stop()


def test_a_failing_forward_fails_its_batch_and_the_engine_goes_on(gemma3_dir, monkeypatch):
    engine = _engine(gemma3_dir)
    real, calls = engine.runner.forward, []

    def forward(batch, *args, **kwargs):
        calls.append(batch)
        if len(calls) == 3:
            raise RuntimeError("kernel fault")
        return real(batch, *args, **kwargs)

    monkeypatch.setattr(engine.runner, "forward", forward)
    loop = Loop(engine)
    try:
        loop.submit("first", [1, 2, 3], GREEDY)
        _, last = loop.result("first")
        assert last.code is ErrorCode.INTERNAL and "kernel fault" in last.error
        loop.submit("second", [1, 2, 3], GREEDY)
        assert len(loop.result("second")[0]) == 10 and loop.loop.error is None
        engine.check_no_leak()
    finally:
        loop.stop()


def test_live_load_after_the_loop_broke(gemma3_dir, monkeypatch):
    """A stopped loop runs nothing and frees what it can: no negative waiting count, no pages
    reported as used by requests that are gone."""
    engine = _engine(gemma3_dir)
    monkeypatch.setattr(engine, "step", lambda: (_ for _ in ()).throw(RuntimeError("device lost")))
    loop = Loop(engine)
    try:
        loop.submit("a", [1, 2, 3], GREEDY)
        loop.submit("b", [4, 5, 6], GREEDY)
        assert loop.result("a")[1].code is ErrorCode.UNAVAILABLE
        assert loop.result("b")[1].code is ErrorCode.UNAVAILABLE
        load = loop.loop.load()
        assert (load["running"], load["waiting"], load["kv_full_used"], load["kv_swa_used"]) == (0, 0, 0, 0)
        engine.check_no_leak()
    finally:
        loop.stop()


def test_an_abort_reaches_only_the_request_its_id_named_when_it_was_sent(gemma3_dir):
    """An abort queued for a request that has ended, then a new request with the same id, in one
    plan: the new request runs to its end (plain decoding's tokens); an abort sent after a
    request in the same plan still ends it."""
    engine = _engine(gemma3_dir)
    (ref,) = _engine(gemma3_dir).generate(prompt_token_ids=[[4, 5, 6]], sampling=GREEDY)
    updates = []
    loop = RankLoop(engine, 0, on_updates=updates.extend)

    def run_plan() -> None:
        loop._apply(loop._next_plan())
        while engine.has_unfinished():
            loop._step()

    loop.submit("x", [1, 2, 3], SamplingParams(max_new_tokens=1, temperature=0.0))
    run_plan()
    loop.abort("x")  # the first "x" has ended: this abort is stale
    loop.submit("x", [4, 5, 6], GREEDY)
    loop.submit("y", [4, 5, 6], GREEDY)
    loop.abort("y")
    updates.clear()
    run_plan()
    tokens = {rid: [t for u in updates if u.rid == rid for t in u.token_ids] for rid in ("x", "y")}
    last = {u.rid: u for u in updates if u.finished}
    assert tokens["x"] == ref.token_ids and last["x"].output.finish_reason == "length"
    assert tokens["y"] == [] and last["y"].output.finish_reason == "abort"
    assert loop.in_flight == 0
    engine.check_no_leak()
