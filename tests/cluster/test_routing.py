"""Routing policies and their data structures, without Ray: round robin spreads evenly, power of
two prefers the lighter replica, cache-aware follows long shared prefixes while balanced and the
least loaded replica when not, consistent hashing keeps sessions and moves only the sessions of
a replica that leaves."""

import collections
import random

import pytest

from cluster.routing.load_board import LoadBoard
from cluster.routing.policies import CacheAware, ConsistentHash, PowerOfTwo, RoundRobin, RouteRequest, make_policy
from cluster.routing.prefix_tree import PrefixTree

REPLICAS = ["r0", "r1", "r2"]


def _req(i: int, tokens=(1, 2, 3), session: str = "") -> RouteRequest:
    return RouteRequest(f"req-{i}", list(tokens), 16, session)


def test_round_robin_spreads_evenly():
    policy = RoundRobin()
    counts = collections.Counter(policy.choose(_req(i), REPLICAS, {}).ranked[0] for i in range(300))
    assert counts == {"r0": 100, "r1": 100, "r2": 100}


def test_power_of_two_prefers_the_lighter_replica():
    policy = PowerOfTwo(seed=0)
    loads = {"r0": 1000.0, "r1": 10.0, "r2": 500.0}
    firsts = collections.Counter(policy.choose(_req(i), REPLICAS, loads).ranked[0] for i in range(3000))
    assert firsts["r0"] == 0  # the heaviest loses every pair it is drawn into
    assert 0.6 < firsts["r1"] / 3000 < 0.73  # wins both pairs it is in: 2/3


def test_cache_aware_follows_shared_prefixes_while_balanced():
    policy = CacheAware(cache_threshold=0.5, balance_abs_threshold=256, balance_rel_threshold=1.5)
    rng = random.Random(0)
    prefixes = [[rng.randrange(1000) for _ in range(200)] for _ in range(3)]
    homes = {}
    for i in range(30):
        k = i % 3
        request = _req(i, prefixes[k] + [rng.randrange(1000) for _ in range(10)])
        decision = policy.choose(request, REPLICAS, {r: 100.0 for r in REPLICAS})
        replica = decision.ranked[0]
        policy.on_routed(request, replica)
        if k in homes:
            assert replica == homes[k] and decision.reason == "prefix" and decision.prefix_match > 0.9
        homes.setdefault(k, replica)


def test_cache_aware_goes_to_the_least_loaded_when_imbalanced():
    policy = CacheAware(cache_threshold=0.5, balance_abs_threshold=256, balance_rel_threshold=1.5)
    prefix = list(range(300))
    policy.on_routed(_req(0, prefix), "r0")
    request = _req(1, prefix + [7])
    assert (
        policy.choose(request, REPLICAS, {"r0": 300.0, "r1": 200.0, "r2": 250.0}).ranked[0] == "r0"
    )  # gap 100: balanced
    imbalanced = policy.choose(request, REPLICAS, {"r0": 2000.0, "r1": 200.0, "r2": 250.0})
    assert imbalanced.ranked[0] == "r1" and imbalanced.reason == "imbalanced"
    # Both thresholds must be crossed: a large absolute gap with a small ratio is still balanced.
    assert policy.choose(request, REPLICAS, {"r0": 10400.0, "r1": 10000.0, "r2": 10000.0}).ranked[0] == "r0"
    low = policy.choose(_req(2, [9] * 50), REPLICAS, {"r0": 30.0, "r1": 20.0, "r2": 10.0})
    assert low.ranked[0] == "r2" and low.reason == "low_match"


def test_consistent_hash_keeps_sessions_and_moves_only_the_leavers():
    policy = ConsistentHash(virtual_nodes=64)
    replicas = ["r0", "r1", "r2", "r3"]
    sessions = [f"session-{i}" for i in range(2000)]
    home = {s: policy.choose(_req(i, session=s), replicas, {}).ranked[0] for i, s in enumerate(sessions)}
    assert all(policy.choose(_req(0, session=s), replicas, {}).ranked[0] == home[s] for s in sessions[:200])
    counts = collections.Counter(home.values())
    assert min(counts.values()) > 300  # spread over every replica
    after = {s: policy.choose(_req(0, session=s), ["r0", "r1", "r3"], {}).ranked[0] for s in sessions}
    moved = {s for s in sessions if after[s] != home[s]}
    assert moved == {s for s in sessions if home[s] == "r2"}


def test_prefix_tree_matches_brute_force_and_evicts_least_recent():
    rng = random.Random(1)
    tree = PrefixTree()
    seqs = []
    for _ in range(400):
        base = rng.choice(seqs) if seqs and rng.random() < 0.7 else []
        seq = base[: rng.randint(0, len(base))] + [rng.randrange(6) for _ in range(rng.randint(1, 12))]
        seqs.append(seq)
        tree.insert(seq)

    def brute(q):
        return max(next((i for i, (a, b) in enumerate(zip(q, s)) if a != b), min(len(q), len(s))) for s in seqs)

    for _ in range(500):
        q = [rng.randrange(6) for _ in range(rng.randint(1, 15))]
        assert tree.match(q) == brute(q)
    small = PrefixTree(max_tokens=10)
    small.insert([1, 2, 3, 4, 5])
    small.insert([9, 9, 9, 9, 9])
    small.insert([1, 2, 3, 4, 5])  # touched again: the 9s are least recent
    small.insert([7, 7, 7])
    assert small.size <= 10 and small.match([1, 2, 3, 4, 5]) == 5 and small.match([9, 9]) == 0


def test_load_board_counts_in_flight_and_reports():
    board = LoadBoard()
    board.routed(RouteRequest("a", [1] * 10, 90), "r0")
    board.routed(RouteRequest("b", [1] * 10, 40), "r1")
    assert board.token_loads(["r0", "r1"]) == {"r0": 100.0, "r1": 50.0}
    board.finished("a", {"replica": "r0", "token_load": 30})
    assert board.token_loads(["r0", "r1"]) == {"r0": 30.0, "r1": 50.0}


def test_unknown_policy_is_named():
    with pytest.raises(ValueError, match="router.policy"):
        make_policy("random_walk")


def test_load_board_decisions_are_kept_until_read():
    board = LoadBoard()
    decision = CacheAware().choose(_req(0), REPLICAS, {})
    board.decide("req-0", decision, REPLICAS)
    assert board.pop_decision("req-0")[2] == decision.ranked[0]
    assert board.pop_decision("req-0") is None and not board.decisions


def test_a_choice_goes_where_the_choice_it_follows_went():
    """n choices of a prompt: the replica that prefills choice 0 forks it for the others (unless
    a retry excludes it, or it has gone)."""
    board, policy = LoadBoard(), RoundRobin()
    leader = _req(0)
    board.note_routed(policy, leader, board.choose(policy, leader, REPLICAS).ranked[0])
    home = board.replica_of("req-0")
    for i in range(1, 4):
        follower = RouteRequest(f"req-{i}", [1, 2, 3], 16, follows="req-0")
        assert board.choose(policy, follower, REPLICAS).ranked[0] == home
    excluded = RouteRequest("req-9", [1, 2, 3], 16, exclude=frozenset({home}), follows="req-0")
    assert board.choose(policy, excluded, REPLICAS).ranked[0] != home
    board.finished("req-0")
    orphan = RouteRequest("req-10", [1, 2, 3], 16, follows="req-0")
    assert board.choose(policy, orphan, REPLICAS).ranked[0] in REPLICAS
