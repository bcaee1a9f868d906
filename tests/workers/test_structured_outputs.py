"""Structured outputs (workers/grammar.py) on the shipped tiny models, against independent
references: `json.loads` and the schema's own constraints, `re.fullmatch`, the choices, and
xgrammar's own matcher accepting every output token; greedy tokens under speculative decoding
(every draft of the shipped models, eager and with emulated CUDA graphs) equal plain greedy
decoding's under the same grammar, drafted on the device with at most k + 1 reads a round; a
draft vocabulary without an allowed token still proposes what the grammar allows; sampled JSON
always parses and validates; rejection sampling under a grammar is exact in distribution; a
hostile grammar is refused within its bound, naming its field, while other requests decode, and
leaves no KV behind."""

import collections
import dataclasses
import json
import os
import re
import threading
import time

import pytest
import torch
from scipy.stats import chisquare

from ops import MODELS_DIR
from tests.draft_models import make_perturbed_copy
from tests.hf_models import make_tiny_model
from tests.workers.test_adaptive_spec import Schedule
from workers.engine import Engine, SamplingParams
from workers.grammar import GrammarCompiler, Matcher, StructuredOutputs, xgrammar
from workers.grammar_masks import GrammarMasks, MaskRow
from workers.rank_loop import ErrorCode, RankLoop
from workers.speculative import drafter as drafter_module
from workers.speculative import worker as spec_worker
from workers.tokenizer import load_tokenizer

TARGET = os.path.join(MODELS_DIR, "tiny-gemma3")
DRAFTS = {
    "standalone": os.path.join(MODELS_DIR, "tiny-gemma3-draft"),
    "eagle": os.path.join(MODELS_DIR, "tiny-gemma3-eagle"),
    "frozen_kv_mtp": os.path.join(MODELS_DIR, "tiny-gemma3-mtp"),
}
TEXTS = [
    "def read_config(path):\n    with open(path) as f:\n        return json.load(f)\n\n\ndef ",
    "import os\nimport sys\n\n\nif __name__ == '__main__':\n    ",
]
SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 10},
        "count": {"type": "integer", "minimum": 0, "maximum": 999},
        "ok": {"type": "boolean"},
        "kind": {"enum": ["file", "dir"]},
    },
    "required": ["name", "count", "ok", "kind"],
}
REGEX = r"[a-z_]+\([a-z, ]*\):"
CHOICE = ["alpha", "beta", "gamma delta"]
GRAMMAR = 'root ::= "x = " [0-9] [0-9]? ";"'
SPECS = [
    StructuredOutputs(json=SCHEMA),
    StructuredOutputs(regex=REGEX),
    StructuredOutputs(choice=CHOICE),
    StructuredOutputs(grammar=GRAMMAR),
    StructuredOutputs(json_object=True),
]
N = 40
# a schema that takes seconds to compile (xgrammar's work grows with its alternatives)
SLOW_SCHEMA = {
    "anyOf": [
        {
            "type": "object",
            "properties": {f"k{i}": {"type": "string", "pattern": "(a|b){200}"} for i in range(50)},
            "required": [f"k{i}" for i in range(50)],
        }
    ]
    * 3
}


def _engine(speculative: str | None = None, graphs: bool | str = False, **kwargs) -> Engine:
    spec = None if speculative is None else {"algorithm": speculative, "draft_model": DRAFTS[speculative]}
    return Engine(
        model=TARGET,
        page_size=4,
        attention_backend="trtllm_mha",
        max_total_tokens=4096,
        context_length=256,
        chunked_prefill_size=9,
        max_running_requests=kwargs.pop("max_running_requests", 16),
        speculative=None if spec is None else spec | {"num_steps": 3, "adaptive": False},  # fixed rounds
        cuda_graphs=graphs,
        **kwargs,
    )


@pytest.fixture(scope="module")
def prompts() -> list[list[int]]:
    tokenizer = load_tokenizer(TARGET)
    return [tokenizer.encode(t) for t in TEXTS]


@pytest.fixture(scope="module")
def plain() -> Engine:
    return _engine()


def _greedy(spec: StructuredOutputs, **kwargs) -> SamplingParams:
    return SamplingParams(max_new_tokens=N, temperature=0.0, structured_outputs=spec, **kwargs)


def _run(eng: Engine, prompts: list[list[int]], params: list[SamplingParams]):
    batch = [(p, sp) for sp in params for p in prompts]
    return eng.generate(prompt_token_ids=[p for p, _ in batch], sampling=[sp for _, sp in batch])


@pytest.fixture(scope="module")
def plain_outputs(plain, prompts):
    params = [_greedy(s) for s in SPECS]
    return params, _run(plain, prompts, params)


