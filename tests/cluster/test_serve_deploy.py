"""`ops/serve.yaml` deployed the way the README says: `ray start --head`, `serve deploy`,
`serve status` shows the application RUNNING, a streamed HTTP request and a `slidespec generate`
gRPC call are served, then `serve shutdown`; the head node stops with its own process, and
another Ray cluster of the same user keeps running. `ray start --head` turns on token
authentication, so the CLI runs with RAY_AUTH_MODE=token. Only the ports are changed (to free
ones)."""

import json
import os

import pytest
import requests
import yaml

from tests.cluster.conftest import free_port
from tests.cluster.ray_head import ROOT, Head, run_cli


@pytest.fixture(scope="module")
def heads():
    """Our head node, and a bystander cluster of the same user that the tests must leave alone."""
    ours, bystander = Head(), Head()
    try:
        ours.wait_up()
        bystander.wait_up()
        yield ours, bystander
    finally:
        ours.stop()
        bystander.stop()


def test_serve_yaml_deploys_and_serves_a_streamed_request(heads, tmp_path):
    env, address = heads[0].env, heads[0].address
    config = yaml.safe_load(open(os.path.join(ROOT, "ops", "serve.yaml")))
    port = free_port()
    config["http_options"]["port"] = port
    grpc_port = free_port()
    config["applications"][0]["args"]["grpc"]["port"] = grpc_port
    path = tmp_path / "serve.yaml"
    path.write_text(yaml.safe_dump(config))
    deployed = run_cli("serve", "deploy", str(path), "-a", address, env=env)
    assert deployed.returncode == 0, deployed.stderr
    heads[0].wait_running()
    assert "status: RUNNING" in heads[0].status()  # as `serve status` shows it
    route = config["applications"][0]["route_prefix"].rstrip("/") + "/generate"
    body = {"prompt_token_ids": [5, 6, 7, 8], "sampling": {"max_new_tokens": 8, "temperature": 0.0, "ignore_eos": True}}
    with requests.post(f"http://127.0.0.1:{port}{route}", json=body, stream=True, timeout=120) as r:
        assert r.status_code == 200
        updates = [json.loads(line) for line in r.iter_lines() if line]
    assert len(updates) >= 2, "tokens should stream back in several messages"
    assert sum(len(u["token_ids"]) for u in updates) == 8 and updates[-1]["finish_reason"] == "FINISH_REASON_LENGTH"
    cli = run_cli(
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
    shutdown = run_cli("serve", "shutdown", "-y", "-a", address, env=env)
    assert shutdown.returncode == 0, shutdown.stderr


def test_stopping_our_head_leaves_other_clusters_running(heads):
    ours, bystander = heads
    ours.stop()
    assert ours.process.returncode is not None and not ours.up()
    assert bystander.process.poll() is None and bystander.up()
