"""SGLang's scheduling policies for the waiting queue."""

from __future__ import annotations

import random
from collections import defaultdict
from typing import Sequence

from srv.sdk.scheduling import R, SchedulePolicy


class FCFSPolicy(SchedulePolicy):
    def order(self, waiting: Sequence[R]) -> list[R]:
        return sorted(waiting, key=lambda r: r.arrival_index)


class LongestPrefixMatchPolicy(SchedulePolicy):
    needs_prefix_match = True

    def order(self, waiting: Sequence[R]) -> list[R]:
        return sorted(waiting, key=lambda r: (-r.cached_prefix_len, r.arrival_index))


class DFSWeightPolicy(SchedulePolicy):
    """Walk the prefix tree depth-first, heaviest subtree (most waiting requests) first, so
    requests sharing a prefix run together while that prefix is cached."""

    needs_prefix_match = True

    def order(self, waiting: Sequence[R]) -> list[R]:
        at_node: dict[int, list[R]] = defaultdict(list)
        children: dict[int, list] = defaultdict(list)
        nodes: dict[int, object] = {}
        roots: list = []
        for req in sorted(waiting, key=lambda r: r.arrival_index):
            node = req.prefix_node
            at_node[id(node)].append(req)
            while node is not None and id(node) not in nodes:
                nodes[id(node)] = node
                parent = node.parent
                (children[id(parent)] if parent is not None else roots).append(node)
                node = parent
        weight: dict[int, int] = {}

        def subtree_weight(node) -> int:
            if id(node) not in weight:
                weight[id(node)] = len(at_node[id(node)]) + sum(subtree_weight(c) for c in children[id(node)])
            return weight[id(node)]

        ordered: list[R] = list(at_node[id(None)])  # requests with no prefix information
        stack = sorted(roots, key=subtree_weight)
        while stack:
            node = stack.pop()
            ordered += at_node[id(node)]
            stack += sorted(children[id(node)], key=subtree_weight)
        return ordered


class LongestOutputFirstPolicy(SchedulePolicy):
    def order(self, waiting: Sequence[R]) -> list[R]:
        return sorted(waiting, key=lambda r: (-r.max_new_tokens, r.arrival_index))


class RandomPolicy(SchedulePolicy):
    def __init__(self, server_args=None) -> None:
        super().__init__(server_args)
        seed = getattr(server_args, "random_seed", None)
        self.rng = random.Random(seed)

    def order(self, waiting: Sequence[R]) -> list[R]:
        shuffled = list(waiting)
        self.rng.shuffle(shuffled)
        return shuffled


class PriorityPolicy(SchedulePolicy):
    """Higher priority values first, or lower ones with --schedule-low-priority-values-first."""

    def order(self, waiting: Sequence[R]) -> list[R]:
        sign = 1 if getattr(self.server_args, "schedule_low_priority_values_first", False) else -1
        return sorted(waiting, key=lambda r: (sign * r.priority, r.arrival_index))
