"""What third-party tools see: Prometheus scraping either endpoint in either exposition format
gets the same metric names and types (following Prometheus' naming rules), the shipped Grafana
dashboard queries only metrics and labels that exist, the gRPC and HTTP doors render the same
response field by field (after Abort too), prefix-cache hits show in both doors' usage and in the
metrics, both reflection versions answer, and settings given
as `serve run` key=value pairs with dotted keys configure the application."""

import json
import os
import re
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import pytest
import requests
from google.protobuf import descriptor_pb2, descriptor_pool, json_format, message_factory
from grpc_reflection.v1alpha import reflection_pb2
from prometheus_client.openmetrics.parser import text_string_to_metric_families as parse_openmetrics
from prometheus_client.parser import text_string_to_metric_families as parse_text
from ray import serve

from cluster.app import build_app
from cluster.client import GenerationClient
from cluster.config import AppArgs
from cluster.proto.slidespec.v1 import generation_pb2 as pb
from ops import DEFAULT_MODEL, DRAFT_MODELS
from tests.cluster.conftest import free_port

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
OPENMETRICS = "application/openmetrics-text; version=1.0.0; charset=utf-8"
TEXT = "text/plain; version=0.0.4"
# Fixed rounds: the two doors' streams are compared update by update, and adaptive draft lengths
# follow measured time (a request's updates would split differently from run to run).
SPEC = {"algorithm": "eagle", "draft_model": DRAFT_MODELS["eagle"], "num_steps": 3, "adaptive": False}


@pytest.fixture(scope="module")
def app(ray_serve):
    metrics_port = free_port()
    args = dict(
        model=DEFAULT_MODEL,
        page_size=16,
        max_total_tokens=4096,
        context_length=2048,
        speculative=SPEC,
        metrics_port=metrics_port,
        grpc={"port": 0},
    )
    handle = serve.run(build_app(args), name="s", route_prefix="/s")
    client = GenerationClient(f"127.0.0.1:{handle.ports.remote().result()['grpc']}")
    list(client.generate("def f(x):", max_new_tokens=8, temperature=0.0))
    requests.post(f"{ray_serve}/s/generate", json={"prompt": "x", "sampling": {"top_p": 2.0}}, timeout=10)  # a failure
    yield client, f"{ray_serve}/s", f"http://127.0.0.1:{metrics_port}/metrics"
    client.close()


def _scrape(url: str, accept: str):
    r = requests.get(url, headers={"Accept": accept}, timeout=10)
    assert r.status_code == 200
    parse = parse_openmetrics if "openmetrics" in r.headers["content-type"] else parse_text
    assert ("openmetrics" in r.headers["content-type"]) == ("openmetrics" in accept)
    return list(parse(r.text))


def _shape(families) -> tuple[set, set]:
    return {(f.name, f.type) for f in families}, {s.name for f in families for s in f.samples}


def test_metric_names_and_types_are_the_same_everywhere(app):
    _, route, port = app
    shapes = {
        (url, accept): _shape(_scrape(url, accept))
        for url in (f"{route}/metrics", port)
        for accept in (TEXT, OPENMETRICS)
    }
    first = next(iter(shapes.values()))
    assert first[0] and all(shape == first for shape in shapes.values()), shapes
    families = dict(first[0])
    for name in (
        "slidespec_spec_decode_num_drafts",
        "slidespec_request_success",
        "slidespec_prompt_tokens",
        "slidespec_generation_tokens",
    ):
        assert families.get(name) == "counter", name
    for name in ("slidespec_num_requests_running", "slidespec_num_requests_waiting", "slidespec_kv_cache_usage_perc"):
        assert families.get(name) == "gauge", name
    for name in (
        "slidespec_time_to_first_token_seconds",
        "slidespec_e2e_request_latency_seconds",
        "slidespec_request_time_per_output_token_seconds",
        "slidespec_inter_token_latency_seconds",
        "slidespec_request_queue_time_seconds",
        "slidespec_request_prefill_time_seconds",
    ):
        assert families.get(name) == "histogram", name
    assert not [s for s in first[1] if s.endswith("_created")]


