"""srv plugin: the `sjf` (shortest job first) scheduling policy."""

from typing import Sequence

from srv.sdk import hookimpl
from srv.sdk.scheduling import R, SchedulePolicy

SRV_SDK_VERSION = ">=0.1,<0.2"


class ShortestJobFirst(SchedulePolicy):
    # The cached part of a prompt costs nothing to prefill, so the policy asks for it.
    needs_prefix_match = True

    def order(self, waiting: Sequence[R]) -> list[R]:
        def work(r: R) -> int:
            return r.prompt_len - r.cached_prefix_len + r.max_new_tokens

        return sorted(waiting, key=lambda r: (work(r), r.arrival_index))


@hookimpl
def srv_register_schedule_policies(register):
    register("sjf", ShortestJobFirst, description="shortest job (uncached prompt + max_new_tokens) first")
