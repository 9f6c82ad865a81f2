"""The eviction policies SGLang offers for its radix cache."""

from __future__ import annotations

from srv.sdk.cache import EvictableNode, EvictionPolicy


class LRUPolicy(EvictionPolicy):
    def eviction_key(self, node: EvictableNode) -> float:
        return node.last_access_time


class LFUPolicy(EvictionPolicy):
    # Ties between equally used prefixes go to the older one, as in LRU.
    def eviction_key(self, node: EvictableNode) -> tuple[int, float]:
        return (node.hit_count, node.last_access_time)
