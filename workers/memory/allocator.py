"""KV slot allocators.

`PageAllocator` is a free list of pages; with `page_size=1` it is the token-level allocator.
`KVAllocator` gives every token of a request a full-pool slot, page by page, and records it in
the request->token table. `HybridSWAAllocator` also gives each full page an SWA page and keeps
the page-aligned map `full_to_swa` (full slot -> SWA slot); when a request's tokens slide out
of the window it returns their SWA pages and points their entries at padding page 0.

One allocator serves a replica's target and draft models alike; what a model's layers read is
decided by each model's own pool (workers/memory/pools.py), never by the allocator's type.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import numpy as np
import torch

from workers.memory.host_mirror import HostMirrored
from workers.memory.req_to_token import ReqToTokenPool


class OutOfKVError(RuntimeError):
    """The pool has too few free pages; admission control should have prevented this."""


def cdiv(a: int, b: int) -> int:
    return -(-a // b)


class PageAllocator:
    """Pages 1..num_pages with reference counts; page 0 is padding and never handed out.
    `reserved` more pages (ids num_pages + 1 ..) are never handed out either: scratch pages
    that padded rows of a CUDA graph write to. Buffers hold `num_ids + 1` pages.

    A page is held by every request whose row points at it and by the prefix cache when it
    keeps it; it is free when the last holder lets go. `reclaim(n)`, when set, is asked to free
    pages (the prefix cache evicts) before an allocation fails."""

    def __init__(self, num_pages: int, page_size: int, name: str, reserved: int = 0) -> None:
        if num_pages < 1:
            raise ValueError(f"{name}: needs at least one page, got {num_pages}")
        self.num_pages = num_pages
        self.num_ids = num_pages + reserved
        self.page_size = page_size
        self.name = name
        self.reserved = list(range(num_pages + 1, self.num_ids + 1))
        self._free = list(range(num_pages, 0, -1))
        self._refs = np.zeros(self.num_ids + 1, dtype=np.int32)
        self.reclaim: Callable[[int], None] | None = None

    @property
    def num_free(self) -> int:
        return len(self._free)

    def alloc(self, n: int) -> list[int]:
        if n > len(self._free) and self.reclaim is not None:
            self.reclaim(n - len(self._free))
        if n > len(self._free):
            raise OutOfKVError(f"{self.name}: asked for {n} pages, {len(self._free)} of {self.num_pages} free")
        pages = [self._free.pop() for _ in range(n)]
        self._refs[pages] = 1
        return pages

    def ref(self, pages: list[int]) -> None:
        """One more holder of pages that are in use."""
        if not pages:
            return
        if not (self._refs[pages] > 0).all():
            raise RuntimeError(f"{self.name}: a holder added to a free page among {pages}")
        np.add.at(self._refs, pages, 1)

    def free(self, pages: list[int]) -> list[int]:
        """One holder fewer; returns the pages that became free."""
        if not pages:
            return []
        np.subtract.at(self._refs, pages, 1)
        if (self._refs[pages] < 0).any():
            np.add.at(self._refs, pages, 1)
            raise RuntimeError(f"{self.name}: double free or foreign page among {pages}")
        freed = [pg for pg in dict.fromkeys(pages) if self._refs[pg] == 0]
        self._free.extend(freed)
        return freed

    def holders(self, page: int) -> int:
        return int(self._refs[page])

    @property
    def refs(self) -> np.ndarray:
        """Holders of every page id, read-only (for counting many pages at once)."""
        view = self._refs.view()
        view.flags.writeable = False
        return view

    def check_no_leak(self) -> None:
        if self.num_free != self.num_pages:
            raise AssertionError(f"{self.name}: {self.num_pages - self.num_free} pages still in use")


def expand_ranges(starts: Sequence[int], ends: Sequence[int]) -> tuple[np.ndarray, np.ndarray]:
    """Ranges [starts[i], ends[i]) laid end to end: each element's range index and its value
    (int64). One element a range (a decode step) takes no expansion."""
    starts_a = np.asarray(starts, dtype=np.int64)
    if all(e - s == 1 for s, e in zip(starts, ends)):
        return np.arange(len(starts_a)), starts_a
    widths = np.asarray(ends, dtype=np.int64) - starts_a
    of = np.repeat(np.arange(len(starts_a)), widths)
    return of, np.arange(int(widths.sum())) - np.repeat(np.cumsum(widths) - widths, widths) + starts_a[of]


class KVAllocator:
    """Full-pool slots for every token of every request, allocated page by page.

    `scratch_pages` full pages (and as many SWA pages) are set aside for the padded rows of
    CUDA graphs: the request->token table's padding row holds their slots, so a padded row
    reads and writes KV only there, at slots every kernel contract allows."""

    def __init__(
        self, req_to_token: ReqToTokenPool, num_full_pages: int, page_size: int, scratch_pages: int = 0
    ) -> None:
        self.req_to_token = req_to_token
        self.page_size = page_size
        self.full = PageAllocator(num_full_pages, page_size, "full KV pool", reserved=scratch_pages)
        self._lens: dict[int, int] = {}  # row -> positions that have slots
        self.scratch_slots = (
            np.array(self.full.reserved, dtype=np.int64)[:, None] * page_size + np.arange(page_size)
        ).reshape(-1)
        req_to_token.write(req_to_token.padding_row, 0, self.scratch_slots[: req_to_token.max_context_len])

    @property
    def is_hybrid(self) -> bool:
        return False

    def allocated_len(self, row: int) -> int:
        return self._lens.get(row, 0)

    def extend(self, row: int, n: int) -> torch.Tensor:
        """Give the next `n` positions of request `row` full slots; returns them (int64, host)."""
        start = self._lens.get(row, 0)
        self.extend_rows([row], [start + n])
        return torch.from_numpy(self.req_to_token.host[row, start : start + n].astype(np.int64))

    def extend_rows(self, rows: Sequence[int], ends: Sequence[int]) -> None:
        """Give each request row full slots up to `ends[i]` positions (rows that long already
        are left alone): one page allocation and one table write for a whole batch, however
        many rows (a decode step's, a verify's). All or nothing: a batch that does not fit
        takes no page."""
        rows_a = np.asarray(rows, dtype=np.int64)
        held_list = [self._lens.get(r, 0) for r in rows]
        held = np.asarray(held_list, dtype=np.int64)
        p, limit = self.page_size, self.req_to_token.max_context_len
        if all(e == h + 1 and h % p and e <= limit for h, e in zip(held_list, ends)):  # decode inside each page
            self.req_to_token.write_many(rows_a, held, self.req_to_token.host[rows_a, held - 1] + 1)
            self._lens.update(zip(rows, ends))
            return
        ends_a = np.asarray(ends, dtype=np.int64)
        grow = ends_a > held
        if not grow.any():
            return
        rows_a, held, ends_a = rows_a[grow], held[grow], ends_a[grow]
        if (ends_a > limit).any():
            i = int(np.argmax(ends_a > limit))
            raise OutOfKVError(f"request row {rows_a[i]}: {ends_a[i]} positions exceed the context of {limit}")
        first_new = -(-held // p)  # each row's first page index that needs a new page
        counts = -(-ends_a // p) - first_new
        new_pages = self.full.alloc(int(counts.sum()))
        try:
            self._on_new_pages(new_pages)
        except OutOfKVError:
            self.full.free(new_pages)
            raise
        of, pos = expand_ranges(held, ends_a)
        page_idx = pos // p
        fresh = page_idx >= first_new[of]
        pages = np.empty(len(pos), dtype=np.int64)
        start_in_new = np.cumsum(counts) - counts  # each row's first page in `new_pages`
        pages[fresh] = np.asarray(new_pages, dtype=np.int64)[
            start_in_new[of[fresh]] + page_idx[fresh] - first_new[of[fresh]]
        ]
        partial = of[~fresh]  # positions in a row's last, partly filled page
        pages[~fresh] = self.req_to_token.host[rows_a[partial], held[partial] - 1] // p
        self.req_to_token.write_many(rows_a[of], pos, pages * p + pos % p)
        self._lens.update(zip(rows_a.tolist(), ends_a.tolist()))

    def flush(self, needed: bool = True) -> None:
        """Bring the device copies of the allocator's tables up to date before a forward that
        reads them (`needed`); before one that does not, only when many changes are pending."""
        self.req_to_token.flush(needed)

    def can_extend(self, ends: dict[int, int]) -> bool:
        """Whether every row could hold slots up to its end (positions) with the pages free now
        (slots borrowed for a moment: a speculative round launched ahead gives them back)."""
        p = self.page_size
        need = sum(max(0, cdiv(end, p) - cdiv(self._lens.get(row, 0), p)) for row, end in ends.items())
        return need <= self._free_pages()

    def _free_pages(self) -> int:
        return self.full.num_free

    def swa_start(self, row: int) -> int:
        """The first page of a request whose SWA page the request still holds (no SWA: all)."""
        return 0

    def row_pages(self, row: int, num_pages: int) -> list[int]:
        """The full pages of a request's first `num_pages` pages."""
        return self._row_full_pages(row, 0, num_pages)

    def share_prefix(self, row: int, pages: list[int]) -> None:
        """Start an empty request row on cached pages: its first len(pages) pages are these
        (each gains the row as a holder); allocation goes on after them."""
        if self._lens.get(row, 0):
            raise RuntimeError(f"request row {row}: a prefix can only start an empty row")
        p = self.page_size
        self.full.ref(pages)
        slots = (np.asarray(pages, dtype=np.int64)[:, None] * p + np.arange(p)).reshape(-1)
        self.req_to_token.write(row, 0, slots)
        self._lens[row] = len(pages) * p

    def release_window(self, row: int, seq_len: int) -> None:
        """Called after every forward with the request's committed length; SWA eviction."""

    def release_windows(self, rows: Sequence[int], seq_lens: Sequence[int]) -> None:
        """`release_window` for a batch's requests."""

    def truncate(self, row: int, keep_len: int) -> None:
        """Give back the slots of positions >= keep_len (e.g. rejected draft tokens)."""
        start = self._lens.get(row, 0)
        if keep_len > start:
            raise RuntimeError(f"request row {row}: truncate to {keep_len} beyond {start} allocated positions")
        p = self.page_size
        pages = self._row_full_pages(row, cdiv(keep_len, p), cdiv(start, p))
        self._on_free_pages(row, cdiv(keep_len, p), pages)
        self.full.free(pages)
        self._lens[row] = keep_len

    def free(self, row: int) -> None:
        """Give back every slot of a finished or aborted request."""
        if row in self._lens:
            self.truncate(row, 0)
            del self._lens[row]

    def stats(self) -> dict[str, int]:
        p = self.page_size
        return {
            "full_free": self.full.num_free * p,
            "full_total": self.full.num_pages * p,
            "swa_free": 0,
            "swa_total": 0,
        }

    def check_no_leak(self) -> None:
        if self._lens:
            raise AssertionError(f"KV allocator: requests rows {sorted(self._lens)} still hold slots")
        self.full.check_no_leak()

    def _row_full_pages(self, row: int, first: int, last: int) -> list[int]:
        """Full pages of page indices [first, last) of a request."""
        if last <= first:
            return []
        return (
            self.req_to_token.host[row, first * self.page_size : last * self.page_size : self.page_size]
            // self.page_size
        ).tolist()

    def _on_new_pages(self, full_pages: list[int]) -> None:
        """Hook: full pages were just allocated."""

    def _on_free_pages(self, row: int, first_page_idx: int, full_pages: list[int]) -> None:
        """Hook: full pages of page indices starting at `first_page_idx` are about to be freed."""


