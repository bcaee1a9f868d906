"""Prometheus metrics of the serving path, kept by the ingress from what every response carries
(finished requests bring their usage, speculative statistics and their replica's load), so no
process has to be scraped but the ingress.

Names: vLLM's metric set and labels where a counterpart exists (`model_name`;
`num_requests_running` / `num_requests_waiting`, `kv_cache_usage_perc`, `prompt_tokens_total`,
`generation_tokens_total`, `prefix_cache_queries_total` / `prefix_cache_hits_total` (tokens),
`request_success_total{finished_reason}`, the latency histograms, the `spec_decode_*`
counters), SGLang's accept-length gauges, under the prefix `slidespec_`; and
`spec_decode_num_draft_steps_total{draft_steps}`, the decode steps of finished requests by the
draft steps the controller chose for them (0: a plain decode step; docs/design.md §6.1).
Not vLLM's `vllm:` colon: prometheus_client renders a colon name differently in the
OpenMetrics format (samples with `_`, HELP/TYPE with `:`), so Prometheus, which negotiates
OpenMetrics, would store untyped series under other names. With `slidespec_` the names and
types are the same on every endpoint and in both formats, and follow Prometheus' naming rules
(`promtool check metrics`). No `_created` series (as vLLM).

Which requests each counts: time to first token, queue time and prefill time count every request
that got a first token, when it comes (whether the request then finishes, is aborted, fails or
loses its client); inter-token latency every later response; e2e latency, time per output token,
the token counters and the speculative counters every request that finished (its last response,
finish reason stop, length or abort, reached the ingress); `request_success` and
`request_failure` every request once, by how it ended.
"""

from __future__ import annotations

import collections
from typing import Any

import prometheus_client
from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram
from prometheus_client.exposition import choose_encoder

prometheus_client.disable_created_metrics()

PREFIX = "slidespec_"
LATENCY_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0)
RECENT_VERIFY_STEPS = 1024  # window of the accept-length gauges
FINISH_REASONS = ("stop", "length", "abort")  # a request that ended with one of these finished


