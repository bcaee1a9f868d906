"""The mixture-of-experts block of Gemma 4 (26B-A4B) and gpt-oss (docs/design.md §4.8).

A router scores every expert for each token and keeps the `top_k` best; the token's output is
the routing-weighted sum of those experts, each a gated MLP. The two families differ only in
data (`MoEConfig`):

| | Gemma 4 | gpt-oss |
| --- | --- | --- |
| router input | RMS-normed (no weight), x learned scale x hidden^-1/2 | the MLP's input |
| router | softmax over all, top-k, renormalised, x per-expert scale | logits + bias, top-k, softmax |
| experts | `gelu_tanh(gate) * up` | clamped SwiGLU, biases |
| gate/up in checkpoint | `[E, 2I, H]`, gate rows then up rows | `[E, H, 2I]`, gate and up alternating |
| down in checkpoint | `[E, H, I]` | `[E, I, H]` |

The two routers are one function: a softmax over all experts renormalised over the top k is the
softmax of the top-k logits. Weights are held in one layout whatever the checkpoint's
(`gate_up_proj [E, 2I, H]` gate rows then up rows, `down_proj [E, H, I]`). Under tensor
parallelism the ranks share the experts one of two ways (`MoEConfig.expert_parallel`, the engine
option `moe_parallel`): by tensor, each rank keeps its slice of every expert's intermediate
dimension (`[E, 2I/tp, H]`, the column/row scheme of the dense MLP, `workers/models/layers.py`);
by expert, each keeps E/tp whole experts (`[E/tp, 2I, H]`) and runs only the chosen ones among
them. Either way every rank holds the same tokens and routing and the partial outputs are
all-reduced. MXFP4 checkpoints' experts stay in 4 bits (`Mxfp4Experts`, `workers/models/mxfp4.py`)
where each rank's share splits into whole 32-value groups: the kernels read them as they are, the
torch path dequantises one expert at a time.

The torch path below is the CPU path and the oracle of the CUDA kernels (`fused_moe.py`, and
`fused_router.py` for the router of a few tokens): it
runs every expert over every token, weighted by its routing weight (zero where not chosen), so
its shapes never depend on the routing and nothing is read back to the host (a CUDA graph can
capture it). CUDA runs the kernels unless fused ops are off or autograd records
(`workers/models/ops.py`), or `SLIDESPEC_FUSED_MOE=0`.
"""

from __future__ import annotations

import dataclasses
import functools
import os
from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import nn

from workers.distributed import TPGroup
from workers.models.activations import ACTIVATIONS
from workers.models.config import MoEConfig
from workers.models.layers import (
    ReplicatedLinear,
    RMSNorm,
    Unreduced,
    check_shape,
    default_weight_loader,
    weight_param,
)
from workers.models.mxfp4 import GROUP, Mxfp4Experts, splits_into_groups
from workers.models.ops import FUSED_ENABLED, triton_module


@dataclasses.dataclass(frozen=True)
class Layout:
    """How a checkpoint stores the stacked expert matrices."""

    transposed: bool  # [E, in, out] (the input multiplies from the left), not [E, out, in]
    interleaved: bool  # gate and up alternate along the gate/up outputs, not all gates then all ups


LAYOUTS = {"packed": Layout(False, False), "interleaved_transposed": Layout(True, True)}


