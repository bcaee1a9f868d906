"""The element-wise operations of a decoder layer, chosen once per device, as data.

| op | CPU (and the reference on any device) | CUDA |
| --- | --- | --- |
| RMSNorm (Llama, Gemma) | torch, float32 math | `flashinfer.norm.rmsnorm` / `gemma_rmsnorm` |
| residual add + RMSNorm | torch | `flashinfer.norm.fused_add_rmsnorm` / `gemma_fused_add_rmsnorm` |
| RMSNorm, add, scale, RMSNorm or not (Gemma's sandwich, `norm_add`) | torch | Triton (`sandwich_norm.py`) |
| RoPE from a cos/sin cache (q/k norms first; K and V, V normed or not, into the cache) | torch | Triton (`rope.py`) |
| SiLU / GELU-tanh / GELU and mul | torch | `flashinfer.activation.*_and_mul` |
| projection (`x W^T + b`) | `F.linear` | 1-8 rows: Triton GEMV (`gemv.py`); more rows: `F.linear` |
| gate/up projection + activation | `F.linear`, then the above | 1-8 rows: fused Triton GEMV; more: as left |
| projection of act(gate) * up, gate and up apart (Gemma 4) | torch | one row: Triton GEMV; more: as above |
| add (+ scale) + RMSNorm + QKV projection | the above, in turn | one row, small QKV: one Triton GEMV (norms inside) |
| embedding, scale, RMSNorm, QKV projection (layer 0) | the above, in turn | one token: the same GEMV, from the id |
| float32 (soft-capped) logits + argmax | torch | Triton (`logits_argmax.py`) |
| FP8 projection (§4.9) | dequantised, float32 `F.linear` | 1-8 rows: FP8 GEMV (`fp8_gemv.py`); more: W8A8 |
| FP8 gate/up projection + activation | the above, then the activation | 1-8 rows: the FP8 GEMV, fused |

The torch set is the reference the CUDA set is tested against (bf16 noise), and the one that
runs whenever autograd is on (training reuses the serving model code). A layer's new K and V
go to the paged cache from the RoPE op where the attention backend names their slots
(`kv_destination`), else through the pool's writer (`workers/memory/kv_write.py`), whose
reference the torch RoPE op uses too. `ops_for(tensor)` picks the set;
`SLIDESPEC_FUSED_OPS=0` turns every fused kernel off, `SLIDESPEC_GEMV=0` only the GEMV.
"""

from __future__ import annotations

import dataclasses
import functools
import importlib
import os
from collections.abc import Callable

import torch
import torch.nn.functional as F

from workers.memory.kv_write import write_kv_torch
from workers.models.activations import ACTIVATIONS
from workers.models.fp8 import dequantize

Tensor = torch.Tensor
Block = tuple[int, int] | None  # an FP8 weight's scale layout: (rows, cols) of a block, None: per output channel
QKNorms = tuple[Tensor, Tensor | None, float, bool]
# (paged cache [pages, 2, Hk, page, D], write slots [T], v [T, Hk * D], (K scale, V scale) of an FP8 cache)
KVDest = tuple[Tensor, Tensor, Tensor, tuple[float, float]]


