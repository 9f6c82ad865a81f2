"""srv's CPU attention (`intel_amx`, SGLang's name for its CPU backend): C kernels that read the
KV cache in place, through each request's slot table, in any of srv's cache formats.

Prefill (prompts, prefill chunks, draft tokens to verify): the kernel of extend_attention.c,
one call a layer for the whole ragged batch, a KV head's keys read once for all the query heads
that share it; float32 products, or bf16 ones (AVX512_BF16) for bf16 queries over a bf16 cache.
It replaced one padded scaled-dot-product attention over keys and values gathered from the
cache, which also computed every masked score of a prompt's causal half.

Decode (one new token a request): the C kernel of decode_attention.c stores the step's keys and
values, then reads each request's keys and values in place through its slot table, one call a
layer for the whole batch. Gathering the cache into padded tensors and running two batched
matmuls took most of a decode step's attention time, and grew with every token of context.
Neighbouring requests whose tables begin with the same slots (a prompt they share in the prefix
cache) read those keys and values once for the group (srv_decode_groups, once a step).
"""

from __future__ import annotations

import ctypes
import functools
from dataclasses import dataclass
from pathlib import Path

import torch

from srv.sdk.attention import AttentionBackend, ForwardBatch, KVCache
from srv.sdk.native import NativeKernel, load_c_library, pick_isa

# The cache formats as srv_kv_formats.h numbers them.
KV_FORMATS = {torch.float32: 0, torch.bfloat16: 1, torch.float16: 2, torch.float8_e4m3fn: 3, torch.float8_e5m2: 4}


@functools.cache
def kernels() -> ctypes.CDLL:
    library = load_c_library(Path(__file__).with_name("decode_attention.c"), ("-mavx2", "-mfma", "-mf16c", "-lm"))
    pointer, size = ctypes.c_void_p, ctypes.c_int64
    library.srv_decode_attention_layer.restype = None
    library.srv_decode_attention_layer.argtypes = [pointer, size, pointer, size, pointer, pointer, size, pointer]
    library.srv_decode_groups.restype = size
    library.srv_decode_groups.argtypes = [pointer, size, pointer, size, size, pointer]
    return library


# extend_attention.c's bodies, with the CPU flags each needs (fastest first).
EXTEND_ISAS = {"avx512_bf16": ("avx512f", "avx512bw", "avx512vl", "avx512_bf16", "avx2", "fma", "f16c"),
               "avx512": ("avx512f", "avx512bw", "avx512vl", "avx2", "fma", "f16c"), "avx2": ("avx2", "fma", "f16c")}
EXTEND_ISA_CODES = {"avx512_bf16": 2, "avx512": 1, "avx2": 0}   # as srv_extend_attention_layer numbers them


@functools.cache
def extend_kernels() -> ctypes.CDLL:
    # No instruction-set flags: each body is compiled for its own (target attributes).
    library = load_c_library(Path(__file__).with_name("extend_attention.c"), ("-ffp-contract=fast", "-lm"))
    pointer, size = ctypes.c_void_p, ctypes.c_int64
    library.srv_extend_attention_layer.restype = None
    library.srv_extend_attention_layer.argtypes = [pointer, size, pointer, size, pointer, size]
    return library


@functools.cache
def extend_isa() -> int:
    """The extend kernel's body for this CPU, as the kernel numbers them; $SRV_EXTEND_ATTENTION_ISA
    picks a slower one, to test it."""
    return EXTEND_ISA_CODES[pick_isa(EXTEND_ISAS, "SRV_EXTEND_ATTENTION_ISA")]


class DecodeContext(ctypes.Structure):
    """What srv_decode_attention_layer reads: the caches of every layer and the step's metadata."""
    _fields_ = [("k_caches", ctypes.c_void_p), ("v_caches", ctypes.c_void_p), ("kv_format", ctypes.c_int64),
                ("k_scales", ctypes.c_void_p), ("v_scales", ctypes.c_void_p), ("new_slots", ctypes.c_void_p), ("kv_slots", ctypes.c_void_p), ("seq_lens", ctypes.c_void_p),
                ("groups", ctypes.c_void_p), ("group_count", ctypes.c_int64), ("kv_slots_stride", ctypes.c_int64),
                ("batch", ctypes.c_int64), ("heads", ctypes.c_int64), ("kv_heads", ctypes.c_int64),
                ("d", ctypes.c_int64), ("scale", ctypes.c_float)]


