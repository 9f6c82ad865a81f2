"""`--quantization gptq`, `awq` (and `gptq_marlin`, `awq_marlin`: the names SGLang upgrades them
to on a GPU, served here by the same CPU code) and compressed-tensors' `pack-quantized`
checkpoints: integer weights in groups of inputs, packed into int32 words.

Every layout stores, for a layer y = x W^T with W [N, K], integer weights q, and per group of
inputs g a float scale s and an integer zero point z:

    W[n, k] = s[g(k), n] * (q[k, n] - z[g(k), n])

- GPTQ (AutoGPTQ, GPTQModel): `qweight` int32 [K * bits / 32, N], each word holding 32 / bits
  consecutive inputs of one output, the first in the low bits; `qzeros` int32 [G, N * bits / 32],
  outputs packed the same way; `scales` float16 [G, N]; `g_idx` int32 [K], each input's group (a
  permutation of groups where the checkpoint was made with `desc_act`). Checkpoint format "gptq"
  stores each zero point minus one, "gptq_v2" the zero point itself. Bits 2, 4 and 8.
- AWQ (AutoAWQ "gemm"): `qweight` int32 [K, N / 8], eight outputs a word in the order
  0, 2, 4, 6, 1, 3, 5, 7 from the low bits; `qzeros` int32 [G, N / 8] the same; `scales`
  float16 [G, N]; input k is in group k // group_size. 4 bits.
- compressed-tensors `pack-quantized` (llm-compressor's W4A16 and W8A16): `weight_packed` int32
  [N, K * bits / 32], inputs packed as GPTQ packs them, of values offset by 2^(bits - 1) (the
  stored integers are signed); `weight_scale` [N, G]; `weight_zero_point` int32
  [N * bits / 32, G] packed along the outputs (asymmetric schemes; symmetric ones have zero
  points 0); `weight_g_idx` [K] where made with activation ordering by group.

A float checkpoint is quantized as it loads: 4 bits, asymmetric, in groups of 32 inputs (the
kernels' blocks are 32 inputs whatever the group, so smaller groups cost no speed), each group's
range the shrunk min..max that rebuilds its weights with the least squared error.

All of these become one form once loaded: q, z, s with the inputs sorted by group (a model
made with activation ordering gathers its activations in that order), which for 4 bits and
groups of a multiple of 32 is GGUF's Q4_1 layout (w = d * q + m, m = -s * z, both exact in
float32) and for 8 bits with z = 128 its Q8_0 (q - 128): decode batches run the gguf plugin's
C kernels (AVX2 and FMA), reading 4.5 or 8.5 bits a weight. Larger batches, and machines or
layouts those kernels do not take, compute with the weights dequantized in the served dtype
(oneDNN's prepacked layer where it computes that dtype), made at the layer's first such batch
and kept.
"""

from __future__ import annotations

import logging
from typing import Any

import torch
from torch import nn

from srv.plugins.quantization import gguf
from srv.sdk import requires_cpu_flags
from srv.sdk.linear import Linear, LinearMethod, parameter
from srv.sdk.native import NativeKernel
from srv.sdk.packed_linear import dense_layer
from srv.sdk.quantization import (QuantizationMethod, checkpoint_quantization_config,
                                  compressed_tensors_scheme, kept_float)

logger = logging.getLogger("srv.quantization")

AWQ_ORDER = (0, 2, 4, 6, 1, 3, 5, 7)   # slot i of an AWQ word holds output AWQ_ORDER[i] of its eight
LOAD_TIME_BITS = 4
LOAD_TIME_GROUPS = (32,)
LOAD_TIME_RANGES = (1.0, 0.95, 0.9, 0.85, 0.8, 0.75)


def unpack(words: torch.Tensor, bits: int, dim: int, order: tuple[int, ...] | None = None) -> torch.Tensor:
    """int32 `words` with 32 / bits unsigned values each, from the low bits, unpacked along `dim`
    (value j of word i is element i * 32 / bits + j; with `order`, element i * 8 + order[j])."""
    per_word = 32 // bits
    shifts = torch.arange(0, 32, bits, dtype=torch.int32)
    values = (words.unsqueeze(-1) >> shifts) & ((1 << bits) - 1)   # [..., words, per_word]
    if order is not None:
        values = values[..., torch.tensor(order).argsort()]
    values = values.to(torch.int16)
    if dim in (0, -words.dim()):
        values = values.movedim(-1, 1).reshape(words.shape[0] * per_word, *words.shape[1:])
        return values
    return values.reshape(*words.shape[:-1], words.shape[-1] * per_word)


