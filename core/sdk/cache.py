"""Base classes for prefix-cache plugins."""

from __future__ import annotations

from abc import ABC, abstractmethod
from typing import Any, Protocol


class EvictableNode(Protocol):
    """What an eviction policy may read of a prefix-cache node."""

    last_access_time: float
    hit_count: int
    num_tokens: int


class EvictionPolicy(ABC):
    """Orders unreferenced prefix-cache leaves for eviction: the smallest key goes first."""

    @abstractmethod
    def eviction_key(self, node: EvictableNode) -> Any:
        ...
