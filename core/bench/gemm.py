"""The model's linear layers as GEMMs, against the machine's float32 and int8 peaks, for
`srv bench one-batch`: how far each quantization method's products are from the limit.

A layer is any module with `in_features` and `out_features` not inside another such module (a
quantized layer's dense copy is its own business). Each is called on random rows of the served
dtype, as the model would call it. The machine's peaks are the multiply-add throughput of the
widest instructions the CPU has (`peak_kernels.c`: chains of FMAs, and of vpmaddubsw or VNNI's
vpdpbusd, on registers, on every thread torch uses): no library's product reaches past them.
Beside them, torch's own products on a large square shape (oneDNN: float32 `linear` and int8
`_int_mm`, bf16 where the CPU computes it natively) say what a maintained library reaches here;
on a CPU without VNNI, oneDNN's int8 product is far under the int8 peak.
"""

from __future__ import annotations

import ctypes
import statistics
import time
from pathlib import Path
from typing import Any, Callable

PEAK_SHAPE = (512, 2048, 2048)   # rows, in, out
# The peak loops' instruction sets, fastest first, with the CPU flags each needs; the codes
# peak_kernels.c takes.
PEAK_ISAS = {"avx512_vnni": ("avx512f", "avx512bw", "avx512_vnni"), "avx512": ("avx512f", "avx512bw"),
             "avx2": ("avx2", "fma"), "portable": ()}
ISA_CODES = {"portable": 0, "avx2": 1, "avx512": 2, "avx512_vnni": 3}
PEAK_SECONDS = 0.1   # each timed run of a peak loop lasts about this long


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


def instruction_peaks(threads: int) -> tuple[str, dict[str, float]]:
    """(the instruction set, GOP/s of its float32 and int8 multiply-add loops on `threads`
    threads); SRV_PEAK_ISA names a slower instruction set to measure instead."""
    from srv.sdk.native import load_c_library, pick_isa

    library = load_c_library(Path(__file__).with_name("peak_kernels.c"))
    isa = pick_isa(PEAK_ISAS, "SRV_PEAK_ISA")
    peaks = {}
    for kind, loop in (("float32", library.srv_peak_fma), ("int8", library.srv_peak_int8)):
        loop.restype, loop.argtypes = ctypes.c_double, [ctypes.c_int, ctypes.c_int64, ctypes.c_int]
        iterations = 1 << 12
        while True:   # long enough to time
            started = time.perf_counter()
            loop(ISA_CODES[isa], iterations, threads)
            if time.perf_counter() - started >= PEAK_SECONDS / 4:
                break
            iterations *= 4
        iterations = int(iterations * PEAK_SECONDS / max(time.perf_counter() - started, 1e-6)) or 1
        operations = loop(ISA_CODES[isa], iterations, threads)
        peaks[kind] = operations / _seconds(lambda: loop(ISA_CODES[isa], iterations, threads), 3) / 1e9
    return isa, peaks


def library_products() -> dict[str, float]:
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
    import torch

    threads = torch.get_num_threads()
    isa, peaks = instruction_peaks(threads)
    return {"layers_gops": {str(rows): layers_throughput(model, rows, dtype) for rows in row_counts},
            "peaks_gops": peaks, "peak_isa": isa, "peak_threads": threads,
            "library_gops": library_products(), "library_shape": list(PEAK_SHAPE)}
