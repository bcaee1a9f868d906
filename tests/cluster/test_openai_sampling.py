"""The OpenAI routes and the gRPC API as sampling setups and evaluation harnesses drive them,
against a running application on loopback and, as the reference, an in-process engine of the
same model: logprobs (completions' `logprobs: k`, chat's `logprobs` and `top_logprobs`),
`echo` (with `max_tokens: 0` too), vLLM's `prompt_logprobs`, penalties, `min_tokens`, `min_p`,
`logit_bias`, `ignore_eos`, stop strings across streamed chunks and `n` choices (each equal to a
request of its own seed; usage counting the prompt once), streamed and whole; bad values are
400 (INVALID_ARGUMENT) naming the parameter, and every KV page is free afterwards.
lm-evaluation-harness's `local-completions` model runs a loglikelihood task and a greedy
generate_until task (JSON lines written here) through the completions route, batched: its
loglikelihoods equal the sums of transformers' log_softmax over the same continuation tokens,
its generations transformers' greedy `generate` cut at the task's stop strings."""

import json
import time

import grpc
import lm_eval
import pytest
import requests
import torch
from lm_eval.api.registry import get_model
from lm_eval.tasks import TaskManager
from transformers import AutoModelForCausalLM

from ops import DEFAULT_MODEL
from tests.cluster.openai_app import deploy
from workers.engine import Engine, SamplingParams
from workers.tokenizer import load_tokenizer

TOKEN = "sampling-test-token"
MODEL = "tiny-gemma3"
PROMPT = "def read_config(path):\n    with open(path) as f:\n        return json.load(f)\n\n\ndef "
ATOL = 1e-4  # the replica's float32 logits against the in-process engine's
GREEDY = {"temperature": 0.0, "extra_body": {"ignore_eos": True}}


@pytest.fixture(scope="module")
def app(ray_serve, tmp_path_factory):
    yield from deploy(ray_serve, tmp_path_factory.mktemp("sampling") / "token", TOKEN, "sampling")


@pytest.fixture(scope="module")
def engine():
    return Engine(model=DEFAULT_MODEL, page_size=4, max_total_tokens=4096, context_length=512)


@pytest.fixture(scope="module")
def tokenizer():
    return load_tokenizer(DEFAULT_MODEL)


def _idle(grpc_client, limit_s: float = 30.0) -> None:
    """Every replica runs nothing and holds no KV page (the prefix cache's own count as free)."""
    deadline = time.monotonic() + limit_s
    while True:
        loads = list(grpc_client.load().replicas)
        if loads and all((x.running, x.waiting, x.kv_full_used, x.kv_swa_used) == (0, 0, 0, 0) for x in loads):
            return
        assert time.monotonic() < deadline, f"KV still held: {loads}"
        time.sleep(0.2)


def _reference(engine: Engine, prompt: list[int], **sampling):
    (out,) = engine.generate(prompt_token_ids=[prompt], sampling=SamplingParams(**sampling))
    return out


def _close(got: list[float | None], want: list[float]) -> None:
    torch.testing.assert_close(
        torch.tensor(got, dtype=torch.float64), torch.tensor(want, dtype=torch.float64), atol=ATOL, rtol=0
    )


def test_completion_logprobs_are_the_engines_streamed_or_not(app, engine, tokenizer):
    client, _, _ = app
    ids = tokenizer.encode(PROMPT)
    ref = _reference(engine, ids, max_new_tokens=8, temperature=0.0, ignore_eos=True, logprobs=3)
    whole = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=8, logprobs=3, **GREEDY)
    lp = whole.choices[0].logprobs
    assert lp.tokens == [tokenizer.decode([t]) for t in ref.token_ids]
    _close(lp.token_logprobs, ref.logprobs.token)
    for top, ref_ids, ref_values in zip(lp.top_logprobs, ref.logprobs.top_ids, ref.logprobs.top):
        assert list(top) == [tokenizer.decode([t]) for t in ref_ids]
        _close(list(top.values()), ref_values)
    assert lp.text_offset == [sum(len(t) for t in lp.tokens[:i]) for i in range(8)]
    chunks = list(
        client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=8, logprobs=3, stream=True, **GREEDY)
    )
    streamed = [c.choices[0].logprobs for c in chunks if c.choices and c.choices[0].logprobs]
    assert [t for c in streamed for t in c.tokens] == lp.tokens and len(streamed) > 1  # per chunk
    _close([v for c in streamed for v in c.token_logprobs], lp.token_logprobs)  # a prefix-cache hit now
    assert [o for c in streamed for o in c.text_offset] == lp.text_offset


