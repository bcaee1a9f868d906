"""KV memory: the request->token table, slot allocators and the KV pools."""

from workers.memory.allocator import HybridSWAAllocator, KVAllocator, OutOfKVError, PageAllocator
from workers.memory.pools import HybridSWAPool, MHAPool, build_pool
from workers.memory.req_to_token import ReqToTokenPool

__all__ = [
    "HybridSWAAllocator",
    "HybridSWAPool",
    "KVAllocator",
    "MHAPool",
    "OutOfKVError",
    "PageAllocator",
    "ReqToTokenPool",
    "build_pool",
]
