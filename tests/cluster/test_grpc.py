"""The gRPC API end to end over loopback: a Serve application (ingress + 2 engine replicas, cache-
aware routing) and a TLS + token one. Streamed tokens equal the in-process engine's; 64
concurrent streams over 2 replicas complete; abort, cancellation and deadlines free KV; every
error case returns its status code with a message naming the cause; retries before the first
token recover from a dead replica; with none healthy the answer is UNAVAILABLE."""

import asyncio
import datetime
import ipaddress
import statistics
import threading
import time

import grpc
import pytest
import ray
import requests
from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import NameOID
from grpc_health.v1 import health_pb2
from ray import serve

from cluster.app import build_app
from cluster.client import AsyncGenerationClient, GenerationClient
from cluster.proto.slidespec.v1 import generation_pb2 as pb
from ops import DEFAULT_MODEL
from ops.bench import serve_bench
from tests.cluster.conftest import session_logs
from tests.hf_models import random_prompts
from workers.engine import Engine, SamplingParams

COMMON = dict(
    page_size=4,
    chunked_prefill_size=8,
    max_total_tokens=4096,
    context_length=512,
    tp_size=1,
    health_check_period_s=1,
    health_check_timeout_s=5,
)
TOKEN = "s3cret-token"


def _self_signed(tmp_path) -> tuple[str, str, bytes]:
    key = ec.generate_private_key(ec.SECP256R1())
    name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, "localhost")])
    now = datetime.datetime.now(datetime.timezone.utc)
    cert = (
        x509.CertificateBuilder()
        .subject_name(name)
        .issuer_name(name)
        .public_key(key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - datetime.timedelta(minutes=5))
        .not_valid_after(now + datetime.timedelta(days=1))
        .add_extension(
            x509.SubjectAlternativeName([x509.DNSName("localhost"), x509.IPAddress(ipaddress.ip_address("127.0.0.1"))]),
            False,
        )
        .add_extension(x509.BasicConstraints(ca=True, path_length=None), True)
        .sign(key, hashes.SHA256())
    )
    pem = cert.public_bytes(serialization.Encoding.PEM)
    (tmp_path / "cert.pem").write_bytes(pem)
    (tmp_path / "key.pem").write_bytes(
        key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8, serialization.NoEncryption())
    )
    return str(tmp_path / "cert.pem"), str(tmp_path / "key.pem"), pem


@pytest.fixture(scope="module")
def model():
    """The shipped trained model: it writes real text, which stop strings need."""
    return DEFAULT_MODEL


@pytest.fixture(scope="module")
def servers(ray_serve, model, tmp_path_factory):
    """{name: (gRPC target, root cert)}: "api" (2 replicas, cache_aware) and "secure" (TLS, token,
    4 KiB messages, one request at a time and one queued; rank 0 reached through Ray, not its
    socket)."""
    tmp = tmp_path_factory.mktemp("tls")
    cert, key, pem = _self_signed(tmp)
    (tmp / "token").write_text(TOKEN + "\n")
    apps = {
        "api": dict(num_replicas=2, router={"policy": "cache_aware"}, grpc={"port": 0, "ready_wait_s": 3.0}),
        "secure": dict(
            num_replicas=1,
            max_ongoing_requests=1,
            max_queued_requests=1,
            rank0_transport="ray",
            grpc={
                "port": 0,
                "tls_cert_file": cert,
                "tls_key_file": key,
                "auth_token_file": str(tmp / "token"),
                "max_message_bytes": 4096,
            },
        ),
    }
    out = {}
    for name, extra in apps.items():
        handle = serve.run(build_app({**COMMON, "model": model, **extra}), name=name, route_prefix=f"/{name}")
        out[name] = (f"127.0.0.1:{handle.ports.remote().result()['grpc']}", pem if name == "secure" else None, handle)
    return out


@pytest.fixture
def api(servers):
    client = GenerationClient(servers["api"][0])
    yield client
    client.close()


def _rank0s(app: str = "") -> list:
    """Rank-0 actors of an application's engine replicas (every application's when "")."""
    names = [
        a["name"]
        for a in ray.util.list_named_actors(all_namespaces=True)
        if a["name"].startswith(f"slidespec-{app}") and a["name"].endswith("-rank0")
    ]
    actors = []
    for name in names:
        try:
            actors.append(ray.get_actor(name))
        except ValueError:
            pass
    return actors


def _assert_kv_full(timeout: float = 10.0) -> None:
    """Every live rank's pools return to their initial free counts (within `timeout`)."""
    deadline = time.monotonic() + timeout
    while True:
        try:
            stats = ray.get([a.kv_check.remote() for a in _rank0s()])
            assert stats and all(s["full_free"] == s["full_total"] and s["swa_free"] == s["swa_total"] for s in stats)
            return
        except (AssertionError, ray.exceptions.RayTaskError):
            if time.monotonic() > deadline:
                raise
            time.sleep(0.2)