@dataclasses.dataclass(frozen=True)
class OpSet:
    name: str
    # (x, weight, eps, gemma) -> normalised x; Gemma scales by (1 + weight)
    rms_norm: Callable[[Tensor, Tensor, float, bool], Tensor]
    # (x, residual, weight, eps, gemma, before, scale) -> (rms_norm(s), s) where s = (residual +
    # x') * scale, x' = rms_norm(x, before) (x itself when before is None), scale a one-element
    # tensor (Gemma 4's layer scalar) or None (1); may reuse x's and residual's storage
    add_rms_norm: Callable[[Tensor, Tensor, Tensor, float, bool, Tensor | None, Tensor | None], tuple[Tensor, Tensor]]
    # (x, residual, before weight, eps, gemma, scale) -> (residual + rms_norm(x, before)) * scale
    # (no scale: 1): a stream no norm follows; may reuse residual's storage
    norm_add: Callable[..., Tensor]  # (x, residual, before, eps, gemma, scale, residual_norm=None)
    # (positions, q [T, H, D], k [T, Hk, D] or None, cos_sin_cache [max_pos, rot], norms, kv,
    # v_norm_eps) -> (q, k) rotated, each head RMS-normalised first when norms = (q weight, k
    # weight, eps, gemma); with kv = (cache, slots, v, scales) the rotated keys and v go to the
    # paged cache at the slots (quantised with the scales when it is FP8) and k comes back None,
    # each value head RMS-normalised without a weight first when v_norm_eps is given (Gemma 4);
    # q, k and v may be strided views of a fused projection, which stays as it was
    rope: Callable[
        [Tensor, Tensor, Tensor | None, Tensor, QKNorms | None, KVDest | None, float | None],
        tuple[Tensor, Tensor | None],
    ]
    # (gate_up [..., 2 * d], activation name) -> act(gate) * up
    act_and_mul: Callable[[Tensor, str], Tensor]
    # (x, weight [out, in], bias or None) -> x W^T + b
    linear: Callable[[Tensor, Tensor, Tensor | None], Tensor]
    # (x, merged gate/up weight [2 * d, in], bias or None, activation name) -> act(gate) * up
    linear_act_and_mul: Callable[[Tensor, Tensor, Tensor | None, str], Tensor]
    # (x, residual, norm weight, eps, gemma, before, weight, bias, scale) -> (linear(add_rms_norm's
    # output), add_rms_norm's residual): a projection of the norm before it; norm weight None: of
    # the stream itself, unnormed
    add_rms_norm_linear: Callable[
        [Tensor, Tensor, Tensor | None, float, bool, Tensor | None, Tensor, Tensor | None, Tensor | None],
        tuple[Tensor, Tensor],
    ]
    # (gate, up, activation name, weight, bias or None) -> linear(act(gate) * up): gate and up
    # apart (Gemma 4's per-layer input gate and the per-layer input)
    gated_linear: Callable[[Tensor, Tensor, str, Tensor, Tensor | None], Tensor]
    # (token ids [T], embedding table, scale, norm weight, eps, gemma, weight, bias) -> (linear(
    # rms_norm(e)), e) where e = the ids' embedding rows times scale: a first layer's projection
    embed_rms_norm_linear: Callable[
        [Tensor, Tensor, float, Tensor, float, bool, Tensor, Tensor | None], tuple[Tensor, Tensor]
    ]
    # (LM-head output [n, V], soft cap or None, out float32 [n, V], tokens int64 [n]) -> None:
    # float_logits(raw, cap) into out and each row's argmax into tokens (a greedy step's tail)
    logits_argmax: Callable[[Tensor, float | None, Tensor, Tensor], None]
    # (x, FP8 weight [out, in], float32 scales, their layout, bias or None) -> x W^T + b, W the
    # weights the FP8 values times their scales stand for (`workers/models/fp8.py`)
    fp8_linear: Callable[[Tensor, Tensor, Tensor, Block, Tensor | None], Tensor]
    # (x, merged FP8 gate/up weight, scales, layout, bias or None, activation name) -> act(gate) * up
    fp8_linear_act_and_mul: Callable[[Tensor, Tensor, Tensor, Block, Tensor | None, str], Tensor]


# -- torch: the reference ---------------------------------------------------------------------------
def _rms_norm(x: Tensor, weight: Tensor, eps: float, gemma: bool) -> Tensor:
    """Hugging Face's RMSNorm: float32 statistics; Gemma scales by (1 + w) and casts last,
    Llama casts, then scales by w."""
    h = x.float()
    h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + eps)
    if gemma:
        return (h * (1.0 + weight.float())).to(x.dtype)
    return weight * h.to(x.dtype)


def _add_rms_norm(
    x: Tensor,
    residual: Tensor,
    weight: Tensor,
    eps: float,
    gemma: bool,
    before: Tensor | None = None,
    scale: Tensor | None = None,
) -> tuple[Tensor, Tensor]:
    residual = _stream(x, residual, before, eps, gemma, scale)
    return _rms_norm(residual, weight, eps, gemma), residual


def _stream(
    x: Tensor,
    residual: Tensor,
    before: Tensor | None,
    eps: float,
    gemma: bool,
    scale: Tensor | None,
    residual_norm: Tensor | None = None,
) -> Tensor:
    """`(r + rms_norm(x, before)) * scale`, r the residual or rms_norm(residual, residual_norm),
    each step rounded to the dtype as Hugging Face's modules round it."""
    if residual_norm is not None:
        residual = _rms_norm(residual, residual_norm, eps, gemma)
    if before is not None:
        x = _rms_norm(x, before, eps, gemma)
    residual = residual + x
    return residual if scale is None else residual * scale


def _add_rms_norm_linear(
    x: Tensor,
    residual: Tensor,
    norm: Tensor | None,
    eps: float,
    gemma: bool,
    before: Tensor | None,
    weight: Tensor,
    bias: Tensor | None,
    scale: Tensor | None = None,
) -> tuple[Tensor, Tensor]:
    if norm is None:
        residual = _stream(x, residual, before, eps, gemma, scale)
        return F.linear(residual, weight, bias), residual
    normed, residual = _add_rms_norm(x, residual, norm, eps, gemma, before, scale)
    return F.linear(normed, weight, bias), residual