def _check_schema(value: object) -> None:
    assert isinstance(value, dict) and set(value) == set(SCHEMA["required"]), value
    assert isinstance(value["name"], str) and len(value["name"]) <= 10
    assert type(value["count"]) is int and 0 <= value["count"] <= 999
    assert type(value["ok"]) is bool and value["kind"] in ("file", "dir")


def _matches(spec: StructuredOutputs, text: str) -> bool:
    """The independent reference of each kind."""
    if spec.json is not None:
        _check_schema(json.loads(text))
        return True
    if spec.json_object:
        return isinstance(json.loads(text), dict)
    if spec.regex is not None:
        return re.fullmatch(REGEX, text) is not None
    if spec.choice is not None:
        return text in CHOICE
    return re.fullmatch(r"x = [0-9][0-9]?;", text) is not None


def test_each_kind_of_output_matches_its_reference_and_xgrammars_matcher(plain, prompts, plain_outputs):
    params, outs = plain_outputs
    eos = plain.cfg.eos_token_ids
    compiler = GrammarCompiler.of_tokenizer(plain.tokenizer, plain.cfg.vocab_size, eos)
    unconstrained = _run(plain, prompts, [SamplingParams(max_new_tokens=N, temperature=0.0)])
    for i, out in enumerate(outs):
        spec = params[i // len(prompts)].structured_outputs
        assert out.finish_reason == "stop" or spec.json_object, (spec.kind, out.text)  # json_object may run long
        if out.finish_reason == "stop":
            assert out.token_ids[-1] in eos and _matches(spec, out.text), (spec.kind, out.text)
        matcher = xgrammar().GrammarMatcher(compiler.compile(spec))
        assert all(matcher.accept_token(t) for t in out.token_ids), (spec.kind, out.token_ids)
        assert matcher.is_terminated() == (out.finish_reason == "stop")
    assert all(not _matches(StructuredOutputs(regex=REGEX), o.text) for o in unconstrained)  # the mask did it
    plain.check_no_leak()


@pytest.mark.parametrize(
    "algorithm, graphs, masked",
    [(a, g, False) for a in sorted(DRAFTS) for g in (False, "emulate")]
    + [(a, "emulate", True) for a in sorted(DRAFTS)],
)
def test_greedy_under_speculation_equals_plain_decoding(prompts, plain_outputs, algorithm, graphs, masked, monkeypatch):
    """Every verify position masked after its draft prefix (a prefix the grammar refuses masks
    nothing: acceptance stops before it), acceptance over the masked distributions: the tokens are
    plain decoding's. The rounds draft on the device (no host draw, no target-wide draft row).
    With free drafts (the default) a round reads the device twice: its drafts while the verify
    runs, to fill the verify's masks, then the verify's choices; under graphs the next round's
    verify is launched ahead with its drafts' copy, read once this round is committed to fill
    its masks (a third read, and the round it serves reads once more); with `masked_drafts` every draft
    step is masked after the drafts before it and a round reads at most k + 1 times: each draft,
    then the verify's choices. Under (emulated) graphs every draft step, verify and catch-up
    replays its graph; a draft with a fixed catch-up window launches it before the round's last
    read."""
    params, want = plain_outputs
    eng = _engine(algorithm, graphs)
    eng.spec.drafter.masked_drafts = masked
    reads, rounds, launched = [], [], []  # launched: each round's forwards (mode, graphed) and reads

    def counted(flight):
        reads[-1] += 1
        launched[-1].append(("read", None))
        return read(flight)

    def round_of(reqs, k):
        reads.append(0)
        launched.append([])
        events = decode_round(reqs, k)
        rounds.append((k, reads[-1]))
        return events

    def logged(runner):
        def forward(batch, pool=None):
            graphed = runner.graphs is not None and runner.graphs.can_run(batch, runner.pool if pool is None else pool)
            if launched:
                launched[-1].append((batch.forward_mode.name, graphed))
            return runner_forward[id(runner)](batch, pool)

        return forward

    runners = {id(r): r for r in (eng.spec.target, eng.spec.drafter.runner)}
    runner_forward = {i: r.forward for i, r in runners.items()}
    for runner in runners.values():
        monkeypatch.setattr(runner, "forward", logged(runner))

    def refused(*args, **kwargs):
        raise AssertionError("a greedy round under grammars drew on the host")

    read, decode_round = spec_worker.InFlight.read, eng.spec.decode_round
    monkeypatch.setattr(spec_worker.InFlight, "read", counted)
    monkeypatch.setattr(eng.spec, "decode_round", round_of)
    for module, name in ((spec_worker, "draw_each"), (drafter_module, "draw_each")):
        monkeypatch.setattr(module, name, refused)
    monkeypatch.setattr(eng.spec.drafter, "target_logits", refused)
    got = _run(eng, prompts, params)
    for i, (a, b) in enumerate(zip(want, got)):
        assert (b.token_ids, b.finish_reason) == (a.token_ids, a.finish_reason), (i, a.text, b.text)
    accepted = [n for o in got for n in o.spec.accept_lengths]
    assert max(accepted) > 2 and min(accepted) < 4, f"drafts never partly accepted: {accepted}"
    assert rounds and eng.spec.masked_rounds == (len(rounds) if masked else 0)
    most = [k + 1 if masked else 3 if graphs else 2 for k, _ in rounds]
    assert all(n <= m for (_, n), m in zip(rounds, most)) and any(n == m for (_, n), m in zip(rounds, most)), rounds
    if graphs and not masked:  # the next round's verify launched ahead, its masks filled once this one is committed
        assert eng.spec.rounds_verified_ahead > len(rounds) // 4, (eng.spec.rounds_verified_ahead, len(rounds))
    if graphs:  # (a catch-up after plain steps is ragged: eager by design)
        assert all(graphed for log in launched for mode, graphed in log if mode not in ("read", "EXTEND")), launched
    if eng.spec.drafter.fixed_window:
        for log in launched:
            modes = [mode for mode, _ in log]
            last_read = len(modes) - 1 - modes[::-1].index("read")
            assert "DRAFT_EXTEND_V2" in modes[:last_read], log
    eng.check_no_leak()


@pytest.mark.parametrize("algorithm", ["eagle", "frozen_kv_mtp"])
def test_masked_rounds_launch_the_next_first_draft_step_before_the_engines_bookkeeping(
    prompts, plain_outputs, algorithm, monkeypatch
):
    """Once a greedy round under grammars is committed, the next round's draft step 2 is launched
    (after the round's last read, before the engine's bookkeeping: `Engine._end_step`), and the
    next round of the same requests with k >= 2 starts by reading its first draft, launching no
    draft step of its own first. A round of k < 2, a plain step or a prefill between them drops
    it, its slots given back. A request joining mid-way: greedy output equals plain decoding's."""
    params, want = plain_outputs
    eng = _engine(algorithm)
    eng.spec.drafter.masked_drafts = True
    eng.spec.controller = Schedule([3, 3, 2, 0, 3, 1])
    events, rounds, steps = [], [], [0]  # rounds: (k, engine step, rids, served, rids still running after it)

    def round_of(reqs, k):
        events.append(("round", k))
        served = eng.spec.masked_rounds_ahead
        out = decode_round(reqs, k)
        served = eng.spec.masked_rounds_ahead > served
        rounds.append((k, steps[0], [r.rid for r in reqs], served, [r.rid for r in reqs if not r.finished]))
        return out

    def logged(kind, forward):
        def run(batch, pool=None):
            events.append((kind, batch.forward_mode.name))
            return forward(batch, pool)

        return run

    def counted(flight):
        events.append(("read", None))
        return read(flight)

    def end_step(*args, **kwargs):
        events.append(("end", None))
        steps[0] += 1
        return end(*args, **kwargs)

    read, decode_round, end = spec_worker.InFlight.read, eng.spec.decode_round, eng._end_step
    monkeypatch.setattr(spec_worker.InFlight, "read", counted)
    monkeypatch.setattr(eng.spec, "decode_round", round_of)
    monkeypatch.setattr(eng, "_end_step", end_step)
    for kind, runner in (("draft", eng.spec.drafter.runner), ("target", eng.spec.target)):
        monkeypatch.setattr(runner, "forward", logged(kind, runner.forward))

    first = eng.add_request(prompts[0], params[0])
    while len(rounds) < 8 or eng.spec._ahead is None:  # a draft step launched ahead when the next request comes
        assert eng.has_unfinished(), rounds
        eng.step()
    drops = eng.spec.drops
    second = eng.add_request(prompts[1], params[0])
    eng.step()  # its first prefill chunk drops the step launched ahead
    assert eng.spec._ahead is None and eng.spec.drops == drops + 1
    while eng.has_unfinished():
        eng.step()
    assert [(o.token_ids, o.finish_reason) for o in map(eng.output, (first, second))] == [
        (o.token_ids, o.finish_reason) for o in want[:2]
    ]

    starts = [i for i, e in enumerate(events) if e[0] == "round"]
    for i, (k, step, rids, served, _) in enumerate(rounds):
        before = rounds[i - 1] if i else None
        follows = before is not None and before[1] == step - 1 and before[0] >= 2 and before[4] == rids
        assert served == (follows and k >= 2), (i, rounds)
        if served:
            own = events[starts[i] + 1 :]
            assert own[0] == ("read", None), own  # its first draft: no draft step of its own before it
            last = events[starts[i - 1] : starts[i]]
            tail = last[len(last) - 1 - [e[0] for e in last][::-1].index("read") + 1 :]
            assert tail[-2:] == [("draft", "DECODE"), ("end", None)], tail  # step 2 before the bookkeeping
    assert sum(r[3] for r in rounds) > len(rounds) // 4
    assert all(n <= k + 1 for k, n in _reads_per_round(events))
    eng.check_no_leak()


def _reads_per_round(events: list[tuple[str, object]]) -> list[tuple[int, int]]:
    """(k, reads from the round's start to the next round's) of each round."""
    out = []
    for kind, what in events:
        if kind == "round":
            out.append([what, 0])
        elif kind == "read" and out:
            out[-1][1] += 1
    return [tuple(r) for r in out]


def test_the_lowest_allowed_token_of_a_mask_is_its_first_set_bit():
    """A draft row left with no allowed token takes the lowest id its grammar allows: found per
    word, it equals the first set bit of the mask expanded to a bit a token."""
    gen = torch.Generator().manual_seed(0)
    masks = torch.randint(-(2**31), 2**31, (64, 9), generator=gen, dtype=torch.int64).to(torch.int32)
    masks &= torch.randint(0, 2, (64, 9), generator=gen, dtype=torch.int32) * -1  # whole words zero
    masks[:, :4] = 0
    masks[0] = 0  # nothing allowed
    masks[1, 4] = -(2**31)  # only bit 31 of a word
    masks[2, 8] = 1 << 30  # past the vocabulary only (8 x 32 + 30 >= 280)
    masks[2, 4:8] = 0
    drafter = drafter_module.Drafter.__new__(drafter_module.Drafter)
    drafter.vocab_size = 280
    bits = (masks[:, :, None] >> torch.arange(32, dtype=torch.int32)) & 1
    want = bits.flatten(1)[:, : drafter.vocab_size].argmax(dim=-1)
    assert torch.equal(drafter._lowest_allowed(masks), want)


def test_sampled_json_always_parses_and_validates_under_speculation(prompts):
    eng = _engine("eagle", max_running_requests=64)
    n = 64
    sp = [
        SamplingParams(max_new_tokens=64, temperature=1.0, seed=s, structured_outputs=StructuredOutputs(json=SCHEMA))
        for s in range(n)
    ]
    outs = eng.generate(prompt_token_ids=[prompts[s % 2] for s in range(n)], sampling=sp)
    for out in outs:
        assert out.finish_reason == "stop", out.text
        _check_schema(json.loads(out.text))
    assert len({o.text for o in outs}) > n // 4, "sampling drew too few distinct outputs to test anything"
    assert any(n > 1 for o in outs for n in o.spec.accept_lengths)
    eng.check_no_leak()


def _digitless_draft_engine(plain: Engine, tmp_path) -> Engine:
    """An EAGLE draft whose hot-token map holds no digit (nor a stop token)."""
    tokenizer, vocab, eos = plain.tokenizer, plain.cfg.vocab_size, plain.cfg.eos_token_ids
    hot = [t for t in range(vocab) if t not in eos and not any(c.isdigit() for c in tokenizer.decode([t]))]
    (tmp_path / "hot.json").write_text(json.dumps(hot))
    return Engine(
        model=TARGET,
        page_size=4,
        attention_backend="trtllm_mha",
        max_total_tokens=4096,
        context_length=256,
        speculative={"algorithm": "eagle", "draft_model": DRAFTS["eagle"], "token_map": str(tmp_path / "hot.json")},
    )


def test_free_drafts_the_grammar_refuses_are_never_accepted(prompts, plain, tmp_path):
    """Free drafts (the default) from a draft that can propose no digit, under a digits-only
    grammar: every draft is refused at the verify's masked position, so every round commits only
    the target's token, and greedy output is plain decoding's."""
    eng = _digitless_draft_engine(plain, tmp_path)
    spec = StructuredOutputs(regex="[0-9]{6}")
    want = plain.generate(prompt_token_ids=prompts, sampling=_greedy(spec))
    got = eng.generate(prompt_token_ids=prompts, sampling=_greedy(spec))
    assert [o.token_ids for o in got] == [o.token_ids for o in want]
    lengths = [n for o in got for n in o.spec.accept_lengths]
    assert lengths and set(lengths) == {1}, lengths
    assert eng.spec.masked_rounds == 0
    eng.check_no_leak()


def test_a_draft_vocabulary_without_an_allowed_token_proposes_from_the_grammar(prompts, plain, tmp_path, monkeypatch):
    """A hot-token map holding no digit under a digits-only grammar, drafts masked: every draft
    row has nothing left after the mask, so the draft proposes uniformly among the tokens the
    grammar allows.
    Greedy output is plain decoding's, and every greedy draft (on the device) is one the grammar
    allows after the drafts before it; sampled requests finish matching the grammar (without the
    fallback their draft distributions would be empty and the requests would fail)."""
    eng = _digitless_draft_engine(plain, tmp_path)
    eng.spec.drafter.masked_drafts = True
    tokenizer, vocab, eos = plain.tokenizer, plain.cfg.vocab_size, plain.cfg.eos_token_ids
    hot = eng.spec.drafter.token_map.tolist()
    spec = StructuredOutputs(regex="[0-9]{6}")
    want = plain.generate(prompt_token_ids=prompts, sampling=_greedy(spec))
    proposed = []  # (committed tokens, drafts) of each request in each greedy round

    def recorded(reqs, k, ahead=None):
        round_ = masked_round(reqs, k, ahead)
        proposed.extend((list(r.output_ids), d) for r, d in zip(reqs, round_[1]))
        return round_

    masked_round = eng.spec._masked_round
    monkeypatch.setattr(eng.spec, "_masked_round", recorded)
    got = eng.generate(prompt_token_ids=prompts, sampling=_greedy(spec))
    assert [o.token_ids for o in got] == [o.token_ids for o in want]
    compiled = GrammarCompiler.of_tokenizer(tokenizer, vocab, eos).compile(spec)
    for committed, drafts in proposed:  # each draft the grammar allows after those before it, up to its end
        matcher = xgrammar().GrammarMatcher(compiled)
        assert all(matcher.accept_token(t) for t in committed)
        for t in drafts:
            if matcher.is_terminated():
                break
            assert matcher.accept_token(t), (committed, drafts)
    # with fewer than 2 of the 6 digits committed, no draft passes the grammar's end: all digits
    assert proposed and all(not set(drafts) & set(hot) for committed, drafts in proposed if len(committed) < 2)
    sampled = [SamplingParams(max_new_tokens=N, seed=s, structured_outputs=spec) for s in range(8)]
    outs = eng.generate(prompt_token_ids=[prompts[s % 2] for s in range(8)], sampling=sampled)
    assert all(o.finish_reason == "stop" and re.fullmatch("[0-9]{6}", o.text) for o in outs), outs
    eng.check_no_leak()


def test_a_draft_past_the_grammars_vocabulary_is_refused_quietly(plain, capfd):
    """A draft id past the tokenizer's ids (an LM head's padding, as a draft with random or
    mismatched weights proposes) is refused without reaching xgrammar, which logs a warning for
    each: a batch-64 round of them flooded the log. The matcher stays where it was."""
    tokenizer, eos = plain.tokenizer, plain.cfg.eos_token_ids
    compiled = GrammarCompiler.of_tokenizer(tokenizer, plain.cfg.vocab_size, eos).compile(
        StructuredOutputs(choice=CHOICE)
    )
    matcher = Matcher(compiled)
    beta = tokenizer.encode("beta")
    capfd.readouterr()
    assert not matcher.seek([beta[0], matcher.vocab_size])
    assert not matcher.seek([matcher.vocab_size + 5])
    assert "out of range" not in capfd.readouterr().err
    assert matcher.seek(beta[:1]) and all(matcher.accept(t) for t in beta) and matcher.committed == len(beta)


def test_batched_masks_are_each_rows_own_and_matchers_keep_their_committed_tokens(plain):
    """One batch of rows, several per request at their draft depths, against xgrammar's own
    matcher advanced over each row's tokens alone; drafts the grammar refuses, or that pass its
    end, leave the row unmasked (acceptance never reaches it); a mask after drafts leaves the
    matcher where its committed tokens put it; a slot holding a row's mask already is not
    filled again; a draft row left with no allowed token becomes uniform over the allowed ones."""
    tokenizer, vocab, eos = plain.tokenizer, plain.cfg.vocab_size, plain.cfg.eos_token_ids
    compiled = GrammarCompiler.of_tokenizer(tokenizer, vocab, eos).compile(StructuredOutputs(choice=CHOICE))
    gamma, beta = tokenizer.encode("gamma delta"), tokenizer.encode("beta")
    refused = tokenizer.encode("zzz")[:1]

    def allowed(committed: list[int], drafts: list[int]) -> torch.Tensor:
        """The reference: a fresh matcher over the row's tokens; every token where it refuses one."""
        matcher = xgrammar().GrammarMatcher(compiled)
        if not all(matcher.accept_token(t) for t in committed + drafts) or matcher.is_terminated():
            return torch.ones(vocab, dtype=torch.bool)
        bits = xgrammar().allocate_token_bitmask(1, vocab)
        matcher.fill_next_token_bitmask(bits, 0)
        return ((bits[0, :, None] >> torch.arange(32)) & 1).bool().flatten()[:vocab]

    masks = GrammarMasks(vocab, requests=3, depths=len(gamma) + 2, device=torch.device("cpu"))
    first, second = Matcher(compiled), Matcher(compiled)
    rows = [MaskRow(first, tuple(gamma[:j]), 2) for j in range(len(gamma) + 1)]
    rows += [MaskRow(first, (*gamma, eos[0]), 2), None, MaskRow(second, (), 0), MaskRow(second, tuple(refused), 0)]
    want = [allowed([], list(r.drafts)) if r is not None else torch.ones(vocab, dtype=torch.bool) for r in rows]
    assert not want[0].all() and not torch.equal(want[0], want[1]) and want[-1].all() and want[-4].all()
    seeks = []
    for matcher in (first, second):
        matcher.seek = lambda drafts, seek=matcher.seek: seeks.append(drafts) or seek(drafts)
    for _ in range(2):  # the second time every slot holds its row's mask already
        logits = torch.zeros(len(rows), vocab)
        masks.apply(logits, rows)
        assert [torch.equal(torch.isfinite(row), w) for row, w in zip(logits, want)] == [True] * len(rows)
    assert len(seeks) == len(rows) - 1
    assert second.accept(beta[0]) and first.accept(gamma[0])  # committed: each matcher moves on from there
    after = [MaskRow(first, (), 2), MaskRow(second, (), 0)]
    logits = torch.zeros(2, vocab)
    masks.apply(logits, after)
    assert torch.equal(torch.isfinite(logits[0]), allowed(gamma[:1], []))
    assert torch.equal(torch.isfinite(logits[1]), allowed(beta[:1], []))
    assert all(first.accept(t) for t in gamma[1:]) and not first.finished and first.accept(eos[0]) and first.finished
    proposals, reference = torch.zeros(1, vocab), allowed(beta[:1], [])
    proposals[0, reference] = float("-inf")  # a draft row scoring nothing the grammar allows
    masks.apply(proposals, [MaskRow(second, (), 0)], partial=True)
    assert torch.equal(proposals[0] == 0, reference) and torch.equal(proposals[0].isfinite(), reference)


@pytest.mark.parametrize("head", [2048 + 100, 2040])
def test_masks_of_a_head_wider_or_narrower_than_the_tokenizer(head):
    """The matchers cover the tokenizer's ids (2,048), at most the LM head's: no padding id is
    among xgrammar's special tokens, which a matcher searches one by one for every token it
    accepts. Along a JSON output each row's allowed tokens are those of xgrammar's matcher over
    a vocabulary as wide as the head (padding ids special, never allowed); a grammar compiled for
    another width is refused."""
    tokenizer = load_tokenizer(TARGET)
    eos = [1]
    compiled = GrammarCompiler.of_tokenizer(tokenizer, head, eos).compile(StructuredOutputs(json=SCHEMA))
    wide = xgrammar().TokenizerInfo.from_huggingface(tokenizer, vocab_size=head, stop_token_ids=eos)
    reference = xgrammar().GrammarMatcher(GrammarCompiler(wide).compile(StructuredOutputs(json=SCHEMA)))
    matcher = Matcher(compiled)
    assert matcher.vocab_size == min(head, 2048)
    masks = GrammarMasks(head, requests=2, depths=1, device=torch.device("cpu"))
    text = json.dumps({"name": "ab", "count": 12, "ok": True, "kind": "dir"})
    bits = xgrammar().allocate_token_bitmask(1, head)
    for token in tokenizer.encode(text, add_special_tokens=False) + eos:
        logits = torch.zeros(2, head)
        masks.apply(logits, [None, MaskRow(matcher, (), 1)])
        reference.fill_next_token_bitmask(bits, 0)
        want = ((bits[0, :, None] >> torch.arange(32)) & 1).bool().flatten()[:head]
        assert torch.equal(torch.isfinite(logits[1]), want) and not want[2048:].any() and logits[0].isfinite().all()
        assert matcher.accept(token) and reference.accept_token(token)
    assert matcher.finished
    other = GrammarCompiler.of_tokenizer(tokenizer, 2016, eos).compile(StructuredOutputs(json=SCHEMA))
    with pytest.raises(RuntimeError, match="compiled for 2016 tokens"):
        masks.apply(torch.zeros(1, head), [MaskRow(Matcher(other), (), 0)])


def test_overlapped_greedy_decoding_under_grammars_equals_step_by_step(prompts, plain_outputs):
    """With the overlap schedule a step's masks are filled after the step before is committed,
    while its forward runs, and applied before the argmax on the device (the greedy decode
    graph's logits): the tokens are step-by-step decoding's."""
    params, want = plain_outputs
    eng = _engine(graphs="emulate", overlap_schedule=True)
    rids = [eng.add_request(p, sp) for sp in params for p in prompts]
    overlapped = 0
    while eng.has_unfinished():
        eng.step()
        overlapped += eng.step_in_flight
    got = [eng.output(rid) for rid in rids]
    assert [(o.token_ids, o.finish_reason) for o in got] == [(o.token_ids, o.finish_reason) for o in want]
    assert overlapped > N // 2
    eng.check_no_leak()


@pytest.mark.parametrize(
    "spec, field, words",
    [
        (StructuredOutputs(regex="[a-"), "structured_outputs.regex", "cannot be compiled"),
        (StructuredOutputs(json='{"type": "nonsense"}'), "structured_outputs.json", "cannot be compiled"),
        (StructuredOutputs(json="{not json"), "structured_outputs.json", "not a JSON schema"),
        (StructuredOutputs(grammar="root ::= undefined_rule"), "structured_outputs.grammar", "cannot be compiled"),
        (StructuredOutputs(regex="a" * 70000), "structured_outputs.regex", "over the limit"),
        (StructuredOutputs(choice=[]), "structured_outputs.choice", "non-empty strings"),
        (StructuredOutputs(regex="a", choice=["a"]), "structured_outputs", "exactly one"),
    ],
)
def test_bad_structured_outputs_are_refused_naming_the_field(plain, prompts, spec, field, words):
    with pytest.raises(ValueError) as err:
        plain.generate(prompt_token_ids=prompts[:1], sampling=_greedy(spec))
    assert str(err.value).startswith(field + ":") and words in str(err.value), str(err.value)
    plain.check_no_leak()
    plain.flush_cache()
    stats = plain.kv_stats()
    assert (stats["full_free"], stats["swa_free"]) == (stats["full_total"], stats["swa_total"])


def test_a_model_without_a_stop_token_refuses_grammars_naming_the_field(prompts):
    eng = _engine()
    eng.cfg = dataclasses.replace(eng.cfg, eos_token_ids=())  # a config naming no eos_token_id
    with pytest.raises(ValueError, match=r"^structured_outputs: this model has no stop token"):
        eng.generate(prompt_token_ids=prompts[:1], sampling=_greedy(StructuredOutputs(choice=CHOICE)))
    eng.check_no_leak()


def test_a_grammar_past_its_size_bound_is_refused(prompts):
    eng = _engine()
    eng.check_request(prompts[0], _greedy(StructuredOutputs(json=SCHEMA)))  # builds the compiler
    eng._grammar_compiler().max_bytes = 1024
    with pytest.raises(ValueError, match=r"^structured_outputs.json: compiles to .* over the limit"):
        eng.generate(prompt_token_ids=prompts[:1], sampling=_greedy(StructuredOutputs(json=SCHEMA)))
    eng.check_no_leak()


def test_a_slow_grammar_is_refused_off_the_loop_while_others_decode(prompts):
    """Through the rank loop: the hostile request ends INVALID_ARGUMENT naming its field at its
    time bound, a plain request and a cheap grammar submitted after it finish meanwhile, the
    loop never waits for the compile, and the pools are whole again."""
    eng = _engine()
    compiler = eng._grammar_compiler()
    compiler.timeout_s = 0.3
    updates: dict[str, list] = collections.defaultdict(list)
    done = {}
    loop = RankLoop(eng, rank=0, on_updates=lambda us: [updates[u.rid].append(u) for u in us], idle_wait_s=0.05)
    thread = threading.Thread(target=loop.run, daemon=True)
    thread.start()
    slow = StructuredOutputs(json=SLOW_SCHEMA)
    try:
        start = time.monotonic()
        loop.submit("hostile", prompts[0], _greedy(slow))
        loop.submit("plain", prompts[1], SamplingParams(max_new_tokens=N, temperature=0.0, ignore_eos=True))
        loop.submit("choice", prompts[1], _greedy(StructuredOutputs(choice=CHOICE)))
        while len(done) < 3 and time.monotonic() - start < 60:
            for rid in ("hostile", "plain", "choice"):
                if rid not in done and updates[rid] and updates[rid][-1].finished:
                    done[rid] = time.monotonic() - start
            time.sleep(0.01)
        hostile = updates["hostile"][-1]
        assert hostile.code is ErrorCode.INVALID_ARGUMENT and hostile.error.startswith("structured_outputs.json:")
        assert "not compiled within 0.3 s" in hostile.error
        assert not compiler.start(slow).future.done(), "the slow schema compiled too fast to test the bound"
        assert sum(len(u.token_ids) for u in updates["plain"]) == N
        assert updates["choice"][-1].output.text in CHOICE
        assert done["hostile"] < 5
    finally:
        loop.stop()
        thread.join(30)
    eng.check_no_leak()


def test_compiled_grammars_are_cached_by_content(plain):
    compiler = GrammarCompiler.of_tokenizer(plain.tokenizer, plain.cfg.vocab_size, plain.cfg.eos_token_ids)
    first = compiler.compile(StructuredOutputs(json=SCHEMA))
    assert compiler.compile(StructuredOutputs(json=json.dumps(SCHEMA))) is first
    assert compiler.compile(StructuredOutputs(json={**SCHEMA, "required": ["name"]})) is not first


def test_tensor_parallel_ranks_mask_alike(tp2):
    """Two ranks (gloo) in lockstep: rank 0 admits each request once its grammar compiled, the
    plan tells the other rank to compile it too, and both mask alike: one rank's tokens, without
    speculation and with an EAGLE draft (masked rounds, each launching the next one's first draft
    step)."""
    from tests.workers.rank_group import FIRST, PROMPTS

    kwargs = dict(
        model=TARGET,
        page_size=4,
        chunked_prefill_size=8,
        max_total_tokens=2048,
        context_length=256,
        attention_backend="trtllm_mha",
    )
    spec = {"algorithm": "eagle", "draft_model": DRAFTS["eagle"], "num_steps": 3, "adaptive": False}
    sp = _greedy(StructuredOutputs(json=SCHEMA))
    single = Engine(**kwargs)
    ref = single.generate(prompt_token_ids=FIRST, sampling=sp)
    ref += single.generate(prompt_token_ids=PROMPTS[len(FIRST) :], sampling=sp)
    plain_tp, drafted = tp2.run_each([kwargs, kwargs | {"speculative": spec}], sp)
    assert all(o.spec.verify_steps for o in drafted)
    for got in (plain_tp, drafted):
        assert [(o.token_ids, o.finish_reason) for o in got] == [(o.token_ids, o.finish_reason) for o in ref]
        for out in got:
            if out.finish_reason == "stop":
                _check_schema(json.loads(out.text))


# -- rejection sampling under a grammar ------------------------------------------------------------
@pytest.fixture(scope="module")
def small_vocab(tmp_path_factory):
    root = tmp_path_factory.mktemp("small_vocab")
    target = str(root / "target")
    hf = make_tiny_model("gemma3", target, vocab_size=8)
    return hf, target, make_perturbed_copy(target, str(root / "draft"), noise=0.6)


def test_rejection_sampling_under_a_grammar_is_exact_in_distribution(small_vocab):
    """Tokens 0..6 spell a..g: the grammar `[a-d][c-g]` allows four first and five second tokens.
    Over many seeds the first two tokens' joint distribution is the target's masked
    p(t1) p(t2 | t1), renormalised over what the grammar allows at each position."""
    hf, target, draft = small_vocab
    vocab = [*"abcdefg", "</s>"]
    info = xgrammar().TokenizerInfo(vocab, vocab_type=xgrammar().VocabType.RAW, stop_token_ids=[7])
    compiled = GrammarCompiler(info).compile(StructuredOutputs(regex="[a-d][c-g]"))
    prompt = [1, 5, 2, 7, 3, 0, 4, 6, 1, 2, 3]
    n = 2000
    eng = Engine(
        model=target,
        page_size=4,
        max_running_requests=64,
        max_total_tokens=8192,
        speculative={"algorithm": "standalone", "draft_model": draft, "num_steps": 3},
    )
    spec = StructuredOutputs(regex="[a-d][c-g]")
    params = [SamplingParams(max_new_tokens=2, seed=s, ignore_eos=True, structured_outputs=spec) for s in range(n)]
    rids = [eng.add_request(prompt, sp, grammar=compiled) for sp in params]
    while eng.has_unfinished():
        eng.step()
    outs = [eng.output(rid) for rid in rids]
    eng.check_no_leak()
    counts = collections.Counter(tuple(o.token_ids) for o in outs)
    assert set(counts) <= {(a, b) for a in range(4) for b in range(2, 7)}, counts
    with torch.no_grad():
        first = torch.full((8,), float("-inf"))
        first[:4] = hf(torch.tensor([prompt])).logits[0, -1, :4]
        second = torch.full((8, 8), float("-inf"))
        second[:, 2:7] = hf(torch.tensor([prompt + [t] for t in range(8)])).logits[:, -1, 2:7]
    joint = (torch.softmax(first, -1)[:, None] * torch.softmax(second, -1)).flatten().double()
    observed = torch.tensor([counts[(a, b)] for a in range(8) for b in range(8)], dtype=torch.float64)
    expected = joint * n
    rare = (expected < 5) & (expected > 0)  # pooled; cells the grammar rules out (0) were never drawn
    common = expected >= 5
    obs = torch.cat([observed[common], observed[rare].sum().view(1)[: int(rare.any())]])
    exp = torch.cat([expected[common], expected[rare].sum().view(1)[: int(rare.any())]])
    stat = chisquare(obs.numpy(), exp.numpy() * obs.sum().item() / exp.sum().item())
    accepted = sum(o.spec.accept_lengths[0] > 1 for o in outs)
    assert 0.05 * n < accepted < 0.95 * n, "the test needs both accepted and rejected drafts"
    assert stat.pvalue > 0.01, stat