def decode_context(k_caches: ctypes.Array, v_caches: ctypes.Array, kv_format: int, kv_scales: torch.Tensor | None,
                   new_slots: torch.Tensor, slots: torch.Tensor, seq_lens: torch.Tensor, heads: int, kv_heads: int,
                   head_dim: int, scale: float) -> tuple[DecodeContext, torch.Tensor]:
    """A decode step's context over int64 slot tables, with the groups of requests that share a
    prefix of slots (srv_decode_groups), and the tensor of those groups it points into.
    kv_scales: a float8 cache's [2, layers] key and value scales, float32, or None."""
    batch = seq_lens.shape[0]
    groups = torch.empty(batch, 3, dtype=torch.int64)
    count = kernels().srv_decode_groups(slots.data_ptr(), slots.stride(0), seq_lens.data_ptr(), batch, kv_heads,
                                        groups.data_ptr())
    k_scales, v_scales = (None, None) if kv_scales is None else (kv_scales[0].data_ptr(), kv_scales[1].data_ptr())
    context = DecodeContext(ctypes.addressof(k_caches), ctypes.addressof(v_caches), kv_format, k_scales, v_scales,
                            new_slots.data_ptr(),
                            slots.data_ptr(), seq_lens.data_ptr(), groups.data_ptr(), count, slots.stride(0), batch,
                            heads, kv_heads, head_dim, scale)
    return context, groups


class ExtendContext(ctypes.Structure):
    """What srv_extend_attention_layer reads: the caches of every layer and the batch's requests."""
    _fields_ = [("k_caches", ctypes.c_void_p), ("v_caches", ctypes.c_void_p), ("kv_format", ctypes.c_int64),
                ("k_scales", ctypes.c_void_p), ("v_scales", ctypes.c_void_p),
                ("kv_slots", ctypes.c_void_p), ("kv_slots_stride", ctypes.c_int64),
                ("prefix_lens", ctypes.c_void_p), ("extend_lens", ctypes.c_void_p),
                ("batch", ctypes.c_int64), ("heads", ctypes.c_int64), ("kv_heads", ctypes.c_int64),
                ("d", ctypes.c_int64), ("scale", ctypes.c_float)]


@dataclass
class ExtendStep:
    """A prefill batch's context for the extend kernel and the tensors it points into."""
    context: ExtendContext
    tensors: tuple[torch.Tensor, ...]


@dataclass
class DecodeStep:
    """A decode batch's kernel, its context and the tensors the context points into."""
    kernel: NativeKernel
    context: DecodeContext
    tensors: tuple[torch.Tensor, ...]


