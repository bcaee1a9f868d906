"""A mixture of experts' router on CUDA for few tokens (decode steps, small verifies): one Triton
kernel where the torch path runs four (gpt-oss: projection, cast, top-k, softmax) or nine
(Gemma 4: its scale-free norm and two scalings before the projection, the expert scales after),
the torch path of `workers/models/moe.py` (`Router`, `route`) its oracle.

- `_logits_kernel`, a program per (token, expert): one expert's row is a few KB, read in one
  load where the hidden size allows, so the kernel takes a DRAM round trip or two rather than a
  loop of them (at 8 experts a program, gpt-oss-20b's router took 9 us a layer); that load
  (and the norm's scale vector) comes before the PDL wait, as the one-row GEMV's preload
  (`attention/kernels/launch.py`): no kernel writes weights. Gemma 4's
  input (the row RMS-normalised without a weight, times the router's scale vector, times
  1/sqrt(hidden), each step rounded to the model's dtype as the torch ops round it) computed by
  every program from the row's statistics, then the expert's logit, rounded to the model's
  dtype as the projection's output is (and its bias added first, gpt-oss).
- `_top_k_row`: the top-k logits of a token in descending order (the lowest expert id first
  among equal ones), each expert placed by its rank (one reduction over all pairs of experts),
  their softmax in float32, times each chosen expert's scale (Gemma 4), into
  float32 weights and int64 ids. `route` runs it in the logits kernel's program that stores a
  token's last logit (`attention/kernels/arrival.py`), reading the logits the others stored:
  no second launch. `top_k_of` runs it alone, a program per token.

Nothing is read back to the host and no shape depends on the routing: CUDA graphs capture it.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from attention.kernels.arrival import counters, last_arrival
from attention.kernels.launch import pdl_options, pdl_start, preloads

MAX_ROWS = 8  # tokens up to which these kernels route (each program reads its experts' rows)
BLOCK_E = 1  # experts a logits program computes
MAX_BLOCK_K = 4096  # hidden features a loop step of it reads at most


@triton.jit
def _router_input(x_row, scale, k, k_ok, rstd, input_scale, NORM: tl.constexpr, dtype: tl.constexpr):
    """Features `k` of the router's input, as float32 values of the model's dtype (`scale`: the
    norm's scale vector at `k`, read by the caller)."""
    x = tl.load(x_row + k, mask=k_ok, other=0.0)
    if NORM:
        x = (x.to(tl.float32) * rstd).to(dtype)
        x = (x.to(tl.float32) * scale.to(tl.float32)).to(dtype)
        x = (x.to(tl.float32) * input_scale).to(dtype)
    return x.to(tl.float32)


@triton.jit
def _weights(w_ptr, scale_ptr, e, e_ok, k, k_ok, H, NORM: tl.constexpr):
    """Experts `e`'s router rows and the norm's scale vector at features `k` (weights: no kernel
    writes them, so they may be read before the PDL wait)."""
    w = tl.load(w_ptr + e[:, None].to(tl.int64) * H + k[None, :], mask=e_ok[:, None] & k_ok[None, :], other=0.0)
    scale = tl.load(scale_ptr + k, mask=k_ok & NORM, other=0.0)
    return w, scale


@triton.jit
def _logits_kernel(
    x_ptr,
    w_ptr,
    b_ptr,
    scale_ptr,
    out_ptr,
    expert_scale_ptr,
    weights_ptr,
    ids_ptr,
    counter_ptr,
    E,
    H,
    stride_x,
    eps,
    input_scale,
    NORM: tl.constexpr,
    HAS_BIAS: tl.constexpr,
    BLOCK_E: tl.constexpr,
    BLOCK_K: tl.constexpr,
    BLOCK_H: tl.constexpr,  # H rounded up to a power of two: the statistics' one pass
    TOP_K: tl.constexpr,  # 0: the logits alone; else the token's last program routes it
    HAS_SCALE: tl.constexpr,
    BLOCK_EXPERTS: tl.constexpr,  # E rounded up to a power of two
    PRELOAD: tl.constexpr,  # H fits one K tile: the program's weights read before the PDL wait
    PDL: tl.constexpr,
):
    t = tl.program_id(0).to(tl.int64)
    e = tl.program_id(1) * BLOCK_E + tl.arange(0, BLOCK_E)
    e_ok = e < E
    cols = tl.arange(0, BLOCK_K)
    if PRELOAD:
        w, scale = _weights(w_ptr, scale_ptr, e, e_ok, cols, cols < H, H, NORM)
    pdl_start(PDL)
    x_row = x_ptr + t * stride_x
    dtype = out_ptr.dtype.element_ty
    rstd = 0.0
    if NORM:
        hs = tl.arange(0, BLOCK_H)
        whole = tl.load(x_row + hs, mask=hs < H, other=0.0).to(tl.float32)
        rstd = tl.rsqrt(tl.sum(whole * whole) / H + eps)
    if PRELOAD:
        acc = w.to(tl.float32) * _router_input(x_row, scale, cols, cols < H, rstd, input_scale, NORM, dtype)[None, :]
    else:
        acc = tl.zeros((BLOCK_E, BLOCK_K), dtype=tl.float32)
        for k0 in range(0, H, BLOCK_K):
            k = k0 + cols
            k_ok = k < H
            w, scale = _weights(w_ptr, scale_ptr, e, e_ok, k, k_ok, H, NORM)
            acc += w.to(tl.float32) * _router_input(x_row, scale, k, k_ok, rstd, input_scale, NORM, dtype)[None, :]
    logits = tl.sum(acc, axis=1)
    if HAS_BIAS:
        logits += tl.load(b_ptr + e, mask=e_ok, other=0.0).to(tl.float32)
    tl.store(out_ptr + t * E + e, logits.to(dtype), mask=e_ok)
    if TOP_K:
        if last_arrival(counter_ptr + t, tl.num_programs(1)):
            _top_k_row(out_ptr, expert_scale_ptr, weights_ptr, ids_ptr, t, E, TOP_K, HAS_SCALE, BLOCK_EXPERTS)


@triton.jit
def _top_k_row(
    logits_ptr,
    expert_scale_ptr,
    weights_ptr,
    ids_ptr,
    t,
    E,
    TOP_K: tl.constexpr,
    HAS_SCALE: tl.constexpr,
    BLOCK: tl.constexpr,  # E rounded up to a power of two
):
    """Token t's top-k experts and weights from its logits (stored by other programs, maybe on
    other SMs: read past the L1 cache). Each expert's place is its rank, the experts ahead of it
    (a larger logit, or an equal one of a lower id) counted in one reduction over all pairs of
    experts, where picking the best k times takes 2k reductions one after another."""
    e = tl.arange(0, BLOCK)
    ok = e < E
    logit = tl.load(logits_ptr + t * E + e, mask=ok, other=float("-inf"), cache_modifier=".cg").to(tl.float32)
    ahead = (logit[None, :] > logit[:, None]) | ((logit[None, :] == logit[:, None]) & (e[None, :] < e[:, None]))
    rank = tl.sum(ahead.to(tl.int32), axis=1)
    chosen = ok & (rank < TOP_K)
    p = tl.where(chosen, tl.exp(logit - tl.max(logit, axis=0)), 0.0)
    p = p / tl.sum(p, axis=0)
    if HAS_SCALE:
        p = p * tl.load(expert_scale_ptr + e, mask=chosen, other=0.0).to(tl.float32)
    tl.store(weights_ptr + t * TOP_K + rank, p, mask=chosen)
    tl.store(ids_ptr + t * TOP_K + rank, e.to(tl.int64), mask=chosen)


@triton.jit
def _top_k_kernel(
    logits_ptr,
    expert_scale_ptr,
    weights_ptr,
    ids_ptr,
    E,
    TOP_K: tl.constexpr,
    HAS_SCALE: tl.constexpr,
    BLOCK: tl.constexpr,  # E rounded up to a power of two
    PDL: tl.constexpr,
):
    pdl_start(PDL)
    t = tl.program_id(0).to(tl.int64)
    _top_k_row(logits_ptr, expert_scale_ptr, weights_ptr, ids_ptr, t, E, TOP_K, HAS_SCALE, BLOCK)


def applies(x: torch.Tensor) -> bool:
    """Whether these kernels route `x` (`[T, hidden]`): 1 to MAX_ROWS rows on CUDA, unit stride."""
    return x.is_cuda and 0 < x.shape[0] <= MAX_ROWS and x.dim() == 2 and x.stride(-1) == 1


def route(
    x: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None,
    top_k: int,
    norm: tuple[torch.Tensor, float, float] | None = None,
    expert_scale: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """(float32 weights `[T, k]`, int64 expert ids `[T, k]`) of `moe.route` over the router's
    logits (`logits`), from one launch."""
    return _launch(x, weight, bias, norm, top_k, expert_scale)[1:]


def logits(
    x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, norm: tuple[torch.Tensor, float, float] | None
) -> torch.Tensor:
    """The router's logits `weight . x' + bias` `[T, E]` in x's dtype, x' = x or, with `norm` =
    (scale vector, eps, input scale), rms_norm(x) * scale * input scale (Gemma 4)."""
    return _launch(x, weight, bias, norm, 0, None)[0]


def _launch(
    x: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None,
    norm: tuple[torch.Tensor, float, float] | None,
    top_k: int,
    expert_scale: torch.Tensor | None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(logits, weights, ids); without `top_k` the weights and ids are empty."""
    tokens, hidden = x.shape
    experts = weight.shape[0]
    out = torch.empty(tokens, experts, dtype=x.dtype, device=x.device)
    weights = torch.empty(tokens, top_k, dtype=torch.float32, device=x.device)
    ids = torch.empty(tokens, top_k, dtype=torch.int64, device=x.device)
    scale, eps, input_scale = norm if norm is not None else (weight, 0.0, 1.0)  # no norm: never read
    blocks = triton.cdiv(experts, BLOCK_E)
    _logits_kernel[(tokens, blocks)](
        x,
        weight,
        bias if bias is not None else weight,
        scale,
        out,
        expert_scale if expert_scale is not None else weight,
        weights,
        ids,
        counters(x.device, tokens),
        experts,
        hidden,
        x.stride(0),
        eps,
        input_scale,
        NORM=norm is not None,
        HAS_BIAS=bias is not None,
        BLOCK_E=BLOCK_E,
        BLOCK_K=min(triton.next_power_of_2(hidden), MAX_BLOCK_K),
        BLOCK_H=triton.next_power_of_2(hidden),
        TOP_K=top_k,
        HAS_SCALE=expert_scale is not None,
        BLOCK_EXPERTS=triton.next_power_of_2(experts),
        PRELOAD=preloads() and hidden <= MAX_BLOCK_K,
        **pdl_options(tokens * blocks),
    )
    return out, weights, ids


def top_k_of(
    logits: torch.Tensor, top_k: int, expert_scale: torch.Tensor | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """`moe.route(logits, top_k, expert_scale)` from one kernel."""
    tokens, experts = logits.shape
    weights = torch.empty(tokens, top_k, dtype=torch.float32, device=logits.device)
    ids = torch.empty(tokens, top_k, dtype=torch.int64, device=logits.device)
    _top_k_kernel[(tokens,)](
        logits,
        expert_scale if expert_scale is not None else logits,
        weights,
        ids,
        experts,
        TOP_K=top_k,
        HAS_SCALE=expert_scale is not None,
        BLOCK=triton.next_power_of_2(experts),
        **pdl_options(tokens),
    )
    return weights, ids