def scale_rows(hidden: Tensor, scale: float) -> Tensor:
    """Embedding rows times `scale` (Gemma's sqrt(hidden)), the scale rounded to their dtype
    first as Hugging Face's Gemma does."""
    return hidden if scale == 1.0 else hidden * torch.tensor(scale, dtype=hidden.dtype)


def embed_rows(ids: Tensor, table: Tensor, scale: float) -> Tensor:
    """The ids' rows of an embedding table, scaled (`scale_rows`)."""
    return scale_rows(F.embedding(ids, table), scale)


def _embed_norm_linear(rms_norm: Callable, linear: Callable) -> Callable:
    """`embed_rms_norm_linear` composed of an op set's norm and projection."""

    def run(ids, table, scale, norm, eps, gemma, weight, bias):
        stream = embed_rows(ids, table, scale)
        return linear(rms_norm(stream, norm, eps, gemma), weight, bias), stream

    return run


def _rope(
    positions: Tensor,
    q: Tensor,
    k: Tensor | None,
    cos_sin_cache: Tensor,
    norms: QKNorms | None = None,
    kv: KVDest | None = None,
    v_norm_eps: float | None = None,
) -> tuple[Tensor, Tensor | None]:
    if norms is not None:
        q_weight, k_weight, eps, gemma = norms
        q = _rms_norm(q, q_weight, eps, gemma)
        k = None if k is None else _rms_norm(k, k_weight, eps, gemma)
    half = cos_sin_cache.shape[-1] // 2
    rows = cos_sin_cache[positions]
    cos = torch.cat([rows[:, :half], rows[:, :half]], dim=-1).to(q.dtype)
    sin = torch.cat([rows[:, half:], rows[:, half:]], dim=-1).to(q.dtype)
    q, k = apply_rope(q, cos, sin), (apply_rope(k, cos, sin) if k is not None else None)
    if kv is None:
        return q, k
    cache, locs, v, (k_scale, v_scale) = kv
    v = v.reshape(k.shape)
    if v_norm_eps is not None:
        v = _rms_norm(v, torch.ones(v.shape[-1], dtype=v.dtype, device=v.device), v_norm_eps, False)
    write_kv_torch(cache, locs, k, v, k_scale, v_scale)
    return q, None


def apply_rope(x: Tensor, cos: Tensor, sin: Tensor) -> Tensor:
    """Rotate the first `rotary_dim` features of every head (x: `[T, heads, head_dim]`)."""
    rot = cos.shape[-1]
    x_rot, x_pass = x[..., :rot], x[..., rot:]
    half = rot // 2
    rotated = torch.cat([-x_rot[..., half:], x_rot[..., :half]], dim=-1)
    out = x_rot * cos[:, None, :] + rotated * sin[:, None, :]
    return torch.cat([out, x_pass], dim=-1) if x_pass.numel() else out


def float_logits(raw: Tensor, cap: float | None) -> Tensor:
    """Float32 logits, soft-capped (`cap * tanh(x / cap)`) when the model caps them."""
    logits = raw.float()
    return torch.tanh(logits / cap) * cap if cap else logits


def _logits_argmax(raw: Tensor, cap: float | None, out: Tensor, tokens: Tensor) -> None:
    out.copy_(float_logits(raw, cap))
    torch.argmax(out, dim=-1, out=tokens)


def _act_and_mul(x: Tensor, act: str) -> Tensor:
    gate, up = x.chunk(2, dim=-1)
    return ACTIVATIONS[act](gate) * up


def _linear_act_and_mul(x: Tensor, weight: Tensor, bias: Tensor | None, act: str) -> Tensor:
    return _act_and_mul(F.linear(x, weight, bias), act)


def _gated_linear(gate: Tensor, up: Tensor, act: str, weight: Tensor, bias: Tensor | None) -> Tensor:
    return F.linear(ACTIVATIONS[act](gate) * up, weight, bias)


def _fp8_linear(x: Tensor, weight: Tensor, scale: Tensor, block: Block, bias: Tensor | None) -> Tensor:
    """The oracle of every FP8 path: the weights dequantised to float32 and the product in
    float32, cast to x's dtype."""
    b = None if bias is None else bias.float()
    return F.linear(x.float(), dequantize(weight, scale, block), b).to(x.dtype)