def test_metric_names_follow_prometheus_naming_rules(app):
    """The rules `promtool check metrics` applies to names: snake case, no colons (reserved for
    recording rules), counters exposed with `_total`, units as suffixes, base units (seconds),
    a HELP text for every family, and `model_name` on every series."""
    _, route, _ = app
    for family in _scrape(f"{route}/metrics", TEXT):
        assert re.fullmatch(r"slidespec_[a-z][a-z0-9_]*", family.name), family.name
        assert family.documentation, family.name
        assert not family.name.endswith("_total"), f"{family.name}: the _total suffix belongs to samples"
        assert not re.search(r"_(milliseconds|ms|minutes|bytes_total)$", family.name), family.name
        if family.type == "counter":
            assert all(s.name == family.name + "_total" for s in family.samples), family.name
        if family.type == "histogram":
            assert family.name.endswith("_seconds"), family.name
        assert all("model_name" in s.labels and "model" not in s.labels for s in family.samples), family.name


def test_the_grafana_dashboard_queries_metrics_and_labels_that_exist(app):
    _, route, _ = app
    families = {f.name: f for f in _scrape(f"{route}/metrics", TEXT)}
    samples = {s.name: set(s.labels) for f in families.values() for s in f.samples}
    dashboard = json.load(open(os.path.join(ROOT, "ops", "dashboards", "slidespec.json")))
    exprs = [t["expr"] for panel in dashboard["panels"] for t in panel["targets"]]
    exprs.append(dashboard["templating"]["list"][1]["definition"])
    assert len(exprs) > 10
    for expr in exprs:
        names = set(re.findall(r"\bslidespec_[a-z0-9_]+", expr))
        assert names, expr
        labels = set()
        for name in names:
            assert name in samples, f"{name} (in {expr}) is not exported"
            labels |= samples[name]
        for group in re.findall(r"\b(?:by|ignoring)\s*\(([^)]*)\)", expr):
            for label in (x.strip() for x in group.split(",")):
                assert label in labels | {"le"}, f"label {label} (in {expr}) is not on {names}"


def _grpc_final(client, request_id: str, **kwargs) -> list[dict]:
    return [
        json_format.MessageToDict(r, preserving_proto_field_name=True, always_print_fields_with_no_presence=True)
        for r in client.generate("def f(x):", request_id=request_id, **kwargs)
    ]


def _http(url: str, body: dict) -> list[dict]:
    with requests.post(url, json=body, stream=True, timeout=60) as r:
        assert r.status_code == 200, r.text
        return [json.loads(line) for line in r.iter_lines() if line]


def test_grpc_and_http_render_the_same_response(app):
    client, route, _ = app
    sampling = {"max_new_tokens": 12, "temperature": 0.0, "ignore_eos": True}
    grpc_lines = _grpc_final(client, "same-1", **sampling)
    http_lines = _http(f"{route}/generate", {"request_id": "same-1", "prompt": "def f(x):", "sampling": sampling})
    assert http_lines == grpc_lines  # every field of every response
    last = http_lines[-1]
    assert last["finish_reason"] == "FINISH_REASON_LENGTH" and last["usage"]["completion_tokens"] == 12
    assert last["spec"]["verify_steps"] > 0 and last["replica"] and "load" not in last

    whole_grpc = client.complete("def f(x):", request_id="same-2", **sampling)
    r = requests.post(
        f"{route}/generate",
        json={"request_id": "same-2", "prompt": "def f(x):", "sampling": sampling, "stream": False},
        timeout=60,
    )
    assert r.json() == json_format.MessageToDict(
        whole_grpc, preserving_proto_field_name=True, always_print_fields_with_no_presence=True
    )


def _counter(families, name: str) -> float:
    return sum(s.value for f in families for s in f.samples if s.name == name)


def test_prefix_cache_hits_in_usage_and_metrics_on_both_doors(app):
    client, route, metrics = app
    before = _scrape(metrics, TEXT)
    prompt = "# a shared system prompt, long enough for several pages of sixteen tokens\n" * 3 + "def g(y):"
    sampling = {"max_new_tokens": 6, "temperature": 0.0, "ignore_eos": True}
    first = client.complete(prompt, request_id="cache-1", **sampling)
    n = first.usage.prompt_tokens
    assert first.usage.cached_tokens == 0 and n > 32
    second = client.complete(prompt, request_id="cache-2", **sampling)
    third = _http(
        f"{route}/generate", {"request_id": "cache-3", "prompt": prompt, "sampling": sampling, "stream": False}
    )[-1]
    cached = (n - 1) // 16 * 16  # an exact repeat: whole pages, the last prompt token computed
    assert second.usage.cached_tokens == cached and third["usage"]["cached_tokens"] == cached
    assert list(second.token_ids) == list(first.token_ids) == third["token_ids"]
    after = _scrape(metrics, TEXT)
    for name, delta in (("prefix_cache_queries_total", 3 * n), ("prefix_cache_hits_total", 2 * cached)):
        name = "slidespec_" + name
        assert _counter(after, name) - _counter(before, name) == delta, name


