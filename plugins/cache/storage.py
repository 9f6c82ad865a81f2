"""Hierarchical-cache storage backends (`--hicache-storage-backend`).

`file` keeps one file a page in a directory (the extra config's `storage_dir`, else
SGLANG_HICACHE_FILE_BACKEND_STORAGE_DIR, else /tmp/hicache), written to a temporary name and
renamed, so a reader never sees half a page; it survives restarts, and servers of the same
model sharing the directory share their pages. `dynamic` loads the class the extra config
names. The distributed stores SGLang offers need their services and clients.
"""

from __future__ import annotations

import importlib
import os
import tempfile
from pathlib import Path

from srv.sdk.cache import HiCacheStorage, HiCacheStorageConfig

DEFAULT_FILE_DIR = "/tmp/hicache"


class FileStorage(HiCacheStorage):
    def __init__(self, config: HiCacheStorageConfig) -> None:
        super().__init__(config)
        place = (config.extra_config.get("storage_dir") or os.environ.get("SGLANG_HICACHE_FILE_BACKEND_STORAGE_DIR")
                 or DEFAULT_FILE_DIR)
        self.root = Path(place)
        self.root.mkdir(parents=True, exist_ok=True)

    def _path(self, key: str) -> Path:
        if not key or not all(c.isalnum() or c in "-_" for c in key):
            raise ValueError(f"a storage key must be letters, digits, - and _: {key!r}")
        return self.root / f"{key}.kv"

    def batch_get(self, keys: list[str]) -> list[bytes | None]:
        values: list[bytes | None] = []
        for key in keys:
            try:
                values.append(self._path(key).read_bytes())
            except OSError:
                values.append(None)
        return values

    def batch_set(self, keys: list[str], values: list[bytes]) -> list[bool]:
        stored = []
        for key, value in zip(keys, values):
            target, temporary = self._path(key), None
            try:
                handle, temporary = tempfile.mkstemp(dir=self.root, prefix=".", suffix=".part")
                with os.fdopen(handle, "wb") as out:
                    out.write(value)
                os.replace(temporary, target)
                stored.append(True)
            except OSError:
                if temporary is not None:
                    Path(temporary).unlink(missing_ok=True)
                stored.append(False)
        return stored

    def batch_exists(self, keys: list[str]) -> list[bool]:
        return [self._path(key).is_file() for key in keys]

    def clear(self) -> None:
        for path in [*self.root.glob("*.kv"), *self.root.glob(".*.part")]:
            path.unlink(missing_ok=True)


def DynamicStorage(config: HiCacheStorageConfig) -> HiCacheStorage:
    """The backend class named by the extra config's module_path and class_name."""
    extra = config.extra_config
    missing = [k for k in ("module_path", "class_name") if not extra.get(k)]
    if missing:
        raise ValueError("--hicache-storage-backend dynamic needs " + " and ".join(missing) +
                         " in --hicache-storage-backend-extra-config")
    try:
        cls = getattr(importlib.import_module(extra["module_path"]), extra["class_name"])
    except Exception as exc:   # whatever importing the named module raises
        raise ValueError(f"--hicache-storage-backend dynamic: cannot load {extra['module_path']}."
                         f"{extra['class_name']}: {exc}") from None
    if not (isinstance(cls, type) and issubclass(cls, HiCacheStorage)):
        raise ValueError(f"--hicache-storage-backend dynamic: {extra['module_path']}.{extra['class_name']} is not a "
                         "subclass of srv.sdk.cache.HiCacheStorage")
    return cls(config)


def service_storage(config: HiCacheStorageConfig) -> HiCacheStorage:
    """A distributed store registered by name only; its availability check says what it needs."""
    raise RuntimeError("this storage backend is not available here")
