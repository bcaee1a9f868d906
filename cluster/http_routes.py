"""The HTTP route table of the ingress: every path the application answers, as data.

Paths are relative to the application's Serve route prefix (`/` in the shipped config and for
`slidespec serve`, so OpenAI clients use `http://host:8000/v1`). A request is matched here
first: a path nobody defined is 404, a defined path asked with another method 405 (with an
`Allow` header), and only then does the route's access rule (the bearer token) apply. Nothing
is served on a path outside the table.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

Access = Literal["token", "metrics", "open"]  # metrics: the token unless `metrics_open`
ErrorShape = Literal["openai", "generate"]


@dataclass(frozen=True)
class Route:
    path: str  # a `{name}` segment matches one path segment, passed to the handler by name
    method: str
    handler: str  # the ingress's method that answers it
    access: Access
    errors: ErrorShape  # how a 401/404/405 on this path is shaped

    def match(self, path: str) -> dict[str, str] | None:
        """The path parameters when `path` is this route's path, else None."""
        want, have = self.path.split("/"), path.split("/")
        if len(want) != len(have):
            return None
        params = {}
        for pattern, segment in zip(want, have):
            if pattern.startswith("{") and pattern.endswith("}"):
                if not segment:
                    return None
                params[pattern[1:-1]] = segment
            elif pattern != segment:
                return None
        return params


ROUTES: tuple[Route, ...] = (
    Route("/v1/completions", "POST", "completions", "token", "openai"),
    Route("/v1/chat/completions", "POST", "chat_completions", "token", "openai"),
    Route("/v1/models", "GET", "models", "token", "openai"),
    Route("/v1/models/{model}", "GET", "model", "token", "openai"),
    Route("/generate", "POST", "generate", "token", "generate"),
    Route("/metrics", "GET", "metrics", "metrics", "generate"),
    Route("/health", "GET", "health", "open", "generate"),
    Route("/version", "GET", "version", "open", "generate"),
)


@dataclass(frozen=True)
class Match:
    """What the table says of a request: its route and parameters, or why there is none."""

    route: Route | None
    params: dict[str, str]
    allowed: tuple[str, ...]  # the methods the path takes (empty: no such path)
    errors: ErrorShape

    @property
    def status(self) -> int:
        return 200 if self.route is not None else 405 if self.allowed else 404


def relative_path(path: str, root_path: str) -> str:
    """The request path below the application's route prefix (Serve puts the prefix in the
    ASGI `root_path` and keeps the whole path), without a trailing slash."""
    if root_path and root_path != "/" and (path == root_path or path.startswith(root_path + "/")):
        path = path[len(root_path) :]
    path = path.rstrip("/")
    return path or "/"


def match(method: str, path: str) -> Match:
    """The route that answers `method` on `path` (already relative to the route prefix)."""
    found = [(route, params) for route in ROUTES if (params := route.match(path)) is not None]
    errors: ErrorShape = "openai" if path == "/v1" or path.startswith("/v1/") else "generate"
    for route, params in found:
        if route.method == method:
            return Match(route, params, (route.method,), route.errors)
    return Match(None, {}, tuple(sorted({route.method for route, _ in found})), errors)
