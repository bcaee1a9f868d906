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
import json
import logging
import os
import uuid
from typing import Any

from ray import serve
from ray.serve.handle import DeploymentHandle

import prometheus_client
from grpc_health.v1 import health_pb2

from cluster.config import AppArgs
from cluster.grpc_server import SERVICE, GenerationService, start_server, unwrap
from cluster.metrics import ServingMetrics
from cluster.routing.load_board import BOARD
from cluster.telemetry import RequestTelemetry
from cluster.tracing import flush_all, tracer_for
from workers.tokenizer import load_tokenizer

logger = logging.getLogger(__name__)

ENGINE_DEPLOYMENT = "LLMServer"


class GrpcIngress:
    async def __init__(self, llm: DeploymentHandle, args: dict[str, Any]) -> None:
        self.args = AppArgs(**args)
        self.llm = llm
        model = self.args.engine_args().engine_kwargs()["model"]
        self.tokenizer = load_tokenizer(model)
        tokenize = self.tokenizer.encode if self.tokenizer is not None else None
        self.running_replicas = 0
        self.model_name = os.path.basename(os.path.normpath(self.args.model))  # served name in spans and metrics
        self.tracer = tracer_for(self.args.tracing, "ingress")
        self.metrics = ServingMetrics(self.model_name)
        if self.args.metrics_port is not None:
            prometheus_client.start_http_server(self.args.metrics_port, addr="127.0.0.1", registry=self.metrics.registry)
        self.app_name = serve.get_replica_context().app_name
        self.service = GenerationService(llm, self.args.grpc, tokenize, self._ready, self._model_info, self._telemetry)
        self.server, self.grpc_port, self.health = await start_server(self.service, self.args.grpc)
        self._watcher = asyncio.create_task(self._watch_replicas())

    async def _watch_replicas(self) -> None:
        """Readiness: SERVING while the engine deployment has a running replica."""
        while True:
            await self._refresh_replicas()
            await asyncio.sleep(1.0)

    async def _refresh_replicas(self) -> None:
        try:
            status = await asyncio.to_thread(serve.status)
            deployment = status.applications[self.app_name].deployments.get(ENGINE_DEPLOYMENT)
            self.running_replicas = deployment.replica_states.get("RUNNING", 0) if deployment else 0
        except Exception as exc:  # noqa: BLE001 - keep the last known state; try again
            logger.warning("could not read the engine deployment's status: %s", exc)
        serving = health_pb2.HealthCheckResponse.SERVING if self.running_replicas else health_pb2.HealthCheckResponse.NOT_SERVING
        self.health.set(SERVICE, serving)

    async def _ready(self) -> bool:
        """Whether a replica runs; asks Serve again before saying no (the watcher may lag)."""
        if not self.running_replicas:
            await self._refresh_replicas()
        return self.running_replicas > 0

    def _telemetry(self, body: dict[str, Any], metadata: dict[str, str]) -> RequestTelemetry:
        return RequestTelemetry(self.tracer, self.metrics, self.model_name, body, metadata)

    async def _model_info(self) -> dict[str, Any]:
        info = await self.llm.model_info.remote()
        return dict(model=self.model_name, architecture=info["architecture"], vocab_size=info["vocab_size"],
                    context_length=info["context_length"], max_window=info["max_window"] or 0,
                    tp_size=info["tp_size"], speculative_algorithm=info["speculative"] or "",
                    num_replicas=self.running_replicas, routing_policy=self.args.router.policy)

    async def ports(self) -> dict[str, int]:
        return {"grpc": self.grpc_port}

    async def stats(self) -> dict[str, Any]:
        """Replica loads as last reported, and how many attempts were retried elsewhere."""
        return {"loads": BOARD.snapshot(), "retried": self.service.retried, "running_replicas": self.running_replicas,
                "pending_decisions": len(BOARD.decisions)}

    async def __call__(self, request) -> Any:
        """HTTP: POST a JSON request ({"prompt" | "prompt_token_ids", "sampling", "session_id"});
        the answer streams back as JSON lines; a bad request gets 400 naming the field."""
        from starlette.responses import JSONResponse, Response, StreamingResponse

        if request.method == "GET" and request.url.path.rstrip("/").endswith("/metrics"):
            return Response(self.metrics.exposition(), media_type=prometheus_client.CONTENT_TYPE_LATEST)
        body: Any = None
        try:
            body = await request.json()
            if not isinstance(body, dict):
                raise ValueError("request: must be a JSON object")
            if isinstance(body.get("prompt"), str) and self.tokenizer is not None:
                body["prompt_token_ids"] = self.tokenizer.encode(body.pop("prompt"))
            body.setdefault("request_id", uuid.uuid4().hex)  # the router's load accounting keys on it
            updates = self.llm.options(stream=True).generate.remote(body)
            first = await updates.__anext__()
        except Exception as exc:  # noqa: BLE001 - bad input is a 400; anything else a 503
            cause = unwrap(exc)
            status = 400 if isinstance(cause, ValueError) else 503
            if isinstance(body, dict):
                BOARD.pop_decision(str(body.get("request_id", "")))
            return JSONResponse({"error": str(cause)}, status_code=status)

        async def lines():
            yield json.dumps(first) + "\n"
            try:
                async for update in updates:
                    yield json.dumps(update) + "\n"
            except Exception as exc:  # noqa: BLE001 - the stream has started: report in band
                yield json.dumps({"error": str(unwrap(exc))}) + "\n"
            finally:
                BOARD.pop_decision(body["request_id"])

        return StreamingResponse(lines(), media_type="application/x-ndjson")

    async def __del__(self) -> None:
        self._watcher.cancel()
        await self.server.stop(grace=5)
        flush_all()
