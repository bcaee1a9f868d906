"""KV memory: the request->token table, slot allocators and the KV pools."""

from workers.memory.allocator import HybridSWAAllocator, KVAllocator, OutOfKVError, PageAllocator
from workers.memory.pools import HybridSWAPool, KVLayout, MHAPool, build_pool, kv_layouts
from workers.memory.req_to_token import ReqToTokenPool

__all__ = [
    "HybridSWAAllocator",
    "HybridSWAPool",
    "KVAllocator",
    "KVLayout",
    "MHAPool",
    "OutOfKVError",
    "PageAllocator",
    "ReqToTokenPool",
    "build_pool",
    "kv_layouts",
]
