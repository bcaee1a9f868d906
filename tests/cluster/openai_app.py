"""A one-replica application of the shipped tiny model behind a bearer token, for tests of the
OpenAI routes: its OpenAI client, gRPC client and base URL."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import openai
from ray import serve

from cluster.app import build_app
from cluster.client import GenerationClient
from ops import DEFAULT_MODEL


def deploy(ray_serve: str, token_file, token: str, name: str, **settings: Any) -> Iterator[tuple]:
    """Serve the application (with `settings` over the defaults) at route prefix `/name` and
    yield (OpenAI client, gRPC client, base URL); the gRPC client is closed after."""
    token_file.write_text(token)
    args = dict(
        model=DEFAULT_MODEL,
        page_size=4,
        max_total_tokens=4096,
        context_length=512,
        num_replicas=1,
        grpc={"port": 0, "auth_token_file": str(token_file)},
    )
    args.update(settings)
    handle = serve.run(build_app(args), name=name, route_prefix=f"/{name}")
    grpc_client = GenerationClient(f"127.0.0.1:{handle.ports.remote().result()['grpc']}", token=token)
    client = openai.OpenAI(base_url=f"{ray_serve}/{name}/v1", api_key=token, max_retries=0, timeout=60)
    yield client, grpc_client, f"{ray_serve}/{name}/v1"
    grpc_client.close()
