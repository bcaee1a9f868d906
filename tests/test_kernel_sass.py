"""ops/bench/kernel_sass.py counts a compiled loop's instructions per weight byte (needs triton
and its `cuobjdump`; skipped without them)."""

import pytest

triton = pytest.importorskip("triton")

from ops.bench import kernel_sass  # noqa: E402


def test_loops_are_found_and_counted_per_weight_byte():
    if kernel_sass.tool() is None:
        pytest.skip("needs cuobjdump")
    cases = kernel_sass.cases()
    bf16 = kernel_sass.loop(cases["gpt-oss-20b/experts_down/bf16"])
    mxfp4 = kernel_sass.loop(cases["gpt-oss-20b/experts_down/mxfp4"])
    # a bf16 tile row of 256 elements over 128 threads: 16 bytes a thread, loaded as one vector
    assert bf16["bytes_per_thread"] == 16 and 8 <= bf16["loop_instructions"] < 200, bf16
    # the codes' decode costs instructions a bf16 load does not; neither kernel spills
    assert mxfp4["instructions_per_byte"] > 2 * bf16["instructions_per_byte"], (mxfp4, bf16)
    assert bf16["stack"] == mxfp4["stack"] == 0
