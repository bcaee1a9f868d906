"""The `slidespec.v1.Generation` gRPC service, with standard health, reflection, TLS and
bearer-token authentication. It runs on a `grpc.aio` server inside the ingress deployment and
sends every request through a Serve handle of the engine deployment, whose request router
picks the replica.

Status codes: invalid arguments (including a prompt longer than the context) INVALID_ARGUMENT
naming the field; the deployment's queue full RESOURCE_EXHAUSTED; no healthy replica, or a
replica failing after tokens were sent, UNAVAILABLE (before the first token the request is
retried on another replica, with backoff); a missing or wrong token UNAUTHENTICATED; the
client's deadline DEADLINE_EXCEEDED. A cancelled call aborts its request, which frees its KV at
the replica's next step.
"""

from __future__ import annotations

import asyncio
import logging
import uuid
from typing import Any, AsyncIterator, Awaitable, Callable, Mapping

import grpc
import ray
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection
from ray.serve.exceptions import BackPressureError, RequestCancelledError

from cluster.config import GrpcArgs
from cluster.proto.slidespec.v1 import generation_pb2 as pb
from cluster.replica import RequestError
from cluster.proto.slidespec.v1 import generation_pb2_grpc as pb_grpc
from cluster.routing.load_board import BOARD
from cluster.telemetry import RequestTelemetry

logger = logging.getLogger(__name__)

SERVICE = pb.DESCRIPTOR.services_by_name["Generation"].full_name
FINISH_REASONS = {"stop": pb.FINISH_REASON_STOP, "length": pb.FINISH_REASON_LENGTH, "abort": pb.FINISH_REASON_ABORT}
SAMPLING_FIELDS = ("temperature", "top_p", "top_k", "max_new_tokens", "seed", "ignore_eos")
UNAUTHENTICATED_METHODS = ("/grpc.health.v1.Health/", "/grpc.reflection.")


class InvalidArgument(ValueError):
    pass


def request_to_body(request: pb.GenerateRequest, tokenize: Callable[[str], list[int]] | None) -> dict[str, Any]:
    """The engine deployment's request dict. Text is tokenized here so the router sees tokens."""
    which = request.WhichOneof("input")
    if which is None:
        raise InvalidArgument("prompt / prompt_token_ids: give one of them")
    if which == "prompt":
        if tokenize is None:
            raise InvalidArgument("prompt: this model has no tokenizer; send prompt_token_ids")
        ids = tokenize(request.prompt)
    else:
        ids = list(request.prompt_token_ids.ids)
    s = request.sampling
    sampling: dict[str, Any] = {name: getattr(s, name) for name in SAMPLING_FIELDS if s.HasField(name)}
    if s.stop:
        sampling["stop"] = list(s.stop)
    if s.stop_token_ids:
        sampling["stop_token_ids"] = list(s.stop_token_ids)
    body = {"request_id": request.request_id or uuid.uuid4().hex, "prompt_token_ids": ids, "sampling": sampling}
    if request.session_id:
        body["session_id"] = request.session_id
    return body


def update_to_response(update: dict[str, Any]) -> pb.GenerateResponse:
    response = pb.GenerateResponse(request_id=update.get("request_id", ""), token_ids=update["token_ids"],
                                   text=update.get("text", ""), finished=update["finished"],
                                   replica=update.get("replica", ""))
    if update["finished"]:
        response.finish_reason = FINISH_REASONS.get(update.get("finish_reason"), pb.FINISH_REASON_UNSPECIFIED)
        response.usage.prompt_tokens = update.get("prompt_tokens", 0)
        response.usage.completion_tokens = update.get("completion_tokens", 0)
        spec = update.get("spec")
        if spec:
            response.spec.CopyFrom(pb.SpecStats(verify_steps=spec["verify_steps"], mean_accept_length=spec["mean_accept_length"],
                                                accepted_per_position=spec["accepted_per_position"],
                                                accept_lengths=spec["accept_lengths"]))
    return response


