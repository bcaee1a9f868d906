"""A Ray head node of a test's own, and the Ray and Serve command lines run against it.

The head starts the documented way, `ops/ray_loopback_head.sh` (`ray start --head` with every
process on 127.0.0.1), with `--block`, in its own session and temp dir, and is stopped by
signalling that process, never by `ray stop` (which stops every Ray cluster of the user on the
machine). Each head has a token of its own (`RAY_AUTH_TOKEN` in its environment and the CLI's):
token authentication needs one, and a fresh machine has no `~/.ray/auth_token`.
"""

from __future__ import annotations

import os
import secrets
import shutil
import signal
import subprocess
import sys
import tempfile
import time

import requests

from tests.cluster.conftest import free_port

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
BIN = os.path.dirname(sys.executable)
LOOPBACK_HEAD = os.path.join(ROOT, "ops", "ray_loopback_head.sh")
TOKEN_ENV = {"RAY_AUTH_MODE": "token", "RAY_USAGE_STATS_ENABLED": "0"}
# A Ray client that connects by GCS address (`serve run`, `serve start`) keeps 127.0.0.1 only with
# this, as the head's processes do (ops/ray_loopback_head.sh says why)
LOOPBACK_ENV = {"RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER": "0"}
SERVE_API = "/api/serve/applications/"  # the dashboard's Serve REST API, which the Serve CLI calls
POLL_S = 0.25  # waits ask the dashboard this often (a request, not a CLI process: no Ray import)


def run_cli(*args: str, env: dict, timeout: int = 120) -> subprocess.CompletedProcess:
    """A command of this environment (`ray`, `serve`, `slidespec`), from the repository root."""
    return subprocess.run(
        [os.path.join(BIN, args[0]), *args[1:]], env=env, capture_output=True, text=True, timeout=timeout, cwd=ROOT
    )


def start_cli(*args: str, env: dict, log_path: str) -> subprocess.Popen:
    """A long-running command (`serve run`) in its own session, its output to a file."""
    return subprocess.Popen(
        [os.path.join(BIN, args[0]), *args[1:]],
        env=env,
        cwd=ROOT,
        stdout=open(log_path, "w"),
        stderr=subprocess.STDOUT,
        start_new_session=True,
    )


def stop_process(process: subprocess.Popen, sig: int = signal.SIGTERM, timeout: float = 60) -> None:
    if process.poll() is None:
        process.send_signal(sig)
        try:
            process.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            os.killpg(process.pid, signal.SIGKILL)
            process.wait()


class Head:
    def __init__(self, num_cpus: int = 8) -> None:
        self.token = secrets.token_hex(32)
        path = BIN + os.pathsep + os.environ.get("PATH", "")  # the script's `ray` is this environment's
        self.env = {**os.environ, **TOKEN_ENV, **LOOPBACK_ENV, "RAY_AUTH_TOKEN": self.token, "PATH": path}
        gcs, dashboard = free_port(), free_port()
        self.temp_dir = tempfile.mkdtemp(prefix="ray", dir="/tmp")  # short: socket paths must fit 107 bytes
        self.process = subprocess.Popen(
            [
                LOOPBACK_HEAD,
                "--block",
                "--num-cpus",
                str(num_cpus),
                "--port",
                str(gcs),
                "--dashboard-port",
                str(dashboard),
                "--temp-dir",
                self.temp_dir,
                "--disable-usage-stats",
            ],
            env=self.env,
            cwd=ROOT,
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
            start_new_session=True,
        )
        self.gcs_address = f"127.0.0.1:{gcs}"
        self.address = f"http://127.0.0.1:{dashboard}"

    def wait_up(self, timeout: float = 120) -> None:
        deadline = time.monotonic() + timeout
        while self.serve_details() is None:
            assert self.process.poll() is None, "ray start --head exited"
            assert time.monotonic() < deadline, "the head node did not come up"
            time.sleep(POLL_S)

    def up(self) -> bool:
        return run_cli("serve", "status", "-a", self.address, env=self.env, timeout=60).returncode == 0

    def status(self) -> str:
        """`serve status`'s output; its error output where it fails (an empty answer says nothing)."""
        done = run_cli("serve", "status", "-a", self.address, env=self.env, timeout=60)
        assert done.returncode == 0 and done.stdout, f"serve status: rc {done.returncode}: {done.stderr[-2000:]}"
        return done.stdout

    def wait_running(self, timeout: float = 240) -> None:
        """Until an application's status is RUNNING, as `serve status` would print it."""
        deadline, details = time.monotonic() + timeout, None
        while time.monotonic() < deadline:
            details = self.serve_details()
            if details and any(app["status"] == "RUNNING" for app in details["applications"].values()):
                return
            time.sleep(POLL_S)
        raise AssertionError(f"the application did not reach RUNNING:\n{details}")

    def shutdown_serve(self, timeout: float = 120) -> None:
        """Shut Serve down as `serve shutdown -y` asks the dashboard to, then wait until the
        Serve controller is gone. The request returns when the dashboard's `serve.shutdown()`
        does, and that waits at most 30 s for the controller to exit; the controller may take
        longer (Ray Serve 2.60 gives each tier of deployments up to
        `RAY_SERVE_SHUTDOWN_TIER_TIMEOUT_S`, 30 s, and a replica that never got its resources
        holds its tier that long). A `serve start` or `serve run` in that window connects to the
        old controller, which then kills itself (`ActorDiedError: ... killed by ray.kill`)."""
        r = requests.delete(f"{self.address}{SERVE_API}", headers=self._auth(), timeout=120)
        assert r.status_code == 200, r.text
        deadline = time.monotonic() + timeout
        while self.serve_controller():
            assert time.monotonic() < deadline, f"the Serve controller still runs {timeout:.0f} s after shutdown"
            time.sleep(POLL_S)

    def serve_details(self) -> dict | None:
        """What `serve status` reads from the dashboard (controller, proxies, applications); None
        while the dashboard does not answer."""
        try:
            r = requests.get(f"{self.address}{SERVE_API}", headers=self._auth(), timeout=60)
        except requests.ConnectionError:
            return None
        return r.json() if r.status_code == 200 else None

    def serve_controller(self) -> dict:
        """The Serve controller as the dashboard reports it (its node, node IP, actor); empty
        when none runs."""
        r = requests.get(f"{self.address}{SERVE_API}", headers=self._auth(), timeout=60)
        assert r.status_code == 200, r.text
        return r.json()["controller_info"]

    def _auth(self) -> dict[str, str]:
        return {"Authorization": f"Bearer {self.token}"}

    def stop(self) -> None:
        stop_process(self.process)
        shutil.rmtree(self.temp_dir, ignore_errors=True)