class CPUAttention(AttentionBackend):
    def __init__(self, num_heads: int, num_kv_heads: int, head_dim: int, scale: float) -> None:
        super().__init__(num_heads, num_kv_heads, head_dim, scale)
        kernels(), extend_kernels()   # a compiler error now, at launch, rather than at the first step
        # The layers' cache addresses for the kernel, per list of buffers, and a float8 cache's
        # scales as the kernel reads them.
        self.cache_addresses: tuple[list[torch.Tensor], list[torch.Tensor], ctypes.Array, ctypes.Array] | None = None
        self.kv_scales: torch.Tensor | None = None

    def prepare(self, batch: ForwardBatch) -> None:
        batch.metadata["cpu_attention"] = self._decode_step(batch) if batch.is_decode else self._extend_step(batch)

    def _extend_step(self, batch: ForwardBatch) -> ExtendStep:
        cache = batch.kv_cache
        k_caches, v_caches = self._cache_addresses(cache)
        slots = batch.kv_slots.to(torch.int64).contiguous()
        lens = torch.tensor([batch.prefix_lens, batch.extend_lens], dtype=torch.int64)
        scales = self.kv_scales   # set by _cache_addresses, kept as long as the cache
        context = ExtendContext(ctypes.addressof(k_caches), ctypes.addressof(v_caches), KV_FORMATS[cache.dtype],
                                None if scales is None else scales[0].data_ptr(),
                                None if scales is None else scales[1].data_ptr(), slots.data_ptr(), slots.stride(0),
                                lens[0].data_ptr(), lens[1].data_ptr(), batch.batch_size, self.num_heads,
                                self.num_kv_heads, self.head_dim, self.scale)
        return ExtendStep(context, (slots, lens))

    def _decode_step(self, batch: ForwardBatch) -> DecodeStep:
        seq_lens = torch.tensor([length + 1 for length in batch.prefix_lens])
        slots = batch.kv_slots.to(torch.int64).contiguous()
        new_slots = batch.out_cache_loc.to(torch.int64).contiguous()
        cache = batch.kv_cache
        k_caches, v_caches = self._cache_addresses(cache)
        context, groups = decode_context(k_caches, v_caches, KV_FORMATS[cache.dtype], self.kv_scales, new_slots, slots,
                                         seq_lens, self.num_heads, self.num_kv_heads, self.head_dim, self.scale)
        return DecodeStep(NativeKernel.of(kernels().srv_decode_attention_layer, context), context,
                          (seq_lens, slots, new_slots, groups))

    def _cache_addresses(self, cache: KVCache) -> tuple[ctypes.Array, ctypes.Array]:
        """Every layer's key and value buffer addresses, as the kernels read them, made once per cache."""
        known = self.cache_addresses
        if known is None or known[0] is not cache.k_buffers or known[1] is not cache.v_buffers:
            if cache.dtype not in KV_FORMATS:
                raise ValueError(f"intel_amx attention reads a KV cache in {', '.join(map(str, KV_FORMATS))}, "
                                 f"not {cache.dtype}")
            self.cache_addresses = (cache.k_buffers, cache.v_buffers,
                                    *((ctypes.c_void_p * len(buffers))(*(b.data_ptr() for b in buffers))
                                      for buffers in (cache.k_buffers, cache.v_buffers)))
            self.kv_scales = torch.tensor([cache.k_scales, cache.v_scales], dtype=torch.float32) if cache.scaled \
                else None
        return self.cache_addresses[2], self.cache_addresses[3]

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, layer_id: int,
                batch: ForwardBatch) -> torch.Tensor:
        if not batch.is_decode:
            return super().forward(q, k, v, layer_id, batch)
        return self._decode(q, layer_id, batch, (token_rows(k), token_rows(v)))

    def native_decode(self, batch: ForwardBatch) -> NativeKernel | None:
        return batch.metadata["cpu_attention"].kernel if batch.is_decode else None

    def attend(self, q: torch.Tensor, layer_id: int, batch: ForwardBatch) -> torch.Tensor:
        if batch.is_decode:
            return self._decode(q, layer_id, batch)
        step = batch.metadata["cpu_attention"]
        query = token_rows(q)
        out = torch.empty(q.shape[0], self.num_heads, self.head_dim)
        # The bf16 products take bf16 queries and keys; others would be rounded to bf16 first.
        isa = extend_isa()
        if isa == EXTEND_ISA_CODES["avx512_bf16"] and (q.dtype, batch.kv_cache.dtype) != (torch.bfloat16,) * 2:
            isa = EXTEND_ISA_CODES["avx512"]
        extend_kernels().srv_extend_attention_layer(ctypes.byref(step.context), layer_id, query.data_ptr(),
                                                    query.stride(0), out.data_ptr(), isa)
        return out if q.dtype == torch.float32 else out.to(q.dtype)

    def _decode(self, q: torch.Tensor, layer_id: int, batch: ForwardBatch,
                new_kv: tuple[torch.Tensor, torch.Tensor] | None = None) -> torch.Tensor:
        """The kernel, which also stores `new_kv` (this step's keys and values) when given."""
        query = token_rows(q)
        k_new, v_new = new_kv or (None, None)
        if k_new is not None and k_new.stride(0) != v_new.stride(0):
            k_new, v_new = k_new.contiguous(), v_new.contiguous()
        out = torch.empty(q.shape[0], self.num_heads, self.head_dim)
        kernels().srv_decode_attention_layer(batch.metadata["cpu_attention"].kernel.context, layer_id,
                                             query.data_ptr(), query.stride(0),
                                             None if k_new is None else k_new.data_ptr(),
                                             None if v_new is None else v_new.data_ptr(),
                                             0 if k_new is None else k_new.stride(0), out.data_ptr())
        return out if q.dtype == torch.float32 else out.to(q.dtype)


def token_rows(x: torch.Tensor) -> torch.Tensor:
    """x [T, heads, D] as float32 with each token's heads back to back, as the kernel reads it:
    x itself when it already is (a view into the fused projection's output, say)."""
    if x.dtype == torch.float32 and x.stride(2) == 1 and x.stride(1) == x.shape[2]:
        return x
    return x.float().contiguous()

