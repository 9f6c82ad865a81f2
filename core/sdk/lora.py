"""What a LoRA backend plugin provides (`--lora-backend`): the adapters' products of a batch.

A layer with adapters computes its base product for every row, then the backend adds each row's
adapter's `scaling * (x @ A.T) @ B.T` into the columns that adapter targets (a fused layer such
as qkv_proj holds several targets side by side). The rows of one request are contiguous, so a
batch is a list of segments (adapter slot, first row, end row); the backend groups them by
adapter (segmented grouped products, SGMV's idea) however it likes.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass
from typing import TYPE_CHECKING

if TYPE_CHECKING:   # annotations only: the HTTP process imports srv.sdk without torch
    import torch


@dataclass
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
