"""`--quantization bitsandbytes`: 4-bit NF4 or FP4 weights on bitsandbytes' own kernels (its CPU
backend here), in blocks of 64 weights of a row with a float32 absmax each.

- Checkpoints stored in bitsandbytes' 4-bit format (`quantization_config.quant_method`
  "bitsandbytes" with `load_in_4bit`, as transformers saves them) are read as stored: each
  layer's packed `weight` and, beside it, `weight.absmax`, `weight.quant_map`, the packed
  `weight.quant_state.bitsandbytes__nf4` (or `__fp4`) and, with double quantization,
  `weight.nested_absmax` and `weight.nested_quant_map`. Each shard of a fused projection has its
  own quant state: the layer keeps the shards' packed bytes end to end and their absmax values,
  dequantized from the nested state where there is one, in one state of its own. The layers in
  `llm_int8_skip_modules` (and the head) stay float. 8-bit (LLM.int8) checkpoints are refused.
- A float checkpoint is quantized as it loads to NF4, as SGLang's in-flight bitsandbytes
  quantization does; the head stays float (bitsandbytes' `llm_int8_skip_modules` default).
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from srv.sdk.linear import Linear, LinearMethod, parameter
from srv.sdk.quantization import QuantizationMethod, checkpoint_quantization_config, kept_float

BLOCKSIZE = 64
QUANT_TYPE = "nf4"


def blocksize(in_features: int) -> int:
    """64, or 32 for a layer whose rows do not divide into 64s: bitsandbytes' CPU quantizer loses
    most of a block's precision where blocks straddle two rows."""
    return BLOCKSIZE if in_features % BLOCKSIZE == 0 else 32


class BnB4BitLinearMethod(LinearMethod):
    """`stored`: the checkpoint holds the layer in bitsandbytes' format (`quant_type`, nested
    or not); otherwise a float weight, quantized once loaded."""

    def __init__(self, dtype: torch.dtype, stored: bool = False, quant_type: str = QUANT_TYPE,
                 nested: bool = False) -> None:
        self.dtype, self.stored, self.quant_type, self.nested = dtype, stored, quant_type, nested

    def stored_tensors(self) -> tuple[str, ...]:
        names = ("weight", "weight_absmax", "weight_quant_map", f"weight_quant_state_bitsandbytes__{self.quant_type}")
        return names + (("weight_nested_absmax", "weight_nested_quant_map") if self.nested else ())

    def create_weights(self, layer: Linear) -> None:
        if not self.stored:
            layer.register_parameter("weight", parameter(layer.out_features, layer.in_features, dtype=torch.float32))
            return
        # A shard's tensors are not rows of the layer (the absmax of flattened blocks, a nested
        # state, a packed JSON): each parameter is a placeholder a row per output whose loader
        # files the shard's tensor under the shard's first row, for process_weights_after_loading.
        layer.bnb_shards = {}
        for name in self.stored_tensors():
            layer.register_parameter(name, parameter(layer.out_features, 1, dtype=torch.uint8,
                                                     weight_loader=self._collect(layer, name)))

    @staticmethod
    def _collect(layer: Linear, name: str):
        def load(rows: torch.Tensor, tensor: torch.Tensor) -> None:
            first = rows.storage_offset() // max(rows.stride(0), 1)
            layer.bnb_shards.setdefault(first, {"rows": rows.shape[0]})[name] = tensor
        return load

    def process_weights_after_loading(self, layer: Linear) -> None:
        import bitsandbytes.functional as bnb_functional

        if not self.stored:
            # Plain attributes: casting the model to the served dtype must leave the packed bytes.
            layer.packed, layer.quant_state = bnb_functional.quantize_4bit(
                layer.weight.data.to(self.dtype), blocksize=blocksize(layer.in_features), quant_type=QUANT_TYPE)
            del layer.weight
            return
        packed, absmax, state = [], [], None
        for first in sorted(layer.bnb_shards):
            shard = layer.bnb_shards[first]
            state = bnb_functional.QuantState.from_dict(
                {name.removeprefix("weight_").replace("quant_state_", "quant_state."): shard[name]
                 for name in self.stored_tensors() if name != "weight"}, device=torch.device("cpu"))
            if tuple(state.shape) != (shard["rows"], layer.in_features):
                raise ValueError(f"a bitsandbytes shard of shape {list(state.shape)} in a layer of "
                                 f"[{shard['rows']}, {layer.in_features}] rows")
            scales = state.absmax
            if state.nested:
                scales = bnb_functional.dequantize_blockwise(state.absmax, state.state2) + state.offset
            packed.append(shard["weight"].reshape(-1, 1))
            absmax.append(scales.float())
        if sum(layer.bnb_shards[first]["rows"] for first in layer.bnb_shards) != layer.out_features:
            raise ValueError(f"the checkpoint's bitsandbytes shards cover {sorted(layer.bnb_shards)} of "
                             f"{layer.out_features} rows")
        layer.packed = torch.cat(packed)
        layer.quant_state = bnb_functional.QuantState(
            absmax=torch.cat(absmax), shape=torch.Size((layer.out_features, layer.in_features)), code=state.code,
            blocksize=state.blocksize, quant_type=state.quant_type, dtype=self.dtype)
        for name in self.stored_tensors():
            delattr(layer, name)
        del layer.bnb_shards

    def apply(self, layer: Linear, x: torch.Tensor) -> torch.Tensor:
        import bitsandbytes as bnb

        bias = None if layer.bias is None else layer.bias.to(self.dtype)
        return bnb.matmul_4bit(x.to(self.dtype), layer.packed.t(), layer.quant_state, bias=bias).to(x.dtype)


class BitsAndBytesQuantization(QuantizationMethod):
    def check(self, model_path: str) -> None:
        config = checkpoint_quantization_config(model_path)
        stored = config.get("quant_method")
        if stored == "bitsandbytes":
            stored_format(config)   # a ValueError for what is not read
        elif stored:
            raise ValueError(f"--quantization bitsandbytes reads bitsandbytes' 4-bit checkpoints and float ones; "
                             f"{model_path} is stored quantized with {stored}")

    def linear_method(self, name: str, layer: nn.Linear) -> LinearMethod | None:
        dtype = self.served_dtype or torch.float32
        config = dict(getattr(self.model_config, "quantization_config", None) or {})
        if config.get("quant_method") == "bitsandbytes":
            if kept_float(name, config):
                return None
            quant_type, nested = stored_format(config)
            return BnB4BitLinearMethod(dtype, stored=True, quant_type=quant_type, nested=nested)
        if name.rsplit(".", 1)[-1] == "lm_head" or layer.in_features % 32:
            return None
        return BnB4BitLinearMethod(dtype)


def stored_format(config: dict[str, Any]) -> tuple[str, bool]:
    """(quant type, double quantization) of a bitsandbytes quantization_config; ValueError for an
    8-bit one."""
    if not config.get("load_in_4bit", config.get("_load_in_4bit")):
        raise ValueError("--quantization bitsandbytes reads 4-bit bitsandbytes checkpoints; this one is 8-bit "
                         "(LLM.int8), which is not read")
    return str(config.get("bnb_4bit_quant_type", "fp4")), bool(config.get("bnb_4bit_use_double_quant"))
