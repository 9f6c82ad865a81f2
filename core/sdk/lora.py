"""What a LoRA backend plugin provides (`--lora-backend`): the adapters' products of a batch.

A layer with adapters computes its base product for every row, then the backend adds each row's
adapter's `scaling * (x @ A.T) @ B.T` into the columns that adapter targets (a fused layer such
as qkv_proj holds several targets side by side). The rows of one request are contiguous, so a
batch is a list of segments (adapter slot, first row, end row); the backend groups them by
adapter (segmented grouped products, SGMV's idea) however it likes.

A backend with C kernels may also give each wrapped layer a kernel of srv.sdk.native's linear
kind (`native_linear`): the base layer's kernel, then the adapters' products of the batch's rows,
so a model's C decode steps keep the layer. Such a kernel is called without Python, so the core
tells the backend the batch's rows before each forward pass (`set_segments`) and each change of
what a slot adds to a layer (`products_changed`).
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass
from typing import TYPE_CHECKING

if TYPE_CHECKING:   # annotations only: the HTTP process imports srv.sdk without torch
    import torch

    from srv.sdk.native import NativeKernel


@dataclass(eq=False)   # compared by identity: a backend may key what it derives from one on it
class LoRAProduct:
    """One adapter's product for one target of a layer: output columns [offset, offset + B.rows)."""

    offset: int
    a: "torch.Tensor"      # [rank, in_features]
    b: "torch.Tensor"      # [out_columns, rank]
    scaling: float


@dataclass(frozen=True)
class LoRASegment:
    slot: int       # the adapter (an index into the layer's products)
    start: int      # the request's first row in the batch
    end: int


class LoRABackend(ABC):
    def __init__(self, server_args=None) -> None:
        self.server_args = server_args

    @abstractmethod
    def add(self, out: "torch.Tensor", x: "torch.Tensor", products: list[list[LoRAProduct]],
            segments: list[LoRASegment]) -> None:
        """Add, in place, each segment's adapter products to `out` [rows, out_features] from its
        rows of `x` [rows, in_features]; products[slot] lists what adapter `slot` adds to this
        layer (empty: it does not target it)."""

    def set_segments(self, segments: list[LoRASegment], rows: int) -> None:
        """Before each forward pass of `rows` rows: the segments of its adapters' rows, the list
        `add` is then handed. For backends whose C kernels read them from memory."""

    def products_changed(self, products: list[list[LoRAProduct]], slot: int) -> None:
        """The core gave a layer's slot other products: `products` is the layer's list (the one
        `add` and `native_linear` are handed), `products[slot]` what the slot adds now."""

    def native_linear(self, base: "NativeKernel", products: list[list[LoRAProduct]], in_features: int,
                      out_features: int) -> "NativeKernel | None":
        """A linear kernel (srv.sdk.native) for a wrapped layer whose base layer has one, `base`:
        the base product, then the current batch's adapter products from `products`, kept up to
        date by `products_changed`. None (the default): the layer has no C kernel while adapters
        are loaded, and a model's C decode steps stand aside."""
        return None
