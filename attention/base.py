"""The attention backend interface and the backend registry."""

from __future__ import annotations

import abc
import dataclasses
import importlib
from typing import Any, NamedTuple

import torch

from attention.batch import AttentionBatch
from attention.forward_mode import ForwardMode
from attention.kernels.calls import Rotary
from attention.kv_pool import KVPool


@dataclasses.dataclass(eq=False)
class AttentionLayer:
    """Static attention parameters of one layer, as seen by this rank (heads already sharded).

    `layer_id` names the KV layer in the pool: usually the model layer itself, the target
    layer whose KV is read for frozen-KV draft layers.
    `sliding_window` counts the keys a query sees including itself (Hugging Face's meaning;
    flashinfer's `window_left` is `sliding_window - 1`); None means full attention.
    `k_scale` / `v_scale`: the checkpoint's scales of the KV this layer stores, for an FP8 cache
    (a stored value times its scale is the value; 1.0 when the checkpoint has none). The pool
    built from the layer keeps them (`KVPool.kv_scales`) and every read and write takes them
    from there, so a layer reading another's KV reads it with the writer's scales.
    """

    layer_id: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    scaling: float
    sliding_window: int | None = None
    logit_softcap: float | None = None
    sinks: torch.Tensor | None = None  # [num_heads] learned sink logits
    k_scale: float = 1.0
    v_scale: float = 1.0

    def __post_init__(self) -> None:
        if self.num_heads % self.num_kv_heads:
            raise ValueError(
                f"layer {self.layer_id}: num_heads {self.num_heads} is not a multiple of "
                f"num_kv_heads {self.num_kv_heads}"
            )
        if self.sliding_window is not None and self.sliding_window < 1:
            raise ValueError(f"layer {self.layer_id}: sliding_window must be >= 1, got {self.sliding_window}")


class KVDestination(NamedTuple):
    """Where a forward's new K and V of one layer go, for a caller that writes them itself: the
    layer's paged cache, the write slots in it, and the (K, V) scales an FP8 cache quantises
    with ((1.0, 1.0) for a cache in the model's dtype)."""

    cache: torch.Tensor
    slots: torch.Tensor
    scales: tuple[float, float]


class AttentionBackend(abc.ABC):
    """Computes attention for every layer of one model.

    Per forward: `init_forward_metadata(batch, pool)` once, then `forward(layer, ...)` for each
    layer. Everything derived from the batch or the pool is computed in
    `init_forward_metadata` and dropped at the next call; nothing is cached at construction.
    """

    name: str = ""

    def __init__(self, device: torch.device, debug_kv_checks: bool = False) -> None:
        self.device = device

    def kernel_name(self, mode: ForwardMode) -> str | None:
        """The kernel this backend runs for a forward mode (recorded in traces)."""
        return self.name

    def prepare(self, layers: list[AttentionLayer], page_size: int, kv_dtype: torch.dtype | None = None) -> None:
        """Check at start-up that this backend can run these layers over a KV cache of
        `kv_dtype` (None: the model's dtype); raise ValueError if not."""

    @abc.abstractmethod
    def init_forward_metadata(self, batch: AttentionBatch, pool: KVPool) -> None:
        """Prepare this forward's metadata from the batch and the pool its layers use."""

    def kv_destination(self, layer: AttentionLayer) -> KVDestination | None:
        """Where this forward's new K and V of `layer` go, for a caller that writes them itself
        (the fused RoPE kernel) and then calls `forward` with k, v None; the slots are checked as
        `forward` checks them. None: pass k, v to `forward`."""
        return None

    def forward_rotating(
        self,
        layer: AttentionLayer,
        q: torch.Tensor,
        k: torch.Tensor | None,
        v: torch.Tensor | None,
        rotary: Rotary,
    ) -> torch.Tensor | None:
        """Attention of raw projections, RoPE (and the q/k norms) applied and the new K and V
        written by the attention kernel itself, where this forward's kernel does so; None
        otherwise (the caller rotates, writes and calls `forward`). q, k, v: `[T, heads,
        head_dim]` views (k, v None: the layer reads KV another layer wrote)."""
        return None

    @abc.abstractmethod
    def forward(
        self,
        layer: AttentionLayer,
        q: torch.Tensor,
        k: torch.Tensor | None,
        v: torch.Tensor | None,
    ) -> torch.Tensor:
        """Write this forward's new `k`, `v` (when given) into the pool and attend.

        q: `[T, num_heads * head_dim]`; k, v: `[T, num_kv_heads * head_dim]` or None when the
        layer only reads KV written by another layer. Returns `[T, num_heads * head_dim]`.
        """


_BACKENDS: dict[str, str] = {
    "torch_native": "attention.torch_native:TorchNativeBackend",
    "trtllm_mha": "attention.trtllm_mha:TRTLLMMHABackend",
}


def register_backend(name: str, target: str) -> None:
    """Register a backend class by import path ("module:Class"), imported on first use."""
    _BACKENDS[name] = target


def backend_names() -> list[str]:
    return sorted(_BACKENDS)


def create_backend(name: str, device: torch.device, **kwargs: Any) -> AttentionBackend:
    if name not in _BACKENDS:
        raise ValueError(f"attention_backend: unknown backend {name!r}; known: {backend_names()}")
    module_name, cls_name = _BACKENDS[name].split(":")
    cls = getattr(importlib.import_module(module_name), cls_name)
    return cls(device=device, **kwargs)
