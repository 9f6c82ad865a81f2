"""The prefix cache: a radix tree over token ids whose nodes own the KV slots of their tokens.

Keys are whole pages (`page_size` tokens), so every node's slots are whole pages and a match
is always page-aligned. A node in use by a running request is locked (a reference count on it
and its ancestors) and never evicted; unlocked leaves are evicted in the order the eviction
policy plugin gives.

Under `--kv-events-config` (`events` set) the cache records what enters and leaves the KV pool
as srv.sdk.kv_events events, its pages as blocks; the scheduler takes them after each step.
"""

from __future__ import annotations

import heapq
import itertools
import time
from typing import Callable

import torch

from srv.engine.memory import PagedSlotAllocator
from srv.sdk.cache import EvictionPolicy, PrefixCache
from srv.sdk.kv_events import AllBlocksCleared, BlockRemoved, BlockStored, KVCacheEvent, block_hashes

_tiebreak = itertools.count()


class TreeNode:
    def __init__(self, key: list[int], value: torch.Tensor, parent: "TreeNode | None") -> None:
        self.key = key
        self.value = value
        self.parent = parent
        self.children: dict[tuple[int, ...], TreeNode] = {}
        self.lock_ref = 0
        self.hit_count = 0
        self.last_access_time = time.monotonic()
        self.block_hashes: list[int] | None = None   # its pages' (srv.sdk.kv_events), once asked for

    @property
    def num_tokens(self) -> int:
        return len(self.key)


