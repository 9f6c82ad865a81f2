"""Conformance kit for scheduling policies (`--schedule-policy`)."""

from __future__ import annotations

import random
from dataclasses import dataclass
from typing import Any, Callable

import pytest

from srv.sdk.scheduling import SchedulePolicy
from srv.sdk.testing.registry import create


@dataclass(eq=False)
class FakePrefixNode:
    """A prefix-cache node (srv.sdk.scheduling.PrefixNode): the root's parent is None."""

    parent: "FakePrefixNode | None" = None


@dataclass(eq=False)
class FakeWaitingRequest:
    """What srv shows a policy of a waiting request (srv.sdk.scheduling.WaitingRequest)."""

    arrival_index: int
    priority: int
    prompt_len: int
    max_new_tokens: int
    cached_prefix_len: int = 0
    prefix_node: FakePrefixNode | None = None

    def state(self) -> tuple:
        return (self.arrival_index, self.priority, self.prompt_len, self.max_new_tokens,
                self.cached_prefix_len, id(self.prefix_node))


def fake_waiting(count: int, prefix_info: bool, seed: int = 0) -> list[FakeWaitingRequest]:
    """`count` requests, listed out of arrival order (a retracted request goes back first).

    prefix_info: matched nodes in a small prefix tree and their cached lengths, as srv fills
    them for a policy with needs_prefix_match; otherwise 0 and None, as without a prefix cache.
    """
    rng = random.Random(seed)
    root = FakePrefixNode()
    a, c = FakePrefixNode(root), FakePrefixNode(root)
    b, d = FakePrefixNode(a), FakePrefixNode(c)
    e = FakePrefixNode(b)
    depth = {id(root): 0, id(a): 1, id(c): 1, id(b): 2, id(d): 2, id(e): 3}
    requests = []
    for i in range(count):
        node = rng.choice([root, a, b, c, d, e, e]) if prefix_info else None
        requests.append(FakeWaitingRequest(
            arrival_index=i, priority=rng.choice([-1, 0, 0, 3]), prompt_len=rng.randint(1, 300),
            max_new_tokens=rng.choice([1, 16, 128, 128, 1024]),
            cached_prefix_len=16 * depth[id(node)] if node is not None else 0, prefix_node=node))
    rng.shuffle(requests)
    return requests


def assert_permutation(result: Any, waiting: list[FakeWaitingRequest]) -> None:
    assert isinstance(result, list), f"order() returned {type(result).__name__}, must return a list"
    ids = [id(r) for r in result]
    assert len(set(ids)) == len(ids), "order() returned a request twice"
    missing = [r.arrival_index for r in waiting if id(r) not in set(ids)]
    assert not missing, f"order() lost requests with arrival_index {missing}"
    assert len(result) == len(waiting), f"order() returned {len(result)} requests for {len(waiting)} (foreign objects?)"


class SchedulePolicyKit:
    """Checks a scheduling policy's contract: `order(waiting)` returns a new list holding exactly
    the waiting requests (none lost, none duplicated, nothing added) and leaves its input and
    the requests alone; it must cope with requests with and without prefix information.

        class TestMyPolicy(SchedulePolicyKit):
            backend_name = "sjf"             # the name your plugin registers, or:
            # policy_factory = SJFPolicy     # (server_args) -> SchedulePolicy

    `server_args` is what the factory receives (None unless you set it).
    """

    backend_name: str | None = None
    policy_factory: Callable[..., SchedulePolicy] | None = None
    server_args: Any = None

    def make_policy(self) -> SchedulePolicy:
        return create(self, "schedule_policy", "backend_name", "policy_factory", self.server_args)

    # ---- the tests -------------------------------------------------------------------------

    @pytest.mark.parametrize("prefix_info", [False, True], ids=["no-prefix-info", "prefix-info"])
    @pytest.mark.parametrize("count", [0, 1, 2, 7, 60])
    def test_order_is_a_permutation(self, count: int, prefix_info: bool) -> None:
        waiting = fake_waiting(count, prefix_info, seed=count)
        assert_permutation(self.make_policy().order(waiting), waiting)

    @pytest.mark.parametrize("prefix_info", [False, True], ids=["no-prefix-info", "prefix-info"])
    def test_order_leaves_its_input_alone(self, prefix_info: bool) -> None:
        """order returns a new list and changes neither its input list nor the requests.

        srv sorts the returned list again (priority scheduling) and keeps its own queue."""
        waiting = fake_waiting(30, prefix_info, seed=1)
        listed, states = list(waiting), [r.state() for r in waiting]
        result = self.make_policy().order(waiting)
        assert result is not waiting, "order() returned its input list: return a new one"
        assert [id(r) for r in waiting] == [id(r) for r in listed], "order() reordered or changed its input list"
        assert [r.state() for r in waiting] == states, "order() changed a request's attributes"

    def test_repeated_calls_and_identical_requests(self) -> None:
        """One policy object orders the queue at every step; ties everywhere are fine."""
        policy = self.make_policy()
        waiting = fake_waiting(20, prefix_info=policy.needs_prefix_match, seed=2)
        twins = [FakeWaitingRequest(i, 0, 10, 10) for i in range(5)]
        for queue in (waiting, twins, waiting):
            for _ in range(3):
                result = policy.order(queue)
                assert_permutation(result, queue)
                queue = result

    def test_needs_prefix_match_is_a_bool(self) -> None:
        policy = self.make_policy()
        assert isinstance(policy.needs_prefix_match, bool), "needs_prefix_match must be True or False"
        assert callable(getattr(policy, "order", None)), "a schedule policy has an order(waiting) method"
