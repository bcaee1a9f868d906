"""`slidespec serve` as a user runs it: the shipped tiny model with its EAGLE draft on the CPU
answers the official `openai` client (a completion, a streamed chat, a 400 for a bad
temperature) and the gRPC client, prints its URLs once ready, listens on loopback only (the Ray
it started too), and exits with status 0 on SIGINT
leaving no Ray process of its own behind; bad settings end it at once with one line naming the
flag and status 2."""

import os
import re
import signal
import subprocess
import sys
import threading
import time

import openai
import psutil
import pytest
import ray

from cluster.client import GenerationClient
from ops import DEFAULT_MODEL, DRAFT_MODELS
from ops.cli import main
from tests.cluster.conftest import free_port
from tests.cluster.sockets import descendants, is_loopback, sockets_of

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
MODEL = os.path.basename(DEFAULT_MODEL)


def _slidespec(*args: str) -> list[str]:
    return [sys.executable, "-m", "ops.cli", *args]


@pytest.mark.parametrize(
    "args, message",
    [
        (["/no/such/model"], "model: '/no/such/model' is neither a directory nor a shipped model"),
        ([MODEL, "--grpc-port", "many"], "--grpc-port: Input should be a valid integer"),
        ([MODEL, "--speculative-algorithm", "guess"], "--speculative-algorithm: Input should be 'standalone'"),
        ([MODEL, "--speculative-algorithm", "eagle"], "--speculative-draft-model: Field required"),
        ([MODEL, "--quantization", "int8"], "--quantization: Input should be 'fp8'"),
        ([MODEL, "--config", "/no/such/serve.yaml"], "--config: cannot read /no/such/serve.yaml"),
        ([MODEL, "--api-key-file", "ops/serve.yaml"], "--grpc-auth-token-file: ops/serve.yaml must hold one word"),
        ([MODEL, "--grpc-tls-cert-file", "ops/serve.yaml"], "--grpc-tls-cert-file / --grpc-tls-key-file: give both"),
        ([], "model: give a model directory"),
    ],
)
def test_bad_settings_end_it_at_once_naming_the_flag(args, message, capsys, monkeypatch):
    def started(*args, **kwargs):
        raise AssertionError("a bad setting started Ray")

    monkeypatch.chdir(ROOT)
    monkeypatch.setattr(ray, "init", started)  # refused before any Ray starts
    assert main(["serve", *args]) == 2
    out, err = capsys.readouterr()
    assert message in err and "Traceback" not in err, err
    assert "deploying" not in out


class Served:
    """A `slidespec serve` process and every line it printed so far."""

    def __init__(self, args: list[str]) -> None:
        self.process = subprocess.Popen(
            _slidespec("serve", *args),
            cwd=ROOT,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
            start_new_session=True,  # a signal to the test's group does not reach it
            # as from a terminal: SIGINT not ignored, even where the test runs as a background job
            preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL),
        )
        self.lines: list[str] = []
        self._reader = threading.Thread(target=self._read, daemon=True)
        self._reader.start()

    def kill(self) -> None:
        """Kill it and the Ray it started (its session's processes)."""
        os.killpg(self.process.pid, signal.SIGKILL)
        self.process.wait()

    def _read(self) -> None:
        for line in self.process.stdout:
            self.lines.append(line.rstrip("\n"))

    def wait_for(self, pattern: str, limit_s: float) -> re.Match:
        deadline = time.monotonic() + limit_s
        while time.monotonic() < deadline:
            for line in list(self.lines):
                if found := re.search(pattern, line):
                    return found
            assert self.process.poll() is None, "\n".join(self.lines)
            time.sleep(0.2)
        raise AssertionError(f"no line matched {pattern!r}:\n" + "\n".join(self.lines))


