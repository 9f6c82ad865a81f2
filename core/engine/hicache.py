"""The hierarchical prefix cache (`--enable-hierarchical-cache`): the radix tree of
`radix_cache.py` over three tiers, the KV pool the model reads, host memory (`host_kv.py`) and
a storage backend plugin (`--hicache-storage-backend`).

A node's pages may be in the pool (`value`), in host memory (`host`) or both. Pool-resident
nodes form the top of the tree: a node is in the pool only if its parent is. Evicting from the
pool keeps a host copy (written when the node was cached under write_through, on its second
hit under write_through_selective, at eviction under write_back) and the node stays in the
tree; a node with no copy left is dropped with what hangs below it. `load_prefix` copies a
matched prefix's host pages back into the pool before the request's prefill.

Every page that gets a host copy is also written to storage under a content key: a hash
chained over the model's fingerprint and every token to the end of the page. When a request
arrives, the pages of its prompt past the tree's match are looked up and fetched on an I/O
thread; `--hicache-storage-prefetch-policy` says whether admission waits for them.
"""

from __future__ import annotations

import hashlib
import heapq
import json
import logging
import struct
import threading
import time
from array import array
import itertools
import queue
from concurrent.futures import Future
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable

import torch

from srv.engine.host_kv import HostKVPool
from srv.engine.memory import PagedSlotAllocator
from srv.engine.radix_cache import RadixCache, TreeNode, split_block_hashes
from srv.sdk.cache import DEVICE, HOST, STORAGE, EvictionPolicy, HiCacheStorage, HiCacheStorageConfig

logger = logging.getLogger("srv.hicache")

WRITE_POLICIES = ("write_back", "write_through", "write_through_selective")
PREFETCH_POLICIES = ("best_effort", "wait_complete", "timeout")
# write_through_selective backs a node up on this many hits (SGLang's threshold).
SELECTIVE_HITS = 2
# SGLang's defaults for the timeout prefetch policy: a base and a share per 1,024 tokens.
PREFETCH_TIMEOUT_BASE_S = 1.0
PREFETCH_TIMEOUT_PER_KI_TOKEN_S = 0.25
# Pages a batch_get or batch_set call takes (a prefetch stops early between batches; reads go
# between batches of writes).
STORAGE_BATCH_PAGES = 64

_tiebreak = iter(range(1 << 62))

# A stored page: magic, payload length, sha256 of the key and payload, then the payload.
_HEADER = struct.Struct("<6s2xQ32s")
_MAGIC = b"SRVKV1"


def seal(key: str, payload: bytes) -> bytes:
    return _HEADER.pack(_MAGIC, len(payload), hashlib.sha256(key.encode() + payload).digest()) + payload


def unseal(key: str, data: bytes | None) -> bytes | None:
    """The payload of a stored page, or None when it is missing, truncated or corrupt."""
    if data is None or len(data) < _HEADER.size:
        return None
    magic, length, digest = _HEADER.unpack_from(data)
    payload = data[_HEADER.size:]
    if magic != _MAGIC or length != len(payload) or hashlib.sha256(key.encode() + payload).digest() != digest:
        return None
    return payload


def page_keys(previous: str, tokens: list[int], page_size: int) -> list[str]:
    """Storage keys of the whole pages of `tokens`, each chained on the one before."""
    keys = []
    for start in range(0, len(tokens) - page_size + 1, page_size):
        previous = hashlib.sha256(previous.encode() + array("q", tokens[start:start + page_size]).tobytes()).hexdigest()
        keys.append(previous)
    return keys


def model_fingerprint(runner: Any, page_size: int) -> str:
    """What makes stored KV pages reusable: the model, its weight files (path, size, modified
    time), dtype, quantization, KV storage format and shapes, and the page size."""
    files = []
    for place in {Path(str(runner.args.model_path)), Path(str(runner.model_dir))}:
        if place.is_file():
            files.append(place)
        elif place.is_dir():
            files += [p for p in place.iterdir() if p.suffix in (".safetensors", ".bin", ".gguf", ".pt", ".pth")]
    stats = sorted((str(p.resolve()), p.stat().st_size, p.stat().st_mtime_ns) for p in files if p.exists())
    kv = runner.kv_cache
    # The layout too: ranks add their partial sums in another order than one process does, so
    # the same tokens' keys and values differ in their last bits from one layout to another.
    parallel = runner.parallel
    parts = [str(runner.model_dir), stats, str(runner.dtype), str(kv.dtype) if kv is not None else "",
             runner.quantization_name, runner.num_layers, runner.total_kv_heads, runner.head_dim, page_size,
             kv.k_scales if kv is not None else [], kv.v_scales if kv is not None else []]
    if parallel.tp_size * parallel.pp_size > 1:
        parts.append([parallel.tp_size, parallel.pp_size])
    return hashlib.sha256(json.dumps(parts, default=str).encode()).hexdigest()


