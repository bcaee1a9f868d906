"""The JSON HTTP route of the generation API, through Serve's HTTP proxy.

A client POSTs a `GenerateRequest` as JSON (the proto's field names: `prompt` or
`prompt_token_ids`, `sampling`, `request_id`, `session_id`, `stream`) and reads
`GenerateResponse`s as JSON lines, rendered from the same message the gRPC door sends
(`cluster/protocol.py`); with `"stream": false`, one JSON object at the end (with `sampling.n`
above 1, a JSON line a choice). Errors carry the
gRPC status name and message: `{"error": {"code", "message"}}` with the matching HTTP status
(400, 413 for a body over the limit, 429, 500, 503); after the stream has started an error is
the stream's last line. The body is refused by its declared length before it is read.
"""

from __future__ import annotations

import asyncio
import json
import logging
from collections.abc import AsyncIterator, Callable, Mapping
from typing import Any

from starlette.responses import JSONResponse, Response, StreamingResponse

from cluster.auth import DENIED
from cluster.gateway import STATUS, Gateway, RequestFailed
from cluster.protocol import InvalidRequest, error_json, merge_responses, response_json, update_to_response
from cluster.telemetry import READER_GONE, RequestTelemetry
from workers.error_codes import ErrorCode

logger = logging.getLogger(__name__)

PARSE_OFF_LOOP_BYTES = 64 << 10  # larger bodies are parsed on a worker thread


class BodyTooLarge(InvalidRequest):
    pass


class HttpApi:
    def __init__(
        self,
        gateway: Gateway,
        telemetry: Callable[[dict[str, Any], Mapping[str, str], tuple[str, int]], RequestTelemetry],
        max_request_bytes: int,
    ) -> None:
        self.gateway = gateway
        self.telemetry = telemetry
        self.max_request_bytes = max_request_bytes

    async def generate(self, request) -> Any:
        """`POST /generate`: one request, its responses as JSON lines (or one object)."""
        try:
            body = await read_json(request, self.max_request_bytes)
        except InvalidRequest as exc:
            self.gateway.rejected("HTTP", exc)
            return _error(
                "RESOURCE_EXHAUSTED" if isinstance(exc, BodyTooLarge) else "INVALID_ARGUMENT",
                str(exc),
                413 if isinstance(exc, BodyTooLarge) else 400,
            )
        try:
            routed = await self.gateway.prepare(body, "HTTP")
        except InvalidRequest as exc:
            return _error("INVALID_ARGUMENT", str(exc), 400)
        telemetry = self.telemetry(routed, dict(request.headers), (request.url.hostname or "", request.url.port or 0))
        updates = self.gateway.generate(routed, telemetry)
        try:
            first = await updates.__anext__()
        except RequestFailed as failed:
            telemetry.end(failed.code, failed.message)
            return _failure(failed)
        if not routed.get("stream", True):
            return await self._whole(first, updates, telemetry)
        return StreamingResponse(self._lines(first, updates, telemetry), media_type="application/x-ndjson")

    @staticmethod
    async def _lines(
        first: dict[str, Any], updates: AsyncIterator[dict[str, Any]], telemetry: RequestTelemetry
    ) -> AsyncIterator[str]:
        outcome = None
        try:
            yield _line(response_json(update_to_response(first)))
            async for update in updates:
                yield _line(response_json(update_to_response(update)))
        except RequestFailed as failed:  # the stream has started: its last line says why it ended
            outcome = failed.code
            yield _line(error_json(STATUS[failed.code][0].name, failed.message))
        except READER_GONE:
            outcome = "cancelled"
            raise
        finally:
            await updates.aclose()
            telemetry.end(outcome)

    @staticmethod
    async def _whole(first: dict[str, Any], updates: AsyncIterator[dict[str, Any]], telemetry: RequestTelemetry) -> Any:
        responses = [update_to_response(first)]
        try:
            async for update in updates:
                responses.append(update_to_response(update))
        except RequestFailed as failed:
            telemetry.end(failed.code, failed.message)
            return _failure(failed)
        except asyncio.CancelledError:
            telemetry.end("cancelled")
            raise
        telemetry.end()
        merged = [response_json(r) for r in merge_responses(responses)]
        if len(merged) == 1:
            return JSONResponse(merged[0])
        return Response("".join(_line(m) for m in merged), media_type="application/x-ndjson")  # a line a choice


async def read_json(request, limit: int) -> Any:
    """The request's JSON body, refused before reading when its declared length is over
    `limit`, and while reading once that many bytes came; large bodies parse off the loop."""
    declared = request.headers.get("content-length")
    if declared is not None and declared.isdigit() and int(declared) > limit:
        raise BodyTooLarge(f"request: body of {int(declared)} bytes is over the limit of {limit} bytes")
    chunks, size = [], 0
    async for chunk in request.stream():
        size += len(chunk)
        if size > limit:
            raise BodyTooLarge(f"request: body is over the limit of {limit} bytes")
        chunks.append(chunk)
    raw = b"".join(chunks)
    try:
        return json.loads(raw) if size <= PARSE_OFF_LOOP_BYTES else await asyncio.to_thread(json.loads, raw)
    except (UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise InvalidRequest(f"request: not valid JSON ({exc})") from None


def _line(payload: dict[str, Any]) -> str:
    return json.dumps(payload) + "\n"


def _failure(failed: RequestFailed) -> JSONResponse:
    grpc_code, http_status = STATUS.get(failed.code, STATUS[ErrorCode.INTERNAL.value])
    return _error(grpc_code.name, failed.message, http_status)


def unauthenticated() -> JSONResponse:
    """401 for a request without the bearer token (what was sent is not echoed)."""
    response = _error("UNAUTHENTICATED", DENIED, 401)
    response.headers["WWW-Authenticate"] = "Bearer"
    return response


def not_routed(status: int, message: str) -> JSONResponse:
    """404 for a path nobody defined, 405 for a defined path asked with another method."""
    return _error("NOT_FOUND" if status == 404 else "UNIMPLEMENTED", message, status)


def _error(code: str, message: str, status: int) -> JSONResponse:
    return JSONResponse(error_json(code, message), status_code=status)
