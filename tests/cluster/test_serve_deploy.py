"""`ops/serve.yaml` deployed the way the README says: `ray start --head`, `serve deploy`,
`serve status` shows the application RUNNING, a streamed HTTP request and a `slidespec generate`
gRPC call are served, then `serve shutdown`; the head node stops with its own process, and
another Ray cluster of the same user keeps running. `ray start --head` turns on token
authentication, so the CLI runs with RAY_AUTH_MODE=token. Only the ports are changed (to free
ones)."""

import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time

import pytest
import requests
import yaml

from tests.cluster.conftest import free_port

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
BIN = os.path.dirname(sys.executable)


def _run(*args: str, env: dict, timeout: int = 120) -> subprocess.CompletedProcess:
    return subprocess.run(
        [os.path.join(BIN, args[0]), *args[1:]], env=env, capture_output=True, text=True, timeout=timeout, cwd=ROOT
    )


class Head:
    """A head node of our own: `ray start --head --block` in its own session and temp dir, stopped
    by signalling that process (never `ray stop`, which stops every cluster of the user)."""

    def __init__(self, env: dict) -> None:
        self.env = env
        gcs, dashboard = free_port(), free_port()
        self.temp_dir = tempfile.mkdtemp(prefix="ray", dir="/tmp")  # short: socket paths must fit 107 bytes
        self.process = subprocess.Popen(
            [
                os.path.join(BIN, "ray"),
                "start",
                "--head",
                "--block",
                "--num-cpus",
                "8",
                "--node-ip-address",
                "127.0.0.1",
                "--dashboard-host",
                "127.0.0.1",
                "--port",
                str(gcs),
                "--dashboard-port",
                str(dashboard),
                "--temp-dir",
                self.temp_dir,
                "--disable-usage-stats",
            ],
            env=env,
            cwd=ROOT,
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
            start_new_session=True,
        )
        self.address = f"http://127.0.0.1:{dashboard}"

    def wait_up(self, timeout: float = 120) -> None:
        deadline = time.monotonic() + timeout
        while not self.up():
            assert self.process.poll() is None, "ray start --head exited"
            assert time.monotonic() < deadline, "the head node did not come up"
            time.sleep(2)

    def up(self) -> bool:
        return _run("serve", "status", "-a", self.address, env=self.env, timeout=60).returncode == 0

    def stop(self) -> None:
        if self.process.poll() is None:
            self.process.send_signal(signal.SIGTERM)
            try:
                self.process.wait(timeout=60)
            except subprocess.TimeoutExpired:
                os.killpg(self.process.pid, signal.SIGKILL)
                self.process.wait()
        shutil.rmtree(self.temp_dir, ignore_errors=True)


@pytest.fixture(scope="module")
def heads():
    """Our head node, and a bystander cluster of the same user that the tests must leave alone."""
    env = {**os.environ, "RAY_AUTH_MODE": "token", "RAY_USAGE_STATS_ENABLED": "0"}
    ours, bystander = Head(env), Head(env)
    try:
        ours.wait_up()
        bystander.wait_up()
        yield ours, bystander
    finally:
        ours.stop()
        bystander.stop()


@pytest.fixture(scope="module")
def cluster(heads):
    return heads[0].env, heads[0].address


def test_serve_yaml_deploys_and_serves_a_streamed_request(cluster, tmp_path):
    env, address = cluster
    config = yaml.safe_load(open(os.path.join(ROOT, "ops", "serve.yaml")))
    port = free_port()
    config["http_options"]["port"] = port
    grpc_port = free_port()
    config["applications"][0]["args"]["grpc"]["port"] = grpc_port
    path = tmp_path / "serve.yaml"
    path.write_text(yaml.safe_dump(config))
    deployed = _run("serve", "deploy", str(path), "-a", address, env=env)
    assert deployed.returncode == 0, deployed.stderr
    deadline, status = time.monotonic() + 240, ""
    while time.monotonic() < deadline:
        status = _run("serve", "status", "-a", address, env=env).stdout
        if "status: RUNNING" in status:
            break
        time.sleep(2)
    assert "status: RUNNING" in status, status
    route = config["applications"][0]["route_prefix"]
    body = {"prompt_token_ids": [5, 6, 7, 8], "sampling": {"max_new_tokens": 8, "temperature": 0.0, "ignore_eos": True}}
    with requests.post(f"http://127.0.0.1:{port}{route}", json=body, stream=True, timeout=120) as r:
        assert r.status_code == 200
        updates = [json.loads(line) for line in r.iter_lines() if line]
    assert len(updates) >= 2, "tokens should stream back in several messages"
    assert sum(len(u["token_ids"]) for u in updates) == 8 and updates[-1]["finish_reason"] == "length"
    cli = _run(
        "slidespec",
        "generate",
        "--token-ids",
        "5,6,7,8",
        "--max-new-tokens",
        "6",
        "--temperature",
        "0",
        "--target",
        f"127.0.0.1:{grpc_port}",
        env=env,
    )
    assert cli.returncode == 0 and "6 tokens" in cli.stderr, cli.stderr
    shutdown = _run("serve", "shutdown", "-y", "-a", address, env=env)
    assert shutdown.returncode == 0, shutdown.stderr


def test_stopping_our_head_leaves_other_clusters_running(heads):
    ours, bystander = heads
    ours.stop()
    assert ours.process.returncode is not None and not ours.up()
    assert bystander.process.poll() is None and bystander.up()
