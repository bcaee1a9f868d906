"""OpenTelemetry traces: a request span per request at the ingress (GenAI semantic conventions),
a router span, and a span per engine step from rank 0 with a child span per forward pass.

Step spans carry what an operator needs to see why speculative decoding's accept length moved:
forward modes in order, batch size, tokens, attention kernels, full/SWA pool use, draft pool
kind, algorithm, the draft steps the step ran (the controller's choice), accept lengths, accepted
drafts per position, sequence lengths relative to the window and the time spent drafting,
verifying and catching up. `slidespec diagnose` reads them
back (ops/diagnose.py). The W3C trace context travels with each request to the rank actors.
"""

from __future__ import annotations

import os
import socket
from collections.abc import Iterable, Mapping
from typing import Any

from opentelemetry import trace
from opentelemetry.propagate import extract, inject
from opentelemetry.sdk.resources import Resource
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import BatchSpanProcessor, SpanExporter
from opentelemetry.sdk.trace.sampling import ParentBased, TraceIdRatioBased
from opentelemetry.trace import Link, SpanKind

from cluster.config import TracingArgs
from workers.step_record import StepRecord

STEP_SPAN = "engine step"
# Forward modes whose time counts as drafting / verifying / draft catch-up in a step span.
PHASES = {
    ("draft", "DECODE"): "draft",
    ("target", "TARGET_VERIFY"): "verify",
    ("draft", "DRAFT_EXTEND_V2"): "draft_extend",
    ("draft", "EXTEND"): "draft_extend",
}

_PROVIDERS: dict[str, TracerProvider] = {}


def _exporter(args: TracingArgs, component: str) -> SpanExporter:
    if args.exporter == "otlp_grpc":
        from opentelemetry.exporter.otlp.proto.grpc.trace_exporter import OTLPSpanExporter

        return OTLPSpanExporter(endpoint=args.endpoint, insecure=args.insecure)
    if args.exporter == "otlp_http":
        from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter

        return OTLPSpanExporter(endpoint=args.endpoint)
    if args.exporter == "file":
        from opentelemetry.exporter.otlp.json.file import FileSpanExporter

        try:
            os.makedirs(args.file_dir, exist_ok=True)
        except OSError as exc:  # a file of that name, no permission, a read-only disk
            raise ValueError(
                f"tracing.file_dir: cannot make {args.file_dir!r} a directory of trace files: {exc}"
            ) from exc
        # One file per process: concurrent appends from several processes could interleave.
        return FileSpanExporter(os.path.join(args.file_dir, f"{component}-{socket.gethostname()}-{os.getpid()}.jsonl"))
    raise ValueError(f"tracing.exporter: unknown {args.exporter!r}")


def tracer_for(args: TracingArgs, component: str) -> trace.Tracer | None:
    """This process's tracer for a component (ingress, rank); None when tracing is off."""
    if args.exporter == "none":
        return None
    key = f"{component}:{args.model_dump_json()}"
    if key not in _PROVIDERS:
        provider = TracerProvider(
            resource=Resource.create({"service.name": args.service_name, "slidespec.component": component}),
            sampler=ParentBased(TraceIdRatioBased(args.sample_ratio)),
        )
        provider.add_span_processor(BatchSpanProcessor(_exporter(args, component)))
        _PROVIDERS[key] = provider
    return _PROVIDERS[key].get_tracer("slidespec")


def flush_all() -> None:
    for provider in _PROVIDERS.values():
        provider.force_flush()


def context_from_carrier(carrier: Mapping[str, str] | None):
    """The W3C trace context in `carrier` (gRPC metadata or a request's `trace_context`)."""
    return extract(dict(carrier or {}))


def carrier_for(span: trace.Span) -> dict[str, str]:
    """A `traceparent` (and `tracestate`) carrier that makes `span` the parent elsewhere."""
    carrier: dict[str, str] = {}
    inject(carrier, context=trace.set_span_in_context(span))
    return carrier


def engine_info(engine) -> dict[str, Any]:
    """The configuration a step span records (backend, window, algorithm, draft pool)."""
    return {
        "attention_backend": engine.runner.backend.name,
        "max_window": engine.cfg.max_window,
        "speculative": engine.spec.drafter.algorithm if engine.spec else None,
        "draft_pool": engine.spec.drafter.pool_kind if engine.spec else None,
    }


