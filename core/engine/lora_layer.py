"""The layer a LoRA adapter wraps (see srv.engine.lora)."""

from __future__ import annotations

from typing import Any

import torch
from torch import nn


class LoRALayer(nn.Module):
    """A linear layer plus its adapters' products: the base product for every row, then the
    backend adds each adapter's into its rows. It offers no native kernel, so the layers' fused C
    decode steps stand aside while adapters are loaded."""

    def __init__(self, base: nn.Module, products: list, manager: Any) -> None:
        super().__init__()
        self.base, self.products, self.manager = base, products, manager

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = self.base(x)
        if self.manager.segments:
            self.manager.backend.add(out, x, self.products, self.manager.segments)
        return out
