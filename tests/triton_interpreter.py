"""Running a test module's kernels under Triton's CPU interpreter: in a child process (the
interpreter is chosen when Triton is imported), which prints its findings as JSON on its last line."""

import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


def interpreter_findings(module: str) -> dict:
    """`python -m module` with `TRITON_INTERPRET=1`: the JSON of its last line (skipped without
    Triton)."""
    if importlib.util.find_spec("triton") is None:
        pytest.skip("needs triton")
    run = subprocess.run(
        [sys.executable, "-m", module],
        cwd=ROOT,
        env={**os.environ, "TRITON_INTERPRET": "1"},
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert run.returncode == 0, run.stderr[-4000:]
    return json.loads(run.stdout.splitlines()[-1])