def test_http_streams_many_requests_at_once(app):
    """Serve lets a deployment take 5 requests at once unless told otherwise; the ingress must
    pass every HTTP request on as soon as it arrives, not queue the sixth behind the first five:
    more than five reach the engine together (running, or waiting there for KV: 8 x 2,000
    tokens do not fit this pool, and none finishes while the others arrive). Every stream stays
    open until the count is read, so a slow start of the later requests cannot hide (or fake)
    the limit."""
    client, route, _ = app
    body = {"prompt_token_ids": [5, 6, 7], "sampling": {"max_new_tokens": 2000, "temperature": 0.0, "ignore_eos": True}}
    counted = threading.Event()

    def first_line_then_hold():
        with requests.post(f"{route}/generate", json=body, stream=True, timeout=120) as r:
            lines = r.iter_lines()  # kept: a dropped line iterator closes the connection (an abort)
            line = json.loads(next(lines))
            counted.wait(60)
            return line

    with ThreadPoolExecutor(8) as pool:
        futures = [pool.submit(first_line_then_hold) for _ in range(8)]
        most, deadline = 0, time.monotonic() + 60
        while most < 8 and time.monotonic() < deadline:
            most = max(most, sum(r.running + r.waiting for r in client.load().replicas))  # reached the engine
            time.sleep(0.05)
        counted.set()
        assert all(f.result()["token_ids"] for f in futures)
    assert most > 5, f"at most {most} of 8 HTTP requests ran at once"  # Serve's default lets 5 through


def test_an_aborted_request_reports_what_it_consumed_on_both_doors(app):
    client, route, _ = app
    long = {"max_new_tokens": 400, "temperature": 0.0, "ignore_eos": True}
    stream = client.generate("def f(x):", request_id="abort-grpc", **long)
    tokens = list(next(stream).token_ids)
    assert client.abort("abort-grpc")
    grpc_rest = [json_format.MessageToDict(r, preserving_proto_field_name=True) for r in stream]
    tokens += [t for r in grpc_rest for t in r.get("token_ids", [])]

    with requests.post(
        f"{route}/generate",
        json={"request_id": "abort-http", "prompt": "def f(x):", "sampling": long},
        stream=True,
        timeout=60,
    ) as r:
        lines = r.iter_lines()
        http = [json.loads(next(lines))]
        assert client.abort("abort-http")  # one Abort serves both doors
        http += [json.loads(line) for line in lines if line]
    for final, received in ((grpc_rest[-1], len(tokens)), (http[-1], sum(len(u["token_ids"]) for u in http))):
        assert final["finish_reason"] == "FINISH_REASON_ABORT" and final["replica"]
        assert final["usage"]["completion_tokens"] == received > 0 and final["usage"]["prompt_tokens"] > 0
    assert set(http[-1]) == set(
        json_format.MessageToDict(
            pb.GenerateResponse(), preserving_proto_field_name=True, always_print_fields_with_no_presence=True
        )
    ) | {"usage", "spec"}


def _v1_reflection_classes():
    """grpc.reflection.v1's messages, built from v1alpha's descriptor with the v1 package: what a
    client generated from grpc/reflection/v1/reflection.proto sends and reads."""
    proto = descriptor_pb2.FileDescriptorProto()
    reflection_pb2.DESCRIPTOR.CopyToProto(proto)
    proto.name, proto.package = "grpc/reflection/v1/reflection.proto", "grpc.reflection.v1"
    for message in proto.message_type:
        for field in message.field:
            if field.type_name:
                field.type_name = field.type_name.replace(".v1alpha.", ".v1.")
    for service in proto.service:
        for method in service.method:
            method.input_type = method.input_type.replace(".v1alpha.", ".v1.")
            method.output_type = method.output_type.replace(".v1alpha.", ".v1.")
    pool = descriptor_pool.DescriptorPool()
    pool.Add(proto)
    get = lambda name: message_factory.GetMessageClass(pool.FindMessageTypeByName(f"grpc.reflection.v1.{name}"))
    return get("ServerReflectionRequest"), get("ServerReflectionResponse")


