"""Speculative decoding on CPU: lossless greedy output for every algorithm x draft pool kind x
backend x target x page size, identical accept lengths on both backends, the accept-length
canary (with the upstream mistake of invariant 1, docs/design.md §4.1, put back), rejection sampling exact in
distribution, bad configurations and KV accounting."""

import collections
import json

import pytest
import torch
from scipy.stats import chisquare

from attention.trtllm_mha import TRTLLMMHABackend
from tests.attention.test_invariants import _AllocatorDecides
from tests.draft_models import SPEC_VARIANTS as VARIANTS
from tests.draft_models import make_perturbed_copy
from tests.hf_models import WINDOW, make_tiny_model, random_prompts
from workers.engine import Engine, SamplingParams
from workers.memory import HybridSWAAllocator, MHAPool
from workers.speculative import worker as spec_worker

K = 3
PROMPT_LENS = [3 * WINDOW + 5, WINDOW + 3, 2 * WINDOW + 1]  # longer than the window
GREEDY = SamplingParams(max_new_tokens=24, temperature=0.0, ignore_eos=True)
BACKENDS = ["torch_native", "trtllm_mha"]


@pytest.fixture(scope="module")
def baselines():
    return {}


def _engine(target: str, backend: str, page_size: int, speculative=None, **kw) -> Engine:
    return Engine(
        model=target,
        page_size=page_size,
        attention_backend=backend,
        chunked_prefill_size=5,
        max_total_tokens=4096,
        speculative=speculative,
        **kw,
    )


def _spec(algorithm: str, draft: str, pool: str | None = None, num_steps: int = K) -> dict:
    spec = {"algorithm": algorithm, "draft_model": draft, "num_steps": num_steps, "adaptive": False}  # fixed rounds
    if pool is not None:
        spec["draft_pool"] = pool
    return spec


@pytest.mark.parametrize("variant", sorted(VARIANTS))
@pytest.mark.parametrize("page_size", [1, 16])
@pytest.mark.parametrize("target", ["gemma3", "llama"])
def test_lossless_matrix(models, baselines, target, page_size, variant):
    m = models[target]
    algorithm, pool, draft = VARIANTS[variant]
    prompts = random_prompts(PROMPT_LENS)
    accept = {}
    for backend in BACKENDS:
        key = (target, page_size, backend)
        if key not in baselines:
            baselines[key] = [
                o.token_ids
                for o in _engine(m["target"], backend, page_size).generate(prompt_token_ids=prompts, sampling=GREEDY)
            ]
        eng = _engine(m["target"], backend, page_size, _spec(algorithm, m[draft], pool))
        assert eng.spec.drafter.pool_kind == pool
        outs = eng.generate(prompt_token_ids=prompts, sampling=GREEDY)
        assert [o.token_ids for o in outs] == baselines[key], f"{variant} on {backend} changed the greedy output"
        eng.check_no_leak()
        accept[backend] = [o.spec.accept_lengths for o in outs]
        for o in outs:
            assert o.spec.verify_steps == len(o.spec.accept_lengths) >= (GREEDY.max_new_tokens - 1) // (K + 1)
            assert sum(o.spec.accepted_per_position) == sum(n - 1 for n in o.spec.accept_lengths)
    assert accept["torch_native"] == accept["trtllm_mha"]
    if variant == "standalone-full":  # the perturbed copy exercises every partial acceptance
        assert {n for seq in accept["trtllm_mha"] for n in seq} == set(range(1, K + 2))


def test_draft_pool_kinds_on_the_shared_allocator(models):
    m = models["gemma3"]
    swa = _engine(m["target"], "trtllm_mha", 16, _spec("standalone", m["copy"], "swa"))
    full = _engine(m["target"], "trtllm_mha", 16, _spec("standalone", m["copy"], "full"))
    frozen = _engine(m["target"], "trtllm_mha", 16, _spec("frozen_kv_mtp", m["frozen"]))
    assert swa.spec.drafter.runner.pool.has_swa and not full.spec.drafter.runner.pool.has_swa
    assert isinstance(full.allocator, HybridSWAAllocator) and isinstance(full.spec.drafter.runner.pool, MHAPool)
    assert frozen.spec.drafter.runner.pool is None  # reads the target's pool, handed to each forward
    llama = models["llama"]
    mixed = _engine(llama["target"], "trtllm_mha", 16, _spec("standalone", llama["swa_draft"]))
    assert isinstance(mixed.allocator, HybridSWAAllocator) and not mixed.runner.pool.has_swa
    assert mixed.spec.drafter.runner.pool.has_swa


