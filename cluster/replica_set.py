"""The engine replicas as the ingress streams to them directly: each replica's rank-0 actor
(found by its Ray name), one `RankClient` each, admission and the routing policy's choice.

Why not through the Serve handle: a handle call and the replica actor's relay cost two Ray hops
each way (about 5 ms of a request's first token on an H200, and a busy core at load). Serve still
owns the replicas (it starts, health-checks, replaces and drains them); the ingress only finds
their rank-0 actors and admits requests as Serve would: at most `max_ongoing_requests` a
replica, at most `max_queued_requests` waiting here for one, RESOURCE_EXHAUSTED past that.
A replica that refuses work (it is draining) or fails is set aside until it answers a ping again.
"""

from __future__ import annotations

import asyncio
import logging
from typing import Any

import ray

from cluster.rank_actor import rank0_replica
from cluster.rank_client import RankClient, Transport, unwrap
from cluster.routing.load_board import BOARD
from cluster.routing.policies import Policy, RouteRequest

logger = logging.getLogger(__name__)

PING_TIMEOUT_S = 2.0


class QueueFull(Exception):
    """Every replica is at `max_ongoing_requests` and `max_queued_requests` already wait."""


class ReplicaSet:
    def __init__(
        self,
        app_name: str,
        reader: str,
        tokenizer,
        policy: Policy,
        stream_interval: int,
        max_ongoing_requests: int,
        max_queued_requests: int,
        transport: Transport,
    ) -> None:
        self.app_name = app_name
        self.reader = reader
        self.tokenizer = tokenizer
        self.policy = policy
        self.stream_interval = stream_interval
        self.max_ongoing_requests = max_ongoing_requests
        self.max_queued_requests = max_queued_requests
        self.transport = transport
        self.clients: dict[str, RankClient] = {}  # replica -> its rank 0
        self.set_aside: set[str] = set()  # draining or failing: not chosen until a ping says otherwise
        self._freed = asyncio.Event()  # a request ended or a replica joined
        self._waiting = 0

    @property
    def ready(self) -> list[str]:
        return sorted(r for r in self.clients if r not in self.set_aside)

    async def refresh(self) -> None:
        """Find this application's rank-0 actors and ping each: a new one joins once it answers
        (set up, not draining); one set aside comes back when it does; one that is dead (a call
        to it fails at once, say its node is gone) fails its requests now, before Ray tears
        down their streams (which waits for the cluster to declare the node dead); a gone one
        leaves."""
        named = await asyncio.to_thread(ray.util.list_named_actors, True)
        found = {}
        for entry in named:
            replica = rank0_replica(self.app_name, entry["name"])
            if replica is not None:
                found[replica] = entry
        for gone in set(self.clients) - set(found):
            self._remove(gone)
        answers = await asyncio.gather(*(self._ping(r, found[r]) for r in found))
        for replica, (actor, state) in zip(found, answers, strict=True):
            client = self.clients.get(replica)
            if state == "dead" and client is not None:
                self._remove(replica, RuntimeError(f"rank 0 of replica {replica} is dead"))
            elif state != "up":
                if client is not None:
                    self.set_aside.add(replica)
            else:
                if client is None:
                    self.clients[replica] = RankClient(
                        actor, replica, self.reader, self.tokenizer, self.stream_interval, transport=self.transport
                    )
                    logger.info("replica %s joined the ingress's direct path", replica)
                self.set_aside.discard(replica)
        self._freed.set()

    async def _ping(self, replica: str, entry: dict[str, Any]) -> tuple[Any, str]:
        """(its rank-0 actor, "up" | "draining" | "silent" | "dead"); a known replica is pinged
        through the handle its client holds, a new one looked up by name first."""
        try:
            client = self.clients.get(replica)
            actor = (
                client.rank0
                if client is not None
                else await asyncio.to_thread(ray.get_actor, entry["name"], entry.get("namespace"))
            )
            info = await asyncio.wait_for(actor.ping.remote(), timeout=PING_TIMEOUT_S)
        except (ray.exceptions.RayActorError, ray.exceptions.ActorUnavailableError) as exc:
            logger.warning("replica %s: rank 0 is dead: %s", replica, unwrap(exc))
            return None, "dead"
        except Exception as exc:  # noqa: BLE001 - not set up yet, busy, or going
            logger.debug("replica %s does not answer yet: %s", replica, unwrap(exc))
            return None, "silent"
        return actor, "draining" if info.get("draining") else "up"

    def _remove(self, replica: str, why: BaseException | None = None) -> None:
        client = self.clients.pop(replica)
        self.set_aside.discard(replica)
        client.close(why or RuntimeError(f"replica {replica} is gone"))
        self.policy.on_replica_removed(replica)
        BOARD.forget(replica)
        logger.info("replica %s left the ingress's direct path", replica)

    def set_replica_aside(self, replica: str) -> None:
        """It refused or failed a request: choose others until it answers a ping again."""
        if replica in self.clients:
            self.set_aside.add(replica)

    async def acquire(self, request: RouteRequest) -> RankClient:
        """The replica the policy ranks first among those with room; waits for room while fewer
        than `max_queued_requests` wait. Raises QueueFull, or LookupError when no replica is
        ready (the caller waits for one first)."""
        while True:
            ready = self.ready
            if not ready:
                raise LookupError("no healthy replica of the engine deployment")
            room = [r for r in ready if len(self.clients[r]) < self.max_ongoing_requests]
            if room:
                decision = BOARD.choose(self.policy, request, room)
                replica = decision.ranked[0]
                BOARD.note_routed(self.policy, request, replica)
                return self.clients[replica]
            if self._waiting >= self.max_queued_requests:
                raise QueueFull("the engine deployment's request queue is full; retry later")
            self._waiting += 1
            self._freed.clear()
            try:
                await self._freed.wait()
            finally:
                self._waiting -= 1

    def release(self) -> None:
        """A request left its replica: one waiting may go."""
        self._freed.set()

    def close(self) -> None:
        for client in self.clients.values():
            client.close(RuntimeError("the ingress is stopping"))
