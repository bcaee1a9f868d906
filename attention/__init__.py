"""Attention: the bottom layer. Forward modes, the batch view and KV-pool protocol a backend
consumes, the backend interface and the backends themselves. Imports nothing above it."""

from attention.base import AttentionBackend, AttentionLayer, KVDestination, create_backend, register_backend
from attention.batch import AttentionBatch
from attention.forward_mode import ForwardMode
from attention.kv_pool import KVPool

__all__ = [
    "AttentionBackend",
    "AttentionBatch",
    "AttentionLayer",
    "ForwardMode",
    "KVDestination",
    "KVPool",
    "create_backend",
    "register_backend",
]