@dataclasses.dataclass(frozen=True)
class Activation:
    """The experts' gated activation, `act(gate, up)` (alpha and limit: the clamped SwiGLU's)."""

    name: str
    alpha: float = 1.702
    limit: float = 7.0

    def __call__(self, gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
        special = GATED.get(self.name)
        return special(gate, up, self) if special is not None else ACTIVATIONS[self.name](gate) * up


def _swiglu_clamped(gate: torch.Tensor, up: torch.Tensor, act: Activation) -> torch.Tensor:
    """gpt-oss's SwiGLU: the gate clamped from above and up on both sides at `limit`, a sigmoid
    of gain `alpha`, and up offset by one."""
    gate = gate.clamp(max=act.limit)
    up = up.clamp(min=-act.limit, max=act.limit)
    return (up + 1) * (gate * torch.sigmoid(gate * act.alpha))


GATED = {"swiglu_clamped": _swiglu_clamped}  # activations that are not transformers' act(gate) * up


def route(
    logits: torch.Tensor, top_k: int, expert_scale: torch.Tensor | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """(float32 weights `[T, k]`, expert ids `[T, k]`): the softmax of each token's top-k logits,
    times each chosen expert's scale where the router has them."""
    top, ids = torch.topk(logits.float(), top_k, dim=-1)
    weights = torch.softmax(top, dim=-1)
    return (weights if expert_scale is None else weights * expert_scale[ids]), ids


def experts_torch(
    x: torch.Tensor,
    gate_up: torch.Tensor,
    down: torch.Tensor,
    weights: torch.Tensor,
    ids: torch.Tensor,
    act: Activation,
    gate_up_bias: torch.Tensor | None = None,
    down_bias: torch.Tensor | None = None,
    expert_map: torch.Tensor | None = None,
) -> torch.Tensor:
    """`sum_k weights[t, k] * expert_{ids[t, k]}(x[t])`, experts in ascending order as transformers
    adds them; every expert runs over every token and an unchosen one adds zero, so no shape
    depends on the routing. It rounds where the kernels do: products and sums in float32, the
    activated intermediate row once to x's dtype, the output once. Rounded after every projection
    and the activation as well (bf16 `F.linear`), it would differ from the kernels by about an ulp
    in most outputs, enough to flip near-tie routings downstream (docs/design.md §4.8).

    `expert_map` (expert parallelism, int64 `[all experts]`): each expert's index in these
    weights, -1 for one another rank holds, which adds nothing here; None: `ids` index the weights."""
    num_experts = gate_up.shape[0]
    matrix = _dequantized if isinstance(gate_up, Mxfp4Experts) else _float
    if expert_map is not None:
        local = expert_map[ids]
        ids = torch.where(local >= 0, local, num_experts)  # other ranks' experts: the column no expert reads
    combine = torch.zeros(x.shape[0], num_experts + 1, dtype=torch.float32, device=x.device).scatter_(1, ids, weights)
    out = torch.zeros(x.shape, dtype=torch.float32, device=x.device)
    xf = x.float()
    for e in range(num_experts):
        h = F.linear(xf, matrix(gate_up, e), None if gate_up_bias is None else gate_up_bias[e].float())
        h = act(*h.chunk(2, dim=-1)).to(x.dtype).float()  # as the kernels store the intermediate rows
        y = F.linear(h, matrix(down, e), None if down_bias is None else down_bias[e].float())
        out += combine[:, e, None] * y
    return out.to(x.dtype)


def _float(weights: torch.Tensor, e: int) -> torch.Tensor:
    return weights[e].float()


def _dequantized(weights: Mxfp4Experts, e: int) -> torch.Tensor:
    return weights.expert(e)


ExpertsFn = Callable[..., torch.Tensor]  # `experts_torch`'s signature


def _kernels_on(x: torch.Tensor) -> bool:
    return x.is_cuda and FUSED_MOE and FUSED_ENABLED and not torch.is_grad_enabled()


def experts_for(x: torch.Tensor, routed_early: bool = False) -> ExpertsFn:
    """The experts' implementation for `x`: the Triton kernels on CUDA (told `routed_early`, see
    `fused_experts`), else the torch path."""
    if not _kernels_on(x):
        return experts_torch
    return functools.partial(triton_module("fused_moe").fused_experts, routed_early=routed_early)


def _fused_router(x: torch.Tensor) -> bool:
    """Whether the router's Triton kernels route `x` (a few tokens on CUDA), else the torch path."""
    return _kernels_on(x) and triton_module("fused_router").applies(x)


FUSED_MOE = os.environ.get("SLIDESPEC_FUSED_MOE", "1") != "0"


class Router(nn.Module):
    """Chooses each token's experts: `forward(x) -> (weights, ids)` (`route`)."""

    def __init__(self, hidden_size: int, moe: MoEConfig, eps: float) -> None:
        super().__init__()
        self.top_k = moe.top_k
        self.proj = ReplicatedLinear(hidden_size, moe.num_experts, bias=moe.bias)
        self.input_scale = hidden_size**-0.5
        self.norm = RMSNorm(hidden_size, eps, False, scaled=False) if moe.router_norm else None
        if moe.router_norm:
            self.scale = weight_param((hidden_size,), default_weight_loader)
            self.per_expert_scale = weight_param((moe.num_experts,), default_weight_loader)
            for p in (self.scale, self.per_expert_scale):
                p.identity = 1.0  # type: ignore[attr-defined]  # its value in random-weight models

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        if _fused_router(x):
            norm = None if self.norm is None else (self.scale, self.norm.eps, self.input_scale)
            expert_scale = None if self.norm is None else self.per_expert_scale
            kernels = triton_module("fused_router")
            return kernels.route(x, self.proj.weight, self.proj.bias, self.top_k, norm, expert_scale)
        if self.norm is None:
            return route(self.proj(x), self.top_k)
        x = self.norm(x) * self.scale * self.input_scale
        return route(self.proj(x), self.top_k, self.per_expert_scale)


class Experts(nn.Module):
    """The stacked experts, shared by the tensor-parallel ranks by tensor (each holds its slice of
    every expert's intermediate dimension) or by expert (`MoEConfig.expert_parallel`: each holds
    the whole of num_experts / tp_size consecutive experts); `forward(x, weights, ids)` is the
    all-reduced weighted sum of the chosen experts' outputs. The down projection's bias is part of
    each expert's weighted output: by tensor every rank holds it whole and rank 0 alone adds it,
    by expert the rank holding the expert adds it. MXFP4 experts (`MoEConfig.mxfp4`) are held as
    their checkpoint's blocks and scales (`gate_up_proj_blocks`, ...) where this rank's matrices
    split into whole groups, else dequantised as they load."""

    def __init__(self, hidden_size: int, moe: MoEConfig, tp: TPGroup) -> None:
        super().__init__()
        width = moe.intermediate_size
        self.tp = tp
        self.expert_parallel = moe.expert_parallel and tp.size > 1
        if self.expert_parallel:
            if moe.num_experts % tp.size:
                raise ValueError(
                    f"moe_parallel: 'expert' needs num_experts divisible by tp_size; {moe.num_experts} experts "
                    f"over {tp.size} ranks ('tensor' splits every expert instead)"
                )
            self.count, self.local = moe.num_experts // tp.size, width  # experts held and their width
        else:
            if width % tp.size:
                raise ValueError(f"moe intermediate size {width} is not divisible by tp_size {tp.size}")
            self.count, self.local = moe.num_experts, width // tp.size
        self.first = tp.rank * self.count if self.expert_parallel else 0  # the first expert held
        self.start = 0 if self.expert_parallel else tp.rank * self.local  # the first intermediate column held
        self.layout = LAYOUTS[moe.layout]
        self.num_experts, self.top_k, self.hidden_size = moe.num_experts, moe.top_k, hidden_size
        self.width = width
        self.act = Activation(moe.activation, moe.swiglu_alpha, moe.swiglu_limit)
        e, h, n = self.count, hidden_size, self.local
        self.mxfp4 = moe.mxfp4 and splits_into_groups(h, n)
        if self.mxfp4:  # values per byte: 2 in the blocks, 32 a scale
            for name, (rows, cols) in {"gate_up_proj": (2 * n, h), "down_proj": (h, n)}.items():
                load = self._load_gate_up if name == "gate_up_proj" else self._load_down
                for suffix, per in (("_blocks", 2), ("_scales", GROUP)):
                    param = weight_param((e, rows, cols // per), load, dtype=torch.uint8)
                    param.values_per_element = per  # type: ignore[attr-defined]
                    setattr(self, name + suffix, param)
        else:
            self.gate_up_proj = weight_param((e, 2 * n, h), self._load_gate_up)
            self.down_proj = weight_param((e, h, n), self._load_down)
        self.gate_up_proj_bias = weight_param((e, 2 * n), self._load_gate_up) if moe.bias else None
        self.down_proj_bias = weight_param((e, h), self._load_down_bias) if moe.bias else None
        expert_map = None  # each expert's index among those held, -1 for another rank's
        if self.expert_parallel:
            index = torch.arange(moe.num_experts, dtype=torch.int64) - self.first
            expert_map = index.where((index >= 0) & (index < self.count), -1)
        self.register_buffer("expert_map", expert_map, persistent=False)

    def _canonical(self, param: torch.Tensor, loaded: torch.Tensor, shape: tuple[int, ...]) -> torch.Tensor:
        """The checkpoint tensor, its whole shape checked in the checkpoint's layout, as `shape`
        (`[E, out, in]` matrices), narrowed to the experts this rank holds. MXFP4 blocks and
        scales are `[E, out, in / per]` already (the blocks' last two dimensions flattened)."""
        per = getattr(param, "values_per_element", None)
        if per is not None:
            if per == 2 and loaded.dim() == 4:
                loaded = loaded.flatten(2)
            shape = (*shape[:2], shape[2] // per)
            check_shape(loaded, shape)
        elif self.layout.transposed and len(shape) == 3:
            check_shape(loaded, (shape[0], shape[2], shape[1]))
            loaded = loaded.transpose(1, 2)
        else:
            check_shape(loaded, shape)
        return loaded.narrow(0, self.first, self.count)

    def _load_gate_up(self, param: torch.Tensor, loaded: torch.Tensor, shard_id: object = None) -> None:
        shape = (self.num_experts, 2 * self.width, self.hidden_size)[: param.dim()]
        full = self._canonical(param, loaded, shape)
        gate, up = (full[:, 0::2], full[:, 1::2]) if self.layout.interleaved else full.chunk(2, dim=1)
        start, n = self.start, self.local
        param.data.copy_(torch.cat([gate.narrow(1, start, n), up.narrow(1, start, n)], dim=1))

    def _load_down(self, param: torch.Tensor, loaded: torch.Tensor, shard_id: object = None) -> None:
        full = self._canonical(param, loaded, (self.num_experts, self.hidden_size, self.width))
        per = getattr(param, "values_per_element", 1)  # the intermediate columns held, in elements
        param.data.copy_(full.narrow(2, self.start // per, self.local // per))

    def _load_down_bias(self, param: torch.Tensor, loaded: torch.Tensor, shard_id: object = None) -> None:
        param.data.copy_(self._canonical(param, loaded, (self.num_experts, self.hidden_size)))

    def matrices(self) -> tuple[torch.Tensor | Mxfp4Experts, torch.Tensor | Mxfp4Experts]:
        """The gate/up and down matrices as the experts' implementations take them."""
        if not self.mxfp4:
            return self.gate_up_proj, self.down_proj
        return (
            Mxfp4Experts(self.gate_up_proj_blocks, self.gate_up_proj_scales),
            Mxfp4Experts(self.down_proj_blocks, self.down_proj_scales),
        )

    def forward(
        self,
        x: torch.Tensor,
        weights: torch.Tensor,
        ids: torch.Tensor,
        reduce: bool = True,
        routed_early: bool = False,
    ) -> torch.Tensor | Unreduced:
        """The experts' output, all-reduced; `reduce=False`: this rank's part (`Unreduced`).
        `routed_early`: a kernel ran between the router and this call (`fused_experts`)."""
        down_bias = self.down_proj_bias if self.expert_parallel or self.tp.rank == 0 else None
        gate_up, down = self.matrices()
        biases = (self.gate_up_proj_bias, down_bias)
        run = experts_for(x, routed_early)
        out = run(x, gate_up, down, weights, ids, self.act, *biases, self.expert_map)
        return self.tp.all_reduce(out) if reduce else Unreduced(out, None, self.tp)


class SparseMoE(nn.Module):
    """A feed-forward block that is only experts (gpt-oss's MLP): the router reads its input."""

    def __init__(self, hidden_size: int, moe: MoEConfig, eps: float, tp: TPGroup) -> None:
        super().__init__()
        self.router = Router(hidden_size, moe, eps)
        self.experts = Experts(hidden_size, moe, tp)

    def forward(self, x: torch.Tensor, reduce: bool = True) -> torch.Tensor | Unreduced:
        return self.experts(x, *self.router(x), reduce=reduce)
