"""C kernels for plugins: compiled on first use with the machine's C compiler, loaded with ctypes.

    library = load_c_library(Path(__file__).with_name("kernels.c"), ["-mavx2", "-mfma"])
    library.my_kernel(x.data_ptr(), ...)

`NativeKernel` hands a kernel from one plugin to another (a quantized layer's product, a decode
attention) so that a model can call it from C.

The shared object is cached under `kernels` in srv's cache root (`srv.sdk.paths`), or in
$SRV_KERNEL_CACHE, keyed by the source, the flags, the compiler and srv.sdk's C headers, so later
launches load it in milliseconds. `-fopenmp` is always passed: a kernel's `#pragma omp parallel`
runs in the OpenMP runtime torch has loaded, on torch's threads, with torch's thread count.

srv.sdk's C headers are on the include path. `#include "srv_amx.h"` gives a kernel AMX's tiles:
whether the CPU has them and the OS lends them (`srv_amx_usable`), their configuration
(`srv_amx_configure`), a 16 x 16 transpose of 32-bit values, and activation rows laid out as the
tiles' second operand (`srv_amx_pack_rows`). `#include "srv_kv_formats.h"` gives the KV cache's
formats as kernels number them (`KVCache.dtype`: float32, bf16, float16, float8 e4m3fn and e5m2)
and float8's codes: each code's value, a row widened with its layer's scale, and a value rounded
to the nearest code as torch rounds it.
"""

from __future__ import annotations

import ctypes
import functools
import hashlib
import logging
import os
import shutil
import subprocess
from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

from srv.sdk.paths import cache_root, write_atomically

if TYPE_CHECKING:   # torch is imported where a kernel is called: availability checks import this module
    import torch

logger = logging.getLogger("srv.native")

BASE_FLAGS = ["-O3", "-shared", "-fPIC", "-fopenmp", "-std=c11"]
# The C headers srv.sdk gives kernels (`#include "srv_amx.h"`): this folder is on every build's
# include path, and their text is part of every build's cache key.
HEADERS_DIR = Path(__file__).parent


class NativeBuildError(RuntimeError):
    """No C compiler, or the source did not compile; the message says which and why."""


def compiler() -> str | None:
    return os.environ.get("CC") or shutil.which("cc") or shutil.which("gcc") or shutil.which("clang")


def cache_dir() -> Path:
    return Path(os.environ.get("SRV_KERNEL_CACHE") or cache_root() / "kernels")


@functools.cache
def load_c_library(source: Path, flags: tuple[str, ...] = ()) -> ctypes.CDLL:
    """Compile `source` (once per machine) and load it; raises NativeBuildError. srv.sdk's C
    headers are on its include path: `#include "srv_amx.h"` for AMX's tiles."""
    cc = compiler()
    if cc is None:
        raise NativeBuildError("no C compiler found (set CC, or install cc, gcc or clang)")
    command = [cc, *BASE_FLAGS, f"-I{HEADERS_DIR}", *flags]
    headers = [h.read_text() for h in sorted(HEADERS_DIR.glob("*.h"))]
    key = hashlib.sha256("\0".join([source.read_text(), *headers, *command]).encode()).hexdigest()[:16]
    target = cache_dir() / f"{source.stem}-{key}.so"
    if not target.exists():
        def build(output: Path) -> None:
            result = subprocess.run([*command, str(source.resolve()), "-o", str(output)], capture_output=True, text=True)
            if result.returncode != 0:
                raise NativeBuildError(f"{' '.join(command)} {source} failed:\n{result.stderr.strip()}")

        write_atomically(target, build)   # a concurrent process never loads half a file
        logger.info("compiled %s into %s", source.name, target)
    return ctypes.CDLL(str(target))


def optional_c_library(source: Path, flags: tuple[str, ...] = (), without: str | None = None) -> ctypes.CDLL | None:
    """load_c_library's library, or None (logged) where it cannot be built.

    `without` says what runs instead (torch's operators, say): the warning names the build's error
    and it, and the caller takes that path."""
    try:
        return load_c_library(source, flags)
    except NativeBuildError as exc:
        logger.warning("%s; %s", exc, without or f"{source.name} is not used")
        return None


def pick_isa(ladder: dict[str, tuple[str, ...]], override: str) -> str:
    """The first of `ladder`'s kernel bodies (fastest first, each with the CPU flags it needs as
    /proc/cpuinfo spells them; the last should need none) that this CPU runs. The environment
    variable `override` names another, a slower one to test it; an unknown name is a ValueError."""
    from srv.sdk.registration import requires_cpu_flags

    forced = os.environ.get(override)
    if forced:
        if forced not in ladder:
            raise ValueError(f"{override}={forced}: one of {', '.join(ladder)}")
        return forced
    return next((name for name, flags in ladder.items() if requires_cpu_flags(*flags)().ok), list(ladder)[-1])


HUGE_PAGE = 2 << 20
CACHE_LINE = 64


def in_huge_pages(tensor: torch.Tensor) -> torch.Tensor:
    """A copy of `tensor` in private memory aligned to 2 MB and marked for the kernel's
    transparent huge pages (madvise), for weights that kernels stream from memory: with 4 KB pages
    the hardware prefetchers stop at every page's end and each page takes a TLB entry. The tensor
    itself where it is under 2 MB or the OS has no such advice; where huge pages are off (or none
    is free), the copy is in ordinary pages and nothing else changes."""
    return together_in_huge_pages([tensor])[0]


