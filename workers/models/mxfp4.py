"""MXFP4 checkpoints (`quantization_config.quant_method: mxfp4`, as gpt-oss ships its experts):
the experts kept in 4 bits for the MoE kernels, or dequantised while they load.

The format is OCP's microscaling FP4 as OpenAI and transformers store it: a matrix `[..., rows,
cols]` becomes `<name>_blocks`, uint8 `[..., rows, cols / 32, 16]` (two E2M1 values a byte, the
even column in the low nibble), and `<name>_scales`, uint8 `[..., rows, cols / 32]` (an E8M0
exponent biased by 127 per 32 values). The rows are the matrix's outputs; transformers' gpt-oss
parameter is the transpose (`[E, in, out]`).

Hopper has no FP4 tensor cores, but a decode step is bound by the bytes it reads, and 4-bit
experts are a quarter of bf16's: the experts stay in MXFP4 (`Mxfp4Experts`, the blocks flattened
to `[E, out, in / 2]`) and the MoE kernels multiply them as they read them (W4A16, as vLLM's and
SGLang's Hopper paths do), in float32 after an exact decode (every E2M1 value times a power of
two is exact in bf16). Where a rank's share of the experts does not split into whole 32-value
groups (tensor parallelism over a narrow intermediate dimension), the loader dequantises them to
the serving dtype instead, under the plain name and in transformers' layout, so the model loads
them as it loads an unquantised checkpoint (`dequantized`).
"""

from __future__ import annotations

import dataclasses
import functools
import math
from collections.abc import Collection, Iterable, Iterator

import torch

# E2M1 by its 4-bit code: sign bit 3, two exponent bits, one mantissa bit.
FP4_VALUES = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0)
SCALE_BIAS = 127
GROUP = 32  # values sharing one scale, along a row
SUFFIXES = ("_blocks", "_scales")
CHUNK_ROWS = 1 << 20  # 32-value groups dequantised at a time


@dataclasses.dataclass(frozen=True)
class Mxfp4Experts:
    """Stacked expert matrices `[E, out, in]` held in MXFP4: `blocks` uint8 `[E, out, in / 2]`
    (the even input in the low nibble), `scales` uint8 `[E, out, in / 32]`."""

    blocks: torch.Tensor
    scales: torch.Tensor

    @property
    def shape(self) -> tuple[int, int, int]:
        """The matrices' logical shape, `[E, out, in]`."""
        experts, rows, half = self.blocks.shape
        return experts, rows, 2 * half

    def expert(self, e: int, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        """Expert `e`'s matrix `[out, in]`, dequantised."""
        return dequantize(self.blocks[e].unflatten(-1, (-1, GROUP // 2)), self.scales[e], dtype)


def splits_into_groups(*widths: int) -> bool:
    """Whether matrices of these input widths (a rank's share) hold whole 32-value groups."""
    return all(w % GROUP == 0 for w in widths)


def fill_dummy(blocks: torch.Tensor, scales: torch.Tensor, generator: torch.Generator, std: float) -> None:
    """Random codes, each equally likely, under one scale that puts the values' RMS near `std`
    (the E2M1 values' is 2.9; a trained checkpoint's scales vary by group, but what a step reads
    does not depend on them)."""
    blocks.copy_(torch.randint(0, 256, blocks.shape, generator=generator, device=blocks.device, dtype=torch.uint8))
    scales.fill_(SCALE_BIAS + round(math.log2(std / 2.9)))


@functools.cache
def _values(dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """The E2M1 values on `device`, made once: a host-to-device copy cannot run inside a CUDA
    graph's capture, where the torch path can be called to check a captured forward."""
    return torch.tensor(FP4_VALUES, dtype=dtype, device=device)


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
    lut = _values(dtype, blocks.device)
    codes, exps = blocks.reshape(-1, width), scales.reshape(-1, 1).to(torch.int32) - SCALE_BIAS
    out = torch.empty(codes.shape[0], 2 * width, dtype=dtype, device=blocks.device)
    for start in range(0, codes.shape[0], CHUNK_ROWS):
        part, rows = codes[start : start + CHUNK_ROWS], out[start : start + CHUNK_ROWS]
        rows[:, 0::2] = lut[(part & 0x0F).int()]
        rows[:, 1::2] = lut[(part >> 4).int()]
        torch.ldexp(rows, exps[start : start + CHUNK_ROWS].to(dtype), out=rows)
    return out.view(*lead, groups * 2 * width)


def dequantized(
    weights: Iterable[tuple[str, torch.Tensor]], dtype: torch.dtype, kept: Collection[str] = ()
) -> Iterator[tuple[str, torch.Tensor]]:
    """The checkpoint's tensors with each `<name>_blocks` / `<name>_scales` pair replaced by
    `<name>`, dequantised and transposed to transformers' parameter layout, but for those named in
    `kept` (the model holds them in MXFP4), handed on as they are; a pair missing its other half is
    an error naming it."""
    pending: dict[str, torch.Tensor] = {}
    for name, tensor in weights:
        suffix = next((s for s in SUFFIXES if name.endswith(s)), None)
        if suffix is None or name in kept:
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
