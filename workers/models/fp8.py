"""FP8 (e4m3) weights of the decoder layers' projections (docs/design.md §4.9).

A decode step at small batches reads every weight once: stored in FP8 they are half the bytes of
bf16. A stored weight times its scale is the weight, in one of two layouts:

- **a scale per output channel** (`block` None): a checkpoint's per-tensor scale (`quant_method:
  fp8` without `weight_block_size`, `<linear>.weight_scale`, one value a linear, as vLLM's and
  AutoFP8's checkpoints ship) becomes that value on each of the linear's rows, so q, k and v, each
  with its own scale, stack into one fused projection bit for bit; a per-channel scale (`[N]` or
  `[N, 1]`) is read as it is; `quantization: fp8` quantises a bf16 checkpoint's rows at load
  (scale = the row's largest magnitude / 448, as vLLM's `--quantization fp8` does per tensor);
- **a scale per block** of `block = (rows, cols)` weights (`weight_block_size`, as Qwen3-FP8 and
  DeepSeek ship: `<linear>.weight_scale_inv`, the multiplier despite its name), `[ceil(N / rows),
  ceil(K / cols)]`; projections stacked or split over ranks are split on whole blocks.

Static activation scales (`input_scale`) are not read: activations are quantised per token (or per
128 columns) as they come (`workers/models/fp8_matmul.py`), which is no coarser. The LM head, the
embeddings and small replicated projections (routers, draft heads) stay in the model's dtype.

Projections are built in FP8 while `building(layout)` is active, around the target's construction
as the serving dtype is (`workers/models/loader.py`), so draft heads stay in the model's dtype.
"""

from __future__ import annotations

import contextlib
import contextvars
import dataclasses
from collections.abc import Callable, Iterator, Mapping
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from attention.kv_pool import FP8_E4M3, FP8_E4M3_MAX

FP8 = FP8_E4M3
TINY = 1e-12  # a scale's floor: an all-zero row or block stores zeros, not NaN
SCALE = "weight_scale"  # every layout's scale parameter
SCALE_NAMES = ("weight_scale", "weight_scale_inv")  # what checkpoints call it (per tensor or channel; per block)
UNREAD = ("input_scale",)  # static activation scales: activations are quantised as they come
ACTIVATION_SCHEMES = ("dynamic", "static")
FORMATS = ("e4m3",)  # `fmt`: the weights' FP8 format
SCALE_FORMATS = ("float",)  # `scale_fmt`: float32 scales (not DeepSeek-V4's ue8m0 bytes)


@dataclasses.dataclass(frozen=True)
class Fp8Layout:
    """How a model's projections hold FP8 weights."""

    block: tuple[int, int] | None = None  # (rows, cols) one scale covers; None: a scale per output channel
    from_checkpoint: bool = True  # the checkpoint holds FP8 weights and their scales; False: quantised at load
    skip: tuple[str, ...] = ()  # modules the checkpoint leaves unquantised (`modules_to_not_convert`)


# The engine option `quantization`: what it makes of a checkpoint in the model's dtype.
QUANTIZATIONS = {"fp8": Fp8Layout(None, from_checkpoint=False)}


def checkpoint_layout(quant: Mapping[str, Any]) -> Fp8Layout:
    """The layout a `quantization_config` of `quant_method: fp8` describes; a field of a value
    slidespec does not read is a ValueError naming it."""
    checks = (
        ("activation_scheme", ACTIVATION_SCHEMES),
        ("fmt", FORMATS),
        ("scale_fmt", SCALE_FORMATS),
    )
    for field, allowed in checks:
        value = quant.get(field)
        if value is not None and value not in allowed:
            raise ValueError(
                f"config.json: quantization_config.{field} {value!r} is not supported; allowed: {list(allowed)}"
            )
    block = quant.get("weight_block_size")
    if block is not None:
        if not (isinstance(block, (list, tuple)) and len(block) == 2 and all(type(v) is int and v > 0 for v in block)):
            raise ValueError(
                f"config.json: quantization_config.weight_block_size {block!r:.40}: want two positive integers "
                "[rows, cols] (or none: a scale per tensor)"
            )
        block = (block[0], block[1])
    skip = quant.get("modules_to_not_convert") or quant.get("ignored_layers") or ()
    if not (isinstance(skip, (list, tuple)) and all(isinstance(s, str) for s in skip)):
        raise ValueError(f"config.json: quantization_config.modules_to_not_convert {skip!r:.40}: want module names")
    return Fp8Layout(block, from_checkpoint=True, skip=tuple(skip))


def quantization_layout(quantization: str) -> Fp8Layout:
    """The layout of the engine option `quantization`."""
    if quantization not in QUANTIZATIONS:
        raise ValueError(f"quantization: unknown {quantization!r}; allowed: {[None, *QUANTIZATIONS]}")
    return QUANTIZATIONS[quantization]


