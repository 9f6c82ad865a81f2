"""C kernels for plugins: compiled on first use with the machine's C compiler, loaded with ctypes.

    library = load_c_library(Path(__file__).with_name("kernels.c"), ["-mavx2", "-mfma"])
    library.my_kernel(x.data_ptr(), ...)

The shared object is cached under `kernels` in srv's cache root (`srv.sdk.paths`), or in
$SRV_KERNEL_CACHE, keyed by the source, the flags and the compiler, so later launches load it in
milliseconds. `-fopenmp` is always passed: a kernel's `#pragma omp parallel` runs in the OpenMP
runtime torch has loaded, on torch's threads, with torch's thread count.
"""

from __future__ import annotations

import ctypes
import functools
import hashlib
import logging
import os
import shutil
import subprocess
from pathlib import Path

from srv.sdk.paths import cache_root, write_atomically

logger = logging.getLogger("srv.native")

BASE_FLAGS = ["-O3", "-shared", "-fPIC", "-fopenmp", "-std=c11"]


class NativeBuildError(RuntimeError):
    """No C compiler, or the source did not compile; the message says which and why."""


def compiler() -> str | None:
    return os.environ.get("CC") or shutil.which("cc") or shutil.which("gcc") or shutil.which("clang")


def cache_dir() -> Path:
    return Path(os.environ.get("SRV_KERNEL_CACHE") or cache_root() / "kernels")


@functools.cache
def load_c_library(source: Path, flags: tuple[str, ...] = ()) -> ctypes.CDLL:
    """Compile `source` (once per machine) and load it; raises NativeBuildError."""
    cc = compiler()
    if cc is None:
        raise NativeBuildError("no C compiler found (set CC, or install cc, gcc or clang)")
    command = [cc, *BASE_FLAGS, *flags]
    key = hashlib.sha256("\0".join([source.read_text(), *command]).encode()).hexdigest()[:16]
    target = cache_dir() / f"{source.stem}-{key}.so"
    if not target.exists():
        def build(output: Path) -> None:
            result = subprocess.run([*command, str(source), "-o", str(output)], capture_output=True, text=True)
            if result.returncode != 0:
                raise NativeBuildError(f"{' '.join(command)} {source} failed:\n{result.stderr.strip()}")

        write_atomically(target, build)   # a concurrent process never loads half a file
        logger.info("compiled %s into %s", source.name, target)
    return ctypes.CDLL(str(target))
