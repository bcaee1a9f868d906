"""KV pools: where each layer's K and V live. Both implement `attention.KVPool`.

`MHAPool` keeps every layer in the full index space. `HybridSWAPool` pairs a full pool for
full-attention layers with a smaller SWA pool for sliding-window layers and translates through
the allocator's `full_to_swa` map (the same tensor object for the pool's whole life).
"""

from __future__ import annotations

import numpy as np
import torch

from workers.memory.allocator import HybridSWAAllocator, KVAllocator
from workers.memory.kv_write import kv_writer


class MHAPool:
    """Paged K/V buffers for a set of layers, all indexed by full-pool slots."""

    def __init__(
        self,
        layer_ids: list[int],
        num_pages: int,
        page_size: int,
        num_kv_heads: int,
        head_dim: int,
        dtype: torch.dtype,
        device: torch.device | str,
    ) -> None:
        self.page_size = page_size
        self.num_pages = num_pages  # page ids; buffers hold one more (padding page 0)
        self._index = {layer_id: i for i, layer_id in enumerate(layer_ids)}
        shape = (num_pages + 1, 2, num_kv_heads, page_size, head_dim)
        self.kv_buffers = [torch.zeros(shape, dtype=dtype, device=device) for _ in layer_ids]
        self._write = kv_writer(device)

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

    def set_kv(self, layer_id: int, locs: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> None:
        self._write(self.kv_cache(layer_id), locs, k, v)

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

    def set_kv(self, layer_id: int, locs: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> None:
        self._pool(layer_id).set_kv(layer_id, locs, k, v)

    def write_slots(self, layer_id: int, locs: torch.Tensor) -> torch.Tensor:
        return self._pool(layer_id).write_slots(layer_id, locs)


def build_pool(
    layer_windows: dict[int, int | None],
    allocator: KVAllocator,
    num_kv_heads: int,
    head_dim: int,
    dtype: torch.dtype,
    device: torch.device | str,
    use_swa_pool: bool = True,
) -> MHAPool | HybridSWAPool:
    """A pool for one model's layers on a (possibly shared) allocator.

    Sliding-window layers go to the SWA pool when the allocator keeps one and `use_swa_pool`;
    otherwise every layer is full (windows are then only a mask). `layer_windows` maps each KV
    layer id to its window (None for full attention).
    """
    p = allocator.page_size
    args = (p, num_kv_heads, head_dim, dtype, device)
    swa_layers = [i for i, w in layer_windows.items() if w is not None]
    if not (use_swa_pool and swa_layers and isinstance(allocator, HybridSWAAllocator)):
        return MHAPool(list(layer_windows), allocator.full.num_ids, *args)
    too_wide = {i: layer_windows[i] for i in swa_layers if layer_windows[i] > allocator.sliding_window}
    if too_wide:
        raise ValueError(
            f"sliding_window: layers {too_wide} have windows wider than the allocator keeps "
            f"({allocator.sliding_window}); size the allocator for the widest window"
        )
    full_layers = [i for i, w in layer_windows.items() if w is None]
    return HybridSWAPool(
        MHAPool(full_layers, allocator.full.num_ids, *args),
        MHAPool(swa_layers, allocator.swa.num_ids, *args),
        allocator.full_to_swa,
        allocator.full_to_swa_host,
        allocator.sliding_window,
    )
