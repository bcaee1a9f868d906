import glob
import os
import socket
import time
from collections.abc import Iterator

import pytest

_shared: dict[str, str] = {}  # "url": the shared cluster's HTTP proxy, while it runs
_log_starts: dict[str, int] = {}  # log path -> its size when the current module started


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _log_paths() -> list[str]:
    import ray

    logs_dir = os.path.join(ray._private.worker.global_worker.node.get_session_dir_path(), "logs")
    paths = glob.glob(os.path.join(logs_dir, "**", "*"), recursive=True)
    return [p for p in paths if os.path.isfile(p) and p.endswith((".log", ".err", ".out"))]


def session_logs() -> Iterator[tuple[str, str]]:
    """(path, text) of every log file of the connected Ray session (every process's output),
    what was written since the current test module started using it."""
    for path in _log_paths():
        with open(path, "rb") as f:
            f.seek(_log_starts.get(path, 0))
            yield path, f.read().decode(errors="replace")


def start_local_ray() -> None:
    """A new local Ray cluster on loopback; span batches leave every process within 0.2 s, so
    tests need not wait for shutdown."""
    import ray

    ray.init(
        address="local",  # a new local cluster, whatever a stale address file says
        num_cpus=8,
        include_dashboard=False,
        _node_ip_address="127.0.0.1",
        log_to_driver=False,
        runtime_env={"env_vars": {"OTEL_BSP_SCHEDULE_DELAY": "200"}},
    )


def stop_shared_ray() -> None:
    """Stop the cluster `ray_serve` shares (a module that starts a Ray of its own calls this)."""
    import ray
    from ray import serve

    if _shared.pop("url", None) is not None:
        serve.shutdown()
        ray.shutdown()


@pytest.fixture(scope="module")
def ray_serve(request):
    """A local Ray cluster (loopback only) with Serve's HTTP proxy: its URL. Starting one takes
    seconds, so test modules share it: each deploys its own applications and deletes them at
    its end, waiting until every CPU is free again (no replica, rank actor or placement group
    left), and reads only the log lines written since it started (`session_logs`). It stops
    after the last module that uses it, when a module starts a Ray of its own, or when a
    module's clean-up fails (the next module then starts a new one). The modules that use it run
    first and one after another, on one worker of a distributed run (tests/conftest.py)."""
    from ray import serve

    if "url" not in _shared:
        start_local_ray()
        port = free_port()
        serve.start(http_options={"host": "127.0.0.1", "port": port})
        _shared["url"] = f"http://127.0.0.1:{port}"
    _log_starts.clear()
    _log_starts.update((path, os.path.getsize(path)) for path in _log_paths())
    yield _shared["url"]
    clean = False
    try:
        for name in serve.status().applications:
            serve.delete(name, _blocking=False)  # a blocking delete looks once a second
        deadline = time.monotonic() + 60
        while left := _left_behind():
            assert time.monotonic() < deadline, f"60 s after deleting the applications: {left}"
            time.sleep(0.1)
        clean = True
    finally:
        if not clean or not _used_after(request.node):  # what a module left behind is not the next one's
            stop_shared_ray()


def _left_behind() -> str:
    """What the deleted applications still hold: applications not yet gone, CPUs not yet free
    (replicas, rank actors, placement groups); empty when nothing."""
    import ray
    from ray import serve

    if apps := list(serve.status().applications):
        return f"applications {apps}"
    free, total = ray.available_resources().get("CPU", 0), ray.cluster_resources()["CPU"]
    return f"{total - free:g} of {total:g} CPUs held" if free < total else ""


def _used_after(module: pytest.Module) -> bool:
    """Whether a test that runs after `module`'s uses `ray_serve`."""
    items = module.session.items
    last = max(i for i, item in enumerate(items) if item.getparent(pytest.Module) is module)
    return any("ray_serve" in item.fixturenames for item in items[last + 1 :])
