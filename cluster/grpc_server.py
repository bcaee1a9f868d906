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
import contextlib
import inspect
import logging
from collections.abc import AsyncIterator, Awaitable, Callable, Mapping
from typing import Any

import grpc
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection, reflection_pb2, reflection_pb2_grpc

from cluster.auth import DENIED, BearerToken, load_token
from cluster.config import GrpcArgs
from cluster.gateway import STATUS, Gateway, RequestFailed
from cluster.proto.slidespec.v1 import generation_pb2 as pb
from cluster.proto.slidespec.v1 import generation_pb2_grpc as pb_grpc
from cluster.protocol import InvalidRequest, merge_responses, request_to_body, update_to_response
from cluster.telemetry import READER_GONE, RequestTelemetry
from workers.error_codes import ErrorCode

logger = logging.getLogger(__name__)

SERVICE = pb.DESCRIPTOR.services_by_name["Generation"].full_name
UNAUTHENTICATED_METHODS = ("/grpc.health.v1.Health/", "/grpc.reflection.")
# A cancellation this close to the deadline counts as the deadline: the client cancels at its own
# deadline, and ours runs later by the call's transit and queueing (tenths of a second on a busy host).
DEADLINE_SLACK_S = 0.5


class GenerationService(pb_grpc.GenerationServicer):
    def __init__(
        self,
        gateway: Gateway,
        ready: Callable[[], Awaitable[bool]],
        model_info: Callable[[], Awaitable[dict[str, Any]]],
        loads: Callable[[], Awaitable[list[dict[str, Any]]]],
        telemetry: Callable[[dict[str, Any], Mapping[str, str], tuple[str, int]], RequestTelemetry],
    ) -> None:
        """`telemetry(body, call metadata)` starts a request's span and metrics; `loads()` asks
        every engine replica for its live load."""
        self.gateway = gateway
        self.ready = ready
        self.model_info = model_info
        self.loads = loads
        self.telemetry = telemetry
        self.address: tuple[str, int] = ("", 0)  # where the server listens, once started

    async def Generate(
        self, request: pb.GenerateRequest, context: grpc.aio.ServicerContext
    ) -> AsyncIterator[pb.GenerateResponse]:
        try:
            body = await self.gateway.prepare(request_to_body(request), "gRPC")
        except InvalidRequest as exc:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(exc))
        except asyncio.CancelledError:  # gone before it was even prepared: still counted
            self.gateway.ended(_cancel_reason(context))
            raise
        telemetry = self.telemetry(body, dict(context.invocation_metadata() or ()), self.address)
        try:
            async with contextlib.aclosing(self.gateway.generate(body, telemetry)) as updates:
                if body["stream"]:
                    async for update in updates:
                        if context.cancelled():  # the deadline passed or the client left: stop generating
                            raise asyncio.CancelledError
                        yield update_to_response(update)
                else:
                    collected = [update_to_response(u) async for u in updates]
                    if collected and not context.cancelled():
                        for response in merge_responses(collected):  # one a choice
                            yield response
        except RequestFailed as failed:
            telemetry.end(failed.code, failed.message)
            await context.abort(STATUS.get(failed.code, STATUS[ErrorCode.INTERNAL.value])[0], failed.message)
        except READER_GONE:
            telemetry.end(_cancel_reason(context))
            raise
        except BaseException as exc:
            telemetry.end(ErrorCode.INTERNAL.value, f"{type(exc).__name__}: {exc}")
            raise
        else:
            telemetry.end(_cancel_reason(context) if context.cancelled() else None)

    async def Abort(self, request: pb.AbortRequest, context: grpc.aio.ServicerContext) -> pb.AbortResponse:
        return pb.AbortResponse(aborted=await self.gateway.abort(request.request_id))

    async def GetModelInfo(self, request: pb.GetModelInfoRequest, context: grpc.aio.ServicerContext) -> pb.ModelInfo:
        info = await self.model_info()
        return pb.ModelInfo(**info)

    async def GetLoad(self, request: pb.GetLoadRequest, context: grpc.aio.ServicerContext) -> pb.GetLoadResponse:
        fields = set(pb.ReplicaLoad.DESCRIPTOR.fields_by_name)
        loads = sorted(await self.loads(), key=lambda load: load["replica"])
        return pb.GetLoadResponse(
            replicas=[pb.ReplicaLoad(**{k: v for k, v in load.items() if k in fields}) for load in loads]
        )


def _cancel_reason(context: grpc.aio.ServicerContext) -> str:
    """deadline_exceeded or cancelled. The client cancels at its deadline, which may reach us a
    moment before our own timer does."""
    remaining = context.time_remaining()
    return "deadline_exceeded" if remaining is not None and remaining <= DEADLINE_SLACK_S else "cancelled"


