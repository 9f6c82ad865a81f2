"""Base class for warm-ups (`--warmups a,b`): named work a server runs before it listens, after
its own one-token probe, so that the first users' requests do not pay one-time costs (kernels
built or laid out at their first use, memory touched for the first time).

The factory takes the server arguments. `run` is handed a `WarmupClient`: it sends requests
through the whole serving path, as token ids, and awaits their output. The kit
(`srv.sdk.testing.WarmupKit`) runs a warm-up on a tiny model and checks that it ends and leaves
no request or KV memory behind.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from typing import Any, Protocol


class WarmupClient(Protocol):
    """What a warm-up may do with the server it warms: send prompts (token ids), each generating
    `max_new_tokens` tokens greedily (one count for all, or one a prompt; end tokens do not stop
    them), all at once as concurrent requests, and get their output ids; and read the limits it
    must keep to."""

    vocab_size: int
    context_len: int
    chunked_prefill_size: int   # tokens a prefill step takes at most (0: no limit)
    max_running_requests: int

    async def generate(self, input_ids: list[list[int]], max_new_tokens: int | list[int]) -> list[list[int]]:
        ...


class Warmup(ABC):
    def __init__(self, server_args: Any = None) -> None:
        self.server_args = server_args

    @abstractmethod
    async def run(self, client: WarmupClient) -> None:
        ...
