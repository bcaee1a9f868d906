"""An approximate per-replica record of the token prefixes it has served (a radix tree), used to
send requests that share a long prefix to the replica most likely to hold its KV."""

from __future__ import annotations

import itertools
from collections.abc import Sequence


class _Node:
    __slots__ = ("edge", "children", "last_used", "parent")

    def __init__(self, edge: tuple[int, ...], parent: _Node | None) -> None:
        self.edge = edge  # tokens on the edge into this node
        self.children: dict[int, _Node] = {}
        self.last_used = 0
        self.parent = parent


class PrefixTree:
    """Token sequences inserted so far, compressed into a radix tree of at most `max_tokens`
    tokens; the least recently used leaves go first when it grows past that."""

    def __init__(self, max_tokens: int = 1 << 20) -> None:
        self.root = _Node((), None)
        self.max_tokens = max_tokens
        self.size = 0
        self._clock = itertools.count(1)

    def match(self, tokens: Sequence[int]) -> int:
        """Length of the longest prefix of `tokens` in the tree."""
        return self._walk(tokens, touch=0)[0]

    def insert(self, tokens: Sequence[int]) -> None:
        tokens = tuple(tokens)
        now = next(self._clock)
        matched, node, partial = self._walk(tokens, touch=now)
        if matched == len(tokens):
            return
        if partial:  # split the edge the match ended in
            start = matched - partial
            child = node.children[tokens[start]]
            mid = _Node(child.edge[:partial], node)
            mid.last_used = now
            node.children[tokens[start]] = mid
            child.edge, child.parent = child.edge[partial:], mid
            mid.children[child.edge[0]] = child
            node = mid
        leaf = _Node(tokens[matched:], node)
        leaf.last_used = now
        node.children[tokens[matched]] = leaf
        self.size += len(leaf.edge)
        if self.size > self.max_tokens:
            self._evict()

    def _walk(self, tokens: Sequence[int], touch: int) -> tuple[int, _Node, int]:
        """(tokens matched, the deepest node whose whole path matched, tokens matched into one
        of its child edges). A nonzero `touch` marks the nodes on the path as used then."""
        node, i = self.root, 0
        while i < len(tokens):
            child = node.children.get(tokens[i])
            if child is None:
                break
            n = _common(child.edge, tokens, i)
            if touch:
                child.last_used = touch
            if n < len(child.edge):
                return i + n, node, n
            node, i = child, i + n
        return i, node, 0

    def _evict(self) -> None:
        while self.size > self.max_tokens:
            leaf = min(_leaves(self.root), key=lambda n: n.last_used)
            del leaf.parent.children[leaf.edge[0]]
            self.size -= len(leaf.edge)


def _common(edge: tuple[int, ...], tokens: Sequence[int], start: int) -> int:
    n = 0
    while n < len(edge) and start + n < len(tokens) and edge[n] == tokens[start + n]:
        n += 1
    return n


def _leaves(node: _Node):
    stack = [node]
    while stack:
        n = stack.pop()
        if not n.children and n.parent is not None:
            yield n
        stack.extend(n.children.values())
