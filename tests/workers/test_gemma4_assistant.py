"""Gemma 4's assistant (`Gemma4AssistantForCausalLM`, built with transformers' classes) as the
frozen-KV MTP draft of a tiny Gemma 4 target, on the CPU.

- Every draft of a round has transformers' logits (float32 noise), given the target's KV and
  hidden state of the same prompt: with a full LM head and with the centroid head, for contexts
  inside the W + 1 keys its sliding layers read and beyond, on both backends.
- As a draft it is lossless: greedy tokens equal plain decoding's on both backends, page sizes
  16 and 64, with the prefix cache on and off; under emulated CUDA graphs on an SWA pool more
  than 85% full its chained drafts equal the eager engine's; sampled rounds are exact in
  distribution over its centroid subsets; no KV leaks.
- The invariants of docs/design.md §4 as end-to-end canaries on the Gemma 4 target with its
  assistant, each with the upstream mistake put back.
"""

import collections
import json
import os
import shutil

import pytest
import torch
import transformers
from safetensors.torch import load_file, save_file
from scipy.stats import chisquare

from attention import ForwardMode
from attention.trtllm_mha import TRTLLMMHABackend
from tests.draft_models import make_eagle_head, make_gemma4_assistant, make_perturbed_copy
from tests.hf_models import WINDOW, make_tiny_model, random_prompts
from tests.workers.test_speculative import _canary_run
from workers.engine import Engine, SamplingParams
from workers.memory import HybridSWAPool, build_pool, kv_layouts
from workers.models.gemma4_assistant import Gemma4Assistant
from workers.speculative import SpecConfig
from workers.speculative import worker as spec_worker

K = 3
BACKENDS = ["torch_native", "trtllm_mha"]
GREEDY = SamplingParams(max_new_tokens=24, temperature=0.0, ignore_eos=True)
FIRST = random_prompts([70, WINDOW + 3, 2 * WINDOW + 1], seed=2)
SECOND = [FIRST[0][:66] + [7, 8, 9]]  # starts on the first wave's pages


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    """A tiny Gemma 4 target (and transformers' model of it), assistants with random weights
    (full LM head, centroid head) and with a path copying their input token (some drafts
    accepted), and an exact copy of the target."""
    root = tmp_path_factory.mktemp("gemma4_assistant")
    target = str(root / "target")
    out = {"target": target, "hf": make_tiny_model("gemma4", target)}
    for seed, (name, ordered, copies) in enumerate(
        [("random-full", False, 0.0), ("random-centroids", True, 0.0), ("copy-centroids", True, 10.0)]
    ):
        out[name] = make_gemma4_assistant(target, str(root / name), ordered=ordered, seed=seed + 1, copies=copies)
    out["exact_copy"] = make_perturbed_copy(target, str(root / "exact_copy"), noise=0.0)
    return out


@pytest.fixture(scope="module")
def baselines():
    return {}


def _spec(draft: str, algorithm: str = "mtp", **extra) -> dict:
    return {"algorithm": algorithm, "draft_model": draft, "num_steps": K, "adaptive": False, **extra}


def _recording(runner, seen: list):
    forward = runner.forward

    def recorded(batch, pool=None):
        out = forward(batch, pool)
        seen.append((batch, out))
        return out

    return recorded