# -- the number format ------------------------------------------------------------------------------------
def cdiv(a: int, b: int) -> int:
    return -(-a // b)


def per_element(scale: torch.Tensor, block: tuple[int, int] | None, shape: tuple[int, ...]) -> torch.Tensor:
    """Each weight's scale, `shape` wide: a channel's on its row, a block's on its elements."""
    rows, cols = shape
    if block is None:
        return scale[:, None].expand(rows, cols)
    return scale.repeat_interleave(block[0], 0)[:rows].repeat_interleave(block[1], 1)[:, :cols]


def quantize(weight: torch.Tensor, block: tuple[int, int] | None) -> tuple[torch.Tensor, torch.Tensor]:
    """(FP8 weight, float32 scales) of a `[N, K]` matrix: each scale is its row's or block's
    largest magnitude / 448, each value divided by it, saturated and rounded to nearest (float32
    math)."""
    w = weight.float()
    if block is None:
        amax = w.abs().amax(dim=1)
    else:
        rows, cols = block
        padded = F.pad(w.abs(), (0, -w.shape[1] % cols, 0, -w.shape[0] % rows))
        amax = padded.view(padded.shape[0] // rows, rows, padded.shape[1] // cols, cols).amax(dim=(1, 3))
    scale = amax.clamp(min=TINY) / FP8_E4M3_MAX
    q = (w / per_element(scale, block, w.shape)).clamp(-FP8_E4M3_MAX, FP8_E4M3_MAX).to(FP8)
    return q, scale


def dequantize(
    weight: torch.Tensor, scale: torch.Tensor, block: tuple[int, int] | None, dtype: torch.dtype = torch.float32
) -> torch.Tensor:
    """The weights an FP8 matrix and its scales stand for, in `dtype` (each product rounded once);
    scales broadcast over their rows or whole blocks rather than spelled out per weight."""
    rows, cols = weight.shape
    w, s = weight.to(dtype), scale.to(dtype)
    if block is None:
        return w * s[:, None]
    if rows % block[0] or cols % block[1]:
        return w * per_element(s, block, weight.shape)
    blocks = w.view(rows // block[0], block[0], cols // block[1], block[1]) * s[:, None, :, None]
    return blocks.view(rows, cols)


# -- building and loading projections ----------------------------------------------------------------
_BUILDING: contextvars.ContextVar[Fp8Layout | None] = contextvars.ContextVar("fp8_building", default=None)


@contextlib.contextmanager
def building(layout: Fp8Layout | None) -> Iterator[None]:
    """Projections created inside hold FP8 weights of `layout` (None: the model's dtype)."""
    token = _BUILDING.set(layout)
    try:
        yield
    finally:
        _BUILDING.reset(token)


def layout_in_build() -> Fp8Layout | None:
    """The layout of the model being built, if its projections are FP8."""
    return _BUILDING.get()


def weight_param(shape: tuple[int, int], loader: Callable[..., None]) -> nn.Parameter:
    """An FP8 weight; its loader takes FP8 tensors as they are and quantises any other
    (`quantizes`: the checkpoint loader hands it tensors uncast)."""
    p = nn.Parameter(torch.empty(shape, dtype=FP8), requires_grad=False)
    p.weight_loader = loader  # type: ignore[attr-defined]
    p.quantizes = True  # type: ignore[attr-defined]
    return p


def scale_param(shape: tuple[int, ...], loader: Callable[..., None], required: bool) -> nn.Parameter:
    """A weight's float32 scales; `required`: the checkpoint must hold them (else the weight's
    loader sets them as it quantises)."""
    p = nn.Parameter(torch.empty(shape, dtype=torch.float32), requires_grad=False)
    p.weight_loader = loader  # type: ignore[attr-defined]
    p.required = required  # type: ignore[attr-defined]
    return p


def scale_shape(rows: list[int], cols: int, block: tuple[int, int] | None, split: bool) -> tuple[int, ...]:
    """The scales of a weight stacked from parts of `rows` rows each, `cols` wide; `split`: its
    parts are stacked or sliced from larger tensors (tensor parallelism), so must hold whole
    blocks."""
    if block is None:
        return (sum(rows),)
    if split and any(n % block[0] for n in rows):
        raise ValueError(
            f"config.json: quantization_config.weight_block_size {list(block)}: projection parts of {rows} rows "
            f"on a rank are not whole blocks of {block[0]} (stacked or split projections are split by blocks)"
        )
    return (sum(cdiv(n, block[0]) for n in rows), cdiv(cols, block[1]))


def checkpoint_scale(loaded: torch.Tensor, rows: int, cols: int, block: tuple[int, int] | None) -> torch.Tensor:
    """A checkpoint's scale of a `rows x cols` weight in the layout's shape, float32: per channel,
    a per-tensor value on every row or a per-channel `[rows]` / `[rows, 1]` as it is; per block,
    `[ceil(rows / r), ceil(cols / c)]`."""
    s = loaded.float()
    if block is None:
        if s.numel() == 1:
            return s.reshape(1).expand(rows)
        if s.numel() == rows and s.shape[0] == rows and s.dim() <= 2:
            return s.reshape(rows)
        raise ValueError(f"an FP8 scale of {tuple(s.shape)}: want one value a tensor or one a row ({rows})")
    want = (cdiv(rows, block[0]), cdiv(cols, block[1]))
    if tuple(s.shape) != want:
        raise ValueError(
            f"an FP8 block scale of {tuple(s.shape)}: {list(block)} blocks of a {rows}x{cols} weight are {want}"
        )
    return s


def fill(weight: torch.Tensor, scale: torch.Tensor, block: tuple[int, int] | None, values: torch.Tensor) -> None:
    """Store `values` (this rank's whole weight) quantised into an FP8 weight and its scales."""
    q, s = quantize(values, block)
    weight.data.copy_(q)
    scale.data.copy_(s)
