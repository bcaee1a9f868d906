"""`serve run` as a user on a 2-core laptop runs it, against a head node with 2 CPUs: the
shipped `ops/serve.yaml` reaches RUNNING and serves gRPC, the JSON-lines route and the official
`openai` client at `/v1`; while no engine replica can run, HTTP
answers 503 at once instead of hanging; and `serve run cluster.app:build_app key=value ...`
with dotted keys for nested settings starts the application."""

import os
import time

import openai
import pytest
import requests
import yaml

from cluster.client import GenerationClient
from tests.cluster.conftest import free_port
from tests.cluster.ray_head import POLL_S, ROOT, Head, run_cli


@pytest.fixture(scope="module")
def laptop():
    head = Head(num_cpus=2)
    try:
        head.wait_up()
        yield head
    finally:
        head.stop()


@pytest.fixture(autouse=True)
def serve_shut_down_after(laptop):
    """Each test ends with Serve shut down and its controller gone, however the test ended: the
    next test's `serve run` or `serve start` must not reach a controller that is still stopping."""
    yield
    laptop.shutdown_serve()


def _config(tmp_path, **args) -> tuple[str, int, int]:
    """ops/serve.yaml with free ports (and `args` changed); its path, HTTP and gRPC ports."""
    config = yaml.safe_load(open(os.path.join(ROOT, "ops", "serve.yaml")))
    http, grpc_port = free_port(), free_port()
    config["http_options"]["port"] = http
    config["applications"][0]["args"]["grpc"]["port"] = grpc_port
    config["applications"][0]["args"].update(args)
    path = tmp_path / "serve.yaml"
    path.write_text(yaml.safe_dump(config))
    return str(path), http, grpc_port


def _serve_run(head: Head, *args: str) -> None:
    done = run_cli("serve", "run", "--non-blocking", "-a", head.gcs_address, *args, env=head.env, timeout=300)
    assert done.returncode == 0, done.stdout + done.stderr


def test_the_shipped_config_runs_on_two_cpus(laptop, tmp_path):
    path, http, grpc_port = _config(tmp_path)
    _serve_run(laptop, path)
    laptop.wait_running()
    client = GenerationClient(f"127.0.0.1:{grpc_port}")
    tokens = [
        t for r in client.generate([5, 6, 7], max_new_tokens=6, temperature=0.0, ignore_eos=True) for t in r.token_ids
    ]
    assert len(tokens) == 6
    r = requests.post(
        f"http://127.0.0.1:{http}/generate", json={"prompt": "import os", "sampling": {"max_new_tokens": 4}}, timeout=60
    )
    assert r.status_code == 200
    client.close()
    # the official client at <host>/v1, as with every OpenAI-compatible server
    oa = openai.OpenAI(base_url=f"http://127.0.0.1:{http}/v1", api_key="unused", max_retries=0, timeout=60)
    model = oa.models.list().data[0].id
    completion = oa.completions.create(model=model, prompt="import os", max_tokens=4, temperature=0)
    assert completion.choices[0].text and completion.usage.completion_tokens == 4
    chunks = list(
        oa.chat.completions.create(
            model=model, messages=[{"role": "user", "content": "hi"}], max_tokens=4, temperature=0, stream=True
        )
    )
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    with pytest.raises(openai.BadRequestError) as bad:
        oa.completions.create(model=model, prompt="x", max_tokens=2, temperature=-1)
    assert bad.value.status_code == 400 and bad.value.body["param"] == "temperature"


def test_http_answers_503_at_once_while_no_replica_runs(laptop, tmp_path):
    # a replica needs 8.5 CPUs: none starts (and the teardown need not wait 30 s for the one pending)
    path, http, _ = _config(tmp_path, cpus_per_rank=4, graceful_shutdown_timeout_s=2)
    _serve_run(laptop, path)
    url = f"http://127.0.0.1:{http}/generate"
    deadline = time.monotonic() + 120
    while True:  # until the ingress is up behind Serve's proxy (its first answer may take seconds)
        try:
            r = requests.post(url, json={"prompt": "x"}, timeout=30)
            if r.status_code != 404:
                break
        except (requests.ConnectionError, requests.Timeout):
            pass
        assert time.monotonic() < deadline, "the ingress never came up"
        time.sleep(POLL_S)
    for _ in range(3):
        start = time.monotonic()
        r = requests.post(url, json={"prompt_token_ids": [1, 2, 3]}, timeout=5)
        assert r.status_code == 503 and r.json()["error"]["code"] == "UNAVAILABLE", r.text
        assert time.monotonic() - start < 1.0
    assert "replicas will wait" not in r.text  # the message is the client's; the warning went to the log


def test_serve_run_with_dotted_keys(laptop):
    http, grpc_port = free_port(), free_port()
    started = run_cli(
        "serve", "start", "-a", laptop.gcs_address, "--http-host", "127.0.0.1", "--http-port", str(http), env=laptop.env
    )
    assert started.returncode == 0, started.stderr
    _serve_run(
        laptop,
        "cluster.app:build_app",
        "model=tiny-gemma3",
        "speculative.algorithm=eagle",
        "speculative.draft_model=tiny-gemma3-eagle",
        "speculative.num_steps=2",
        "tp_size=1",
        "cpus_per_rank=0.5",
        f"grpc.port={grpc_port}",
    )
    laptop.wait_running()
    client = GenerationClient(f"127.0.0.1:{grpc_port}")
    *_, last = client.generate("def main():", max_new_tokens=8, temperature=0.0, ignore_eos=True)
    assert last.usage.completion_tokens == 8 and last.spec.verify_steps > 0
    assert len(last.spec.accepted_per_position) == 2  # num_steps from the command line
    client.close()