# -- the model against transformers ------------------------------------------------------------
@pytest.mark.parametrize("head", ["full", "centroids"])
@pytest.mark.parametrize("length", [5, 30])  # inside the W + 1 keys a sliding layer reads, and beyond
@pytest.mark.parametrize("backend", BACKENDS)
def test_draft_logits_match_transformers(models, backend, length, head):
    """The first round's drafts of one request: positions, logits (the centroid head's: the same
    tokens chosen and their logits), the state handed on and the drafted tokens equal transformers'
    assistant fed transformers' target KV (`shared_kv_states`) and hidden states of the prompt."""
    path = models[f"random-{head}"]
    prompt = random_prompts([length], seed=11)[0]
    eng = Engine(
        model=models["target"],
        page_size=4,
        attention_backend=backend,
        chunked_prefill_size=5,
        max_total_tokens=2048,
        speculative=_spec(path),
    )
    assert isinstance(eng.spec.drafter.runner.model, Gemma4Assistant)
    seen: list = []
    eng.spec.drafter.runner.forward = _recording(eng.spec.drafter.runner, seen)
    (out,) = eng.generate(prompt_token_ids=[prompt], sampling=SamplingParams(max_new_tokens=K + 2, temperature=0.0))
    eng.check_no_leak()

    target = models["hf"]
    assistant = transformers.Gemma4AssistantForCausalLM.from_pretrained(path, attn_implementation="eager").eval()
    with torch.no_grad():
        ref = target(torch.tensor([prompt]), return_shared_kv_states=True, output_hidden_states=True, use_cache=False)
        kv, state, token = ref.shared_kv_states, ref.hidden_states[-1][:, -1:], out.token_ids[0]
        for step, (batch, ours) in enumerate(seen[:K]):
            assert batch.positions.tolist() == [length], f"step {step + 1}: drafts sit at the pending token"
            embeds = target.get_input_embeddings()(torch.tensor([[token]]))
            theirs = assistant(
                inputs_embeds=torch.cat([embeds, state], dim=-1),
                position_ids=torch.tensor([[length]]),
                shared_kv_states=kv,
                attention_mask=torch.ones(1, length, dtype=torch.long),
            )
            logits, state = theirs.logits[0, -1], theirs.last_hidden_state
            if head == "centroids":  # transformers fills the rest with the chosen logits' minimum - 1
                chosen = (logits > logits.min()).nonzero().flatten()
                assert sorted(ours.ids[0].tolist()) == chosen.tolist(), f"step {step + 1}: other tokens scored"
                diff = (ours.logits[0] - logits[ours.ids[0]]).abs().max().item()
                drafted = int(ours.ids[0, ours.logits[0].argmax()])
            else:
                assert ours.ids is None
                diff = (ours.logits[0] - logits).abs().max().item()
                drafted = int(ours.logits[0].argmax())
            assert diff <= 1e-4, f"step {step + 1}: max |logit diff| {diff:.2e}"
            assert (ours.hidden[0] - state[0, 0]).abs().max().item() <= 1e-4, f"step {step + 1}: state differs"
            token = int(logits.argmax())
            assert drafted == token, f"step {step + 1}: drafted {drafted}, transformers {token}"


# -- lossless ------------------------------------------------------------------------------------
def _baseline(models, baselines, backend: str, page_size: int) -> list[list[int]]:
    key = (backend, page_size)
    if key not in baselines:
        eng = Engine(model=models["target"], page_size=page_size, attention_backend=backend, max_total_tokens=4096)
        outs = eng.generate(prompt_token_ids=FIRST, sampling=GREEDY)
        baselines[key] = [o.token_ids for o in outs + eng.generate(prompt_token_ids=SECOND, sampling=GREEDY)]
    return baselines[key]


@pytest.mark.parametrize("cache", [True, False], ids=["cache", "no_cache"])
@pytest.mark.parametrize("page_size", [16, 64])
@pytest.mark.parametrize("backend", BACKENDS)
def test_lossless_against_plain_greedy_decoding(models, baselines, backend, page_size, cache):
    """Two waves (the second on the first's pages) with the centroid-head assistant: plain
    decoding's tokens, some drafts accepted, the prefix cache hit only when on, no KV leaked."""
    eng = Engine(
        model=models["target"],
        page_size=page_size,
        attention_backend=backend,
        chunked_prefill_size=5,
        max_total_tokens=4096,
        enable_prefix_caching=cache,
        speculative=_spec(models["copy-centroids"]),
    )
    assert eng.spec.drafter.pool_kind == "target" and eng.spec.drafter.runner.pool is None
    outs = eng.generate(prompt_token_ids=FIRST, sampling=GREEDY)
    outs += eng.generate(prompt_token_ids=SECOND, sampling=GREEDY)
    assert [o.token_ids for o in outs] == _baseline(models, baselines, backend, page_size)
    lengths = collections.Counter(n for o in outs for n in o.spec.accept_lengths)
    assert lengths[1] and sum(lengths[n] for n in range(2, K + 2)), f"accept lengths {dict(lengths)}"
    assert (outs[-1].cached_tokens >= page_size) == cache, outs[-1].cached_tokens
    eng.check_no_leak()
    eng.flush_cache()
    eng.allocator.check_no_leak()