@pytest.mark.parametrize("max_tokens", [0, 1])
def test_echo_gives_the_prompts_logprobs_as_lm_eval_reads_them(app, engine, tokenizer, max_tokens):
    """lm-evaluation-harness's loglikelihood request: token ids, echo, logprobs 1, max_tokens 0
    (older versions) or 1 (it drops the last entry)."""
    client, grpc_client, _ = app
    ids = tokenizer.encode(PROMPT)
    ref = _reference(engine, ids, max_new_tokens=1, temperature=0.0, prompt_logprobs=1, logprobs=1)
    out = client.completions.create(model=MODEL, prompt=ids, max_tokens=max_tokens, echo=True, logprobs=1, **GREEDY)
    choice = out.choices[0]
    lp = choice.logprobs
    shown = ids + ref.token_ids[:max_tokens]
    assert lp.tokens == [tokenizer.decode([t]) for t in shown]
    assert lp.token_logprobs[0] is None and lp.top_logprobs[0] is None
    _close(lp.token_logprobs[1:], ref.prompt_logprobs.token + ref.logprobs.token[:max_tokens])
    assert [list(top) for top in lp.top_logprobs[1 : len(ids)]] == [
        [tokenizer.decode(t)] for t in ref.prompt_logprobs.top_ids
    ]
    assert choice.text == tokenizer.decode(shown) and choice.finish_reason == "length"
    assert out.usage.prompt_tokens == len(ids) and out.usage.completion_tokens == max_tokens
    chunks = list(
        client.completions.create(
            model=MODEL, prompt=ids, max_tokens=max_tokens, echo=True, logprobs=1, stream=True, **GREEDY
        )
    )
    assert "".join(c.choices[0].text for c in chunks if c.choices) == choice.text
    assert [v for c in chunks if c.choices and c.choices[0].logprobs for v in c.choices[0].logprobs.token_logprobs] == (
        lp.token_logprobs
    )
    _idle(grpc_client)


def test_vllm_prompt_logprobs_on_every_choice(app, engine, tokenizer):
    _, _, base = app
    ids = tokenizer.encode(PROMPT)
    ref = _reference(engine, ids, max_new_tokens=1, temperature=0.0, prompt_logprobs=2)
    body = {"model": MODEL, "prompt": PROMPT, "max_tokens": 3, "n": 2, "seed": 1, "prompt_logprobs": 2}
    r = requests.post(f"{base}/completions", json=body, headers={"Authorization": f"Bearer {TOKEN}"}, timeout=60)
    assert r.status_code == 200, r.text
    for choice in r.json()["choices"]:
        shown = choice["prompt_logprobs"]
        assert shown[0] is None and len(shown) == len(ids)
        for entries, token, value, top_ids in zip(
            shown[1:], ids[1:], ref.prompt_logprobs.token, ref.prompt_logprobs.top_ids
        ):
            assert entries[str(token)]["logprob"] == pytest.approx(value, abs=ATOL)
            assert [entries[str(t)]["rank"] for t in top_ids] == [1, 2]


def test_chat_logprobs_and_top_logprobs(app, engine, tokenizer):
    client, _, _ = app
    messages = [{"role": "user", "content": "def add(a, b):"}]
    text = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    ref = _reference(
        engine, tokenizer.encode(text, add_special_tokens=False), max_new_tokens=6, temperature=0.0, logprobs=2
    )
    out = client.chat.completions.create(
        model=MODEL, messages=messages, max_tokens=6, logprobs=True, top_logprobs=2, **GREEDY
    )
    content = out.choices[0].logprobs.content
    assert [c.token for c in content] == [tokenizer.decode([t]) for t in ref.token_ids]
    _close([c.logprob for c in content], ref.logprobs.token)
    assert [[t.token for t in c.top_logprobs] for c in content] == [
        [tokenizer.decode([t]) for t in top] for top in ref.logprobs.top_ids
    ]
    assert content[0].bytes == list(content[0].token.encode())
    stream = client.chat.completions.create(
        model=MODEL, messages=messages, max_tokens=6, logprobs=True, stream=True, **GREEDY
    )
    entries = [e for c in stream if c.choices and c.choices[0].logprobs for e in c.choices[0].logprobs.content]
    assert [e.token for e in entries] == [c.token for c in content] and all(e.top_logprobs == [] for e in entries)


