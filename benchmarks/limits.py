"""The machine's limits that bound decoding: DRAM bandwidth, matmul throughput, and the ceilings
they imply for the default model in each weight format.

Decoding one token reads every weight once (SmolLM2 ties the embeddings to the output layer,
which reads all of them), so a single stream cannot beat bandwidth / weight bytes; a batch shares
those reads and is bounded by matmul throughput instead, at 2 FLOPs per weight per token.
"""

from __future__ import annotations

import functools
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass
from typing import Any

# Bytes per weight. Q4_1 stores 32 weights in 20 bytes (4-bit values, an fp16 scale and minimum).
WEIGHT_FORMATS = (("fp32", 4.0), ("bf16", 2.0), ("int8", 1.0), ("4-bit (Q4_1)", 20 / 32))


@dataclass(frozen=True)
class LimitSizes:
    bandwidth_bytes: int = 1 << 30     # far beyond the last-level cache
    matmul_k: int = 2048
    matmul_n: int = 2048
    matmul_ms: tuple[int, ...] = (128, 1)
    seconds: float = 1.0              # time spent per measurement, best repeat kept


def _best_time(fn: Callable[[], object], seconds: float) -> float:
    """The fastest of as many calls as fit in `seconds` (at least 3, after one warm-up)."""
    fn()
    best, spent, calls = float("inf"), 0.0, 0
    while calls < 3 or spent < seconds:
        start = time.perf_counter()
        fn()
        elapsed = time.perf_counter() - start
        best, spent, calls = min(best, elapsed), spent + elapsed, calls + 1
    return best


def measure_bandwidth(sizes: LimitSizes) -> dict[str, float]:
    """GB/s of reading (a sum) and of copying (read + write) a large float32 tensor."""
    import torch

    src = torch.ones(sizes.bandwidth_bytes // 4, dtype=torch.float32)
    dst = torch.empty_like(src)
    read = _best_time(lambda: src.sum(), sizes.seconds)
    copy = _best_time(lambda: dst.copy_(src), sizes.seconds)
    return {"read_gb_s": sizes.bandwidth_bytes / read / 1e9, "copy_gb_s": 2 * sizes.bandwidth_bytes / copy / 1e9}


def measure_matmul(sizes: LimitSizes) -> dict[str, float]:
    """GFLOP/s of [M, K] @ [K, N] per dtype and M, keyed like 'bf16_m128'."""
    import torch

    out = {}
    for name, dtype in (("bf16", torch.bfloat16), ("fp32", torch.float32)):
        b = torch.randn(sizes.matmul_k, sizes.matmul_n).to(dtype)
        for m in sizes.matmul_ms:
            a = torch.randn(m, sizes.matmul_k).to(dtype)
            elapsed = _best_time(functools.partial(torch.matmul, a, b), sizes.seconds)
            out[f"{name}_m{m}"] = 2 * m * sizes.matmul_k * sizes.matmul_n / elapsed / 1e9
    return out


@dataclass
class Ceiling:
    weight_format: str
    weight_bytes: float
    single_stream_tok_s: float      # bandwidth / weight bytes
    single_stream_ms: float


def decode_ceilings(num_params: int, read_gb_s: float) -> list[Ceiling]:
    ceilings = []
    for name, bytes_per_weight in WEIGHT_FORMATS:
        weight_bytes = num_params * bytes_per_weight
        tok_s = read_gb_s * 1e9 / weight_bytes
        ceilings.append(Ceiling(name, weight_bytes, tok_s, 1e3 / tok_s))
    return ceilings


def measure_limits(num_params: int, sizes: LimitSizes = LimitSizes()) -> dict[str, Any]:
    """Bandwidth, matmul GFLOP/s and the decode ceilings of a model of `num_params` weights."""
    import torch

    bandwidth = measure_bandwidth(sizes)
    matmul = measure_matmul(sizes)
    # A batch's decode step is matmul-bound: 2 FLOPs per weight per token.
    batched = {f"{key}_tok_s": gflops * 1e9 / (2 * num_params) for key, gflops in matmul.items()
               if not key.endswith("_m1")}
    return {
        "torch_threads": torch.get_num_threads(),
        "sizes": {**asdict(sizes), "matmul_ms": list(sizes.matmul_ms)},   # JSON has no tuples
        "num_params": num_params,
        "bandwidth": bandwidth,
        "matmul_gflops": matmul,
        "matmul_shape": f"[M, {sizes.matmul_k}] @ [{sizes.matmul_k}, {sizes.matmul_n}]",
        "decode_ceilings": [asdict(c) for c in decode_ceilings(num_params, bandwidth["read_gb_s"])],
        "batched_ceilings": batched,
    }
