"""The OpenAI-compatible API, driven by the official `openai` client against a running
application on loopback: completions and chat, streaming and not, greedy output equal to the
gRPC API's for the same prompt tokens, usage counts, a cancelled stream frees its KV, bad
parameters get OpenAI-shaped 400s naming the parameter, the bearer token guards the routes."""

import asyncio
import time

import openai
import pytest
import requests

from ops import DEFAULT_MODEL
from ops.bench.serve_bench import OpenAIBackend
from tests.cluster.openai_app import deploy
from workers.tokenizer import load_tokenizer

TOKEN = "openai-test-token"
MODEL = "tiny-gemma3"
GREEDY = {"temperature": 0.0, "extra_body": {"ignore_eos": True}}


@pytest.fixture(scope="module")
def app(ray_serve, tmp_path_factory):
    yield from deploy(ray_serve, tmp_path_factory.mktemp("openai") / "token", TOKEN, "oa")


def _grpc(grpc_client, prompt, max_new_tokens: int) -> tuple[str, list[int], object]:
    responses = list(grpc_client.generate(prompt, max_new_tokens=max_new_tokens, temperature=0.0, ignore_eos=True))
    return "".join(r.text for r in responses), [t for r in responses for t in r.token_ids], responses[-1]


def _chat_ids(messages: list[dict]) -> list[int]:
    """The prompt tokens an independent render of the shipped template gives."""
    tokenizer = load_tokenizer(DEFAULT_MODEL)
    text = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    return tokenizer.encode(text, add_special_tokens=False)


def _idle(grpc_client, limit_s: float = 30.0) -> list:
    deadline = time.monotonic() + limit_s
    while True:
        loads = list(grpc_client.load().replicas)
        if all(x.running == 0 and x.kv_full_used == 0 and x.kv_swa_used == 0 for x in loads) or (
            time.monotonic() > deadline
        ):
            return loads
        time.sleep(0.2)


def test_models_lists_the_served_model(app):
    client, _, _ = app
    (model,) = client.models.list().data
    assert model.id == MODEL and model.owned_by == "slidespec"


def test_completion_equals_the_grpc_api_streamed_or_not(app):
    client, grpc_client, _ = app
    text, ids, last = _grpc(grpc_client, "def f(x):", 12)
    whole = client.completions.create(model=MODEL, prompt="def f(x):", max_tokens=12, **GREEDY)
    assert whole.choices[0].text == text and whole.choices[0].finish_reason == "length"
    assert whole.usage.prompt_tokens == last.usage.prompt_tokens and whole.usage.completion_tokens == 12
    chunks = list(
        client.completions.create(
            model=MODEL,
            prompt="def f(x):",
            max_tokens=12,
            stream=True,
            stream_options={"include_usage": True},
            **GREEDY,
        )
    )
    assert "".join(c.choices[0].text for c in chunks if c.choices) == text
    assert chunks[-1].usage.completion_tokens == 12 and not chunks[-1].choices
    ids_prompt = client.completions.create(model=MODEL, prompt=list(ids[:3]) + [5], max_tokens=4, **GREEDY)
    assert ids_prompt.usage.prompt_tokens == 4
    again = client.completions.create(model=MODEL, prompt="def f(x):", max_tokens=2, **GREEDY)  # prefix cache
    assert again.usage.prompt_tokens_details.cached_tokens == (last.usage.prompt_tokens - 1) // 4 * 4 > 0


def test_a_list_of_prompts_gives_one_choice_each(app):
    client, grpc_client, _ = app
    prompts = ["import os\n", "class A:"]
    out = client.completions.create(model=MODEL, prompt=prompts, max_tokens=6, **GREEDY)
    assert [c.index for c in out.choices] == [0, 1]
    assert [c.text for c in out.choices] == [_grpc(grpc_client, p, 6)[0] for p in prompts]
    assert out.usage.completion_tokens == 12


def test_chat_renders_the_template_and_equals_the_grpc_api(app):
    client, grpc_client, _ = app
    messages = [{"role": "system", "content": "You write Python."}, {"role": "user", "content": "def add(a, b):"}]
    text, _, last = _grpc(grpc_client, _chat_ids(messages), 10)
    whole = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=10, **GREEDY)
    assert whole.choices[0].message.role == "assistant" and whole.choices[0].message.content == text
    assert whole.usage.prompt_tokens == last.usage.prompt_tokens == len(_chat_ids(messages))
    stream = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=10, stream=True, **GREEDY)
    chunks = list(stream)
    assert chunks[0].choices[0].delta.role == "assistant"
    assert "".join(c.choices[0].delta.content or "" for c in chunks) == text
    assert chunks[-1].choices[0].finish_reason == "length"


def test_a_cancelled_stream_frees_its_kv(app):
    client, grpc_client, _ = app
    stream = client.chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": "x"}], max_tokens=400, stream=True, **GREEDY
    )
    next(iter(stream))
    assert any(x.running for x in grpc_client.load().replicas)
    stream.close()
    loads = _idle(grpc_client)
    assert loads and all(x.running == 0 and x.kv_full_used == 0 and x.kv_swa_used == 0 for x in loads), loads


