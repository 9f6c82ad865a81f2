"""Linear layers on oneDNN with weights reordered once, after loading, into its blocked layout:
for models' float layers, and for the dense copies quantization methods compute large batches
with.

A plain `F.linear` on CPU either reorders a bf16 weight on every call or, in float32, goes to
MKL; with the reorder done once, oneDNN's products are faster in both dtypes on SmolLM2's
shapes (BENCHMARKS.md has the measurements), and the vocabulary head is read at DRAM speed.

A model's layers may also keep the weight in its row-major layout for decode steps: a few
float32 rows against a float32 or bf16 weight is a product bound by the weight's bytes, which
srv's own kernel (dense_kernels.c) reads at DRAM speed, and which a model can call from C
(`native_linear`) to run a decode step's layers in one call. Both layouts are then held, so
`pack_linear_layers` keeps the row-major one only where memory allows.
"""

from __future__ import annotations

import ctypes
import functools
import logging
from pathlib import Path

import torch
from torch import nn
from torch.nn import functional as F

from srv.sdk.native import NativeKernel, optional_c_library
from srv.sdk.system import available_memory_bytes

logger = logging.getLogger("srv.layers")

# Steps of fewer float32 rows than this, by weight dtype, take the row-major kernel; from this
# many, oneDNN's blocked products are as fast or faster (`python -m benchmarks.decode_kernels`;
# BENCHMARKS.md's notes, "Dense decode").
NATIVE_ROWS = {torch.float32: 16, torch.bfloat16: 12}
# The row-major copies are kept while they take at most this share of the memory available
# after loading: the blocked copies, made at the first large product, need as much again.
ROW_MAJOR_MEMORY_SHARE = 0.25
WEIGHT_TYPES = {torch.float32: 0, torch.bfloat16: 1}
ISAS = {"portable": 0, "avx2": 1, "avx512": 2}


@functools.cache
def kernels() -> ctypes.CDLL | None:
    """dense_kernels.c, or None without a C compiler (every product on oneDNN then)."""
    library = optional_c_library(Path(__file__).with_name("dense_kernels.c"),
                                 without="decode steps' dense products run on oneDNN")
    if library is None:
        return None
    library.srv_dense_linear.argtypes = [ctypes.c_void_p, ctypes.c_void_p, ctypes.c_int64, ctypes.c_void_p]
    library.srv_dense_set_isa.argtypes = [ctypes.c_int]
    return library


def set_isa(name: str | None) -> None:
    """Force the row-major kernel's instruction set ("portable", "avx2", "avx512"; None: the CPU's
    best). For tests: the kernel must not be forced onto a set the CPU lacks."""
    kernels().srv_dense_set_isa(-1 if name is None else ISAS[name])


class DenseContext(ctypes.Structure):
    """What srv_dense_linear reads: the weight's type (0 float32, 1 bf16), shape, weight, bias."""
    _fields_ = [("weight_type", ctypes.c_int64), ("in_features", ctypes.c_int64), ("out_features", ctypes.c_int64),
                ("weight", ctypes.c_void_p), ("bias", ctypes.c_void_p)]


