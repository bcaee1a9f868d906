"""Prefix caching over hybrid SWA pools (workers/radix_cache.py).

Lossless: with the cache on, greedy outputs equal those of a plain engine with it off, for every
speculative variant x backend x target x page size, on three workloads (a shared system prompt
longer than the window, a multi-turn conversation, an exact repeat), with the kernel contract
checks on. Hits are the expected page-aligned lengths; a hit reads the tree's pages in both
index spaces; evicted SWA pages cut a match; no forward writes a page the tree holds, and a
request's window release never frees the tree's SWA pages (each shown to fail with the mistake
put back); a property test drives random colliding prompts, aborts and pool pressure."""

import sys
import threading

import numpy as np
import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from tests.draft_models import SPEC_VARIANTS
from tests.hf_models import random_prompts
from workers.engine import Engine, SamplingParams
from workers.memory import HybridSWAAllocator
from workers.scheduler import Scheduler

GREEDY = SamplingParams(max_new_tokens=12, temperature=0.0, ignore_eos=True)
SYSTEM_LEN = 37  # > WINDOW, not a multiple of the page sizes
BACKENDS = ["torch_native", "trtllm_mha"]
VARIANTS = {"plain": None, **SPEC_VARIANTS}  # None: no speculation


def _engine(m: dict, backend: str, page_size: int, variant: str = "plain", **kw) -> Engine:
    spec = None
    if VARIANTS[variant] is not None:
        algorithm, pool, draft = VARIANTS[variant]
        spec = {"algorithm": algorithm, "draft_model": m[draft], "num_steps": 3, "draft_pool": pool, "adaptive": False}
    kw = {"chunked_prefill_size": 5, "max_total_tokens": 4096, **kw}
    return Engine(
        model=m["target"],
        page_size=page_size,
        attention_backend=backend,
        speculative=spec,
        debug_kv_checks=backend == "trtllm_mha",
        **kw,
    )


def _system_prompt_requests() -> list[list[int]]:
    """Workload (a): one system prompt, four suffixes that differ from their first token."""
    system = random_prompts([SYSTEM_LEN], seed=11)[0]
    tails = random_prompts([4, 5, 6, 8], seed=12)
    return [system + [240 + i] + tail for i, tail in enumerate(tails)]


def _run_workloads(eng: Engine) -> list[tuple[list[int], list[int], int]]:
    """(prompt, output tokens, cached tokens) of every request of workloads (a), (b), (c), in order."""
    done = []

    def run(prompts):
        outs = eng.generate(prompt_token_ids=prompts, sampling=GREEDY)
        done.extend((p, o.token_ids, o.cached_tokens) for p, o in zip(prompts, outs))
        return outs

    system = _system_prompt_requests()
    run(system[:1])  # (a): the first request fills the cache, the others hit it together
    run(system[1:])
    prompt = random_prompts([13], seed=13)[0]  # (b): each turn continues the last turn's sequence
    for new in random_prompts([6, 4], seed=14) + [[]]:
        out = run([prompt])[0]
        prompt = prompt + out.token_ids + new
    for _ in range(2):  # (c): an exact repeat
        run(random_prompts([23], seed=15))
    eng.check_no_leak()
    eng.flush_cache()
    eng.allocator.check_no_leak()
    return done


def _expected_hits(done: list, page_size: int, shifted: bool, plain: bool) -> list[tuple[int, int]]:
    """(least, most) cached tokens of each request of `_run_workloads`: page aligned, the last
    prompt token excluded; a shifted draft's page also needs the next token shared."""
    p = page_size

    def pages(n: int) -> int:
        return n // p * p

    system = pages(SYSTEM_LEN - 1 if shifted else SYSTEM_LEN)
    hits = [(0, 0)] + [(system, system)] * 3
    turns = done[4:7]
    hits.append((0, 0))
    for (prev_prompt, prev_out, _), (prompt, _, _) in zip(turns, turns[1:]):
        whole = min(pages(len(prev_prompt) + len(prev_out) - 1), pages(len(prompt) - 1))  # the last token has no KV
        hits.append((whole if plain else pages(len(prev_prompt)), whole))
    repeat = pages(len(done[-1][0]) - 1)
    return hits + [(0, 0), (repeat, repeat)]


@pytest.fixture(scope="module")
def baselines():
    return {}