def step_attributes(
    step: StepRecord, engine_info: Mapping[str, Any], kv: Mapping[str, int], num_steps: int
) -> dict[str, Any]:
    """A step span's attributes (docs/design.md §8)."""
    window = engine_info.get("max_window")
    phases = {"draft": 0, "verify": 0, "draft_extend": 0}
    for f in step.forwards:
        phase = PHASES.get((f.model, f.mode))
        if phase:
            phases[phase] += f.end_ns - f.start_ns
    target = [f for f in step.forwards if f.model == "target"]
    mode = target[-1].mode if target else (step.forwards[-1].mode if step.forwards else "IDLE")
    verified = [r for r in step.request_ids if r in step.accept_lengths]
    lengths = [step.accept_lengths[r] for r in verified]
    attrs: dict[str, Any] = {
        "slidespec.forward_mode": mode,
        "slidespec.forward_modes": [f"{f.model}:{f.mode}" for f in step.forwards for _ in range(f.steps)],
        "slidespec.batch_size": len(step.request_ids),
        "slidespec.num_tokens": sum(f.num_tokens for f in target),
        "slidespec.attention.backend": engine_info.get("attention_backend", ""),
        "slidespec.attention.kernel": sorted({f.kernel for f in target}),
        "slidespec.kv.full_used": kv["full_total"] - kv["full_free"],
        "slidespec.kv.swa_used": kv["swa_total"] - kv["swa_free"],
        "slidespec.kv.full_total": kv["full_total"],
        "slidespec.kv.swa_total": kv["swa_total"],
        "slidespec.request_ids": list(step.request_ids),
        "slidespec.seq_lens": list(step.seq_lens),
        "slidespec.cache.hit_tokens": list(step.cached_tokens),
        "slidespec.step.draft_ms": phases["draft"] / 1e6,
        "slidespec.step.verify_ms": phases["verify"] / 1e6,
        "slidespec.step.draft_extend_ms": phases["draft_extend"] / 1e6,
    }
    if window:
        attrs["slidespec.seq_len_over_window"] = [round(n / window, 3) for n in step.seq_lens]
    if engine_info.get("speculative"):
        attrs["slidespec.spec.algorithm"] = engine_info["speculative"]
        attrs["slidespec.draft.pool"] = engine_info.get("draft_pool", "")
        attrs["slidespec.spec.num_steps"] = num_steps
    if step.draft_steps is not None:
        attrs["slidespec.spec.draft_steps"] = step.draft_steps
    if lengths:
        attrs["slidespec.spec.request_ids"] = verified
        attrs["slidespec.spec.accept_lengths"] = lengths
        attrs["slidespec.spec.accepted_per_position"] = [sum(n - 1 > i for n in lengths) for i in range(num_steps)]
    return attrs


def record_step(
    tracer: trace.Tracer,
    step: StepRecord,
    parents: Iterable[Any],
    engine_info: Mapping[str, Any],
    kv: Mapping[str, int],
    num_steps: int,
) -> None:
    """One span per engine step in the trace of the step's first request (linked to the other
    requests' traces), with a child span per forward pass."""
    contexts = [c for c in parents if c is not None]
    links = [Link(trace.get_current_span(c).get_span_context()) for c in contexts[1:]]
    span = tracer.start_span(
        STEP_SPAN,
        context=contexts[0] if contexts else None,
        links=links,
        kind=SpanKind.INTERNAL,
        start_time=step.start_ns,
        attributes=step_attributes(step, engine_info, kv, num_steps),
    )
    child_context = trace.set_span_in_context(span)
    for f in step.forwards:
        tracer.start_span(
            f"{f.model} {f.mode}",
            context=child_context,
            start_time=f.start_ns,
            attributes={
                "slidespec.model": f.model,
                "slidespec.forward_mode": f.mode,
                "slidespec.batch_size": f.batch_size,
                "slidespec.num_tokens": f.num_tokens,
                "slidespec.attention.kernel": f.kernel,
                "slidespec.forward.steps": f.steps,
            },
        ).end(end_time=f.end_ns)
    span.end(end_time=step.end_ns)