def _graph_engine(models, draft: str | None, graphs) -> Engine:
    """A small SWA pool: more than 85% of it in use while the five requests run."""
    return Engine(
        model=models["target"],
        page_size=4,
        attention_backend="trtllm_mha",
        max_total_tokens=1024,
        swa_full_tokens_ratio=0.12,
        chunked_prefill_size=16,
        context_length=256,
        max_running_requests=8,
        speculative=None if draft is None else _spec(models[draft]),
        cuda_graphs=graphs,
    )


GRAPH_PROMPTS = random_prompts([3 * WINDOW + 5, WINDOW + 3, 2 * WINDOW + 1, 5, 17], seed=7)


def test_emulated_graphs_on_a_busy_swa_pool_draft_as_eager(models):
    """Under emulated replay (drafts 1..k of a round chained in place, launched by the round
    before from accepted counts the host has not read) every round's drafts equal the eager
    engine's step-by-step drafts, the tokens plain decoding's, while the SWA pool is more than
    85% used at draft forwards; then every pool is back at its free count."""
    plain = _graph_engine(models, None, False).generate(prompt_token_ids=GRAPH_PROMPTS, sampling=GREEDY)
    engines = [_graph_engine(models, "copy-centroids", graphs) for graphs in (False, "emulate")]
    alloc, peak = engines[1].allocator, [0.0]
    forward = engines[1].spec.drafter.runner.forward

    def observed(batch, pool=None):
        s = alloc.stats()
        peak[0] = max(peak[0], 1 - s["swa_free"] / s["swa_total"])
        return forward(batch, pool)

    engines[1].spec.drafter.runner.forward = observed
    rids = [[eng.add_request(p, GREEDY) for p in GRAPH_PROMPTS] for eng in engines]
    rounds = 0
    while engines[0].has_unfinished():
        for eng in engines:
            eng.step()
        eager, replayed = (eng.last_step.drafts for eng in engines)
        assert replayed == eager
        rounds += bool(eager)
    outs = [[eng.output(r) for r in ids] for eng, ids in zip(engines, rids)]
    for got in outs:
        assert [o.token_ids for o in got] == [p.token_ids for p in plain]
    assert any(n > 1 for o in outs[1] for n in o.spec.accept_lengths), "no draft was accepted"
    graphs = engines[1].spec.drafter.runner.graphs
    assert rounds > 5 and graphs.replays > 0 and engines[1].spec.rounds_drafted_ahead > rounds // 2
    assert sorted(key.query_offset for key in graphs.families) == [1, 1, 1]  # a step, a chain, a round ahead
    assert peak[0] > 0.85, f"SWA pool peaked at {peak[0]:.0%}"
    for eng in engines:
        eng.check_no_leak()


# -- rejection sampling --------------------------------------------------------------------------
@pytest.fixture(scope="module")
def small_vocab(tmp_path_factory):
    """A Gemma 4 target of 8 tokens and an assistant scoring 4 of them a row (2 of 4 centroids)."""
    root = tmp_path_factory.mktemp("small_vocab")
    target = str(root / "target")
    hf = make_tiny_model("gemma4", target, vocab_size=8, vocab_size_per_layer_input=8)
    draft = make_gemma4_assistant(target, str(root / "assistant"), centroids=4, top_k=2, seed=5)
    return hf, target, draft


