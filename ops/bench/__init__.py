"""Benchmarks; `--record` writes a run to ops/bench/results/ (how: ops/bench/record.py)."""

from __future__ import annotations

import json
import socket
from typing import Any


def emit(result: dict[str, Any], out: str | None) -> None:
    """Print a benchmark's result as one JSON line and, with `out`, write it there too."""
    if out:
        with open(out, "w") as f:
            json.dump(result, f, indent=1)
    print(json.dumps(result))


def free_port() -> int:
    """A TCP port free on the loopback now (for a process group's rendezvous, a server)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]