@pytest.mark.parametrize("version", ["v1", "v1alpha"])
def test_reflection_answers_in_both_versions(app, version):
    client, _, _ = app
    request_cls, response_cls = (
        _v1_reflection_classes()
        if version == "v1"
        else (reflection_pb2.ServerReflectionRequest, reflection_pb2.ServerReflectionResponse)
    )
    call = client.channel.stream_stream(
        f"/grpc.reflection.{version}.ServerReflection/ServerReflectionInfo",
        request_serializer=request_cls.SerializeToString,
        response_deserializer=response_cls.FromString,
    )
    listed, described = call(
        iter([request_cls(list_services=""), request_cls(file_containing_symbol="slidespec.v1.Generation")]), timeout=10
    )
    names = {s.name for s in listed.list_services_response.service}
    assert {
        "slidespec.v1.Generation",
        "grpc.health.v1.Health",
        "grpc.reflection.v1.ServerReflection",
        "grpc.reflection.v1alpha.ServerReflection",
    } <= names
    files = [
        descriptor_pb2.FileDescriptorProto.FromString(b)
        for b in described.file_descriptor_response.file_descriptor_proto
    ]
    assert any(f.package == "slidespec.v1" and any(s.name == "Generation" for s in f.service) for f in files)


def test_serve_run_key_value_pairs_with_dotted_keys():
    args = AppArgs.from_flat(
        {
            "model": "tiny-gemma3",
            "speculative.algorithm": "eagle",
            "speculative.draft_model": "tiny-gemma3-eagle",
            "speculative.num_steps": "2",
            "speculative.token_map": "hot.json",
            "grpc.port": "50077",
            "tp_size": "2",
            "router.policy": "round_robin",
        }
    )
    assert (args.speculative.algorithm, args.speculative.num_steps, args.grpc.port, args.tp_size) == (
        "eagle",
        2,
        50077,
        2,
    )
    assert args.engine_kwargs()["speculative"]["draft_model"] == DRAFT_MODELS["eagle"]
    assert args.engine_kwargs()["speculative"]["token_map"] == "hot.json"  # checked when the engine starts
    with pytest.raises(ValueError, match="speculative.num_steps"):
        AppArgs.from_flat(
            {
                "model": "tiny-gemma3",
                "speculative.algorithm": "eagle",
                "speculative.draft_model": "tiny-gemma3-eagle",
                "speculative.num_steps": "99",
            }
        )
    with pytest.raises(ValueError, match="grpc.colour"):
        AppArgs.from_flat({"model": "tiny-gemma3", "grpc.colour": "blue"})
    with pytest.raises(ValueError, match="grpc.port: grpc is not a group"):
        AppArgs.from_flat({"model": "tiny-gemma3", "grpc": 5, "grpc.port": 1})
    with pytest.raises(ValueError, match="^1: a setting's name must be text"):
        AppArgs.from_flat({"model": "tiny-gemma3", 1: "x"})


@pytest.mark.parametrize(
    "key, value",
    [("num_replicas", "0"), ("num_replicas", "-2"), ("num_replicas", "many"), ("dtype", "float8"), ("dtype", "fp16")],
)
def test_settings_that_cannot_deploy_are_refused_when_the_app_is_built(key, value):
    """Zero replicas would deploy an application that answers nothing; a dtype the engine
    lacks would fail every replica's start in turn: both refused naming the setting."""
    with pytest.raises(ValueError, match=key):
        AppArgs.from_flat({"model": "tiny-gemma3", key: value})
    assert (
        AppArgs.from_flat({"model": "tiny-gemma3", "num_replicas": "auto", "dtype": "float16"}).num_replicas == "auto"
    )


