"""`--torchao-config`: quantize a float checkpoint's linear layers with torchao at load, as
SGLang's flag does (its values: int8wo, int8dq, int4wo-<group size>, fp8wo, fp8dq-per_tensor,
fp8dq-per_row, gemlite-...).

On CPU torchao computes:
- int8wo: int8 weights per output channel, activations in the served dtype
  (`Int8WeightOnlyConfig`);
- int8dq: int8 weights, activations quantized per token at run time
  (`Int8DynamicActivationInt8WeightConfig`);
- int4wo-<g>: 4-bit weights in groups of g inputs. SGLang's `Int4WeightOnlyConfig` packs for
  CUDA's tinygemm (or needs the mslk kernels), so on CPU the same quantization is torchao's
  `IntxWeightOnlyConfig(weight_dtype=int4, granularity=PerGroup(g))`;
- fp8wo: float8 e4m3 weights (`Float8WeightOnlyConfig`).
fp8dq-* needs a GPU with float8 arithmetic (CUDA compute capability 8.9+, MI300) and gemlite-*
its Triton kernels; both are refused, saying so.

The method is chosen by the flag itself (its `detects` claims the launch when the flag is set),
or `--quantization torchao`. Every linear layer but the vocabulary head is quantized, in the
served dtype, once the weights have loaded. These are torchao's own kernels: srv's
`--quantization w8a8_int8` is the fast int8 path on this machine (BENCHMARKS.md).
"""

from __future__ import annotations

import logging
import re
from typing import Any

import torch
from torch import nn
from torch.nn import functional as F

from srv.sdk.quantization import QuantizationMethod, checkpoint_quantization_config

logger = logging.getLogger("srv.quantization")

GPU_ONLY = {"fp8dq-per_tensor": "float8 dynamic quantization: CUDA compute capability 8.9+ or MI300",
            "fp8dq-per_row": "float8 dynamic quantization: CUDA compute capability 8.9+ or MI300"}


def torchao_config(value: str) -> Any:
    """torchao's config object for one of SGLang's `--torchao-config` values (ValueError else)."""
    if value in GPU_ONLY or value.startswith("gemlite"):
        raise ValueError(f"--torchao-config {value} needs {GPU_ONLY.get(value, 'gemlite Triton kernels (CUDA)')}; "
                         "on CPU: int8wo, int8dq, int4wo-<group size>, fp8wo")
    try:
        import torch
        import torchao.quantization as ao
    except ImportError as exc:
        raise ValueError(f"--torchao-config needs torchao (pip install torchao): {exc}") from None
    if value == "int8wo":
        return ao.Int8WeightOnlyConfig()
    if value == "int8dq":
        return ao.Int8DynamicActivationInt8WeightConfig()
    if value == "fp8wo":
        return ao.Float8WeightOnlyConfig()
    match = re.fullmatch(r"int4wo-(\d+)", value)
    if match and int(match[1]) in (32, 64, 128, 256):
        return ao.IntxWeightOnlyConfig(weight_dtype=torch.int4, granularity=ao.PerGroup(int(match[1])))
    raise ValueError(f"--torchao-config {value!r}: one of int8wo, int8dq, int4wo-<32|64|128|256>, fp8wo "
                     "(fp8dq-per_tensor, fp8dq-per_row and gemlite-* need a GPU)")


class TorchAOQuantization(QuantizationMethod):
    def __init__(self, server_args: Any = None) -> None:
        super().__init__(server_args)
        self.value = getattr(server_args, "torchao_config", None) or ""

    def detects(self, model_path: str) -> bool:
        return bool(self.value)

    def check(self, model_path: str) -> None:
        if not self.value:
            raise ValueError("--quantization torchao needs --torchao-config (int8wo, int8dq, int4wo-<group size>, "
                             "fp8wo)")
        stored = checkpoint_quantization_config(model_path).get("quant_method")
        if stored:
            raise ValueError(f"--torchao-config quantizes float checkpoints; {model_path} is stored quantized "
                             f"({stored})")
        self.config = torchao_config(self.value)

    def apply(self, model: nn.Module) -> int:
        from torchao.quantization import quantize_

        config = getattr(self, "config", None) or torchao_config(self.value)
        targets = [(name, module) for name, module in model.named_modules()
                   if isinstance(module, nn.Linear) and name.rsplit(".", 1)[-1] != "lm_head"]
        for name, module in targets:
            # In the served dtype first: torchao's tensors keep the dtype they were made in.
            module.to(self.served_dtype or torch.float32)
            quantize_(module, config, filter_fn=lambda m, fqn: isinstance(m, nn.Linear))
            parent, _, leaf = name.rpartition(".")
            setattr(model.get_submodule(parent), leaf, TorchAOLinear(module))
        logger.info("torchao %s: %d linear layers quantized", self.value, len(targets))
        return len(targets)


class TorchAOLinear(nn.Module):
    """y = x W^T + b with W torchao's quantized tensor (a subclass computing its own products):
    no longer an nn.Linear, which a model may repack for its own kernels."""

    def __init__(self, linear: nn.Linear) -> None:
        super().__init__()
        self.in_features, self.out_features = linear.in_features, linear.out_features
        self.weight, self.bias = linear.weight, linear.bias

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.linear(x, self.weight, self.bias)