@pytest.mark.parametrize(
    "extra",
    [
        {"frequency_penalty": 1.5, "presence_penalty": 0.5},
        {"repetition_penalty": 1.6},
        {"min_tokens": 6, "stop_token_ids": "the third token plain decoding gives"},
        {"logit_bias": {"280": -100, "15": 5.0}},
        {"min_p": 0.3, "temperature": 1.0, "seed": 4},
    ],
    ids=["frequency_presence", "repetition", "min_tokens", "logit_bias", "min_p"],
)
def test_sampling_parameters_are_the_engines(app, engine, tokenizer, extra):
    client, _, _ = app
    ids = tokenizer.encode("class Queue:\n    def __init__(self, maxsize=0):\n        self.")
    plain = _reference(
        engine, ids, max_new_tokens=12, temperature=extra.get("temperature", 0.0), ignore_eos=True, seed=4
    )
    if "stop_token_ids" in extra:
        extra = {**extra, "stop_token_ids": [plain.token_ids[2]]}
    sampling = {"temperature": 0.0, "ignore_eos": True, **extra}
    if "logit_bias" in sampling:
        sampling["logit_bias"] = {int(k): v for k, v in sampling["logit_bias"].items()}
    ref = _reference(engine, ids, max_new_tokens=12, **sampling)
    assert ref.token_ids != plain.token_ids, "the parameter changed nothing here"
    temperature = extra.get("temperature", 0.0)
    body = {k: v for k, v in extra.items() if k not in ("temperature", "seed", "frequency_penalty", "presence_penalty")}
    for stream in (False, True):
        out = client.completions.create(
            model=MODEL,
            prompt=ids,
            max_tokens=12,
            temperature=temperature,
            seed=extra.get("seed"),
            frequency_penalty=extra.get("frequency_penalty"),
            presence_penalty=extra.get("presence_penalty"),
            stream=stream,
            extra_body={"ignore_eos": True, "return_token_ids": True, **body},
        )
        chunks = list(out) if stream else [out]
        assert [t for c in chunks if c.choices for t in c.choices[0].token_ids] == ref.token_ids


def test_a_stop_string_across_streamed_chunks(app, tokenizer):
    """A stop string made of the end of one token and the start of the next, each its own chunk."""
    client, grpc_client, _ = app
    whole = client.completions.create(
        model=MODEL,
        prompt=PROMPT,
        max_tokens=16,
        extra_body={"ignore_eos": True, "return_token_ids": True},
        **{"temperature": 0.0},
    )
    pieces = [tokenizer.decode([t]) for t in whole.choices[0].token_ids]
    k = next(i for i in range(3, 15) if len(pieces[i]) >= 2 and len(pieces[i + 1]) >= 2)
    stop = pieces[k][-2:] + pieces[k + 1][:2]
    text = whole.choices[0].text
    chunks = list(
        client.completions.create(
            model=MODEL,
            prompt=PROMPT,
            max_tokens=16,
            stop=[stop],
            stream=True,
            temperature=0.0,
            extra_body={"ignore_eos": True},
        )
    )
    texts = [c.choices[0].text for c in chunks if c.choices]
    assert "".join(texts) == text[: text.index(stop)] and len([t for t in texts if t]) > 2
    assert chunks[-1].choices[0].finish_reason == "stop"
    _idle(grpc_client)


