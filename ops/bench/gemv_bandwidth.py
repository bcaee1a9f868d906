"""Few-row projections: cuBLAS (`F.linear`) against the Triton GEMV, on model shapes.

    python -m ops.bench.gemv_bandwidth [--rows 1,5] [--sweep] [--weights bf16,fp8,fp8-block] [--out FILE]

Each shape is timed as a CUDA graph of back-to-back calls over enough copies of the weight
(at least 1 GiB in all) that no call finds its weight in L2, which is what a decode step does:
every projection reads its weight once. Reports microseconds a call and the weight-read rate
(TB/s) of cuBLAS, of the GEMV with the tile `workers/models/gemv.py` chooses and, with
`--sweep`, of the best tile of a grid (how the tables were tuned), for each count of input rows
(1: a batch-1 decode step; 5: a batch-1 verify of four draft tokens). `gate_up+act` rows time
the fused gate/up GEMV against cuBLAS plus flashinfer's activation kernel. With FP8 weights
(`--weights fp8`: a scale per output channel; `fp8-block`: per 128 x 128 block) the GEMV is
`fp8_gemv.py`, its tiles from `gemv_tiles.FP8_TILES` / `FP8_ROW_TILES`, and the cuBLAS column is
the W8A8 path larger batches take (`fp8_matmul.linear`: activations quantised, then a scaled GEMM).
"""

from __future__ import annotations

import argparse
import dataclasses
import itertools
import logging

import torch
import torch.nn.functional as F
import triton

from ops.bench.record import add_record_args, record_run, write_out
from ops.bench.xqa_decode_bandwidth import graph_ms
from workers.models import fp8_gemv, fp8_matmul, gemv, gemv_tiles
from workers.models.fp8 import quantize
from workers.models.ops import FLASHINFER_OPS

logger = logging.getLogger(__name__)
COLUMNS = ["cublas_us", "cublas_TBps", "gemv_us", "gemv_TBps", "tile", "best_us", "best_tile"]

# (out_features, in_features) of batch-1 projections; `act` rows are merged gate/up weights
SHAPES = {
    "llama3-8b/qkv": (6144, 4096),
    "llama3-8b/o": (4096, 4096),
    "llama3-8b/gate_up+act": (28672, 4096),
    "llama3-8b/down": (4096, 14336),
    "llama3-8b/lm_head": (128256, 4096),
    "gemma3-1b/qkv": (1536, 1152),
    "gemma3-1b/o": (1152, 1024),
    "gemma3-1b/gate_up+act": (13824, 1152),
    "gemma3-1b/down": (1152, 6912),
    "gemma3-1b/lm_head": (262144, 1152),
    "gemma3-12b/qkv": (8192, 3840),
    "gemma3-12b/o": (3840, 4096),
    "gemma3-12b/gate_up+act": (30720, 3840),
    "gemma3-12b/down": (3840, 15360),
    "gemma3-12b/lm_head": (262144, 3840),
    "gemma4-e4b/qkv": (3072, 2560),
    "gemma4-e4b/qkv_full": (6144, 2560),
    "gemma4-e4b/q_shared": (2048, 2560),
    "gemma4-e4b/o": (2560, 2048),
    "gemma4-e4b/o_full": (2560, 4096),
    "gemma4-e4b/gate_up+act": (20480, 2560),
    "gemma4-e4b/down": (2560, 10240),
    "gemma4-e4b/per_layer_gate": (256, 2560),
    "gemma4-e4b/per_layer_proj": (2560, 256),
    "gemma4-e4b/lm_head": (262144, 2560),
    "gemma4-31b/qkv": (16384, 5376),
    "gemma4-31b/qk_full": (18432, 5376),
    "gemma4-31b/o": (5376, 8192),
    "gemma4-31b/o_full": (5376, 16384),
    "gemma4-31b/gate_up+act": (43008, 5376),
    "gemma4-31b/down": (5376, 21504),
    "gemma4-31b/lm_head": (262144, 5376),
}
SWEEP = [gemv.Tile(*t) for t in itertools.product((4, 8, 16, 32), (128, 256, 512), (4, 8), (2, 4))]
# one row, gate/up: also K unrolled (stages do not apply)
ACT_SWEEP = SWEEP + [
    gemv.Tile(r, c, w, 1, unroll=True) for r, c, w in itertools.product((8, 16, 32), (128, 256), (4, 8))
]
# one row, no activation: K shared between programs
SPLIT_SWEEP = [gemv.Tile(*t) for t in itertools.product((4, 8), (128, 256), (4, 8), (3, 4), (2, 3, 4, 6))] + [
    gemv.Tile(r, c, w, 1, s, unroll=True) for r, c, w, s in itertools.product((4, 8), (128, 256), (4, 8), (1, 3, 6, 12))
]
ROW_SWEEP = [gemv.Tile(*t) for t in itertools.product((16, 32, 64), (64, 128, 256), (4,), (3, 4, 5))]
# FP8 weights: a byte an element, so twice the columns for the bytes; per block, `cols` a multiple
# of the block's 128 (one row) or the block's (more rows: `fp8_tile_for` narrows them)
FP8_SWEEP = [gemv.Tile(*t) for t in itertools.product((2, 4, 8, 16), (1024, 2048, 4096), (4, 8), (2, 3))]
FP8_ROW_SWEEP = [gemv.Tile(*t) for t in itertools.product((16, 32, 64, 128), (128, 256), (4, 8), (3, 5))]
WEIGHTS = {"bf16": None, "fp8": None, "fp8-block": (128, 128)}  # -> the FP8 scales' block


