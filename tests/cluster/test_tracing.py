"""Traces and metrics end to end: a gRPC request with a W3C traceparent produces, in that one
trace, the request span, the router span and engine-step spans whose forward spans show EXTEND,
draft decode, TARGET_VERIFY and DRAFT_EXTEND_V2 in order with accept lengths recorded; an OTLP
receiver on loopback (a real gRPC TraceService) receives them. Prometheus metrics count the
speculative drafts and latencies."""

import time
from concurrent import futures

import grpc
import pytest
import requests
from opentelemetry.proto.collector.trace.v1 import trace_service_pb2, trace_service_pb2_grpc
from ray import serve

from cluster.app import build_app
from cluster.client import GenerationClient
from tests.draft_models import make_target_and_draft

TRACE_ID = "4bf92f3577b34da6a3ce929d0e0e4736"
K = 3


class Receiver(trace_service_pb2_grpc.TraceServiceServicer):
    def __init__(self):
        self.spans = []

    def Export(self, request, context):
        for rs in request.resource_spans:
            resource = {a.key: a.value.string_value for a in rs.resource.attributes}
            for ss in rs.scope_spans:
                for span in ss.spans:
                    self.spans.append((resource, span))
        return trace_service_pb2.ExportTraceServiceResponse()


@pytest.fixture(scope="module")
def receiver():
    server = grpc.server(futures.ThreadPoolExecutor(max_workers=4))
    sink = Receiver()
    trace_service_pb2_grpc.add_TraceServiceServicer_to_server(sink, server)
    port = server.add_insecure_port("127.0.0.1:0")
    server.start()
    yield sink, port
    server.stop(0)


@pytest.fixture(scope="module")
def app(receiver, ray_serve, tmp_path_factory):
    """The receiver first, so that it stops after Serve: the application's last flush at
    shutdown reaches it rather than retrying against a closed port."""
    target, draft = make_target_and_draft(tmp_path_factory.mktemp("tracing"))
    handle = serve.run(
        build_app(
            dict(
                model=target,
                page_size=4,
                chunked_prefill_size=16,
                max_total_tokens=2048,
                context_length=512,
                speculative={"algorithm": "standalone", "draft_model": draft, "num_steps": K, "adaptive": False},
                tracing={"exporter": "otlp_grpc", "endpoint": f"127.0.0.1:{receiver[1]}"},
                grpc={"port": 0},
            )
        ),
        name="traced",
        route_prefix="/traced",
    )
    return handle, handle.ports.remote().result()["grpc"]


def _attr(span, key):
    for a in span.attributes:
        if a.key == key:
            v = a.value
            if v.HasField("array_value"):
                return [getattr(x, x.WhichOneof("value")) for x in v.array_value.values]
            return getattr(v, v.WhichOneof("value"))
    return None


