"""Base class for scheduling policies (`--schedule-policy`): which waiting request goes first."""

from __future__ import annotations

from abc import ABC, abstractmethod
from typing import Any, Protocol, Sequence, TypeVar


class PrefixNode(Protocol):
    """A node of the prefix cache's tree; the root's parent is None."""

    parent: "PrefixNode | None"


class WaitingRequest(Protocol):
    """What a policy may read of a waiting request."""

    arrival_index: int          # 0, 1, 2, ... in order of arrival
    priority: int               # the request's priority (0 when not given)
    prompt_len: int
    max_new_tokens: int
    cached_prefix_len: int      # tokens found in the prefix cache (filled when the policy asks)
    prefix_node: PrefixNode | None  # the deepest prefix-cache node matched (filled likewise)


R = TypeVar("R", bound=WaitingRequest)


class SchedulePolicy(ABC):
    """Orders the waiting queue before each admission round."""

    #: Set to True to have `cached_prefix_len` and `prefix_node` refreshed before each `order`
    #: call (it costs a prefix-cache lookup per waiting request; without a prefix cache they
    #: stay 0 and None).
    needs_prefix_match: bool = False

    def __init__(self, server_args: Any = None) -> None:
        self.server_args = server_args

    @abstractmethod
    def order(self, waiting: Sequence[R]) -> list[R]:
        ...
