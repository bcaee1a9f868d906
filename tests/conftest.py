import importlib.util
import os
import subprocess
import sys

import pytest

# One torch thread a test process: the suite's tensors are tiny, so a second thread only spins,
# taking a core from the Ray processes a test starts. Set before torch starts its thread pool;
# subprocesses a test starts inherit it.
os.environ.setdefault("OMP_NUM_THREADS", "1")

import torch  # noqa: E402

torch.set_num_threads(int(os.environ["OMP_NUM_THREADS"]))  # (torch started already if a plugin imported it)

# Every local Ray cluster a test starts keeps its node address on loopback (ops/local_ray.py):
# Ray reads this when it is imported.
os.environ["RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER"] = "0"

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SHARED_RAY = "ray_serve"  # the group of the modules sharing one Ray cluster
HOW_TO_FIX = "fix with `ruff check --fix . && ruff format .` from the repository root, then what remains by hand"


def pytest_sessionstart(session):
    """The whole suite (the README's test command, CI) starts with the linter and the formatter
    check, so a style problem fails in seconds and says how to fix it. A run of chosen tests
    (explicit paths) skips it, and so do the workers of a distributed run (their controller runs it)."""
    if hasattr(session.config, "workerinput"):
        return
    if session.config.args != [os.path.join(ROOT, "tests")] and session.config.args != ["tests"]:
        return
    if importlib.util.find_spec("ruff") is None:
        pytest.exit("lint: ruff is not installed; install the test extra: pip install -e '.[test]'", returncode=1)
    for check in (["check", "."], ["format", "--check", "."]):
        done = subprocess.run([sys.executable, "-m", "ruff", *check], cwd=ROOT, capture_output=True, text=True)
        if done.returncode != 0:
            report = f"{done.stdout}{done.stderr}"
            pytest.exit(f"lint: `ruff {' '.join(check)}` failed:\n{report}\n{HOW_TO_FIX}", returncode=1)


@pytest.hookimpl(optionalhook=True)  # pytest-xdist's (the test extra has it; the GPU machine may not)
def pytest_xdist_auto_num_workers(config):
    """`-n auto` (the README's test command): one worker per core on a machine without CUDA; none
    with CUDA, where the GPU tests share one device and run in one process."""
    return 0 if torch.cuda.is_available() else len(os.sched_getaffinity(0))


@pytest.hookimpl(tryfirst=True)  # before xdist's worker names the groups in the test ids
def pytest_collection_modifyitems(config, items):
    """The modules sharing the `ray_serve` cluster (tests/cluster/conftest.py) run first and one
    after another, by one worker of a distributed run (`--dist loadgroup`): the cluster then
    starts once and stops before the modules that start Ray clusters of their own. Every other
    module is a group of its own, so that its module fixtures (engines, clusters, rank groups)
    are made once. Without CUDA, the GPU tests are skipped."""
    module_of = {item: getattr(item, "module", None) for item in items}
    shares = {module_of[item] for item in items if "ray_serve" in getattr(item, "fixturenames", ())}
    items[:] = sorted(items, key=lambda item: module_of[item] not in shares)
    for item in items:
        group = SHARED_RAY if module_of[item] in shares else item.path.relative_to(ROOT).as_posix()
        item.add_marker(pytest.mark.xdist_group(group))
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA device")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)