@pytest.mark.parametrize("variant", ["fixed", "keep_every_draft"])
def test_rejection_sampling_is_exact_in_distribution(small_vocab, variant, monkeypatch):
    """First and second token over many seeds: their joint distribution is the target's
    p(t1) p(t2 | t1), though each draft comes from a distribution that is zero off its row's
    centroid subset. Keeping every sampled draft (no rejection step) must be caught."""
    hf, target, draft = small_vocab
    if variant == "keep_every_draft":
        monkeypatch.setattr(
            spec_worker, "verify_sampling", lambda tp, dp, drafts, g: (len(drafts), int(tp[-1].argmax()))
        )
    prompt = [1, 5, 2, 7, 3, 0, 4, 6, 1, 2, 3]
    n = 1500
    eng = Engine(model=target, page_size=4, max_running_requests=64, max_total_tokens=8192, speculative=_spec(draft))
    outs = eng.generate(
        prompt_token_ids=[prompt] * n,
        sampling=[SamplingParams(max_new_tokens=2, temperature=1.0, ignore_eos=True, seed=s) for s in range(n)],
    )
    eng.check_no_leak()
    counts = collections.Counter(tuple(o.token_ids) for o in outs)
    with torch.no_grad():
        p1 = torch.softmax(hf(torch.tensor([prompt])).logits[0, -1], -1)
        p2 = torch.softmax(hf(torch.tensor([prompt + [t] for t in range(8)])).logits[:, -1], -1)
    expected = (p1[:, None] * p2).flatten().double() * n
    observed = torch.tensor([counts[(a, b)] for a in range(8) for b in range(8)], dtype=torch.float64)
    rare = expected < 5  # pooled: too rare for the chi-square approximation
    obs = torch.cat([observed[~rare], observed[rare].sum().view(1)])
    exp = torch.cat([expected[~rare], expected[rare].sum().view(1)])
    stat = chisquare(obs.numpy(), exp.numpy() * obs.sum().item() / exp.sum().item())
    accepted = sum(o.spec.accept_lengths[0] > 1 for o in outs)
    print(f"chi-square p={stat.pvalue:.3g}, first draft accepted in {accepted}/{n}")
    if variant == "keep_every_draft":
        assert stat.pvalue < 0.01
        return
    assert 0.05 * n < accepted < 0.95 * n, "the test needs both accepted and rejected drafts"
    assert stat.pvalue > 0.01


# -- the invariants of docs/design.md §4, end to end ------------------------------------------------
class _ResolvedAtConstruction:
    """Upstream bug 2 (§4.2): the draft's backend resolved SWA state once, from the pool it was
    built with (the draft worker's own, full-only), and kept it when the target's pool was
    swapped in for every forward; KV is read from the pool handed in."""

    def __init__(self, first, current):
        self._first, self._current = first, current
        self.page_size = current.page_size

    has_swa = property(lambda self: self._first.has_swa)
    swa_window = property(lambda self: self._first.swa_window)

    def is_swa_layer(self, layer_id):
        return self._first.is_swa_layer(layer_id)

    def translate_full_to_swa(self, locs):
        return self._first.translate_full_to_swa(locs)

    def translate_full_to_swa_host(self, locs):
        return self._first.translate_full_to_swa_host(locs)

    def kv_cache(self, layer_id):
        return self._current.kv_cache(layer_id)

    def set_kv(self, layer_id, locs, k, v):
        self._current.set_kv(layer_id, locs, k, v)

    def write_slots(self, layer_id, locs):
        return self._current.write_slots(layer_id, locs)


