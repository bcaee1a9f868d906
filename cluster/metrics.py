"""Prometheus metrics of the serving path, kept by the ingress from what every response carries
(finished requests bring their speculative statistics and their replica's load), so no process
has to be scraped but the ingress.

Speculative decoding counters follow vLLM's names (`spec_decode_num_drafts`,
`..._num_draft_tokens`, `..._num_accepted_tokens`, `..._num_accepted_tokens_per_pos`), gauges
SGLang's (`spec_accept_length`, `spec_accept_rate`), all under the `slidespec:` prefix.
"""

from __future__ import annotations

import collections
from typing import Any

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest

LATENCY_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0)
RECENT_VERIFY_STEPS = 1024  # window of the accept-length gauges


class ServingMetrics:
    def __init__(self, model: str) -> None:
        self.registry = CollectorRegistry()
        self.model = model
        r, m = self.registry, ["model"]
        self.num_drafts = Counter("slidespec:spec_decode_num_drafts", "Draft chains verified", m, registry=r)
        self.num_draft_tokens = Counter(
            "slidespec:spec_decode_num_draft_tokens", "Draft tokens proposed", m, registry=r
        )
        self.num_accepted_tokens = Counter(
            "slidespec:spec_decode_num_accepted_tokens", "Draft tokens accepted", m, registry=r
        )
        self.accepted_per_pos = Counter(
            "slidespec:spec_decode_num_accepted_tokens_per_pos",
            "Draft tokens accepted at each draft position",
            m + ["position"],
            registry=r,
        )
        self.accept_length = Gauge(
            "slidespec:spec_accept_length",
            f"Mean accept length (accepted drafts + 1) over the last {RECENT_VERIFY_STEPS} verify steps",
            m,
            registry=r,
        )
        self.accept_rate = Gauge(
            "slidespec:spec_accept_rate",
            f"Accepted / proposed draft tokens over the last {RECENT_VERIFY_STEPS} verify steps",
            m,
            registry=r,
        )
        self.ttft = Histogram(
            "slidespec:time_to_first_token_seconds", "Time to first token", m, buckets=LATENCY_BUCKETS, registry=r
        )
        self.itl = Histogram(
            "slidespec:inter_token_latency_seconds",
            "Time between streamed responses, per token",
            m,
            buckets=LATENCY_BUCKETS,
            registry=r,
        )
        self.requests = Counter(
            "slidespec:requests",
            "Requests by how they ended: finish reason (stop, length, abort, "
            "error) or, when they did not finish, cancelled, deadline_exceeded or an error code",
            m + ["finish_reason"],
            registry=r,
        )
        self.kv_usage = Gauge(
            "slidespec:kv_usage",
            "KV pool use (0-1) as last reported by the replica",
            m + ["replica", "pool"],
            registry=r,
        )
        self.queue = Gauge(
            "slidespec:num_requests",
            "Requests running or waiting, as last reported by the replica",
            m + ["replica", "state"],
            registry=r,
        )
        self._recent: collections.deque[tuple[int, int]] = collections.deque(maxlen=RECENT_VERIFY_STEPS)

    def first_token(self, seconds: float) -> None:
        self.ttft.labels(self.model).observe(seconds)

    def next_tokens(self, seconds: float, tokens: int) -> None:
        if tokens:
            self.itl.labels(self.model).observe(seconds / tokens)

    def finished(self, update: dict[str, Any]) -> None:
        """A request's last response: its speculative statistics and its replica's load."""
        spec = update.get("spec")
        if spec and spec["verify_steps"]:
            num_steps = len(spec["accepted_per_position"])
            accepted = sum(spec["accept_lengths"]) - spec["verify_steps"]
            self.num_drafts.labels(self.model).inc(spec["verify_steps"])
            self.num_draft_tokens.labels(self.model).inc(spec["verify_steps"] * num_steps)
            self.num_accepted_tokens.labels(self.model).inc(accepted)
            for position, count in enumerate(spec["accepted_per_position"]):
                self.accepted_per_pos.labels(self.model, str(position)).inc(count)
            self._recent.extend((n, num_steps) for n in spec["accept_lengths"])
            self.accept_length.labels(self.model).set(sum(n for n, _ in self._recent) / len(self._recent))
            self.accept_rate.labels(self.model).set(
                sum(n - 1 for n, _ in self._recent) / sum(k for _, k in self._recent)
            )
        load = update.get("load")
        if load:
            self.load(load)

    def ended(self, reason: str) -> None:
        self.requests.labels(self.model, reason).inc()

    def load(self, load: dict[str, Any]) -> None:
        replica = load["replica"]
        for pool in ("full", "swa"):
            total = load.get(f"kv_{pool}_total", 0)
            self.kv_usage.labels(self.model, replica, pool).set(
                load.get(f"kv_{pool}_used", 0) / total if total else 0.0
            )
        for state in ("running", "waiting"):
            self.queue.labels(self.model, replica, state).set(load.get(state, 0))

    def exposition(self) -> bytes:
        return generate_latest(self.registry)
