"""Prefix caching over hybrid SWA pools: a radix tree of cached token pages.

Each node is one full page of a token sequence: its P token ids (the edge from its parent), the
full-pool page that holds their KV, and whether the tree still holds that page's SWA-pool page
(the sliding-window layers' KV). The tree is a holder of its pages like a request is
(`PageAllocator` reference counts), so a request that ends or releases its window never frees a
page the tree keeps, and a page is free only when its last holder lets go.

- Prompts enter the tree as their prefill completes (page by page, after every prefill chunk),
  and a finishing request's whole sequence enters it too (multi-turn continuations hit).
- A node's SWA page can be evicted on its own (LRU), leaving its full page: a tombstone for the
  sliding-window layers. Unreferenced leaves are evicted (LRU) when a pool runs short, before a
  request is made to wait.
- A match ends at a page boundary m only where the SWA KV of the window before m is held;
  otherwise it is cut back to the last such boundary, and the rest is recomputed. The last prompt
  token is always computed (its logits and hidden state are needed). For drafts whose entry at
  position p reads token p + 1 (EAGLE), a page's last draft entry read the token after the page:
  a node remembers it (`follow`) and is used only by prompts that continue with that token.
- Requests using a matched prefix lock its nodes; locked nodes are never evicted.

Every rank of a tensor-parallel group runs the same deterministic tree on the same inputs.
"""

from __future__ import annotations

import dataclasses
import functools
import heapq
import itertools
from collections.abc import Callable, Sequence

import numpy as np

from workers.memory import HybridSWAAllocator, KVAllocator, PageAllocator

RECLAIM_BATCH = 1 / 64  # of a pool's pages, given back at once when it runs short


def _batch(pool: PageAllocator) -> int:
    return max(1, int(pool.num_pages * RECLAIM_BATCH))


@dataclasses.dataclass(eq=False)
class Node:
    key: tuple[int, ...]  # the page's token ids
    page: int  # full-pool page holding their KV
    parent: Node | None
    swa: bool = False  # the tree holds the page's SWA page
    follow: int | None = None  # the token after the page, when its draft KV read it
    last_used: int = 0
    children: dict[tuple[int, ...], Node] = dataclasses.field(default_factory=dict)


@dataclasses.dataclass
class Match:
    nodes: list[Node]  # the matched pages, root first

    @property
    def pages(self) -> list[int]:
        return [n.page for n in self.nodes]


