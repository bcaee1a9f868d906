"""The README's main job, `slidespec demo`, runs end to end (small settings) in a fresh process."""

import os
import subprocess
import sys


def test_demo_runs(tmp_path):
    bin_dir = os.path.dirname(sys.executable)
    done = subprocess.run(
        [
            os.path.join(bin_dir, "slidespec"),
            "demo",
            "--requests",
            "3",
            "--max-new-tokens",
            "16",
            "--trace-dir",
            str(tmp_path / "traces"),
        ],
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    out = done.stdout
    assert "3 requests, 48 tokens" in out and "mean accept length" in out
    assert "slidespec_spec_accept_length" in out and "verify results in" in out
    assert os.path.isfile(tmp_path / "traces" / "accept_length.png")
