"""KV pools: where each layer's K and V live. Both implement `attention.KVPool`.

`MHAPool` keeps every layer in the full index space. `HybridSWAPool` pairs a full pool for
full-attention layers with a smaller SWA pool for sliding-window layers and translates through
the allocator's `full_to_swa` map (the same tensor object for the pool's whole life).

Each layer's buffer has that layer's own KV heads and head size (`KVLayout`): Gemma 4's
sliding and full layers differ. Only layers that store KV have one; a layer reading another's
KV (KV sharing, frozen-KV drafts) names that layer and adds nothing (docs/design.md §4.6).

Buffers are in the model's dtype or FP8 (`kv_cache_dtype: fp8_e4m3`, half a bf16 slot's bytes);
an FP8 pool keeps each KV layer's K and V scales and quantises every write with them
(docs/design.md §4.7).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterable

import numpy as np
import torch

from attention import AttentionLayer
from attention.kv_pool import FP8_E4M3
from workers.memory.allocator import HybridSWAAllocator, KVAllocator
from workers.memory.kv_write import kv_writer


@dataclasses.dataclass(frozen=True)
class KVLayout:
    """What one KV layer stores a token, as one rank sees it: K and V of `num_kv_heads` heads of
    `head_dim`, for a window of `sliding_window` keys (None: full attention), and the scales an
    FP8 cache stores them with."""

    sliding_window: int | None
    num_kv_heads: int
    head_dim: int
    k_scale: float = 1.0
    v_scale: float = 1.0


def kv_layouts(layers: Iterable[AttentionLayer]) -> dict[int, KVLayout]:
    """The KV layers a model's attention layers read (`layer_id`), each once. Layers reading the
    same KV layer must agree on its layout."""
    layouts: dict[int, KVLayout] = {}
    for layer in layers:
        layout = KVLayout(layer.sliding_window, layer.num_kv_heads, layer.head_dim, layer.k_scale, layer.v_scale)
        if layouts.setdefault(layer.layer_id, layout) != layout:
            raise ValueError(
                f"KV layer {layer.layer_id}: read as {layout} and as {layouts[layer.layer_id]}; "
                "a KV layer has one layout"
            )
    return layouts


class MHAPool:
    """Paged K/V buffers for a set of layers, all indexed by full-pool slots; each layer's
    buffer in its own (KV heads, head size)."""

    def __init__(
        self,
        layers: dict[int, tuple[int, int]],
        num_pages: int,
        page_size: int,
        dtype: torch.dtype,
        device: torch.device | str,
        scales: dict[int, tuple[float, float]] | None = None,
    ) -> None:
        """`layers`: KV layer id -> (KV heads, head size); `scales`: KV layer id -> (K scale,
        V scale) of an FP8 pool (default 1.0; a pool in the model's dtype has none)."""
        self._write = kv_writer(device)
        self.page_size = page_size
        self.num_pages = num_pages  # page ids; buffers hold one more (padding page 0)
        self._index = {layer_id: i for i, layer_id in enumerate(layers)}
        self.kv_buffers = [
            torch.zeros((num_pages + 1, 2, heads, page_size, dim), dtype=dtype, device=device)
            for heads, dim in layers.values()
        ]
        fp8 = dtype == FP8_E4M3
        self._scales = {i: (scales or {}).get(i, (1.0, 1.0)) if fp8 else (1.0, 1.0) for i in layers}

    @property
    def slot_bytes(self) -> int:
        """Bytes one slot holds over every layer here (K and V)."""
        return sum(buf[0].numel() * buf.element_size() for buf in self.kv_buffers) // self.page_size

    @property
    def kv_bytes(self) -> dict[str, int]:
        """Bytes a slot of each index space holds in this pool."""
        return {"full": self.slot_bytes, "swa": 0}

    @property
    def has_swa(self) -> bool:
        return False

    @property
    def swa_window(self) -> int | None:
        return None

    def holds(self, layer_id: int) -> bool:
        return layer_id in self._index

    def is_swa_layer(self, layer_id: int) -> bool:
        self._slot(layer_id)
        return False

    def translate_full_to_swa(self, full_locs: torch.Tensor) -> torch.Tensor:
        raise RuntimeError("MHAPool has no SWA index space; nothing to translate")

    def translate_full_to_swa_host(self, full_locs: np.ndarray) -> np.ndarray:
        raise RuntimeError("MHAPool has no SWA index space; nothing to translate")

    def kv_cache(self, layer_id: int) -> torch.Tensor:
        return self.kv_buffers[self._slot(layer_id)]

    def kv_scales(self, layer_id: int) -> tuple[float, float]:
        self._slot(layer_id)
        return self._scales[layer_id]

    def set_kv(self, layer_id: int, locs: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> None:
        self._write(self.kv_cache(layer_id), locs, k, v, *self.kv_scales(layer_id))

    def write_slots(self, layer_id: int, locs: torch.Tensor) -> torch.Tensor:
        self._slot(layer_id)
        return locs

    def _slot(self, layer_id: int) -> int:
        try:
            return self._index[layer_id]
        except KeyError:
            raise KeyError(f"KV pool holds layers {sorted(self._index)}, not layer {layer_id}") from None


class HybridSWAPool:
    """Full pool for full-attention layers, SWA pool for sliding-window layers."""

    def __init__(
        self,
        full: MHAPool,
        swa: MHAPool,
        full_to_swa: torch.Tensor,
        full_to_swa_host: np.ndarray,
        sliding_window: int,
    ) -> None:
        """`full_to_swa`: the allocator's map on the device; `full_to_swa_host`: its host master."""
        self.full = full
        self.swa = swa
        self.page_size = full.page_size
        self._full_to_swa = full_to_swa
        self._full_to_swa_host = full_to_swa_host
        self._window = sliding_window

    @property
    def has_swa(self) -> bool:
        return True

    @property
    def kv_bytes(self) -> dict[str, int]:
        return {"full": self.full.slot_bytes, "swa": self.swa.slot_bytes}

    @property
    def swa_window(self) -> int | None:
        return self._window

    def is_swa_layer(self, layer_id: int) -> bool:
        if self.swa.holds(layer_id):
            return True
        self.full._slot(layer_id)
        return False

    def translate_full_to_swa(self, full_locs: torch.Tensor) -> torch.Tensor:
        return self._full_to_swa[full_locs.long()]

    def translate_full_to_swa_host(self, full_locs: np.ndarray) -> np.ndarray:
        return self._full_to_swa_host[full_locs]

    def _pool(self, layer_id: int) -> MHAPool:
        return self.swa if self.is_swa_layer(layer_id) else self.full

    def kv_cache(self, layer_id: int) -> torch.Tensor:
        return self._pool(layer_id).kv_cache(layer_id)

    def kv_scales(self, layer_id: int) -> tuple[float, float]:
        return self._pool(layer_id).kv_scales(layer_id)

    def set_kv(self, layer_id: int, locs: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> None:
        self._pool(layer_id).set_kv(layer_id, locs, k, v)

    def write_slots(self, layer_id: int, locs: torch.Tensor) -> torch.Tensor:
        return self._pool(layer_id).write_slots(layer_id, locs)


def build_pool(
    layouts: dict[int, KVLayout],
    allocator: KVAllocator,
    dtype: torch.dtype,
    device: torch.device | str,
    use_swa_pool: bool = True,
) -> MHAPool | HybridSWAPool:
    """A pool for one model's KV layers (`kv_layouts` of its attention layers) on a (possibly
    shared) allocator, its buffers in `dtype` (the model's, or FP8 with the layouts' scales).

    Sliding-window layers go to the SWA pool when the allocator keeps one and `use_swa_pool`;
    otherwise every layer is full (windows are then only a mask)."""
    p = allocator.page_size
    shapes = {i: (layout.num_kv_heads, layout.head_dim) for i, layout in layouts.items()}
    scales = {i: (layout.k_scale, layout.v_scale) for i, layout in layouts.items()}
    swa_layers = [i for i, layout in layouts.items() if layout.sliding_window is not None]
    if not (use_swa_pool and swa_layers and isinstance(allocator, HybridSWAAllocator)):
        return MHAPool(shapes, allocator.full.num_ids, p, dtype, device, scales)
    windows = {i: layouts[i].sliding_window for i in swa_layers}
    too_wide = {i: w for i, w in windows.items() if w > allocator.sliding_window}
    if too_wide:
        raise ValueError(
            f"sliding_window: layers {too_wide} have windows wider than the allocator keeps "
            f"({allocator.sliding_window}); size the allocator for the widest window"
        )
    full_layers = {i: shapes[i] for i in layouts if i not in swa_layers}
    return HybridSWAPool(
        MHAPool(full_layers, allocator.full.num_ids, p, dtype, device, scales),
        MHAPool({i: shapes[i] for i in swa_layers}, allocator.swa.num_ids, p, dtype, device, scales),
        allocator.full_to_swa,
        allocator.full_to_swa_host,
        allocator.sliding_window,
    )