def together_in_huge_pages(tensors: Sequence[torch.Tensor]) -> list[torch.Tensor]:
    """in_huge_pages for many tensors at once, back to back in one mapping in the order given (each
    at a cache line): the weights of layers too small for a huge page of their own, placed in the
    order a decode step reads them. The tensors themselves where all of them come to under 2 MB."""
    import mmap

    import torch

    sizes = [t.numel() * t.element_size() for t in tensors]
    starts = [0]
    for size in sizes:
        starts.append(starts[-1] + -(-size // CACHE_LINE) * CACHE_LINE)
    if starts[-1] < HUGE_PAGE or not hasattr(mmap, "MADV_HUGEPAGE"):
        return list(tensors)
    region = mmap.mmap(-1, starts[-1] + HUGE_PAGE, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    region.madvise(mmap.MADV_HUGEPAGE)   # before the copies touch it: the pages are huge from the first fault
    raw = torch.frombuffer(region, dtype=torch.uint8)   # each copy keeps the mapping alive
    base = -raw.data_ptr() % HUGE_PAGE
    copies = []
    for tensor, start, size in zip(tensors, starts, sizes):
        copy = raw[base + start:base + start + size].view(tensor.dtype).view(tensor.shape)
        copy.copy_(tensor)
        copies.append(copy)
    return copies


def has_forward_hooks(model: Any) -> bool:
    """Whether any module of `model` holds a forward hook or pre-hook (`--forward-hooks`, or a
    plugin's): a model then runs its layers in Python, where torch calls them, not in one C call."""
    return any(m._forward_hooks or m._forward_pre_hooks for m in model.modules())


class NativeKernel(ctypes.Structure):
    """A C function and the context it is called with, handed from one plugin to another.

    With them a model runs its decode layers in one C call, where Python called every product
    and every attention (a dozen calls a layer: a third of a single-stream decode step of the
    default model). Three kinds, each with its C signature:

    - a linear layer's (`native_linear` of a quantized module): y [rows][out] = x [rows][in] W^T,
      float32 rows back to back:
      `void f(const void *context, const float *x, int64_t rows, float *y)`;
    - a decode step's attention (`AttentionBackend.native_decode`): stores the step's keys and
      values in layer `layer`'s cache, then writes each token's attention over it to `out`
      [tokens][heads * head_dim], float32; q, k and v are float32 rows, `q_stride` and `kv_stride`
      floats apart, each row's heads back to back:
      `void f(const void *context, int64_t layer, const float *q, int64_t q_stride,
      const float *k, const float *v, int64_t kv_stride, float *out)`;
    - tensor-parallel ranks' all-reduce (`ParallelContext.native_all_reduce`): x, `count` float32
      values, summed over the ranks in place: `void f(const void *context, float *x, int64_t count)`.

    `context` points into memory the giver keeps alive as long as the kernel may be called.
    `call_linear` and `call_decode_attention` call them from Python (the kits do).
    """

    _fields_ = [("function", ctypes.c_void_p), ("context", ctypes.c_void_p)]

    @classmethod
    def of(cls, function: ctypes._CFuncPtr, context: ctypes.Structure) -> NativeKernel:
        """A kernel from a function of a loaded library and its context structure."""
        return cls(ctypes.cast(function, ctypes.c_void_p).value, ctypes.addressof(context))


_LINEAR = ctypes.CFUNCTYPE(None, ctypes.c_void_p, ctypes.c_void_p, ctypes.c_int64, ctypes.c_void_p)
_DECODE_ATTENTION = ctypes.CFUNCTYPE(None, ctypes.c_void_p, ctypes.c_int64, ctypes.c_void_p, ctypes.c_int64,
                                     ctypes.c_void_p, ctypes.c_void_p, ctypes.c_int64, ctypes.c_void_p)


def call_linear(kernel: NativeKernel, x: torch.Tensor, out_features: int) -> torch.Tensor:
    """A linear layer's kernel on x [rows, in_features], float32 and contiguous."""
    import torch

    if x.dtype != torch.float32 or x.dim() != 2 or not x.is_contiguous():
        raise ValueError("a native linear kernel takes contiguous float32 rows")
    y = torch.empty(x.shape[0], out_features)
    _LINEAR(kernel.function)(kernel.context, x.data_ptr(), x.shape[0], y.data_ptr())
    return y


def call_decode_attention(kernel: NativeKernel, layer: int, q: torch.Tensor, k: torch.Tensor,
                          v: torch.Tensor) -> torch.Tensor:
    """A decode attention kernel on one layer; returns [tokens, heads, head_dim].

    q [tokens, heads, head_dim], k and v [tokens, kv_heads, head_dim]: float32, each token's
    heads back to back."""
    import torch

    for name, t in (("q", q), ("k", k), ("v", v)):
        if t.dtype != torch.float32 or t.stride(2) != 1 or t.stride(1) != t.shape[2]:
            raise ValueError(f"{name}: a native decode attention kernel takes float32 rows of back-to-back heads")
    if k.stride(0) != v.stride(0):
        raise ValueError("k and v must have the same row stride")
    out = torch.empty(q.shape)
    _DECODE_ATTENTION(kernel.function)(kernel.context, layer, q.data_ptr(), q.stride(0), k.data_ptr(), v.data_ptr(),
                                       k.stride(0), out.data_ptr())
    return out