def merge_responses(responses: list[pb.GenerateResponse]) -> pb.GenerateResponse:
    """The single response of a non-streaming call: every token, the whole text, the end."""
    merged = pb.GenerateResponse()
    merged.CopyFrom(responses[-1])
    del merged.token_ids[:]
    merged.token_ids.extend(t for r in responses for t in r.token_ids)
    merged.text = "".join(r.text for r in responses)
    return merged


def unwrap(exc: BaseException) -> BaseException:
    """The exception a Ray task raised, without Ray's wrapper (and its remote traceback)."""
    return getattr(exc, "cause", None) or exc


class GenerationService(pb_grpc.GenerationServicer):
    def __init__(self, llm, args: GrpcArgs, tokenize: Callable[[str], list[int]] | None,
                 ready: Callable[[], Awaitable[bool]], model_info: Callable[[], Awaitable[dict[str, Any]]],
                 telemetry: Callable[[dict[str, Any], Mapping[str, str]], RequestTelemetry]) -> None:
        """`telemetry(body, call metadata)` starts a request's span and metrics."""
        self.llm = llm
        self.args = args
        self.tokenize = tokenize
        self.ready = ready
        self.model_info = model_info
        self.telemetry = telemetry
        self._calls: dict[str, Any] = {}  # request id -> the Serve response being streamed
        self._aborted: set[str] = set()
        self.retried = 0  # attempts repeated on another replica

    async def Generate(self, request: pb.GenerateRequest, context: grpc.aio.ServicerContext) -> AsyncIterator[pb.GenerateResponse]:
        try:
            body = request_to_body(request, self.tokenize)
        except ValueError as exc:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(exc))
        if body["request_id"] in self._calls:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, f"request_id: {body['request_id']!r} is already in use")
        telemetry = self.telemetry(body, dict(context.invocation_metadata() or ()))
        stream = not request.HasField("stream") or request.stream
        error = None
        try:
            if stream:
                async for response in self._attempts(body, context, telemetry):
                    yield response
            else:
                collected = [response async for response in self._attempts(body, context, telemetry)]
                if collected:
                    yield merge_responses(collected)
        except BaseException as exc:
            error = f"{type(exc).__name__}: {exc}"
            raise
        finally:
            telemetry.end(error)

    async def _attempts(self, body: dict[str, Any], context: grpc.aio.ServicerContext,
                        telemetry: RequestTelemetry) -> AsyncIterator[pb.GenerateResponse]:
        """The request's responses, retried on another replica while nothing was sent."""
        rid, sent = body["request_id"], 0
        for attempt in range(self.args.retries + 1):
            if not await self.ready():
                await context.abort(grpc.StatusCode.UNAVAILABLE, "no healthy replica of the engine deployment")
            call = self.llm.options(stream=True).generate.remote(body)
            self._calls[rid] = call
            try:
                async for update in call:
                    telemetry.update(update)
                    if update["finished"]:
                        BOARD.finished(rid, update.get("load"))
                    sent += 1
                    yield update_to_response(update)
                return
            except (asyncio.CancelledError, RequestCancelledError):
                call.cancel()
                if rid in self._aborted:  # the Abort RPC cancelled it: end the stream normally
                    yield pb.GenerateResponse(request_id=rid, finished=True, finish_reason=pb.FINISH_REASON_ABORT)
                    return
                raise
            except Exception as exc:  # noqa: BLE001 - mapped to a status code below
                code, message = self._status(exc)
                if not (code is grpc.StatusCode.UNAVAILABLE and sent == 0 and attempt < self.args.retries):
                    await context.abort(code, message)
                decision = BOARD.pop_decision(rid)
                if decision is not None:  # try another replica than the one that failed
                    body["exclude_replicas"] = sorted({*body.get("exclude_replicas", ()), decision[2]})
                self.retried += 1
                logger.warning("request %s failed before its first token (%s); retrying", rid, message)
                await asyncio.sleep(self.args.retry_backoff_s * 2**attempt)
            finally:
                self._calls.pop(rid, None)
                self._aborted.discard(rid)

    @staticmethod
    def _status(exc: BaseException) -> tuple[grpc.StatusCode, str]:
        cause = unwrap(exc)
        if isinstance(cause, ValueError):
            return grpc.StatusCode.INVALID_ARGUMENT, str(cause)
        if isinstance(exc, BackPressureError) or isinstance(cause, BackPressureError):
            return grpc.StatusCode.RESOURCE_EXHAUSTED, "the engine deployment's request queue is full; retry later"
        if isinstance(cause, (ray.exceptions.RayActorError, ray.exceptions.ActorUnavailableError, RequestError)):
            return grpc.StatusCode.UNAVAILABLE, f"a replica failed: {cause}"
        return grpc.StatusCode.INTERNAL, f"{type(cause).__name__}: {cause}"

    async def Abort(self, request: pb.AbortRequest, context: grpc.aio.ServicerContext) -> pb.AbortResponse:
        call = self._calls.get(request.request_id)
        if call is None:
            return pb.AbortResponse(aborted=False)
        self._aborted.add(request.request_id)
        call.cancel()
        return pb.AbortResponse(aborted=True)

    async def GetModelInfo(self, request: pb.GetModelInfoRequest, context: grpc.aio.ServicerContext) -> pb.ModelInfo:
        info = await self.model_info()
        return pb.ModelInfo(**info)

    async def GetLoad(self, request: pb.GetLoadRequest, context: grpc.aio.ServicerContext) -> pb.GetLoadResponse:
        fields = set(pb.ReplicaLoad.DESCRIPTOR.fields_by_name)
        return pb.GetLoadResponse(replicas=[pb.ReplicaLoad(**{k: v for k, v in load.items() if k in fields})
                                            for _, load in sorted(BOARD.snapshot().items())])


