"""The one-row GEMV's tiles by weight shape, as data (`gemv.py` runs them): Triton-free, so the
choice and its overrides are testable anywhere.

`SLIDESPEC_GEMV_TILES` overrides the one-row tile of exact weight shapes, for tuning inside a
captured decode step (where a kernel's launch overlaps the one before and isolated timings
mislead): `OUTxIN=rows,cols,warps,stages[,splits[,unroll]]`, several separated by `;`, e.g.
`1152x6912=8,256,4,4,3` for Gemma-3-1B's down projection with three splits, or
`13824x1152=16,128,8,4,1,0` for its gate/up projection's looped tile. `SLIDESPEC_FP8_GEMV_TILES`
does the same for the FP8 one-row GEMV (`OUTxIN=rows,cols,warps,stages`; a block-scaled weight
still reads whole blocks, `fit_block`), and `SLIDESPEC_MOE_GEMV_TILES` for the MoE decode
kernels by kernel name (`gate_up=rows,cols,warps,stages;down=...`); `SLIDESPEC_MOE_GEMV_BELOW`
moves the routed-pair counts below which those kernels run (`bf16,mxfp4`).
"""

from __future__ import annotations

import dataclasses
import functools
import os
from collections.abc import Callable
from typing import Any


@dataclasses.dataclass(frozen=True)
class Tile:
    rows: int  # output features a program computes
    cols: int  # K elements it reads a row per iteration
    warps: int
    stages: int
    splits: int = 1  # programs sharing a row block's K (one input row, no activation)
    unroll: bool = False  # one row: K's tiles unrolled (gate/up: K a multiple of `cols`; else a split's)


# First match on (out_features >= rows_at_least, in_features >= cols_at_least), tuned on an H200
# with ops/bench/gemv_bandwidth.py over Llama-3-8B and Gemma-3-1B/12B projections.
TILES: tuple[tuple[int, int, Tile], ...] = (
    (65536, 0, Tile(16, 256, 4, 4)),  # LM heads
    (30720, 0, Tile(8, 256, 4, 4)),  # widest gate/up (Gemma-3-12B: 1.22x the tile below)
    (20480, 0, Tile(16, 256, 4, 4)),  # wide: gate/up (Llama-3-8B)
    (13824, 0, Tile(8, 128, 8, 1, unroll=True)),  # gate/up (Gemma-3-1B: 1.10x the looped 16-row tile)
    (8192, 0, Tile(8, 256, 8, 2)),  # wide fused QKV (Gemma-3-12B)
    (2048, 6144, Tile(4, 512, 8, 2)),  # long rows: down projections
    (0, 6144, Tile(4, 128, 8, 1, unroll=True)),  # few long rows: Gemma-3-1B down (1.27x 6 looped splits)
    (6144, 0, Tile(8, 512, 4, 4)),  # fused QKV
    (0, 0, Tile(4, 512, 4, 4)),  # square: O projections
)

# One-row tiles of exact weight shapes, before the rules above: Gemma-4-E4B's projections from its
# 2560-wide stream (fused QKV of sliding and full layers, the query-only projections of KV-shared
# layers, the per-layer input gate). At 8 warps a program's 4 x 2560 row block fits the preload
# (`preload_width`), so the norm runs inside the GEMV: a captured batch-1 step 3.34 ms against
# 3.45 with the rules' tiles (`decode_step --shape gemma4-e4b`, H200).
# Its MLP's gate/up (20480 x 2560, the activation inside) reads 16 x 256 tiles at 8 warps where the
# rules' 4 warps take 3.36 ms a step: 3.19 ms. Gemma-4-26B-A4B's O projections (4096 and 8192
# inputs) at 8 warps, the 4096-wide ones preloaded: 3.28 ms a step against 3.33 (sweeps in
# `decode_step.history.jsonl`; E4B's O projections gained nothing so).
SHAPE_TILES: dict[tuple[int, int], Tile] = {
    **{(out_features, 2560): Tile(4, 512, 8, 4) for out_features in (3072, 6144, 2048, 4096, 256)},
    (20480, 2560): Tile(16, 256, 8, 4),
    **{(2816, in_features): Tile(4, 512, 8, 4) for in_features in (4096, 8192)},
}

