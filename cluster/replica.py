"""The Serve deployment of one engine replica: a tensor-parallel group of rank actors.

Each replica runs in its own placement group (Serve's `placement_group_bundles`: bundle 0 for
the replica actor, one bundle per rank), starts its rank actors in that group, wires their
process group and streams requests through rank 0. Its health check fails when any rank actor
or rank loop is gone, so Serve replaces the replica; requests in flight then end with an error.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import logging
import uuid
from collections.abc import AsyncIterator
from typing import Any

import ray
from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

from cluster.config import AppArgs
from cluster.protocol import InvalidRequest, PromptLimits, RoutedBody, parse_request
from cluster.rank_actor import REPLICA_READER, RankActor, error_update, rank_actor_name
from cluster.rank_client import RankClient, unwrap
from workers.error_codes import ErrorCode
from workers.sampling_params import SamplingParams
from workers.tokenizer import load_tokenizer

logger = logging.getLogger(__name__)


class LLMServer:
    """One replica. Methods are called through Serve deployment handles (and HTTP)."""

    def __init__(self, args: dict[str, Any]) -> None:
        self.args = AppArgs(**args)
        self.engine_kwargs = self.args.engine_args().engine_kwargs()
        app, replica = _serve_ids()
        self.replica_tag = replica or uuid.uuid4().hex[:8]
        self._ids = itertools.count()
        self.tokenizer = load_tokenizer(self.engine_kwargs["model"])
        pg = ray.util.get_current_placement_group()
        actor_cls = ray.remote(RankActor)
        bundle = self.args.rank_bundles()[0]
        self.ranks = []
        for rank in range(self.args.tp_size):
            strategy = PlacementGroupSchedulingStrategy(pg, placement_group_bundle_index=rank + 1) if pg else None
            self.ranks.append(
                actor_cls.options(
                    num_cpus=bundle["CPU"],
                    num_gpus=bundle.get("GPU", 0),
                    scheduling_strategy=strategy,
                    name=rank_actor_name(app, self.replica_tag, rank),
                    max_concurrency=1000,
                ).remote(
                    rank,
                    self.args.tp_size,
                    self.engine_kwargs,
                    self.args.torch_threads_per_rank,
                    tracing=self.args.tracing.model_dump(),
                    stall_timeout_s=self.args.stall_timeout_s,
                )
            )
        addr, port = ray.get(self.ranks[0].address.remote())
        self.info = ray.get([a.setup.remote(addr, port) for a in self.ranks])[0]
        self.limits = PromptLimits.of(self.info["context_length"], self.tokenizer)
        self.client = RankClient(
            self.ranks[0],
            self.replica_tag,
            REPLICA_READER,
            self.tokenizer,
            self.args.stream_interval,
            transport=self.args.rank0_transport,
        )
        logger.info("replica %s: %d rank(s) up: %s", self.replica_tag, len(self.ranks), self.info)

    # -- requests ------------------------------------------------------------------------------
    async def generate(self, body: dict[str, Any]) -> AsyncIterator[dict[str, Any]]:
        """Stream a request for a Serve handle caller (`cluster/rank_client.py` says what the
        updates hold). Invalid input is answered with an error update, never raised (it is not
        a fault of the replica)."""
        try:
            rid, prompt_ids, sampling, stop = await self._parse(body)
        except ValueError as exc:
            yield {**error_update(ErrorCode.INVALID_ARGUMENT, str(exc)), "replica": self.replica_tag}
            return
        stream = self.client.generate(rid, prompt_ids, sampling, stop, body.get("trace_context"), body.get("follows"))
        async with contextlib.aclosing(stream) as updates:  # the id is free again only once it ends
            async for update in updates:
                yield update

    async def _parse(self, body: dict[str, Any]) -> tuple[str, list[int], SamplingParams, list[str]]:
        """(request id, prompt token ids, sampling params, stop strings); ValueError names the
        field (an id this replica is running is one). The ingress has validated and tokenized
        already; direct handle callers may send text, tokenized here off the event loop."""
        parsed = parse_request(body, RoutedBody)
        if parsed.body.sampling.n != 1:  # the ingress sends each choice as a request of its own
            raise InvalidRequest(f"sampling.n: send each choice as a request (n 1), got {parsed.body.sampling.n}")
        if parsed.stop and self.tokenizer is None:
            raise InvalidRequest("sampling.stop: stop strings need a tokenizer; use stop_token_ids")
        ids = parsed.body.prompt_token_ids
        if ids is None:
            if self.tokenizer is None:
                raise InvalidRequest("prompt: this model has no tokenizer; send prompt_token_ids")
            self.limits.check_text(parsed.body.prompt)
            ids = await asyncio.to_thread(self.tokenizer.encode, parsed.body.prompt)
        rid = parsed.request_id or f"{self.replica_tag}-{next(self._ids)}"
        if rid in self.client:
            raise InvalidRequest(f"request_id: {rid!r} is already in use")
        return rid, list(ids), parsed.sampling, parsed.stop

    async def abort(self, rid: str) -> None:
        await self.ranks[0].abort.remote(rid)

    async def load(self) -> dict[str, Any]:
        return {"replica": self.replica_tag, **await self.ranks[0].load.remote()}

    async def model_info(self) -> dict[str, Any]:
        return {"replica": self.replica_tag, "tp_size": self.args.tp_size, **self.info}

    async def kv_check(self) -> list[dict[str, int]]:
        """Every rank's pools are back at their initial free counts (raises otherwise)."""
        return await asyncio.gather(*[a.kv_check.remote() for a in self.ranks])

    # -- Serve hooks ---------------------------------------------------------------------------
    async def check_health(self) -> None:
        """Fails when a rank actor died, a rank loop stopped or a step stalled; Serve then
        replaces the replica. A dead or stalled rank leaves the others waiting in a collective
        until its timeout: the replica kills them at once, so that requests in flight end now
        (UNAVAILABLE) rather than when the collective gives up."""
        try:
            await asyncio.wait_for(
                asyncio.gather(*[a.ping.remote() for a in self.ranks]), timeout=self.args.health_check_timeout_s
            )
        except ray.exceptions.RayError as exc:
            logger.error("replica %s: a rank failed (%s); stopping the ranks", self.replica_tag, unwrap(exc))
            for actor in self.ranks:
                ray.kill(actor, no_restart=True)
            raise

    async def record_routing_stats(self) -> dict[str, Any]:
        return await self.load()

    def __del__(self) -> None:
        """Serve drained the replica's handle calls: let the requests the ingress sent to rank 0
        directly finish (rank 0 refuses new ones, which the ingress retries elsewhere), stop the
        rank loops, then make sure the actors are gone."""
        ranks = getattr(self, "ranks", [])
        try:
            if ranks:
                left = ray.get(ranks[0].drain.remote(self.args.graceful_shutdown_timeout_s))
                if left:
                    logger.warning("replica %s: stopping with %d request(s) still running", self.replica_tag, left)
            ray.get([a.shutdown.remote() for a in ranks], timeout=30)
        except Exception as exc:  # noqa: BLE001 - a dead rank cannot shut down; kill what is left
            logger.warning("replica %s: rank shutdown failed (%s); killing the rank actors", self.replica_tag, exc)
        for actor in ranks:
            ray.kill(actor, no_restart=True)


def _serve_ids() -> tuple[str, str | None]:
    """(application name, this replica's id as the request router knows it); outside Serve
    ("local", None). Rank actors are named slidespec-<app>-<replica>-rank<r>."""
    try:
        from ray import serve

        context = serve.get_replica_context()
        return context.app_name, context.replica_id.unique_id
    except Exception:  # noqa: BLE001 - not running inside a Serve replica
        return "local", None
