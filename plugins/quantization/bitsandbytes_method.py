"""`--quantization bitsandbytes`: a float checkpoint's linear layers quantized as they load to
bitsandbytes' 4-bit NF4 (blocks of 64 weights of a row, a float32 absmax each), computed by
bitsandbytes' own kernels (its CPU backend here), as SGLang's in-flight bitsandbytes
quantization does. The vocabulary head stays float (bitsandbytes' `llm_int8_skip_modules`
default).

Checkpoints stored in bitsandbytes' format (`quantization_config.quant_method`
"bitsandbytes", `weight.absmax` and `weight.quant_state.*` tensors beside each weight) are
refused, saying so: srv reads their float originals.
"""

from __future__ import annotations

import torch
from torch import nn

from srv.sdk.linear import Linear, LinearMethod, parameter
from srv.sdk.quantization import QuantizationMethod, checkpoint_quantization_config

BLOCKSIZE = 64
QUANT_TYPE = "nf4"


def blocksize(in_features: int) -> int:
    """64, or 32 for a layer whose rows do not divide into 64s: bitsandbytes' CPU quantizer loses
    most of a block's precision where blocks straddle two rows."""
    return BLOCKSIZE if in_features % BLOCKSIZE == 0 else 32


class BnB4BitLinearMethod(LinearMethod):
    def __init__(self, dtype: torch.dtype) -> None:
        self.dtype = dtype

    def create_weights(self, layer: Linear) -> None:
        layer.register_parameter("weight", parameter(layer.out_features, layer.in_features, dtype=torch.float32))

    def process_weights_after_loading(self, layer: Linear) -> None:
        import bitsandbytes.functional as bnb_functional

        # Plain attributes: casting the model to the served dtype must leave the packed bytes.
        layer.packed, layer.quant_state = bnb_functional.quantize_4bit(
            layer.weight.data.to(self.dtype), blocksize=blocksize(layer.in_features), quant_type=QUANT_TYPE)
        del layer.weight

    def apply(self, layer: Linear, x: torch.Tensor) -> torch.Tensor:
        import bitsandbytes as bnb

        bias = None if layer.bias is None else layer.bias.to(self.dtype)
        return bnb.matmul_4bit(x.to(self.dtype), layer.packed.t(), layer.quant_state, bias=bias).to(x.dtype)


class BitsAndBytesQuantization(QuantizationMethod):
    def check(self, model_path: str) -> None:
        stored = checkpoint_quantization_config(model_path).get("quant_method")
        if stored == "bitsandbytes":
            raise ValueError("--quantization bitsandbytes quantizes float checkpoints as they load; checkpoints "
                             f"stored in bitsandbytes' format are not read yet ({model_path}): serve the float one")
        if stored:
            raise ValueError(f"--quantization bitsandbytes quantizes float checkpoints; {model_path} is stored "
                             f"quantized ({stored})")

    def linear_method(self, name: str, layer: nn.Linear) -> LinearMethod | None:
        if name.rsplit(".", 1)[-1] == "lm_head" or layer.in_features % 32:
            return None
        return BnB4BitLinearMethod(self.served_dtype or torch.float32)
