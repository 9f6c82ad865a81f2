"""Conformance kit for KV cache event publishers (`--kv-events-config`)."""

from __future__ import annotations

import time
from typing import Any, Callable

from srv.sdk.kv_events import (AllBlocksCleared, BlockRemoved, BlockStored, KVEventBatch, KVEventPublisher,
                               block_hashes)
from srv.sdk.testing.registry import create


class KVEventPublisherKit:
    """Checks a publisher's contract: it takes a batch of every event type without blocking the
    scheduler that hands it over (however many come, with no subscriber), publishers of two
    data-parallel ranks run side by side on one config, and `close` returns.

        class TestMyPublisher(KVEventPublisherKit):
            backend_name = "mypublisher"          # the name your plugin registers, or:
            # publisher_factory = MyPublisher     # (config, data_parallel_rank) -> KVEventPublisher
            def make_config(self):                # the --kv-events-config a test launch gives it
                return {"publisher": "mypublisher", "endpoint": ...}
    """

    backend_name: str | None = None
    publisher_factory: Callable[[dict[str, Any], int], KVEventPublisher] | None = None
    # How long `publish_s_limit` publishes of one small batch may take in all.
    batches: int = 2000
    publish_s_limit: float = 2.0

    def make_config(self) -> dict[str, Any]:
        return {"publisher": self.backend_name}

    def make_publisher(self, config: dict[str, Any], rank: int = 0) -> KVEventPublisher:
        return create(self, "kv_events_publisher", "backend_name", "publisher_factory", config, rank)

    @staticmethod
    def batch(step: int) -> KVEventBatch:
        tokens = list(range(step, step + 8))
        hashes = block_hashes(None, tokens, 4)
        return KVEventBatch(float(step), [BlockStored(hashes, None, tokens, 4, None, None),
                                          BlockRemoved(hashes[1:], None), AllBlocksCleared()], 0)

    def test_publishing_never_blocks_the_scheduler(self) -> None:
        publisher = self.make_publisher(self.make_config())
        try:
            started = time.monotonic()
            for step in range(self.batches):
                publisher.publish(self.batch(step))
            assert time.monotonic() - started <= self.publish_s_limit, \
                f"{self.batches} publishes took longer than {self.publish_s_limit} s: publish must only queue"
        finally:
            started = time.monotonic()
            publisher.close()
            assert time.monotonic() - started <= 15.0, "close did not return"

    def test_two_data_parallel_ranks_publish_side_by_side(self) -> None:
        config = self.make_config()
        publishers = [self.make_publisher(config, rank) for rank in (0, 1)]
        try:
            for rank, publisher in enumerate(publishers):
                assert publisher.data_parallel_rank == rank
                publisher.publish(self.batch(rank))
        finally:
            for publisher in publishers:
                publisher.close()
