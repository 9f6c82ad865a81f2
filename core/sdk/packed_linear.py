"""Linear layers on oneDNN with weights reordered once, after loading, into its blocked layout:
for models' float layers, and for the dense copies quantization methods compute large batches
with.

A plain `F.linear` on CPU either reorders a bf16 weight on every call or, in float32, goes to
MKL; with the reorder done once, oneDNN's products are faster in both dtypes on SmolLM2's
shapes (BENCHMARKS.md has the measurements), and the vocabulary head is read at DRAM speed.
"""

from __future__ import annotations

import torch
from torch import nn


class PackedLinear(nn.Module):
    """Reorders its weight at its first product, not when built: a layer only some batches use
    (gguf's dense copies serve long prefills alone) costs nothing until then, and the 121
    reorders of the default model (0.3-0.4 s) stay out of the launch."""

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None) -> None:
        super().__init__()
        self.in_features, self.out_features = weight.shape[1], weight.shape[0]
        self.weight_dtype = weight.dtype   # `weight` itself is dropped once reordered
        self.register_buffer("weight", weight.detach(), persistent=False)
        self.register_buffer("packed_weight", None, persistent=False)
        self.bias = None if bias is None else nn.Parameter(bias.detach(), requires_grad=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.packed_weight is None:
            # oneDNN picks the blocking for this many rows. In float32 a hint of 1 made 16- and
            # 64-row products 1.3-1.5x slower than a hint of 16 or 64, which cost one row nothing.
            self.packed_weight = torch.ops.mkldnn._reorder_linear_weight(self.weight, 64)
            self.weight = None
        shape = x.shape
        out = torch.ops.mkldnn._linear_pointwise(x.reshape(-1, self.in_features), self.packed_weight, self.bias,
                                                 "none", [], "")
        return out.view(*shape[:-1], self.out_features)


def can_pack(dtype: torch.dtype) -> bool:
    if not torch.backends.mkldnn.is_available():
        return False
    return dtype == torch.float32 or (dtype == torch.bfloat16 and torch.ops.mkldnn._is_mkldnn_bf16_supported())


def pack_linear_layers(model: nn.Module) -> None:
    """Swap every float32 or bf16 nn.Linear for a PackedLinear."""
    if not can_pack(next(model.parameters()).dtype):
        return
    for name, module in list(model.named_modules()):
        if isinstance(module, nn.Linear):
            parent, _, leaf = name.rpartition(".")
            setattr(model.get_submodule(parent), leaf, PackedLinear(module.weight, module.bias))


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
