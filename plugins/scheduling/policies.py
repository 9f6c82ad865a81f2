"""SGLang's scheduling policies for the waiting queue."""

from __future__ import annotations

import random
from typing import Sequence

from srv.sdk.scheduling import R, SchedulePolicy


class FCFSPolicy(SchedulePolicy):
    def order(self, waiting: Sequence[R]) -> list[R]:
        return sorted(waiting, key=lambda r: r.arrival_index)


class LongestPrefixMatchPolicy(SchedulePolicy):
    needs_prefix_match = True

    def order(self, waiting: Sequence[R]) -> list[R]:
        return sorted(waiting, key=lambda r: (-r.cached_prefix_len, r.arrival_index))


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
