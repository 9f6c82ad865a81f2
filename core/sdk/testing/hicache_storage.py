"""Conformance kit for hierarchical-cache storage backends (`--hicache-storage-backend`)."""

from __future__ import annotations

import hashlib
import random
from contextlib import contextmanager
from pathlib import Path
from typing import Callable, Iterator

import pytest

from srv.sdk.cache import HiCacheStorage, HiCacheStorageConfig
from srv.sdk.testing.registry import create

#: The page size the kit's default config names (srv's are a header and a page of KV).
PAGE_BYTES = 1 << 20


def page_key(tag: str, index: int) -> str:
    """A key as srv makes them: a sha256 hexdigest (64 lowercase hex characters)."""
    return hashlib.sha256(f"srv-kit:{tag}:{index}".encode()).hexdigest()


def page_keys(tag: str, count: int) -> list[str]:
    return [page_key(tag, i) for i in range(count)]


def page_value(seed: int, size: int) -> bytes:
    """`size` random bytes (zeros included) of `seed`."""
    return random.Random(seed).randbytes(size)


def _check_lengths(what: str, keys: list[str], results: object) -> list:
    assert isinstance(results, list), f"{what} returned {type(results).__name__}, not a list"
    assert len(results) == len(keys), f"{what} of {len(keys)} keys returned {len(results)} results"
    return results


def _as_bytes(key: str, value: object) -> bytes | None:
    if value is None:
        return None
    assert isinstance(value, (bytes, bytearray, memoryview)), \
        f"batch_get returned {type(value).__name__} for key {key[:16]}..., not bytes or None"
    return bytes(value)


