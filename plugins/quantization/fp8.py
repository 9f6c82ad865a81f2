"""`--quantization fp8` and `w8a8_fp8`: float8 e4m3fn weights with float32 scales, computed
weight-only on CPU (no CPU has float8 arithmetic): activations stay in the served dtype.

Scales are held per output row and block of inputs, `scale [N, ceil(K / block_k)]`, whatever
the checkpoint's layout:
- per tensor (`weight_scale` [] or [1]: Fp8Config without `weight_block_size`,
  compressed-tensors strategy "tensor"), copied to every row of its shard: the query, key and
  value shards of a fused projection keep their own scales;
- per channel (`weight_scale` [N, 1]: SGLang's w8a8_fp8, compressed-tensors "channel");
- per block (`weight_scale_inv` [ceil(N / bn), ceil(K / bk)]: Fp8Config's `weight_block_size`,
  DeepSeek-V3 and Qwen3 FP8 checkpoints; compressed-tensors "block" with `weight_scale`),
  each block row spread over its rows.
A float checkpoint is quantized at load, per channel: s[n] = max_k |w[n, k]| / 448, the weight
rounded to e4m3fn (every linear layer, the head included).

Batches under NATIVE_ROWS rows in float32 (DENSE_FROM_OTHER_DTYPES_ROWS in bf16) go to
fp8_kernels.c, which widens each weight row once for every activation row (AVX2 with F16C, or
portable C). Larger ones are bound by arithmetic, where the served dtype's dense kernels are
faster: the layer dequantizes its weights into a dense copy (oneDNN's prepacked layer) at its
first such batch and keeps it, as gguf keeps its dense copy (a model that never sees one,
decode-only, holds the float8 bytes alone).
"""

from __future__ import annotations

import ctypes
import functools
import logging
from pathlib import Path
from typing import Any

import torch
from torch import nn

from srv.sdk.linear import Linear, LinearMethod, parameter
from srv.sdk.native import NativeKernel, load_c_library, pick_isa
from srv.sdk.packed_linear import dense_layer
from srv.sdk.quantization import (QuantizationMethod, checkpoint_quantization_config,
                                  compressed_tensors_scheme, kept_float)

logger = logging.getLogger("srv.quantization")

NATIVE_ROWS = 32
# A model served in bf16 or float16 takes the dense copy from 8 rows called from Python, as
# gguf's layers do: on AMX its bf16 products outrun the float32 kernel from about there.
DENSE_FROM_OTHER_DTYPES_ROWS = 8
FP8_MAX = 448.0


@functools.cache
def kernels() -> ctypes.CDLL:
    library = load_c_library(Path(__file__).with_name("fp8_kernels.c"), ("-lm",))
    pointer, size = ctypes.c_void_p, ctypes.c_int64
    library.srv_fp8_linear.argtypes = [pointer, pointer, size, pointer]
    return library


@functools.cache
def best_isa() -> int:
    """fp8_kernels.c's body for this CPU: 1 AVX2 (with FMA and F16C), 0 portable; $SRV_FP8_ISA
    picks another."""
    return {"avx2": 1, "portable": 0}[pick_isa({"avx2": ("avx2", "fma", "f16c"), "portable": ()}, "SRV_FP8_ISA")]


class Fp8LinearContext(ctypes.Structure):
    _fields_ = [("isa", ctypes.c_int64), ("in_features", ctypes.c_int64), ("out_features", ctypes.c_int64),
                ("block_n", ctypes.c_int64), ("block_k", ctypes.c_int64), ("weight", ctypes.c_void_p),
                ("scale", ctypes.c_void_p), ("bias", ctypes.c_void_p)]