class PackedWeight:
    """A layer's weights once loaded: q [N, K], zeros and scales [N, G] with `groups` [K] (each
    input's group), the Q4_1 or Q8_0 weights of gguf's kernels where they take the layer, and
    the permutation of inputs that sorts them by group (None where they already are)."""

    def __init__(self, q: torch.Tensor, zeros: torch.Tensor, scales: torch.Tensor, groups: torch.Tensor,
                 bits: int, bias: torch.Tensor | None, use_kernels: bool) -> None:
        self.bits, self.out_features, self.in_features = bits, q.shape[0], q.shape[1]
        self.q, self.zeros, self.scales, self.groups = q, zeros.float(), scales.float(), groups.long()
        self.bias = None if bias is None else bias.detach().float().contiguous()
        self.dense: dict[torch.dtype, nn.Module] = {}
        self.perm = None
        if bool((groups[1:] < groups[:-1]).any()):
            self.perm = torch.argsort(groups, stable=True)
        self.block = self._blocks() if use_kernels else None

    def dequantized(self) -> torch.Tensor:
        """W [N, K] in float32, inputs in the model's order."""
        g = self.groups
        return (self.q.float() - self.zeros[:, g]) * self.scales[:, g]

    def _blocks(self) -> gguf.BlockWeight | None:
        if self.in_features % gguf.GROUP:
            return None
        q, groups = (self.q, self.groups) if self.perm is None else (self.q[:, self.perm], self.groups[self.perm])
        per_block = groups.view(-1, gguf.GROUP)
        if not bool((per_block == per_block[:, :1]).all()):
            return None   # a block of 32 inputs spans two groups
        block_group = per_block[:, 0]
        scale = self.scales[:, block_group].contiguous()
        if self.bits == 4:
            return gguf.Q4_1Weight.from_blocks(q.to(torch.uint8), scale,
                                               (-self.scales * self.zeros)[:, block_group].contiguous())
        if self.bits == 8 and bool((self.zeros == 128).all()):
            return gguf.Q8_0Weight.from_blocks(q - 128, scale)
        return None

    def matmul(self, x: torch.Tensor) -> torch.Tensor:
        """x [M, K] -> [M, N] in x's dtype."""
        rows = x.shape[0]
        limit = gguf.DENSE_FROM_FLOAT32_ROWS if x.dtype == torch.float32 else gguf.DENSE_FROM_OTHER_DTYPES_ROWS
        if self.block is not None and rows < limit:
            x32 = x.float() if self.perm is None else x.float()[:, self.perm]
            y = self.block.matmul(x32.contiguous())
            if self.bias is not None:
                y += self.bias
            return y.to(x.dtype)
        if x.dtype not in self.dense:
            self.dense[x.dtype] = dense_layer(self.dequantized().to(x.dtype),
                                              None if self.bias is None else self.bias.to(x.dtype))
        return self.dense[x.dtype](x)


