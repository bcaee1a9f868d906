"""The one-row GEMV's tile choice and its SLIDESPEC_GEMV_TILES and SLIDESPEC_FP8_GEMV_TILES overrides, and
the MoE kernels' paths (no GPU needed)."""

import pytest

from workers.models import gemv_tiles
from workers.models.gemv_tiles import Tile


def test_overrides_are_read_by_exact_weight_shape():
    got = gemv_tiles._overrides(" 1152x6912=8,256,4,4,3 ; 1536X1152=8,256,4,4;")
    assert got == {(1152, 6912): Tile(8, 256, 4, 4, splits=3), (1536, 1152): Tile(8, 256, 4, 4)}
    looped = gemv_tiles._overrides("13824x1152=16,128,8,4,1,0")[(13824, 1152)]
    assert looped == Tile(16, 128, 8, 4) and gemv_tiles._overrides("13824x1152=8,128,8,1,1,1")[(13824, 1152)].unroll


@pytest.mark.parametrize(
    "text",
    [
        "1152x6912",
        "1152x6912=8,256",
        "1152=8,256,4,4",
        "axb=8,256,4,4",
        "1152x6912=6,256,4,4",
        "1x2=8,256,4,0",
        "1x2=8,256,4,1,1,1,7",
    ],
)
def test_a_malformed_override_names_itself(text):
    with pytest.raises(ValueError, match="SLIDESPEC_GEMV_TILES"):
        gemv_tiles._overrides(text)


def test_moe_kernel_overrides_are_read_by_kernel_name():
    tiles = gemv_tiles._overrides("gate_up=8,512,4,1; down=32,128,8,1", "X", gemv_tiles._moe_kernel)
    assert tiles == {"gate_up": Tile(8, 512, 4, 1), "down": Tile(32, 128, 8, 1)}
    with pytest.raises(ValueError, match="X: cannot read 'up=8,512,4,1'"):
        gemv_tiles._overrides("up=8,512,4,1", "X", gemv_tiles._moe_kernel)
    with pytest.raises(ValueError, match="powers of two"):
        gemv_tiles._overrides("down=12,512,4,1", "X", gemv_tiles._moe_kernel)
    assert gemv_tiles._moe_overrides("down_mxfp4=4,1024,4,1") == {"down_mxfp4": Tile(4, 1024, 4, 1)}
    with pytest.raises(ValueError, match="down_mxfp4 cols 16: at least 32"):
        gemv_tiles._moe_overrides("down_mxfp4=4,16,4,1")


def test_moe_tiles_follow_the_experts_width_and_an_override_wins(monkeypatch):
    assert gemv_tiles.moe_tile_for("gate_up", 2880) == Tile(4, 256, 4, 1)  # gpt-oss-20b
    assert gemv_tiles.moe_tile_for("down", 704) == Tile(8, 256, 4, 1)  # Gemma-4-26B-A4B
    assert gemv_tiles.moe_tile_for("gate_up_mxfp4", 2880) == Tile(8, 512, 4, 1)  # gpt-oss-20b's MXFP4 experts
    monkeypatch.setattr(gemv_tiles, "MOE_OVERRIDES", {"down": Tile(4, 512, 4, 1)})
    assert gemv_tiles.moe_tile_for("down", 704) == Tile(4, 512, 4, 1)
    assert gemv_tiles.moe_tile_for("gate_up", 704) == Tile(1, 256, 4, 1)


def test_moe_row_blocks_are_preloaded_where_they_fit_the_registers():
    """Gemma-4-26B-A4B's tiles hold a program's whole row block (704 inputs rounded to 1024 for
    down, gate and up rows of 2816 rounded to 4096) in 64 elements a thread; gpt-oss-20b's
    (2880 wide) stream theirs after the wait, as do wider tiles."""
    down, gate_up = gemv_tiles.moe_tile_for("down", 704), gemv_tiles.moe_tile_for("gate_up", 704)
    assert gemv_tiles.preload_width(down, 704, 1) == 1024
    assert gemv_tiles.preload_width(gate_up, 2816, 2) == 4096
    assert gemv_tiles.preload_width(Tile(2, 256, 4, 1), 2816, 2) == 0
    assert gemv_tiles.preload_width(Tile(2, 256, 8, 1), 2816, 2) == 4096
    assert gemv_tiles.preload_width(gemv_tiles.moe_tile_for("down", 2880), 2880, 1) == 0


def test_the_gemv_threshold_override_is_two_pair_counts():
    assert gemv_tiles._gemv_below("") == gemv_tiles.GEMV_BELOW_PAIRS
    assert gemv_tiles._gemv_below("48,96") == {False: 48, True: 96}
    for bad in ("48", "48,96,1", "a,b"):
        with pytest.raises(ValueError, match="SLIDESPEC_MOE_GEMV_BELOW: cannot read"):
            gemv_tiles._gemv_below(bad)
    with pytest.raises(ValueError, match=">= 0"):
        gemv_tiles._gemv_below("-1,96")


