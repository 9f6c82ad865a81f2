"""Conformance kit for prefix-cache eviction policies (`--radix-eviction-policy`)."""

from __future__ import annotations

import heapq
import itertools
import random
from dataclasses import dataclass
from typing import Any, Callable

from srv.sdk.cache import EvictionPolicy
from srv.sdk.testing.registry import create


@dataclass(eq=False)
class FakeNode:
    """What srv's radix cache shows an eviction policy of a leaf (srv.sdk.cache.EvictableNode)."""

    last_access_time: float
    hit_count: int
    num_tokens: int

    def state(self) -> tuple[float, int, int]:
        return (self.last_access_time, self.hit_count, self.num_tokens)


def fake_leaves(count: int = 200, seed: int = 0) -> list[FakeNode]:
    """Leaves with many ties in each attribute (few distinct times, counts and sizes)."""
    rng = random.Random(seed)
    return [FakeNode(1000.0 + rng.choice([0.0, 0.5, 1.25, 7.0, 9.5]) + rng.randrange(20),
                     rng.choice([0, 0, 1, 2, 5, 40]), rng.choice([1, 16, 32, 48, 160]))
            for _ in range(count)]


def _less(a: Any, b: Any) -> bool:
    try:
        return bool(a < b)
    except Exception as exc:
        raise AssertionError(f"eviction keys {a!r} and {b!r} cannot be compared with '<': {exc!r}") from None


class EvictionPolicyKit:
    """Checks an eviction policy's contract: srv's radix cache keeps unreferenced leaves in a
    heap of (eviction_key(leaf), counter, leaf) and evicts the smallest key first, so keys
    must be totally ordered by `<`, depend only on the node's documented attributes
    (last_access_time, hit_count, num_tokens), and leave the node unchanged.

        class TestMyPolicy(EvictionPolicyKit):
            backend_name = "fifo"            # the name your plugin registers, or:
            # policy_factory = FIFOPolicy    # () -> EvictionPolicy
    """

    backend_name: str | None = None
    policy_factory: Callable[[], EvictionPolicy] | None = None

    def make_policy(self) -> EvictionPolicy:
        return create(self, "eviction_policy", "backend_name", "policy_factory")

    def keys(self, nodes: list[FakeNode]) -> list[Any]:
        policy = self.make_policy()
        return [policy.eviction_key(n) for n in nodes]

    # ---- the tests -------------------------------------------------------------------------

    def test_keys_are_totally_ordered(self) -> None:
        """Any two keys compare (exactly one of a < b, b < a, neither), and `<` is transitive."""
        keys = self.keys(fake_leaves(60))
        less = [[_less(a, b) for b in keys] for a in keys]
        for i, j in itertools.combinations(range(len(keys)), 2):
            assert not (less[i][j] and less[j][i]), f"keys {keys[i]!r} and {keys[j]!r} are each less than the other"
        for i, j, k in itertools.permutations(range(0, len(keys), 3), 3):
            if less[i][j] and less[j][k]:
                assert less[i][k], f"'<' is not transitive: {keys[i]!r} < {keys[j]!r} < {keys[k]!r}"
            if not less[j][i] and not less[k][j]:  # i <= j <= k
                assert not less[k][i], f"keys are not totally ordered: {keys[i]!r}, {keys[j]!r}, {keys[k]!r}"

    def test_keys_are_deterministic_and_read_only_the_node(self) -> None:
        """Keys depend only on the node's attributes, and reading them changes nothing.

        The same node, and another node with the same attributes, get equal keys."""
        nodes = fake_leaves(50, seed=1)
        states = [n.state() for n in nodes]
        first, second = self.keys(nodes), self.keys(nodes)
        twins = self.keys([FakeNode(*n.state()) for n in nodes])
        assert [n.state() for n in nodes] == states, "eviction_key changed a node's attributes"
        for a, b, c in zip(first, second, twins):
            assert not _less(a, b) and not _less(b, a), f"the same node got keys {a!r} then {b!r}"
            assert not _less(a, c) and not _less(c, a), f"nodes with equal attributes got keys {a!r} and {c!r}"

    def test_sorted_leaves_are_the_same_whatever_their_input_order(self) -> None:
        """The eviction order does not depend on the order leaves are listed in.

        Sorting leaves by key (or popping them from a heap, as the radix cache does) gives the
        same groups of equal-key leaves, in the same order, for any input order."""
        nodes = fake_leaves(200, seed=2)
        policy = self.make_policy()
        orders = []
        for seed in range(3):
            shuffled = nodes[:]
            random.Random(seed).shuffle(shuffled)
            ranked = sorted(shuffled, key=policy.eviction_key)
            groups: list[list[tuple]] = []
            for previous, node in zip([None] + ranked, ranked):
                if previous is None or _less(policy.eviction_key(previous), policy.eviction_key(node)):
                    groups.append([])
                groups[-1].append(node.state())
            orders.append([sorted(group) for group in groups])
            heap = [(policy.eviction_key(n), i, n) for i, n in enumerate(shuffled)]
            heapq.heapify(heap)
            popped = [heapq.heappop(heap)[0] for _ in range(len(heap))]
            assert all(not _less(b, a) for a, b in zip(popped, popped[1:])), "heap pops keys out of order"
        assert orders[0] == orders[1] == orders[2], "the eviction order depends on the order leaves are listed"
