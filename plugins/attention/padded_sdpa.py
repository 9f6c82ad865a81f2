"""A batched CPU backend: the whole ragged batch as one padded scaled-dot-product attention.

Queries are padded to the longest extend and keys to the longest sequence; one boolean mask
carries causality and the padding, so prefill chunks and decode steps mix in one call with no
Python loop per request. In bfloat16, torch runs it on oneDNN (AMX on CPUs that have it).
"""

from __future__ import annotations

import torch
from torch.nn import functional as F

from srv.sdk.attention import AttentionBackend, ForwardBatch


class PaddedSDPAAttention(AttentionBackend):
    def prepare(self, batch: ForwardBatch) -> None:
        extend = torch.tensor(batch.extend_lens)
        prefix = torch.tensor(batch.prefix_lens)
        max_extend, max_seq = int(extend.max()), batch.kv_slots.shape[1]
        j = torch.arange(max_extend)
        valid_query = j[None, :] < extend[:, None]                                   # [B, Q]
        query_pos = prefix[:, None] + j[None, :]                                     # [B, Q]
        key_pos = torch.arange(max_seq)
        mask = key_pos[None, None, :] <= query_pos[:, :, None]                       # [B, Q, K]
        # Padding query rows attend to key 0 so softmax stays finite; their output is dropped.
        mask |= (~valid_query[:, :, None]) & (key_pos[None, None, :] == 0)
        batch.metadata["padded_sdpa"] = (mask[:, None], valid_query, max_extend)

    def attend(self, q: torch.Tensor, layer_id: int, batch: ForwardBatch) -> torch.Tensor:
        mask, valid_query, max_extend = batch.metadata["padded_sdpa"]
        slots = batch.kv_slots
        k = batch.kv_cache.k_buffers[layer_id][slots].to(q.dtype).transpose(1, 2)  # [B, KVH, K, D]
        v = batch.kv_cache.v_buffers[layer_id][slots].to(q.dtype).transpose(1, 2)
        if batch.is_decode:
            qp = q[:, None]                                                           # [B, 1, H, D]
        else:
            qp = q.new_zeros(batch.batch_size, max_extend, self.num_heads, self.head_dim)
            qp[valid_query] = q
        out = F.scaled_dot_product_attention(qp.transpose(1, 2), k, v, attn_mask=mask, scale=self.scale,
                                             enable_gqa=self.num_heads != self.num_kv_heads)
        out = out.transpose(1, 2)                                                     # [B, Q, H, D]
        return out[valid_query] if not batch.is_decode else out[:, 0]
