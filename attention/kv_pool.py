"""What a backend reads and writes KV through.

Each layer's KV lives in one index space: *full* (one slot per token, `out_cache_loc` and
`req_to_token` are in it) or *swa* (a smaller pool of a hybrid pair, reached through the
allocator's page-aligned `full_to_swa` map). Only the pool object handed to a forward says
which: a backend asks it per forward and never infers it from an allocator (docs/design.md §4.1) nor
caches the answer across forwards (docs/design.md §4.2).

Each layer's KV is one buffer in flashinfer's stacked paged "HND" layout, `[num_pages, 2,
num_kv_heads, page_size, head_dim]` (index 0 of dim 1 is K, 1 is V), which XQA, FMHA-v2 and
trtllm-gen all read without copies. Page 0 of every pool is a padding
page that is never allocated: untranslatable (evicted) SWA entries point at it.

A buffer holds K and V in the model's dtype, or quantised to FP8 (e4m3) with a scale per KV layer
for K and one for V (`kv_scales`): a stored value times its scale is the value. Writes quantise
with `quantize` (the Triton writers match it); every read dequantises with `dequantize`
(docs/design.md §4.7).
"""

from __future__ import annotations

from typing import Protocol, runtime_checkable

import numpy as np
import torch

FP8_E4M3 = torch.float8_e4m3fn  # the quantised KV format (`kv_cache_dtype: fp8_e4m3`)
FP8_E4M3_MAX = float(torch.finfo(FP8_E4M3).max)  # 448: writes saturate here (the format has no infinity)


def quantize(x: torch.Tensor, scale: float, dtype: torch.dtype) -> torch.Tensor:
    """`x` as a buffer of `dtype` stores it: FP8 holds x / scale, saturated to the format's
    range (a cast would turn an overflow into NaN: e4m3 has no infinity), rounded to nearest;
    any other dtype holds x cast (no scale)."""
    if dtype != FP8_E4M3:
        return x.to(dtype)
    return (x.float() * (1.0 / scale)).clamp(-FP8_E4M3_MAX, FP8_E4M3_MAX).to(dtype)  # as the Triton writers


def dequantize(stored: torch.Tensor, scale: float) -> torch.Tensor:
    """What KV read from a buffer stands for: an FP8 entry as float32 times its layer's scale;
    an entry in the model's dtype as it is (such a buffer has no scales)."""
    return stored.float() * scale if stored.dtype == FP8_E4M3 else stored


@runtime_checkable
class KVPool(Protocol):
    page_size: int

    @property
    def has_swa(self) -> bool:
        """Whether any layer of this pool lives in the SWA index space."""

    @property
    def swa_window(self) -> int | None:
        """Keys (counting the query itself) that the SWA pool keeps for each request's next
        query; tokens older than that may already have lost their SWA slot."""

    def is_swa_layer(self, layer_id: int) -> bool:
        """Whether `layer_id`'s KV indices are in the SWA index space."""

    def translate_full_to_swa(self, full_locs: torch.Tensor) -> torch.Tensor:
        """Full-pool slots to SWA-pool slots (evicted ones map into padding page 0)."""

    def translate_full_to_swa_host(self, full_locs: np.ndarray) -> np.ndarray:
        """The same translation through the host's master copy of the map."""

    def kv_cache(self, layer_id: int) -> torch.Tensor:
        """A layer's KV buffer, `[num_pages, 2, num_kv_heads, page_size, head_dim]`."""

    def kv_scales(self, layer_id: int) -> tuple[float, float]:
        """(K scale, V scale) of `layer_id`'s buffer when it is FP8: a stored value times its
        scale is the value. Readers ask only of an FP8 buffer; a layer reading another layer's
        KV reads it with the scales it was written with, the pool's."""

    def set_kv(self, layer_id: int, locs: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> None:
        """Write `k`, `v` (`[n, num_kv_heads, head_dim]`) at `locs`, given in the layer's own
        index space, quantised with the layer's scales when the buffer is FP8."""

    def write_slots(self, layer_id: int, locs: torch.Tensor) -> torch.Tensor:
        """The slots of `kv_cache(layer_id)` that `set_kv(layer_id, locs, ...)` writes: for a
        caller that writes K and V itself (the fused RoPE kernel)."""