@pytest.mark.parametrize("variant", sorted(VARIANTS))
@pytest.mark.parametrize("page_size", [1, 4, 16])
@pytest.mark.parametrize("target", ["gemma3", "llama"])
def test_lossless_with_hits(models, baselines, target, page_size, variant):
    m = models[target]
    for backend in BACKENDS:
        key = (target, page_size, backend)
        if key not in baselines:
            off = _engine(m, backend, page_size, enable_prefix_caching=False)
            baselines[key] = _run_workloads(off)
            assert all(hit == 0 for _, _, hit in baselines[key])
        eng = _engine(m, backend, page_size, variant)
        done = _run_workloads(eng)
        assert [d[:2] for d in done] == [b[:2] for b in baselines[key]], f"{variant} with the cache changed the output"
        shifted = eng.spec is not None and eng.spec.drafter.shift == 1
        own_draft_kv = eng.spec is not None and eng.spec.drafter.runner.pool is not None
        for (_, _, hit), (least, most) in zip(done, _expected_hits(done, page_size, shifted, not own_draft_kv)):
            assert least <= hit <= most and hit % page_size == 0, (variant, [d[2] for d in done])
        assert done[1][2] > 0 and done[-1][2] > 0


# -- what a hit reads ----------------------------------------------------------------------------
def _start_hit(eng: Engine) -> tuple:
    """Cache the first system-prompt request, admit the second; returns (request, its match)."""
    first, second = _system_prompt_requests()[:2]
    eng.generate(prompt_token_ids=[first], sampling=GREEDY)
    rid = eng.add_request(second, GREEDY)
    eng.step()
    req = eng._requests[rid]
    return req, req.cache_match


def test_a_hit_reads_the_trees_pages_in_both_index_spaces(models):
    eng = _engine(models["gemma3"], "trtllm_mha", 4, "standalone-swa")
    req, match = _start_hit(eng)
    p, alloc = 4, eng.allocator
    assert req.cached_tokens == len(match.nodes) * p == 36
    slots = eng.scheduler.req_to_token.slots(req.row, 0, req.cached_tokens)
    tree_slots = (np.asarray(match.pages)[:, None] * p + np.arange(p)).reshape(-1)
    assert np.array_equal(slots, tree_slots)  # full index space: the tree's pages
    window = eng.cache.swa_from(len(match.nodes))
    swa = alloc.full_to_swa[torch.from_numpy(tree_slots[window * p :])].numpy()
    tree_swa = np.array([alloc.swa_page_of(pg) for pg in match.pages[window:]])
    assert (tree_swa > 0).all() and np.array_equal(swa, (tree_swa[:, None] * p + np.arange(p)).reshape(-1))
    # the request shares the tree's SWA pages still inside its window (target and draft read them)
    held = tree_swa[alloc.swa_start(req.row) - window :]
    assert len(held) and all(alloc.swa.holders(pg) == 2 for pg in held)
    while eng.has_unfinished():
        eng.step()
    eng.check_no_leak()


def test_evicted_swa_pages_cut_the_match_and_the_rest_is_recomputed(models):
    m = models["gemma3"]
    first, second = _system_prompt_requests()[:2]
    want = _engine(m, "trtllm_mha", 4, enable_prefix_caching=False).generate(prompt_token_ids=[second], sampling=GREEDY)
    eng = _engine(m, "trtllm_mha", 4)
    eng.generate(prompt_token_ids=[first], sampling=GREEDY)
    nodes = eng.cache.match(second).nodes
    assert len(nodes) == 9 and all(n.swa for n in nodes[7:])  # the window before 36: pages 7, 8
    cached_pages = eng.cache.num_pages
    eng.cache._touch(nodes[8], 0)  # least recently used: SWA eviction takes it first
    assert eng.cache.evict_swa(1) == 1
    assert not nodes[8].swa and eng.cache.num_pages == cached_pages  # a tombstone: full page kept
    got = eng.generate(prompt_token_ids=[second], sampling=GREEDY)
    assert got[0].cached_tokens == 32  # cut to the last boundary whose window is held
    assert got[0].token_ids == want[0].token_ids
    eng.check_no_leak()


