"""Base class for weight quantization methods (`--quantization`).

A method runs once, when the loader has filled the model with float32 weights: it replaces
linear layers with modules of its own that compute the same product from quantized weights.
The model is then cast to the served dtype (`Module.to` casts parameters and buffers, so keep
quantized data that must not be cast as plain attributes) and handed to the model
implementation's `finalize`. A replacement may keep an `nn.Linear` inside it (a dense copy for
large batches, say); `finalize` repacks that one like any other.

A replacement may also offer `native_linear(rows) -> srv.sdk.native.NativeKernel | None`: a C
kernel computing its float32 forward for batches of `rows` rows, to the bit. A model that has
one for every product of its layers runs its decode steps' layers in C (srv's Llama does). The
kit checks that kernel against `forward`.
"""

from __future__ import annotations

import logging
from abc import ABC, abstractmethod
from typing import Any

from torch import nn

logger = logging.getLogger("srv.quantization")


class QuantizationMethod(ABC):
    def __init__(self, server_args: Any = None) -> None:
        self.server_args = server_args

    def check(self, model_path: str) -> None:
        """Raise ValueError if this method cannot serve the model at `model_path` (optional)."""

    def detects(self, model_path: str) -> bool:
        """Whether the checkpoint at `model_path` is in this method's format, so that srv serves
        it this way when `--quantization` is unset (a checkpoint whose config.json names its
        method in quantization_config gets that method without asking). Optional."""
        return False

    @abstractmethod
    def quantize(self, name: str, linear: nn.Linear) -> nn.Module | None:
        """The module that replaces `linear` (named `name` in the model), or None to keep it."""

    def apply(self, model: nn.Module) -> int:
        """Replace every linear layer `quantize` accepts; returns how many were replaced."""
        replaced = 0
        for name, module in list(model.named_modules()):
            if isinstance(module, nn.Linear):
                replacement = self.quantize(name, module)
                if replacement is not None:
                    parent, _, leaf = name.rpartition(".")
                    setattr(model.get_submodule(parent), leaf, replacement)
                    replaced += 1
        logger.info("%s: %d linear layers quantized", type(self).__name__, replaced)
        return replaced