@pytest.mark.parametrize("variant", ["standalone-swa", "eagle1-full", "eagle3-full", "frozen_kv_mtp-target"])
def test_incremental_drafts_equal_a_fresh_prefill(models, variant):
    """The draft's state after chunked prefill, batching and many catch-ups over rejected drafts
    proposes the same drafts as a fresh engine that prefills the same tokens in one forward:
    the draft side is checked, which losslessness alone cannot see."""
    m = models["gemma3"]
    algorithm, pool, draft = VARIANTS[variant]
    spec = _spec(algorithm, m[draft], pool)
    eng = _engine(m["target"], "trtllm_mha", 4, spec)
    prompts = random_prompts(PROMPT_LENS, seed=8)
    rids = [eng.add_request(p, GREEDY) for p in prompts]
    rounds = []  # (tokens before the pending one, drafts)
    while eng.has_unfinished():
        before = {r.rid: r.tokens(0, r.num_tokens - 1) for r in eng.scheduler.running if r.prefilled}
        eng.step()
        rounds += [(before[rid], d) for rid, d in eng.last_step.drafts.items()]
    fresh = Engine(
        model=m["target"],
        page_size=16,
        attention_backend="torch_native",
        chunked_prefill_size=None,
        max_total_tokens=4096,
        speculative=spec,
    )
    for tokens, drafts in rounds[::4]:
        rid = fresh.add_request(tokens, SamplingParams(max_new_tokens=K + 2, temperature=0.0, ignore_eos=True))
        while not fresh.last_step.drafts:
            fresh.step()
        assert fresh.last_step.drafts[rid] == drafts
        fresh.abort(rid)
        fresh.step()
    assert len(rounds) > 12 and len(rids) == 3
    fresh.check_no_leak()


# -- accept-length canary ------------------------------------------------------------------------
class _UpstreamReadsByAllocator(_AllocatorDecides):
    """Upstream bug 1 as it shipped: the draft's pool (full-only) writes KV at full slots in its
    own index space, while the backend, asking the allocator, reads its sliding-window layers
    through SWA page tables."""

    def __init__(self, pool, allocator, windows, out_cache_loc):
        super().__init__(pool, allocator, windows)
        self._out_cache_loc = out_cache_loc

    def set_kv(self, layer_id, locs, k, v):
        self._pool.set_kv(layer_id, self._out_cache_loc, k, v)

    def write_slots(self, layer_id, locs):
        return self._out_cache_loc


def _canary_run(m, backend: str, monkeypatch=None):
    """A copy of the target drafts on a full-only pool on the target's SWA allocator, while
    other requests keep the SWA pool over 85% occupied (measured at every draft forward) with
    full slot ids above its size."""
    page = 4
    eng = Engine(
        model=m["target"],
        page_size=page,
        attention_backend=backend,
        chunked_prefill_size=4,
        max_total_tokens=400 * page,
        swa_full_tokens_ratio=36 / 400,
        max_running_requests=16,
        speculative=_spec("standalone", m["exact_copy"], "full"),
    )
    draft_runner, alloc = eng.spec.drafter.runner, eng.allocator
    if monkeypatch is not None:
        windows = dict(eng.cfg.layer_windows)
        original = TRTLLMMHABackend.init_forward_metadata

        def mistaken(self, batch, pool):
            if pool is draft_runner.pool:
                pool = _UpstreamReadsByAllocator(pool, alloc, windows, batch.out_cache_loc)
            original(self, batch, pool)

        monkeypatch.setattr(TRTLLMMHABackend, "init_forward_metadata", mistaken)
    g = torch.Generator().manual_seed(5)
    sp = SamplingParams(max_new_tokens=4 * WINDOW, temperature=0.0, ignore_eos=True)
    lengths = [200] + [13, 21, 17, 29, 9, 25, 33, 19]
    rids = [eng.add_request(torch.randint(0, 256, (n,), generator=g).tolist(), sp) for n in lengths]
    seen = {"peak": 0.0, "high_ids": False}
    forward = draft_runner.forward

    def observed_forward(batch, pool=None):
        s = alloc.stats()
        seen["peak"] = max(seen["peak"], 1 - s["swa_free"] / s["swa_total"])
        rows = [r.row for r in eng.scheduler.running if r.rid != rids[0] and r.kv_len]
        first_pages = eng.req_to_token.table[rows, 0].long() // page
        seen["high_ids"] |= bool(rows) and bool((first_pages > alloc.swa.num_pages).all())
        return forward(batch, pool)

    draft_runner.forward = observed_forward
    while eng.has_unfinished():
        eng.step()
    eng.check_no_leak()
    return [eng.output(r).spec.accept_lengths for r in rids], seen["peak"], seen["high_ids"]


