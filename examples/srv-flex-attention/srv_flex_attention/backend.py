"""Ragged-batch attention with `torch.nn.attention.flex_attention`."""

from __future__ import annotations

import warnings

import torch
from torch.nn.attention.flex_attention import create_block_mask, flex_attention

from srv.sdk.attention import AttentionBackend, ForwardBatch

# Eager flex_attention warns that it is not compiled; the backend knows and says so in its README.
warnings.filterwarnings("ignore", message=".*flex_attention.*", category=UserWarning)


class FlexAttention(AttentionBackend):
    def prepare(self, batch: ForwardBatch) -> None:
        seq_lens = [p + e for p, e in zip(batch.prefix_lens, batch.extend_lens)]
        # Every new token and every key, tagged with its request and position in that request.
        q_doc = torch.repeat_interleave(torch.arange(batch.batch_size), torch.tensor(batch.extend_lens))
        q_pos = torch.cat([torch.arange(p, p + e) for p, e in zip(batch.prefix_lens, batch.extend_lens)])
        k_doc = torch.repeat_interleave(torch.arange(batch.batch_size), torch.tensor(seq_lens))
        k_pos = torch.cat([torch.arange(n) for n in seq_lens])
        slots = torch.cat([batch.kv_slots[i, :n] for i, n in enumerate(seq_lens)])

        def same_request_and_causal(b, h, q, k):
            return (q_doc[q] == k_doc[k]) & (k_pos[k] <= q_pos[q])

        mask = create_block_mask(same_request_and_causal, B=None, H=None, Q_LEN=len(q_pos), KV_LEN=len(k_pos),
                                 device="cpu")
        batch.metadata["flex_attention"] = (mask, slots)

    def attend(self, q: torch.Tensor, layer_id: int, batch: ForwardBatch) -> torch.Tensor:
        mask, slots = batch.metadata["flex_attention"]
        k = batch.kv_cache.keys(layer_id, slots, q.dtype)
        v = batch.kv_cache.values(layer_id, slots, q.dtype)
        out = flex_attention(q.transpose(0, 1)[None], k.transpose(0, 1)[None], v.transpose(0, 1)[None],
                             block_mask=mask, scale=self.scale, enable_gqa=self.num_heads != self.num_kv_heads)
        return out[0].transpose(0, 1)
