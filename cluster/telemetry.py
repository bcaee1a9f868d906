"""One request's telemetry at the ingress: its request span (GenAI semantic conventions), its
router span, and the latency and speculative-decoding metrics of its responses."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Mapping
from typing import Any

from opentelemetry import trace
from opentelemetry.trace import SpanKind, Status, StatusCode

from cluster.metrics import ServingMetrics
from cluster.routing.load_board import BOARD
from cluster.tracing import carrier_for, context_from_carrier

OPERATION = "text_completion"
PROVIDER = "slidespec"  # gen_ai.provider.name: the system serving the model


# How a request's stream ends when its reader left (a cancelled call, a passed deadline, a closed
# connection): the server cancels the handler's task, or closes its generator at a `yield` when
# the cancellation meets a write in progress. Either is the client's doing, never an error.
READER_GONE = (asyncio.CancelledError, GeneratorExit)


class RequestTelemetry:
    def __init__(
        self,
        tracer: trace.Tracer | None,
        metrics: ServingMetrics | None,
        model: str,
        body: dict[str, Any],
        metadata: Mapping[str, str],
        server: tuple[str, int] | None = None,
    ) -> None:
        """Start the request span (child of a `traceparent` in the call's metadata, if any) and
        put its W3C context into the request so the engine's step spans join the trace.
        `server`: the address and port the request came in on."""
        self.tracer, self.metrics = tracer, metrics
        self.rid = body["request_id"]
        self.start, self.start_ns = time.monotonic(), time.time_ns()
        self.first: float | None = None
        self.last: float | None = None
        self.finish_reason: str | None = None
        self.span = None
        if tracer is not None:
            sampling = body.get("sampling", {})
            attrs = {
                "gen_ai.operation.name": OPERATION,
                "gen_ai.provider.name": PROVIDER,
                "gen_ai.request.model": model,
                "gen_ai.response.id": self.rid,
                "gen_ai.usage.input_tokens": len(body.get("prompt_token_ids", ())),
            }
            for name, key in (
                ("max_tokens", "max_new_tokens"),
                ("temperature", "temperature"),
                ("top_p", "top_p"),
                ("top_k", "top_k"),
                ("seed", "seed"),
            ):
                if key in sampling:
                    attrs[f"gen_ai.request.{name}"] = sampling[key]
            if server is not None:
                attrs["server.address"], attrs["server.port"] = server
            self.span = tracer.start_span(
                f"{OPERATION} {model}",
                context=context_from_carrier(metadata),
                kind=SpanKind.SERVER,
                attributes=attrs,
                start_time=self.start_ns,
            )
            body["trace_context"] = carrier_for(self.span)

    def update(self, update: dict[str, Any]) -> None:
        """One response on its way to the client. The first that brings tokens is the request's
        first token: its time and the engine's queue and prefill times (which that response
        carries) are counted then, so all three count the same requests, however they end."""
        now = time.monotonic()
        if self.last is None and self.span is not None:
            self._router_span()
        if self.first is None and update["token_ids"]:
            self.first = now
            if self.metrics is not None:
                self.metrics.first_token(now - self.start, update)
            if self.span is not None:
                self.span.set_attribute("gen_ai.server.time_to_first_token", now - self.start)
        elif self.first is not None and self.metrics is not None:
            self.metrics.next_tokens(now - self.last, len(update["token_ids"]))
        self.last = now
        if update["finished"]:
            self.finish_reason = update.get("finish_reason") or "unknown"
            if self.metrics is not None:
                self.metrics.finished(update, now - self.start, now - (self.first or now))
            if self.span is not None:
                self.span.set_attributes(
                    {
                        "gen_ai.usage.output_tokens": update.get("completion_tokens", 0),
                        "gen_ai.response.finish_reasons": [update.get("finish_reason") or ""],
                        "slidespec.replica": update.get("replica", ""),
                    }
                )
                spec = update.get("spec")
                if spec:
                    self.span.set_attributes(
                        {
                            "slidespec.spec.mean_accept_length": spec["mean_accept_length"],
                            "slidespec.spec.verify_steps": spec["verify_steps"],
                        }
                    )

    def _router_span(self) -> None:
        decision = BOARD.pop_decision(self.rid)
        if decision is None:
            return
        chosen_by, candidates, chosen = decision
        attrs = {
            "slidespec.router.policy": chosen_by.policy,
            "slidespec.router.candidates": candidates,
            "slidespec.router.chosen": chosen,
            "slidespec.router.reason": chosen_by.reason,
        }
        if chosen_by.prefix_match is not None:
            attrs["slidespec.router.prefix_match"] = chosen_by.prefix_match
        self.tracer.start_span(
            "route", context=trace.set_span_in_context(self.span), start_time=self.start_ns, attributes=attrs
        ).end()

    def end(self, outcome: str | None = None, error: str | None = None) -> None:
        """The request is over: counted once by how it ended: `outcome` when it did not end
        normally (cancelled, deadline_exceeded or an error code), else its finish reason."""
        BOARD.pop_decision(self.rid)  # unread when tracing is off or no token came back
        if self.metrics is not None:
            self.metrics.ended(outcome or self.finish_reason or "unknown")
        if self.span is None:
            return
        if error is not None or (self.finish_reason is None and outcome is not None):
            self.span.set_status(Status(StatusCode.ERROR, error or outcome))
        self.span.end()