class RadixCache:
    def __init__(self, allocator: KVAllocator, draft_shift: int = 0) -> None:
        """`draft_shift`: 1 when a draft's entry at position p reads token p + 1 (EAGLE)."""
        self.allocator = allocator
        self.page_size = allocator.page_size
        self.draft_shift = draft_shift
        self.window = allocator.sliding_window if isinstance(allocator, HybridSWAAllocator) else None
        self.root = Node((), 0, None)
        self._clock = itertools.count(1)
        self.num_pages = 0  # full pages the tree holds
        self._leaves: dict[Node, None] = {}  # nodes without children (what full eviction drops)
        self._swa: dict[Node, None] = {}  # nodes holding their SWA page (what SWA eviction releases)
        # Least recently used first, kept across evictions: an entry (last_used, id, node) is
        # current while the node still has that last_used and is still a leaf / SWA holder.
        self._leaf_heap: list[tuple[int, int, Node]] = []
        self._swa_heap: list[tuple[int, int, Node]] = []
        # Per full page, for reads from other threads (`usage`) without walking the tree:
        ids = allocator.full.num_ids + 1
        self._is_node = np.zeros(ids, dtype=bool)  # a node's page
        self._holds_swa = np.zeros(ids, dtype=bool)  # a node's page whose SWA page the tree holds
        self._locks = np.zeros(ids, dtype=np.int32)  # running requests whose prefix the page is
        allocator.full.reclaim = functools.partial(self._reclaim_full, _batch(allocator.full))
        if self.window is not None:
            allocator.swa.reclaim = functools.partial(self._reclaim, self.evict_swa, _batch(allocator.swa))

    # -- lookup ---------------------------------------------------------------------------------
    def match(self, tokens: Sequence[int]) -> Match:
        """The longest usable cached prefix of a prompt (page aligned, see the module doc)."""
        p = self.page_size
        nodes, node = [], self.root
        for i in range(len(tokens) // p):
            child = node.children.get(tuple(tokens[i * p : (i + 1) * p]))
            if child is None:
                break
            nodes.append(child)
            node = child
        usable = min(len(nodes), (len(tokens) - 1) // p)
        if self.draft_shift:
            usable = next((i for i in range(usable) if nodes[i].follow != tokens[(i + 1) * p]), usable)
        while usable > 0 and not self._window_held(nodes, usable):
            usable -= 1
        match = Match(nodes[: max(0, usable)])
        now = next(self._clock)
        for n in match.nodes:
            self._touch(n, now)
        return match

    def swa_from(self, num_pages: int) -> int:
        """The first page, of a prefix of `num_pages` pages, inside the window of the next query."""
        if self.window is None:
            return num_pages
        return max(0, num_pages * self.page_size - self.window + 1) // self.page_size

    def _window_held(self, nodes: list[Node], num_pages: int) -> bool:
        return self.window is None or all(n.swa for n in nodes[self.swa_from(num_pages) : num_pages])

    # -- holding ----------------------------------------------------------------------------------
    def lock(self, match: Match) -> None:
        self._locks[match.pages] += 1  # a match's pages are distinct

    def unlock(self, match: Match) -> None:
        self._locks[match.pages] -= 1

    def insert(self, tokens: Sequence[int], pages: Sequence[int], swa_from: int) -> None:
        """Cache the complete pages of a sequence whose KV lies in `pages` (page i holds tokens
        [iP, (i+1)P)); the sequence's owner still holds the SWA pages of pages[swa_from:].
        `tokens` runs one token past the pages where the sequence has it (a shifted draft's
        last entry of a page read it)."""
        p, node, now = self.page_size, self.root, next(self._clock)
        for i, page in enumerate(pages):
            key = tuple(tokens[i * p : (i + 1) * p])
            follow = tokens[(i + 1) * p] if self.draft_shift and (i + 1) * p < len(tokens) else None
            child = node.children.get(key)
            if child is not None and child.follow != follow:
                break  # its draft KV read another next token: nothing past it is usable here
            if child is None:
                child = Node(key, page, node, follow=follow)
                node.children[key] = child
                self._leaves.pop(node, None)
                self._leaves[child] = None
                self.allocator.full.ref([page])
                self._is_node[page] = True
                self.num_pages += 1
            if not child.swa and child.page == page and i >= swa_from and self.window is not None:
                self.allocator.hold_swa([page])
                child.swa = True
                self._swa[child] = None
                self._holds_swa[page] = True
            self._touch(child, now)
            node = child

    # -- eviction ---------------------------------------------------------------------------------
    def evict_swa(self, pages: int) -> int:
        """Give back the tree's SWA pages, least recently used first, until `pages` of them are
        free; their nodes keep their full pages. Returns the pages freed."""
        freed, alloc, released = 0, self.allocator, []
        while freed < pages and self._swa_heap:
            last_used, _, node = heapq.heappop(self._swa_heap)
            if node.last_used != last_used or node not in self._swa:
                continue  # touched since, or released or dropped already
            # a locked node too: requests reading its window hold their own SWA pages
            freed += alloc.swa.holders(alloc.swa_page_of(node.page)) == 1
            node.swa = False
            del self._swa[node]
            self._holds_swa[node.page] = False
            released.append(node.page)
        if released:
            alloc.release_swa(released)
        return freed

    def evict_full(self, pages: int, needed: int | None = None) -> int:
        """Drop unlocked leaves, least recently used first, until `pages` full pages are free; a
        parent whose last child went is a leaf in the same pass. Leaves whose page a running
        request still holds free nothing and are kept, unless the others free fewer than
        `needed` (default `pages`): a request's pages inserted under another's cached prefix make
        that prefix's pages (held by the tree alone, which admission counts as free for the
        asking) internal nodes, reachable only through such leaves, which then go where they
        lead to such a page. The leaves' heap is kept as the tree changes, so a pool running
        short costs O(pages log leaves) plus the leaves it skips. Returns the pages freed."""
        freed = self._evict_leaves(pages, shared=False)
        needed = pages if needed is None else needed
        if freed < needed:
            freed += self._evict_leaves(needed - freed, shared=True)
        return freed

    def _evict_leaves(self, pages: int, shared: bool) -> int:
        """One LRU pass over the leaves; `shared`: also drop leaves a running request holds that
        sit above a page only the tree holds."""
        dropped, kept, freed = [], [], 0
        holders = self.allocator.full.holders
        while freed < pages and self._leaf_heap:
            entry = heapq.heappop(self._leaf_heap)
            node = entry[2]
            if node.last_used != entry[0] or node not in self._leaves:
                continue  # touched since, or no longer a leaf
            alone = holders(node.page) == 1
            if self._locks[node.page] or not (alone or (shared and self._above_tree_page(node))):
                kept.append(entry)  # locked or shared now; a candidate again later
                continue
            freed += alone
            self._unlink(node)
            dropped.append(node)
        for entry in kept:
            heapq.heappush(self._leaf_heap, entry)
        self._release(dropped)
        return freed

    def _above_tree_page(self, node: Node) -> bool:
        """Whether an ancestor's page is held by the tree alone (and unlocked)."""
        holders, parent = self.allocator.full.holders, node.parent
        while parent is not self.root:
            if holders(parent.page) == 1 and not self._locks[parent.page]:
                return True
            parent = parent.parent
        return False

    def _touch(self, node: Node, now: int) -> None:
        """Mark a node used at `now` and queue it for eviction in that order."""
        node.last_used = now
        if node.swa:
            self._push(self._swa_heap, node, self._swa)
        if node in self._leaves:
            self._push(self._leaf_heap, node, self._leaves)

    @staticmethod
    def _push(heap: list[tuple[int, int, Node]], node: Node, index: dict[Node, None]) -> None:
        """Queue a node; a heap grown to twice its index (entries gone stale) is rebuilt."""
        heapq.heappush(heap, (node.last_used, id(node), node))
        if len(heap) > 2 * len(index) + 64:
            heap[:] = [(n.last_used, id(n), n) for n in index]
            heapq.heapify(heap)

    def _reclaim(self, evict: Callable[[int], int], batch: int, pages: int) -> int:
        """A pool ran short by `pages`: evict at least `batch` (a fraction of the pool) at once,
        so that a busy pool is not short again at the next page."""
        return evict(max(pages, batch))

    def _reclaim_full(self, batch: int, pages: int) -> int:
        """As `_reclaim`; running requests' leaves go only for the shortfall itself."""
        return self.evict_full(max(pages, batch), needed=pages)

    def flush(self) -> None:
        """Drop every node no running request uses (all of them when the engine is idle)."""
        while True:
            leaves = [n for n in self._leaves if self._locks[n.page] == 0]
            if not leaves:
                return
            for leaf in leaves:
                self._unlink(leaf)
            self._release(leaves)

    def _unlink(self, node: Node) -> None:
        """Take a leaf out of the tree; its pages are released by `_release`, in one call per
        pool for all the nodes an eviction drops."""
        if node.swa:
            del self._swa[node]
        self._is_node[node.page] = self._holds_swa[node.page] = False
        parent = node.parent
        del parent.children[node.key]
        del self._leaves[node]
        if parent is not self.root and not parent.children:
            self._leaves[parent] = None
            self._push(self._leaf_heap, parent, self._leaves)
        self.num_pages -= 1

    def _release(self, nodes: list[Node]) -> None:
        swa = [n.page for n in nodes if n.swa]
        if swa:
            self.allocator.release_swa(swa)
        for n in nodes:
            n.swa = False
        if nodes:
            self.allocator.full.free([n.page for n in nodes])

    def _nodes(self) -> list[Node]:
        out, stack = [], list(self.root.children.values())
        while stack:
            node = stack.pop()
            out.append(node)
            stack.extend(node.children.values())
        return out

    def num_swa_pages(self) -> int:
        return len(self._swa)

    def usage(self) -> tuple[int, int, int, int]:
        """(full pages, SWA pages) the tree holds, then those only the tree holds (free for the
        asking). Array reads only: rank 0 answers load queries from another thread while the
        loop thread changes the tree (a snapshot a step old at worst, never an error)."""
        alloc, nodes = self.allocator, self._is_node.copy()
        full = (int(nodes.sum()), int((nodes & (self._locks == 0) & (alloc.full.refs == 1)).sum()))
        if self.window is None:
            return full[0], 0, full[1], 0
        swa = np.flatnonzero(self._holds_swa)
        return full[0], len(swa), full[1], int((alloc.swa.refs[alloc.swa_pages_of(swa)] == 1).sum())

    def check_sole_holder(self) -> None:
        """With no request running: every page in use is a node's, held by the tree alone (and the
        indexes eviction reads agree with the tree)."""
        alloc, nodes = self.allocator, self._nodes()
        if self._locks.any():
            raise AssertionError("prefix cache: nodes are still locked by requests")
        pages = np.zeros_like(self._is_node)
        pages[[n.page for n in nodes]] = True
        swa = np.zeros_like(self._holds_swa)
        swa[[n.page for n in nodes if n.swa]] = True
        if (
            set(self._leaves) != {n for n in nodes if not n.children}
            or set(self._swa) != {n for n in nodes if n.swa}
            or not np.array_equal(pages, self._is_node)
            or not np.array_equal(swa, self._holds_swa)
        ):
            raise AssertionError("prefix cache: its indexes of leaves, pages or SWA holders disagree with the tree")
        for heap, index in ((self._leaf_heap, self._leaves), (self._swa_heap, self._swa)):
            queued = {(t, n) for t, _, n in heap}
            if any((n.last_used, n) not in queued for n in index):
                raise AssertionError("prefix cache: a node eviction could take is missing from its queue")
        if alloc.full.num_free + len(nodes) != alloc.full.num_pages or any(
            alloc.full.holders(n.page) != 1 for n in nodes
        ):
            raise AssertionError(
                f"prefix cache: {alloc.full.num_pages - alloc.full.num_free} full pages in use, "
                f"the tree holds {len(nodes)}"
            )
        if self.window is not None:
            swa = [alloc.swa_page_of(n.page) for n in nodes if n.swa]
            if alloc.swa.num_free + len(swa) != alloc.swa.num_pages or any(alloc.swa.holders(pg) != 1 for pg in swa):
                raise AssertionError(
                    f"prefix cache: {alloc.swa.num_pages - alloc.swa.num_free} SWA pages in use, "
                    f"the tree holds {len(swa)}"
                )
