"""Running a test module's kernels under Triton's CPU interpreter: in a child process (the
interpreter is chosen when Triton is imported), which prints its findings as JSON on its last line."""

import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

ROOT = Path(__file__).resolve().parents[1]


def interpreter_findings(module: str, timeout: float = 600) -> dict:
    """`python -m module` with `TRITON_INTERPRET=1`: the JSON of its last line (skipped without
    Triton); `timeout` seconds at most."""
    if importlib.util.find_spec("triton") is None:
        pytest.skip("needs triton")
    run = subprocess.run(
        [sys.executable, "-m", module],
        cwd=ROOT,
        # no programmatic dependent launch: the interpreter has no grid-dependency control, and a
        # machine with a Hopper GPU would otherwise turn it on (attention/kernels/launch.py)
        env={**os.environ, "TRITON_INTERPRET": "1", "SLIDESPEC_PDL": "0"},
        capture_output=True,
        text=True,
        timeout=timeout,
    )
    assert run.returncode == 0, run.stderr[-4000:]
    return json.loads(run.stdout.splitlines()[-1])


def as_the_gpu_does() -> None:
    """Make the interpreter handle bfloat16 as the GPU does (it keeps bfloat16 as its bits,
    uint16): float32 -> bfloat16 rounds to nearest even, and arithmetic and `tl.dot` read the
    operands' values; float32 -> FP8 (e4m3) rounds to nearest even too (the interpreter's own
    cast rounded 2% of random values the other way); and let a scalar argument bound a `range`
    loop, as it does compiled."""
    import triton.language as tl
    from triton.runtime import interpreter

    builder = interpreter.InterpreterBuilder
    cast, binary, dot, to_fp = builder.cast_impl, builder.binary_op, builder.create_dot, builder.create_fp_to_fp

    def to_bits(values: np.ndarray) -> np.ndarray:
        rounded = torch.from_numpy(np.ascontiguousarray(values, dtype=np.float32)).to(torch.bfloat16)
        return rounded.view(torch.int16).numpy().view(np.uint16)

    def values(bits: np.ndarray) -> np.ndarray:
        return (bits.astype(np.uint32) << 16).view(np.float32)

    def as_values(t):
        return interpreter.TensorHandle(values(t.data), tl.float32) if t.dtype.scalar == tl.bfloat16 else t

    def to_fp8_bits(values: np.ndarray) -> np.ndarray:
        rounded = torch.from_numpy(np.ascontiguousarray(values, dtype=np.float32)).to(torch.float8_e4m3fn)
        return rounded.view(torch.uint8).numpy()

    def fp_to_fp(self, src, dst_type, rounding_mode):
        if src.dtype.scalar != tl.float32 or dst_type.scalar != tl.float8e4nv:
            return to_fp(self, src, dst_type, rounding_mode)
        return interpreter.TensorHandle(to_fp8_bits(src.data), tl.float8e4nv)

    def cast_impl(self, src, dst_type):
        if src.dtype.scalar != tl.float32 or dst_type.scalar != tl.bfloat16:
            return cast(self, src, dst_type)
        return interpreter.TensorHandle(to_bits(src.data), tl.bfloat16)

    def binary_op(self, lhs, rhs, op):
        if lhs.dtype.scalar != tl.bfloat16 or rhs.dtype.scalar != tl.bfloat16:
            return binary(self, lhs, rhs, op)
        return interpreter.TensorHandle(to_bits(op(values(lhs.data), values(rhs.data))), tl.bfloat16)

    def create_dot(self, a, b, d, input_precision, max_num_imprecise_acc):
        return dot(self, as_values(a), as_values(b), d, input_precision, max_num_imprecise_acc)

    builder.cast_impl, builder.binary_op, builder.create_dot = cast_impl, binary_op, create_dot
    builder.create_fp_to_fp = fp_to_fp
    patch_tensor = interpreter._patch_lang_tensor

    def patch_lang_tensor(tensor, scope) -> None:
        """A scalar (a one-element array there) as a loop bound: `int()` of a one-element array,
        which NumPy 2.4 refuses; `.item()` reads the same value."""
        patch_tensor(tensor, scope)
        scope.set_attr(tensor, "__index__", lambda self: int(self.handle.data.item()))

    interpreter._patch_lang_tensor = patch_lang_tensor
