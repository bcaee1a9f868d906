"""The documentation runs: every python/sh/bash block of README.md and docs/*.md carries a marker
on the line before it, and the blocks marked to run do run, so the pages cannot drift from the
code.

Markers (one line, right before the block's opening fence):

- `<!-- run: cpu -->`: run as it is on a CPU machine (python with the repository root as the
  working directory; sh and bash with `bash -euo pipefail` in a new temporary directory, the
  repository root in `$REPO_ROOT`);
- `<!-- run: server -->`: run against one slidespec application on the shipped tiny model with
  its EAGLE draft, started for this module, with `127.0.0.1:8000` and `127.0.0.1:50051` in the
  block replaced by the ports it listens on; its sh blocks run in the directory whose `traces/`
  holds the application's trace files;
- `<!-- norun: REASON -->`: never run (it needs a GPU, a cluster, root, runs in the foreground...).

Each block is one test case, named by its page and line.
"""

from __future__ import annotations

import dataclasses
import os
import re
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.cluster.conftest import free_port, start_local_ray

REPO = Path(__file__).resolve().parent.parent
PAGES = [REPO / "README.md", *sorted((REPO / "docs").glob("*.md"))]
EXECUTABLE = ("python", "sh", "bash")
MODES = ("cpu", "server")
MARKER = re.compile(r"^<!--\s*(?:run:\s*(?P<mode>\S+)|norun:\s*(?P<reason>.*?))\s*-->$")
FENCE = re.compile(r"^(?P<indent>\s*)(?P<fence>`{3,}|~{3,})(?P<info>.*)$")
HTTP_IN_DOCS, GRPC_IN_DOCS = "127.0.0.1:8000", "127.0.0.1:50051"
BLOCK_TIMEOUT_S = 300
READY_TIMEOUT_S = 120


@dataclasses.dataclass(frozen=True)
class Block:
    page: Path
    line: int  # of the opening fence, 1-based
    language: str
    marker: str | None  # the line before the fence, when it is a marker comment
    code: str

    @property
    def name(self) -> str:
        return f"{self.page.relative_to(REPO)}:{self.line}"

    @property
    def mode(self) -> str | None:
        """`cpu` or `server` for a block to run, None for `norun` or no valid marker."""
        found = MARKER.match(self.marker or "")
        return found["mode"] if found and found["mode"] in MODES else None

    def marker_problem(self) -> str | None:
        """Why this block's marker does not do, or None."""
        if self.language not in EXECUTABLE:
            return None
        found = MARKER.match(self.marker or "")
        if found is None:
            return f"{self.name}: a ```{self.language} block without a marker on the line before it"
        if found["mode"] is not None and found["mode"] not in MODES:
            return f"{self.name}: unknown marker 'run: {found['mode']}' (run: cpu, run: server or norun: REASON)"
        if found["mode"] is None and not found["reason"]:
            return f"{self.name}: 'norun:' without a reason"
        return None


def fenced_blocks(page: Path) -> Iterator[Block]:
    """Every fenced code block of a Markdown page, with the line before its opening fence."""
    lines = page.read_text(encoding="utf-8").splitlines()
    i = 0
    while i < len(lines):
        opening = FENCE.match(lines[i])
        if opening is None:
            i += 1
            continue
        indent, fence = opening["indent"], opening["fence"]
        language = opening["info"].strip().split(" ")[0].lower()
        body, j = [], i + 1
        while j < len(lines):
            closing = FENCE.match(lines[j])
            if closing and closing["fence"].startswith(fence) and not closing["info"].strip():
                break
            body.append(lines[j][len(indent) :] if lines[j].startswith(indent) else lines[j].lstrip())
            j += 1
        marker = lines[i - 1].strip() if i > 0 else None
        yield Block(page, i + 1, language, marker, "\n".join(body) + "\n")
        i = j + 1


BLOCKS = [block for page in PAGES for block in fenced_blocks(page)]


def _cases(mode: str) -> list:
    return [pytest.param(b, id=b.name) for b in BLOCKS if b.language in EXECUTABLE and b.mode == mode]


@pytest.mark.parametrize("page", PAGES, ids=lambda p: str(p.relative_to(REPO)))
def test_every_runnable_block_has_a_marker(page):
    problems = [p for b in BLOCKS if b.page == page and (p := b.marker_problem()) is not None]
    problems += [f"{b.name}: a fenced block without a language" for b in BLOCKS if b.page == page and not b.language]
    assert not problems, "\n".join(problems)


LINK = re.compile(r"\]\((?P<target>[^)\s]+)\)")


def _anchor(heading: str) -> str:
    """GitHub's anchor of a heading: lower case, punctuation dropped, spaces as hyphens."""
    return re.sub(r"[^\w\- ]", "", heading.strip().lower()).replace(" ", "-")


