"""One bearer token for every front door: gRPC calls and the HTTP route (generation and metrics)."""

from __future__ import annotations

import hmac

DENIED = "authorization: missing or wrong bearer token"  # never echoes what was sent


class BearerToken:
    """The token clients must send as `authorization: Bearer <token>`, read from its file once.
    Compared in constant time, so a response's timing says nothing about how much matched."""

    def __init__(self, token_file: str) -> None:
        try:
            with open(token_file, encoding="utf-8") as f:
                token = f.read().strip()
        except (OSError, UnicodeDecodeError) as exc:
            raise ValueError(f"grpc.auth_token_file: cannot read {token_file}: {exc}") from exc
        if not token:
            raise ValueError(f"grpc.auth_token_file: {token_file} holds no token")
        if not token.isascii() or not token.isprintable() or any(c.isspace() for c in token):
            # no client could send it in an authorization header: every call would be denied
            raise ValueError(f"grpc.auth_token_file: {token_file} must hold one word of printable ASCII")
        self._expected = f"Bearer {token}".encode()

    def admits(self, authorization: str | None) -> bool:
        return authorization is not None and hmac.compare_digest(authorization.encode(), self._expected)


def load_token(token_file: str | None) -> BearerToken | None:
    return BearerToken(token_file) if token_file else None