class PackedLayout:
    """How one checkpoint format stores a layer: its parameters (output features first, as
    srv.sdk.linear asks) and how they unpack."""

    def __init__(self, bits: int, group_size: int) -> None:
        self.bits, self.group_size = bits, group_size

    def groups(self, k: int) -> int:
        return 1 if self.group_size in (-1, 0) else -(-k // self.group_size)

    def default_groups(self, k: int) -> torch.Tensor:
        size = k if self.group_size in (-1, 0) else self.group_size
        return torch.arange(k) // size

    def create_weights(self, layer: Linear) -> None:
        raise NotImplementedError

    def unpack(self, layer: Linear) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
        """(q [N, K], zeros [N, G], scales [N, G], groups [K]), removing the layer's parameters."""
        raise NotImplementedError


def transposed(rows: torch.Tensor, tensor: torch.Tensor) -> None:
    """A checkpoint tensor stored inputs first, copied onto the parameter's output rows."""
    if tensor.t().shape != rows.shape:
        raise ValueError(f"checkpoint tensor of shape {list(tensor.shape)}, the layer's {list(rows.t().shape)}")
    rows.copy_(tensor.t())


def whole(rows: torch.Tensor, tensor: torch.Tensor) -> None:
    """A tensor of the inputs (g_idx), the same for every shard of a fused layer."""
    if tensor.shape != rows.shape:
        raise ValueError(f"checkpoint tensor of shape {list(tensor.shape)}, the layer's {list(rows.shape)}")
    rows.copy_(tensor)


class GPTQLayout(PackedLayout):
    def __init__(self, bits: int, group_size: int, zeros_minus_one: bool) -> None:
        super().__init__(bits, group_size)
        self.zeros_minus_one = zeros_minus_one

    def create_weights(self, layer: Linear) -> None:
        n, k, per_word, g = layer.out_features, layer.in_features, 32 // self.bits, self.groups(layer.in_features)
        layer.register_parameter("qweight", parameter(n, k // per_word, dtype=torch.int32, weight_loader=transposed))
        layer.register_parameter("qzeros", parameter(n // per_word, g, dtype=torch.int32, weight_loader=transposed,
                                                     outputs_per_row=per_word))
        layer.register_parameter("scales", parameter(n, g, dtype=torch.float32, weight_loader=transposed))
        layer.register_parameter("g_idx", parameter(k, dtype=torch.int32, weight_loader=whole, outputs_per_row=None))

    def unpack(self, layer: Linear):
        q = unpack(layer.qweight.data, self.bits, dim=1)
        zeros = unpack(layer.qzeros.data, self.bits, dim=0) + int(self.zeros_minus_one)
        scales, groups = layer.scales.data, layer.g_idx.data
        for name in ("qweight", "qzeros", "scales", "g_idx"):
            delattr(layer, name)
        return q, zeros, scales, groups


class AWQLayout(PackedLayout):
    def create_weights(self, layer: Linear) -> None:
        n, k, g = layer.out_features, layer.in_features, self.groups(layer.in_features)
        layer.register_parameter("qweight", parameter(n // 8, k, dtype=torch.int32, weight_loader=transposed,
                                                      outputs_per_row=8))
        layer.register_parameter("qzeros", parameter(n // 8, g, dtype=torch.int32, weight_loader=transposed,
                                                     outputs_per_row=8))
        layer.register_parameter("scales", parameter(n, g, dtype=torch.float32, weight_loader=transposed))

    def unpack(self, layer: Linear):
        q = unpack(layer.qweight.data, 4, dim=0, order=AWQ_ORDER)
        zeros = unpack(layer.qzeros.data, 4, dim=0, order=AWQ_ORDER)
        scales = layer.scales.data
        for name in ("qweight", "qzeros", "scales"):
            delattr(layer, name)
        return q, zeros, scales, self.default_groups(layer.in_features)


class PackQuantizedLayout(PackedLayout):
    """compressed-tensors' pack-quantized; `weight_shape` is read and checked."""

    def __init__(self, bits: int, group_size: int, symmetric: bool, g_idx: bool) -> None:
        super().__init__(bits, group_size)
        self.symmetric, self.g_idx = symmetric, g_idx

    def create_weights(self, layer: Linear) -> None:
        n, k, per_word, g = layer.out_features, layer.in_features, 32 // self.bits, self.groups(layer.in_features)
        layer.register_parameter("weight_packed", parameter(n, k // per_word, dtype=torch.int32))
        layer.register_parameter("weight_scale", parameter(n, g, dtype=torch.float32))
        layer.register_parameter("weight_shape", parameter(2, dtype=torch.int64, weight_loader=self._check_shape(n, k),
                                                           outputs_per_row=None))
        if not self.symmetric:
            layer.register_parameter("weight_zero_point", parameter(n // per_word, g, dtype=torch.int32,
                                                                    outputs_per_row=per_word))
        if self.g_idx:
            layer.register_parameter("weight_g_idx", parameter(k, dtype=torch.int32, weight_loader=whole,
                                                               outputs_per_row=None))

    @staticmethod
    def _check_shape(n: int, k: int):
        def load(rows: torch.Tensor, tensor: torch.Tensor) -> None:
            # A fused layer's shards each give their own [rows, K]: only the inputs must agree.
            if int(tensor.reshape(-1)[1]) != k:
                raise ValueError(f"weight_shape {tensor.tolist()}: the layer has {k} inputs")
            rows.copy_(torch.tensor([n, k]))
        return load

    def unpack(self, layer: Linear):
        offset = 1 << (self.bits - 1)
        q = unpack(layer.weight_packed.data, self.bits, dim=1)
        if self.symmetric:
            zeros = torch.full((layer.out_features, self.groups(layer.in_features)), offset, dtype=torch.int16)
        else:
            zeros = unpack(layer.weight_zero_point.data, self.bits, dim=0)
            del layer.weight_zero_point
        groups = layer.weight_g_idx.data if self.g_idx else self.default_groups(layer.in_features)
        scales = layer.weight_scale.data
        for name in ("weight_packed", "weight_scale", "weight_shape") + (("weight_g_idx",) if self.g_idx else ()):
            delattr(layer, name)
        return q, zeros, scales, groups


class PackedIntLinearMethod(LinearMethod):
    """A layer stored in `layout`, or (layout None) a float layer quantized once loaded."""

    def __init__(self, layout: PackedLayout | None, use_kernels: bool) -> None:
        self.layout, self.use_kernels = layout, use_kernels

    def create_weights(self, layer: Linear) -> None:
        if self.layout is None:
            layer.register_parameter("weight", parameter(layer.out_features, layer.in_features, dtype=torch.float32))
        else:
            self.layout.create_weights(layer)

    def process_weights_after_loading(self, layer: Linear) -> None:
        if self.layout is None:
            q, zeros, scales, groups = quantize_weight(layer.weight.data)
            del layer.weight
            bits = LOAD_TIME_BITS
        else:
            q, zeros, scales, groups = self.layout.unpack(layer)
            bits = self.layout.bits
        layer.packed = PackedWeight(q, zeros, scales, groups, bits, layer.bias, self.use_kernels)

    def apply(self, layer: Linear, x: torch.Tensor) -> torch.Tensor:
        rows = x.numel() // layer.in_features
        return layer.packed.matmul(x.reshape(rows, layer.in_features)).view(*x.shape[:-1], layer.out_features)

    def native_linear(self, layer: Linear, rows: int, dtype: torch.dtype = torch.float32) -> NativeKernel | None:
        packed = layer.packed
        if packed.block is None or packed.perm is not None or packed.bias is not None \
                or rows >= gguf.DENSE_FROM_FLOAT32_ROWS or dtype != torch.float32:
            return None
        return packed.block.kernel


def quantize_weight(weight: torch.Tensor, bits: int = LOAD_TIME_BITS):
    """Round to nearest in asymmetric groups of a float weight [N, K], each group's range the one
    of LOAD_TIME_RANGES (shares of its min..max) whose weights rebuild with the least squared
    error: (q, zeros, scales, groups)."""
    n, k = weight.shape
    size = next((g for g in LOAD_TIME_GROUPS if k % g == 0), k)
    top = (1 << bits) - 1
    blocks = weight.float().view(n, k // size, size)
    low, high = blocks.amin(-1).clamp(max=0), blocks.amax(-1).clamp(min=0)
    best = None
    for share in LOAD_TIME_RANGES:
        scales = ((high - low) * share / top).clamp_min(1e-10)
        zeros = (-low * share / scales).round_().clamp_(0, top)
        q = (blocks / scales[..., None] + zeros[..., None]).round_().clamp_(0, top)
        error = (q - zeros[..., None]).mul_(scales[..., None]).sub_(blocks).square_().sum(-1)
        if best is None:
            best = [q, zeros, scales, error]
        else:
            better = error < best[3]
            best[0] = torch.where(better[..., None], q, best[0])
            for i, value in ((1, zeros), (2, scales), (3, error)):
                best[i] = torch.where(better, value, best[i])
    q, zeros, scales, _ = best
    return q.view(n, k).to(torch.int16), zeros.to(torch.int16), scales, torch.arange(k) // size


def kernels_available() -> bool:
    """gguf's kernels (AVX2 and FMA, a C compiler), compiled now: an error at launch, not later."""
    if not requires_cpu_flags("avx2", "fma")().ok:
        return False
    try:
        gguf.kernels()
    except (OSError, RuntimeError) as exc:
        logger.warning("no C kernels for packed integer weights (%s): they compute dequantized", exc)
        return False
    return True


class PackedIntQuantization(QuantizationMethod):
    """The base of gptq, awq and their aliases: reads the formats above, each by its config."""

    NAME = "gptq"

    def __init__(self, server_args: Any = None) -> None:
        super().__init__(server_args)
        self.use_kernels: bool | None = None

    def check(self, model_path: str) -> None:
        config = checkpoint_quantization_config(model_path)
        if config:
            self.layout(config)   # a ValueError naming what is not read
        self.use_kernels = kernels_available()
        logger.info("%s: %s", self.NAME, "gguf's AVX2 kernels for decode" if self.use_kernels else "dequantized")

    def linear_method(self, name: str, layer: nn.Linear) -> LinearMethod | None:
        if self.use_kernels is None:
            self.use_kernels = kernels_available()
        config = dict(getattr(self.model_config, "quantization_config", None) or {})
        if not config.get("quant_method"):
            return PackedIntLinearMethod(None, self.use_kernels)
        if kept_float(name, config):
            return None
        return PackedIntLinearMethod(self.layout(config), self.use_kernels)

    def layout(self, config: dict[str, Any]) -> PackedLayout:
        method = config.get("quant_method")
        if method == "gptq":
            bits, group = int(config.get("bits", 4)), int(config.get("group_size", 128))
            if bits not in (2, 4, 8):
                raise ValueError(f"--quantization {self.NAME}: {bits}-bit GPTQ weights are not read (2, 4 and 8 are)")
            checkpoint = config.get("checkpoint_format", "gptq")
            if checkpoint not in ("gptq", "gptq_v2"):
                raise ValueError(f"--quantization {self.NAME}: GPTQ checkpoint_format {checkpoint!r} is not read "
                                 "(gptq and gptq_v2 are)")
            return GPTQLayout(bits, group, zeros_minus_one=checkpoint == "gptq")
        if method == "awq":
            bits = int(config.get("bits", config.get("w_bit", 4)))
            group = int(config.get("group_size", config.get("q_group_size", 128)))
            version = str(config.get("version", "gemm")).lower()
            if bits != 4 or version != "gemm" or not config.get("zero_point", True):
                raise ValueError(f"--quantization {self.NAME} reads AutoAWQ's 4-bit GEMM checkpoints with zero "
                                 f"points; this one has bits={bits}, version={version!r}, "
                                 f"zero_point={config.get('zero_point')}")
            return AWQLayout(bits, group)
        if method == "compressed-tensors":
            weights = compressed_tensors_packed(config, refuse=True, name=self.NAME)["weights"]
            group = int(weights.get("group_size") or -1) if weights["strategy"] == "group" else -1
            return PackQuantizedLayout(int(weights["num_bits"]), group, bool(weights["symmetric"]),
                                       g_idx=weights.get("actorder") in ("group", True))
        raise ValueError(f"--quantization {self.NAME} reads GPTQ, AWQ and compressed-tensors pack-quantized "
                         f"checkpoints, not {method!r}")


class GPTQQuantization(PackedIntQuantization):
    NAME = "gptq"

    def detects(self, model_path: str) -> bool:
        return compressed_tensors_packed(checkpoint_quantization_config(model_path)) is not None


class AWQQuantization(PackedIntQuantization):
    NAME = "awq"


def compressed_tensors_packed(config: dict[str, Any], refuse: bool = False, name: str = "gptq"):
    """The scheme of a compressed-tensors `pack-quantized` config with integer weights in groups
    or channels and float activations (W4A16, W8A16), or None (with `refuse`, a ValueError)."""
    group, why = compressed_tensors_scheme(config, ("pack-quantized",), {
        "weights": {"num_bits": (2, 4, 8), "type": "int", "strategy": ("group", "channel")}})
    if group is not None and group.get("input_activations"):
        group, why = None, "quantizes its input activations too"
    if group is None and refuse:
        raise ValueError(f"--quantization {name} reads compressed-tensors pack-quantized integer weights with "
                         f"float activations; this one {why}")
    return group
