"""A linear layer whose weights a `LinearMethod` owns: the slot quantization plugins fill.

A model is built on the meta device with plain `nn.Linear` layers. Before any weight is read,
the chosen quantization method (`QuantizationMethod.linear_method`) may claim a layer: srv
then puts a `Linear` in its place, and the method's `create_weights` registers the parameters
the checkpoint holds for that layer in the method's own format (int8 `weight` and a float32
`weight_scale`, say). The loader fills them by their checkpoint names; a model that stores
projections fused (query, key and value in one layer) copies each checkpoint shard into rows
of each parameter, so every parameter a method creates is indexed by output feature along its
first dimension (the same split tensor parallelism will make): one output feature a row, or
`outputs_per_row` of them where a format packs several outputs into one element (eight 4-bit
zero points in an int32), or none where the tensor belongs to the inputs (GPTQ's `g_idx`,
which every shard of a fused layer shares: `outputs_per_row=None`). `shard_rows` says which
rows hold a shard. Once every weight is in,
`process_weights_after_loading` turns them into what `apply` computes with (quantizing a float
checkpoint at load, repacking for a kernel).

A parameter whose checkpoint tensor is not simply its rows (a per-tensor scale of one shard of
a fused layer, block scales to spread over rows) carries a `weight_loader(rows, tensor)`:
model implementations call `load_weight`, which hands it the parameter's rows for the shard
(the whole parameter for an unfused layer) and the checkpoint's tensor.

A method's parameters are cast with the model to the served dtype where they are floating
point; what must keep its dtype (scales) is kept as plain attributes by
`process_weights_after_loading`.
"""

from __future__ import annotations

from abc import ABC, abstractmethod

import torch
from torch import nn

from srv.sdk.native import NativeKernel


class LinearMethod(ABC):
    """How one linear layer stores its weights and computes y = x W^T (+ b)."""

    @abstractmethod
    def create_weights(self, layer: Linear) -> None:
        """Register the layer's parameters (`layer.register_parameter`), shaped from
        `layer.in_features` and `layer.out_features`, output features first. The bias, when the
        layer has one, is registered by `Linear` itself."""

    def process_weights_after_loading(self, layer: Linear) -> None:
        """Called once the loader has filled the parameters (optional)."""

    @abstractmethod
    def apply(self, layer: Linear, x: torch.Tensor) -> torch.Tensor:
        """x [..., in_features] in the served dtype -> [..., out_features] in the same dtype."""

    def native_linear(self, layer: Linear, rows: int, dtype: torch.dtype = torch.float32) -> NativeKernel | None:
        """A C kernel computing this layer's float32 forward for `rows` rows, to the bit (see
        srv.sdk.native.NativeKernel), or None. A model whose every product has one runs its
        decode steps' layers in C. With `dtype` bfloat16: the product of float32 rows in the
        arithmetic of the layer's bf16 forward (rows and weights rounded to bf16, float32
        sums), for a model served in bf16; None where there is none."""
        return None


class Linear(nn.Module):
    """y = method.apply(self, x), with the weights `method` created."""

    def __init__(self, in_features: int, out_features: int, bias: bool, method: LinearMethod) -> None:
        super().__init__()
        self.in_features, self.out_features, self.method = in_features, out_features, method
        method.create_weights(self)
        self.bias = nn.Parameter(torch.empty(out_features), requires_grad=False) if bias else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.method.apply(self, x)

    def native_linear(self, rows: int, dtype: torch.dtype = torch.float32) -> NativeKernel | None:
        return self.method.native_linear(self, rows, dtype)

    def extra_repr(self) -> str:
        return (f"in_features={self.in_features}, out_features={self.out_features}, bias={self.bias is not None}, "
                f"method={type(self.method).__name__}")


def parameter(*shape: int, dtype: torch.dtype, weight_loader=None, outputs_per_row: int | None = 1) -> nn.Parameter:
    """An empty parameter a method registers (frozen: srv never trains), with its
    `weight_loader(rows, tensor)` where the checkpoint's tensor needs one, and how many output
    features each of its rows holds (None: it is not indexed by output feature)."""
    param = nn.Parameter(torch.empty(*shape, dtype=dtype), requires_grad=False)
    if weight_loader is not None:
        param.weight_loader = weight_loader
    if outputs_per_row != 1:
        param.outputs_per_row = outputs_per_row
    return param


def shard_rows(param: torch.Tensor, start: int, size: int) -> torch.Tensor:
    """The rows of `param` that hold output features [start, start + size) of its layer (one
    shard of a fused projection): the whole parameter where it is not indexed by output."""
    per_row = getattr(param, "outputs_per_row", 1)
    if per_row is None:
        return param.data
    if start % per_row or size % per_row:
        raise ValueError(f"a shard of output features [{start}, {start + size}) splits rows that pack "
                         f"{per_row} outputs each")
    return param.data.narrow(0, start // per_row, size // per_row)


def load_weight(name: str, param: torch.Tensor, rows: torch.Tensor, tensor: torch.Tensor) -> None:
    """Fill `rows` (the parameter `param`, or its rows of one shard of a fused layer) from the
    checkpoint's `tensor` named `name`: through the parameter's weight_loader, else a copy of
    the same shape."""
    loader = getattr(param, "weight_loader", None)
    if loader is not None:
        loader(rows, tensor)
        return
    if tensor.shape != rows.shape:
        raise ValueError(f"checkpoint weight {name} has shape {list(tensor.shape)}, the model's {list(rows.shape)}")
    rows.copy_(tensor)


def checkpoint_key(name: str) -> str:
    """A checkpoint tensor's name as a model's parameter name. Formats that store tensors beside a
    layer's weight under its name (bitsandbytes' `q_proj.weight.absmax` and
    `q_proj.weight.quant_state.bitsandbytes__nf4`) name parameters no module can hold: they become
    `q_proj.weight_absmax` and `q_proj.weight_quant_state_bitsandbytes__nf4`, which a linear
    method registers."""
    head, dot_weight, tail = name.partition(".weight.")
    return f"{head}.weight_{tail.replace('.', '_')}" if dot_weight else name