class ServingMetrics:
    def __init__(self, model: str) -> None:
        self.registry = CollectorRegistry()
        self.model = model
        r, m = self.registry, ["model_name"]

        def counter(name: str, doc: str, labels: tuple[str, ...] = ()) -> Counter:
            return Counter(PREFIX + name, doc, m + list(labels), registry=r)

        def gauge(name: str, doc: str, labels: tuple[str, ...] = ()) -> Gauge:
            return Gauge(PREFIX + name, doc, m + list(labels), registry=r)

        def histogram(name: str, doc: str) -> Histogram:
            return Histogram(PREFIX + name, doc, m, buckets=LATENCY_BUCKETS, registry=r)

        self.running = gauge(
            "num_requests_running", "Requests running on the replica, as it last reported", ("replica",)
        )
        self.waiting = gauge(
            "num_requests_waiting", "Requests waiting on the replica, as it last reported", ("replica",)
        )
        self.kv_usage = gauge(
            "kv_cache_usage_perc", "KV pool use (0-1), as the replica last reported", ("replica", "pool")
        )
        self.prompt_tokens = counter("prompt_tokens", "Prompt tokens of finished requests")
        self.generation_tokens = counter("generation_tokens", "Tokens generated for finished requests")
        self.cache_queries = counter("prefix_cache_queries", "Prompt tokens looked up in the prefix cache")
        self.cache_hits = counter("prefix_cache_hits", "Prompt tokens found in the prefix cache")
        self.success = counter("request_success", "Requests that finished, by finish reason", ("finished_reason",))
        self.failure = counter(
            "request_failure",
            "Requests that ended without finishing: cancelled, deadline_exceeded or an error code",
            ("reason",),
        )
        self.ttft = histogram("time_to_first_token_seconds", "Time to first token, of every request that got one")
        self.itl = histogram("inter_token_latency_seconds", "Time between streamed responses, per token")
        self.tpot = histogram(
            "request_time_per_output_token_seconds", "A request's time per output token after the first"
        )
        self.e2e = histogram("e2e_request_latency_seconds", "Time from arrival to the last token")
        self.queue = histogram(
            "request_queue_time_seconds",
            "Time from arrival at a replica's engine to admission (KV reserved), of every request that got a "
            "first token",
        )
        self.prefill = histogram(
            "request_prefill_time_seconds",
            "Time from admission to the first generated token, of every request that got one",
        )
        self.num_drafts = counter("spec_decode_num_drafts", "Draft chains verified")
        self.num_draft_tokens = counter("spec_decode_num_draft_tokens", "Draft tokens proposed")
        self.num_accepted_tokens = counter("spec_decode_num_accepted_tokens", "Draft tokens accepted")
        self.accepted_per_pos = counter(
            "spec_decode_num_accepted_tokens_per_pos", "Draft tokens accepted at each draft position", ("position",)
        )
        self.draft_steps = counter(
            "spec_decode_num_draft_steps",
            "Decode steps of finished requests by the draft steps each ran (0: a plain decode step)",
            ("draft_steps",),
        )
        self.accept_length = gauge(
            "spec_accept_length",
            f"Mean accept length (accepted drafts + 1) over the last {RECENT_VERIFY_STEPS} verify steps",
        )
        self.accept_rate = gauge(
            "spec_accept_rate", f"Accepted / proposed draft tokens over the last {RECENT_VERIFY_STEPS} verify steps"
        )
        self._recent: collections.deque[tuple[int, int]] = collections.deque(maxlen=RECENT_VERIFY_STEPS)

    def first_token(self, seconds: float, update: dict[str, Any]) -> None:
        """A request's first token came `seconds` after it arrived, in `update`, which carries the
        engine's queue and prefill times."""
        self.ttft.labels(self.model).observe(seconds)
        for histogram, phase in ((self.queue, "queue_s"), (self.prefill, "prefill_s")):
            if update.get(phase) is not None:
                histogram.labels(self.model).observe(update[phase])

    def next_tokens(self, seconds: float, tokens: int) -> None:
        if tokens:
            self.itl.labels(self.model).observe(seconds / tokens)

    def finished(self, update: dict[str, Any], e2e_s: float, decode_s: float) -> None:
        """A request's last response: usage, latencies, speculative statistics, replica load.
        `decode_s`: time from its first token to its last (0 without tokens)."""
        completion = update.get("completion_tokens", 0)
        self.prompt_tokens.labels(self.model).inc(update.get("prompt_tokens", 0))
        self.generation_tokens.labels(self.model).inc(completion)
        self.cache_queries.labels(self.model).inc(update.get("prompt_tokens", 0))
        self.cache_hits.labels(self.model).inc(update.get("cached_tokens", 0))
        self.e2e.labels(self.model).observe(e2e_s)
        if completion > 1:
            self.tpot.labels(self.model).observe(decode_s / (completion - 1))
        spec = update.get("spec")
        if spec:
            steps = collections.Counter(spec["draft_steps"])
            steps[0] += spec["plain_steps"]
            for k, count in sorted(steps.items()):
                if count:
                    self.draft_steps.labels(self.model, str(k)).inc(count)
        if spec and spec["verify_steps"]:
            accepted = sum(spec["accept_lengths"]) - spec["verify_steps"]
            self.num_drafts.labels(self.model).inc(spec["verify_steps"])
            self.num_draft_tokens.labels(self.model).inc(sum(spec["draft_steps"]))
            self.num_accepted_tokens.labels(self.model).inc(accepted)
            for position, count in enumerate(spec["accepted_per_position"]):
                self.accepted_per_pos.labels(self.model, str(position)).inc(count)
            self._recent.extend(zip(spec["accept_lengths"], spec["draft_steps"]))
            self.accept_length.labels(self.model).set(sum(n for n, _ in self._recent) / len(self._recent))
            self.accept_rate.labels(self.model).set(
                sum(n - 1 for n, _ in self._recent) / sum(k for _, k in self._recent)
            )
        load = update.get("load")
        if load:
            self.load(load)

    def ended(self, reason: str) -> None:
        """Every request is counted once: as a success by finish reason, or as a failure."""
        if reason in FINISH_REASONS:
            self.success.labels(self.model, reason).inc()
        else:
            self.failure.labels(self.model, reason).inc()

    def load(self, load: dict[str, Any]) -> None:
        replica = load["replica"]
        for pool in ("full", "swa"):
            total = load.get(f"kv_{pool}_total", 0)
            self.kv_usage.labels(self.model, replica, pool).set(
                load.get(f"kv_{pool}_used", 0) / total if total else 0.0
            )
        self.running.labels(self.model, replica).set(load.get("running", 0))
        self.waiting.labels(self.model, replica).set(load.get("waiting", 0))

    def exposition(self, accept: str | None = None) -> tuple[bytes, str]:
        """The registry in the format the scraper asked for (OpenMetrics or the text format)."""
        encoder, content_type = choose_encoder(accept or "")
        return encoder(self.registry), content_type