@pytest.mark.parametrize("backend", BACKENDS)
def test_accept_length_canary(models, backend):
    accept, peak, high_ids = _canary_run(models["gemma3"], backend)
    assert peak > 0.85, f"SWA pool peaked at {peak:.0%}"
    assert high_ids, "full slot ids never exceeded the SWA pool size"
    assert all(n == K + 1 for seq in accept for n in seq), f"accept lengths below {K + 1}: {accept}"


def test_accept_length_canary_catches_the_upstream_mistake(models, monkeypatch):
    accept, peak, _ = _canary_run(models["gemma3"], "trtllm_mha", monkeypatch)
    assert peak > 0.85
    mean = sum(map(sum, accept)) / sum(map(len, accept))
    assert mean < K, f"with the mistake put back the canary still saw a mean accept length of {mean:.2f}"


@pytest.mark.parametrize("variant", ["standalone-swa", "standalone-full", "eagle3-full"])
def test_catch_up_padding_writes_only_slots_the_round_gives_back(models, variant):
    """The draft's catch-up after a verify runs num_steps + 1 rows per request; rows past the
    accepted tokens are padding. They may write draft KV only at slots their own request holds
    for this round, and after every round a request holds no slot past its pending token."""
    m = models["gemma3"]
    algorithm, pool, draft = VARIANTS[variant]
    eng = _engine(m["target"], "trtllm_mha", 4, _spec(algorithm, m[draft], pool))
    drafter, r2t, alloc = eng.spec.drafter, eng.req_to_token, eng.allocator
    forward, seen = drafter.runner.forward, collections.Counter()

    def checked_forward(batch, pool=None):
        if batch.forward_mode.name == "DRAFT_EXTEND_V2":
            width = K + 1
            assert batch.q_lens_cpu == [width] * batch.batch_size
            for i, row in enumerate(batch.host.req_pool_indices.tolist()):
                held = set(r2t.host[row, : alloc.allocated_len(row)].tolist())
                written = batch.host.out_cache_loc[i * width : (i + 1) * width].tolist()
                assert set(written) <= held, f"row {row} wrote slots it does not hold: {set(written) - held}"
            seen["catch_ups"] += 1
        return forward(batch, pool)

    drafter.runner.forward = checked_forward
    sp = SamplingParams(max_new_tokens=30, temperature=0.0, ignore_eos=True)
    for p in random_prompts(PROMPT_LENS):
        eng.add_request(p, sp)
    while eng.has_unfinished():
        eng.step()
        for req in eng.scheduler.running:
            if req.prefilled and not req.finished:
                assert alloc.allocated_len(req.row) <= req.num_tokens, "slots held past the pending token"
    assert seen["catch_ups"] > 0
    for rid in list(eng._requests):
        eng.release(rid)
    eng.check_no_leak()


@pytest.mark.parametrize(
    "variant, early", [("standalone-swa", True), ("eagle3-full", True), ("frozen_kv_mtp-target", False)]
)
def test_greedy_rounds_launch_the_catch_up_before_reading_the_verify(models, monkeypatch, variant, early):
    """With a fixed catch-up window the device runs the draft's catch-up while the host reads
    and commits the verify (a frozen-KV head's next step depends on what was accepted: after)."""
    m = models["gemma3"]
    algorithm, pool, draft = VARIANTS[variant]
    eng = _engine(m["target"], "trtllm_mha", 4, _spec(algorithm, m[draft], pool))
    events = []
    read = spec_worker.InFlight.read
    for name, runner in (("target", eng.runner), ("draft", eng.spec.drafter.runner)):
        monkeypatch.setattr(runner, "forward", _recording(runner.forward, name, events))

    def recorded_read(flight):
        events.append("read")
        return read(flight)

    monkeypatch.setattr(spec_worker.InFlight, "read", recorded_read)
    prompts = random_prompts(PROMPT_LENS)
    outputs = [o.token_ids for o in eng.generate(prompt_token_ids=prompts, sampling=GREEDY)]
    after_verify = [events[i + 1 : i + 3] for i, e in enumerate(events) if e == "target TARGET_VERIFY"]
    catch_up = "draft DRAFT_EXTEND_V2" if early else "draft DECODE"
    expected = [catch_up, "read"] if early else ["read", catch_up]
    assert after_verify and all(e == expected for e in after_verify[:-1]), after_verify[:3]
    plain = _engine(m["target"], "trtllm_mha", 4).generate(prompt_token_ids=prompts, sampling=GREEDY)
    assert outputs == [o.token_ids for o in plain]
    eng.check_no_leak()


