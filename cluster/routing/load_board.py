"""Per-replica load as seen from the ingress process: requests routed and not finished, and what
each replica reported with its responses (or its polled routing stats).

The Serve request router and the gRPC ingress run in the same process; they share the board:
the router adds a request when it routes it, the ingress removes it when its last response
arrives, with the replica's load snapshot that response carried. No polling needed.
"""

from __future__ import annotations

import threading
from typing import Any

from cluster.routing.policies import Decision, Policy, RouteRequest


class LoadBoard:
    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._in_flight: dict[str, tuple[str, int]] = {}  # request id -> (replica, token cost)
        self._reported: dict[str, dict[str, Any]] = {}  # replica -> its last load snapshot
        self.decisions: dict[str, tuple[Decision, list[str], str]] = {}  # request id -> (decision, candidates, chosen)

    def routed(
        self, request: RouteRequest, replica: str, decision: Decision | None = None, candidates: list[str] | None = None
    ) -> None:
        with self._lock:
            self._in_flight[request.request_id] = (replica, request.cost)
            if decision is not None:
                self.decisions[request.request_id] = (decision, candidates or [], replica)

    def finished(self, request_id: str, replica_load: dict[str, Any] | None = None) -> None:
        with self._lock:
            self._in_flight.pop(request_id, None)
            if replica_load and "replica" in replica_load:
                self._reported[replica_load["replica"]] = dict(replica_load)

    def replica_of(self, request_id: str) -> str | None:
        """The replica a live request was routed to, if it was."""
        with self._lock:
            entry = self._in_flight.get(request_id)
            return entry[0] if entry else None

    def report(self, replica: str, load: dict[str, Any]) -> None:
        with self._lock:
            self._reported[replica] = dict(load)

    def forget(self, replica: str) -> None:
        with self._lock:
            self._reported.pop(replica, None)
            self._in_flight = {rid: v for rid, v in self._in_flight.items() if v[0] != replica}

    def choose(self, policy: Policy, request: RouteRequest, candidates: list[str]) -> Decision:
        """The policy's ranking of `candidates` (a retry avoids the replicas that failed it,
        unless none is left) by their loads on this board; recorded until the request ends. A
        choice that follows another of its prompt goes where that one went, where it may: that
        replica prefills the prompt once for both."""
        allowed = sorted(r for r in candidates if r not in request.exclude) or sorted(candidates)
        leader = self.replica_of(request.follows) if request.follows else None
        if leader in allowed:
            ranked = [leader, *(r for r in allowed if r != leader)]
            decision = Decision(ranked, policy.name, reason="with the choice it follows")
        else:
            decision = policy.choose(request, allowed, self.token_loads(allowed))
        self.decide(request.request_id, decision, allowed)
        return decision

    def note_routed(self, policy: Policy, request: RouteRequest, replica: str) -> None:
        """The request went to `replica`: the policy learns it, the board counts its tokens."""
        policy.on_routed(request, replica)
        decision = self.decisions.get(request.request_id)
        self.routed(request, replica, decision[0] if decision else None, decision[1] if decision else None)

    def decide(self, request_id: str, decision: Decision, candidates: list[str]) -> None:
        """The router's choice for a request, until its span is written or the request ends."""
        with self._lock:
            self.decisions[request_id] = (decision, candidates, decision.ranked[0])

    def pop_decision(self, request_id: str) -> tuple[Decision, list[str], str] | None:
        with self._lock:
            return self.decisions.pop(request_id, None)

    def token_loads(self, replicas: list[str]) -> dict[str, float]:
        """Tokens in flight per replica: routed here and unfinished, or the replica's own report
        (which also counts other clients), whichever is larger."""
        with self._lock:
            local = {r: 0.0 for r in replicas}
            for replica, cost in self._in_flight.values():
                if replica in local:
                    local[replica] += cost
            return {r: max(local[r], float(self._reported.get(r, {}).get("token_load", 0))) for r in replicas}

    def snapshot(self) -> dict[str, dict[str, Any]]:
        with self._lock:
            return {r: dict(v) for r, v in self._reported.items()}


BOARD = LoadBoard()  # the process's board: shared by the request router and the ingress
