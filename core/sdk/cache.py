"""Base classes for prefix-cache plugins: eviction policies (`--radix-eviction-policy`), the
prefix cache the scheduler talks to, and hierarchical-cache storage backends
(`--hicache-storage-backend`)."""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass, field
from typing import Any, Protocol

import torch


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


# Where a prefix-cache node's keys and values are: in the KV pool the model reads, in host
# memory (the hierarchical cache's second tier), or only in a storage backend.
DEVICE, HOST, STORAGE = "device", "host", "storage"


class PrefixCache(ABC):
    """The prefix cache the scheduler uses: a tree of token pages whose nodes own KV slots.

    Keys are whole pages, so every match is page-aligned. `match_prefix` only looks;
    `load_prefix` (at admission) may first bring a prefix held in a slower tier back into the
    KV pool. A locked node (and its ancestors) is in use and is never evicted from the pool;
    `evict` frees pool slots of unlocked nodes, and what a tier below keeps of them stays
    matchable. Token counts (`cached_tokens` and the rest) are of pool slots.
    """

    page_size: int
    evicted_tokens: int
    evictable_tokens: int
    protected_tokens: int

    @property
    def cached_tokens(self) -> int:
        return self.evictable_tokens + self.protected_tokens

    @abstractmethod
    def match_prefix(self, tokens: list[int]) -> tuple[torch.Tensor, Any]:
        """Pool slots of the longest cached page-aligned prefix of `tokens`, and its last node."""

    def load_prefix(self, tokens: list[int], rid: str | None = None) -> tuple[torch.Tensor, Any]:
        """As `match_prefix`, after bringing back into the pool what slower tiers hold of
        `tokens` (what `prefetch` fetched for request `rid`)."""
        return self.match_prefix(tokens)

    def prefetch(self, rid: str, tokens: list[int]) -> None:
        """A request arrived: start fetching what a slower tier holds of its prompt."""

    def prefetch_ready(self, rid: str) -> bool:
        """Whether request `rid` may be admitted now (the prefetch policy decides)."""
        return True

    def forget(self, rid: str) -> None:
        """Request `rid` left before admission: drop its prefetch."""

    def wait_for_prefetch(self, timeout: float) -> None:
        """The scheduler has nothing to run but requests waiting for prefetches: block until one
        completes, at most `timeout` seconds (rather than spin, starving the I/O thread)."""

    @abstractmethod
    def insert(self, tokens: list[int], slots: torch.Tensor) -> int:
        """Cache `tokens` (page-aligned) with their pool slots; returns how many leading tokens
        the pool held already (the caller frees its own slots for those, and only those)."""

    @abstractmethod
    def lock(self, node: Any) -> None:
        ...

    @abstractmethod
    def unlock(self, node: Any) -> None:
        ...

    @abstractmethod
    def evict(self, num_tokens: int) -> int:
        """Free at least `num_tokens` pool slots of unlocked nodes if possible; returns how many."""

    @abstractmethod
    def flush(self) -> bool:
        """Drop every cached prefix (storage backends keep theirs); False while any is in use."""

    def location(self, node: Any) -> str:
        """Where `node`'s keys and values are: DEVICE, HOST or STORAGE."""
        return DEVICE

    def stats(self) -> dict[str, int]:
        """Counters for /metrics and the status call (tier hits, bytes moved)."""
        return {}

    def close(self) -> None:
        """The server is stopping: finish writes still in flight."""


@dataclass(frozen=True)
class HiCacheStorageConfig:
    """What a storage backend is built with.

    `extra_config` is `--hicache-storage-backend-extra-config` parsed (a JSON object; srv's own
    keys such as the prefetch timeouts are in it too). `model_fingerprint` identifies the
    model, its weights, dtype and KV layout: srv already puts it into every key, so a backend
    may use it only to group or name what it stores. `page_bytes` is the size of one stored
    page (a header and the page's keys and values)."""

    extra_config: dict[str, Any] = field(default_factory=dict)
    model_fingerprint: str = ""
    page_bytes: int = 0
    server_args: Any = None


class HiCacheStorage(ABC):
    """A store of KV pages by key, below the host tier of the hierarchical cache (SGLang's
    `HiCacheStorage` operations, on bytes).

    A key is a content hash (hex) of the model and every token up to the end of its page, so
    two servers of the same model sharing a store find each other's pages. A value is opaque
    bytes with srv's own checksum inside: a backend need not check what it returns, and srv
    skips a page that does not verify. srv calls a backend from one I/O thread, never from two
    at once."""

    def __init__(self, config: HiCacheStorageConfig) -> None:
        self.config = config

    @abstractmethod
    def batch_get(self, keys: list[str]) -> list[bytes | None]:
        """Each key's value, or None where the store has none (or cannot read it)."""

    @abstractmethod
    def batch_set(self, keys: list[str], values: list[bytes]) -> list[bool]:
        """Store each value under its key; True where it was stored (an existing key may be
        kept as it is: equal keys mean equal contents)."""

    @abstractmethod
    def batch_exists(self, keys: list[str]) -> list[bool]:
        """Whether each key has a value (cheaper than getting it)."""

    @abstractmethod
    def clear(self) -> None:
        """Remove every page this store holds (the /clear_hicache_storage_backend route)."""

    def close(self) -> None:
        """The server is stopping."""