def _recording(forward, name: str, events: list[str]):
    def recorded(batch, pool=None):
        events.append(f"{name} {batch.forward_mode.name}")
        return forward(batch, pool)

    return recorded


# -- rejection sampling ----------------------------------------------------------------------------
@pytest.fixture(scope="module")
def small_vocab(tmp_path_factory):
    root = tmp_path_factory.mktemp("small_vocab")
    target = str(root / "target")
    hf = make_tiny_model("gemma3", target, vocab_size=8)
    return hf, target, make_perturbed_copy(target, str(root / "draft"), noise=0.6)


@pytest.mark.parametrize("temperature, variant", [(0.7, "fixed"), (1.0, "fixed"), (1.0, "keep_every_draft")])
def test_rejection_sampling_is_exact_in_distribution(small_vocab, temperature, variant, monkeypatch):
    """First token (prefill) and second token (the first verify step) over many seeds: their
    joint distribution is the target's p(t1) p(t2 | t1). Keeping every sampled draft (no
    rejection step) emits the draft's distribution instead, which the test must catch."""
    hf, target, draft = small_vocab
    if variant == "keep_every_draft":
        monkeypatch.setattr(
            spec_worker, "verify_sampling", lambda tp, dp, drafts, g: (len(drafts), int(tp[-1].argmax()))
        )
    prompt = [1, 5, 2, 7, 3, 0, 4, 6, 1, 2, 3]
    n = 3000
    eng = Engine(
        model=target,
        page_size=4,
        max_running_requests=64,
        max_total_tokens=8192,
        speculative=_spec("standalone", draft, num_steps=3),
    )
    outs = eng.generate(
        prompt_token_ids=[prompt] * n,
        sampling=[SamplingParams(max_new_tokens=2, temperature=temperature, ignore_eos=True, seed=s) for s in range(n)],
    )
    eng.check_no_leak()
    counts = collections.Counter(tuple(o.token_ids) for o in outs)
    with torch.no_grad():
        p1 = torch.softmax(hf(torch.tensor([prompt])).logits[0, -1] / temperature, -1)
        seqs = torch.tensor([prompt + [t] for t in range(8)])
        p2 = torch.softmax(hf(seqs).logits[:, -1] / temperature, -1)
    joint = (p1[:, None] * p2).flatten().double()
    observed = torch.tensor([counts[(a, b)] for a in range(8) for b in range(8)], dtype=torch.float64)
    expected = joint * n
    rare = expected < 5  # pool cells too rare for the chi-square approximation
    obs = torch.cat([observed[~rare], observed[rare].sum().view(1)])
    exp = torch.cat([expected[~rare], expected[rare].sum().view(1)])
    stat = chisquare(obs.numpy(), exp.numpy() * obs.sum().item() / exp.sum().item())
    accepted = sum(o.spec.accept_lengths[0] > 1 for o in outs)
    print(f"T={temperature}: chi-square p={stat.pvalue:.3f}, first draft accepted in {accepted}/{n}")
    if variant == "keep_every_draft":
        assert stat.pvalue < 0.01
        return
    assert 0.05 * n < accepted < 0.95 * n, "the test needs both accepted and rejected drafts"
    assert stat.pvalue > 0.01


