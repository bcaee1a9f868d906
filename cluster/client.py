"""Python clients of the `slidespec.v1.Generation` gRPC API (blocking and asyncio).

client = GenerationClient("127.0.0.1:50051")
for response in client.generate("Once upon a time", max_new_tokens=32, temperature=0.0):
    print(response.text, end="")
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Iterator, Mapping, Sequence
from typing import Any

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

from cluster.proto.slidespec.v1 import generation_pb2 as pb
from cluster.proto.slidespec.v1 import generation_pb2_grpc as pb_grpc

SERVICE = pb.DESCRIPTOR.services_by_name["Generation"].full_name


def build_request(
    prompt: str | Sequence[int],
    request_id: str = "",
    session_id: str = "",
    stream: bool = True,
    stop: Sequence[str] = (),
    stop_token_ids: Sequence[int] = (),
    **sampling: Any,
) -> pb.GenerateRequest:
    """A GenerateRequest: text or token ids, and sampling fields (temperature, top_p, top_k,
    max_new_tokens, seed, ignore_eos, logprobs, n, ...; `logit_bias` a mapping) left unset
    unless given."""
    request = pb.GenerateRequest(request_id=request_id, session_id=session_id, stream=stream)
    if isinstance(prompt, str):
        request.prompt = prompt
    else:
        request.prompt_token_ids.extend(prompt)
    for name, value in sampling.items():
        if isinstance(value, Mapping):
            getattr(request.sampling, name).update(value)
        elif value is not None:
            setattr(request.sampling, name, value)
    request.sampling.stop.extend(stop)
    request.sampling.stop_token_ids.extend(stop_token_ids)
    return request


def _channel_args(max_message_bytes: int) -> list[tuple[str, int]]:
    return [("grpc.max_receive_message_length", max_message_bytes), ("grpc.max_send_message_length", max_message_bytes)]


def _credentials(root_cert: bytes | None) -> grpc.ChannelCredentials | None:
    return grpc.ssl_channel_credentials(root_certificates=root_cert) if root_cert is not None else None


class GenerationClient:
    def __init__(
        self,
        target: str,
        token: str | None = None,
        root_cert: bytes | None = None,
        max_message_bytes: int = 16 << 20,
        server_name: str | None = None,
    ) -> None:
        """`root_cert`: PEM of the CA that signed the server's certificate (TLS when given);
        `token`: sent as `authorization: Bearer <token>`."""
        options = _channel_args(max_message_bytes)
        if server_name:
            options.append(("grpc.ssl_target_name_override", server_name))
        creds = _credentials(root_cert)
        self.channel = grpc.secure_channel(target, creds, options) if creds else grpc.insecure_channel(target, options)
        self.stub = pb_grpc.GenerationStub(self.channel)
        self.health_stub = health_pb2_grpc.HealthStub(self.channel)
        self.metadata = (("authorization", f"Bearer {token}"),) if token else ()

    def generate(
        self, prompt: str | Sequence[int], timeout: float | None = None, **kwargs: Any
    ) -> Iterator[pb.GenerateResponse]:
        """Stream responses; raises grpc.RpcError with the server's status code."""
        return self.stub.Generate(build_request(prompt, **kwargs), timeout=timeout, metadata=self.metadata)

    def complete(self, prompt: str | Sequence[int], **kwargs: Any) -> pb.GenerateResponse:
        """One response holding every token (a non-streaming call)."""
        (response,) = list(self.generate(prompt, stream=False, **kwargs))
        return response

    def abort(self, request_id: str) -> bool:
        return self.stub.Abort(pb.AbortRequest(request_id=request_id), metadata=self.metadata).aborted

    def model_info(self) -> pb.ModelInfo:
        return self.stub.GetModelInfo(pb.GetModelInfoRequest(), metadata=self.metadata)

    def load(self) -> pb.GetLoadResponse:
        return self.stub.GetLoad(pb.GetLoadRequest(), metadata=self.metadata)

    def health(self, service: str = SERVICE) -> int:
        """health_pb2.HealthCheckResponse status: "" for liveness, the service for readiness."""
        return self.health_stub.Check(health_pb2.HealthCheckRequest(service=service)).status

    def close(self) -> None:
        self.channel.close()


class AsyncGenerationClient:
    def __init__(
        self, target: str, token: str | None = None, root_cert: bytes | None = None, max_message_bytes: int = 16 << 20
    ) -> None:
        options = _channel_args(max_message_bytes)
        creds = _credentials(root_cert)
        self.channel = (
            grpc.aio.secure_channel(target, creds, options) if creds else grpc.aio.insecure_channel(target, options)
        )
        self.stub = pb_grpc.GenerationStub(self.channel)
        self.metadata = (("authorization", f"Bearer {token}"),) if token else ()

    def generate(
        self, prompt: str | Sequence[int], timeout: float | None = None, **kwargs: Any
    ) -> AsyncIterator[pb.GenerateResponse]:
        return self.stub.Generate(build_request(prompt, **kwargs), timeout=timeout, metadata=self.metadata)

    async def abort(self, request_id: str) -> bool:
        return (await self.stub.Abort(pb.AbortRequest(request_id=request_id), metadata=self.metadata)).aborted

    async def close(self) -> None:
        await self.channel.close()