def _put_back(mistake: str, eng: Engine, monkeypatch) -> None:
    """Re-create one upstream mistake, as its bug report describes, in a built engine."""
    if mistake == "resolve_at_use":  # §4.2, the frozen-KV pool swap
        draft = eng.spec.drafter.runner
        own = build_pool(kv_layouts(draft.model.attention_layers), eng.allocator, eng.dtype, eng.device, False)
        original = TRTLLMMHABackend.init_forward_metadata

        def resolved_once(self, batch, pool):
            if self is draft.backend:
                pool = _ResolvedAtConstruction(own, pool)
            original(self, batch, pool)

        monkeypatch.setattr(TRTLLMMHABackend, "init_forward_metadata", resolved_once)
    elif mistake == "one_write_location":  # §4.4: an SWA write index left over from an earlier batch
        backend, left = eng.runner.backend, {}
        init = backend.init_forward_metadata

        def stale(batch, pool):
            init(batch, pool)
            md = backend._md
            if md.swa_out_loc is not None:
                md.swa_out_loc = left.setdefault(tuple(md.swa_out_loc.shape), md.swa_out_loc.clone())

        monkeypatch.setattr(backend, "init_forward_metadata", stale)
    elif mistake == "fresh_indices":  # §4.5: the translation memoised on (buffer address, size)
        memo, original = {}, HybridSWAPool.translate_full_to_swa_host

        def memoised(self, locs):
            key = (locs.__array_interface__["data"][0], locs.size)
            return memo.setdefault(key, original(self, locs))

        monkeypatch.setattr(HybridSWAPool, "translate_full_to_swa_host", memoised)


BUSY_LENGTHS = [160, 13, 21, 17, 29, 9, 25]


def _busy_engine(models, speculative, graphs) -> Engine:
    """Page 4, an SWA pool of 36 pages: a 160-token request holds the low full pages, so the
    others' full slot ids lie above the SWA pool's size, which they keep over 85% used."""
    return Engine(
        model=models["target"],
        page_size=4,
        attention_backend="trtllm_mha",
        chunked_prefill_size=4,
        max_total_tokens=1600,
        swa_full_tokens_ratio=36 / 400,
        max_running_requests=16,
        speculative=speculative,
        cuda_graphs=graphs,
    )


def _busy_prompts() -> tuple[list[list[int]], SamplingParams]:
    g = torch.Generator().manual_seed(5)
    prompts = [torch.randint(0, 256, (n,), generator=g).tolist() for n in BUSY_LENGTHS]
    return prompts, SamplingParams(max_new_tokens=3 * WINDOW, temperature=0.0, ignore_eos=True)


def _busy_run(models, graphs, mistake: str | None = None, monkeypatch=None) -> dict:
    """The Gemma 4 target with its random-weight assistant (drafts that depend on every key it
    reads) on the busy pool: each request's tokens and errors, every round's drafts, the SWA
    peak at draft forwards, whether full slot ids exceeded the SWA pool's size, and the
    forwards' (model, mode)."""
    eng = _busy_engine(models, _spec(models["random-centroids"]), graphs)
    if mistake is not None:
        _put_back(mistake, eng, monkeypatch)
    alloc, draft = eng.allocator, eng.spec.drafter.runner
    seen = {"peak": 0.0, "high_ids": False, "forwards": set()}
    forward = draft.forward

    def observed(batch, pool=None):
        s = alloc.stats()
        seen["peak"] = max(seen["peak"], 1 - s["swa_free"] / s["swa_total"])
        rows = [r.row for r in eng.scheduler.running if r.rid != rids[0] and r.kv_len]
        first_pages = eng.req_to_token.table[rows, 0].long() // alloc.page_size
        seen["high_ids"] |= bool(rows) and bool((first_pages > alloc.swa.num_pages).all())
        return forward(batch, pool)

    draft.forward = observed
    prompts, sampling = _busy_prompts()
    rids = [eng.add_request(p, sampling) for p in prompts]
    drafts = []
    while eng.has_unfinished():
        eng.step()
        drafts.append(eng.last_step.drafts)
        seen["forwards"] |= {(f.model, f.mode) for f in eng.last_step.forwards}
    outs = [eng.output(r) for r in rids]
    eng.check_no_leak()
    return {"tokens": [o.token_ids for o in outs], "errors": [o.error for o in outs], "drafts": drafts, **seen}