def _fp8_linear_act_and_mul(
    x: Tensor, weight: Tensor, scale: Tensor, block: Block, bias: Tensor | None, act: str
) -> Tensor:
    return _act_and_mul(_fp8_linear(x, weight, scale, block, bias), act)


TORCH_OPS = OpSet(
    "torch",
    _rms_norm,
    _add_rms_norm,
    _stream,
    _rope,
    _act_and_mul,
    F.linear,
    _linear_act_and_mul,
    _add_rms_norm_linear,
    _gated_linear,
    _embed_norm_linear(_rms_norm, F.linear),
    _logits_argmax,
    _fp8_linear,
    _fp8_linear_act_and_mul,
)


# -- CUDA: flashinfer's fused kernels ---------------------------------------------------------------
@functools.cache
def _flashinfer():
    # flashinfer's CuTe-DSL norms need a package the serving image lacks; its CUDA JIT norms do not
    os.environ.setdefault("FLASHINFER_USE_CUDA_NORM", "1")
    import flashinfer

    return flashinfer


def _fi_rms_norm(x: Tensor, weight: Tensor, eps: float, gemma: bool) -> Tensor:
    norm = _flashinfer().norm
    shape = x.shape
    x2 = x.reshape(-1, shape[-1])
    out = norm.gemma_rmsnorm(x2, weight, eps) if gemma else norm.rmsnorm(x2, weight, eps)
    return out.view(shape)


def _fi_add_rms_norm(
    x: Tensor,
    residual: Tensor,
    weight: Tensor,
    eps: float,
    gemma: bool,
    before: Tensor | None = None,
    scale: Tensor | None = None,
) -> tuple[Tensor, Tensor]:
    if before is not None:
        return triton_module("sandwich_norm").norm_add_norm(x, residual, before, weight, eps, gemma, scale)
    if scale is not None:
        residual = _stream(x, residual, None, eps, gemma, scale)
        return _fi_rms_norm(residual, weight, eps, gemma), residual
    norm = _flashinfer().norm
    x = x.contiguous()
    (norm.gemma_fused_add_rmsnorm if gemma else norm.fused_add_rmsnorm)(x, residual, weight, eps)
    return x, residual


def _cuda_rope(
    positions: Tensor,
    q: Tensor,
    k: Tensor | None,
    cos_sin_cache: Tensor,
    norms: QKNorms | None = None,
    kv: KVDest | None = None,
    v_norm_eps: float | None = None,
) -> tuple[Tensor, Tensor | None]:
    if q.stride(-1) != 1 or (k is not None and k.stride(-1) != 1):
        q, k = q.contiguous(), None if k is None else k.contiguous()
    return triton_module("rope").rope(positions, q, k, cos_sin_cache, norms, kv, v_norm_eps)


FLASHINFER_ACTS = {"silu": "silu_and_mul", "gelu_pytorch_tanh": "gelu_tanh_and_mul", "gelu": "gelu_and_mul"}


def _fi_act_and_mul(x: Tensor, act: str) -> Tensor:
    name = FLASHINFER_ACTS.get(act)
    if name is None:
        return _act_and_mul(x, act)
    return getattr(_flashinfer().activation, name)(x.contiguous())


@functools.cache
def triton_module(name: str):
    """A module of Triton kernels under `workers/models` (`gemv`, `fp8_gemv`, `fused_moe`, ...):
    Triton ships with CUDA builds of torch only."""
    return importlib.import_module(f"workers.models.{name}")


def _cuda_linear(x: Tensor, weight: Tensor, bias: Tensor | None) -> Tensor:
    if GEMV_ENABLED and triton_module("gemv").applies(x, weight):
        return triton_module("gemv").gemv(x, weight, bias)
    return F.linear(x, weight, bias)


def _cuda_linear_act_and_mul(x: Tensor, weight: Tensor, bias: Tensor | None, act: str) -> Tensor:
    gemv = triton_module("gemv")
    if GEMV_ENABLED and bias is None and act in gemv.ACTIVATIONS and gemv.applies(x, weight):
        return gemv.gemv_act_and_mul(x, weight, act)
    return _fi_act_and_mul(F.linear(x, weight, bias), act)