# -- configuration, stops, accounting --------------------------------------------------------------
def test_bad_speculative_configurations(models, tmp_path):
    m = models["gemma3"]
    other_vocab = str(tmp_path / "other_vocab")
    make_tiny_model("llama", other_vocab, vocab_size=300)
    wide = str(tmp_path / "wide_window")
    make_tiny_model("gemma3", wide, sliding_window=600)
    cases = [
        (_spec("medusa", m["copy"]), "speculative.algorithm"),
        (_spec(["eagle"], m["copy"]), "speculative.algorithm"),  # not a name at all
        (_spec("standalone", m["copy"], num_steps=0), "speculative.num_steps"),
        (_spec("standalone", m["copy"], num_steps=17), "speculative.num_steps"),
        (_spec("standalone", other_vocab), "vocabulary"),
        (_spec("standalone", wide), "sliding window 600"),
        (_spec("standalone", str(tmp_path / "absent")), "speculative.draft_model"),
        (_spec("eagle", m["eagle1"], "swa"), "speculative.draft_pool"),
        (_spec("standalone", m["copy"]) | {"temperature": 1.0}, "unknown option"),
        (_spec("frozen_kv_mtp", m["frozen"], num_steps=WINDOW), "speculative.num_steps"),
        (_spec("eagle", m["copy"]), "not an EAGLE head"),
        (_spec("standalone", models["llama"]["copy"], "swa"), "speculative.draft_pool"),
        (_spec("eagle", m["eagle1"]) | {"token_map": str(tmp_path / "absent.json")}, "speculative.token_map"),
        (_spec("eagle", m["eagle1"]) | {"token_map": _ids_file(tmp_path, "far", [1, 10**6])}, "speculative.token_map"),
        (_spec("eagle", m["eagle1"]) | {"token_map": _ids_file(tmp_path, "twice", [3, 5, 3])}, "twice"),
        (_spec("eagle", m["eagle3"]) | {"token_map": _ids_file(tmp_path, "ok", [1, 2, 3])}, "draft vocabulary"),
    ]
    for spec, message in cases:
        with pytest.raises(ValueError, match=message):
            Engine(model=m["target"], page_size=16, max_total_tokens=512, context_length=500, speculative=spec)


def _ids_file(root, name: str, ids: list[int]) -> str:
    path = root / f"{name}.json"
    path.write_text(json.dumps(ids))
    return str(path)


@pytest.mark.parametrize("graphs", [False, "emulate"])
@pytest.mark.parametrize("variant", ["standalone-full", "eagle1-full", "frozen_kv_mtp-target"])
def test_a_hot_token_map_keeps_the_output_and_drafts_only_listed_tokens(models, baselines, tmp_path, variant, graphs):
    """`speculative.token_map`: the draft's LM head keeps the rows of the listed tokens (here
    the even ids and the baseline's own tokens, so that drafts are still accepted); greedy
    output is the output without speculation, every draft is a listed token, accepted drafts
    still occur, and sampled rounds (rejection sampling over a draft distribution that is zero
    off the list) run too."""
    m = models["gemma3"]
    algorithm, pool, draft = VARIANTS[variant]
    prompts = random_prompts(PROMPT_LENS)
    key = ("gemma3", 16, "trtllm_mha")
    if key not in baselines:
        plain = _engine(m["target"], "trtllm_mha", 16)
        baselines[key] = [o.token_ids for o in plain.generate(prompt_token_ids=prompts, sampling=GREEDY)]
    vocab = Engine(model=m["target"], max_total_tokens=256).cfg.vocab_size
    listed = sorted(set(range(0, vocab, 2)) | {t for seq in baselines[key] for t in seq})
    spec = _spec(algorithm, m[draft], pool) | {"token_map": _ids_file(tmp_path, "hot", listed)}
    eng = _engine(m["target"], "trtllm_mha", 16, spec, cuda_graphs=graphs)
    assert eng.spec.drafter.token_map is not None and len(eng.spec.drafter.token_map) == len(listed)
    rids = [eng.add_request(p, GREEDY) for p in prompts]
    drafted: set[int] = set()
    while eng.has_unfinished():
        eng.step()
        drafted.update(t for d in eng.last_step.drafts.values() for t in d)
    outs = [eng.output(r) for r in rids]
    assert [o.token_ids for o in outs] == baselines[key]
    assert drafted and drafted <= set(listed)
    if variant == "standalone-full":  # the perturbed copy: drafts from the list are accepted
        assert any(n > 1 for o in outs for n in o.spec.accept_lengths)
    sampled = SamplingParams(max_new_tokens=12, temperature=0.8, top_p=0.9, seed=3, ignore_eos=True)
    assert all(len(o.token_ids) == 12 for o in eng.generate(prompt_token_ids=prompts, sampling=sampled))
    eng.check_no_leak()