def quantize_weight(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-channel e4m3fn: (w8 [N, K], scale [N, 1]) with weight ~ scale * w8."""
    weight = weight.float()
    scale = weight.abs().amax(1, keepdim=True).clamp_min(1e-12) / FP8_MAX
    return (weight / scale).clamp_(-FP8_MAX, FP8_MAX).to(torch.float8_e4m3fn), scale


def dequantize(w8: torch.Tensor, scale: torch.Tensor, block_k: int, dtype: torch.dtype) -> torch.Tensor:
    """w8 [N, K] with scale [N, ceil(K / block_k)] as a `dtype` matrix."""
    expanded = scale.repeat_interleave(block_k, dim=1)[:, :w8.shape[1]]
    return (w8.float() * expanded).to(dtype)


class Fp8Weight:
    """A layer's e4m3fn weights and row-block scales (and bias), with the C kernel's context:
    plain attributes, which casting the model to the served dtype leaves alone."""

    def __init__(self, w8: torch.Tensor, scale: torch.Tensor, block_k: int, bias: torch.Tensor | None,
                 isa: int) -> None:
        self.w8, self.scale, self.block_k = w8.contiguous(), scale.float().contiguous(), block_k
        self.bias = None if bias is None else bias.detach().float().contiguous()
        self.out_features, self.in_features = self.w8.shape
        self.kernel_scale = self.scale * 256   # the kernels multiply float16 images (fp8_kernels.c)
        self.context = Fp8LinearContext(isa, self.in_features, self.out_features, 1, block_k, self.w8.data_ptr(),
                                        self.kernel_scale.data_ptr(),
                                        None if self.bias is None else self.bias.data_ptr())
        self.dense: dict[torch.dtype, nn.Module] = {}
        self.kernel = NativeKernel.of(kernels().srv_fp8_linear, self.context)

    def matmul(self, x: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        """x [M, K] -> [M, N]: the kernel (float32) for few rows, else dense in `dtype`."""
        rows = x.shape[0]
        if rows < (NATIVE_ROWS if dtype == torch.float32 else DENSE_FROM_OTHER_DTYPES_ROWS):
            x = x.float().contiguous()
            y = torch.empty(rows, self.out_features)
            kernels().srv_fp8_linear(ctypes.addressof(self.context), x.data_ptr(), rows, y.data_ptr())
            return y
        if dtype not in self.dense:
            self.dense[dtype] = dense_layer(dequantize(self.w8, self.scale, self.block_k, dtype),
                                            None if self.bias is None else self.bias.to(dtype))
        return self.dense[dtype](x.to(dtype))


class Fp8LinearMethod(LinearMethod):
    """`layout`: "float" (a float checkpoint, quantized once loaded), "tensor", "channel" or
    "block" (with `block` = (bn, bk)); `scale_name` the checkpoint's name for the scales."""

    def __init__(self, layout: str, isa: int, block: tuple[int, int] | None = None,
                 scale_name: str = "weight_scale", input_scale: bool = False) -> None:
        self.layout, self.isa, self.block, self.scale_name, self.input_scale = layout, isa, block, scale_name, input_scale

    @property
    def block_k(self) -> int | None:
        return self.block[1] if self.block else None

    def create_weights(self, layer: Linear) -> None:
        n, k = layer.out_features, layer.in_features
        if self.layout == "float":
            layer.register_parameter("weight", parameter(n, k, dtype=torch.float32))
            return
        layer.register_parameter("weight", parameter(n, k, dtype=torch.float8_e4m3fn))
        blocks = 1 if self.block is None else -(-k // self.block[1])
        layer.register_parameter(self.scale_name, parameter(n, blocks, dtype=torch.float32,
                                                            weight_loader=self.load_scale))
        if self.input_scale:   # static activation scales: weight-only compute has no use for them (one
            # a row, so that a fused layer's shards each find theirs)
            layer.register_parameter("input_scale", parameter(n, dtype=torch.float32,
                                                              weight_loader=lambda rows, tensor: None))

    def load_scale(self, rows: torch.Tensor, tensor: torch.Tensor) -> None:
        """A checkpoint's scales onto this layer's (or shard's) rows of [rows, k-blocks]."""
        tensor = tensor.float()
        if self.layout == "tensor":
            if tensor.numel() != 1:
                raise ValueError(f"a per-tensor fp8 scale has one value, not {tensor.numel()}")
            rows.fill_(float(tensor.reshape(())))
        elif self.layout == "channel":
            rows.copy_(tensor.reshape(rows.shape[0], 1))
        else:
            spread = tensor.repeat_interleave(self.block[0], dim=0)[:rows.shape[0]]
            if spread.shape != rows.shape:
                raise ValueError(f"fp8 block scales of shape {list(tensor.shape)} do not cover {list(rows.shape)} "
                                 f"in blocks of {self.block}")
            rows.copy_(spread)

    def process_weights_after_loading(self, layer: Linear) -> None:
        if self.layout == "float":
            w8, scale = quantize_weight(layer.weight.data)
            block_k = layer.in_features
        else:
            w8, scale = layer.weight.data, getattr(layer, self.scale_name).data
            block_k = self.block_k or layer.in_features
            delattr(layer, self.scale_name)
            if self.input_scale:
                del layer.input_scale
        del layer.weight
        layer.fp8 = Fp8Weight(w8, scale, block_k, layer.bias, self.isa)

    def apply(self, layer: Linear, x: torch.Tensor) -> torch.Tensor:
        rows = x.numel() // layer.in_features
        y = layer.fp8.matmul(x.reshape(rows, layer.in_features), x.dtype)
        return y.to(x.dtype).view(*x.shape[:-1], layer.out_features)

    def native_linear(self, layer: Linear, rows: int, dtype: torch.dtype = torch.float32) -> NativeKernel | None:
        return layer.fp8.kernel if rows < NATIVE_ROWS and dtype == torch.float32 else None


class Fp8Quantization(QuantizationMethod):
    """Reads Fp8Config checkpoints (`quant_method` "fp8") and compressed-tensors float8 ones."""

    NAME = "fp8"

    def __init__(self, server_args: Any = None) -> None:
        super().__init__(server_args)
        self.isa = best_isa()

    def detects(self, model_path: str) -> bool:
        return compressed_tensors_fp8(checkpoint_quantization_config(model_path)) is not None

    def check(self, model_path: str) -> None:
        config = checkpoint_quantization_config(model_path)
        method = config.get("quant_method")
        if method == "compressed-tensors":
            compressed_tensors_fp8(config, refuse=True)
        elif method not in (None, "fp8", "w8a8_fp8"):
            raise ValueError(f"--quantization {self.NAME} cannot read a checkpoint quantized with {method!r}")
        kernels()   # a compiler error now, at launch
        logger.info("%s: weight-only float8, %s kernels", self.NAME, "AVX2" if self.isa else "portable")

    def linear_method(self, name: str, layer: nn.Linear) -> LinearMethod | None:
        config = dict(getattr(self.model_config, "quantization_config", None) or {})
        method = config.get("quant_method")
        if method is None:
            return Fp8LinearMethod("float", self.isa)
        if kept_float(name, config):
            return None
        if method == "compressed-tensors":
            scheme = compressed_tensors_fp8(config, refuse=True)
            weights = scheme["weights"]
            block = tuple(weights["block_structure"]) if weights.get("strategy") == "block" else None
            return Fp8LinearMethod(weights["strategy"], self.isa, block,
                                   input_scale=not (scheme.get("input_activations") or {}).get("dynamic", True))
        if method == "w8a8_fp8":
            return Fp8LinearMethod("channel", self.isa)
        if config.get("weight_block_size"):
            return Fp8LinearMethod("block", self.isa, tuple(config["weight_block_size"]), "weight_scale_inv",
                                   input_scale=config.get("activation_scheme") == "static")
        return Fp8LinearMethod("tensor", self.isa, input_scale=config.get("activation_scheme") == "static")


    def quantize_experts(self, name: str, layer: Any) -> bool:
        # A float8 checkpoint's experts, read as stored and widened to float once loaded: no MoE
        # runner computes float8 (no CPU has its arithmetic). A float checkpoint's stay float.
        method = self.linear_method(name, None)
        if method is None or method.layout == "float":
            return False
        scales = layer.take_stored(method.scale_name)
        if scales is None:
            return False
        layer.take_stored("input_scale")   # static activation scales: weight-only compute has no use for them
        for (local, shard), tensor in scales.items():
            weight = layer.shard_weight(local, shard)
            block_k = method.block_k or weight.shape[1]
            rows = torch.empty(weight.shape[0], -(-weight.shape[1] // block_k))
            method.load_scale(rows, tensor)
            weight.copy_(dequantize(weight, rows, block_k, weight.dtype))
        return True


class W8A8Fp8Quantization(Fp8Quantization):
    """SGLang's w8a8_fp8 (per-channel weights, per-token activations); weight-only here."""

    NAME = "w8a8_fp8"


def compressed_tensors_fp8(config: dict[str, Any], refuse: bool = False) -> dict[str, Any] | None:
    """The scheme of a compressed-tensors config with float8 e4m3 weights (tensor, channel or
    block scales), or None (with `refuse`, a ValueError saying what differs)."""
    group, why = compressed_tensors_scheme(config, ("float-quantized", "naive-quantized", None), {
        "weights": {"num_bits": 8, "type": "float", "symmetric": True, "strategy": ("tensor", "channel", "block")}})
    if group is not None and group["weights"]["strategy"] == "block" \
            and len(group["weights"].get("block_structure") or []) != 2:
        group, why = None, "has block strategy without a two-number block_structure"
    if group is None and refuse:
        raise ValueError(f"--quantization fp8 reads compressed-tensors float8 checkpoints; this one {why}")
    return group
