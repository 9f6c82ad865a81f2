"""What an attention backend receives, and the base class it implements."""

from __future__ import annotations

import enum
from abc import ABC, abstractmethod
from dataclasses import dataclass, field
from typing import Any

import torch

from srv.sdk.native import NativeKernel


class KVCache:
    """Keys and values of every cached token, one buffer per layer, indexed by slot: the pool
    `--kv-cache-dtype` chose (a `srv_register_kv_cache_dtypes` factory builds it).

    The pool owns how values are stored: `dtype` is the buffers' dtype, and a float8 pool keeps
    `value / scale` with one scale a layer for keys (`k_scales`) and one for values
    (`v_scales`), saturated at the format's largest finite value. Backends write through
    `store` and read through `keys` and `values`, which give the values in the dtype asked;
    a backend reading `k_buffers` and `v_buffers` itself (a C kernel) must apply the scales of
    a float8 pool (`scaled`) and refuse a `dtype` it does not know.

    Slot 0 is never handed to a request: padded index tables point there.
    """

    def __init__(self, num_slots: int, num_layers: int, num_kv_heads: int, head_dim: int,
                 dtype: torch.dtype, k_scales: list[float] | None = None, v_scales: list[float] | None = None) -> None:
        shape = (num_slots, num_kv_heads, head_dim)
        # Left unwritten: zeroing gigabytes up front costs seconds of launch, and every slot is
        # written before it is read, except slot 0, which padding reads and must hold finite values.
        self.k_buffers = [torch.empty(shape, dtype=dtype) for _ in range(num_layers)]
        self.v_buffers = [torch.empty(shape, dtype=dtype) for _ in range(num_layers)]
        for buffer in self.k_buffers + self.v_buffers:
            buffer[0].zero_()
        self.dtype = dtype
        self.scaled = dtype in FLOAT8_DTYPES
        self.k_scales = [1.0] * num_layers if k_scales is None else [float(s) for s in k_scales]
        self.v_scales = [1.0] * num_layers if v_scales is None else [float(s) for s in v_scales]
        if len(self.k_scales) != num_layers or len(self.v_scales) != num_layers:
            raise ValueError(f"a KV cache of {num_layers} layers needs {num_layers} key and value scales")

    def store(self, layer_id: int, slots: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> None:
        self.k_buffers[layer_id][slots] = self._encode(k, self.k_scales[layer_id])
        self.v_buffers[layer_id][slots] = self._encode(v, self.v_scales[layer_id])

    def keys(self, layer_id: int, slots: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        """Layer `layer_id`'s keys at `slots` (any shape S): [*S, kv_heads, head_dim] in `dtype`."""
        return self._read(self.k_buffers[layer_id], slots, self.k_scales[layer_id], dtype)

    def values(self, layer_id: int, slots: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        return self._read(self.v_buffers[layer_id], slots, self.v_scales[layer_id], dtype)

    def stored_rows(self, slots: torch.Tensor) -> torch.Tensor:
        """Every layer's keys and values at `slots` as the pool stores them (a float8 pool's
        scaled values): [len(slots), layers, 2, kv_heads, head_dim], keys then values. A view
        of one gathered copy (layers first), not contiguous: whoever keeps the rows copies them
        once, in the order they keep."""
        gathered = torch.stack([buffer.index_select(0, slots) for pair in zip(self.k_buffers, self.v_buffers)
                                for buffer in pair])
        return gathered.view(len(self.k_buffers), 2, *gathered.shape[1:]).permute(2, 0, 1, 3, 4)

    def set_stored_rows(self, slots: torch.Tensor, rows: torch.Tensor) -> None:
        """The inverse of `stored_rows`: rows as the pool stores them written at `slots`."""
        for layer, (k, v) in enumerate(zip(self.k_buffers, self.v_buffers)):
            k[slots] = rows[:, layer, 0]
            v[slots] = rows[:, layer, 1]

    def copy(self, sources: torch.Tensor, targets: torch.Tensor) -> None:
        """Every layer's keys and values at `sources` to `targets` (a tree draft's accepted nodes)."""
        for buffer in self.k_buffers + self.v_buffers:
            buffer[targets] = buffer[sources]

    def _encode(self, x: torch.Tensor, scale: float) -> torch.Tensor:
        if not self.scaled:
            return x.to(self.dtype)
        largest = torch.finfo(self.dtype).max
        return (x.float() / scale).clamp_(-largest, largest).to(self.dtype)

    def _read(self, buffer: torch.Tensor, slots: torch.Tensor, scale: float, dtype: torch.dtype) -> torch.Tensor:
        # index_select on rows is several times faster than advanced indexing.
        rows = buffer.view(buffer.shape[0], -1).index_select(0, slots.reshape(-1))
        rows = rows.view(*slots.shape, *buffer.shape[1:])
        return (rows.float() * scale).to(dtype) if self.scaled else rows.to(dtype)


FLOAT8_DTYPES = (torch.float8_e4m3fn, torch.float8_e5m2)


class KVCacheDtype(ABC):
    """A `--kv-cache-dtype`: how the KV pool stores keys and values. srv sizes the pool from
    `storage_dtype` (bytes a token) and builds it with `create`."""

    def __init__(self, server_args: Any = None) -> None:
        self.server_args = server_args

    @abstractmethod
    def storage_dtype(self, served: torch.dtype) -> torch.dtype:
        """The buffers' dtype for a model served in `served`."""

    def create(self, num_slots: int, num_layers: int, num_kv_heads: int, head_dim: int,
               served: torch.dtype) -> KVCache:
        return KVCache(num_slots, num_layers, num_kv_heads, head_dim, self.storage_dtype(served))


class ForwardMode(str, enum.Enum):
    """What a forward pass computes (SGLang's names).

    EXTEND: prompt chunks (and, mixed in, decode rows); DECODE: one new token a request;
    TARGET_VERIFY: a speculative verify pass, laid out as decode rows (a request's last token
    and each of its drafts is a row attending to its own prefix, so rows of one request share
    a KV row); DRAFT_EXTEND: a draft model's pass; IDLE: no rows, under data-parallel attention
    (`srv.sdk.parallel`), on a rank with nothing to compute while another rank computes: the
    pass only takes part in the collectives of the blocks split across the ranks."""

    EXTEND = "extend"
    DECODE = "decode"
    TARGET_VERIFY = "target_verify"
    DRAFT_EXTEND = "draft_extend"
    IDLE = "idle"


@dataclass
class ForwardBatch:
    """One forward pass over a ragged batch: each request contributes `extend_lens[i]` new
    tokens (a prefill chunk, or 1 for a decode step) on top of `prefix_lens[i]` tokens whose
    keys and values are already cached.

    input_ids, positions, out_cache_loc: [T], the new tokens of every request, concatenated.
    kv_slots: [B, max(prefix + extend)] cache slots of each request's tokens, 0-padded; the new tokens
        are written to out_cache_loc, which equals their places in kv_slots.
    logits_indices: the rows of the new tokens whose logits the model returns, in this order;
        None means each request's last new token (one row a request, in batch order). The
        scheduler asks for more rows when a request wants its prompt's log-probabilities.
    mode: see ForwardMode; every mode uses this same ragged layout.
    capture_layers: hidden states to return in ModelOutput.hidden_states, for every new token
        [T, len(capture_layers) * hidden], side by side in this order: index i < num_layers is
        the residual stream entering layer i (0: the embeddings), num_layers the final norm's
        output (what the head reads), as Hugging Face's `output_hidden_states` numbers them.
        Draft heads read them (EAGLE the last, EAGLE3 three of the layers').
    token_type_ids: see the field.
    """

    input_ids: torch.Tensor
    positions: torch.Tensor
    out_cache_loc: torch.Tensor
    kv_slots: torch.Tensor
    prefix_lens: list[int]
    extend_lens: list[int]
    kv_cache: KVCache
    attention: "AttentionBackend"
    metadata: dict[str, Any] = field(default_factory=dict)
    logits_indices: torch.Tensor | None = None
    mode: ForwardMode = ForwardMode.EXTEND
    capture_layers: tuple[int, ...] = ()
    # Segment ids of the new tokens [T], for encoders whose input is a pair of texts (a
    # cross-encoder's query and document); None: every token is in segment 0.
    token_type_ids: torch.Tensor | None = None

    @property
    def batch_size(self) -> int:
        return len(self.extend_lens)

    @classmethod
    def idle(cls, kv_cache: KVCache, attention: "AttentionBackend") -> ForwardBatch:
        """An IDLE pass's batch: no requests, no tokens."""
        empty = torch.zeros(0, dtype=torch.long)
        return cls(input_ids=empty, positions=empty, out_cache_loc=empty, kv_slots=empty.view(0, 0), prefix_lens=[],
                   extend_lens=[], kv_cache=kv_cache, attention=attention, mode=ForwardMode.IDLE)

    @property
    def is_idle(self) -> bool:
        return self.mode is ForwardMode.IDLE

    @property
    def is_decode(self) -> bool:
        return not self.is_idle and all(e == 1 for e in self.extend_lens)

    def last_token_indices(self) -> torch.Tensor:
        return torch.tensor(self.extend_lens, dtype=torch.long).cumsum(0) - 1

    def logits_rows(self) -> torch.Tensor:
        """The rows whose logits a model returns (see `logits_indices`)."""
        return self.last_token_indices() if self.logits_indices is None else self.logits_indices

    def micro_batches(self, size: int) -> list[ForwardBatch]:
        """The batch as consecutive groups of at most `size` requests (pipeline parallelism's
        micro-batches), whose logits rows, one group after another, are this batch's in order.
        One group where the asked rows are not in request order."""
        rows = self.logits_indices
        if self.batch_size <= size or (rows is not None and bool((rows[1:] < rows[:-1]).any())):
            return [self]
        token_starts = [0]
        for extend in self.extend_lens:
            token_starts.append(token_starts[-1] + extend)
        parts = []
        for first in range(0, self.batch_size, size):
            last = min(first + size, self.batch_size)
            t0, t1 = token_starts[first], token_starts[last]
            indices = None if rows is None else rows[(rows >= t0) & (rows < t1)] - t0
            tokens = slice(t0, t1)
            parts.append(ForwardBatch(
                input_ids=self.input_ids[tokens], positions=self.positions[tokens],
                out_cache_loc=self.out_cache_loc[tokens], kv_slots=self.kv_slots[first:last],
                prefix_lens=self.prefix_lens[first:last], extend_lens=self.extend_lens[first:last],
                kv_cache=self.kv_cache, attention=self.attention, logits_indices=indices, mode=self.mode,
                capture_layers=self.capture_layers,
                token_type_ids=None if self.token_type_ids is None else self.token_type_ids[tokens]))
        return parts


class AttentionBackend(ABC):
    """Causal attention of a batch's new tokens over their cached and new keys and values.

    q: [T, num_heads, head_dim]; k, v: [T, num_kv_heads, head_dim] of the new tokens.
    `forward` stores k and v in the cache, then returns [T, num_heads, head_dim].
    """

    def __init__(self, num_heads: int, num_kv_heads: int, head_dim: int, scale: float) -> None:
        self.num_heads, self.num_kv_heads, self.head_dim, self.scale = num_heads, num_kv_heads, head_dim, scale

    def prepare(self, batch: ForwardBatch) -> None:
        """Build whatever per-batch metadata every layer will reuse (once per forward pass)."""

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, layer_id: int,
                batch: ForwardBatch) -> torch.Tensor:
        """Store k and v at `batch.out_cache_loc`, in the cache's dtype, then `attend`.

        A backend may override it to store inside its own kernel (intel_amx does for decode:
        two scatters a layer cost more than the attention at one token). q, k and v may be views
        of one projection's output and must not be modified; the kit's store test checks that
        and the stored values, for every cache dtype."""
        batch.kv_cache.store(layer_id, batch.out_cache_loc, k, v)
        return self.attend(q, layer_id, batch)

    def native_decode(self, batch: ForwardBatch) -> NativeKernel | None:
        """This decode batch's `forward` as a C kernel (`srv.sdk.native.NativeKernel`), or None.

        Called after `prepare`, by a model that runs its decode layers in C; it calls the
        kernel for every layer. With None (the default) the model calls `forward`. The kit
        checks that both store and return the same, to the bit."""
        return None

    @abstractmethod
    def attend(self, q: torch.Tensor, layer_id: int, batch: ForwardBatch) -> torch.Tensor:
        """Attention of q over the cache (which already holds this step's keys and values)."""
