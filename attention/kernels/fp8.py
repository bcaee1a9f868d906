"""FP8 (e4m3) KV quantisation as the Triton writers do it, matching `quantize` in
`attention/kv_pool.py` (the torch reference): value / scale in float32, saturated to the
format's range (e4m3 has no infinity: a bare cast turns an overflow into NaN), then the store's
cast rounds to nearest."""

from __future__ import annotations

import triton
import triton.language as tl

from attention import kv_pool

FP8_E4M3_MAX = tl.constexpr(kv_pool.FP8_E4M3_MAX)


@triton.jit
def fp8_saturate(x, inv_scale):
    """`x` scaled by 1 / scale and clamped to e4m3's range, float32 (the caller's store casts)."""
    return tl.clamp(x.to(tl.float32) * inv_scale, -FP8_E4M3_MAX, FP8_E4M3_MAX)