@pytest.mark.parametrize(
    "kwargs, param",
    [
        ({"temperature": -1.0}, "temperature"),
        ({"top_p": 0.0}, "top_p"),
        ({"max_tokens": 0}, "max_tokens"),
        ({"max_tokens": 10_000}, "max_tokens"),
        ({"n": 0}, "n"),
        ({"logprobs": True, "top_logprobs": 21}, "top_logprobs"),
        ({"frequency_penalty": 3.0}, "frequency_penalty"),
        ({"extra_body": {"top_k": "many"}}, "top_k"),
        # tool_choice auto (the default with tools): the shipped chat template shows no tool-call format
        ({"tools": [{"type": "function", "function": {"name": "f", "parameters": {}}}]}, "tool_choice"),
    ],
)
def test_bad_parameters_get_400_naming_them(app, kwargs, param):
    client, _, _ = app
    with pytest.raises(openai.BadRequestError) as info:
        client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "x"}], **kwargs)
    error = info.value.body
    assert error["param"] == param and error["type"] == "invalid_request_error", error
    assert error["message"].startswith(param), error


def test_a_prompt_or_session_refused_is_named_as_the_client_sent_it(app):
    """The generation API's prompt_token_ids and session_id are OpenAI's messages (or prompt)
    and user (or the x-session-id header) in errors."""
    client, _, base = app
    long_chat = [{"role": "user", "content": " ".join(str(i) for i in range(2000))}]
    with pytest.raises(openai.BadRequestError) as info:
        client.chat.completions.create(model=MODEL, messages=long_chat, max_tokens=1)
    assert info.value.body["param"] == "messages" and "context length" in info.value.body["message"], info.value.body
    with pytest.raises(openai.BadRequestError) as info:
        client.completions.create(model=MODEL, prompt=[list(range(1, 600))], max_tokens=1)
    assert info.value.body["param"] == "prompt", info.value.body
    with pytest.raises(openai.BadRequestError) as info:
        client.completions.create(model=MODEL, prompt="x", max_tokens=1, user="u" * 300)
    assert info.value.body["param"] == "user" and info.value.body["message"].startswith("user: "), info.value.body
    r = requests.post(
        f"{base}/completions",
        json={"model": MODEL, "prompt": "x", "max_tokens": 1},
        headers={"Authorization": f"Bearer {TOKEN}", "x-session-id": "s" * 300},
        timeout=30,
    )
    assert r.status_code == 400 and r.json()["error"]["param"] == "x-session-id", r.text


@pytest.mark.parametrize(
    "route, body, param",
    [
        ("completions", '{"model": "%s", "prompt": "a\\ud800"}', "prompt"),
        ("chat/completions", '{"model": "%s", "messages": [{"role": "user", "content": "\\udfff"}]}', "messages"),
    ],
)
def test_a_lone_surrogate_gets_400_naming_its_parameter(app, route, body, param):
    """Escaped JSON can carry a surrogate half no UTF-8 text holds: refused, not a 500."""
    _, grpc_client, base = app
    r = requests.post(f"{base}/{route}", data=body % MODEL, headers={"Authorization": f"Bearer {TOKEN}"}, timeout=30)
    assert r.status_code == 400, r.text
    assert r.json()["error"]["param"] == param and "not valid Unicode" in r.json()["error"]["message"], r.text
    assert all(x.running == 0 and x.kv_full_used == 0 for x in _idle(grpc_client))


def test_unknown_model_is_404_and_a_missing_token_401(app):
    client, _, base = app
    with pytest.raises(openai.NotFoundError) as info:
        client.completions.create(model="gpt-4", prompt="x", max_tokens=2)
    assert info.value.body["code"] == "model_not_found" and info.value.body["param"] == "model"
    anonymous = openai.OpenAI(base_url=base, api_key="wrong", max_retries=0)
    with pytest.raises(openai.AuthenticationError):
        anonymous.models.list()
    r = requests.post(f"{base}/completions", json={"model": MODEL, "prompt": "x"}, timeout=30)
    assert r.status_code == 401 and r.json()["error"]["type"] == "authentication_error"


def test_the_serving_benchmark_drives_it_token_for_token(app):
    _, grpc_client, base = app
    _, ids, _ = _grpc(grpc_client, [7, 8, 9, 10], 8)
    backend = OpenAIBackend(base, MODEL)

    async def collect():
        import aiohttp

        backend.session = aiohttp.ClientSession(headers={"authorization": f"Bearer {TOKEN}"})
        try:
            return [chunk async for chunk in backend.stream([7, 8, 9, 10], 8)]
        finally:
            await backend.aclose()

    chunks = asyncio.run(collect())
    assert [t for c in chunks for t in c.tokens] == ids and not any(c.error for c in chunks)