class UndecodableRequestInterceptor(grpc.aio.ServerInterceptor):
    """A message that does not parse (garbage bytes, invalid UTF-8 in a string field) is the
    client's error: INVALID_ARGUMENT naming the message type, not gRPC's default UNKNOWN."""

    async def intercept_service(self, continuation, handler_call_details):
        handler = await continuation(handler_call_details)
        if handler is None or handler.request_deserializer is None:
            return handler
        parse = handler.request_deserializer

        def deserialize(data: bytes):
            try:
                return parse(data)
            except Exception as exc:  # noqa: BLE001 - DecodeError, UnicodeDecodeError, ...
                return _Undecodable(f"request: not a valid message for {handler_call_details.method}: {exc}")

        kind = "unary_stream" if handler.unary_stream else "unary_unary" if handler.unary_unary else None
        if kind is None:
            return handler
        behavior = getattr(handler, kind)  # async or sync (the health servicer is sync)
        if kind == "unary_stream":

            async def checked(request, context):
                if isinstance(request, _Undecodable):
                    await context.abort(grpc.StatusCode.INVALID_ARGUMENT, request.message)
                responses = behavior(request, context)
                if hasattr(responses, "__aiter__"):
                    async for response in responses:
                        yield response
                else:
                    for response in responses:
                        yield response
        else:

            async def checked(request, context):
                if isinstance(request, _Undecodable):
                    await context.abort(grpc.StatusCode.INVALID_ARGUMENT, request.message)
                response = behavior(request, context)
                return await response if inspect.isawaitable(response) else response

        return handler._replace(request_deserializer=deserialize, **{kind: checked})


class _Undecodable:
    def __init__(self, message: str) -> None:
        self.message = message


class BearerTokenInterceptor(grpc.aio.ServerInterceptor):
    """Rejects calls without `authorization: Bearer <token>` (health and reflection excepted)."""

    def __init__(self, token: BearerToken) -> None:
        self._token = token

        async def deny(request, context):
            await context.abort(grpc.StatusCode.UNAUTHENTICATED, DENIED)

        self._deny = grpc.unary_unary_rpc_method_handler(deny)
        self._deny_stream = grpc.unary_stream_rpc_method_handler(deny)

    async def intercept_service(self, continuation, handler_call_details):
        if handler_call_details.method.startswith(UNAUTHENTICATED_METHODS):
            return await continuation(handler_call_details)
        metadata = dict(handler_call_details.invocation_metadata or ())
        if self._token.admits(metadata.get("authorization")):
            return await continuation(handler_call_details)
        return self._deny_stream if handler_call_details.method.endswith("/Generate") else self._deny


async def start_server(
    service: GenerationService, args: GrpcArgs
) -> tuple[grpc.aio.Server, int, health.HealthServicer]:
    """Build and start the server; returns it, the port it bound and its health servicer."""
    interceptors: list[grpc.aio.ServerInterceptor] = [UndecodableRequestInterceptor()]
    token = load_token(args.auth_token_file)
    if token is not None:
        interceptors.append(BearerTokenInterceptor(token))
    options = [
        ("grpc.max_receive_message_length", args.max_message_bytes),
        ("grpc.max_send_message_length", args.max_message_bytes),
    ]
    server = grpc.aio.server(interceptors=interceptors, options=options)
    pb_grpc.add_GenerationServicer_to_server(service, server)
    health_servicer = health.HealthServicer(experimental_non_blocking=True)
    health_pb2_grpc.add_HealthServicer_to_server(health_servicer, server)
    add_reflection(server, (SERVICE, health.SERVICE_NAME))
    address = f"{args.host}:{args.port}"
    try:
        if args.tls_cert_file:
            creds = grpc.ssl_server_credentials(
                [(open(args.tls_key_file, "rb").read(), open(args.tls_cert_file, "rb").read())]
            )
            port = server.add_secure_port(address, creds)
        else:
            port = server.add_insecure_port(address)
    except RuntimeError as exc:  # grpcio's "Failed to bind", the cause only in its own log
        tls = " or grpc.tls_cert_file / tls_key_file are not a certificate and its key" if args.tls_cert_file else ""
        raise RuntimeError(
            f"grpc.host / grpc.port: cannot listen on {address}: another process holds the port, "
            f"the host is not an address of this node{tls}"
        ) from exc
    await server.start()
    service.address = (args.host, port)
    health_servicer.set("", health_pb2.HealthCheckResponse.SERVING)  # liveness: the server is up
    logger.info(
        "gRPC %s on %s:%d (%s, %s)",
        SERVICE,
        args.host,
        port,
        "TLS" if args.tls_cert_file else "plaintext",
        "token auth" if args.auth_token_file else "no auth",
    )
    return server, port, health_servicer


REFLECTION_V1 = "grpc.reflection.v1.ServerReflection"


def add_reflection(server: grpc.aio.Server, services: tuple[str, ...]) -> None:
    """Server reflection as both `grpc.reflection.v1` (what current clients ask first) and
    `v1alpha`. grpcio-reflection implements only v1alpha, but v1's messages are v1alpha's with
    the package renamed (the same fields and numbers), so one servicer answers both through the
    v1alpha message classes."""
    names = (*services, reflection.SERVICE_NAME, REFLECTION_V1)
    servicer = reflection.aio.ReflectionServicer(names)
    reflection_pb2_grpc.add_ServerReflectionServicer_to_server(servicer, server)
    v1 = grpc.stream_stream_rpc_method_handler(
        servicer.ServerReflectionInfo,
        request_deserializer=reflection_pb2.ServerReflectionRequest.FromString,
        response_serializer=reflection_pb2.ServerReflectionResponse.SerializeToString,
    )
    server.add_generic_rpc_handlers(
        (grpc.method_handlers_generic_handler(REFLECTION_V1, {"ServerReflectionInfo": v1}),)
    )