# The same for 2 to MAX_ROWS rows (`rows` is the tl.dot tile's N: at least 16); None: cuBLAS,
# which reads long rows (down projections) faster than this kernel without a split over K.
ROW_TILES: tuple[tuple[int, int, Tile | None], ...] = (
    (0, 6144, None),  # long rows: down projections
    (65536, 0, Tile(64, 128, 4, 4)),  # LM heads
    (16384, 0, Tile(64, 64, 4, 3)),  # wide gate/up
    (8192, 0, Tile(64, 128, 4, 4)),  # gate/up
    (6144, 0, Tile(64, 256, 4, 4)),  # fused QKV
    (0, 4096, Tile(32, 256, 4, 5)),  # O projections
    (0, 0, Tile(32, 128, 4, 5)),  # small projections
)
MAX_ROWS = 8

# The same for FP8 weights (`fp8_gemv.py`), one row and 2 to MAX_ROWS rows, tuned on an H200 with
# `gemv_bandwidth.py --weights fp8,fp8-block` over Llama-3-8B's projections: a byte an element,
# so one-row tiles read 2048 to 4096 columns. Block-scaled weights (128 columns a block) run
# one row with `cols` a multiple of the block's, more rows with `cols` the block's (`fp8_tile_for`).
FP8_TILES: tuple[tuple[int, int, Tile], ...] = (
    (20480, 0, Tile(4, 4096, 4, 2)),  # wide: gate/up
    (2048, 6144, Tile(8, 2048, 8, 3)),  # long rows: down projections
    (6144, 0, Tile(8, 2048, 4, 3)),  # fused QKV
    (0, 0, Tile(8, 2048, 8, 3)),  # O projections
)
# few rows: the tiles that won isolated timings (32 x 256) made a captured batch-8 step slower (7.1 ms against 5.8)
FP8_ROW_TILES: tuple[tuple[int, int, Tile], ...] = (
    (8192, 0, Tile(64, 128, 4, 4)),  # gate/up, fused QKV
    (0, 0, Tile(32, 128, 4, 4)),  # O and down projections
)
# weight elements one thread may hold when a program reads its whole row block before the PDL
# wait; larger blocks stream after it
PRELOAD_ELEMENTS = 64


def _overrides(
    text: str, name: str = "SLIDESPEC_GEMV_TILES", key: Callable[[str], Any] | None = None
) -> dict[Any, Tile]:
    """The tiles of environment variable `name` (its value `text`) by (out_features, in_features),
    or by what `key` makes of the text before `=`."""
    tiles = {}
    for item in filter(None, (part.strip() for part in text.split(";"))):
        try:
            shape, fields = item.split("=")
            where = key(shape) if key else tuple(int(v) for v in shape.lower().split("x"))
            if not key and len(where) != 2:
                raise ValueError(shape)
            values = [int(v) for v in fields.split(",")]
            tile = Tile(*values[:5], *map(bool, values[5:]))  # more than six: a TypeError
        except (ValueError, TypeError) as e:
            want = "KERNEL=rows,cols,warps,stages" if key else "OUTxIN=rows,cols,warps,stages[,splits[,unroll]]"
            raise ValueError(f"{name}: cannot read {item!r}; want {want}") from e
        powers = (tile.rows, tile.cols, tile.warps)
        if any(v < 1 or v & (v - 1) for v in powers) or tile.stages < 1 or tile.splits < 1:
            raise ValueError(f"{name}: {item!r}: rows, cols and warps must be powers of two, all >= 1")
        tiles[where] = tile
    return tiles


