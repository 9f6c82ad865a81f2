"""The layer a LoRA adapter wraps (see srv.engine.lora)."""

from __future__ import annotations

from typing import Any

import torch
from torch import nn


class LoRALayer(nn.Module):
    """A linear layer plus its adapters' products: the base product for every row, then the
    backend adds each adapter's into its rows. Its C kernel (`native_linear`), where the base
    layer and the backend both have one, does the same from C, so a model's fused decode steps
    keep the layer; otherwise they stand aside while adapters are loaded."""

    def __init__(self, base: nn.Module, products: list, manager: Any) -> None:
        super().__init__()
        self.base, self.products, self.manager = base, products, manager

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = self.base(x)
        if self.manager.segments:
            self.manager.backend.add(out, x, self.products, self.manager.segments)
        return out

    def set_products(self, slot: int, products: list) -> None:
        """What the adapter in `slot` adds to this layer from now on."""
        self.products[slot] = products
        self.manager.backend.products_changed(self.products, slot)

    def native_linear(self, rows: int, dtype: torch.dtype = torch.float32):
        base = getattr(self.base, "native_linear", None)
        # The adapters' kernels add float32 products (see srv.sdk.linear.LinearMethod for dtype).
        kernel = base(rows) if base is not None and dtype == torch.float32 else None
        shape = getattr(self.base, "in_features", None), getattr(self.base, "out_features", None)
        if kernel is None or None in shape:
            return None
        return self.manager.backend.native_linear(kernel, self.products, *shape)
