"""The decode GEMVs' inner loops as Hopper runs them: SASS instructions per weight byte, counted
from the compiled kernel, no GPU needed.

    python -m ops.bench.kernel_sass [--record]

A GEMV is fast when its loads keep DRAM busy, and that needs the instructions a weight byte costs
to issue within the byte's share of a cycle: an H200 SM reads about 16 bytes a cycle and issues
128 thread instructions, so past about 8 instructions a byte the loop, not memory, sets the pace.
Weights read as stored and widened in registers (FP8, MXFP4) spend instructions on the decode;
this counts them for each kernel at its table's tile, compiled for sm_90 as launched (sizes
divisible by 16, so loads are vectors): the loop is the kernel's longest backward branch, the
bytes those one thread's iteration reads. Also the registers and stack a thread uses. Needs
triton with its CUDA tools (`cuobjdump`); timings are `gemv_bandwidth.py`'s and `decode_step.py`'s.
"""

from __future__ import annotations

import argparse
import dataclasses
import re
import shutil
import subprocess
import tempfile
from pathlib import Path

import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource

from ops.bench.record import add_record_args, record_run
from workers.models import fp8_gemv, fused_moe, gemv_tiles

COLUMNS = ["loop_instructions", "bytes_per_thread", "instructions_per_byte", "registers", "stack"]
HOPPER = GPUTarget("cuda", 90, 32)
# sizes a launch passes divisible by 16 (Triton specialises them): the loads' vector width rests on them
DIVISIBLE = {"K", "N", "stride_we", "stride_wn", "stride_se", "stride_x", "stride_h", "stride_be", "stride_y"}
# the split-KV decode's: multiples of a head (64 to 512 features)
DIVISIBLE |= {f"stride_{t}_{d}" for t in "qkvo" for d in ("row", "head")} | {"stride_page", "stride_kv", "stride_head"}
LINE = re.compile(r"\s+/\*([0-9a-f]{4})\*/\s+(.*?);")


@dataclasses.dataclass(frozen=True)
class Case:
    """A kernel at one tile: `types` its pointer arguments' element types, `bytes` the weight
    bytes one thread reads an iteration of its loop."""

    module: object
    kernel: str
    constexprs: dict
    warps: int
    types: dict
    bytes: int


def _moe_case(kernel: str, w4: bool) -> Case:
    tile = gemv_tiles.moe_tile_for(kernel + ("_mxfp4" if w4 else ""), 2880)  # gpt-oss-20b's experts
    name = "_gemv_gate_up" if kernel == "gate_up" else "_gemv_down"
    streams = 2 if kernel == "gate_up" else 1  # the gate's and the up projection's rows
    preload = 0 if w4 else gemv_tiles.preload_width(tile, 2880, streams)  # as `fused_experts` launches it
    flags = dict(HAS_BIAS=True, HAS_MAP=False, W4=w4, BLOCK_N=tile.rows, BLOCK_K=tile.cols, PRELOAD_K=preload, PDL=2)
    flags.update(ACT=1) if kernel == "gate_up" else flags.update(TOP_K_PAD=4)
    types = {"w_ptr": "*u8", "s_ptr": "*u8"} if w4 else {}
    per_element = 0.5 if w4 else 2
    return Case(
        fused_moe,
        name,
        flags,
        tile.warps,
        types,
        int(streams * tile.rows * tile.cols * per_element / (32 * tile.warps)),
    )


def _fp8_case(out_features: int, in_features: int, act: bool) -> Case:
    """`fp8_gemv`'s one-row kernel, a scale per output channel, at its table's tile."""
    rows = out_features * (2 if act else 1)  # a merged gate/up weight's
    tile = gemv_tiles.fp8_tile_for(rows, in_features, 1, None)
    scale_k = min(tile.cols, fp8_gemv.CHANNEL_SUM)
    flags = dict(
        HAS_BIAS=False, ACT=0 if act else -1, BLOCK_N=tile.rows, BLOCK_K=tile.cols, GROUPS=tile.cols // scale_k,
        SCALE_N=1, SCALE_K=scale_k, BLOCKED=False, EVEN_K=in_features % tile.cols == 0, PDL=2,
    )  # fmt: skip
    types = {"w_ptr": "*fp8e4nv", "s_ptr": "*fp32"}
    streams = 2 if act else 1
    return Case(
        fp8_gemv, "_fp8_gemv_kernel", flags, tile.warps, types, streams * tile.rows * tile.cols // (32 * tile.warps)
    )