# The MoE decode kernels' tiles (`fused_moe.py`, few routed pairs) by the experts' intermediate
# width, first match: `rows` outputs a program computes, `cols` K elements it reads a loop step
# (`stages` unused). Captured batch-1 steps on an H200 (`decode_step`): gpt-oss-20b (2880 wide)
# 2.69 ms at 4 rows against 2.81 at 16. Gemma-4-26B-A4B (704 wide, 8 experts a token): tiles whose
# whole row block fits the preload (`preload_width`), read before the PDL wait: 3.01 ms with
# down 8 rows and gate/up 1 row, 3.10 with down alone preloaded, 3.25 with neither (16 x 256
# tiles, the best looped ones); 8-warp tiles (down 16 rows, gate/up 2) 3.12 and 3.03.
# `SLIDESPEC_MOE_GEMV_TILES` overrides a kernel's tile at every width, e.g.
# `gate_up=8,256,4,1;down=8,512,4,1`.
# The MXFP4 kernels (`*_mxfp4`) read half a byte an element: 8 rows of 512 columns read 16 bytes
# a thread a loop step, one vector, and spread the loop's fixed work over the most of them
# (`kernel_sass`: 13 and 12 instructions a code byte for down and gate/up, against 16 and 14 at
# 4 rows). Timed (`moe_experts`, H200): 51 us a gpt-oss-20b layer at batch 1, bound by the decode.
MOE_GEMV_TILES: tuple[tuple[int, dict[str, Tile]], ...] = (
    (
        2048,
        {
            "gate_up": Tile(4, 256, 4, 1),
            "down": Tile(4, 256, 4, 1),
            "gate_up_mxfp4": Tile(8, 512, 4, 1),
            "down_mxfp4": Tile(8, 512, 4, 1),
        },
    ),
    (
        0,
        {
            "gate_up": Tile(1, 256, 4, 1),
            "down": Tile(8, 256, 4, 1),
            "gate_up_mxfp4": Tile(16, 128, 8, 1),  # wider spills at 4 warps (two tiles and their decoding)
            "down_mxfp4": Tile(16, 128, 8, 1),
        },
    ),
)


def _moe_kernel(name: str) -> str:
    if name not in MOE_GEMV_TILES[-1][1]:
        raise ValueError(f"unknown kernel {name!r}; one of {sorted(MOE_GEMV_TILES[-1][1])}")
    return name


def _moe_overrides(text: str) -> dict[str, Tile]:
    """`SLIDESPEC_MOE_GEMV_TILES` read; the MXFP4 kernels read whole 32-column scale groups."""
    tiles = _overrides(text, "SLIDESPEC_MOE_GEMV_TILES", _moe_kernel)
    for name, tile in tiles.items():
        if name.endswith("_mxfp4") and tile.cols < 32:
            raise ValueError(f"SLIDESPEC_MOE_GEMV_TILES: {name} cols {tile.cols}: at least 32 (a scale group)")
    return tiles


MOE_OVERRIDES = _moe_overrides(os.environ.get("SLIDESPEC_MOE_GEMV_TILES", ""))


def moe_tile_for(kernel: str, width: int) -> Tile:
    """The MoE decode kernel's (`gate_up` or `down`, `_mxfp4` for MXFP4 experts) tile for experts
    `width` wide; an override first."""
    if kernel in MOE_OVERRIDES:
        return MOE_OVERRIDES[kernel]
    return next(tiles[kernel] for at_least, tiles in MOE_GEMV_TILES if width >= at_least)


# Routed pairs below which the GEMV-like kernels run, by whether the experts are MXFP4: the GEMV
# reads an expert once per pair, the grouped GEMM once per tile of its pairs after laying them
# out (two small kernels). Alone (ops/bench/moe_experts.py, H200) the bf16 GEMM wins from 16
# pairs at Gemma-4-26B-A4B's 704-wide experts (0.071 ms against 0.073, 0.17 against 0.21 at 64),
# but inside a captured step the GEMV's row blocks are read before its wait (`preload_width`),
# overlapping the kernel before, and it wins to 64 (decode_step, H200: a batch-8 step 7.93 ms
# against 8.09; the 4-draft assistant round, 40 pairs, 8.26 ms against 8.62), so bf16 takes the
# GEMV below 72. MXFP4 (gpt-oss-20b): its grouped GEMM decodes codes per tile, so the GEMV wins
# to 64 pairs (0.54 ms against 0.68) and loses at 128 (1.05 against 0.77).
# `SLIDESPEC_MOE_GEMV_BELOW=bf16,mxfp4` (e.g. `48,96`) overrides both, for tuning.
GEMV_BELOW_PAIRS = {False: 72, True: 96}


def _gemv_below(text: str) -> dict[bool, int]:
    """`SLIDESPEC_MOE_GEMV_BELOW` read (empty: the table's thresholds)."""
    if not text.strip():
        return GEMV_BELOW_PAIRS
    try:
        bf16, mxfp4 = (int(v) for v in text.split(","))
    except ValueError as e:
        raise ValueError(f"SLIDESPEC_MOE_GEMV_BELOW: cannot read {text!r}; want two pair counts 'bf16,mxfp4'") from e
    if bf16 < 0 or mxfp4 < 0:
        raise ValueError(f"SLIDESPEC_MOE_GEMV_BELOW: {text!r}: pair counts must be >= 0")
    return {False: bf16, True: mxfp4}


