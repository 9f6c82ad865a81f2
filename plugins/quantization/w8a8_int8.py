"""`--quantization w8a8_int8`: int8 weights per output channel, activations quantized per token
at run time, int8 x int8 products accumulated exactly in int32.

For a layer with int8 weights w [N, K] and float32 scales s [N] (w_float ~ s[n] * w[n, k]), a
batch x [M, K] is computed as

    sx[m] = max(max_k |x[m, k]|, 1e-10) / 127,   q = round(x / sx) clamped to -127..127,
    y[m, n] = (int32 sum_k q[m, k] * w[n, k]) * sx[m] * s[n]  (+ bias[n]).

Two ways compute it, to the same bits (int32 sums are exact in any order, the float steps are
the same operations in the same order): the C kernels of int8_kernels.c, and torch's `_int_mm`
(oneDNN's int8 GEMM). Batches under NATIVE_ROWS rows take the C kernel, which reads each weight
row once for every activation row (decode steps, bound by the weight bytes; AVX512-VNNI or AVX2 by
the CPU's flags). Larger batches are bound by arithmetic: where the CPU has VNNI (and AMX), they
go to oneDNN; on AVX2 alone, oneDNN's int8 GEMM is many times slower than float32 (it has no
AVX2 int8 kernel), and they take the C kernel's tiled AVX2 product.

Checkpoints:
- SGLang's w8a8_int8 (`quantization_config.quant_method` "w8a8_int8") and compressed-tensors'
  int8 channel-wise weights with dynamic per-token activations (RedHatAI's `quantized.w8a8`
  models: quant_method "compressed-tensors", format "int-quantized"): each linear layer has an
  int8 `weight` [N, K] and a `weight_scale` [N, 1]; the head and the layers in
  compressed-tensors' `ignore` stay float. Other compressed-tensors schemes are refused, saying
  what differs.
- A float checkpoint is quantized as it loads, every linear layer including the head:
  s[n] = max_k |w[n, k]| / 127, w = round(w_float / s) (the same per-channel symmetric
  quantization the checkpoints above are made with).
"""

from __future__ import annotations

import copy
import ctypes
import functools
import logging
from pathlib import Path
from typing import Any

import torch
from torch import nn

from srv.sdk.linear import Linear, LinearMethod, parameter
from srv.sdk.native import NativeKernel, load_c_library, pick_isa, together_in_huge_pages
from srv.sdk.quantization import (QuantizationMethod, checkpoint_quantization_config,
                                  compressed_tensors_scheme, kept_float)

logger = logging.getLogger("srv.quantization")

# Rows from which torch's int8 GEMM computes a product called from Python; fewer rows take the C
# kernel (measured on AVX512-VNNI with AMX: the kernel is 1.5-2x faster at 1-4 rows, oneDNN 1.5x
# at 16). The C decode layers (native_linear) call the kernel up to NATIVE_LAYER_ROWS rows: there
# it also saves the Python calls of every product, which outweighs oneDNN's faster GEMM.
NATIVE_ROWS = 12
NATIVE_LAYER_ROWS = 32
# The instruction sets whose batches from NATIVE_ROWS rows go to oneDNN (see above): VNNI's, and
# the portable one, where no kernel here is fast. AMX's tiles take every batch: they beat oneDNN's
# GEMM (with the same quantization and epilogue) at every batch size measured (BENCHMARKS.md).
ONEDNN_ISAS = frozenset({"avx512_vnni", "portable"})
SMALLEST_SCALE = 1e-10
ISAS = {"portable": 0, "avx2": 1, "avx512_vnni": 2, "amx": 3}


@functools.cache
def kernels() -> ctypes.CDLL:
    # No instruction-set flags: each kernel is compiled for its own (target attributes) and the
    # Python side picks the one the CPU has.
    library = load_c_library(Path(__file__).with_name("int8_kernels.c"))
    pointer, size = ctypes.c_void_p, ctypes.c_int64
    library.srv_int8_linear.argtypes = [pointer, pointer, size, pointer]
    library.srv_int8_quantize_rows.argtypes = [pointer, size, size, pointer, pointer, size]
    library.srv_int8_scale_products.argtypes = [pointer, pointer, pointer, size, pointer]
    library.srv_int8_has_amx.restype = ctypes.c_int
    return library


@functools.cache
def best_isa() -> str:
    """The fastest kernel this CPU runs; $SRV_INT8_ISA picks another (a slower one, to test it).
    AMX also needs the OS to lend the process its tiles, which only the kernels can ask."""
    isa = pick_isa({"amx": ("amx_int8", "amx_tile", "avx512f", "avx512bw", "avx512_vnni"),
                    "avx512_vnni": ("avx512f", "avx512bw", "avx512_vnni"), "avx2": ("avx2", "fma"), "portable": ()},
                   "SRV_INT8_ISA")
    return "avx512_vnni" if isa == "amx" and not kernels().srv_int8_has_amx() else isa


