"""The arguments of the two TensorRT-LLM attention kernels, and their contracts.

A `DecodeCall` / `ContextCall` holds exactly the tensors flashinfer's
`trtllm_batch_decode_with_kv_cache` (XQA / trtllm-gen) and `trtllm_fmha_v2_prefill` /
`trtllm_batch_context_with_kv_cache` receive. The CPU reference kernels take the same objects,
so agreeing with `torch_native` proves these tensors right. `check()` verifies every
precondition a real kernel would fault on (or silently read garbage under) and raises
`KernelContractError` naming the forward mode, layer and tensor.

The cache's dtype is part of the contract: the query's, or FP8 (e4m3) read with a K and a V scale
(a stored value times its scale is the value; flashinfer takes them folded into `bmm1_scale` and
as `bmm2_scale`, docs/design.md §4.7).

Positions follow the kernels' convention: request b's KV holds positions [0, seq_lens[b]) and
its q_len queries are the last q_len of them (bottom-right aligned causal mask).
"""

from __future__ import annotations

import dataclasses
import functools
import math
from typing import NamedTuple

import torch

from attention.kv_pool import FP8_E4M3


class KernelContractError(RuntimeError):
    """A kernel was about to be called with arguments it would fault on."""


def cdiv(a: int, b: int) -> int:
    return -(-a // b)


def chain_mask(batch_size: int, q_len: int, device: torch.device) -> torch.Tensor:
    """XQA's bit-packed draft-block mask for linear chains: row i has bits 0..i set; each row is
    32-bit words stored as two uint16 (low half first): `[B, q_len, 2 * ceil(q_len / 32)]`."""
    return _chain_rows(q_len, torch.device(device)).expand(batch_size, -1, -1).contiguous()


@functools.cache
def _chain_rows(q_len: int, device: torch.device) -> torch.Tensor:
    """One request's mask rows, built and uploaded once per query length and device (an upload
    per verify step would make the host wait for the device)."""
    words = cdiv(q_len, 32)
    mask = torch.zeros(q_len, words * 2, dtype=torch.int32)
    for i in range(q_len):
        bits = (1 << (i + 1)) - 1  # bits 0..i
        for w in range(words):
            word = (bits >> (32 * w)) & 0xFFFFFFFF
            mask[i, 2 * w] = word & 0xFFFF
            mask[i, 2 * w + 1] = word >> 16
    return mask.to(torch.uint16).to(device)


def unpack_mask(mask: torch.Tensor, q_len: int) -> torch.Tensor:
    """Inverse of the packing: `[B, q_len, q_len]` bool, entry (i, j) = row i sees draft j."""
    halves = mask.to(torch.int64)
    words = halves[..., 0::2] | (halves[..., 1::2] << 16)
    j = torch.arange(q_len, device=mask.device)
    return ((words[..., j // 32] >> (j % 32)) & 1).bool()


def check_write(locs: torch.Tensor, kv_cache: torch.Tensor, where: str) -> None:
    """KV write slots must lie in the pool the layer writes, outside padding page 0."""
    num_slots, page = kv_cache.shape[0] * kv_cache.shape[3], kv_cache.shape[3]
    bad = (locs < page) | (locs >= num_slots)
    if bool(bad.any()):
        raise KernelContractError(
            f"{where}: write slots: {locs[bad][:4].tolist()} outside slots [{page}, {num_slots}) of the pool written"
        )


class Rotary(NamedTuple):
    """What a decode kernel that rotates its own query applies to the raw projections: RoPE at
    `positions` (`[T]`) from `cos_sin` (float32 `[max_positions, rotary_dim]`, cos then sin),
    after `norms` (q weight, k weight or None, eps, gemma: the per-head RMSNorms of qk-norm
    models) when given; `v_norm_eps`: each new value head RMS-normalised (no weight) first."""

    positions: torch.Tensor
    cos_sin: torch.Tensor
    norms: tuple[torch.Tensor, torch.Tensor | None, float, bool] | None = None
    v_norm_eps: float | None = None


class NewKV(NamedTuple):
    """A decode step's new key (raw: `Rotary` applies) and value heads, `[T, Hkv, D]` views of
    the projection's output, and the cache slots they go to."""

    key: torch.Tensor
    value: torch.Tensor
    slots: torch.Tensor


@dataclasses.dataclass
class _Common:
    query: torch.Tensor  # [T, H, D]
    kv_cache: torch.Tensor  # [num_pages, 2, Hkv, page_size, D]
    block_tables: torch.Tensor  # [B, max_pages] int32, page ids in kv_cache
    seq_lens: torch.Tensor  # [B] int32, KV length including this forward's tokens
    bmm1_scale: float
    window_left: int  # keys left of the query that stay visible; -1 = no window
    sinks: torch.Tensor | None  # [H] float32
    where: str  # "<FORWARD_MODE> layer <id> (<pool space>)", for error messages
    k_scale: float = 1.0  # an FP8 cache's scales (stored x scale = value); 1.0 for any other cache
    v_scale: float = 1.0

    @property
    def batch_size(self) -> int:
        return self.seq_lens.shape[0]

    @property
    def page_size(self) -> int:
        return self.kv_cache.shape[3]

    def fail(self, tensor: str, message: str) -> KernelContractError:
        return KernelContractError(f"{self.where}: {tensor}: {message}")

    def _check_common(self, q_lens: list[int]) -> None:
        if self.block_tables.dtype != torch.int32 or self.seq_lens.dtype != torch.int32:
            raise self.fail(
                "block_tables/seq_lens", f"must be int32, got {self.block_tables.dtype}/{self.seq_lens.dtype}"
            )
        if self.kv_cache.dim() != 5 or self.kv_cache.shape[1] != 2:
            raise self.fail("kv_cache", f"must be [pages, 2, kv_heads, page, dim], got {tuple(self.kv_cache.shape)}")
        self._check_dtype()
        if (
            self.query.dim() != 3
            or self.query.shape[1] % self.kv_cache.shape[2]
            or self.query.shape[2] != self.kv_cache.shape[4]
        ):
            raise self.fail(
                "query", f"shape {tuple(self.query.shape)} does not fit kv_cache {tuple(self.kv_cache.shape)}"
            )
        if self.block_tables.shape[0] != self.batch_size:
            raise self.fail("block_tables", f"{self.block_tables.shape[0]} rows for a batch of {self.batch_size}")
        if self.window_left < -1:
            raise self.fail("window_left", f"must be >= -1, got {self.window_left}")
        if self.sinks is not None and self.sinks.shape != (self.query.shape[1],):
            raise self.fail("sinks", f"shape {tuple(self.sinks.shape)} != [{self.query.shape[1]}]")
        self._check_pages(q_lens)

    def _check_pages(self, q_lens: list[int]) -> None:
        """Every request's KV covers its queries, and the pages it reads are the pool's and, inside
        its window, assigned (checked for the whole batch at once; the first request at fault is
        named)."""
        num_pages, p, columns = self.kv_cache.shape[0], self.page_size, self.block_tables.shape[1]
        kv_lens = self.seq_lens.long()
        q = torch.tensor(q_lens, dtype=torch.long, device=kv_lens.device)
        if bool((short := kv_lens < q).any()):
            b = int(short.nonzero()[0])
            raise self.fail(
                "seq_lens",
                f"request {b} has {int(kv_lens[b])} KV tokens for {q_lens[b]} queries; "
                "KV lengths must include the new tokens",
            )
        used = (kv_lens + p - 1) // p
        if bool((wide := used > columns).any()):
            b = int(wide.nonzero()[0])
            raise self.fail("block_tables", f"request {b} needs {int(used[b])} pages, table has {columns} columns")
        column = torch.arange(columns, device=kv_lens.device)
        pages = self.block_tables
        read = column < used[:, None]
        outside = read & ((pages < 0) | (pages >= num_pages))
        if bool(outside.any()):
            b = int(outside.any(1).nonzero()[0])
            raise self.fail(
                "block_tables",
                f"request {b} names pages {pages[b][outside[b]][:4].tolist()} outside the pool's {num_pages} pages",
            )
        first_visible = (
            (kv_lens - q - self.window_left).clamp(min=0) if self.window_left >= 0 else torch.zeros_like(kv_lens)
        )
        padding = read & (column >= (first_visible // p)[:, None]) & (pages == 0)
        if bool(padding.any()):
            b = int(padding.any(1).nonzero()[0])
            raise self.fail(
                "block_tables",
                f"request {b} would read padding page 0 inside its window (an evicted or unassigned page)",
            )

    def _check_dtype(self) -> None:
        """The cache holds the query's dtype, or FP8 with positive finite scales; scales other
        than 1.0 on any other cache would be applied to values that were never quantised."""
        cache, scales = self.kv_cache.dtype, (self.k_scale, self.v_scale)
        if cache not in (self.query.dtype, FP8_E4M3):
            raise self.fail("kv_cache", f"dtype {cache} is neither the query's ({self.query.dtype}) nor {FP8_E4M3}")
        if cache == FP8_E4M3 and not all(math.isfinite(s) and s > 0 for s in scales):
            raise self.fail("k_scale/v_scale", f"an FP8 cache needs positive finite scales, got {scales}")
        if cache != FP8_E4M3 and scales != (1.0, 1.0):
            raise self.fail("k_scale/v_scale", f"scales apply to an FP8 cache only, got {scales} for a {cache} cache")


@dataclasses.dataclass
class DecodeCall(_Common):
    """`trtllm_batch_decode_with_kv_cache`: uniform `q_len_per_req` queries per request."""

    max_seq_len: int = 0
    q_len_per_req: int = 1
    mask: torch.Tensor | None = None  # chain mask when q_len_per_req > 1

    def check(self) -> None:
        q = self.q_len_per_req
        if self.query.shape[0] != self.batch_size * q:
            raise self.fail("query", f"{self.query.shape[0]} rows != batch {self.batch_size} x q_len_per_req {q}")
        self._check_common([q] * self.batch_size)
        if self.batch_size and self.max_seq_len < int(self.seq_lens.max()):
            raise self.fail("max_seq_len", f"{self.max_seq_len} < longest KV {int(self.seq_lens.max())}")
        if q > 1:
            shape = (self.batch_size, q, 2 * cdiv(q, 32))
            if self.mask is None or self.mask.dtype != torch.uint16 or tuple(self.mask.shape) != shape:
                got = None if self.mask is None else (self.mask.dtype, tuple(self.mask.shape))
                raise self.fail(
                    "mask", f"verify with q_len_per_req {q} needs a uint16 mask of shape {shape}, got {got}"
                )


@dataclasses.dataclass
class ContextCall(_Common):
    """`trtllm_fmha_v2_prefill` (Q_PAGED_KV_HND) / `trtllm_batch_context_with_kv_cache`:
    ragged queries over paged KV with a cached prefix."""

    cum_seq_lens_q: torch.Tensor | None = None  # [B+1] int32
    cum_seq_lens_kv: torch.Tensor | None = None  # [B+1] int32
    max_q_len: int = 0
    max_kv_len: int = 0
    logits_soft_cap: float | None = None

    @property
    def q_lens(self) -> list[int]:
        return self.cum_seq_lens_q.diff().tolist()

    def check(self) -> None:
        b = self.batch_size
        for name in ("cum_seq_lens_q", "cum_seq_lens_kv"):
            t = getattr(self, name)
            if (
                t is None
                or t.dtype != torch.int32
                or t.shape != (b + 1,)
                or int(t[0]) != 0
                or bool((t.diff() < 0).any())
            ):
                raise self.fail(
                    name, f"must be a non-decreasing int32 [batch+1] from 0, got {None if t is None else t.tolist()}"
                )
        if int(self.cum_seq_lens_q[-1]) != self.query.shape[0]:
            raise self.fail(
                "cum_seq_lens_q", f"ends at {int(self.cum_seq_lens_q[-1])} but query has {self.query.shape[0]} rows"
            )
        if not torch.equal(self.cum_seq_lens_kv.diff(), self.seq_lens):
            raise self.fail("cum_seq_lens_kv", "differences do not equal seq_lens")
        q_lens = self.q_lens
        self._check_common(q_lens)
        if b and (self.max_q_len < max(q_lens) or self.max_kv_len < int(self.seq_lens.max())):
            raise self.fail(
                "max_q_len/max_kv_len",
                f"{self.max_q_len}/{self.max_kv_len} below the batch's {max(q_lens)}/{int(self.seq_lens.max())}",
            )