class BearerTokenInterceptor(grpc.aio.ServerInterceptor):
    """Rejects calls without `authorization: Bearer <token>` (health and reflection excepted)."""

    def __init__(self, token: str) -> None:
        self._expected = f"Bearer {token}"

        async def deny(request, context):
            await context.abort(grpc.StatusCode.UNAUTHENTICATED, "authorization: missing or wrong bearer token")

        self._deny = grpc.unary_unary_rpc_method_handler(deny)
        self._deny_stream = grpc.unary_stream_rpc_method_handler(deny)

    async def intercept_service(self, continuation, handler_call_details):
        if handler_call_details.method.startswith(UNAUTHENTICATED_METHODS):
            return await continuation(handler_call_details)
        metadata = dict(handler_call_details.invocation_metadata or ())
        if metadata.get("authorization") == self._expected:
            return await continuation(handler_call_details)
        return self._deny_stream if handler_call_details.method.endswith("/Generate") else self._deny


async def start_server(service: GenerationService, args: GrpcArgs) -> tuple[grpc.aio.Server, int, health.HealthServicer]:
    """Build and start the server; returns it, the port it bound and its health servicer."""
    interceptors = []
    if args.auth_token_file:
        interceptors.append(BearerTokenInterceptor(open(args.auth_token_file).read().strip()))
    options = [("grpc.max_receive_message_length", args.max_message_bytes),
               ("grpc.max_send_message_length", args.max_message_bytes)]
    server = grpc.aio.server(interceptors=interceptors, options=options)
    pb_grpc.add_GenerationServicer_to_server(service, server)
    health_servicer = health.HealthServicer(experimental_non_blocking=True)
    health_pb2_grpc.add_HealthServicer_to_server(health_servicer, server)
    reflection.enable_server_reflection((SERVICE, health.SERVICE_NAME, reflection.SERVICE_NAME), server)
    address = f"{args.host}:{args.port}"
    if args.tls_cert_file:
        creds = grpc.ssl_server_credentials([(open(args.tls_key_file, "rb").read(), open(args.tls_cert_file, "rb").read())])
        port = server.add_secure_port(address, creds)
    else:
        port = server.add_insecure_port(address)
    await server.start()
    health_servicer.set("", health_pb2.HealthCheckResponse.SERVING)  # liveness: the server is up
    logger.info("gRPC %s on %s:%d (%s, %s)", SERVICE, args.host, port, "TLS" if args.tls_cert_file else "plaintext",
                "token auth" if args.auth_token_file else "no auth")
    return server, port, health_servicer