class PackedLinear(nn.Module):
    """Reorders its weight at its first product that oneDNN computes, or in the first pause of
    the traffic (`pack`, which the scheduler calls), not when built: the 121 reorders of the
    default model (0.3-0.4 s) stay out of the launch, and out of the first long prompt's prefill
    where the server had a moment before it.

    With `keep_rows` the row-major weight stays beside the blocked one, and float32 steps of
    fewer than NATIVE_ROWS[weight dtype] rows are the row-major kernel's (in Python and from C
    alike, so both give the same bits). A dtype oneDNN cannot compute here keeps its rows always
    and takes F.linear for larger steps."""

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None, keep_rows: bool = False) -> None:
        super().__init__()
        self.in_features, self.out_features = weight.shape[1], weight.shape[0]
        self.weight_dtype = weight.dtype   # `weight` itself is dropped once reordered, unless kept
        self.register_buffer("weight", weight.detach(), persistent=False)
        self.register_buffer("packed_weight", None, persistent=False)
        self.bias = None if bias is None else nn.Parameter(bias.detach(), requires_grad=False)
        self.packs = can_pack(weight.dtype)
        self.keep_rows = (keep_rows or not self.packs) and weight.dtype in WEIGHT_TYPES and kernels() is not None
        self.context: DenseContext | None = None
        self.kernel: NativeKernel | None = None
        self.float32_bias: torch.Tensor | None = None

    def native_linear(self, rows: int, dtype: torch.dtype = torch.float32) -> NativeKernel | None:
        """The row-major kernel for `rows` float32 rows, or None where oneDNN computes them (and
        for products in other arithmetic than float32: see srv.sdk.linear.LinearMethod)."""
        if not self.keep_rows or rows >= NATIVE_ROWS[self.weight_dtype] or dtype != torch.float32:
            return None
        if self.kernel is None:
            # The addresses of the weight and bias as they are now: srv never replaces them after
            # the first decode step (loading and quantization come before it).
            self.weight = self.weight.contiguous()
            # Kept: the kernel reads the float32 bias from this address.
            self.float32_bias = bias = None if self.bias is None else self.bias.detach().float().contiguous()
            weight = self.weight
            self.context = DenseContext(WEIGHT_TYPES[weight.dtype], self.in_features, self.out_features,
                                        weight.data_ptr(), None if bias is None else bias.data_ptr())
            self.kernel = NativeKernel.of(kernels().srv_dense_linear, self.context)
        return self.kernel

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        shape = x.shape
        rows = x.numel() // self.in_features
        if x.dtype == torch.float32 and self.keep_rows and rows < NATIVE_ROWS[self.weight_dtype]:
            y = torch.empty(rows, self.out_features)
            x = x.reshape(rows, self.in_features).contiguous()
            kernels().srv_dense_linear(self.native_linear(rows).context, x.data_ptr(), rows, y.data_ptr())
            return y.view(*shape[:-1], self.out_features)
        if self.packed_weight is None:
            if not self.packs:   # a dtype oneDNN cannot compute here (bf16 without AVX-512 BF16)
                return F.linear(x, self.weight, self.bias)
            self.pack()
        out = torch.ops.mkldnn._linear_pointwise(x.reshape(-1, self.in_features), self.packed_weight, self.bias,
                                                 "none", [], "")
        return out.view(*shape[:-1], self.out_features)


    @property
    def unpacked(self) -> bool:
        """Whether oneDNN would reorder the weight at its first product (`pack` does it now)."""
        return self.packs and self.packed_weight is None

    def pack(self) -> None:
        """The weight in oneDNN's blocked layout, reordered once: at the first product oneDNN
        computes, or earlier (the scheduler does it in the first pause of the traffic)."""
        if not self.unpacked:
            return
        # oneDNN picks the blocking for this many rows. In float32 a hint of 1 made 16- and
        # 64-row products 1.3-1.5x slower than a hint of 16 or 64, which cost one row nothing.
        self.packed_weight = torch.ops.mkldnn._reorder_linear_weight(self.weight, 64)
        if not self.keep_rows:
            self.weight = None


def can_pack(dtype: torch.dtype) -> bool:
    if not torch.backends.mkldnn.is_available():
        return False
    return dtype == torch.float32 or (dtype == torch.bfloat16 and torch.ops.mkldnn._is_mkldnn_bf16_supported())


def pack_linear_layers(model: nn.Module) -> None:
    """Swap every float32 or bf16 nn.Linear for a PackedLinear. The model's own products keep
    their row-major weights for decode steps where memory allows (and always where oneDNN cannot
    take the dtype: its large products are then F.linear's on them); a layer inside one with a
    decode kernel of its own (a GGUF layer's dense copy, for its large batches) never does."""
    dtype = next(model.parameters()).dtype
    if not can_pack(dtype) and not (dtype in WEIGHT_TYPES and kernels() is not None):
        return
    linears = []   # (parent, attribute, layer, whether it is the model's own product)
    for name, module in model.named_modules():
        if isinstance(module, nn.Linear):
            parent_name, _, leaf = name.rpartition(".")
            parent = model.get_submodule(parent_name)
            linears.append((parent, leaf, module, not hasattr(parent, "native_linear")))
    row_bytes = sum(m.weight.numel() * m.weight.element_size() for _, _, m, own in linears if own)
    keep_rows = row_bytes <= ROW_MAJOR_MEMORY_SHARE * available_memory_bytes()
    if not keep_rows and can_pack(dtype):
        logger.info("the linear layers' %.1f GiB are held once, blocked for oneDNN: decode steps take its products",
                    row_bytes / 2**30)
    for parent, leaf, module, own in linears:
        packed = PackedLinear(module.weight, module.bias, keep_rows and own)
        if hasattr(module, "sharding"):   # which part of the checkpoint a rank's layer holds (srv.sdk.layers)
            packed.sharding = module.sharding
        setattr(parent, leaf, packed)


def dense_layer(weight: torch.Tensor, bias: torch.Tensor | None) -> nn.Module:
    """y = x W^T (+ b) with the weight in its dtype: a PackedLinear where oneDNN computes that
    dtype, else a plain nn.Linear."""
    if can_pack(weight.dtype):
        return PackedLinear(weight, bias)
    layer = nn.Linear(weight.shape[1], weight.shape[0], bias=bias is not None, device="meta", dtype=weight.dtype)
    layer.weight = nn.Parameter(weight, requires_grad=False)
    if bias is not None:
        layer.bias = nn.Parameter(bias.to(weight.dtype), requires_grad=False)
    return layer