class Int8LinearContext(ctypes.Structure):
    """What srv_int8_linear reads."""
    _fields_ = [("isa", ctypes.c_int64), ("in_features", ctypes.c_int64), ("out_features", ctypes.c_int64),
                ("weight", ctypes.c_void_p), ("scale", ctypes.c_void_p), ("bias", ctypes.c_void_p),
                ("weight_sums", ctypes.c_void_p), ("bf16_rows", ctypes.c_int64)]


def quantize_weight(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-channel symmetric int8: (q [N, K] int8, scale [N] float32) with weight ~ scale[:, None] * q."""
    weight = weight.float()
    scale = weight.abs().amax(1).clamp_min(SMALLEST_SCALE) / 127
    return torch.round(weight / scale[:, None]).clamp_(-127, 127).to(torch.int8), scale


def quantize_rows(x: torch.Tensor, isa: str) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-row symmetric int8 of float32 x [M, K] contiguous: (q [M, K] int8, scale [M]), by
    the kernels' own function (torch's operators give the same values in eight passes)."""
    q, scale = torch.empty(x.shape, dtype=torch.int8), torch.empty(x.shape[0])
    kernels().srv_int8_quantize_rows(x.data_ptr(), x.shape[0], x.shape[1], q.data_ptr(), scale.data_ptr(),
                                     ISAS[isa])
    return q, scale


class Int8Weight:
    """A layer's int8 weights and float32 scales (and bias), with the C kernel's context.
    Plain attributes of the layer: casting the model to the served dtype must leave them."""

    def __init__(self, q: torch.Tensor, scale: torch.Tensor, bias: torch.Tensor | None, isa: str) -> None:
        self.q, self.scale = q.contiguous(), scale.float().reshape(-1).contiguous()
        self.bias = None if bias is None else bias.detach().float().contiguous()
        self.weight_sums = self.q.sum(1, dtype=torch.int32)
        self.out_features, self.in_features = self.q.shape
        self.isa = isa
        self._bind()

    def _bind(self) -> None:
        """The C kernel's contexts, at the tensors' addresses as they are now."""
        bias_address = None if self.bias is None else self.bias.data_ptr()
        self.context, self.bf16_context = (
            Int8LinearContext(ISAS[self.isa], self.in_features, self.out_features, self.q.data_ptr(),
                              self.scale.data_ptr(), bias_address, self.weight_sums.data_ptr(), bf16_rows)
            for bf16_rows in (0, 1))
        self.kernel = NativeKernel.of(kernels().srv_int8_linear, self.context)
        # The product of a model served in bf16: its rows rounded to bf16 first, as its forward has them.
        self.bf16_kernel = NativeKernel.of(kernels().srv_int8_linear, self.bf16_context)

    def with_weights(self, q: torch.Tensor) -> Int8Weight:
        """The same layer with `q` (equal to this one's, elsewhere in memory) as its int8 weights."""
        moved = copy.copy(self)
        moved.q = q
        moved._bind()
        return moved

    def matmul(self, x: torch.Tensor) -> torch.Tensor:
        """x [M, K] float32 contiguous -> [M, N] float32."""
        rows = x.shape[0]
        if rows < NATIVE_ROWS or self.isa not in ONEDNN_ISAS:
            y = torch.empty(rows, self.out_features)
            kernels().srv_int8_linear(ctypes.addressof(self.context), x.data_ptr(), rows, y.data_ptr())
            return y
        q, sx = quantize_rows(x, self.isa)
        products = torch._int_mm(q, self.q.t())
        y = torch.empty(rows, self.out_features)
        kernels().srv_int8_scale_products(ctypes.addressof(self.context), products.data_ptr(), sx.data_ptr(), rows,
                                          y.data_ptr())
        return y


class Int8LinearMethod(LinearMethod):
    """`stored`: the checkpoint holds int8 `weight` and `weight_scale`; otherwise it holds a float
    `weight`, quantized once loaded."""

    def __init__(self, stored: bool, isa: str) -> None:
        self.stored, self.isa = stored, isa

    def create_weights(self, layer: Linear) -> None:
        n, k = layer.out_features, layer.in_features
        if self.stored:
            layer.register_parameter("weight", parameter(n, k, dtype=torch.int8))
            layer.register_parameter("weight_scale", parameter(n, 1, dtype=torch.float32))
        else:
            layer.register_parameter("weight", parameter(n, k, dtype=torch.float32))

    def process_weights_after_loading(self, layer: Linear) -> None:
        if self.stored:
            q, scale = layer.weight.data, layer.weight_scale.data
            del layer.weight_scale
        else:
            q, scale = quantize_weight(layer.weight.data)
        del layer.weight
        layer.int8 = Int8Weight(q, scale, layer.bias, self.isa)

    def apply(self, layer: Linear, x: torch.Tensor) -> torch.Tensor:
        rows = x.numel() // layer.in_features
        y = layer.int8.matmul(x.reshape(rows, layer.in_features).float().contiguous())
        return y.to(x.dtype).view(*x.shape[:-1], layer.out_features)

    def native_linear(self, layer: Linear, rows: int, dtype: torch.dtype = torch.float32) -> NativeKernel | None:
        # Where oneDNN takes larger batches, they are faster there, and the C layers cannot call it.
        small = rows < NATIVE_LAYER_ROWS or layer.int8.isa not in ONEDNN_ISAS
        if not small:
            return None
        return {torch.float32: layer.int8.kernel, torch.bfloat16: layer.int8.bf16_kernel}.get(dtype)


class W8A8Int8Quantization(QuantizationMethod):
    # A float checkpoint's weights split across ranks before they are quantized: each rank's
    # rows get their own scales (an input-split layer's scale is its shard's), within the bound.
    tensor_parallel = True

    def __init__(self, server_args: Any = None) -> None:
        super().__init__(server_args)
        self.isa = best_isa()

    def detects(self, model_path: str) -> bool:
        return compressed_tensors_int8(checkpoint_quantization_config(model_path)) is not None

    def check(self, model_path: str) -> None:
        config = checkpoint_quantization_config(model_path)
        method = config.get("quant_method")
        if method == "compressed-tensors":
            compressed_tensors_int8(config, refuse=True)
        elif method not in (None, "w8a8_int8"):
            raise ValueError(f"--quantization w8a8_int8 cannot read a checkpoint quantized with {method!r}")
        if method is not None and getattr(self.server_args, "tensor_parallel_size", 1) > 1:
            raise ValueError("--quantization w8a8_int8: a stored int8 checkpoint does not split across tensor-parallel "
                             "ranks yet (a float checkpoint does)")
        kernels()   # a compiler error now, at launch, rather than at the first request
        logger.info("w8a8_int8: %s kernels", self.isa)

    def linear_method(self, name: str, layer: nn.Linear) -> LinearMethod | None:
        config = dict(getattr(self.model_config, "quantization_config", None) or {})
        method = config.get("quant_method")
        if method is None:
            return Int8LinearMethod(stored=False, isa=self.isa)
        if kept_float(name, config):   # the head (a tied one is the embedding matrix) and `ignore`
            return None
        return Int8LinearMethod(stored=True, isa=self.isa)


    def apply(self, model: nn.Module) -> int:
        """Every layer's int8 weights, then all of them together in huge pages, in the order the
        layers run: one-row decode steps read them at the memory's pace, and with 4 KB pages
        the prefetchers stopped at each page's end."""
        replaced = super().apply(model)
        layers = [m for m in model.modules() if isinstance(getattr(m, "int8", None), Int8Weight)]
        for layer, q in zip(layers, together_in_huge_pages([layer.int8.q for layer in layers])):
            layer.int8 = layer.int8.with_weights(q)
        return replaced

    def quantize_experts(self, name: str, layer: Any) -> bool:
        # int8 weights with a scale per output channel, computed weight-only by the MoE runner
        # (activations stay float): a float checkpoint's experts quantized now, an int8
        # checkpoint's as stored. Experts an int8 checkpoint keeps float (its `ignore`) stay so.
        stored = (getattr(self.model_config, "quantization_config", None) or {}).get("quant_method") is not None
        scales = layer.take_stored("weight_scale") if stored else None
        if stored and scales is None:
            return False
        layer.quantize_int8(scales)
        return True


def compressed_tensors_int8(config: dict[str, Any], refuse: bool = False) -> dict[str, Any] | None:
    """The scheme of a compressed-tensors config this method computes (int8 channel-wise
    symmetric weights, dynamic int8 per-token activations), or None (with `refuse`, a
    ValueError saying what differs)."""
    group, why = compressed_tensors_scheme(config, ("int-quantized", None), {
        "weights": {"num_bits": 8, "type": "int", "symmetric": True, "strategy": "channel"},
        "input_activations": {"num_bits": 8, "type": "int", "symmetric": True, "strategy": "token", "dynamic": True}})
    if group is None and refuse:
        raise ValueError(f"--quantization w8a8_int8 reads compressed-tensors int8 checkpoints; this one {why}")
    return group