GEMV_BELOW = _gemv_below(os.environ.get("SLIDESPEC_MOE_GEMV_BELOW", ""))
# Routed pairs an expert from which MXFP4 experts are dequantised into a workspace in the
# model's dtype and the bf16 grouped GEMM runs: one pass over all the experts' codes (~0.8 ms a
# gpt-oss-20b layer) then costs less than the grouped GEMM decoding them per tile (1.14 ms against
# 1.26 at 512 pairs, 1.14 against 0.93 at 256; same benchmark).
DEQUANTIZE_PAIRS_PER_EXPERT = 16
MOE_PATHS = ("gemv", "gemm", "dequant")


def moe_path(pairs: int, experts: int, mxfp4: bool) -> str:
    """The kernels (of `MOE_PATHS`, in `fused_moe.py`) that `pairs` routed pairs over `experts`
    experts run (all the model's: under expert parallelism a rank holds a like share of both)."""
    if pairs < GEMV_BELOW[mxfp4]:
        return "gemv"
    return "dequant" if mxfp4 and pairs >= DEQUANTIZE_PAIRS_PER_EXPERT * experts else "gemm"


OVERRIDES = _overrides(os.environ.get("SLIDESPEC_GEMV_TILES", ""))
FP8_OVERRIDES = _overrides(os.environ.get("SLIDESPEC_FP8_GEMV_TILES", ""), "SLIDESPEC_FP8_GEMV_TILES")


@functools.cache  # asked by `applies` and again at launch, for every projection call
def tile_for(out_features: int, in_features: int, rows: int = 1) -> Tile | None:
    """The table's tile for a weight of this shape and `rows` input rows (None: cuBLAS); for one
    row an override first, then a tile of the exact shape."""
    if rows == 1:
        shape = (out_features, in_features)
        if shape in OVERRIDES or shape in SHAPE_TILES:
            return OVERRIDES.get(shape) or SHAPE_TILES[shape]
    table = TILES if rows == 1 else ROW_TILES
    return next(t for n, k, t in table if out_features >= n and in_features >= k)


def preload_width(tile: Tile, in_features: int, matrices: int = 1) -> int:
    """K rounded up to a power of two when a one-row program of `tile` can hold its whole row
    block (of each of `matrices` weights it reads: 2 for an MoE gate/up) in registers (no
    split), loaded before the PDL wait: Gemma-3-1B's QKV and O projections, not an 8B model's;
    else 0 (the K loop after the wait)."""
    width = 1 << (in_features - 1).bit_length()
    fits = tile.splits == 1 and matrices * tile.rows * width <= PRELOAD_ELEMENTS * 32 * tile.warps
    return width if fits else 0


@functools.cache
def fp8_tile_for(out_features: int, in_features: int, rows: int, block: tuple[int, int] | None) -> Tile | None:
    """The FP8 GEMV's tile for a weight of this shape and scale layout and `rows` input rows;
    None where no tile fits the layout (a block's columns neither a power of two nor at most a
    tile's): such products run as matrix products."""
    if rows == 1 and (out_features, in_features) in FP8_OVERRIDES:
        return fit_block(FP8_OVERRIDES[(out_features, in_features)], rows, block)
    table = FP8_TILES if rows == 1 else FP8_ROW_TILES
    return fit_block(next(t for n, k, t in table if out_features >= n and in_features >= k), rows, block)


def fit_block(tile: Tile, rows: int, block: tuple[int, int] | None) -> Tile | None:
    """`tile` as FP8 weights of this scale layout run it: per block, one row reads whole blocks
    (`cols` a multiple of the block's, else the block's), more rows one block; None where the
    block's columns are no power of two of at least 16 (or over 256 for more rows)."""
    if block is None:
        return tile
    cols = block[1]
    if cols & (cols - 1) or cols < 16:
        return None
    if rows == 1:
        return tile if tile.cols % cols == 0 else dataclasses.replace(tile, cols=cols)
    return dataclasses.replace(tile, cols=cols) if cols <= 256 else None
