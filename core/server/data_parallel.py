"""Data parallelism (`--data-parallel-size` N): N scheduler processes, each with the whole model
and its own KV memory, behind one front end. The router picks a group for each request by
`--load-balance-method`, sends the requests that name a session to the group that holds it, and
those a caller routed itself (SGLang's `routed_dp_rank`, the `X-Data-Parallel-Rank` header that
SGLang and vLLM read) to the group they name; control calls go to every group, and their replies
are merged into one.

    round_robin     groups in turn
    shortest_queue  the group with the fewest requests in flight
    minimum_tokens  the group with the least token load: what the group last reported (the KV
                    tokens its requests hold and the prompt tokens it has queued, asked every
                    `--load-watch-interval` seconds) and the prompts sent to it since it answered;
                    this evens out long and short requests, and counts what prefix-cache hits
                    and finished requests gave back
"""

from __future__ import annotations

import itertools
import logging
from dataclasses import dataclass
from typing import Any, Callable

from srv.engine.errors import InvalidRequest
from srv.engine.io import AbortRequest, ControlRequest, ControlResult, GenerateRequest, RequestOutput

logger = logging.getLogger("srv.data_parallel")

LOAD_BALANCE_METHODS = ("round_robin", "shortest_queue", "minimum_tokens")
# Fields of a group's status that are not amounts (an id, a ratio): kept from group 0.
NOT_SUMMED = {"pid", "spec_accept_length"}


# Load calls the router makes itself have ids below zero: the front end's count up from zero.
WATCH_CALL_IDS = itertools.count(-1, -1)


@dataclass
class LoadWatch:
    """One group's load as it last reported it, and the prompt tokens sent to it since."""

    reported: int = 0
    sent_since: int = 0
    # The load call in flight, and what had been sent when it was made (its answer counts those).
    call_id: int | None = None
    sent_before_call: int = 0

    @property
    def tokens(self) -> int:
        return self.reported + self.sent_since


class DataParallelRouter:
    """`send` takes what the front end sends; `receive(group, out)` what a group answers, and
    returns what the front end should see."""

    def __init__(self, sends: list[Callable[[Any], None]], method: str) -> None:
        if method not in LOAD_BALANCE_METHODS:
            raise ValueError(f"--load-balance-method {method}: srv balances by {', '.join(LOAD_BALANCE_METHODS)}")
        self.sends, self.method = sends, method
        self.groups = len(sends)
        self._turn = itertools.cycle(range(self.groups))
        self._requests: dict[str, int] = {}   # the group of each request in flight
        self._in_flight = [0] * self.groups
        self._loads = [LoadWatch() for _ in range(self.groups)]
        self._sessions: dict[str, int] = {}
        self._calls: dict[int, list[ControlResult | None]] = {}
        # Requests each group has been given since launch (what the tests and logs read).
        self.assigned = [0] * self.groups

    # ---- what the front end sends -------------------------------------------------------------

    def send(self, message: Any) -> None:
        if isinstance(message, GenerateRequest):
            group = self._group_of(message)
            if message.session_id:
                self._sessions[message.session_id] = group
            self._requests[message.rid] = group
            self._in_flight[group] += 1
            self._loads[group].sent_since += len(message.input_ids)
            self.assigned[group] += 1
            self.sends[group](message)
        elif isinstance(message, AbortRequest):
            owner = self._requests.get(message.rid)
            for group in [owner] if owner is not None else range(self.groups):
                self.sends[group](message)
        elif isinstance(message, ControlRequest):
            self._calls[message.call_id] = [None] * self.groups
            if message.method == "close_session":
                self._sessions.pop(message.args.get("session_id"), None)
            for send in self.sends:
                send(message)
        else:
            for send in self.sends:
                send(message)

    def _group_of(self, message: GenerateRequest) -> int:
        """The group a request goes to: its session's, else the one it names (the front end checked
        that it exists), else the method's choice. Raises InvalidRequest for a rank other than its
        session's."""
        held = self._sessions.get(message.session_id) if message.session_id else None
        named = message.dp_rank
        if named is not None and held is not None and named != held:
            raise InvalidRequest(f"session {message.session_id!r} is held by data-parallel rank {held}, "
                                 f"not {named}", "routed_dp_rank")
        if held is not None:
            return held
        return named if named is not None else self._choose()

    def _choose(self) -> int:
        if self.method == "round_robin":
            return next(self._turn)
        load = self._in_flight if self.method == "shortest_queue" else [watch.tokens for watch in self._loads]
        return min(range(self.groups), key=lambda g: (load[g], g))

    @property
    def watches_load(self) -> bool:
        return self.method == "minimum_tokens"

    def watch_load(self) -> None:
        """Ask each group for its load (minimum_tokens balances by the answers); a group still
        busy with the last call is not asked again."""
        for group, watch in enumerate(self._loads):
            if watch.call_id is None:
                watch.call_id, watch.sent_before_call = next(WATCH_CALL_IDS), watch.sent_since
                self.sends[group](ControlRequest(watch.call_id, "load"))

    # ---- what the groups answer ---------------------------------------------------------------

    def receive(self, group: int, out: RequestOutput | ControlResult) -> RequestOutput | ControlResult | None:
        if isinstance(out, ControlResult):
            watch = self._loads[group]
            if out.call_id == watch.call_id:
                # A group handles its messages in order: its answer counts every request sent
                # to it before the call (queued or running).
                if out.error is None:
                    watch.reported = out.value["num_tokens"]
                    watch.sent_since -= watch.sent_before_call
                watch.call_id = None
                return None
            replies = self._calls.get(out.call_id)
            if replies is None:
                return out
            replies[group] = out
            if any(reply is None for reply in replies):
                return None
            del self._calls[out.call_id]
            return merge_replies(replies)
        if out.finished:
            owner = self._requests.pop(out.rid, None)
            if owner is not None:
                self._in_flight[owner] -= 1
        return out


def merge_replies(replies: list[ControlResult]) -> ControlResult:
    """One reply for a control call every group answered: the first refusal, else group 0's
    value, with the amounts of a status or load summed over the groups (and each group's own
    under "data_parallel_groups") and a yes/no call true only where every group said yes."""
    refused = next((reply for reply in replies if reply.error is not None), None)
    if refused is not None:
        return refused
    values = [reply.value for reply in replies]
    first = values[0]
    if isinstance(first, bool):
        value: Any = all(values)
    elif isinstance(first, dict):
        value = dict(first)
        for key, item in first.items():
            if key not in NOT_SUMMED and isinstance(item, (int, float)) and not isinstance(item, bool):
                value[key] = sum(v.get(key, 0) for v in values)
        value["data_parallel_groups"] = values
    else:
        value = first
    return ControlResult(replies[0].call_id, value)