def test_stops_inside_accepted_drafts_match_plain_decoding(models):
    m = models["gemma3"]
    prompt = random_prompts([19], seed=4)[0]
    plain = _engine(m["target"], "trtllm_mha", 4)
    spec = _engine(m["target"], "trtllm_mha", 4, _spec("standalone", m["exact_copy"], "full"))
    (ref,) = plain.generate(prompt_token_ids=[prompt], sampling=GREEDY)
    stop = ref.token_ids[6]
    for sp in (
        SamplingParams(max_new_tokens=24, temperature=0.0, ignore_eos=True, stop_token_ids=(stop,)),
        SamplingParams(max_new_tokens=7, temperature=0.0, ignore_eos=True),
    ):
        (a,) = plain.generate(prompt_token_ids=[prompt], sampling=sp)
        (b,) = spec.generate(prompt_token_ids=[prompt], sampling=sp)
        assert (b.token_ids, b.finish_reason) == (a.token_ids, a.finish_reason)
        spec.check_no_leak()


@pytest.mark.parametrize("variant", sorted(VARIANTS))
def test_a_prefill_chunk_ending_one_token_short_of_the_prompt(models, variant):
    """Chunks of 5 over an 11-token prompt end at 10: the target has KV for all but the last
    prompt token, and nothing was sampled yet (a frozen-KV draft once took that for a decode)."""
    m = models["gemma3"]
    algorithm, pool, draft = VARIANTS[variant]
    prompt = random_prompts([11], seed=6)[0]
    (want,) = _engine(m["target"], "trtllm_mha", 4).generate(prompt_token_ids=[prompt], sampling=GREEDY)
    eng = _engine(m["target"], "trtllm_mha", 4, _spec(algorithm, m[draft], pool))
    (got,) = eng.generate(prompt_token_ids=[prompt], sampling=GREEDY)
    assert (got.token_ids, got.finish_reason) == (want.token_ids, "length")


def test_abort_mid_round_frees_both_models_kv(models):
    m = models["gemma3"]
    eng = _engine(m["target"], "trtllm_mha", 4, _spec("eagle", m["eagle3"]))
    rid = eng.add_request(random_prompts([23])[0], GREEDY)
    modes = []
    while len(modes) < 12:
        eng.step()
        modes += [(f.model, f.mode) for f in eng.last_step.forwards]
    assert ("target", "TARGET_VERIFY") in modes and ("draft", "DRAFT_EXTEND_V2") in modes
    assert eng.abort(rid)
    eng.check_no_leak()


def test_step_records_show_the_round_in_order(models):
    m = models["gemma3"]
    eng = _engine(m["target"], "torch_native", 4, _spec("standalone", m["copy"], "swa"))
    eng.add_request(random_prompts([12])[0], GREEDY)
    steps = []
    while eng.has_unfinished():
        eng.step()
        steps.append([(f.model, f.mode) for f in eng.last_step.forwards])
    assert steps[0][:2] == [("target", "EXTEND"), ("draft", "EXTEND")]
    rounds = [s for s in steps if ("target", "TARGET_VERIFY") in s]
    assert rounds and all(s[: K - 1] == [("draft", "DECODE")] * (K - 1) for s in rounds)
    assert all(s[K - 1] == ("target", "TARGET_VERIFY") and s[K] == ("draft", "DRAFT_EXTEND_V2") for s in rounds[:-1])
    eng.check_no_leak()


@pytest.mark.parametrize("variant", sorted(VARIANTS))
@pytest.mark.parametrize("target", ["gemma3", "llama"])
def test_a_round_at_the_models_last_position_runs_past_it_safely(models, target, variant):
    """A request ending at the model's last position: the round's verify and drafts hold
    positions past it, which the RoPE tables must cover (they stopped at max_position_embeddings:
    an index error failed the request on a CPU, an unchecked read on a GPU). Output as plain
    decoding's, pools back at their free counts."""
    m = models[target]
    algorithm, pool, draft = VARIANTS[variant]
    with open(f"{m['target']}/config.json") as f:
        limit = json.load(f)["max_position_embeddings"]
    prompt = random_prompts([limit - 6])[0]
    sampling = SamplingParams(max_new_tokens=20, temperature=0.0, ignore_eos=True)
    (plain,) = Engine(model=m["target"], page_size=16, max_total_tokens=2 * limit).generate(
        prompt_token_ids=[prompt], sampling=sampling
    )
    eng = Engine(
        model=m["target"], page_size=16, max_total_tokens=2 * limit, speculative=_spec(algorithm, m[draft], pool)
    )
    (out,) = eng.generate(prompt_token_ids=[prompt], sampling=sampling)
    assert (plain.finish_reason, len(plain.token_ids)) == ("length", 6)
    assert (out.finish_reason, out.token_ids) == ("length", plain.token_ids)
    eng.check_no_leak()
