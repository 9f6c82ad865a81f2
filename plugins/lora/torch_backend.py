"""The torch LoRA backend: per adapter, its rows gathered once, then per target two matmuls
(rank-sized, so cheap beside the base product) added into the target's columns."""

from __future__ import annotations

import torch

from srv.sdk.lora import LoRABackend, LoRAProduct, LoRASegment


class TorchLoRABackend(LoRABackend):
    def add(self, out: torch.Tensor, x: torch.Tensor, products: list[list[LoRAProduct]],
            segments: list[LoRASegment]) -> None:
        rows: dict[int, list[int]] = {}
        for segment in segments:
            if segment.slot >= 0 and products[segment.slot]:
                rows.setdefault(segment.slot, []).extend(range(segment.start, segment.end))
        for slot, indices in rows.items():
            index = torch.tensor(indices)
            xs = x.index_select(0, index)
            for product in products[slot]:
                delta = (xs @ product.a.t()) @ product.b.t()
                columns = slice(product.offset, product.offset + product.b.shape[0])
                out[index, columns] += (product.scaling * delta).to(out.dtype)


class GPUOnlyLoRABackend(LoRABackend):
    def __init__(self, server_args=None) -> None:
        raise RuntimeError("this LoRA backend runs only on a GPU (see `srv plugins`)")

    def add(self, out, x, products, segments) -> None:  # pragma: no cover - never built
        raise NotImplementedError