def test_moe_paths_follow_the_routed_pairs():
    """Where the timed crossovers lie (ops/bench/moe_experts.py, decode_step): the GEMV below 72
    pairs (bf16) or 96 (MXFP4), MXFP4 dequantised first from sixteen pairs an expert; under expert parallelism
    the whole model's pairs and experts decide, so both ranks take the same path."""
    assert [gemv_tiles.moe_path(p, 32, False) for p in (4, 16, 71, 72, 128, 4096)] == ["gemv"] * 3 + ["gemm"] * 3
    assert [gemv_tiles.moe_path(p, 128, False) for p in (8, 64, 72, 128)] == ["gemv"] * 2 + ["gemm"] * 2
    mxfp4 = [gemv_tiles.moe_path(p, 32, True) for p in (4, 64, 95, 96, 256, 511, 512, 4096)]
    assert mxfp4 == ["gemv"] * 3 + ["gemm"] * 3 + ["dequant"] * 2


def test_an_override_wins_for_its_shape_and_one_row_only(monkeypatch):
    table = gemv_tiles.tile_for(1152, 6912)
    assert table == Tile(4, 128, 8, 1, unroll=True)  # the table's: Gemma-3-1B's down projection
    monkeypatch.setattr(gemv_tiles, "OVERRIDES", {(1152, 6912): Tile(16, 128, 4, 2, splits=3)})
    gemv_tiles.tile_for.cache_clear()
    try:
        assert gemv_tiles.tile_for(1152, 6912) == Tile(16, 128, 4, 2, splits=3)
        assert gemv_tiles.tile_for(1152, 6912, rows=2) is None  # few rows: the row table (cuBLAS here)
        assert gemv_tiles.tile_for(1152, 1024) == Tile(4, 512, 4, 4)  # other shapes: the table
    finally:
        gemv_tiles.tile_for.cache_clear()


@pytest.mark.parametrize(
    "shape, width",
    [
        ((1536, 1152), 2048),
        ((1152, 1024), 1024),
        ((37, 264), 512),
        ((6144, 4096), 0),
        ((4096, 4096), 0),
        ((1152, 6912), 0),
        ((3072, 2560), 4096),
        ((256, 2560), 4096),
        ((2560, 2560), 0),
    ],
)
def test_small_row_blocks_are_read_whole_and_the_rest_stream(shape, width):
    """Gemma-3-1B's QKV and O (and tiny models') fit a program's registers, and so do
    Gemma-4-E4B's projections from its stream at their 8-warp tiles; an 8B model's projections,
    a split down projection and a square 2560 projection (the rules' 4-warp tile) do not."""
    assert gemv_tiles.preload_width(gemv_tiles.tile_for(*shape), shape[1]) == width


def test_exact_shape_tiles_apply_to_one_row_of_their_shape_only():
    """Gemma-4-E4B's gate/up (20480 x 2560) and Gemma-4-26B-A4B's O projection read their timed
    8-warp tiles for one row; Llama-3-8B's wide gate/up keeps the rules' 4-warp tile, and several
    rows the rows' table."""
    assert gemv_tiles.tile_for(20480, 2560) == Tile(16, 256, 8, 4)
    assert gemv_tiles.tile_for(2816, 4096) == Tile(4, 512, 8, 4)  # Gemma-4-26B-A4B's O projection
    assert gemv_tiles.tile_for(28672, 4096) == Tile(16, 256, 4, 4)
    assert gemv_tiles.tile_for(20480, 2560, 2) == Tile(64, 64, 4, 3)


@pytest.mark.parametrize("shape", [(6144, 4096), (4096, 4096), (28672, 4096), (4096, 14336)])
@pytest.mark.parametrize("rows", [1, 2, 8])
def test_fp8_tiles_fit_their_scale_layout(shape, rows):
    """The FP8 GEMV's tiles: one row spans whole 128-column blocks of block-scaled weights, a
    `tl.dot` tile of more rows is one block wide; a block of no power-of-two width takes none."""
    per_channel = gemv_tiles.fp8_tile_for(*shape, rows, None)
    block = gemv_tiles.fp8_tile_for(*shape, rows, (128, 128))
    assert per_channel is not None and block is not None
    assert block.cols % 128 == 0 if rows == 1 else block.cols == 128
    assert gemv_tiles.fp8_tile_for(*shape, rows, (128, 96)) is None


def test_an_fp8_override_wins_for_its_shape_and_one_row_and_still_reads_whole_blocks(monkeypatch):
    table = gemv_tiles.fp8_tile_for(28672, 4096, 1, None)
    assert table == Tile(4, 4096, 4, 2)  # the table's: an 8B model's gate/up projection
    monkeypatch.setattr(gemv_tiles, "FP8_OVERRIDES", {(28672, 4096): Tile(4, 2048, 8, 3)})
    gemv_tiles.fp8_tile_for.cache_clear()
    try:
        assert gemv_tiles.fp8_tile_for(28672, 4096, 1, None) == Tile(4, 2048, 8, 3)
        assert gemv_tiles.fp8_tile_for(28672, 4096, 1, (128, 128)) == Tile(4, 2048, 8, 3)  # whole blocks
        assert gemv_tiles.fp8_tile_for(28672, 4096, 4, None) == Tile(64, 128, 4, 4)  # few rows: the row table
        assert gemv_tiles.fp8_tile_for(6144, 4096, 1, None) == Tile(8, 2048, 4, 3)  # other shapes: the table
    finally:
        gemv_tiles.fp8_tile_for.cache_clear()
    with pytest.raises(ValueError, match="SLIDESPEC_FP8_GEMV_TILES: cannot read"):
        gemv_tiles._overrides("28672x4096=4,2048", "SLIDESPEC_FP8_GEMV_TILES")
