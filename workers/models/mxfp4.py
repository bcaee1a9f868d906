"""MXFP4 checkpoints (`quantization_config.quant_method: mxfp4`, as gpt-oss ships its experts),
dequantised while they load.

The format is OCP's microscaling FP4 as OpenAI and transformers store it: a matrix `[..., rows,
cols]` becomes `<name>_blocks`, uint8 `[..., rows, cols / 32, 16]` (two E2M1 values a byte, the
even column in the low nibble), and `<name>_scales`, uint8 `[..., rows, cols / 32]` (an E8M0
exponent biased by 127 per 32 values). The rows are the matrix's outputs; transformers' gpt-oss
parameter is the transpose (`[E, in, out]`), and that is what the loader hands on, under the
plain name, so the model loads it as it loads an unquantised checkpoint. Hopper has no FP4 tensor
cores: the weights are kept in the serving dtype (every E2M1 value times a power of two is exact
in bf16).
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator

import torch

# E2M1 by its 4-bit code: sign bit 3, two exponent bits, one mantissa bit.
FP4_VALUES = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0)
SCALE_BIAS = 127
SUFFIXES = ("_blocks", "_scales")
CHUNK_ROWS = 1 << 20  # 32-value groups dequantised at a time


def dequantize(blocks: torch.Tensor, scales: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """`[..., rows, groups * 32]` in `dtype` from MXFP4 blocks `[..., rows, groups, 16]` and their
    scales `[..., rows, groups]`, `CHUNK_ROWS` rows at a time (the codes' index tensors of a whole
    gpt-oss-120b expert tensor would take gigabytes)."""
    if blocks.dtype != torch.uint8 or scales.dtype != torch.uint8 or blocks.shape[:-1] != scales.shape:
        raise ValueError(
            f"blocks {tuple(blocks.shape)} {blocks.dtype} and scales {tuple(scales.shape)} {scales.dtype}: "
            "MXFP4 needs uint8 blocks [..., groups, 16] and uint8 scales [..., groups]"
        )
    *lead, groups, width = blocks.shape
    lut = torch.tensor(FP4_VALUES, dtype=dtype, device=blocks.device)
    codes, exps = blocks.reshape(-1, width), scales.reshape(-1, 1).to(torch.int32) - SCALE_BIAS
    out = torch.empty(codes.shape[0], 2 * width, dtype=dtype, device=blocks.device)
    for start in range(0, codes.shape[0], CHUNK_ROWS):
        part, rows = codes[start : start + CHUNK_ROWS], out[start : start + CHUNK_ROWS]
        rows[:, 0::2] = lut[(part & 0x0F).int()]
        rows[:, 1::2] = lut[(part >> 4).int()]
        torch.ldexp(rows, exps[start : start + CHUNK_ROWS].to(dtype), out=rows)
    return out.view(*lead, groups * 2 * width)


def dequantized(weights: Iterable[tuple[str, torch.Tensor]], dtype: torch.dtype) -> Iterator[tuple[str, torch.Tensor]]:
    """The checkpoint's tensors with each `<name>_blocks` / `<name>_scales` pair replaced by
    `<name>`, dequantised and transposed to transformers' parameter layout; a pair missing its
    other half is an error naming it."""
    pending: dict[str, torch.Tensor] = {}
    for name, tensor in weights:
        suffix = next((s for s in SUFFIXES if name.endswith(s)), None)
        if suffix is None:
            yield name, tensor
            continue
        pending[name] = tensor
        base = name[: -len(suffix)]
        blocks, scales = pending.get(base + "_blocks"), pending.get(base + "_scales")
        if blocks is None or scales is None:
            continue
        del pending[base + "_blocks"], pending[base + "_scales"]
        try:
            yield base, dequantize(blocks, scales, dtype).transpose(-1, -2)
        except ValueError as exc:
            raise ValueError(f"weights: MXFP4 tensor {base!r}: {exc}") from None
    if pending:
        raise ValueError(f"weights: MXFP4 tensors without their blocks or scales: {sorted(pending)[:8]}")