@pytest.fixture(scope="module")
def busy_reference(models):
    """The busy run as built, eager and under emulated graphs, and plain decoding's tokens."""
    prompts, sampling = _busy_prompts()
    plain = _busy_engine(models, None, False).generate(prompt_token_ids=prompts, sampling=sampling)
    return _busy_run(models, False), _busy_run(models, "emulate"), [o.token_ids for o in plain]


def _as_built(run: dict, reference: dict, plain: list[list[int]]) -> None:
    assert run["errors"] == [None] * len(plain), run["errors"]
    assert run["tokens"] == plain, "the greedy tokens changed"
    assert run["drafts"] == reference["drafts"], "the drafts changed"


@pytest.mark.parametrize("variant", ["fixed", "upstream_mistake"])
@pytest.mark.parametrize(
    "mistake, graphs", [("resolve_at_use", False), ("one_write_location", False), ("fresh_indices", "emulate")]
)
def test_invariant_canaries_with_the_assistant(models, busy_reference, monkeypatch, mistake, graphs, variant):
    """§4.2 (the assistant's backend handed the target's pool every forward: the upstream crash
    once the SWA pool was about 85% full), §4.4 and §4.5 (under replay): as built, tokens are
    plain decoding's and drafts the eager engine's, on a busy pool; with the mistake put back
    the check fails (other drafts or tokens, or a kernel contract refused)."""
    eager, replayed, plain = busy_reference
    reference = replayed if graphs else eager
    for run in (eager, replayed):
        assert run["peak"] > 0.85, f"SWA pool peaked at {run['peak']:.0%}"
        assert run["high_ids"], "full slot ids never exceeded the SWA pool size"
    if variant == "fixed":
        _as_built(reference, eager, plain)
        return
    run = _busy_run(models, graphs, mistake, monkeypatch)
    with pytest.raises(AssertionError):
        _as_built(run, eager, plain)


def test_uniform_decode_routing_with_the_assistant(busy_reference):
    """§4.3: a frozen-KV draft has no catch-up forward (the ragged DRAFT_EXTEND_V2 of the
    upstream crash cannot arise); its steps are single read-only queries and the target's
    verify is uniform, so both run the decode kernel (a ragged decode-routed batch is refused
    before any kernel runs, tests/attention/test_invariants.py)."""
    eager, replayed, _ = busy_reference
    for run in (eager, replayed):
        assert ("draft", "DECODE") in run["forwards"] and ("target", "TARGET_VERIFY") in run["forwards"]
        assert not {mode for model, mode in run["forwards"] if model == "draft"} - {"DECODE"}


@pytest.mark.parametrize("variant", ["fixed", "upstream_mistake"])
def test_pool_decides_canary_on_a_gemma4_target(models, monkeypatch, variant):
    """§4.1 concerns a draft with a pool of its own: the accept-length canary of
    tests/workers/test_speculative.py on the Gemma 4 target, with an exact copy of it drafting
    from a full-only pool on the target's SWA allocator (the assistant reads the target's pool,
    which decides as the allocator would)."""
    accept, peak, high_ids = _canary_run(models, "trtllm_mha", monkeypatch if variant != "fixed" else None)
    assert peak > 0.85 and high_ids
    mean = sum(map(sum, accept)) / sum(map(len, accept))
    if variant == "fixed":
        assert all(n == K + 1 for seq in accept for n in seq), accept
    else:
        assert mean < K, f"with the mistake put back the canary still saw a mean accept length of {mean:.2f}"