class HiNode(TreeNode):
    def __init__(self, key: list[int], value: torch.Tensor | None, parent: "HiNode | None") -> None:
        super().__init__(key, value, parent)
        self.host: list[int] | None = None   # host pages of its tokens, when it has a copy there
        self.keys: list[str] = []            # storage keys of its pages (with a storage backend)
        self.stored = False                  # its pages were written to storage
        self.pinned = 0                      # being loaded: its host copy must stay
        self.from_storage = False


@dataclass(eq=False)
class Prefetch:
    """Pages of one waiting request's prompt being fetched from storage."""

    start: int                # prompt position of the first page
    keys: list[str]
    deadline: float
    payloads: list[bytes] = field(default_factory=list)   # filled in order by the I/O thread
    done: bool = False
    cancelled: bool = False


class IOThread:
    """One thread running storage calls, reads before writes: a waiting request's pages must not
    queue behind the pages other requests are writing (writes are cut into batches for that)."""

    READ, WRITE = 0, 1

    def __init__(self) -> None:
        self.jobs: queue.PriorityQueue = queue.PriorityQueue()
        self.order = itertools.count()
        self.thread = threading.Thread(target=self._run, name="srv-hicache-io", daemon=True)
        self.thread.start()

    def submit(self, priority: int, function: Callable[..., Any], *args: Any) -> Future:
        future: Future = Future()
        self.jobs.put((priority, next(self.order), function, args, future))
        return future

    def _run(self) -> None:
        while True:
            _, _, function, args, future = self.jobs.get()
            if function is None:
                return
            try:
                future.set_result(function(*args))
            except BaseException as exc:
                future.set_exception(exc)

    def shutdown(self) -> None:
        """Finish every job queued, then stop."""
        self.jobs.put((self.WRITE + 1, next(self.order), None, (), None))
        self.thread.join()


class StorageTier:
    """A storage backend behind one I/O thread: writes queued, prefetches in flight."""

    def __init__(self, backend: HiCacheStorage, prefetch_policy: str, timeout_base: float,
                 timeout_per_ki_token: float) -> None:
        self.backend, self.prefetch_policy = backend, prefetch_policy
        self.timeout_base, self.timeout_per_ki_token = timeout_base, timeout_per_ki_token
        self.io = IOThread()
        self.lock = threading.Lock()
        self.counters = {"storage_read_bytes": 0, "storage_written_bytes": 0, "storage_corrupt_pages": 0,
                         "storage_failed_writes": 0}
        self.prefetches: dict[str, Prefetch] = {}
        self.progress = threading.Event()   # set when a prefetch completes

    def _count(self, name: str, amount: int) -> None:
        with self.lock:
            self.counters[name] += amount

    def write(self, keys: list[str], payloads: list[bytes]) -> None:
        for first in range(0, len(keys), STORAGE_BATCH_PAGES):
            last = first + STORAGE_BATCH_PAGES
            self.io.submit(IOThread.WRITE, self._write, keys[first:last], payloads[first:last])

    def _write(self, keys: list[str], payloads: list[bytes]) -> None:
        try:
            sealed = [seal(k, p) for k, p in zip(keys, payloads)]
            stored = self.backend.batch_set(keys, sealed)
        except Exception:
            logger.exception("hicache storage: writing %d pages failed", len(keys))
            self._count("storage_failed_writes", len(keys))
            return
        self._count("storage_written_bytes", sum(len(s) for s, ok in zip(sealed, stored) if ok))
        self._count("storage_failed_writes", sum(1 for ok in stored if not ok))

    def start(self, rid: str, start: int, keys: list[str]) -> None:
        timeout = self.timeout_base + self.timeout_per_ki_token * len(keys) / 1024
        record = Prefetch(start, keys, time.monotonic() + timeout)
        self.prefetches[rid] = record
        self.io.submit(IOThread.READ, self._fetch, record)

    def _fetch(self, record: Prefetch) -> None:
        try:
            exists = self.backend.batch_exists(record.keys)
            present = next((i for i, ok in enumerate(exists) if not ok), len(exists))
            for first in range(0, present, STORAGE_BATCH_PAGES):
                if record.cancelled:
                    break
                keys = record.keys[first:min(first + STORAGE_BATCH_PAGES, present)]
                for key, data in zip(keys, self.backend.batch_get(keys)):
                    payload = unseal(key, data)
                    if payload is None:
                        if data is not None:
                            logger.warning("hicache storage: page %s does not verify (corrupt or truncated); "
                                           "skipped", key[:16])
                            self._count("storage_corrupt_pages", 1)
                        return
                    self._count("storage_read_bytes", len(data))
                    record.payloads.append(payload)
        except Exception:
            logger.exception("hicache storage: prefetch failed")
        finally:
            record.done = True
            self.progress.set()

    def ready(self, rid: str) -> bool:
        record = self.prefetches.get(rid)
        if record is None or record.done or self.prefetch_policy == "best_effort":
            return True
        return self.prefetch_policy == "timeout" and time.monotonic() >= record.deadline

    def take(self, rid: str) -> Prefetch | None:
        record = self.prefetches.pop(rid, None)
        if record is not None:
            record.cancelled = True
        return record

    def clear(self) -> None:
        self.io.submit(IOThread.WRITE, self.backend.clear).result()   # after the writes queued

    def close(self) -> None:
        self.io.shutdown()
        self.backend.close()


