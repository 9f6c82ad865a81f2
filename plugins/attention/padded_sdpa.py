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

    def _gather(self, buffer: torch.Tensor, batch: ForwardBatch, dtype: torch.dtype) -> torch.Tensor:
        """[B, KVH, K, D] keys or values of every request, contiguous per (request, head)."""
        slots = batch.kv_slots
        # index_select on rows is several times faster than advanced indexing here.
        rows = buffer.view(buffer.shape[0], -1).index_select(0, slots.reshape(-1))
        return rows.view(*slots.shape, self.num_kv_heads, self.head_dim).transpose(1, 2).to(dtype).contiguous()

    def attend(self, q: torch.Tensor, layer_id: int, batch: ForwardBatch) -> torch.Tensor:
        mask, valid_query, max_extend = batch.metadata["padded_sdpa"]
        k = self._gather(batch.kv_cache.k_buffers[layer_id], batch, q.dtype)
        v = self._gather(batch.kv_cache.v_buffers[layer_id], batch, q.dtype)
        if batch.is_decode:
            return self._decode(q, k, v, mask)
        qp = q.new_zeros(batch.batch_size, max_extend, self.num_heads, self.head_dim)
        qp[valid_query] = q
        out = F.scaled_dot_product_attention(qp.transpose(1, 2), k, v, attn_mask=mask, scale=self.scale,
                                             enable_gqa=self.num_heads != self.num_kv_heads)
        return out.transpose(1, 2)[valid_query]

    def _decode(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        """One query per request: each KV head's query group against its keys as one batched
        matmul. CPU SDPA kernels spend far longer than this on a single query row."""
        batch_size, seq_len = k.shape[0], k.shape[2]
        group = self.num_heads // self.num_kv_heads
        k = k.view(-1, seq_len, self.head_dim)                                        # [B*KVH, K, D]
        v = v.view(-1, seq_len, self.head_dim)
        scores = torch.bmm(q.reshape(-1, group, self.head_dim), k.transpose(1, 2)).float()
        scores = scores.view(batch_size, self.num_kv_heads, group, seq_len) * self.scale
        scores.masked_fill_(~mask, float("-inf"))
        probs = scores.softmax(-1).to(q.dtype).view(-1, group, seq_len)
        return torch.bmm(probs, v).view(batch_size, self.num_heads, self.head_dim)