class RadixCache(PrefixCache):
    node_class = TreeNode

    # The KV events recorded since the scheduler last took them (None: not recorded).
    events: list[KVCacheEvent] | None = None

    def __init__(self, allocator: PagedSlotAllocator, policy: EvictionPolicy) -> None:
        self.allocator = allocator
        self.page_size = allocator.page_size
        self.policy = policy
        self.evicted_tokens = 0
        self.reset()

    def reset(self) -> None:
        self.root = self.node_class([], torch.empty(0, dtype=torch.int64), None)
        self.root.lock_ref = 1
        self.root.block_hashes = []
        self.evictable_tokens = 0
        self.protected_tokens = 0

    # ---- KV events -------------------------------------------------------------------------

    def _hashes(self, node: TreeNode) -> list[int]:
        if node.block_hashes is None:
            parent = self._hashes(node.parent)
            node.block_hashes = block_hashes(parent[-1] if parent else None, node.key, self.page_size)
        return node.block_hashes

    def _record_stored(self, node: TreeNode) -> None:
        """`node`'s pages entered the KV pool."""
        if self.events is not None:
            parent = self._hashes(node.parent)
            self.events.append(BlockStored(self._hashes(node), parent[-1] if parent else None, list(node.key),
                                           self.page_size, None, None))

    def _record_removed(self, node: TreeNode) -> None:
        """`node`'s pages left the KV pool."""
        if self.events is not None:
            self.events.append(BlockRemoved(self._hashes(node), None))

    def _record_cleared(self) -> None:
        if self.events is not None:
            self.events.append(AllBlocksCleared())

    def take_events(self) -> list[KVCacheEvent]:
        events, self.events = self.events or [], [] if self.events is not None else None
        return events

    def _child_key(self, tokens: list[int]) -> tuple[int, ...]:
        return tuple(tokens[: self.page_size])

    def _common_pages(self, a: list[int], b: list[int]) -> int:
        n = 0
        for x, y in zip(a, b):
            if x != y:
                break
            n += 1
        return n // self.page_size * self.page_size

    def _split(self, node: TreeNode, at: int) -> TreeNode:
        """Cut `node` after `at` tokens; returns the new upper part."""
        upper = self.node_class(node.key[:at], node.value[:at], node.parent)
        upper.lock_ref, upper.hit_count, upper.last_access_time = node.lock_ref, node.hit_count, node.last_access_time
        split_block_hashes(node, upper, at // self.page_size)
        upper.children[self._child_key(node.key[at:])] = node
        node.parent.children[self._child_key(node.key)] = upper
        node.key, node.value, node.parent = node.key[at:], node.value[at:], upper
        return upper

    # Which nodes a match may enter (None: every node); the hierarchical cache's stop at the pool.
    pool_resident: Callable[[TreeNode], bool] | None = None

    def match_prefix(self, tokens: list[int]) -> tuple[torch.Tensor, TreeNode]:
        """The slots of the longest cached page-aligned prefix of `tokens`, and its last node."""
        return self._slots_of(self._walk(tokens, self.pool_resident))

    def _slots_of(self, path: list[TreeNode]) -> tuple[torch.Tensor, TreeNode]:
        slots = torch.cat([n.value for n in path]) if path else torch.empty(0, dtype=torch.int64)
        return slots, path[-1] if path else self.root

    def _walk(self, tokens: list[int], enters: Callable[[TreeNode], bool] | None = None) -> list[TreeNode]:
        """The nodes matching `tokens` from the root, split at the match's end (and not past a
        node `enters` refuses); each counts a hit."""
        node, pos, path = self.root, 0, []
        now = time.monotonic()
        while pos < len(tokens):
            child = node.children.get(self._child_key(tokens[pos:]))
            if child is None or (enters is not None and not enters(child)):
                break
            common = self._common_pages(child.key, tokens[pos:])
            if common == 0:
                break
            if common < child.num_tokens:
                child = self._split(child, common)
            child.last_access_time, child.hit_count = now, child.hit_count + 1
            path.append(child)
            node, pos = child, pos + common
        return path

    def insert(self, tokens: list[int], slots: torch.Tensor) -> int:
        """Cache `tokens` (page-aligned length) with their slots; returns how many leading
        tokens were cached already (the caller frees its own copies of those)."""
        node, pos = self.root, 0
        now = time.monotonic()
        while pos < len(tokens):
            child = node.children.get(self._child_key(tokens[pos:]))
            if child is None:
                leaf = self.node_class(tokens[pos:], slots[pos:].clone(), node)
                node.children[self._child_key(leaf.key)] = leaf
                self.evictable_tokens += leaf.num_tokens
                self._record_stored(leaf)
                return pos
            common = self._common_pages(child.key, tokens[pos:])
            if common < child.num_tokens:
                child = self._split(child, common)
            child.last_access_time = now
            node, pos = child, pos + common
        return pos

    def lock(self, node: TreeNode) -> None:
        while node is not self.root:
            if node.lock_ref == 0:
                self.evictable_tokens -= node.num_tokens
                self.protected_tokens += node.num_tokens
            node.lock_ref += 1
            node = node.parent

    def unlock(self, node: TreeNode) -> None:
        while node is not self.root:
            node.lock_ref -= 1
            if node.lock_ref == 0:
                self.evictable_tokens += node.num_tokens
                self.protected_tokens -= node.num_tokens
            node = node.parent

    def evict(self, num_tokens: int) -> int:
        """Free at least `num_tokens` slots of unlocked leaves if possible; returns how many."""
        heap = [(self.policy.eviction_key(n), next(_tiebreak), n) for n in self._unlocked_leaves()]
        heapq.heapify(heap)
        freed = 0
        while freed < num_tokens and heap:
            _, _, leaf = heapq.heappop(heap)
            self.allocator.free_slots(leaf.value)
            self._record_removed(leaf)
            freed += leaf.num_tokens
            self.evicted_tokens += leaf.num_tokens
            self.evictable_tokens -= leaf.num_tokens
            parent = leaf.parent
            del parent.children[self._child_key(leaf.key)]
            if parent is not self.root and not parent.children and parent.lock_ref == 0:
                heapq.heappush(heap, (self.policy.eviction_key(parent), next(_tiebreak), parent))
        return freed

    def _unlocked_leaves(self) -> list[TreeNode]:
        leaves, stack = [], [self.root]
        while stack:
            node = stack.pop()
            if not node.children and node.lock_ref == 0:
                leaves.append(node)
            stack.extend(node.children.values())
        return leaves

    def flush(self) -> bool:
        """Drop every cached prefix; refused (False) while any is in use."""
        if self.protected_tokens:
            return False
        self.evict(self.evictable_tokens)
        self.reset()
        self._record_cleared()
        return True


def split_block_hashes(lower: TreeNode, upper: TreeNode, pages: int) -> None:
    """A node cut in two (`upper` its first `pages` pages): each keeps its own pages' hashes."""
    if lower.block_hashes is not None:
        upper.block_hashes, lower.block_hashes = lower.block_hashes[:pages], lower.block_hashes[pages:]
