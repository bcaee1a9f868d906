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
"""

from __future__ import annotations

from typing import Protocol, runtime_checkable

import numpy as np
import torch


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

    def set_kv(self, layer_id: int, locs: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> None:
        """Write `k`, `v` (`[n, num_kv_heads, head_dim]`) at `locs`, given in the layer's own
        index space."""

    def write_slots(self, layer_id: int, locs: torch.Tensor) -> torch.Tensor:
        """The slots of `kv_cache(layer_id)` that `set_kv(layer_id, locs, ...)` writes: for a
        caller that writes K and V itself (the fused RoPE kernel)."""
