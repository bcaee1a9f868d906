"""Replica selection policies, independent of Ray: each ranks the candidate replicas for a request.

- round_robin: the next replica in turn.
- power_of_two: of two random replicas, the one with less token load.
- cache_aware: the replica whose served prefixes match the request longest, while the load is
  balanced; the least loaded one when it is not (SGLang router style).
- consistent_hash: a hash ring over the session key: a session stays on its replica; when a
  replica leaves, only its sessions move.

Token load of a replica = prompt + max_new_tokens of the requests routed to it and not finished,
or what the replica itself last reported, whichever is larger.
"""

from __future__ import annotations

import abc
import bisect
import dataclasses
import hashlib
import itertools
import random
from collections.abc import Sequence
from typing import Any

from cluster.routing.prefix_tree import PrefixTree


@dataclasses.dataclass(frozen=True)
class RouteRequest:
    request_id: str
    tokens: Sequence[int]
    max_new_tokens: int
    session_id: str = ""
    exclude: frozenset[str] = frozenset()  # replicas a retry must avoid
    follows: str = ""  # another choice of the same prompt: its replica forks its prefill

    @property
    def cost(self) -> int:
        return len(self.tokens) + self.max_new_tokens


@dataclasses.dataclass
class Decision:
    """What a policy chose and why (recorded on the router span)."""

    ranked: list[str]
    policy: str
    prefix_match: float | None = None  # cache_aware: matched / prompt tokens on the chosen replica
    reason: str = ""


class Policy(abc.ABC):
    name = ""

    @abc.abstractmethod
    def choose(self, request: RouteRequest, replicas: Sequence[str], loads: dict[str, float]) -> Decision:
        """Rank `replicas` (non-empty) for this request, best first."""

    def on_routed(self, request: RouteRequest, replica: str) -> None:
        """The request went to `replica`."""

    def on_replica_removed(self, replica: str) -> None:
        """`replica` left the deployment."""


def _least_loaded_first(replicas: Sequence[str], loads: dict[str, float]) -> list[str]:
    return sorted(replicas, key=lambda r: (loads.get(r, 0.0), r))


class RoundRobin(Policy):
    name = "round_robin"

    def __init__(self) -> None:
        self._turn = itertools.count()

    def choose(self, request, replicas, loads):
        ordered = sorted(replicas)
        i = next(self._turn) % len(ordered)
        return Decision(ordered[i:] + ordered[:i], self.name)


class PowerOfTwo(Policy):
    name = "power_of_two"

    def __init__(self, seed: int | None = None) -> None:
        self._rng = random.Random(seed)

    def choose(self, request, replicas, loads):
        pair = self._rng.sample(list(replicas), min(2, len(replicas)))
        ranked = sorted(pair, key=lambda r: (loads.get(r, 0.0), self._rng.random()))
        rest = [r for r in _least_loaded_first(replicas, loads) if r not in ranked]
        return Decision(ranked + rest, self.name)


class CacheAware(Policy):
    name = "cache_aware"

    def __init__(
        self,
        cache_threshold: float = 0.5,
        balance_abs_threshold: float = 256,
        balance_rel_threshold: float = 1.5,
        max_tree_tokens: int = 1 << 20,
    ) -> None:
        """Imbalanced when max load - min load > balance_abs_threshold (tokens) and max load >
        balance_rel_threshold x min load; then the least loaded replica wins. Otherwise the best
        prefix match wins when it covers more than cache_threshold of the prompt, else the
        least loaded."""
        self.cache_threshold = cache_threshold
        self.balance_abs = balance_abs_threshold
        self.balance_rel = balance_rel_threshold
        self.max_tree_tokens = max_tree_tokens
        self.trees: dict[str, PrefixTree] = {}

    def _tree(self, replica: str) -> PrefixTree:
        return self.trees.setdefault(replica, PrefixTree(self.max_tree_tokens))

    def imbalanced(self, replicas: Sequence[str], loads: dict[str, float]) -> bool:
        values = [loads.get(r, 0.0) for r in replicas]
        high, low = max(values), min(values)
        return high - low > self.balance_abs and high > self.balance_rel * low

    def choose(self, request, replicas, loads):
        by_load = _least_loaded_first(replicas, loads)
        matches = {r: self._tree(r).match(request.tokens) for r in replicas}
        if self.imbalanced(replicas, loads):
            return Decision(by_load, self.name, matches[by_load[0]] / max(1, len(request.tokens)), "imbalanced")
        best = max(replicas, key=lambda r: (matches[r], -loads.get(r, 0.0), r))
        rate = matches[best] / max(1, len(request.tokens))
        if rate > self.cache_threshold:
            return Decision([best] + [r for r in by_load if r != best], self.name, rate, "prefix")
        return Decision(by_load, self.name, matches[by_load[0]] / max(1, len(request.tokens)), "low_match")

    def on_routed(self, request, replica):
        self._tree(replica).insert(request.tokens)

    def on_replica_removed(self, replica):
        self.trees.pop(replica, None)


class ConsistentHash(Policy):
    name = "consistent_hash"

    def __init__(self, virtual_nodes: int = 64) -> None:
        self.virtual_nodes = virtual_nodes
        self._ring: list[tuple[int, str]] = []
        self._members: frozenset[str] = frozenset()

    @staticmethod
    def _hash(key: str) -> int:
        return int.from_bytes(hashlib.blake2b(key.encode(), digest_size=8).digest(), "big")

    def _update(self, replicas: Sequence[str]) -> None:
        members = frozenset(replicas)
        if members != self._members:
            self._members = members
            self._ring = sorted((self._hash(f"{r}#{i}"), r) for r in members for i in range(self.virtual_nodes))

    def choose(self, request, replicas, loads):
        self._update(replicas)
        key = self._hash(request.session_id or request.request_id)
        start = bisect.bisect(self._ring, (key, ""))
        ranked: list[str] = []
        for _, replica in itertools.chain(self._ring[start:], self._ring[:start]):
            if replica not in ranked:
                ranked.append(replica)
        return Decision(ranked, self.name)


POLICIES: dict[str, type[Policy]] = {p.name: p for p in (RoundRobin, PowerOfTwo, CacheAware, ConsistentHash)}


def make_policy(name: str, **params: Any) -> Policy:
    if name not in POLICIES:
        raise ValueError(f"router.policy: unknown {name!r}; known: {sorted(POLICIES)}")
    return POLICIES[name](**params)