def test_one_trace_holds_request_router_and_step_spans(app, receiver):
    sink, _ = receiver
    _, port = app
    client = GenerationClient(f"127.0.0.1:{port}")
    client.metadata = (("traceparent", f"00-{TRACE_ID}-00f067aa0ba902b7-01"),)
    responses = list(
        client.generate([5, 9, 2, 6, 5, 3, 5, 8, 9, 7], max_new_tokens=12, temperature=0.0, ignore_eos=True)
    )
    assert responses[-1].finished
    deadline = time.monotonic() + 20
    while time.monotonic() < deadline:
        mine = [(r, s) for r, s in sink.spans if s.trace_id.hex() == TRACE_ID]
        names = {s.name for _, s in mine}
        if (
            {"route", "engine step"} <= names
            and any(n.startswith("text_completion") for n in names)
            and any(_attr(s, "slidespec.spec.accept_lengths") for _, s in mine if s.name == "engine step")
        ):
            break
        time.sleep(0.2)
    else:
        pytest.fail(f"spans received for the trace: {sorted(names)}")
    request = next(s for _, s in mine if s.name.startswith("text_completion"))
    assert request.parent_span_id.hex() == "00f067aa0ba902b7"  # the client's traceparent was honoured
    assert _attr(request, "gen_ai.operation.name") == "text_completion"
    assert _attr(request, "gen_ai.usage.input_tokens") == 10 and _attr(request, "gen_ai.usage.output_tokens") == 12
    assert _attr(request, "gen_ai.response.finish_reasons") == ["length"]
    assert _attr(request, "gen_ai.server.time_to_first_token") > 0
    assert _attr(request, "gen_ai.provider.name") == "slidespec"
    assert _attr(request, "server.address") == "127.0.0.1" and _attr(request, "server.port") == port
    route = next(s for _, s in mine if s.name == "route")
    assert route.parent_span_id == request.span_id and _attr(route, "slidespec.router.policy") == "power_of_two"
    steps = sorted((s for _, s in mine if s.name == "engine step"), key=lambda s: s.start_time_unix_nano)
    forwards = sorted(
        (s for _, s in mine if s.parent_span_id in {st.span_id for st in steps}), key=lambda s: s.start_time_unix_nano
    )
    modes = [s.name for s in forwards]
    first = {
        m: modes.index(m) for m in ("target EXTEND", "draft DECODE", "target TARGET_VERIFY", "draft DRAFT_EXTEND_V2")
    }
    assert (
        first["target EXTEND"] < first["draft DECODE"] < first["target TARGET_VERIFY"] < first["draft DRAFT_EXTEND_V2"]
    )
    verify = [s for s in steps if _attr(s, "slidespec.spec.accept_lengths")]
    assert verify and all(_attr(s, "slidespec.spec.accept_lengths") == [K + 1] for s in verify[:-1])
    assert (
        _attr(verify[0], "slidespec.draft.pool") == "swa"
        and _attr(verify[0], "slidespec.spec.algorithm") == "standalone"
    )
    assert _attr(verify[0], "slidespec.kv.swa_used") > 0 and _attr(verify[0], "slidespec.step.verify_ms") > 0
    assert all(_attr(s, "slidespec.cache.hit_tokens") == [0] for s in steps)  # less than a page: no hit
    assert {r["slidespec.component"] for r, s in mine} == {"ingress", "rank0"}


def test_metrics_count_drafts_and_latency(app, ray_serve):
    _, port = app
    client = GenerationClient(f"127.0.0.1:{port}")
    for i in range(3):
        list(client.generate([1, 2, 3, i], max_new_tokens=9, temperature=0.0, ignore_eos=True))
    text = requests.get(f"{ray_serve}/traced/metrics", timeout=30).text
    values = {}
    for line in text.splitlines():
        if line and not line.startswith("#"):
            name, value = line.rsplit(" ", 1)
            values[name] = float(value)
    model_label = next(k for k in values if k.startswith("slidespec_spec_decode_num_drafts_total"))
    assert values[model_label] >= 6  # (9 - 1) / (K + 1) = 2 verify steps per request
    assert 'model_name="' in model_label
    assert any(k.startswith("slidespec_spec_accept_length{") and v == K + 1 for k, v in values.items())
    assert any(k.startswith("slidespec_time_to_first_token_seconds_count") and v >= 3 for k, v in values.items())
    assert any(k.startswith("slidespec_e2e_request_latency_seconds_count") and v >= 3 for k, v in values.items())
    for phase in ("queue", "prefill"):
        assert any(k.startswith(f"slidespec_request_{phase}_time_seconds_count") and v >= 3 for k, v in values.items())
    assert any(k.startswith("slidespec_request_time_per_output_token_seconds_count") for k in values)
    assert any(k.startswith("slidespec_generation_tokens_total") and v >= 27 for k, v in values.items())
    assert any(k.startswith("slidespec_prompt_tokens_total") and v >= 12 for k, v in values.items())
    assert any(k.startswith("slidespec_kv_cache_usage_perc{") for k in values)
    assert any(k.startswith("slidespec_num_requests_running{") for k in values)
    assert any(k.startswith("slidespec_spec_decode_num_accepted_tokens_per_pos_total") for k in values)


def test_a_trace_directory_that_cannot_be_made_names_the_setting(tmp_path):
    from cluster.config import TracingArgs
    from cluster.tracing import tracer_for

    taken = tmp_path / "a-file"
    taken.write_text("")
    with pytest.raises(ValueError, match="tracing.file_dir: cannot make .*a-file"):
        tracer_for(TracingArgs(exporter="file", file_dir=str(taken)), "ingress")
    assert tracer_for(TracingArgs(exporter="file", file_dir=str(tmp_path / "traces")), "ingress") is not None