class HybridSWAAllocator(KVAllocator):
    """Full slots for all tokens plus SWA slots for the tokens still inside the window."""

    def __init__(
        self,
        req_to_token: ReqToTokenPool,
        num_full_pages: int,
        num_swa_pages: int,
        page_size: int,
        sliding_window: int,
        scratch_pages: int = 0,
    ) -> None:
        super().__init__(req_to_token, num_full_pages, page_size, scratch_pages)
        self.swa = PageAllocator(num_swa_pages, page_size, "SWA KV pool", reserved=scratch_pages)
        self.sliding_window = sliding_window
        self._page_offsets = np.arange(page_size, dtype=np.int64)
        # full slot -> SWA slot; page-aligned, so full_to_swa[f] // P is an SWA page. Entries of
        # unmapped or evicted pages point into padding page 0. The device copy is updated in
        # place, never replaced: pools hold a reference to this very tensor.
        identity = np.tile(self._page_offsets, self.full.num_ids + 1)
        identity.reshape(-1, page_size)[self.full.reserved] = (
            np.array(self.swa.reserved)[:, None] * page_size + self._page_offsets
        )  # scratch full pages -> scratch SWA pages, for good
        self._expected_idle = identity.copy()
        self._f2s = HostMirrored(identity, req_to_token.table.device)
        self.full_to_swa = self._f2s.tensor
        self.full_to_swa_host = self._f2s.host
        self._evicted: dict[int, int] = {}  # row -> leading page indices whose SWA page is gone

    @property
    def is_hybrid(self) -> bool:
        return True

    def flush(self, needed: bool = True) -> None:
        super().flush(needed)
        self._f2s.flush(needed)

    def _free_pages(self) -> int:
        return min(self.full.num_free, self.swa.num_free)

    def release_window(self, row: int, seq_len: int) -> None:
        """Let go of SWA pages whose positions no future query can see: those before the window
        of a query at the last page boundary (so that the window before that boundary stays
        whole, for the prefix cache to keep)."""
        first = self._evicted.get(row, 0)
        upto = self._window_start_page(seq_len)
        if upto <= first:
            return
        self._unmap(self._row_full_pages(row, first, upto))
        self._evicted[row] = upto

    def release_windows(self, rows: Sequence[int], seq_lens: Sequence[int]) -> None:
        """`release_window` for the rows whose window reached a page it has not let go of (a
        decode step's window moves on a page once in `page_size` steps): one comparison a row,
        a call for each of those few."""
        evicted = self._evicted
        for row, seq_len in zip(rows, seq_lens):
            if self._window_start_page(seq_len) > evicted.get(row, 0):
                self.release_window(row, seq_len)

    def _window_start_page(self, seq_len: int) -> int:
        """The first page the window of a query at the last page boundary of `seq_len` sees."""
        p = self.page_size
        return max(0, seq_len // p * p - self.sliding_window + 1) // p

    def free(self, row: int) -> None:
        super().free(row)
        self._evicted.pop(row, None)

    def stats(self) -> dict[str, int]:
        p = self.page_size
        return {**super().stats(), "swa_free": self.swa.num_free * p, "swa_total": self.swa.num_pages * p}

    def check_no_leak(self) -> None:
        super().check_no_leak()
        self.swa.check_no_leak()
        if not np.array_equal(self._f2s.host, self._expected_idle):
            raise AssertionError("SWA allocator: full_to_swa still maps some full page to an SWA page")

    def _on_new_pages(self, full_pages: list[int]) -> None:
        swa_pages = self.swa.alloc(len(full_pages))
        if not full_pages:
            return
        self._set_pages(np.array(full_pages), np.array(swa_pages)[:, None] * self.page_size + self._page_offsets)

    def _on_free_pages(self, row: int, first_page_idx: int, full_pages: list[int]) -> None:
        skip = max(0, self._evicted.get(row, 0) - first_page_idx)
        self._unmap(full_pages[skip:])
        self._evicted[row] = min(self._evicted.get(row, 0), first_page_idx)

    def _unmap(self, full_pages: list[int]) -> None:
        """One holder fewer of these full pages' SWA pages; an SWA page nobody holds is freed
        and its full page maps to padding again (a tombstone where the full page lives on)."""
        if not full_pages:
            return
        fp = np.array(full_pages)
        view = self._f2s.host.reshape(-1, self.page_size)
        swa_pages = (view[fp, 0] // self.page_size).tolist()
        if 0 in swa_pages:
            raise RuntimeError(f"SWA allocator: releasing unmapped SWA pages of full pages {full_pages}")
        freed = set(self.swa.free(swa_pages))
        gone = fp[[pg in freed for pg in swa_pages]]
        if len(gone):
            self._set_pages(gone, self._page_offsets)

    # -- the prefix cache's holds ------------------------------------------------------------------
    def share_prefix(self, row: int, pages: list[int], swa_from: int = 0) -> None:
        """As `KVAllocator.share_prefix`; the row also holds the SWA pages of pages[swa_from:]
        (the window before the row's first new token), which must be mapped."""
        super().share_prefix(row, pages)
        self.hold_swa(pages[swa_from:])
        self._evicted[row] = swa_from

    def swa_page_of(self, full_page: int) -> int:
        """The SWA page a full page maps to (0: none), read on the host."""
        return int(self._f2s.host[full_page * self.page_size]) // self.page_size

    def swa_pages_of(self, full_pages: np.ndarray) -> np.ndarray:
        """`swa_page_of` for many full pages at once."""
        return np.asarray(self._f2s.host[full_pages * self.page_size]) // self.page_size

    def swa_start(self, row: int) -> int:
        """The first page of a request whose SWA page the request still holds."""
        return self._evicted.get(row, 0)

    def hold_swa(self, full_pages: list[int]) -> None:
        """One more holder of these full pages' (mapped) SWA pages."""
        if not full_pages:
            return
        view = self._f2s.host.reshape(-1, self.page_size)
        swa_pages = (view[np.array(full_pages), 0] // self.page_size).tolist()
        if 0 in swa_pages:
            raise RuntimeError(f"SWA allocator: holding unmapped SWA pages of full pages {full_pages}")
        self.swa.ref(swa_pages)

    def release_swa(self, full_pages: list[int]) -> None:
        self._unmap(full_pages)

    def _set_pages(self, full_pages: np.ndarray, slots: np.ndarray) -> None:
        """Map full pages to SWA slots (rows of `slots`), on the host; marked for the device."""
        p = self.page_size
        self._f2s.host.reshape(-1, p)[full_pages] = slots
        self._f2s.mark((full_pages[:, None] * p + self._page_offsets).reshape(-1))
