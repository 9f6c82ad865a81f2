"""KV cache events (`--kv-events-config`): what a server publishes as its prefix cache changes,
so that a router can send each request where its prefix is cached (NVIDIA Dynamo's KV router,
llm-d). The event types and their encoding are vLLM's and SGLang's: msgpack arrays whose first
element names the event, in batches of [timestamp, events, data-parallel rank].

`--kv-events-config` is a JSON object. Its "publisher" names a backend of the
`kv_events_publisher` family ("zmq", or "null" for none); the other keys are the publisher's
own, and a publisher refuses a key it does not know. A publisher is built with the config and
the data-parallel rank of the scheduler it serves, and is handed a `KVEventBatch` after each
scheduler step that changed the cache (`publish`, which must not block the step).

Blocks are the prefix cache's pages (`--page-size` tokens). A block's hash is a content hash
of its tokens and every token before it (`block_hashes`), so servers of the same model agree
on it; it is a non-negative integer below 2**63.
"""

from __future__ import annotations

import hashlib
from abc import ABC, abstractmethod
from array import array
from typing import Any

import msgspec


class EventBatch(msgspec.Struct, array_like=True, omit_defaults=True, gc=False):
    ts: float
    events: list[Any]
    data_parallel_rank: int | None = None


class KVCacheEvent(msgspec.Struct, array_like=True, omit_defaults=True, gc=False, tag=True):
    """A change of the prefix cache."""


class BlockStored(KVCacheEvent):
    """Blocks now cached: `token_ids` are theirs, `block_size` each; the first follows
    `parent_block_hash` (None: it starts a sequence)."""

    block_hashes: list[int]
    parent_block_hash: int | None
    token_ids: list[int]
    block_size: int
    lora_id: int | None
    medium: str | None


class BlockRemoved(KVCacheEvent):
    block_hashes: list[int]
    medium: str | None


class AllBlocksCleared(KVCacheEvent):
    pass


class KVEventBatch(EventBatch):
    events: list[BlockStored | BlockRemoved | AllBlocksCleared]


def block_hashes(parent: int | None, tokens: list[int], block_size: int) -> list[int]:
    """Hashes of the whole blocks of `tokens`, each chained on the one before (the first on
    `parent`, the block before them, or None at the start of a sequence)."""
    hashes = []
    for start in range(0, len(tokens) - block_size + 1, block_size):
        seed = b"" if parent is None else parent.to_bytes(8, "big")
        digest = hashlib.sha256(seed + array("q", tokens[start:start + block_size]).tobytes()).digest()
        parent = int.from_bytes(digest[:8], "big") >> 1
        hashes.append(parent)
    return hashes


class KVEventPublisher(ABC):
    """Sends the batches of one scheduler's events (a `kv_events_publisher` backend)."""

    def __init__(self, config: dict[str, Any], data_parallel_rank: int = 0) -> None:
        self.config, self.data_parallel_rank = config, data_parallel_rank

    @abstractmethod
    def publish(self, batch: KVEventBatch) -> None:
        """Send `batch` (or queue it to be sent): called on the scheduler's loop."""

    def close(self) -> None:
        """The server is stopping: send what is queued, and release the transport."""