def test_serve_answers_openai_and_grpc_clients_and_stops_cleanly_on_sigint():
    http = free_port()
    served = Served(
        [
            "ops/models/tiny-gemma3",
            "--speculative-algorithm",
            "eagle",
            "--draft-model",
            os.path.relpath(DRAFT_MODELS["eagle"], ROOT),
            "--port",
            str(http),
            "--grpc-port",
            "0",  # any free port: the printed target names it
            "--max-total-tokens",
            "4096",
        ]
    )
    try:
        base = served.wait_for(r"OpenAI API\s+(http://\S+/v1)$", 240).group(1)
        assert base == f"http://127.0.0.1:{http}/v1"
        target = served.wait_for(r"gRPC\s+(\S+)$", 5).group(1)
        host, grpc_port = target.rsplit(":", 1)
        assert host == "127.0.0.1" and int(grpc_port) > 0
        grpc_port = int(grpc_port)
        assert any("engine start-up: ready in" in line for line in served.lines)  # progress reached the terminal

        client = openai.OpenAI(base_url=base, api_key="unused", max_retries=0, timeout=60)
        completion = client.completions.create(model=MODEL, prompt="def f(x):", max_tokens=6, temperature=0)
        assert completion.usage.completion_tokens == 6 and completion.choices[0].text
        chunks = list(
            client.chat.completions.create(
                model=MODEL, messages=[{"role": "user", "content": "hi"}], max_tokens=6, temperature=0, stream=True
            )
        )
        assert chunks[-1].choices[0].finish_reason in ("length", "stop")
        assert "".join(c.choices[0].delta.content or "" for c in chunks)
        with pytest.raises(openai.BadRequestError) as bad:
            client.completions.create(model=MODEL, prompt="x", max_tokens=2, temperature=-1)
        assert bad.value.body["param"] == "temperature"

        grpc_client = GenerationClient(target)
        tokens = [t for r in grpc_client.generate("import os", max_new_tokens=5, temperature=0.0) for t in r.token_ids]
        grpc_client.close()
        assert len(tokens) == 5

        own = psutil.Process(served.process.pid).children(recursive=True)
        assert any("raylet" in " ".join(p.cmdline()) for p in own if p.is_running())
        sockets = sockets_of(descendants(served.process.pid))  # the Ray it started, Serve's proxy, gRPC
        assert {http, grpc_port} <= {port for _, port in sockets}, sockets
        wide = [name for (address, _), name in sockets.items() if not is_loopback(address)]
        # the one documented exception (docs/deploy.md): each Serve replica's inter-deployment
        # gRPC server, which Ray Serve 2.60 binds to [::] whatever the node's address
        replicas = {"ray::ServeReplica:slidespec:GrpcIngress", "ray::ServeReplica:slidespec:LLMServer"}
        assert sorted(wide) == sorted(replicas), f"listening beyond loopback: {sockets}"
    except BaseException:
        served.kill()
        raise
    served.process.send_signal(signal.SIGINT)
    try:
        status = served.process.wait(timeout=120)
    except subprocess.TimeoutExpired:
        served.kill()
        raise AssertionError("still running 120 s after SIGINT:\n" + "\n".join(served.lines)) from None
    assert status == 0, "\n".join(served.lines)
    deadline = time.monotonic() + 30
    while alive := [p for p in own if p.is_running() and p.status() != psutil.STATUS_ZOMBIE]:
        assert time.monotonic() < deadline, [" ".join(p.cmdline())[:120] for p in alive]
        time.sleep(0.5)


def test_a_serve_config_gives_the_settings_and_flags_override_them(monkeypatch, tmp_path):
    from ops.cli import build_parser
    from ops.serve import app_settings

    monkeypatch.chdir(ROOT)
    args = build_parser().parse_args(
        ["serve", "--config", "ops/serve.yaml", "--grpc-port", "50999", "--no-enable-prefix-caching", "--port", "8100"]
    )
    cfg, http = app_settings(args)
    assert (cfg.tp_size, cfg.router.policy, cfg.speculative.algorithm) == (2, "cache_aware", "eagle")  # the config's
    assert (cfg.grpc.port, cfg.grpc.host, cfg.enable_prefix_caching) == (50999, "127.0.0.1", False)  # the flags'
    assert http == {"host": "127.0.0.1", "port": 8100} and cfg.device == "cpu"
    token = tmp_path / "token"
    token.write_text("s3cret\n")
    args = build_parser().parse_args(["serve", MODEL, "--api-key-file", str(token), "--num-replicas", "auto"])
    cfg, _ = app_settings(args)
    assert cfg.grpc.auth_token_file == str(token) and cfg.num_replicas == "auto" and cfg.speculative is None


def test_quantization_reaches_every_rank_as_vllm_spells_it(monkeypatch):
    from ops.cli import build_parser
    from ops.serve import app_settings

    monkeypatch.chdir(ROOT)
    cfg, _ = app_settings(build_parser().parse_args(["serve", MODEL, "--quantization", "fp8"]))
    assert cfg.engine_args().engine_kwargs()["quantization"] == "fp8"