class HiCacheStorageKit:
    """Checks a hierarchical-cache storage backend: pages set by key come back byte for byte,
    unknown keys give None (and False from batch_exists) in their place, every result list
    is as long as its keys and in their order, `clear` removes every page and leaves the store
    usable, and a second instance built with the same config finds the first one's pages (as
    srv does after a restart). Keys are sha256 hexdigests, as srv's are.

        class TestMyStore(HiCacheStorageKit):
            backend_name = "mystore"          # the name your plugin registers, or:
            # storage_factory = MyStore       # (HiCacheStorageConfig) -> HiCacheStorage
            # persistent = False              # an in-memory store: skip the restart check

    The config of each test is `make_config(tmp_path)`: its extra config's `storage_dir` is a
    fresh directory; override it for a backend that needs other keys.
    """

    backend_name: str | None = None
    storage_factory: Callable[[HiCacheStorageConfig], HiCacheStorage] | None = None
    #: Whether pages outlive the instance that wrote them (a new instance of the same config sees them).
    persistent: bool = True

    def make_config(self, tmp_path: Path) -> HiCacheStorageConfig:
        """The config of a test's storages: `storage_dir` in `tmp_path`, pages of PAGE_BYTES."""
        return HiCacheStorageConfig(extra_config={"storage_dir": str(Path(tmp_path) / "store")},
                                    model_fingerprint="kit", page_bytes=PAGE_BYTES)

    def make_storage(self, config: HiCacheStorageConfig) -> HiCacheStorage:
        """`storage_factory(config)`, else the registered backend `backend_name` built with it."""
        storage = create(self, "hicache_storage", "backend_name", "storage_factory", config)
        assert isinstance(storage, HiCacheStorage), \
            f"the factory returned {type(storage).__name__}, not a srv.sdk.cache.HiCacheStorage"
        return storage

    @contextmanager
    def opened(self, config: HiCacheStorageConfig) -> Iterator[HiCacheStorage]:
        """A storage of `config`, closed (as srv closes it when stopping) at the end of the block."""
        storage = self.make_storage(config)
        try:
            yield storage
        finally:
            storage.close()

    def set(self, storage: HiCacheStorage, keys: list[str], values: list[bytes]) -> list[bool]:
        """`batch_set`, checked to return a list of bools as long as `keys`."""
        stored = _check_lengths("batch_set", keys, storage.batch_set(keys, values))
        assert all(ok is True or ok is False for ok in stored), f"batch_set returned {stored!r}, not bools"
        return stored

    def get(self, storage: HiCacheStorage, keys: list[str]) -> list[bytes | None]:
        """`batch_get`, checked to return a list of bytes or None as long as `keys`."""
        values = _check_lengths("batch_get", keys, storage.batch_get(keys))
        return [_as_bytes(key, value) for key, value in zip(keys, values)]

    def exists(self, storage: HiCacheStorage, keys: list[str]) -> list[bool]:
        """`batch_exists`, checked to return a list as long as `keys`."""
        found = _check_lengths("batch_exists", keys, storage.batch_exists(keys))
        return [bool(ok) for ok in found]

    # ---- the tests -------------------------------------------------------------------------

    def test_set_then_get_round_trips_bytes(self, tmp_path: Path) -> None:
        """Values of 1 byte to a page (and more), binary with zeros, come back exactly."""
        config = self.make_config(tmp_path)
        values = [b"\x00", b"x", b"\x00srv\x00\xff\x00", bytes(range(256)) * 16, bytes(4096),
                  page_value(0, 1 << 20), page_value(1, config.page_bytes or 4096)]
        keys = page_keys("round-trip", len(values))
        with self.opened(config) as storage:
            assert self.set(storage, keys, values) == [True] * len(keys), "batch_set refused a value"
            got = self.get(storage, keys)
            for key, value, back in zip(keys, values, got):
                assert back is not None, f"key {key[:16]}... was set, batch_get gave None"
                assert len(back) == len(value), f"a value of {len(value)} bytes came back as {len(back)} bytes"
                assert back == value, f"a value of {len(value)} bytes came back with other bytes"
            assert self.exists(storage, keys) == [True] * len(keys)

    def test_unknown_keys_give_none_in_their_place(self, tmp_path: Path) -> None:
        """A batch of known and unknown keys: values where set, None (and False) elsewhere."""
        known, unknown = page_keys("known", 3), page_keys("unknown", 3)
        values = [page_value(10 + i, 1000 + i) for i in range(3)]
        with self.opened(self.make_config(tmp_path)) as storage:
            assert self.get(storage, unknown) == [None] * 3, "an empty store gave a value"
            assert self.exists(storage, unknown) == [False] * 3, "an empty store has a key"
            self.set(storage, known, values)
            mixed = [known[0], unknown[0], known[1], unknown[1], unknown[2], known[2]]
            expected = [values[0], None, values[1], None, None, values[2]]
            assert self.get(storage, mixed) == expected, "batch_get of known and unknown keys"
            assert self.exists(storage, mixed) == [v is not None for v in expected], \
                "batch_exists of known and unknown keys"

    def test_exists_matches_what_was_set_in_order(self, tmp_path: Path) -> None:
        """batch_exists says, key by key and in the keys' order (repeats too), what was set."""
        keys = page_keys("exists", 30)
        chosen = keys[::3]
        with self.opened(self.make_config(tmp_path)) as storage:
            self.set(storage, chosen, [page_value(i, 64) for i in range(len(chosen))])
            order = keys[:]
            random.Random(0).shuffle(order)
            assert self.exists(storage, order) == [k in chosen for k in order], \
                "batch_exists does not say, key by key and in order, what was set"
            assert self.exists(storage, [chosen[0]] * 3 + [keys[1]] * 2) == [True] * 3 + [False] * 2, \
                "batch_exists of repeated keys"

    def test_setting_an_existing_key_again(self, tmp_path: Path) -> None:
        """A key set again stays readable, with a value that was written.

        Equal keys mean equal contents, so srv writes the same bytes again: that reports the
        page stored (True), whether the store rewrites it or keeps what it has."""
        key, first, second = page_key("again", 0), page_value(20, 5000), page_value(21, 5000)
        with self.opened(self.make_config(tmp_path)) as storage:
            assert self.set(storage, [key], [first]) == [True]
            assert self.set(storage, [key], [first]) == [True], \
                "setting a key again with the same bytes did not report it stored (srv counts a failed write)"
            assert self.get(storage, [key]) == [first]
            self.set(storage, [key], [second])
            assert self.get(storage, [key])[0] in (first, second), "a key set twice gave neither value"
            assert self.exists(storage, [key]) == [True]

    def test_clear_removes_everything_and_the_store_works_after(self, tmp_path: Path) -> None:
        """After clear() no key exists or gives a value; the store then takes pages again."""
        keys = page_keys("clear", 10)
        values = [page_value(30 + i, 2000) for i in range(10)]
        with self.opened(self.make_config(tmp_path)) as storage:
            self.set(storage, keys, values)
            assert storage.clear() is None
            assert self.exists(storage, keys) == [False] * 10, "clear() left keys"
            assert self.get(storage, keys) == [None] * 10, "clear() left values"
            storage.clear()  # clearing an empty store is fine too
            assert self.set(storage, keys[:4], values[:4]) == [True] * 4, "the store refuses writes after clear()"
            assert self.get(storage, keys) == values[:4] + [None] * 6
            assert self.exists(storage, keys) == [True] * 4 + [False] * 6

    def test_a_new_instance_of_the_same_config_finds_the_pages(self, tmp_path: Path) -> None:
        """srv restarting (or a second server of the same model) finds what was stored."""
        if not self.persistent:
            pytest.skip("the store keeps its pages in memory (persistent = False)")
        config = self.make_config(tmp_path)
        keys = page_keys("restart", 20)
        values = [page_value(40 + i, 3000 + i) for i in range(20)]
        with self.opened(config) as first:
            self.set(first, keys[:12], values[:12])
        with self.opened(config) as second:
            assert self.exists(second, keys) == [True] * 12 + [False] * 8, \
                "a new instance of the same config does not find the first one's pages"
            assert self.get(second, keys) == values[:12] + [None] * 8

    def test_batches_of_a_hundred_keys(self, tmp_path: Path) -> None:
        """Batches of 100 pages (and 200 known and unknown keys, interleaved) work."""
        keys, others = page_keys("hundred", 100), page_keys("hundred-unset", 100)
        values = [page_value(100 + i, 4096) for i in range(100)]
        with self.opened(self.make_config(tmp_path)) as storage:
            assert self.set(storage, keys, values) == [True] * 100
            assert self.exists(storage, keys) == [True] * 100
            assert self.get(storage, keys) == values
            mixed = [k for pair in zip(keys, others) for k in pair]
            assert self.exists(storage, mixed) == [True, False] * 100
            assert self.get(storage, mixed) == [v for value in values for v in (value, None)]

    def test_empty_batches_give_empty_lists(self, tmp_path: Path) -> None:
        """Each call takes an empty batch and returns an empty list."""
        with self.opened(self.make_config(tmp_path)) as storage:
            assert self.set(storage, [], []) == []
            assert self.get(storage, []) == []
            assert self.exists(storage, []) == []