def cases() -> dict[str, Case]:
    """Batch-1 decode kernels that widen weights or read them in bf16 for comparison:
    gpt-oss-20b's experts in bf16 and MXFP4, the 8B shape's down and gate/up projections in FP8."""
    return {
        "gpt-oss-20b/experts_gate_up/bf16": _moe_case("gate_up", False),
        "gpt-oss-20b/experts_down/bf16": _moe_case("down", False),
        "gpt-oss-20b/experts_gate_up/mxfp4": _moe_case("gate_up", True),
        "gpt-oss-20b/experts_down/mxfp4": _moe_case("down", True),
        "llama3-8b/down/fp8": _fp8_case(4096, 14336, False),
        "llama3-8b/gate_up+act/fp8": _fp8_case(14336, 4096, True),
    }


def _type(name: str, case: Case) -> str:
    """An argument's type in the signature: the case's pointers, else float32 scalars for the
    activation's parameters, bf16 pointers and int32 sizes."""
    if name in case.types:
        return case.types[name]
    if name in ("ids_ptr", "map_ptr"):
        return "*i64"
    if name in ("y_ptr", "weights_ptr"):
        return "*fp32"
    if name == "counter_ptr":
        return "*i32"
    return "*bf16" if name.endswith("_ptr") else "fp32" if name in ("alpha", "limit") else "i32"


def tool() -> str | None:
    """triton's `cuobjdump`, else one on the path (None: neither)."""
    shipped = Path(triton.__file__).parent / "backends" / "nvidia" / "bin" / "cuobjdump"
    return str(shipped) if shipped.exists() else shutil.which("cuobjdump")


def launch_hints(fn: object, constexprs: dict) -> dict:
    """The divisibility Triton specialises at launch for the models' shapes: pointers and the
    sizes in DIVISIBLE by 16 (compiled without it, loads are scalar and register counts differ)."""
    return {
        (i,): [["tt.divisibility", 16]]
        for i, a in enumerate(fn.arg_names)
        if a not in constexprs and (a.endswith("_ptr") or a in DIVISIBLE)
    }


def compiled(fn: object, signature: dict, constexprs: dict, warps: int, hints: dict | None = None) -> tuple[str, str]:
    """A Triton kernel compiled for sm_90: (`cuobjdump`'s resource usage, its SASS)."""
    kernel = triton.compile(ASTSource(fn, signature, constexprs, hints), target=HOPPER, options={"num_warps": warps})
    with tempfile.TemporaryDirectory() as tmp:
        cubin = Path(tmp) / "kernel.cubin"
        cubin.write_bytes(kernel.asm["cubin"])
        usage = subprocess.run(
            [tool(), "--dump-resource-usage", str(cubin)], capture_output=True, text=True, check=True
        ).stdout
        sass = subprocess.run([tool(), "-sass", str(cubin)], capture_output=True, text=True, check=True).stdout
    return usage, sass


def loop(case: Case) -> dict:
    """The case compiled for sm_90 as launched: its longest loop's instruction count, per weight
    byte a thread reads there, and the thread's registers and stack."""
    fn = getattr(case.module, case.kernel)
    signature = {a: "constexpr" if a in case.constexprs else _type(a, case) for a in fn.arg_names}
    usage, sass = compiled(fn, signature, case.constexprs, case.warps, launch_hints(fn, case.constexprs))
    code = [(int(m.group(1), 16), m.group(2)) for m in map(LINE.match, sass.splitlines()) if m]
    back = [
        (int(b.group(1), 16), at)
        for at, text in code
        if (b := re.search(r"BRA 0x([0-9a-f]+)", text)) and int(b.group(1), 16) < at
    ]
    start, end = max(back, key=lambda span: span[1] - span[0])
    count = sum(start <= at <= end for at, _ in code)
    return {
        "loop_instructions": count,
        "bytes_per_thread": case.bytes,
        "instructions_per_byte": count / case.bytes,
        "registers": int(re.search(r"REG:(\d+)", usage).group(1)),
        "stack": int(re.search(r"STACK:(\d+)", usage).group(1)),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_record_args(parser)
    args = parser.parse_args()
    figures = {name: loop(case) for name, case in cases().items()}
    for name, row in figures.items():
        print(
            f"{name:<38} {row['loop_instructions']:>5} instructions, {row['bytes_per_thread']:>4} bytes: "
            f"{row['instructions_per_byte']:.1f} a byte (registers {row['registers']}, stack {row['stack']})"
        )
    record_run(args, "kernel_sass", figures, COLUMNS, device="cpu")


if __name__ == "__main__":
    main()
