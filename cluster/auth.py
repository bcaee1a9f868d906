"""One bearer token for every front door: gRPC calls and the HTTP route (generation and metrics)."""

from __future__ import annotations

import hmac

DENIED = "authorization: missing or wrong bearer token"  # never echoes what was sent


class BearerToken:
    """The token clients must send as `authorization: Bearer <token>`, read from its file once.
    Compared in constant time, so a response's timing says nothing about how much matched."""

    def __init__(self, token_file: str) -> None:
        with open(token_file) as f:
            token = f.read().strip()
        if not token:
            raise ValueError(f"grpc.auth_token_file: {token_file} holds no token")
        self._expected = f"Bearer {token}".encode()

    def admits(self, authorization: str | None) -> bool:
        return authorization is not None and hmac.compare_digest(authorization.encode(), self._expected)


def load_token(token_file: str | None) -> BearerToken | None:
    return BearerToken(token_file) if token_file else None