def compiles(call) -> bool:
    """Whether a tile builds on this device (a deep pipeline of wide tiles outgrows shared memory)."""
    try:
        call()
    except triton.runtime.errors.OutOfResources as e:
        logger.info("skipped: %s", e)
        return False
    return True


def measure(name: str, out_features: int, in_features: int, rows: int, sweep: bool, weights: str = "bf16") -> dict:
    fused = name.endswith("+act")
    fp8 = weights != "bf16"
    nbytes = out_features * in_features * (1 if fp8 else 2)
    copies = min(64, max(2, (1 << 30) // nbytes + 1))
    x = torch.randn(rows, in_features, dtype=torch.bfloat16, device="cuda")
    if fp8:
        block = WEIGHTS[weights]
        stored = [quantize(torch.randn(out_features, in_features, device="cuda") * 0.02, block) for _ in range(copies)]
        tile = gemv_tiles.fp8_tile_for(out_features, in_features, rows, block)

        def ours(w, t=None):
            if fused:
                return fp8_gemv.gemv_act_and_mul(x, *w, block, "silu", tile=t)
            return fp8_gemv.gemv(x, *w, block, tile=t)

        def theirs(w):
            out = fp8_matmul.linear(x, *w, block, None)
            return FLASHINFER_OPS.act_and_mul(out, "silu") if fused else out

        grid = FP8_ROW_SWEEP if rows > 1 else FP8_SWEEP
    else:
        stored = [
            torch.randn(out_features, in_features, dtype=torch.bfloat16, device="cuda") * 0.02 for _ in range(copies)
        ]
        tile = gemv.tile_for(out_features, in_features, rows)

        def ours(w, t=None):
            if t is not None:
                return gemv.gemv_act_and_mul(x, w, "silu", tile=t) if fused else gemv.gemv(x, w, tile=t)
            if fused:
                return FLASHINFER_OPS.linear_act_and_mul(x, w, None, "silu")
            return FLASHINFER_OPS.linear(x, w, None)

        def theirs(w):
            return FLASHINFER_OPS.act_and_mul(F.linear(x, w), "silu") if fused else F.linear(x, w)

        grid = ROW_SWEEP if rows > 1 else ACT_SWEEP if fused else SWEEP + SPLIT_SWEEP
    row = {"shape": name, "rows": rows, "weights": weights, "out_features": out_features, "in_features": in_features}
    runs_gemv = tile is not None and rows <= gemv_tiles.MAX_ROWS
    for label, call in (("cublas", theirs), ("gemv", ours)):
        if label == "gemv" and not runs_gemv:
            continue
        us = graph_ms([lambda w=w, call=call: call(w) for w in stored]) * 1e3 / copies
        row[f"{label}_us"] = round(us, 2)
        row[f"{label}_TBps"] = round(nbytes / us / 1e6, 3)
    row["tile"] = dataclasses.astuple(tile) if runs_gemv else "cuBLAS"
    if sweep and runs_gemv:
        if fp8:
            grid = list(dict.fromkeys(gemv_tiles.fit_block(t, rows, block) for t in grid))
        timed = [
            (graph_ms([lambda w=w, t=t: ours(w, t) for w in stored], replays=5) * 1e3 / copies, t)
            for t in grid
            if compiles(lambda t=t: ours(stored[0], t))
        ]
        best = min(timed, key=lambda pair: pair[0])
        row["best_us"], row["best_tile"] = round(best[0], 2), dataclasses.astuple(best[1])
    return row


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--rows", default="1", help="input rows to time, comma-separated (1 to gemv.MAX_ROWS)")
    p.add_argument("--sweep", action="store_true", help="also time every tile of a grid")
    p.add_argument("--shapes", default="", help="only shapes whose names start with one of these, comma-separated")
    p.add_argument("--weights", default="bf16", help=f"the weights' storage, comma-separated, of {', '.join(WEIGHTS)}")
    p.add_argument("--out", default=None)
    add_record_args(p)
    args = p.parse_args()
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    unknown = sorted(set(args.weights.split(",")) - set(WEIGHTS))
    if unknown:
        p.error(f"--weights: unknown {unknown}; choose from {list(WEIGHTS)}")
    rows = []
    for weights, m, (name, (n, k)) in itertools.product(
        args.weights.split(","), (int(r) for r in args.rows.split(",")), SHAPES.items()
    ):
        if name.startswith(tuple(args.shapes.split(","))):
            rows.append(measure(name, n, k, m, args.sweep, weights))
            logger.info("measured %s", rows[-1])  # a sweep takes minutes: each row as it comes
    header = f"{'shape':24} {'weights':9} {'rows':>4} {'cuBLAS us':>10} {'TB/s':>6}"
    header += f" {'GEMV us':>8} {'TB/s':>6} {'ratio':>6}"
    logger.info(header)
    for r in rows:
        if "gemv_us" not in r:
            cublas = f"{r['cublas_us']:10.2f} {r['cublas_TBps']:6.2f}"
            logger.info(f"{r['shape']:24} {r['weights']:9} {r['rows']:4} {cublas}")
            continue
        ratio = r["cublas_us"] / r["gemv_us"]
        logger.info(
            f"{r['shape']:24} {r['weights']:9} {r['rows']:4} {r['cublas_us']:10.2f} {r['cublas_TBps']:6.2f} "
            f"{r['gemv_us']:8.2f} {r['gemv_TBps']:6.2f} {ratio:6.2f}"
            + (f"  best {r['best_us']} us {r['best_tile']}" if "best_us" in r else "")
        )
    write_out(args.out, {"device": torch.cuda.get_device_name(), "rows": rows})
    cases = {
        f"{r['shape']}{'' if r['weights'] == 'bf16' else '+' + r['weights']} x{r['rows']}": {
            k: v for k, v in r.items() if k not in ("shape", "rows", "weights")
        }
        for r in rows
    }
    record_run(args, "gemv_bandwidth", cases, COLUMNS)


if __name__ == "__main__":
    main()
