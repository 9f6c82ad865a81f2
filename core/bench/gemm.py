"""The model's linear layers as GEMMs, against the machine's float32 and int8 peaks, for
`srv bench one-batch`: how far each quantization method's products are from the limit.

A layer is any module with `in_features` and `out_features` not inside another such module (a
quantized layer's dense copy is its own business). Each is called on random rows of the served
dtype, as the model would call it; the peaks are torch's own products on a large square shape
(oneDNN: float32 `linear` and int8 `_int_mm`, bf16 where the CPU computes it natively).
"""

from __future__ import annotations

import statistics
import time
from typing import Any, Callable

PEAK_SHAPE = (512, 2048, 2048)   # rows, in, out


def linear_layers(model: Any) -> list[Any]:
    layers, inside = [], []
    for name, module in model.named_modules():
        if any(name.startswith(prefix + ".") for prefix in inside):
            continue
        if hasattr(module, "in_features") and hasattr(module, "out_features"):
            layers.append(module)
            inside.append(name)
    return layers


def _seconds(call: Callable[[], Any], repeats: int = 5) -> float:
    call()
    times = []
    for _ in range(repeats):
        started = time.perf_counter()
        call()
        times.append(time.perf_counter() - started)
    return statistics.median(times)


def layers_throughput(model: Any, rows: int, dtype: Any) -> float:
    """GOP/s of one pass over every linear layer of `model` at `rows` rows."""
    import torch

    layers = linear_layers(model)
    inputs = [torch.randn(rows, layer.in_features).to(dtype) for layer in layers]

    def run() -> None:
        with torch.inference_mode():
            for layer, x in zip(layers, inputs):
                layer(x)

    operations = sum(2 * rows * layer.in_features * layer.out_features for layer in layers)
    return operations / _seconds(run) / 1e9


def machine_peaks() -> dict[str, float]:
    """GOP/s of torch's float32, bf16 (where native) and int8 products on PEAK_SHAPE."""
    import torch
    from torch.nn import functional as F

    m, k, n = PEAK_SHAPE
    operations = 2 * m * k * n
    peaks = {}
    x, w = torch.randn(m, k), torch.randn(n, k)
    with torch.inference_mode():
        peaks["float32"] = operations / _seconds(lambda: F.linear(x, w)) / 1e9
        if torch.cpu._is_avx512_bf16_supported() or torch.cpu._is_amx_tile_supported():
            xb, wb = x.bfloat16(), w.bfloat16()
            peaks["bfloat16"] = operations / _seconds(lambda: F.linear(xb, wb)) / 1e9
        qx = torch.randint(-127, 128, (m, k), dtype=torch.int8)
        qw = torch.randint(-127, 128, (n, k), dtype=torch.int8)
        peaks["int8"] = operations / _seconds(lambda: torch._int_mm(qx, qw.t())) / 1e9
    return peaks


def gemm_report(model: Any, dtype: Any, row_counts: list[int]) -> dict[str, Any]:
    return {"layers_gops": {str(rows): layers_throughput(model, rows, dtype) for rows in row_counts},
            "peaks_gops": machine_peaks(), "peak_shape": list(PEAK_SHAPE)}
