"""The reference backend: one scaled-dot-product attention per request over its gathered cache."""

from __future__ import annotations

import torch
from torch.nn import functional as F

from srv.sdk.attention import AttentionBackend, ForwardBatch


class TorchNativeAttention(AttentionBackend):
    def attend(self, q: torch.Tensor, layer_id: int, batch: ForwardBatch) -> torch.Tensor:
        cache = batch.kv_cache
        out = torch.empty_like(q)
        start = 0
        for i, (prefix, extend) in enumerate(zip(batch.prefix_lens, batch.extend_lens)):
            slots = batch.kv_slots[i, : prefix + extend]
            qi = q[start : start + extend].transpose(0, 1)
            ki = cache.keys(layer_id, slots, q.dtype).transpose(0, 1)
            vi = cache.values(layer_id, slots, q.dtype).transpose(0, 1)
            # Query j sits at position prefix + j and sees every key up to it.
            mask = torch.ones(extend, prefix + extend, dtype=torch.bool).tril(diagonal=prefix)
            oi = F.scaled_dot_product_attention(qi, ki, vi, attn_mask=mask, scale=self.scale,
                                                enable_gqa=self.num_heads != self.num_kv_heads)
            out[start : start + extend] = oi.transpose(0, 1)
            start += extend
        return out