def test_n_choices_equal_requests_of_their_own_seeds(app, tokenizer):
    """Choice i of n is the request with seed + i (as vLLM); usage counts the prompt once."""
    client, grpc_client, _ = app
    kw = dict(model=MODEL, prompt=PROMPT, max_tokens=10, temperature=1.0, extra_body={"ignore_eos": True})
    out = client.completions.create(n=3, seed=11, **kw)
    single = [client.completions.create(seed=11 + i, **kw) for i in range(3)]
    assert [c.index for c in out.choices] == [0, 1, 2]
    assert [c.text for c in out.choices] == [s.choices[0].text for s in single]
    assert len({c.text for c in out.choices}) > 1
    assert out.usage.prompt_tokens == single[0].usage.prompt_tokens == len(tokenizer.encode(PROMPT))
    assert out.usage.completion_tokens == 30
    assert client.completions.create(n=2, best_of=2, seed=11, **kw).choices[1].text == out.choices[1].text
    chunks = list(client.completions.create(n=3, seed=11, stream=True, stream_options={"include_usage": True}, **kw))
    for i in range(3):
        assert "".join(c.choices[0].text for c in chunks if c.choices and c.choices[0].index == i) == (
            out.choices[i].text
        )
    assert chunks[-1].usage.prompt_tokens == out.usage.prompt_tokens
    echoed = list(client.completions.create(n=2, seed=11, echo=True, logprobs=1, stream=True, **kw))
    prompt_tokens = [tokenizer.decode([t]) for t in tokenizer.encode(PROMPT)]
    for i in range(2):  # choice 1's chunks wait for the prompt's logprobs, which choice 0 brings
        mine = [c.choices[0] for c in echoed if c.choices and c.choices[0].index == i]
        assert "".join(c.text for c in mine) == PROMPT + out.choices[i].text
        tokens = [t for c in mine if c.logprobs for t in c.logprobs.tokens]
        values = [v for c in mine if c.logprobs for v in c.logprobs.token_logprobs]
        assert tokens[: len(prompt_tokens)] == prompt_tokens and len(tokens) == len(prompt_tokens) + 10
        assert values[0] is None and all(v is not None for v in values[1:])
    many = client.completions.create(n=2, seed=11, **{**kw, "prompt": [PROMPT, "import os\n"]})
    assert [c.text for c in many.choices[:2]] == [c.text for c in out.choices[:2]] and len(many.choices) == 4
    chat = client.chat.completions.create(
        model=MODEL,
        messages=[{"role": "user", "content": "x"}],
        max_tokens=5,
        n=2,
        seed=3,
        extra_body={"ignore_eos": True},
    )
    assert [c.index for c in chat.choices] == [0, 1] and chat.usage.completion_tokens == 10
    _idle(grpc_client)


@pytest.mark.parametrize(
    "route, extra, param",
    [
        ("completions", {"logprobs": 21}, "logprobs"),
        ("completions", {"echo": True, "logprobs": -1}, "logprobs"),
        ("completions", {"max_tokens": 0}, "max_tokens"),
        ("chat/completions", {"logprobs": True, "top_logprobs": 30}, "top_logprobs"),
        ("chat/completions", {"top_logprobs": 2}, "top_logprobs"),
        ("completions", {"frequency_penalty": 2.5}, "frequency_penalty"),
        ("completions", {"presence_penalty": "much"}, "presence_penalty"),
        ("completions", {"repetition_penalty": 0}, "repetition_penalty"),
        ("completions", {"min_tokens": 50, "max_tokens": 5}, "min_tokens"),
        ("completions", {"min_p": 1.5}, "min_p"),
        ("completions", {"logit_bias": {"x": 1}}, "logit_bias"),
        ("completions", {"logit_bias": {"5": 101}}, "logit_bias"),
        ("completions", {"logit_bias": {"99999": 1}, "n": 2}, "logit_bias"),  # refused by the replica
        ("completions", {"n": 0}, "n"),
        ("completions", {"n": 129}, "n"),
        ("completions", {"n": 2, "best_of": 3}, "best_of"),
        ("completions", {"prompt_logprobs": 50}, "prompt_logprobs"),
    ],
)
def test_bad_values_are_400_naming_the_parameter_and_free_every_page(app, route, extra, param):
    _, grpc_client, base = app
    body = {"model": MODEL, "max_tokens": 4, **extra}
    body.update({"messages": [{"role": "user", "content": "x"}]} if route.startswith("chat") else {"prompt": "x"})
    r = requests.post(f"{base}/{route}", json=body, headers={"Authorization": f"Bearer {TOKEN}"}, timeout=60)
    assert r.status_code == 400, r.text
    error = r.json()["error"]
    assert error["param"] == param and error["message"].startswith(param), error
    _idle(grpc_client)