def _cuda_add_rms_norm_linear(
    x: Tensor,
    residual: Tensor,
    norm: Tensor | None,
    eps: float,
    gemma: bool,
    before: Tensor | None,
    weight: Tensor,
    bias: Tensor | None,
    scale: Tensor | None = None,
) -> tuple[Tensor, Tensor]:
    gemv = triton_module("gemv")
    if GEMV_ENABLED and residual.is_contiguous() and gemv.norm_applies(x, weight):
        return gemv.add_norm_gemv(x, residual, norm, eps, gemma, before, weight, bias, scale)
    if norm is None:
        if before is not None:
            residual = _cuda_norm_add(x, residual, before, eps, gemma, scale)
        else:
            residual = _stream(x, residual, None, eps, gemma, scale)
        return _cuda_linear(residual, weight, bias), residual
    normed, residual = _fi_add_rms_norm(x, residual, norm, eps, gemma, before, scale)
    return _cuda_linear(normed, weight, bias), residual


def _cuda_norm_add(
    x: Tensor,
    residual: Tensor,
    before: Tensor,
    eps: float,
    gemma: bool,
    scale: Tensor | None,
    residual_norm: Tensor | None = None,
) -> Tensor:
    if residual.is_contiguous() and x.stride(-1) == 1:
        return triton_module("sandwich_norm").norm_add(x, residual, before, eps, gemma, scale, residual_norm)
    return _stream(x, residual, before, eps, gemma, scale, residual_norm)


def _cuda_gated_linear(gate: Tensor, up: Tensor, act: str, weight: Tensor, bias: Tensor | None) -> Tensor:
    gemv = triton_module("gemv")
    if GEMV_ENABLED and act in gemv.ACTIVATIONS and gemv.gated_applies(gate, up, weight):
        return gemv.gated_gemv(gate, up, act, weight, bias)
    return _cuda_linear(_fi_act_and_mul(torch.cat([gate, up], dim=-1), act), weight, bias)


def _cuda_fp8_linear(x: Tensor, weight: Tensor, scale: Tensor, block: Block, bias: Tensor | None) -> Tensor:
    gemv = triton_module("fp8_gemv")
    if GEMV_ENABLED and gemv.applies(x, weight, block):
        return gemv.gemv(x, weight, scale, block, bias)
    return triton_module("fp8_matmul").linear(x, weight, scale, block, bias)


def _cuda_fp8_linear_act_and_mul(
    x: Tensor, weight: Tensor, scale: Tensor, block: Block, bias: Tensor | None, act: str
) -> Tensor:
    gemv = triton_module("fp8_gemv")
    if GEMV_ENABLED and bias is None and act in gemv.ACTIVATIONS and gemv.applies(x, weight, block):
        return gemv.gemv_act_and_mul(x, weight, scale, block, act)
    return _fi_act_and_mul(_cuda_fp8_linear(x, weight, scale, block, bias), act)


_cuda_embed_composed = _embed_norm_linear(_fi_rms_norm, _cuda_linear)


def _cuda_embed_rms_norm_linear(
    ids: Tensor,
    table: Tensor,
    scale: float,
    norm: Tensor,
    eps: float,
    gemma: bool,
    weight: Tensor,
    bias: Tensor | None,
) -> tuple[Tensor, Tensor]:
    gemv = triton_module("gemv")
    if GEMV_ENABLED and ids.numel() == 1 and table.is_contiguous() and gemv.norm_applies(table[:1], weight):
        return gemv.embed_norm_gemv(ids.view(1), table, scale, norm, eps, gemma, weight, bias)
    return _cuda_embed_composed(ids, table, scale, norm, eps, gemma, weight, bias)


FLASHINFER_OPS = OpSet(
    "flashinfer",
    _fi_rms_norm,
    _fi_add_rms_norm,
    _cuda_norm_add,
    _cuda_rope,
    _fi_act_and_mul,
    _cuda_linear,
    _cuda_linear_act_and_mul,
    _cuda_add_rms_norm_linear,
    _cuda_gated_linear,
    _cuda_embed_rms_norm_linear,
    lambda raw, cap, out, tokens: triton_module("logits_argmax").logits_argmax(raw, cap, out, tokens),
    _cuda_fp8_linear,
    _cuda_fp8_linear_act_and_mul,
)

OP_SETS = {"cpu": TORCH_OPS, "cuda": FLASHINFER_OPS}


def ops_for(x: Tensor) -> OpSet:
    """The device's set; the torch set while autograd records (the fused kernels have no
    backward) or when `SLIDESPEC_FUSED_OPS=0`."""
    if torch.is_grad_enabled() or not FUSED_ENABLED:
        return TORCH_OPS
    return OP_SETS["cuda" if x.is_cuda else "cpu"]  # is_cuda: a tenth of the cost of device.type


FUSED_ENABLED = os.environ.get("SLIDESPEC_FUSED_OPS", "1") != "0"
GEMV_ENABLED = os.environ.get("SLIDESPEC_GEMV", "1") != "0"
