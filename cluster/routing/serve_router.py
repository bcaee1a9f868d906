"""The routing policies as a Ray Serve request router of the engine deployment.

Serve calls `choose_replicas` for every request sent through a handle of the deployment; the
policy ranks the replicas (Serve still skips a replica whose queue is full and falls back to
the next). Loads come from the process's `LoadBoard`: requests routed here and not completed
(`on_request_routed` / `on_request_completed`) and the load snapshots that replicas send back with
their responses or through `record_routing_stats`.

Configured per deployment: `RequestRouterConfig(request_router_class=
"cluster.routing.serve_router:SlidespecRequestRouter", request_router_kwargs={"policy": ...})`.
Serve pickles this module by value; the board is reached through its module (pickled by
reference) so that the router and the ingress share the process's one board.
"""

from __future__ import annotations

from typing import Any

from ray.serve.request_router import FIFOMixin, PendingRequest, ReplicaID, RequestRouter, RunningReplica

from cluster.routing import load_board
from cluster.routing.policies import Policy, RouteRequest, make_policy

ROUTED_METHOD = "generate"  # other methods (load, model info) go to any replica


def route_request(body: dict[str, Any]) -> RouteRequest:
    sampling = body.get("sampling") or {}
    return RouteRequest(
        str(body.get("request_id", "")),
        body.get("prompt_token_ids") or [],
        int(sampling.get("max_new_tokens", 128)),
        str(body.get("session_id") or ""),
        frozenset(body.get("exclude_replicas") or ()),
        str(body.get("follows") or ""),
    )


class SlidespecRequestRouter(FIFOMixin, RequestRouter):
    def initialize_state(self, policy: str = "power_of_two", **params: Any) -> None:
        self.policy: Policy = make_policy(policy, **params)
        self._requests: dict[str, RouteRequest] = {}  # Serve's internal request id -> request

    async def choose_replicas(
        self, candidate_replicas: list[RunningReplica], pending_request: PendingRequest | None = None
    ) -> list[list[RunningReplica]]:
        request = self._route_request(pending_request)
        if request is None or not candidate_replicas:
            return [candidate_replicas]
        by_id = {r.replica_id.unique_id: r for r in candidate_replicas}
        for replica in candidate_replicas:
            if replica.routing_stats:
                load_board.BOARD.report(replica.replica_id.unique_id, replica.routing_stats)
        decision = load_board.BOARD.choose(self.policy, request, list(by_id))
        return [[by_id[r]] for r in decision.ranked]

    def on_request_routed(self, pending_request: PendingRequest, replica_id: ReplicaID, result: Any) -> None:
        request = self._route_request(pending_request)
        if request is None:
            return
        load_board.BOARD.note_routed(self.policy, request, replica_id.unique_id)
        self._requests[pending_request.metadata.internal_request_id] = request

    def on_request_completed(self, replica_id: ReplicaID, internal_request_id: str) -> None:
        request = self._requests.pop(internal_request_id, None)
        if request is not None:
            load_board.BOARD.finished(request.request_id)

    def on_replica_actor_died(self, replica_id: ReplicaID) -> None:
        super().on_replica_actor_died(replica_id)
        self.policy.on_replica_removed(replica_id.unique_id)
        load_board.BOARD.forget(replica_id.unique_id)

    @staticmethod
    def _route_request(pending_request: PendingRequest | None) -> RouteRequest | None:
        if pending_request is None or pending_request.metadata.call_method != ROUTED_METHOD or not pending_request.args:
            return None
        body = pending_request.args[0]
        return route_request(body) if isinstance(body, dict) else None
