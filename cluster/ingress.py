"""The ingress deployment: the gRPC API (and a JSON-lines HTTP route through Serve's proxy) in
front of the engine deployment.

Why a `grpc.aio` server inside a Serve deployment rather than Serve's own gRPC proxy: the API
needs TLS, a bearer-token interceptor, the standard health and reflection services, message
size limits and per-call cancellation, which Serve's proxy does not let an application
configure. Serve still owns the deployment: it starts, health-checks and replaces the ingress,
and requests reach engine replicas through a Serve handle and its request router.
"""

from __future__ import annotations

import asyncio
import importlib.metadata
import logging
import os
import uuid
from collections.abc import Mapping
from typing import Any

import prometheus_client
import ray
from grpc_health.v1 import health_pb2
from ray import serve
from ray.experimental import internal_kv
from ray.serve.handle import DeploymentHandle
from starlette.responses import JSONResponse, Response

from cluster.auth import DENIED, load_token
from cluster.config import AppArgs
from cluster.gateway import READY_POLL_S, Gateway
from cluster.grpc_server import SERVICE, GenerationService, start_server
from cluster.http_api import HttpApi, not_routed, unauthenticated
from cluster.http_routes import Match, match, relative_path
from cluster.metrics import ServingMetrics
from cluster.openai_api import OpenAIApi
from cluster.openai_api import error_response as openai_error
from cluster.openai_tools import tool_format
from cluster.protocol import PromptLimits, clipped
from cluster.rank_actor import rank0_replica, rank_actor_name
from cluster.replica_set import ReplicaSet
from cluster.routing.load_board import BOARD
from cluster.routing.policies import make_policy
from cluster.telemetry import RequestTelemetry
from cluster.tracing import flush_all, tracer_for
from workers.tokenizer import load_tokenizer

logger = logging.getLogger(__name__)

try:
    VERSION = importlib.metadata.version("slidespec")
except importlib.metadata.PackageNotFoundError:  # run from a checkout that was not installed
    VERSION = "unknown"

ENGINE_DEPLOYMENT = "LLMServer"
INGRESS_DEPLOYMENT = "GrpcIngress"
HANDOVER_S = 60.0  # at most this long a stopping ingress waits for its successor
METRICS_PORT_PATIENCE_S = int(HANDOVER_S)  # a taken metrics port is a warning after this long
KV_NAMESPACE = "slidespec"


def _engine_ran(app_name: str) -> bool:
    """Whether an ingress of this application has seen an engine replica run (kept in Ray's
    key-value store, so an ingress that replaces another knows a gap is a redeploy)."""
    return bool(internal_kv._internal_kv_exists(f"{app_name}/engine_ran", namespace=KV_NAMESPACE))


def _note_engine_ran(app_name: str) -> None:
    internal_kv._internal_kv_put(f"{app_name}/engine_ran", b"1", namespace=KV_NAMESPACE)


def _forget_engine_ran(app_name: str) -> None:
    try:
        internal_kv._internal_kv_del(f"{app_name}/engine_ran", namespace=KV_NAMESPACE)
    except Exception as exc:  # noqa: BLE001 - the cluster is going away too
        logger.info("could not clear %s's engine flag: %s", app_name, exc)


