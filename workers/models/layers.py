"""Tensor-parallel building blocks, in the column/row scheme of Megatron-LM.

Every parameter carries a `weight_loader(param, loaded, shard_id=None)` that copies this rank's
slice of a full checkpoint tensor, so loading is the same for any `tp_size`.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import nn

from workers.distributed import TPGroup
from workers.memory.allocator import cdiv
from workers.models import fp8
from workers.models.ops import embed_rows, ops_for


def weight_param(shape: tuple[int, ...], loader: Callable[..., None], dtype: torch.dtype | None = None) -> nn.Parameter:
    p = nn.Parameter(torch.empty(shape, dtype=dtype), requires_grad=False)
    p.weight_loader = loader  # type: ignore[attr-defined]
    return p


def check_shape(loaded: torch.Tensor, expected: tuple[int, ...]) -> None:
    """The whole checkpoint tensor against the shape the config implies, before any rank takes
    its slice (a larger tensor would otherwise slice cleanly into wrong weights)."""
    if tuple(loaded.shape) != tuple(expected):
        raise ValueError(f"checkpoint shape {tuple(loaded.shape)}, the config implies {tuple(expected)}")


def default_weight_loader(param: torch.Tensor, loaded: torch.Tensor, shard_id: object = None) -> None:
    check_shape(loaded, param.shape)
    param.data.copy_(loaded)


def head_param(num_heads: int, tp: TPGroup, dtype: torch.dtype = torch.float32) -> nn.Parameter:
    """One value per attention head (gpt-oss's sink logits, float32 as the kernels read them):
    this rank's heads of the checkpoint's vector."""
    local = num_heads // tp.size

    def load(param: torch.Tensor, loaded: torch.Tensor, shard_id: object = None) -> None:
        check_shape(loaded, (num_heads,))
        param.data.copy_(loaded.narrow(0, tp.rank * local, local))

    p = nn.Parameter(torch.zeros(local, dtype=dtype), requires_grad=False)
    p.weight_loader = load  # type: ignore[attr-defined]
    return p


class VocabParallelEmbedding(nn.Module):
    """Rows of the vocabulary split over ranks (padded to a multiple of tp_size)."""

    def __init__(self, vocab_size: int, hidden_size: int, tp: TPGroup) -> None:
        super().__init__()
        self.vocab_size = vocab_size
        self.tp = tp
        self.shard = cdiv(vocab_size, tp.size)
        self.start = tp.rank * self.shard
        self.weight = weight_param((self.shard, hidden_size), self._load)

    def _load(self, param: torch.Tensor, loaded: torch.Tensor, shard_id: object = None) -> None:
        check_shape(loaded, (self.vocab_size, param.shape[1]))
        rows = loaded[self.start : self.start + self.shard]
        param.data.zero_()
        param.data[: rows.shape[0]].copy_(rows)

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        if self.tp.size == 1:
            return F.embedding(input_ids, self.weight)
        local = input_ids - self.start
        outside = (local < 0) | (local >= self.shard)
        out = F.embedding(local.masked_fill(outside, 0), self.weight)
        out.masked_fill_(outside[:, None], 0)
        return self.tp.all_reduce(out)


class ParallelLMHead(VocabParallelEmbedding):
    """Vocabulary-parallel output projection; `logits` gathers the full vocabulary."""

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        local = ops_for(hidden).linear(hidden, self.weight, None)
        return self.tp.all_gather(local, dim=-1)[:, : self.vocab_size]


class Projection(nn.Module):
    """What column- and row-parallel projections share: a weight in the model's dtype, or in FP8
    with its scales when the model is built with FP8 projections (`workers/models/fp8.py`,
    docs/design.md §4.9), and the product that reads it."""

    tp: TPGroup
    weight_scale: torch.Tensor | None
    _load: Callable[..., None]  # a checkpoint tensor's slice of this rank, as `weight_param` loaders
    _load_scale: Callable[..., None]  # the same for its FP8 scale

    def _weight(self, shape: tuple[int, int], scale_shape: Callable[[fp8.Fp8Layout], tuple[int, ...]]) -> None:
        """`weight` (and, for FP8, `weight_scale` of `scale_shape(layout)`), loaded by `_load`
        (and `_load_scale`)."""
        self.layout = fp8.layout_in_build()
        if self.layout is None:
            self.weight = weight_param(shape, self._load)
            self.weight_scale = None
            return
        self.weight = fp8.weight_param(shape, self._load_fp8)
        self.weight_scale = fp8.scale_param(scale_shape(self.layout), self._load_scale, self.layout.from_checkpoint)

    def _load_fp8(self, param: torch.Tensor, loaded: torch.Tensor, shard_id: int | str | None = None) -> None:
        """A checkpoint's FP8 weight as it is; any other quantised whole first (the same scales
        on every rank), on this device."""
        if loaded.dtype != fp8.FP8:
            loaded, scale = fp8.quantize(loaded.to(param.device), self.layout.block)
            self._load_scale(self.weight_scale, scale, shard_id)
        self._load(param, loaded, shard_id)

    def _product(self, x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        if self.weight_scale is None:
            return ops_for(x).linear(x, self.weight, bias)
        return ops_for(x).fp8_linear(x, self.weight, self.weight_scale, self.layout.block, bias)


class ColumnParallelLinear(Projection):
    """`y = x W^T + b` with W's output rows split over ranks; output stays sharded.

    `output_sizes` lists the checkpoint tensors stacked into this one (each split over ranks
    separately), e.g. [intermediate, intermediate] for a merged gate/up projection.
    """

    def __init__(self, input_size: int, output_sizes: list[int], bias: bool, tp: TPGroup) -> None:
        super().__init__()
        self.tp = tp
        self.input_size = input_size
        self.output_sizes = list(output_sizes)
        self.local_sizes = [self._local_size(i, size) for i, size in enumerate(output_sizes)]
        self.offsets = [sum(self.local_sizes[:i]) for i in range(len(output_sizes))]
        out = sum(self.local_sizes)
        split = len(self.local_sizes) > 1 or tp.size > 1
        self._weight((out, input_size), lambda f: fp8.scale_shape(self.local_sizes, input_size, f.block, split))
        self.bias = weight_param((out,), self._load) if bias else None

    def _local_size(self, shard: int, size: int) -> int:
        if size % self.tp.size:
            raise ValueError(f"output size {size} is not divisible by tp_size {self.tp.size}")
        return size // self.tp.size

    def _row_start(self, shard_id: int) -> int:
        """The first row of this rank's slice of checkpoint tensor `shard_id`."""
        return self.tp.rank * self.local_sizes[shard_id]

    def _load(self, param: torch.Tensor, loaded: torch.Tensor, shard_id: int | str | None = None) -> None:
        idx = self._shard_index(shard_id)
        check_shape(loaded, (self.output_sizes[idx], *param.shape[1:]))
        rows = loaded.narrow(0, self._row_start(idx), self.local_sizes[idx])
        param.data.narrow(0, self.offsets[idx], self.local_sizes[idx]).copy_(rows)

    def _load_scale(self, param: torch.Tensor, loaded: torch.Tensor, shard_id: int | str | None = None) -> None:
        """The scale rows of this rank's rows (a block's row covers `block[0]` weight rows)."""
        idx = self._shard_index(shard_id)
        scale = fp8.checkpoint_scale(loaded, self.output_sizes[idx], self.input_size, self.layout.block)
        per = self.layout.block[0] if self.layout.block else 1
        n = cdiv(self.local_sizes[idx], per)
        param.data.narrow(0, self.offsets[idx] // per, n).copy_(scale.narrow(0, self._row_start(idx) // per, n))

    def _shard_index(self, shard_id: int | str | None) -> int:
        return 0 if shard_id is None else int(shard_id)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self._product(x, self.bias)

    def act_and_mul(self, x: torch.Tensor, act: str) -> torch.Tensor:
        """`act(gate) * up` of a merged [gate, up] projection, fused where the device can."""
        if self.weight_scale is not None:
            return ops_for(x).fp8_linear_act_and_mul(
                x, self.weight, self.weight_scale, self.layout.block, self.bias, act
            )
        return ops_for(x).linear_act_and_mul(x, self.weight, self.bias, act)

    def after_norm(
        self,
        x: torch.Tensor | Unreduced,
        residual: torch.Tensor,
        norm: RMSNorm,
        before: RMSNorm | None,
        scale: torch.Tensor | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """This projection of `norm.add(x, residual, before, scale)`'s output, and the residual
        stream, fused where the device can: the norm inside the projection's kernel, or, for
        partial sums whose group fuses their all-reduce with the add and norm, that kernel, then
        the projection (FP8 weights: the norm, then the projection)."""
        if isinstance(x, Unreduced) and not x.fuses_norm():
            x = x.reduce()
        if self.weight_scale is not None or isinstance(x, Unreduced):
            normed, residual = norm.add(x, residual, before, scale)
            return self(normed), residual
        w_before = None if before is None else before.weight
        return ops_for(x).add_rms_norm_linear(
            x, residual, norm.weight, norm.eps, norm.gemma, w_before, self.weight, self.bias, scale
        )

    def after_embedding(
        self, ids: torch.Tensor, table: torch.Tensor, scale: float, norm: RMSNorm
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """This projection of `norm` over the ids' embedding rows times `scale`, and those rows
        (the residual stream's start), fused where the device can (one kernel from the ids;
        FP8 weights: the rows, the norm, then the projection)."""
        if self.weight_scale is not None:
            rows = embed_rows(ids, table, scale)
            return self(norm(rows)), rows
        ops = ops_for(table)
        return ops.embed_rms_norm_linear(ids, table, scale, norm.weight, norm.eps, norm.gemma, self.weight, self.bias)


class QKVParallelLinear(ColumnParallelLinear):
    """Fused q/k/v projection split by heads. With fewer KV heads than ranks, KV heads are
    replicated: rank r holds KV head r * num_kv_heads // tp_size. `shards` ("q", "k"): no V
    projection (its layer's V is the K projection's output)."""

    def __init__(
        self,
        hidden_size: int,
        head_dim: int,
        num_heads: int,
        num_kv_heads: int,
        bias: bool,
        tp: TPGroup,
        shards: tuple[str, ...] = ("q", "k", "v"),
    ) -> None:
        self.head_dim = head_dim
        self.shards = shards
        self.num_heads, self.num_kv_heads = self.local_heads(num_heads, num_kv_heads, tp)
        replicated = num_kv_heads < tp.size
        self._kv_head_start = tp.rank * num_kv_heads // tp.size if replicated else tp.rank * self.num_kv_heads
        sizes = [num_heads * head_dim] + [num_kv_heads * head_dim] * (len(shards) - 1)
        super().__init__(hidden_size, sizes, bias, tp)
        for p in (self.weight, self.bias, self.weight_scale):
            if p is not None:
                p.shard_ids = shards  # type: ignore[attr-defined]  # what a checkpoint must provide

    @staticmethod
    def local_heads(num_heads: int, num_kv_heads: int, tp: TPGroup) -> tuple[int, int]:
        """(query heads, KV heads) on one rank."""
        if num_heads % tp.size:
            raise ValueError(f"num_attention_heads {num_heads} is not divisible by tp_size {tp.size}")
        if num_kv_heads >= tp.size and num_kv_heads % tp.size:
            raise ValueError(f"num_key_value_heads {num_kv_heads} is not divisible by tp_size {tp.size}")
        if num_kv_heads < tp.size and tp.size % num_kv_heads:
            raise ValueError(f"tp_size {tp.size} is not a multiple of num_key_value_heads {num_kv_heads}")
        return num_heads // tp.size, max(1, num_kv_heads // tp.size)

    def _local_size(self, shard: int, size: int) -> int:
        return (self.num_heads if shard == 0 else self.num_kv_heads) * self.head_dim

    def _shard_index(self, shard_id: int | str | None) -> int:
        return self.shards.index(shard_id)

    def _row_start(self, shard_id: int) -> int:
        return super()._row_start(0) if shard_id == 0 else self._kv_head_start * self.head_dim

    def split(self, qkv: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """(q, k, v) views; without a V projection, v is k's view."""
        parts = qkv.split(self.local_sizes, dim=-1)
        return parts if len(parts) == 3 else (*parts, parts[1])


class RowParallelLinear(Projection):
    """`y = x W^T + b` with W's input columns split over ranks; partial sums are all-reduced."""

    def __init__(self, input_size: int, output_size: int, bias: bool, tp: TPGroup) -> None:
        super().__init__()
        if input_size % tp.size:
            raise ValueError(f"input size {input_size} is not divisible by tp_size {tp.size}")
        self.tp = tp
        self.output_size = output_size
        self.local_in = input_size // tp.size
        self._weight((output_size, self.local_in), self._scale_shape)
        self.bias = weight_param((output_size,), default_weight_loader) if bias else None

    def _scale_shape(self, layout: fp8.Fp8Layout) -> tuple[int, ...]:
        block = layout.block
        if block is not None and self.tp.size > 1 and self.local_in % block[1]:
            raise ValueError(
                f"config.json: quantization_config.weight_block_size {list(block)}: {self.local_in} input columns "
                f"a rank are not whole blocks of {block[1]} (split projections are split by blocks)"
            )
        return fp8.scale_shape([self.output_size], self.local_in, block, split=False)

    def _load(self, param: torch.Tensor, loaded: torch.Tensor, shard_id: object = None) -> None:
        check_shape(loaded, (param.shape[0], self.local_in * self.tp.size))
        param.data.copy_(loaded.narrow(1, self.tp.rank * self.local_in, self.local_in))

    def _load_scale(self, param: torch.Tensor, loaded: torch.Tensor, shard_id: object = None) -> None:
        """Every row's scales; per block, the columns of this rank's blocks."""
        block = self.layout.block
        scale = fp8.checkpoint_scale(loaded, self.output_size, self.local_in * self.tp.size, block)
        if block is not None:
            scale = scale.narrow(1, self.tp.rank * self.local_in // block[1], param.shape[1])
        param.data.copy_(scale)

    def forward(self, x: torch.Tensor, reduce: bool = True) -> torch.Tensor | Unreduced:
        """The product, all-reduced; `reduce=False`: this rank's partial sums, for the norm after
        the projection to reduce (`Unreduced`)."""
        out = Unreduced(self._product(x, None), self.bias, self.tp)
        return out.reduce() if reduce else out


@dataclasses.dataclass
class Unreduced:
    """A row-parallel projection's output before its all-reduce: this rank's partial sums and the
    bias their sum takes. The norm after it reduces it (`RMSNorm.add`), in one kernel with the
    residual add and the norm where the group can (`TPGroup.all_reduce_add_rms_norm`); whatever
    else reads it takes `reduced`. Reduce it once: NCCL sums the partial sums in place."""

    partial: torch.Tensor
    bias: torch.Tensor | None
    tp: TPGroup

    def reduce(self) -> torch.Tensor:
        out = self.tp.all_reduce(self.partial)
        return out + self.bias if self.bias is not None else out

    def fuses_norm(self) -> bool:
        """Whether the norm after it runs the all-reduce, add and norm as one kernel."""
        return self.tp.method(self.partial, then_norm=True) == "one_shot_fused"


def reduced(x: torch.Tensor | Unreduced) -> torch.Tensor:
    """`x` all-reduced, if it is not yet."""
    return x.reduce() if isinstance(x, Unreduced) else x


class ReplicatedLinear(nn.Module):
    """`y = x W^T + b` with the whole weight on every rank (small draft-head projections)."""

    def __init__(self, input_size: int, output_size: int, bias: bool) -> None:
        super().__init__()
        self.weight = weight_param((output_size, input_size), default_weight_loader)
        self.bias = weight_param((output_size,), default_weight_loader) if bias else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return ops_for(x).linear(x, self.weight, self.bias)

    def after_add(
        self, x: torch.Tensor | Unreduced, residual: torch.Tensor, before: RMSNorm
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """(this projection of s, s) for the stream s = residual + before(x), in one kernel where
        the device fuses them (Gemma 4's per-layer input gate reads the stream after the MLP)."""
        x = reduced(x)
        return ops_for(x).add_rms_norm_linear(
            x, residual, None, before.eps, before.gemma, before.weight, self.weight, self.bias
        )

    def gated(self, gate: torch.Tensor, up: torch.Tensor, act: str) -> torch.Tensor:
        """This projection of `act(gate) * up`, the activation inside its kernel where the device
        fuses it."""
        return ops_for(gate).gated_linear(gate, up, act, self.weight, self.bias)


class RMSNorm(nn.Module):
    """RMSNorm (Gemma 2 and 3 scale by 1 + w); `add` fuses the residual add before it. The math
    is the device's op set's (`workers/models/ops.py`). `scaled=False`: no weight (Gemma 4's
    value norm), a unit scale that is no parameter."""

    def __init__(self, size: int, eps: float, gemma: bool, scaled: bool = True) -> None:
        super().__init__()
        self.eps = eps
        self.gemma = gemma
        if scaled:
            self.weight = weight_param((size,), default_weight_loader)
        else:
            self.register_buffer("weight", torch.empty(size), persistent=False)
        self.reset_parameters()

    def reset_parameters(self) -> None:
        nn.init.zeros_(self.weight) if self.gemma else nn.init.ones_(self.weight)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return ops_for(x).rms_norm(x, self.weight, self.eps, self.gemma)

    def added_to(self, x: torch.Tensor, residual: torch.Tensor, residual_norm: RMSNorm | None = None) -> torch.Tensor:
        """`residual + self(x)`, or `residual_norm(residual) + self(x)` (a norm of the same
        kind), in one kernel where the device fuses them (residual's storage may be reused)."""
        if residual_norm is not None and (residual_norm.eps, residual_norm.gemma) != (self.eps, self.gemma):
            have, want = (residual_norm.eps, residual_norm.gemma), (self.eps, self.gemma)
            raise ValueError(f"added_to: residual_norm's (eps, gemma) {have} differ from this norm's {want}")
        other = None if residual_norm is None else residual_norm.weight
        return ops_for(x).norm_add(x, residual, self.weight, self.eps, self.gemma, None, other)

    def add(
        self,
        x: torch.Tensor | Unreduced,
        residual: torch.Tensor | None,
        before: RMSNorm | None = None,
        scale: torch.Tensor | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """(norm(s), s) with s = (residual + x') * scale, x' = before(x) (x without `before`: the
        norm a sub-layer's output still needs, fused in; no scale: 1); the first layer starts the
        residual stream. Partial sums (`Unreduced`) are all-reduced first, in the same kernel
        where the group fuses them (`TPGroup.all_reduce_add_rms_norm`)."""
        if residual is None:
            x = reduced(x)
            x = before(x) if before is not None else x
            x = x * scale if scale is not None else x
            return self(x), x
        w_before = None if before is None else before.weight
        if isinstance(x, Unreduced):
            return x.tp.all_reduce_add_rms_norm(
                x.partial, residual, self.weight, self.eps, self.gemma, w_before, x.bias, scale
            )
        return ops_for(x).add_rms_norm(x, residual, self.weight, self.eps, self.gemma, w_before, scale)


def rope_cache(inv_freq: torch.Tensor, scaling: float, max_positions: int) -> torch.Tensor:
    """`[max_positions, rotary_dim]` float32: cos then sin of position x inv_freq (times the
    variant's attention scaling), computed once at start-up as Hugging Face computes them."""
    positions = torch.arange(max_positions, device=inv_freq.device)
    freqs = positions[:, None].float() * inv_freq[None, :]
    return torch.cat([freqs.cos() * scaling, freqs.sin() * scaling], dim=-1)