def test_grpc_takes_the_same_fields(app, engine, tokenizer):
    _, grpc_client, _ = app
    ids = tokenizer.encode(PROMPT)
    ref = _reference(
        engine,
        ids,
        max_new_tokens=6,
        temperature=0.0,
        ignore_eos=True,
        repetition_penalty=1.6,
        logit_bias={280: -100},
        logprobs=2,
        prompt_logprobs=1,
    )
    kw = dict(max_new_tokens=6, temperature=0.0, ignore_eos=True, repetition_penalty=1.6, logit_bias={280: -100.0})
    responses = list(grpc_client.generate(ids, logprobs=2, prompt_logprobs=1, **kw))
    assert [t for r in responses for t in r.token_ids] == ref.token_ids
    _close([v for r in responses for v in r.logprobs.token_logprobs], ref.logprobs.token)
    assert [list(t.token_ids) for r in responses for t in r.logprobs.top] == ref.logprobs.top_ids
    _close(list(responses[0].prompt_logprobs.token_logprobs), ref.prompt_logprobs.token)
    assert list(responses[0].prompt_logprobs.ranks) == ref.prompt_logprobs.rank
    fresh = tokenizer.encode("while True:\n    line = input()\n    if not line:\n        break\n")
    whole = list(grpc_client.generate(fresh, stream=False, n=2, seed=5, **{**kw, "temperature": 1.0}))
    assert [r.index for r in whole] == [0, 1] and all(len(r.token_ids) == 6 and r.finished for r in whole)
    shared = (len(fresh) - 1) // 4 * 4  # choice 1 forked from choice 0's prefill, on its cached pages
    assert [r.usage.cached_tokens for r in whole] == [0, shared]
    alone = grpc_client.complete(fresh, seed=6, **{**kw, "temperature": 1.0})
    assert list(whole[1].token_ids) == list(alone.token_ids)
    with pytest.raises(grpc.RpcError) as info:
        list(grpc_client.generate(ids, min_p=2.0, **kw))
    assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT and "sampling.min_p" in info.value.details()
    line = requests.post(
        f"{app[2].rsplit('/v1', 1)[0]}/generate",
        json={
            "prompt_token_ids": ids,
            "sampling": {**{k: v for k, v in kw.items() if k != "logit_bias"}, "logprobs": 1},
        },
        headers={"Authorization": f"Bearer {TOKEN}"},
        timeout=60,
    ).text.splitlines()
    assert sum(len(json.loads(x)["logprobs"]["token_logprobs"]) for x in line) == 6
    _idle(grpc_client)


# -- lm-evaluation-harness -------------------------------------------------------------------------
DOCS = [
    {"context": "def read_config(path):\n    with open(path) as f:\n        return", "continuation": " json.load(f)"},
    {"context": "import os\nimport", "continuation": " sys"},
    {"context": "class Queue:\n    def __init__(self, maxsize=0):\n        self.", "continuation": "maxsize = maxsize"},
    {"context": "for i in range(10):\n    ", "continuation": "print(i)"},
    {"context": "if __name__ == ", "continuation": "'__main__':\n    main()"},
    {"context": "x = [1, 2, 3]\ny = ", "continuation": "sum(x) "},
]
# generate_until: hand-written targets (what a reader would complete), scored by exact match
GENERATE = [
    {"context": "import os\nimport", "target": " sys"},
    {"context": "for i in range(", "target": "n"},
    {"context": "def __init__(self", "target": ", *args, **kwargs"},
    {"context": "raise ValueError(", "target": "'bad value'"},
]
UNTIL = ["\n", ")"]
GENERATE_TOKENS = 12


def _task_yaml(root, name: str, docs: list[dict], lines: list[str]) -> None:
    data = root / f"{name}.jsonl"
    data.write_text("".join(json.dumps(d) + "\n" for d in docs))
    head = [f"task: {name}", "dataset_path: json", "dataset_kwargs:", "  data_files:", f"    test: {data}"]
    (root / f"{name}.yaml").write_text("\n".join([*head, "test_split: test", *lines]))


