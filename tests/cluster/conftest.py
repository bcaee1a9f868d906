import glob
import os
import socket
from collections.abc import Iterator

import pytest


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def session_logs() -> Iterator[tuple[str, str]]:
    """(path, text) of every log file of the connected Ray session (every process's output)."""
    import ray

    logs_dir = os.path.join(ray._private.worker.global_worker.node.get_session_dir_path(), "logs")
    for path in glob.glob(os.path.join(logs_dir, "**", "*"), recursive=True):
        if os.path.isfile(path) and path.endswith((".log", ".err", ".out")):
            with open(path, errors="replace") as f:
                yield path, f.read()


def start_local_ray() -> None:
    """A new local Ray cluster on loopback for one test module; span batches leave every
    process within 0.2 s, so tests need not wait for shutdown."""
    import ray

    ray.init(
        address="local",  # a new local cluster, whatever a stale address file says
        num_cpus=8,
        include_dashboard=False,
        _node_ip_address="127.0.0.1",
        log_to_driver=False,
        runtime_env={"env_vars": {"OTEL_BSP_SCHEDULE_DELAY": "200"}},
    )


@pytest.fixture(scope="module")
def ray_serve():
    """One local Ray cluster (loopback only) with Serve's HTTP proxy per test module."""
    import ray
    from ray import serve

    start_local_ray()
    port = free_port()
    serve.start(http_options={"host": "127.0.0.1", "port": port})
    yield f"http://127.0.0.1:{port}"
    serve.shutdown()
    ray.shutdown()