def _alive(pid: int) -> bool:
    """Whether a process runs (a zombie has exited; one that exits while its stat is read is
    gone too)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except (FileNotFoundError, ProcessLookupError):
        return False


def _collect(responses):
    tokens, text, last = [], "", None
    for r in responses:
        tokens += list(r.token_ids)
        text += r.text
        last = r
    return tokens, text, last


def test_streamed_generation_matches_the_in_process_engine(api, model):
    ref_engine = Engine(model=model, page_size=4, chunked_prefill_size=8, max_total_tokens=4096, context_length=512)
    greedy = SamplingParams(max_new_tokens=16, temperature=0.0, ignore_eos=True)
    for prompt in ["def main(argv):\n    ", random_prompts([23])[0]]:
        ids = ref_engine.tokenizer.encode(prompt) if isinstance(prompt, str) else prompt
        (ref,) = ref_engine.generate(prompt_token_ids=[ids], sampling=greedy)
        tokens, text, last = _collect(api.generate(prompt, max_new_tokens=16, temperature=0.0, ignore_eos=True))
        assert tokens == ref.token_ids
        assert text == ref_engine.tokenizer.decode(tokens, skip_special_tokens=True)
        assert last.finished and last.finish_reason == pb.FINISH_REASON_LENGTH
        assert (last.usage.prompt_tokens, last.usage.completion_tokens) == (len(ids), 16)
        single = api.complete(prompt, max_new_tokens=16, temperature=0.0, ignore_eos=True)
        assert list(single.token_ids) == ref.token_ids and single.text == text
    assert api.health("") == health_pb2.HealthCheckResponse.SERVING
    assert api.health() == health_pb2.HealthCheckResponse.SERVING
    info = api.model_info()
    assert (info.architecture, info.num_replicas, info.routing_policy) == ("Gemma3ForCausalLM", 2, "cache_aware")


def test_64_concurrent_streams_over_two_replicas(servers):
    target = servers["api"][0]

    async def run():
        client = AsyncGenerationClient(target)

        async def one(i):
            tokens, replica = 0, ""
            async for r in client.generate(
                [3, 1, 4, 1, 5, 9, i % 200], max_new_tokens=12, temperature=0.0, ignore_eos=True
            ):
                tokens += len(r.token_ids)
                replica = r.replica or replica
            return tokens, replica

        try:
            return await asyncio.gather(*[one(i) for i in range(64)])
        finally:
            await client.close()

    results = asyncio.run(run())
    assert all(n == 12 for n, _ in results)
    assert len({replica for _, replica in results}) == 2
    _assert_kv_full()
    pings = [a.ping.remote() for a in _rank0s("api")]
    assert all(any(r.startswith("ingress-") for r in p["socket_callers"]) for p in ray.get(pings))  # no Ray hop
    assert servers["api"][2].stats.remote().result()["pending_decisions"] == 0  # routing records do not pile up


def test_the_serving_benchmark_alternates_the_engine_and_the_stack(servers, ray_serve):
    """`serve_bench --compare-rounds`: the same workload on the in-process engine and through a
    running application, alternated; the stack's cost is each round's difference. Both sides
    report the engine's mean queue and prefill times (the stack's from its metrics)."""
    host, port = servers["api"][0].rsplit(":", 1)
    args = ["--backend", "grpc", "--host", host, "--port", port, "--compare-rounds", "2", "--model", "tiny-gemma3"]
    args += ["--metrics-url", f"{ray_serve}/api/metrics"]
    args += ["--device", "cpu", "--page-size", "4", "--max-total-tokens", "4096", "--num-prompts", "4"]
    args += ["--random-input-len", "16", "--random-output-len", "6", "--max-concurrency", "2", "--warmup-requests", "1"]
    result = serve_bench.main(args + ["--disable-tqdm"])
    rounds = result["rounds"]
    assert len(rounds) == 2
    for measured in rounds:
        for backend in ("engine", "stack"):
            assert measured[backend]["completed"] == 4 and measured[backend]["failed"] == 0
            assert measured[backend]["total_output_tokens"] == 4 * 6
            assert all(measured[backend][f"server_mean_{phase}_ms"] >= 0 for phase in ("queue", "prefill"))
    added = [r["stack"]["median_ttft_ms"] - r["engine"]["median_ttft_ms"] for r in rounds]
    assert result["stack_cost"]["median_ttft_added_ms"] == {"rounds": added, "median": statistics.median(added)}
    change = [r["stack"]["output_throughput"] / r["engine"]["output_throughput"] - 1 for r in rounds]
    assert result["stack_cost"]["output_throughput_change"]["rounds"] == change


def test_stop_string_ends_the_text_before_it(api):
    prompt = "import os\n\n\ndef main(argv):\n    "
    _, full, _ = _collect(api.generate(prompt, max_new_tokens=40, temperature=0.0, ignore_eos=True))
    stop = full[len(full) // 2 : len(full) // 2 + 3]
    tokens, text, last = _collect(
        api.generate(prompt, max_new_tokens=40, temperature=0.0, ignore_eos=True, stop=[stop])
    )
    assert text == full[: full.index(stop)] and stop not in text
    assert last.finish_reason == pb.FINISH_REASON_STOP and last.usage.completion_tokens == len(tokens) < 40
    _assert_kv_full()


def test_cache_aware_routing_keeps_a_shared_prefix_on_one_replica(api):
    prefix = random_prompts([80], seed=21)[0]
    replicas = []
    for i in range(6):
        *_, last = _collect(api.generate(prefix + [i], max_new_tokens=2, temperature=0.0, ignore_eos=True))
        replicas.append(last.replica)
    assert len(set(replicas)) == 1, replicas


def test_abort_and_client_cancellation_free_kv(api):
    stream = api.generate([5, 6, 7], request_id="to-abort", max_new_tokens=400, temperature=0.0, ignore_eos=True)
    first = next(stream)
    assert first.request_id == "to-abort"
    assert api.abort("to-abort")
    rest = list(stream)
    assert rest[-1].finished and rest[-1].finish_reason == pb.FINISH_REASON_ABORT
    assert not api.abort("to-abort") and not api.abort("never-seen")
    _assert_kv_full()
    call = api.generate([8, 9, 10], max_new_tokens=400, temperature=0.0, ignore_eos=True)
    next(call)
    call.cancel()
    _assert_kv_full()


@pytest.mark.parametrize(
    "kwargs, code, words",
    [
        (dict(prompt=[]), grpc.StatusCode.INVALID_ARGUMENT, "prompt_token_ids"),  # empty = not given
        (dict(prompt=[1, 2], temperature=-1.0), grpc.StatusCode.INVALID_ARGUMENT, "temperature"),
        (dict(prompt=[1, 2], top_p=0.0), grpc.StatusCode.INVALID_ARGUMENT, "top_p"),
        (dict(prompt=[1, 2], max_new_tokens=0), grpc.StatusCode.INVALID_ARGUMENT, "max_new_tokens"),
        (dict(prompt=[1, 999999]), grpc.StatusCode.INVALID_ARGUMENT, "vocabulary"),
        (dict(prompt=[1] * 600), grpc.StatusCode.INVALID_ARGUMENT, "context length"),
        (dict(prompt=[1, 2], max_new_tokens=400, timeout=0.5), grpc.StatusCode.DEADLINE_EXCEEDED, "Deadline"),
    ],
)
def test_error_codes_name_the_cause(api, kwargs, code, words):
    kwargs = dict(kwargs)
    prompt = kwargs.pop("prompt")
    with pytest.raises(grpc.RpcError) as info:
        list(api.generate(prompt, ignore_eos=True, **kwargs))
    assert info.value.code() == code and words in info.value.details()
    _assert_kv_full()


def test_missing_input_is_invalid(api):
    with pytest.raises(grpc.RpcError) as info:
        list(api.stub.Generate(pb.GenerateRequest()))
    assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT and "prompt" in info.value.details()


def test_tls_token_auth_and_message_size(servers):
    target, pem, _ = servers["secure"]
    good = GenerationClient(target, token=TOKEN, root_cert=pem, server_name="localhost")
    tokens, _, last = _collect(good.generate([1, 2, 3], max_new_tokens=4, temperature=0.0, ignore_eos=True))
    assert len(tokens) == 4 and last.finished
    assert good.health() == health_pb2.HealthCheckResponse.SERVING
    for token in (None, "wrong-token"):
        client = GenerationClient(target, token=token, root_cert=pem, server_name="localhost")
        assert client.health("") == health_pb2.HealthCheckResponse.SERVING  # health needs no token
        with pytest.raises(grpc.RpcError) as info:
            list(client.generate([1, 2, 3], max_new_tokens=4))
        assert info.value.code() == grpc.StatusCode.UNAUTHENTICATED and "bearer token" in info.value.details()
    with pytest.raises(grpc.RpcError) as info:
        GenerationClient(target, token=TOKEN).model_info()  # plaintext to a TLS port
    assert info.value.code() == grpc.StatusCode.UNAVAILABLE
    with pytest.raises(grpc.RpcError) as info:
        list(good.generate([150] * 5000, max_new_tokens=4))  # 10 KB of varints > the 4 KiB limit
    assert info.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
    good.close()


def test_the_token_guards_the_http_route_and_its_metrics_too(servers, ray_serve):
    route = f"{ray_serve}/secure/generate"
    body = {"prompt_token_ids": [1, 2, 3], "sampling": {"max_new_tokens": 3, "temperature": 0.0}, "stream": False}
    for headers in ({}, {"Authorization": "Bearer wrong-token"}, {"Authorization": TOKEN}):
        for r in (
            requests.post(route, json=body, headers=headers, timeout=30),
            requests.get(f"{ray_serve}/secure/metrics", headers=headers, timeout=30),
        ):
            assert r.status_code == 401 and r.json()["error"]["code"] == "UNAUTHENTICATED", r.text
            assert r.headers["WWW-Authenticate"] == "Bearer" and TOKEN not in r.text
    good = {"Authorization": f"Bearer {TOKEN}"}
    r = requests.post(route, json=body, headers=good, timeout=60)
    assert r.status_code == 200 and len(r.json()["token_ids"]) == 3
    r = requests.get(f"{ray_serve}/secure/metrics", headers=good, timeout=30)
    assert r.status_code == 200 and "slidespec_request_success_total" in r.text
    assert requests.get(f"{ray_serve}/api/metrics", timeout=30).status_code == 200  # no token configured there
    time.sleep(1.0)  # log lines reach their files
    assert not [path for path, text in session_logs() if TOKEN in text]  # never logged


def test_full_queue_is_resource_exhausted(servers):
    target, pem, _ = servers["secure"]

    async def run():
        client = AsyncGenerationClient(target, token=TOKEN, root_cert=pem)

        async def one(i):
            try:
                async for _ in client.generate([1, 2, i], max_new_tokens=200, temperature=0.0, ignore_eos=True):
                    pass
                return "ok"
            except grpc.aio.AioRpcError as exc:
                return exc.code(), exc.details()

        try:
            return await asyncio.gather(*[one(i) for i in range(4)])
        finally:
            await client.close()

    results = asyncio.run(run())
    exhausted = [r for r in results if r != "ok"]
    assert exhausted and all(
        code == grpc.StatusCode.RESOURCE_EXHAUSTED and "queue is full" in msg for code, msg in exhausted
    )
    assert "ok" in results
    _assert_kv_full()
    assert [p["socket_callers"] for p in ray.get([a.ping.remote() for a in _rank0s("secure")])] == [[]]


def test_a_dead_replica_fails_its_streams_at_once_the_other_serves_then_unavailable_when_none_is_healthy(api):
    """Retries before the first token are covered without Ray (`test_gateway_retries.py`); here
    a stream that has tokens ends UNAVAILABLE as soon as its rank 0 dies (not retried: its
    client has seen tokens), and new requests go to the replica that lives."""
    stream = api.generate([2, 7, 1, 8], max_new_tokens=400, temperature=0.0, ignore_eos=True)
    first = next(stream)
    dead = ray.get_actor(f"slidespec-api-{first.replica}-rank0")
    pid = ray.get(dead.ping.remote())["pid"]
    ray.kill(dead)
    started, got = time.monotonic(), len(first.token_ids)
    with pytest.raises(grpc.RpcError) as failed:
        for r in stream:
            got += len(r.token_ids)
    assert failed.value.code() == grpc.StatusCode.UNAVAILABLE and first.replica in failed.value.details()
    assert got < 400 and time.monotonic() - started < 10
    deadline = time.monotonic() + 30
    while _alive(pid):  # gone, not dying: a dying rank 0 may still serve its socket
        assert time.monotonic() < deadline, "the killed rank 0 did not exit"
        time.sleep(0.01)
    for i in range(4):
        tokens, _, last = _collect(api.generate([2, 7, 1, 8, i], max_new_tokens=3, temperature=0.0, ignore_eos=True))
        assert len(tokens) == 3 and last.finished and last.replica != first.replica
    stop = threading.Event()

    def keep_killing():  # Serve keeps replacing replicas: kill whatever rank comes up
        while not stop.is_set():
            for actor in _rank0s("api"):
                ray.kill(actor)
            time.sleep(0.05)

    killer = threading.Thread(target=keep_killing, daemon=True)
    killer.start()
    try:
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline:
            try:
                list(api.generate([1, 2, 3], max_new_tokens=2))
            except grpc.RpcError as exc:
                # a replica that failed it, or none that came up within ready_wait_s (3 s here)
                assert exc.code() == grpc.StatusCode.UNAVAILABLE, exc.details()
                assert "replica" in exc.details()
                break
        else:
            pytest.fail("requests kept succeeding with every engine rank dead")
    finally:
        stop.set()
        killer.join()