def _tasks(root) -> TaskManager:
    """A loglikelihood task and a greedy generate_until task, as JSON lines and task YAML."""
    _task_yaml(
        root,
        "slidespec_tiny_loglikelihood",
        DOCS,
        [
            "output_type: loglikelihood",
            "doc_to_text: '{{context}}'",
            "doc_to_target: '{{continuation}}'",
            "metric_list:",
            "  - metric: perplexity",
            "  - metric: acc",
        ],
    )
    _task_yaml(
        root,
        "slidespec_tiny_generate",
        GENERATE,
        [
            "output_type: generate_until",
            "doc_to_text: '{{context}}'",
            "doc_to_target: '{{target}}'",
            "generation_kwargs:",
            f"  until: {json.dumps(UNTIL)}",
            "  do_sample: false",
            f"  max_gen_toks: {GENERATE_TOKENS}",
            "metric_list:",
            "  - metric: exact_match",
        ],
    )
    return TaskManager(include_path=str(root))


@pytest.fixture(scope="module")
def evaluated(app, tmp_path_factory):
    """lm-eval's local-completions model run once over both tasks: (model, results)."""
    lm = get_model("local-completions")(
        model=MODEL,
        base_url=f"{app[2]}/completions",
        header={"Authorization": f"Bearer {TOKEN}"},
        tokenizer_backend="huggingface",
        tokenizer=DEFAULT_MODEL,
        tokenized_requests=True,
        batch_size=4,
        max_retries=1,
    )
    results = lm_eval.simple_evaluate(
        model=lm,
        tasks=["slidespec_tiny_loglikelihood", "slidespec_tiny_generate"],
        task_manager=_tasks(tmp_path_factory.mktemp("lm_eval")),
        log_samples=True,
    )
    return lm, results


@pytest.fixture(scope="module")
def hf():
    return AutoModelForCausalLM.from_pretrained(DEFAULT_MODEL, dtype=torch.float32).eval()


def _samples(results, task: str) -> list[dict]:
    return sorted(results["samples"][task], key=lambda s: s["doc_id"])


def test_lm_eval_local_completions_loglikelihoods_equal_transformers(evaluated, hf):
    lm, results = evaluated
    samples = _samples(results, "slidespec_tiny_loglikelihood")
    assert len(samples) == len(DOCS)
    for doc, sample in zip(DOCS, samples):
        (loglikelihood, greedy) = sample["filtered_resps"][0]
        context, continuation = lm._encode_pair(doc["context"], doc["continuation"])
        with torch.no_grad():
            logprobs = torch.log_softmax(hf(torch.tensor([context + continuation])).logits[0].float(), dim=-1)
        rows = logprobs[len(context) - 1 : -1]
        want = rows[torch.arange(len(continuation)), torch.tensor(continuation)]
        assert loglikelihood == pytest.approx(want.sum().item(), abs=1e-4), doc
        assert greedy == bool((rows.argmax(dim=-1) == torch.tensor(continuation)).all()), doc
    assert results["results"]["slidespec_tiny_loglikelihood"]["acc,none"] == pytest.approx(
        sum(s["filtered_resps"][0][1] for s in samples) / len(DOCS)
    )


def _cut(text: str, stops: list[str]) -> str:
    """The text before the first of the stop strings."""
    return text[: min((i for i in (text.find(s) for s in stops) if i >= 0), default=len(text))]


def test_lm_eval_local_completions_generations_equal_transformers_greedy(evaluated, hf, tokenizer):
    """generate_until through the completions route: token prompts, `stop` (the task's `until`
    and the tokenizer's EOS text), `max_tokens`, `seed`, temperature 0."""
    lm, results = evaluated
    samples = _samples(results, "slidespec_tiny_generate")
    assert len(samples) == len(GENERATE)
    matches = []
    for doc, sample in zip(GENERATE, samples):
        ids = lm.tok_encode(doc["context"])
        with torch.no_grad():
            out = hf.generate(torch.tensor([ids]), max_new_tokens=GENERATE_TOKENS, do_sample=False)
        want = _cut(tokenizer.decode(out[0, len(ids) :], skip_special_tokens=True), UNTIL)
        assert sample["resps"] == [[want]] and sample["filtered_resps"] == [want], doc
        matches.append(want == doc["target"])
    assert 0 < sum(matches) < len(matches)  # the metric sees both outcomes
    assert results["results"]["slidespec_tiny_generate"]["exact_match,none"] == pytest.approx(
        sum(matches) / len(matches)
    )