def in_pool(node: HiNode) -> bool:
    return node.value is not None


class HiRadixCache(RadixCache):
    node_class = HiNode
    pool_resident = staticmethod(in_pool)   # match_prefix: the pool's part of a match

    def __init__(self, allocator: PagedSlotAllocator, policy: EvictionPolicy, device: Any,
                 host: HostKVPool, write_policy: str, storage: StorageTier | None,
                 fingerprint: Callable[[], str]) -> None:
        """`device` reads and writes the KV pool's rows of every layer and head (the model
        runner: `read_kv(slots)`, `write_kv(slots, rows)`)."""
        if write_policy not in WRITE_POLICIES:
            raise ValueError(f"--hicache-write-policy {write_policy!r}: one of {', '.join(WRITE_POLICIES)}")
        self.device, self.host, self.write_policy, self.storage = device, host, write_policy, storage
        self.fingerprint = fingerprint
        self.counters = {"device_hit_tokens": 0, "host_hit_tokens": 0, "storage_hit_tokens": 0,
                         "device_to_host_bytes": 0, "host_to_device_bytes": 0}
        super().__init__(allocator, policy)

    def reset(self) -> None:
        super().reset()
        self.root_key = self.fingerprint() if self.storage is not None else ""

    # ---- the tree ------------------------------------------------------------------------

    def _split(self, node: HiNode, at: int) -> HiNode:
        pages = at // self.page_size
        upper = HiNode(node.key[:at], None if node.value is None else node.value[:at], node.parent)
        upper.lock_ref, upper.hit_count, upper.last_access_time = node.lock_ref, node.hit_count, node.last_access_time
        split_block_hashes(node, upper, pages)
        upper.host = None if node.host is None else node.host[:pages]
        upper.keys, upper.stored, upper.pinned = node.keys[:pages], node.stored, node.pinned
        upper.from_storage = node.from_storage
        upper.children[self._child_key(node.key[at:])] = node
        node.parent.children[self._child_key(node.key)] = upper
        node.key, node.parent = node.key[at:], upper
        node.value = None if node.value is None else node.value[at:]
        node.host = None if node.host is None else node.host[pages:]
        node.keys = node.keys[pages:]
        return upper

    def _nodes(self) -> list[HiNode]:
        """Every node but the root."""
        return self._subtree(self.root)[1:]

    def _last_key(self, node: HiNode) -> str:
        return node.keys[-1] if node.keys else self.root_key

    def _detach(self, node: HiNode) -> None:
        """Drop `node` and everything below it (none of it is in the pool)."""
        for n in self._subtree(node):
            if n.host is not None:
                self.host.free(n.host)
                n.host = None
        del node.parent.children[self._child_key(node.key)]

    @staticmethod
    def _subtree(node: HiNode) -> list[HiNode]:
        nodes, stack = [], [node]
        while stack:
            n = stack.pop()
            nodes.append(n)
            stack.extend(n.children.values())
        return nodes

    def location(self, node: HiNode) -> str:
        return DEVICE if node.value is not None else HOST if node.host is not None else STORAGE

    # ---- host copies -----------------------------------------------------------------------

    def _host_room(self, pages: int) -> bool:
        """Free host pages, dropping unused copies in eviction order: the host copy of a node
        that is also in the pool, or a host-only leaf with its node."""
        if self.host.free_pages >= pages:
            return True
        def candidate(n: HiNode) -> bool:
            return n.host is not None and not n.pinned and (n.value is not None or not n.children)
        heap = [(self.policy.eviction_key(n), next(_tiebreak), n) for n in self._nodes() if candidate(n)]
        heapq.heapify(heap)
        while self.host.free_pages < pages and heap:
            _, _, node = heapq.heappop(heap)
            if node.value is not None:
                self.host.free(node.host)
                node.host = None
                continue
            parent = node.parent
            self._detach(node)
            if parent is not self.root and parent.value is None and candidate(parent):
                heapq.heappush(heap, (self.policy.eviction_key(parent), next(_tiebreak), parent))
        return self.host.free_pages >= pages

    def _back_up(self, node: HiNode) -> bool:
        """Copy a pool node's pages to host memory (and on to storage)."""
        if node.host is not None:
            return True
        count = node.num_tokens // self.page_size
        node.pinned += 1
        try:
            if not self._host_room(count):
                return False
        finally:
            node.pinned -= 1
        node.host = self.host.allocate(count)
        self.host.store(node.host, self.device.read_kv(node.value))
        self.counters["device_to_host_bytes"] += count * self.host.page_nbytes
        if self.storage is not None and not node.stored:
            node.stored = True
            self.storage.write(node.keys, [self.host.page_bytes(p) for p in node.host])
        return True

    def insert(self, tokens: list[int], slots: torch.Tensor) -> int:
        node, pos, already = self.root, 0, None
        now = time.monotonic()
        while pos < len(tokens):
            child = node.children.get(self._child_key(tokens[pos:]))
            if child is None:
                leaf = HiNode(tokens[pos:], slots[pos:].clone(), node)
                if self.storage is not None:
                    leaf.keys = page_keys(self._last_key(node), leaf.key, self.page_size)
                node.children[self._child_key(leaf.key)] = leaf
                self.evictable_tokens += leaf.num_tokens
                self._record_stored(leaf)
                if self.write_policy == "write_through":
                    self._back_up(leaf)
                return pos if already is None else already
            common = self._common_pages(child.key, tokens[pos:])
            if common < child.num_tokens:
                child = self._split(child, common)
            if child.value is None:   # held by a lower tier only: the caller's slots join the pool
                child.value = slots[pos:pos + common].clone()
                self.evictable_tokens += common
                self._record_stored(child)
                already = pos if already is None else already
            child.last_access_time = now
            node, pos = child, pos + common
        return pos if already is None else already

    def evict(self, num_tokens: int) -> int:
        """Free pool slots of unlocked nodes with no child in the pool; a node keeps its host copy
        (made now under write_back) and stays matchable, one without a copy is dropped."""
        def candidate(n: HiNode) -> bool:
            return (n is not self.root and n.value is not None and n.lock_ref == 0
                    and all(c.value is None for c in n.children.values()))
        heap = [(self.policy.eviction_key(n), next(_tiebreak), n) for n in self._nodes() if candidate(n)]
        heapq.heapify(heap)
        freed = 0
        while freed < num_tokens and heap:
            _, _, node = heapq.heappop(heap)
            if self.write_policy == "write_back":
                self._back_up(node)
            self.allocator.free_slots(node.value)
            node.value = None
            self._record_removed(node)
            freed += node.num_tokens
            self.evicted_tokens += node.num_tokens
            self.evictable_tokens -= node.num_tokens
            parent = node.parent
            if node.host is None:
                self._detach(node)
            if candidate(parent):
                heapq.heappush(heap, (self.policy.eviction_key(parent), next(_tiebreak), parent))
        return freed

    def flush(self) -> bool:
        if self.protected_tokens:
            return False
        for node in self._nodes():
            if node.value is not None:
                self.allocator.free_slots(node.value)
            if node.host is not None:
                self.host.free(node.host)
        for rid in list(self.storage.prefetches if self.storage is not None else ()):
            self.storage.take(rid)
        self.reset()
        self._record_cleared()
        return True

    # ---- loading back ------------------------------------------------------------------------

    def prefetch(self, rid: str, tokens: list[int]) -> None:
        if self.storage is None:
            return
        node, pos, last = self.root, 0, self.root_key
        while pos < len(tokens):   # how far the tree (any tier) holds the prompt, changing nothing
            child = node.children.get(self._child_key(tokens[pos:]))
            common = 0 if child is None else self._common_pages(child.key, tokens[pos:])
            if common == 0:
                break
            pos, last = pos + common, child.keys[common // self.page_size - 1]
            if common < child.num_tokens:
                break
            node = child
        end = len(tokens) // self.page_size * self.page_size
        if end > pos:
            self.storage.start(rid, pos, page_keys(last, tokens[pos:end], self.page_size))

    def prefetch_ready(self, rid: str) -> bool:
        return self.storage is None or self.storage.ready(rid)

    def forget(self, rid: str) -> None:
        if self.storage is not None:
            self.storage.take(rid)

    def wait_for_prefetch(self, timeout: float) -> None:
        storage = self.storage
        if storage is None or all(record.done for record in storage.prefetches.values()):
            return
        storage.progress.wait(timeout)
        storage.progress.clear()

    def _from_storage(self, rid: str | None, tokens: list[int], path: list[HiNode]) -> HiNode | None:
        """A host node under the path's end holding the pages prefetched for `rid`."""
        record = self.storage.take(rid) if self.storage is not None and rid is not None else None
        if record is None:
            return None
        matched = sum(n.num_tokens for n in path)
        if matched < record.start:
            return None   # the tree lost what the fetched pages continue
        skip = (matched - record.start) // self.page_size
        usable = len(tokens) // self.page_size * self.page_size
        payloads = record.payloads[skip:][:max(0, (usable - matched) // self.page_size)]
        if not payloads or not self._host_room(len(payloads)):
            return None
        parent = path[-1] if path else self.root
        node = HiNode(tokens[matched:matched + len(payloads) * self.page_size], None, parent)
        node.host = self.host.allocate(len(payloads))
        for page, payload in zip(node.host, payloads):
            self.host.set_page_bytes(page, payload)
        node.keys, node.stored, node.from_storage = record.keys[skip:skip + len(payloads)], True, True
        parent.children[self._child_key(node.key)] = node
        return node

    def load_prefix(self, tokens: list[int], rid: str | None = None) -> tuple[torch.Tensor, HiNode]:
        path = self._walk(tokens)
        for node in path:
            node.pinned += 1
        locked: list[HiNode] = []
        try:
            fetched = self._from_storage(rid, tokens, path)
            if fetched is not None:
                fetched.pinned += 1
                path.append(fetched)
            in_pool = next((i for i, n in enumerate(path) if n.value is None), len(path))
            self.counters["device_hit_tokens"] += sum(n.num_tokens for n in path[:in_pool])
            if self.write_policy == "write_through_selective":
                for node in path[:in_pool]:
                    if node.hit_count >= SELECTIVE_HITS:
                        self._back_up(node)
            # Making room in the pool must not evict what this match holds or has loaded.
            locked = path[:in_pool][-1:]
            for node in locked:
                self.lock(node)
            for node in path[in_pool:]:
                if not self._load(node):
                    break
                self.lock(node)
                locked.append(node)
                in_pool += 1
        finally:
            for node in locked:
                self.unlock(node)
            for node in path:
                node.pinned -= 1
        return self._slots_of(path[:in_pool])

    def _load(self, node: HiNode) -> bool:
        """Copy a host node's pages into the pool."""
        count = node.num_tokens
        if self.allocator.free_tokens < count:
            self.evict(count - self.allocator.free_tokens)
        if self.allocator.free_tokens < count:
            return False
        pages = torch.tensor(self.allocator.allocate_pages(count // self.page_size))
        slots = (pages[:, None] * self.page_size + torch.arange(self.page_size)[None, :]).flatten()
        self.device.write_kv(slots, self.host.rows(node.host))
        node.value = slots
        self.evictable_tokens += count
        self._record_stored(node)
        self.counters["host_to_device_bytes"] += count // self.page_size * self.host.page_nbytes
        self.counters["storage_hit_tokens" if node.from_storage else "host_hit_tokens"] += count
        node.from_storage = False
        return True

    def stats(self) -> dict[str, int]:
        host_used = (self.host.num_pages - self.host.free_pages) * self.page_size
        out = {**self.counters, "host_tokens_in_use": host_used, "host_capacity_tokens": self.host.capacity_tokens}
        if self.storage is not None:
            with self.storage.lock:
                out.update(self.storage.counters)
        return out

    def clear_storage(self) -> None:
        if self.storage is None:
            raise ValueError("no --hicache-storage-backend is configured")
        self.storage.clear()
        for node in self._nodes():
            node.stored = False

    def close(self) -> None:
        if self.storage is not None:
            self.storage.close()


def hicache_extra_config(args: Any) -> dict[str, Any]:
    raw = args.hicache_storage_backend_extra_config
    if not raw:
        return {}
    try:
        config = json.loads(raw)
    except json.JSONDecodeError as exc:
        raise ValueError(f"--hicache-storage-backend-extra-config is not JSON: {exc}") from None
    if not isinstance(config, dict):
        raise ValueError("--hicache-storage-backend-extra-config must be a JSON object")
    return config


def make_prefix_cache(args: Any, runner: Any, allocator: PagedSlotAllocator, registry: Any) -> RadixCache | None:
    """The prefix cache the flags ask for: none, the radix cache, or the hierarchical one."""
    hierarchical = bool(args.enable_hierarchical_cache)
    if args.hicache_storage_backend and not hierarchical:
        raise ValueError("--hicache-storage-backend needs --enable-hierarchical-cache")
    if args.disable_radix_cache or runner.is_embedding:
        if hierarchical:
            raise ValueError("--enable-hierarchical-cache needs the prefix cache: drop --disable-radix-cache"
                             if args.disable_radix_cache else "an embedding model keeps no prefix cache to tier")
        return None
    policy = registry.choose("eviction_policy", args.radix_eviction_policy).create()
    if not hierarchical:
        return RadixCache(allocator, policy)
    if args.hicache_io_backend == "kernel_ascend":
        raise ValueError("--hicache-io-backend kernel_ascend copies with Ascend NPU kernels; this server's KV pool "
                         "is in host memory: use direct (or kernel, the default)")
    if args.hicache_storage_prefetch_policy not in PREFETCH_POLICIES:
        raise ValueError(f"--hicache-storage-prefetch-policy: one of {', '.join(PREFETCH_POLICIES)}")
    kv = runner.kv_cache
    page_size = allocator.page_size
    # The host tier holds every layer and head, whichever share of them this rank's pool holds.
    layers, heads = runner.num_layers, runner.total_kv_heads
    token_bytes = 2 * layers * heads * runner.head_dim * kv.k_buffers[0].element_size()
    if args.hicache_size and args.hicache_size > 0:
        pages = int(args.hicache_size * 2**30 // (token_bytes * page_size))
    else:
        if not args.hicache_ratio > 0:
            raise ValueError("--hicache-ratio must be positive (host tier size / KV pool size)")
        pages = int(allocator.capacity_tokens * args.hicache_ratio) // page_size
    if pages < 1:
        raise ValueError("the hierarchical cache's host tier would hold no page: raise --hicache-ratio or --hicache-size")
    host = HostKVPool(pages, page_size, layers, heads, runner.head_dim, kv.dtype, args.hicache_mem_layout)
    fingerprint = lambda: model_fingerprint(runner, page_size)  # noqa: E731 (read again after a weight update)
    storage = None
    if args.hicache_storage_backend:
        extra = hicache_extra_config(args)
        config = HiCacheStorageConfig(extra, fingerprint(), host.page_nbytes + _HEADER.size, args)
        backend = registry.choose("hicache_storage", args.hicache_storage_backend).create(config)
        storage = StorageTier(backend, args.hicache_storage_prefetch_policy,
                              float(extra.get("prefetch_timeout_base", PREFETCH_TIMEOUT_BASE_S)),
                              float(extra.get("prefetch_timeout_per_ki_token", PREFETCH_TIMEOUT_PER_KI_TOKEN_S)))
    logger.info("hierarchical cache: host tier of %d tokens (%.1f MiB, %s, %s)%s", pages * page_size,
                pages * host.page_nbytes / 2**20, args.hicache_mem_layout, args.hicache_write_policy,
                f", storage {args.hicache_storage_backend}" if storage else "")
    return HiRadixCache(allocator, policy, runner, host, args.hicache_write_policy, storage, fingerprint)
