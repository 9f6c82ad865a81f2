"""Base class for weight quantization methods (`--quantization`).

A method acts at two points of a launch:

1. `prepare`, on the model just built on the meta device, before any weight is read: each
   linear layer the method claims (`linear_method` returns a `srv.sdk.linear.LinearMethod`)
   becomes a `srv.sdk.linear.Linear` slot holding the weights in the method's format, which
   the loader fills from the checkpoint by name. This is how a checkpoint stored quantized
   (int8 weights with their scales) is read as it is, and how a float checkpoint is quantized
   as it loads (the slot takes float weights and quantizes them in
   `process_weights_after_loading`).
2. `apply`, once the loader is done: every slot's `process_weights_after_loading`, then
   `quantize` on each remaining `nn.Linear`, for a method that recovers its format from
   weights a loader has already turned to float (gguf: the GGUF loader dequantizes the file).

A MoE model's experts (srv.sdk.moe.FusedMoE) are offered to `quantize_experts` in `apply`; a
linear layer marked `unquantized` (a router, whose scores pick the experts) is never claimed.

The model is then cast to the served dtype (`Module.to` casts floating parameters and buffers,
so keep quantized data that must not be cast as plain attributes) and handed to the model
implementation's `finalize`. A replacement may keep an `nn.Linear` inside it (a dense copy for
large batches, say); `finalize` repacks that one like any other.

A replacement may also offer `native_linear(rows) -> srv.sdk.native.NativeKernel | None`: a C
kernel computing its float32 forward for batches of `rows` rows, to the bit. A model that has
one for every product of its layers runs its decode steps' layers in C (srv's Llama does). The
kit checks that kernel against `forward`. A model served in bf16 may also ask
`native_linear(rows, torch.bfloat16)` for larger decode steps: the product of float32 rows in the
bf16 forward's arithmetic (rows and weights rounded to bf16, float32 sums), or None (the Python
layers then run the step); a replacement that takes no `dtype` is asked for float32 only.
"""

from __future__ import annotations

import json
import logging
import re
from abc import ABC
from pathlib import Path
from typing import Any

from torch import nn

from srv.sdk.linear import Linear, LinearMethod
from srv.sdk.moe import FusedMoE

logger = logging.getLogger("srv.quantization")


class QuantizationMethod(ABC):
    model_config: Any = None   # the checkpoint's config, from `prepare`
    # The dtype `--dtype auto` serves a model with this method in; None: the machine's choice
    # (bf16 where the CPU computes it natively, float32 elsewhere). A method whose kernels take
    # float32 activations names float32, so no product converts its input and output.
    activation_dtype: Any = None
    # The dtype the model is served in, set by srv before `prepare`.
    served_dtype: Any = None
    # Whether the method's weights split across tensor-parallel ranks (srv.sdk.layers cuts each
    # checkpoint tensor by rows or columns before `load_weight`). srv refuses --tensor-parallel-size
    # > 1 with a method that does not say so, and serves a detected format's dequantized weights.
    tensor_parallel = False
    # Whether `apply` computes from the float weights the loader filled (a method that quantizes
    # a float checkpoint at load): they are loaded in float32 then, and the model is converted to
    # the served dtype after `apply`. A method that takes its weights from the checkpoint in its
    # own format says False, and the float weights load straight in the served dtype.
    reads_float_weights = True

    def __init__(self, server_args: Any = None) -> None:
        self.server_args = server_args

    def check(self, model_path: str) -> None:
        """Raise ValueError if this method cannot serve the model at `model_path` (optional)."""

    def detects(self, model_path: str) -> bool:
        """Whether the checkpoint at `model_path` is in this method's format (or the launch's
        flags, `self.server_args`, ask for this method), so that srv serves it this way when
        `--quantization` is unset. Asked in order of priority, before a checkpoint whose
        config.json names its method in quantization_config gets that method. Optional."""
        return False

    def linear_method(self, name: str, layer: nn.Linear) -> LinearMethod | None:
        """The weights' format for the linear layer `name` of the model (built on the meta
        device, not loaded), or None to leave it to `quantize` after loading. `self.model_config`
        is the checkpoint's config (its quantization_config says how it is stored)."""
        return None

    def quantize(self, name: str, linear: nn.Linear) -> nn.Module | None:
        """The module that replaces the loaded float layer `linear` (named `name`), or None to
        keep it."""
        return None

    def prepare(self, model: nn.Module, model_config: Any = None) -> int:
        """Put a `Linear` slot wherever `linear_method` claims a layer; returns how many. Called
        on the meta device, where the slots' parameters are created too."""
        self.model_config = model_config
        slots = 0
        for name, module in list(model.named_modules()):
            if isinstance(module, nn.Linear) and not getattr(module, "unquantized", False):
                method = self.linear_method(name, module)
                if method is not None:
                    parent, _, leaf = name.rpartition(".")
                    slot = Linear(module.in_features, module.out_features, module.bias is not None, method)
                    # A tensor-parallel layer's part of each checkpoint tensor (srv.sdk.layers).
                    if getattr(module, "sharding", None) is not None:
                        slot.sharding = module.sharding
                    setattr(model.get_submodule(parent), leaf, slot)
                    slots += 1
        return slots

    def apply(self, model: nn.Module) -> int:
        """Finish every slot's weights, then replace every linear layer `quantize` accepts;
        returns how many layers are quantized in all."""
        replaced = 0
        for module in model.modules():
            if isinstance(module, Linear):
                module.method.process_weights_after_loading(module)
                replaced += 1
        experts = 0
        for name, module in list(model.named_modules()):
            if isinstance(module, nn.Linear) and not getattr(module, "unquantized", False):
                replacement = self.quantize(name, module)
                if replacement is not None:
                    parent, _, leaf = name.rpartition(".")
                    setattr(model.get_submodule(parent), leaf, replacement)
                    replaced += 1
            elif isinstance(module, FusedMoE) and self.quantize_experts(name, module):
                experts += 1
        logger.info("%s: %d linear layers quantized%s", type(self).__name__, replaced,
                    f", {experts} expert layers" if experts else "")
        return replaced + experts

    def quantize_experts(self, name: str, layer: FusedMoE) -> bool:
        """Turn a MoE layer's loaded float experts (srv.sdk.moe.FusedMoE) into this method's
        format, in place; whether it did (optional: by default experts stay in the served dtype)."""
        return False