def test_a_metrics_port_held_by_another_process_is_a_warning_then_served_once_free(monkeypatch):
    """A redeploy's old ingress holds the port a while (tried again each second, quietly); past
    that a warning names it, and the port is served as soon as it frees."""
    import asyncio
    import socket
    import types

    import prometheus_client

    from cluster import ingress

    holder = socket.socket()
    holder.bind(("127.0.0.1", 0))
    holder.listen()
    port = holder.getsockname()[1]
    sleeps, logged = [], []

    async def sleep(seconds):
        sleeps.append(seconds)
        if len(sleeps) == 4:
            holder.close()

    def record(level):
        return lambda message, *args: logged.append((level, message % args))

    monkeypatch.setattr(ingress, "METRICS_PORT_PATIENCE_S", 2)
    # only the ingress module's asyncio: loops other tests left running in this process sleep too
    monkeypatch.setattr(ingress, "asyncio", types.SimpleNamespace(sleep=sleep))
    # the module's logger itself: Serve, started in this process by other tests, may configure logging
    monkeypatch.setattr(ingress, "logger", types.SimpleNamespace(info=record("info"), warning=record("warning")))
    fake = types.SimpleNamespace(
        args=types.SimpleNamespace(metrics_port=port),
        metrics=types.SimpleNamespace(registry=prometheus_client.REGISTRY),
    )
    asyncio.run(ingress.GrpcIngress._serve_metrics(fake))
    assert [level for level, _ in logged] == ["info", "info", "warning", "info"] and len(sleeps) == 4
    assert f"metrics_port {port} is taken" in logged[2][1]
    assert requests.get(f"http://127.0.0.1:{port}/metrics", timeout=5).status_code == 200


def test_a_grpc_port_another_process_holds_names_the_setting():
    import asyncio
    import socket
    import types

    from cluster.config import GrpcArgs
    from cluster.grpc_server import start_server

    holder = socket.socket()
    holder.bind(("127.0.0.1", 0))
    holder.listen()
    port = holder.getsockname()[1]
    service = types.SimpleNamespace(Generate=None, Abort=None, GetModelInfo=None, GetLoad=None)
    try:
        with pytest.raises(RuntimeError, match=f"grpc.host / grpc.port: cannot listen on 127.0.0.1:{port}"):
            asyncio.run(start_server(service, GrpcArgs(port=port)))
    finally:
        holder.close()


@pytest.mark.parametrize(
    "content, message",
    [
        (b"  \n", "holds no token"),
        (b"two words", "one word"),
        (b"caf\xc3\xa9", "one word"),
        (b"\xff\xfe", "cannot read"),
    ],
)
def test_a_token_file_no_client_could_send_is_refused(tmp_path, content, message):
    """An empty token, one with spaces or non-ASCII (no authorization header carries it: every
    call would be denied) or a file that is not text: refused naming the setting."""
    from cluster.auth import BearerToken

    path = tmp_path / "token"
    path.write_bytes(content)
    with pytest.raises(ValueError, match=f"grpc.auth_token_file: .*{message}"):
        BearerToken(str(path))
    with pytest.raises(ValueError, match=f"grpc.auth_token_file: .*{message}"):  # when the app is built
        AppArgs.from_flat({"model": "tiny-gemma3", "grpc.auth_token_file": str(path)})
    path.write_bytes(b"s3cret-token_1\n")
    assert BearerToken(str(path)).admits("Bearer s3cret-token_1")


def test_a_tls_pair_that_is_not_a_certificate_and_its_key_is_refused_when_the_app_is_built(tmp_path):
    """grpcio would only say it failed to bind (the cause in its own log)."""
    from tests.cluster.test_grpc import _self_signed

    (tmp_path / "a").mkdir()
    (tmp_path / "b").mkdir()
    cert, key, _ = _self_signed(tmp_path / "a")
    _, other_key, _ = _self_signed(tmp_path / "b")
    garbage = tmp_path / "garbage.pem"
    garbage.write_text("not a certificate")
    args = {"model": "tiny-gemma3", "grpc.tls_cert_file": cert, "grpc.tls_key_file": key}
    assert AppArgs.from_flat(args).grpc.tls_cert_file == cert
    for cert_file, key_file in [(key, cert), (cert, other_key), (str(garbage), key)]:
        with pytest.raises(ValueError, match="grpc.tls_cert_file / grpc.tls_key_file: .* not a PEM certificate"):
            AppArgs.from_flat({**args, "grpc.tls_cert_file": cert_file, "grpc.tls_key_file": key_file})