def _anchors(page: Path) -> set[str]:
    text = re.sub(r"^```.*?^```", "", page.read_text(encoding="utf-8"), flags=re.M | re.S)
    return {_anchor(m[1]) for m in re.finditer(r"^#+\s+(.*)$", text, flags=re.M)}


@pytest.mark.parametrize("page", PAGES, ids=lambda p: str(p.relative_to(REPO)))
def test_every_link_within_the_repository_resolves(page):
    broken = []
    for found in LINK.finditer(page.read_text(encoding="utf-8")):
        target = found["target"]
        if re.match(r"^[a-z]+:", target):  # http:, https:, mailto:
            continue
        path, _, anchor = target.partition("#")
        linked = (page.parent / path).resolve() if path else page
        if not linked.exists():
            broken.append(f"{target}: no such file")
        elif anchor and linked.suffix == ".md" and anchor not in _anchors(linked):
            broken.append(f"{target}: no heading #{anchor} in {linked.relative_to(REPO)}")
    assert not broken, "\n".join(broken)


def _environment() -> dict[str, str]:
    """This interpreter first on the PATH (`python`, `slidespec`), the checkout importable, and
    the repository root in `$REPO_ROOT`."""
    env = dict(os.environ)
    env["PATH"] = os.pathsep.join([os.path.dirname(sys.executable), env.get("PATH", "")])
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(REPO), env.get("PYTHONPATH")]))
    env["REPO_ROOT"] = str(REPO)
    return env


def run_block(block: Block, code: str, shell_dir: Path) -> None:
    """Run a block's code: python in a subprocess from the repository root, sh and bash with
    `bash -euo pipefail` in `shell_dir`; fail with its output when it exits with an error."""
    if block.language == "python":
        command, cwd = [sys.executable, "-c", code], REPO
    else:
        command, cwd = ["bash", "-euo", "pipefail", "-c", code], shell_dir
    try:
        done = subprocess.run(
            command, cwd=cwd, env=_environment(), capture_output=True, text=True, timeout=BLOCK_TIMEOUT_S
        )
    except subprocess.TimeoutExpired as exc:
        pytest.fail(f"{block.name}: still running after {BLOCK_TIMEOUT_S} s\n{exc.stdout or ''}\n{exc.stderr or ''}")
    if done.returncode != 0:
        pytest.fail(
            f"{block.name}: exit status {done.returncode}\n--- code\n{code}--- stdout\n{done.stdout[-4000:]}"
            f"\n--- stderr\n{done.stderr[-4000:]}"
        )


@pytest.mark.parametrize("block", _cases("cpu"))
def test_cpu_block(block, tmp_path):
    run_block(block, block.code, tmp_path)


@dataclasses.dataclass(frozen=True)
class Server:
    http: str  # host:port of Serve's HTTP proxy
    grpc: str  # host:port of the gRPC API
    workdir: Path  # holds traces/, the application's trace files

    def code_for(self, block: Block) -> str:
        return block.code.replace(HTTP_IN_DOCS, self.http).replace(GRPC_IN_DOCS, self.grpc)


def _wait_until_serving(target: str) -> None:
    """The engine replica is up: the gRPC readiness check says SERVING."""
    from grpc_health.v1 import health_pb2

    from cluster.client import GenerationClient

    client = GenerationClient(target)
    try:
        deadline = time.monotonic() + READY_TIMEOUT_S
        while client.health() != health_pb2.HealthCheckResponse.SERVING:
            assert time.monotonic() < deadline, f"the application was not ready within {READY_TIMEOUT_S} s"
            time.sleep(0.2)
    finally:
        client.close()


@pytest.fixture(scope="module")
def server(tmp_path_factory) -> Iterator[Server]:
    """The shipped tiny model with its EAGLE draft behind the whole stack, on a local Ray cluster
    (loopback only), at the root route prefix, with step traces written to files."""
    import ray
    from ray import serve

    from cluster.app import build_app
    from ops import DEFAULT_MODEL, DRAFT_MODELS

    workdir = tmp_path_factory.mktemp("docs-server")
    start_local_ray()
    try:
        http_port = free_port()
        serve.start(http_options={"host": "127.0.0.1", "port": http_port})
        args = dict(
            model=DEFAULT_MODEL,
            speculative={"algorithm": "eagle", "draft_model": DRAFT_MODELS["eagle"], "num_steps": 4},
            cpus_per_rank=0.5,
            grpc={"port": 0},
            tracing={"exporter": "file", "file_dir": str(workdir / "traces")},
        )
        handle = serve.run(build_app(args), name="docs", route_prefix="/")
        grpc_target = f"127.0.0.1:{handle.ports.remote().result()['grpc']}"
        _wait_until_serving(grpc_target)
        yield Server(http=f"127.0.0.1:{http_port}", grpc=grpc_target, workdir=workdir)
    finally:
        serve.shutdown()
        ray.shutdown()


@pytest.mark.parametrize("block", _cases("server"))
def test_server_block(block, server):
    run_block(block, server.code_for(block), server.workdir)