# -- regression tests with the mistake put back --------------------------------------------------
def _writes_never_touch_tree_pages(eng: Engine) -> list[str]:
    """Wrap every runner's forward: record a write into a page the tree holds."""
    problems = []
    runners = [eng.runner] + ([eng.spec.drafter.runner] if eng.spec is not None else [])
    for runner in runners:
        forward = runner.forward

        def checked(batch, *args, _forward=forward, **kw):
            tree = {n.page for n in eng.cache._nodes()}
            written = set((batch.out_cache_loc // eng.allocator.page_size).tolist())
            if written & tree:
                problems.append(f"{batch.forward_mode}: writes pages {sorted(written & tree)} the cache holds")
            return _forward(batch, *args, **kw)

        runner.forward = checked
    return problems


@pytest.mark.parametrize("variant", ["fixed", "upstream_mistake"])
@pytest.mark.parametrize("draft", ["standalone-swa", "eagle1-full"])
def test_a_shared_page_is_never_written_by_a_second_request(models, variant, draft, monkeypatch):
    if variant == "upstream_mistake":  # the hit recomputes its prefix into the shared pages
        start_on = Scheduler._start_on

        def recompute(self, req, match):
            start_on(self, req, match)
            req.kv_len = 0
            req.spec.draft_len = 0

        monkeypatch.setattr(Scheduler, "_start_on", recompute)
    eng = _engine(models["gemma3"], "trtllm_mha", 4, draft)
    problems = _writes_never_touch_tree_pages(eng)
    prompts = _system_prompt_requests()
    eng.generate(prompt_token_ids=prompts[:1], sampling=GREEDY)
    hits = eng.generate(prompt_token_ids=prompts[1:], sampling=GREEDY)
    assert all(o.cached_tokens == 36 for o in hits)
    assert bool(problems) == (variant == "upstream_mistake"), problems


def _tree_swa_pages_mapped(eng: Engine) -> None:
    for node in eng.cache._nodes():
        if node.swa and eng.allocator.swa_page_of(node.page) == 0:
            raise AssertionError(f"the cache's SWA page of full page {node.page} was freed under it")


@pytest.mark.parametrize("variant", ["fixed", "upstream_mistake"])
def test_window_release_never_frees_a_tree_owned_swa_page(models, variant, monkeypatch):
    if variant == "upstream_mistake":  # a request's window pages counted as its own alone

        def release_as_owner(self, row, seq_len):
            p, first = self.page_size, self._evicted.get(row, 0)
            upto = max(0, seq_len // p * p - self.sliding_window + 1) // p
            if upto > first:
                pages = self._row_full_pages(row, first, upto)
                self.swa._refs[[self.swa_page_of(pg) for pg in pages]] = 1
                self._unmap(pages)
                self._evicted[row] = upto

        monkeypatch.setattr(HybridSWAAllocator, "release_window", release_as_owner)
    eng = _engine(models["gemma3"], "trtllm_mha", 4, "standalone-swa")
    rid = eng.add_request(_system_prompt_requests()[0], GREEDY)
    checks = 0
    while eng.has_unfinished():
        eng.step()
        if eng.cache.num_swa_pages():
            checks += 1
            if variant == "fixed":
                _tree_swa_pages_mapped(eng)
            elif _tree_swa_pages_mapped_fails(eng):
                return
    assert variant == "fixed" and checks > 5 and eng.output(rid).finish_reason == "length"
    eng.check_no_leak()


def _tree_swa_pages_mapped_fails(eng: Engine) -> bool:
    try:
        _tree_swa_pages_mapped(eng)
    except AssertionError:
        return True
    return False


# -- property test --------------------------------------------------------------------------------
BASES = [[1, 2, 3, 1, 2, 3, 1, 2, 3, 1, 2, 3], [1, 2, 3, 3, 2, 1, 1, 2, 3, 3, 2, 1], [2] * 12]
REQUEST = st.tuples(
    st.sampled_from(range(len(BASES))),  # the base its prompt starts with
    st.integers(0, 12),  # how much of it
    st.lists(st.integers(1, 3), max_size=10),  # then this tail
    st.integers(0, 6),  # the step it arrives at
    st.one_of(st.none(), st.integers(0, 12)),  # abort it that many steps after it arrives
    st.integers(2, 8),  # max new tokens
)


@pytest.fixture(scope="module")
def pressure_engines(models):
    """Small pools (requests wait and the cache is evicted) with the cache on, and references."""
    m = models["gemma3"]
    kw = dict(page_size=2, max_total_tokens=96, swa_full_tokens_ratio=0.5, max_running_requests=4)
    on = {v: _engine(m, "trtllm_mha", variant=v, **kw) for v in ("plain", "eagle1-full")}
    return on, _engine(m, "torch_native", 2, enable_prefix_caching=False), {}


@pytest.mark.parametrize("variant", ["plain", "eagle1-full"])
@settings(max_examples=30, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(requests=st.lists(REQUEST, min_size=1, max_size=8))
def test_random_prefixes_aborts_and_pressure(pressure_engines, variant, requests):
    engines, reference, ref_cache = pressure_engines
    eng = engines[variant]
    pending = sorted(
        (
            (
                arrive,
                [0] + BASES[b][:n] + tail,
                abort,
                SamplingParams(max_new_tokens=k, temperature=0.0, ignore_eos=True),
            )
            for b, n, tail, arrive, abort, k in requests
        ),
        key=lambda r: r[0],
    )
    live, aborts, step = {}, {}, 0
    while pending or eng.has_unfinished():
        while pending and pending[0][0] <= step:
            _, prompt, abort, sampling = pending.pop(0)
            rid = eng.add_request(prompt, sampling)
            live[rid] = (prompt, sampling)
            if abort is not None:
                aborts[rid] = step + abort
        for rid in [r for r, at in aborts.items() if at == step]:
            eng.abort(rid)
        eng.step()
        step += 1
        assert step < 400, "requests did not finish: a deadlock or an admitted request that cannot finish"
    for rid, (prompt, sampling) in live.items():
        out = eng.output(rid)
        if out.finish_reason == "abort":
            continue
        assert out.finish_reason == "length"
        key = (tuple(prompt), sampling.max_new_tokens)
        if key not in ref_cache:
            ref_cache[key] = reference.generate(prompt_token_ids=[prompt], sampling=sampling)[0].token_ids
        assert out.token_ids == ref_cache[key]
        eng.release(rid)
    eng.check_no_leak()
    stats = eng.kv_stats()
    assert stats["full_free"] == stats["full_total"] and stats["swa_free"] == stats["swa_total"]


def test_kv_stats_read_from_another_thread_while_the_cache_changes(models):
    """Rank 0 answers load queries (`kv_stats`) from its event loop while its loop thread
    inserts into and evicts from the tree: a read must never fail (a failing read broke the
    update stream of every request in the replica)."""
    eng = _engine(models["gemma3"], "torch_native", 2, max_total_tokens=256, swa_full_tokens_ratio=0.5)
    errors, done = [], threading.Event()

    def read():
        while not done.is_set():
            try:
                stats = eng.kv_stats()
                assert 0 <= stats["full_free"] <= stats["full_total"], stats
            except Exception as exc:  # noqa: BLE001 - reported below
                errors.append(exc)
                return

    reader = threading.Thread(target=read)
    interval = sys.getswitchinterval()
    sys.setswitchinterval(1e-5)  # switch threads often: inside a read, not only between reads
    reader.start()
    try:
        # Eight requests of ~44 tokens a round overflow the 256-token pool: insertions and evictions
        # from the first round on. A read that iterates the tree's SWA index fails in the first
        # round (10 runs of 10); the second round evicts what the first one cached.
        for seed in range(2):
            eng.generate(prompt_token_ids=random_prompts([30 + seed % 5] * 8, seed=seed), sampling=GREEDY)
    finally:
        done.set()
        reader.join()
        sys.setswitchinterval(interval)
    assert not errors, errors
    eng.check_no_leak()


def test_eviction_reaches_the_trees_pages_under_a_running_requests_leaves():
    """A running request's pages entered the tree under a finished request's cached prefix: that
    prefix's pages, held by the tree alone (admission counts them as free for the asking), are
    internal nodes now, below leaves the running request still holds. A pool running short
    drops those leaves (freeing nothing: the request keeps its pages) to reach them, instead of
    failing the request that asked. Found by the random-pressure test above (an EAGLE engine
    whose verify ran out of pages with the tree holding ten)."""
    from workers.memory import KVAllocator
    from workers.memory.allocator import OutOfKVError
    from workers.memory.req_to_token import ReqToTokenPool
    from workers.radix_cache import RadixCache

    alloc = KVAllocator(ReqToTokenPool(2, 16, "cpu"), num_full_pages=8, page_size=2)
    cache = RadixCache(alloc)
    tokens = list(range(10, 20))
    done = alloc.req_to_token.alloc()
    alloc.extend(done, 4)
    cache.insert(tokens[:4], alloc.row_pages(done, 2), 0)
    alloc.free(done)
    alloc.req_to_token.free(done)  # its two pages: the tree's alone
    running = alloc.req_to_token.alloc()
    alloc.extend(running, 8)  # the same first four tokens in its own pages, then four more
    cache.insert(tokens[:8], alloc.row_pages(running, 4), 0)
    assert alloc.full.num_free == 2 and cache.num_pages == 4
    alloc.full.alloc(4)  # two free pages and the tree's two
    assert alloc.full.num_free == 0 and alloc.allocated_len(running) == 8
    assert [alloc.full.holders(pg) for pg in alloc.row_pages(running, 4)] == [1, 1, 1, 1]

    # With no page the tree holds alone, a short pool drops none of a running request's entries.
    alloc = KVAllocator(ReqToTokenPool(2, 16, "cpu"), num_full_pages=4, page_size=2)
    cache = RadixCache(alloc)
    running = alloc.req_to_token.alloc()
    alloc.extend(running, 8)
    cache.insert(tokens[:8], alloc.row_pages(running, 4), 0)
    with pytest.raises(OutOfKVError):
        alloc.full.alloc(1)
    assert cache.num_pages == 4