def checkpoint_quantization_config(model_path: str) -> dict[str, Any]:
    """The `quantization_config` of the config.json in the directory `model_path` ({} when there
    is none, or `model_path` is a file)."""
    config = Path(model_path) / "config.json"
    if not config.is_file():
        return {}
    return json.loads(config.read_text()).get("quantization_config") or {}


def compressed_tensors_scheme(config: dict[str, Any], formats: tuple[str | None, ...],
                              requirements: dict[str, dict[str, Any]]) -> tuple[dict[str, Any] | None, str]:
    """The one config group of a compressed-tensors `quantization_config` whose format is one of
    `formats` and whose "weights" and "input_activations" schemes have the values
    `requirements` names (a tuple of values: any of them), and "" — or None and why not."""
    if config.get("quant_method") != "compressed-tensors":
        return None, "is not compressed-tensors"
    if config.get("format") not in formats:
        return None, f"has format {config.get('format')!r}, not {next(f for f in formats if f)!r}"
    groups = list((config.get("config_groups") or {}).values())
    if len(groups) != 1:
        return None, f"has {len(groups)} config groups, not one"
    for role, wanted in requirements.items():
        scheme = groups[0].get(role) or {}
        for key, value in wanted.items():
            allowed = value if isinstance(value, tuple) else (value,)
            if scheme.get(key) not in allowed:
                return None, (f"quantizes its {role.replace('_', ' ')} with {key}={scheme.get(key)!r}, not "
                              f"{' or '.join(map(repr, allowed))}")
    return groups[0], ""


def kept_float(name: str, config: dict[str, Any]) -> bool:
    """Whether a checkpoint stored quantized keeps the model's linear layer `name` in float: the
    head (SGLang computes heads unquantized), and the layers its config lists as left alone
    (compressed-tensors' `ignore`, Fp8Config's `ignored_layers`, `modules_to_not_convert`,
    bitsandbytes' `llm_int8_skip_modules`):
    module names, or "re:" patterns, matched with or without the checkpoint's "model." prefix."""
    if name.rsplit(".", 1)[-1] == "lm_head":
        return True
    names = {name, f"model.{name}"}
    for key in ("ignore", "ignored_layers", "modules_to_not_convert", "llm_int8_skip_modules"):
        for pattern in config.get(key) or []:
            if pattern.startswith("re:"):
                if any(re.fullmatch(pattern[3:], n) for n in names):
                    return True
            elif pattern in names:
                return True
    return False