class GrpcIngress:
    async def __init__(self, llm: DeploymentHandle, args: dict[str, Any], context_length: int) -> None:
        """`context_length`: the replicas' (`cluster.app.served_context_length`), resolved where
        the application is built, so that this process loads no model code (nor torch)."""
        self.args = AppArgs(**args)
        self.llm = llm
        self.tokenizer = load_tokenizer(self.args.engine_args().engine_kwargs()["model"])
        self.running_replicas = 0
        self.model_name = os.path.basename(os.path.normpath(self.args.model))  # served name in spans and metrics
        self.tracer = tracer_for(self.args.tracing, "ingress")
        self.metrics = ServingMetrics(self.model_name)
        self.app_name = serve.get_replica_context().app_name
        policy_kwargs = self.args.router.policy_kwargs()
        policy = policy_kwargs.pop("policy")
        self.replicas = (
            ReplicaSet(
                self.app_name,
                f"ingress-{uuid.uuid4().hex[:8]}",
                self.tokenizer,
                make_policy(policy, **policy_kwargs),
                self.args.stream_interval,
                self.args.max_ongoing_requests,
                self.args.max_queued_requests,
                self.args.rank0_transport,
            )
            if self.args.direct_path
            else None
        )
        self.gateway = Gateway(
            llm,
            self.app_name,
            self.tokenizer,
            PromptLimits.of(context_length, self.tokenizer),
            self._ready,
            self.args.grpc.retries,
            self.args.grpc.retry_backoff_s,
            self.metrics,
            self.args.grpc.ready_wait_s,
            self.replicas,
        )
        self.gateway.was_ready = await asyncio.to_thread(_engine_ran, self.app_name)
        self._refreshed_at, self._refreshing = 0.0, asyncio.Lock()
        self.service = GenerationService(self.gateway, self._ready, self._model_info, self._loads, self._telemetry)
        self.http = HttpApi(self.gateway, self._telemetry, self.args.max_request_bytes)
        self.openai = OpenAIApi(
            self.gateway,
            self._telemetry,
            self.tokenizer,
            self.model_name,
            self.args.max_request_bytes,
            tool_format(self.args.tool_call_parser, getattr(self.tokenizer, "chat_template", None)),
        )
        self.token = load_token(self.args.grpc.auth_token_file)
        self.server, self.grpc_port, self.health = await start_server(self.service, self.args.grpc)
        self._watcher = asyncio.create_task(self._watch_replicas())
        self._metrics_server = asyncio.create_task(self._serve_metrics()) if self.args.metrics_port else None

    async def _serve_metrics(self) -> None:
        """The Prometheus port; during a redeploy the old ingress may hold it a while longer,
        so a taken port is tried again each second, and named as a warning once that has
        lasted longer than a handover (another process may hold it for good)."""
        waited = 0
        while True:
            try:
                prometheus_client.start_http_server(
                    self.args.metrics_port, addr="127.0.0.1", registry=self.metrics.registry
                )
                return
            except OSError as exc:
                log = logger.warning if waited == METRICS_PORT_PATIENCE_S else logger.info
                log("metrics_port %d is taken (%s); trying again each second", self.args.metrics_port, exc)
                waited += 1
                await asyncio.sleep(1.0)

    async def _watch_replicas(self) -> None:
        """Readiness: SERVING while the engine deployment has a running replica."""
        while True:
            await self._refresh_replicas()
            await asyncio.sleep(1.0)

    async def _refresh_replicas(self) -> None:
        """Ask Serve how many engine replicas run; concurrent callers share one question, and
        one asked within the last READY_POLL_S answers for it."""
        async with self._refreshing:
            if asyncio.get_running_loop().time() - self._refreshed_at < READY_POLL_S:
                return
            try:
                if self.replicas is not None:
                    await self.replicas.refresh()
                    self.running_replicas = len(self.replicas.ready)
                else:
                    status = await asyncio.to_thread(serve.status)
                    deployment = status.applications[self.app_name].deployments.get(ENGINE_DEPLOYMENT)
                    self.running_replicas = deployment.replica_states.get("RUNNING", 0) if deployment else 0
            except Exception as exc:  # noqa: BLE001 - keep the last known state; try again
                logger.warning("could not read the engine replicas' state: %s", exc)
            self._refreshed_at = asyncio.get_running_loop().time()
        if self.running_replicas and not self.gateway.was_ready:
            self.gateway.was_ready = True
            await asyncio.to_thread(_note_engine_ran, self.app_name)
        serving = (
            health_pb2.HealthCheckResponse.SERVING
            if self.running_replicas
            else health_pb2.HealthCheckResponse.NOT_SERVING
        )
        self.health.set(SERVICE, serving)

    async def _ready(self) -> bool:
        """Whether a replica runs; looks again before saying no (the watcher may lag)."""
        if not self._running():
            await self._refresh_replicas()
        return self._running() > 0

    def _running(self) -> int:
        """Replicas that take requests now (on the direct path: not set aside since the watcher
        last looked)."""
        return len(self.replicas.ready) if self.replicas is not None else self.running_replicas

    async def _loads(self) -> list[dict[str, Any]]:
        """Every engine replica's live load, asked of its rank-0 actor (a replica that does not
        answer within a second is left out)."""
        named = await asyncio.to_thread(ray.util.list_named_actors, True)
        replicas = [r for r in (rank0_replica(self.app_name, a["name"]) for a in named) if r is not None]

        async def one(replica: str) -> dict[str, Any] | None:
            try:
                actor = ray.get_actor(rank_actor_name(self.app_name, replica, 0))
                return {"replica": replica, **await asyncio.wait_for(actor.load.remote(), timeout=1.0)}
            except Exception:  # noqa: BLE001 - gone or going
                return None

        return [load for load in await asyncio.gather(*map(one, replicas)) if load is not None]

    def _telemetry(
        self, body: dict[str, Any], metadata: Mapping[str, str], server: tuple[str, int]
    ) -> RequestTelemetry:
        return RequestTelemetry(self.tracer, self.metrics, self.model_name, body, metadata, server)

    async def _model_info(self) -> dict[str, Any]:
        info = await self.llm.model_info.remote()
        return dict(
            model=self.model_name,
            architecture=info["architecture"],
            vocab_size=info["vocab_size"],
            context_length=info["context_length"],
            max_window=info["max_window"] or 0,
            tp_size=info["tp_size"],
            speculative_algorithm=info["speculative"] or "",
            num_replicas=self.running_replicas,
            routing_policy=self.args.router.policy,
        )

    async def ports(self) -> dict[str, int]:
        return {"grpc": self.grpc_port}

    async def stats(self) -> dict[str, Any]:
        """Replica loads as last reported, and how many attempts were retried elsewhere."""
        return {
            "loads": BOARD.snapshot(),
            "retried": self.gateway.retried,
            "running_replicas": self.running_replicas,
            "pending_decisions": len(BOARD.decisions),
        }

    async def __call__(self, request) -> Any:
        """HTTP through Serve's proxy: the route table (`cluster/http_routes.py`) says which
        handler answers; a path outside it is 404, another method 405. With a bearer token
        configured, every route but `/health` and `/version` needs it (`/metrics` unless
        `metrics_open`), as gRPC does."""
        path = relative_path(request.url.path, request.scope.get("root_path", ""))
        found = match(request.method, path)
        if found.route is None:
            return self._not_routed(found, request.method, path)
        route = found.route
        if (
            self.token is not None
            and (route.access == "token" or (route.access == "metrics" and not self.args.metrics_open))
            and not self.token.admits(request.headers.get("authorization"))
        ):
            if route.errors == "openai":
                return openai_error(401, DENIED, code="invalid_api_key")
            return unauthenticated()
        return await getattr(self, f"_http_{route.handler}")(request, **found.params)

    @staticmethod
    def _not_routed(found: Match, method: str, path: str) -> Response:
        if found.status == 405:
            message = f"method: {method} {path} is not allowed; it takes {', '.join(found.allowed)}"
        else:
            message = f"path: {clipped(path)} is not a route of this server"
        response = (
            openai_error(found.status, message, code="not_found" if found.status == 404 else "method_not_allowed")
            if found.errors == "openai"
            else not_routed(found.status, message)
        )
        if found.allowed:
            response.headers["Allow"] = ", ".join(found.allowed)
        return response

    async def _http_completions(self, request) -> Any:
        return await self.openai.completions(request, chat=False)

    async def _http_chat_completions(self, request) -> Any:
        return await self.openai.completions(request, chat=True)

    async def _http_models(self, request) -> Any:
        return self.openai.models()

    async def _http_model(self, request, model: str) -> Any:
        return self.openai.model(model)

    async def _http_generate(self, request) -> Any:
        return await self.http.generate(request)

    async def _http_metrics(self, request) -> Response:
        body, content_type = self.metrics.exposition(request.headers.get("accept"))
        return Response(body, media_type=content_type)

    async def _http_health(self, request) -> JSONResponse:
        """200 while an engine replica can take requests, 503 otherwise (load balancers and
        probes; a replica is RUNNING only once its engine has started: weights, kernels, graphs)."""
        ready = await self._ready()
        return JSONResponse(
            {"status": "ok" if ready else "unavailable", "replicas": self._running()}, status_code=200 if ready else 503
        )

    async def _http_version(self, request) -> JSONResponse:
        return JSONResponse({"version": VERSION})

    async def __del__(self) -> None:
        """Graceful stop (a redeploy, a scale-down, a deletion): say NOT_SERVING, keep taking calls
        until a successor ingress runs (it shares the gRPC port) or the application is going
        away, then stop taking calls and let the ones in flight finish."""
        self.health.set(SERVICE, health_pb2.HealthCheckResponse.NOT_SERVING)
        await self._hand_over()
        self._watcher.cancel()
        if self._metrics_server is not None:
            self._metrics_server.cancel()
        await self.server.stop(grace=self.args.graceful_shutdown_timeout_s)
        if self.replicas is not None:
            self.replicas.close()
        flush_all()

    async def _hand_over(self) -> None:
        """Wait for a successor; when the application is going away, forget that its engine ran
        (an application deployed later under the same name starts afresh)."""
        deadline = asyncio.get_running_loop().time() + HANDOVER_S
        while asyncio.get_running_loop().time() < deadline:
            try:
                status = await asyncio.wait_for(asyncio.to_thread(serve.status), timeout=2.0)
                app = status.applications.get(self.app_name)
            except Exception:  # noqa: BLE001 - Serve itself is going away (or too busy to say)
                app = None
            if app is None or app.status == "DELETING":
                await asyncio.to_thread(_forget_engine_ran, self.app_name)
                return
            ingress = app.deployments.get(INGRESS_DEPLOYMENT)
            if ingress is None or ingress.replica_states.get("RUNNING"):
                return
            await asyncio.sleep(READY_POLL_S)