# -- configuration -------------------------------------------------------------------------------
def test_algorithm_names(models, tmp_path):
    """`mtp` names frozen-KV MTP; `nextn` too for a Gemma 4 assistant checkpoint, and EAGLE for
    any other draft (as before)."""
    eagle = make_eagle_head(models["target"], str(tmp_path / "eagle"), 1)
    assert SpecConfig.from_dict(_spec(models["copy-centroids"], "nextn")).algorithm == "frozen_kv_mtp"
    assert SpecConfig.from_dict(_spec(models["copy-centroids"], "mtp")).algorithm == "frozen_kv_mtp"
    assert SpecConfig.from_dict(_spec(eagle, "nextn")).algorithm == "eagle"
    eng = Engine(
        model=models["target"], page_size=16, max_total_tokens=512, speculative=_spec(models["random-full"], "nextn")
    )
    assert isinstance(eng.spec.drafter.runner.model, Gemma4Assistant)
    assert eng.allocator.sliding_window == WINDOW + 2  # the W + 1 keys before the drafts' position stay


def _edited(path: str, root, name: str, config=None, tensors=None) -> str:
    out = str(root / name)
    shutil.copytree(path, out)
    if config is not None:
        raw = json.load(open(os.path.join(out, "config.json")))
        config(raw)
        json.dump(raw, open(os.path.join(out, "config.json"), "w"))
    if tensors is not None:
        weights = load_file(os.path.join(out, "model.safetensors"))
        tensors(weights)
        save_file(weights, os.path.join(out, "model.safetensors"))
    return out


def test_drafts_it_cannot_serve_are_refused_naming_the_setting(models, tmp_path):
    gemma3 = str(tmp_path / "gemma3")
    make_tiny_model("gemma3", gemma3)
    hot = tmp_path / "hot.json"
    hot.write_text(json.dumps([1, 2, 3]))
    path = models["random-centroids"]
    narrow = _edited(path, tmp_path, "narrow", config=lambda c: c.update(backbone_hidden_size=32))
    heads = _edited(path, tmp_path, "heads", config=lambda c: c["text_config"].update(head_dim=8))
    twice = _edited(
        path,
        tmp_path,
        "twice",
        tensors=lambda w: w.update({"masked_embedding.token_ordering": torch.zeros(256, dtype=torch.int64)}),
    )
    cases = [
        (models["target"], _spec(path, token_map=str(hot)), "speculative.token_map: the draft's centroid head"),
        (gemma3, _spec(path), "a Gemma 4 assistant drafts for Gemma 4 targets"),
        (models["target"], _spec(narrow), "backbone_hidden_size 32 differs from the target's hidden_size 64"),
        (models["target"], _spec(heads), r"assistant layer 0 \(sliding-window attention\) has head_dim 8"),
        (models["target"], _spec(twice), "masked_embedding.token_ordering must list each of the 256 token ids once"),
    ]
    for target, spec, message in cases:
        with pytest.raises(ValueError, match=message):
            Engine(model=target, page_size=16, max_total_tokens=512, speculative=spec)


def test_forward_modes_of_a_round(models):
    """A round: draft steps 2..k at the pending token (step 1 came with the last verify or
    prefill), the target's verify, nothing else of the draft's."""
    eng = Engine(
        model=models["target"], page_size=4, max_total_tokens=1024, speculative=_spec(models["copy-centroids"])
    )
    eng.add_request(random_prompts([12])[0], GREEDY)
    steps = []
    while eng.has_unfinished():
        eng.step()
        steps.append([(f.model, f.mode) for f in eng.last_step.forwards])
    rounds = [s for s in steps if ("target", "TARGET_VERIFY") in s]
    assert rounds and all(s[: K - 1] == [("draft", "DECODE")] * (K - 1) for s in rounds)
    assert all(s[K - 1 :] == [("target", "TARGET_VERIFY"), ("draft", "DECODE")] for s in rounds[:-1])
    assert ForwardMode.DRAFT_EXTEND_V2.name not in {mode for s in steps for _, mode in s}
    eng.check_no_leak()
