"""Llama-family decoder models on srv's KV cache: Llama (SmolLM2, Llama 3), Qwen2 and Qwen3.

The three differ only in small switches read from the HF config: Qwen2 adds biases to the
query/key/value projection, Qwen3 normalises queries and keys per head before rotary.
"""

from __future__ import annotations

import ctypes
import os
import functools
import logging
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Iterable

import torch
from torch import nn
from torch.nn import functional as F

from srv.sdk.attention import ForwardBatch
from srv.sdk.layers import (MergedColumnParallelLinear, Sharding, ParallelLMHead, QKVParallelLinear, RowParallelLinear,
                            VocabParallelEmbedding, load_shard, rank_part)
from srv.sdk.linear import checkpoint_key, load_weight, shard_rows
from srv.sdk.models import ModelOutput
from srv.sdk.parallel import ParallelContext
from srv.sdk.registration import requires_cpu_flags
from srv.sdk.native import NativeKernel, has_forward_hooks, optional_c_library

logger = logging.getLogger("srv.models")

SUPPORTED_ARCHITECTURES = {"LlamaForCausalLM", "Qwen2ForCausalLM", "Qwen3ForCausalLM"}
# A model served in bf16 or fp16 runs decode steps of fewer rows than this in float32 through the
# native layers when they have kernels (a GGUF file's blocks): those steps are bound by the bytes
# the products read, and the C layers skip the Python calls. Larger steps are bound by arithmetic,
# where the served dtype's dense products (AMX) are faster. See BENCHMARKS.md. On a CPU with AMX,
# bf16 products on its tiles are faster from 9 rows, where the float32 kernels stop scaling each
# weight in registers for every row (`srv bench one-batch`, BENCHMARKS.md's notes).
# Up to 8 rows stay in float32 either way, so a speculative verify pass of a token and its
# drafts sums each row as a one-row step does.
FLOAT32_DECODE_ROWS = int(os.environ.get("SRV_FLOAT32_DECODE_ROWS") or
                          (9 if requires_cpu_flags("amx_bf16", "amx_tile")().ok else 12))
# From FLOAT32_DECODE_ROWS rows up to this, a bf16 model's decode steps run the native layers with
# products in bf16 arithmetic where every product offers a kernel for them
# (native_linear(rows, torch.bfloat16): a GGUF file's blocks on a CPU with bf16 products, up to the
# rows where the product's dense copy is faster, which the product knows): the arithmetic of the
# Python layers' dense bf16 products, without their dozen Python calls a layer. Larger steps
# are bound by the products alone, where oneDNN's are as fast and the calls cost little.
BF16_DECODE_ROWS = int(os.environ.get("SRV_BF16_DECODE_ROWS", "128"))


def native_product(module: nn.Module, rows: int, dtype: torch.dtype) -> NativeKernel | None:
    """The module's C kernel for `rows` float32 rows in `dtype`'s arithmetic (see
    srv.sdk.linear.LinearMethod.native_linear), or None."""
    offer = getattr(module, "native_linear", None)
    if offer is None:
        return None
    return offer(rows) if dtype == torch.float32 else offer(rows, dtype)


def native_products_dtype(dtype: torch.dtype, rows: int) -> torch.dtype | None:
    """The arithmetic of the native layers' products for a decode step of `rows` rows of a
    model served in `dtype`, or None where the Python layers run it."""
    if dtype == torch.float32 or rows < FLOAT32_DECODE_ROWS:
        return torch.float32
    return torch.bfloat16 if dtype == torch.bfloat16 and rows < BF16_DECODE_ROWS else None


@functools.cache
def kernels() -> ctypes.CDLL | None:
    """llama_kernels.c for float32 rows, or None without a C compiler (torch's operators then)."""
    library = optional_c_library(Path(__file__).with_name("llama_kernels.c"),
                                 ("-ffp-contract=off", "-fno-trapping-math", "-lm"),
                                 "the model runs its norms, rotary embedding and activation on torch's operators")
    if library is None:
        return None
    pointer, size = ctypes.c_void_p, ctypes.c_int64
    library.srv_rms_norm.argtypes = [pointer, size, size, size, pointer, ctypes.c_float, pointer]
    library.srv_add_rms_norm.argtypes = [pointer, pointer, size, size, pointer, ctypes.c_float, pointer]
    library.srv_silu_mul.argtypes = [pointer, size, size, pointer]
    library.srv_rotary.argtypes = [pointer, size, size, size, size, pointer, pointer, pointer]
    library.srv_rms_norm_bf16.argtypes = [pointer, size, size, size, pointer, ctypes.c_float, pointer]
    library.srv_add_rms_norm_bf16.argtypes = [pointer, pointer, size, size, pointer, ctypes.c_float, pointer]
    library.srv_rotary_bf16.argtypes = [pointer, size, size, size, size, pointer, pointer, pointer]
    library.srv_decode_layers.argtypes = [pointer, size, pointer, pointer, pointer, pointer, pointer, pointer, pointer,
                                          size, pointer, pointer, pointer, pointer, pointer, pointer, size, pointer]
    library.srv_decode_layers.restype = size
    return library


# srv_decode_layers' all-reduce of a split layer's partial sums: (context, address of float32 x, count).
AllReduceFunction = ctypes.CFUNCTYPE(None, ctypes.c_void_p, ctypes.c_void_p, ctypes.c_int64)


@dataclass
class NativeAllReduce:
    """The all-reduce srv_decode_layers calls (`kernel`; None at one rank), and the Python function
    it calls back where the ranks have no C all-reduce, kept alive as long as the kernel."""
    kernel: NativeKernel | None
    callback: AllReduceFunction | None = None


def native_all_reduce(parallel: ParallelContext) -> NativeAllReduce:
    """The context's all-reduce, in place: its C function where the ranks share memory, else a
    call back into Python. A collective that fails ends the process, as in the Python layers (an
    exception cannot cross the C frames)."""
    if not parallel.is_parallel:
        return NativeAllReduce(None)
    native = parallel.native_all_reduce()
    if native is not None:
        return NativeAllReduce(native)

    def all_reduce(context: int, address: int, count: int) -> None:
        try:
            x = torch.frombuffer((ctypes.c_float * count).from_address(address), dtype=torch.float32)
            summed = parallel.all_reduce(x)
            if summed.data_ptr() != x.data_ptr():
                x.copy_(summed)
        except BaseException:
            logger.exception("rank %d: a collective failed in the native decode layers; exiting", parallel.rank)
            os._exit(1)

    callback = AllReduceFunction(all_reduce)
    return NativeAllReduce(NativeKernel(ctypes.cast(callback, ctypes.c_void_p).value, None), callback)


class NativeDecoderLayer(ctypes.Structure):
    """A decoder layer as srv_decode_layers runs it: its products' kernels and its norms' weights."""
    _fields_ = [("qkv", NativeKernel), ("o", NativeKernel), ("gate_up", NativeKernel), ("down", NativeKernel),
                ("input_norm", ctypes.c_void_p), ("post_attention_norm", ctypes.c_void_p)]


class DecodeEnds(ctypes.Structure):
    """What srv_decode_layers looks up before the first layer (the embeddings, where `ids` is set)
    and computes after the last (the final norm, where `final_norm` is set)."""
    _fields_ = [("ids", ctypes.c_void_p), ("embedding", ctypes.c_void_p), ("vocab", ctypes.c_int64),
                ("embedding_bf16", ctypes.c_int64), ("final_norm", ctypes.c_void_p), ("final_out", ctypes.c_void_p)]


class LayerShapes(ctypes.Structure):
    _fields_ = [("hidden", ctypes.c_int64), ("heads", ctypes.c_int64), ("kv_heads", ctypes.c_int64),
                ("head_dim", ctypes.c_int64), ("intermediate", ctypes.c_int64), ("eps", ctypes.c_float)]


def int64_values(x: torch.Tensor) -> torch.Tensor:
    """x as contiguous int64 values, the form C reads token ids and positions in (as the worker gives them)."""
    return x if x.dtype == torch.int64 and x.is_contiguous() else x.to(torch.int64).contiguous()


def float32_rows(x: torch.Tensor) -> bool:
    """Whether the C kernels take x: float32 rows of contiguous values."""
    return x.dtype == torch.float32 and x.stride(-1) == 1 and kernels() is not None


def bf16_rows(x: torch.Tensor) -> bool:
    """Whether the bf16 C kernels take x: bf16 rows of contiguous values."""
    return x.dtype == torch.bfloat16 and x.stride(-1) == 1 and kernels() is not None


class RMSNorm(nn.Module):
    def __init__(self, size: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(size))
        self.eps = eps

    def forward(self, x: torch.Tensor, residual: torch.Tensor | None = None):
        """norm(x); with `residual`, the residual stream's step: (norm(residual + x), residual + x),
        the sum written into `residual` where the C kernel takes the rows."""
        # The C kernels: float32 rows, or bf16 rows of a bf16 norm (a float32 weight would make
        # torch's product float32).
        native = x.dim() == 2 and (float32_rows(x) or bf16_rows(x) and self.weight.dtype == torch.bfloat16)
        if residual is not None:
            if native and x.is_contiguous() and residual.is_contiguous() and residual.dtype == x.dtype:
                out = torch.empty(x.shape, dtype=x.dtype)
                add = kernels().srv_add_rms_norm if x.dtype == torch.float32 else kernels().srv_add_rms_norm_bf16
                add(residual.data_ptr(), x.data_ptr(), x.shape[0], x.shape[1], self.weight.data_ptr(), self.eps,
                    out.data_ptr())
                return out, residual
            residual = residual + x
            return self(residual), residual
        if native:
            out = torch.empty(x.shape, dtype=x.dtype)
            norm = kernels().srv_rms_norm if x.dtype == torch.float32 else kernels().srv_rms_norm_bf16
            norm(x.data_ptr(), x.shape[0], x.shape[1], x.stride(0), self.weight.data_ptr(), self.eps, out.data_ptr())
            return out
        # Normalise in float32 whatever the served dtype, as the reference implementation does.
        dtype = x.dtype
        x = x.float()
        x = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * x.to(dtype)


class ShardedRMSNorm(RMSNorm):
    """An RMS norm over features that tensor-parallel ranks share: this rank holds the weights of
    its `shard` (start, size) of the `size` features, and the mean of squares is taken over all of
    them (one all-reduce of each row's sum). At one rank it is RMSNorm."""

    def __init__(self, size: int, shard: tuple[int, int], eps: float, parallel: ParallelContext) -> None:
        super().__init__(shard[1], eps)
        self.full_size, self.parallel = size, parallel
        self.sharding = Sharding(0, [shard], parallel.tp_rank, parallel.tp_size)

    def forward(self, x: torch.Tensor, residual: torch.Tensor | None = None):
        if not self.parallel.is_parallel:
            return super().forward(x, residual)
        dtype = x.dtype
        x = x.float()
        squares = self.parallel.all_reduce(x.pow(2).sum(-1, keepdim=True))
        return self.weight * (x * torch.rsqrt(squares / self.full_size + self.eps)).to(dtype)


class RotaryEmbedding(nn.Module):
    def __init__(self, head_dim: int, theta: float, rope_scaling: dict[str, Any] | None) -> None:
        super().__init__()
        if rope_scaling and rope_scaling.get("rope_type", rope_scaling.get("type", "default")) != "default":
            raise NotImplementedError(f"rope scaling {rope_scaling} is not supported yet")
        self.head_dim, self.theta = head_dim, theta
        self.cos_table = self.sin_table = torch.empty(0, head_dim)

    def tables(self, length: int) -> tuple[torch.Tensor, torch.Tensor]:
        """cos, sin [positions, head_dim] for positions up to at least `length` - 1, computed once
        (again, twice as long, when a longer sequence comes) rather than five operators a forward
        pass: each position's row is the one those operators give for it alone (elementwise)."""
        if self.cos_table.shape[0] < length:
            # At the first pass rather than as a buffer: the model is built on the meta device.
            exponents = torch.arange(0, self.head_dim, 2, dtype=torch.int64).float() / self.head_dim
            inv_freq = 1.0 / (self.theta ** exponents)
            positions = torch.arange(max(length, 2 * self.cos_table.shape[0], 4096))
            freqs = positions.float()[:, None] * inv_freq[None, :]
            emb = torch.cat((freqs, freqs), dim=-1)
            self.cos_table, self.sin_table = emb.cos(), emb.sin()
        return self.cos_table, self.sin_table

    def forward(self, positions: torch.Tensor, length: int) -> tuple[torch.Tensor, torch.Tensor]:
        """cos, sin: [T, 1, head_dim] of the positions (all below `length`), for every layer's heads."""
        cos, sin = self.tables(length)
        return cos[positions][:, None], sin[positions][:, None]


def apply_rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> None:
    """Rotates x [T, heads, head_dim] in place; cos, sin: [T, 1, head_dim]."""
    if (float32_rows(x) or bf16_rows(x)) and x.stride(1) == x.shape[2]:
        rotary = kernels().srv_rotary if x.dtype == torch.float32 else kernels().srv_rotary_bf16
        rotary(x.data_ptr(), x.shape[0], x.shape[1], x.shape[2], x.stride(0), cos.data_ptr(), sin.data_ptr(), None)
        return
    half = x.shape[-1] // 2
    rotated = torch.cat((-x[..., half:], x[..., :half]), dim=-1)
    x.copy_(x * cos + rotated * sin)


class Attention(nn.Module):
    """This rank's heads: key/value head groups are split across tensor-parallel ranks.
    `layer_id` is the layer's place in its pipeline stage, which is where its KV lives."""

    def __init__(self, config: Any, layer_id: int, parallel: ParallelContext) -> None:
        super().__init__()
        self.layer_id, self.parallel = layer_id, parallel
        total_heads = config.num_attention_heads
        total_kv_heads = getattr(config, "num_key_value_heads", None) or total_heads
        self.head_dim = getattr(config, "head_dim", None) or config.hidden_size // total_heads
        bias = getattr(config, "attention_bias", False) or config.model_type in ("qwen2", "qwen2_moe")
        self.qkv_proj = QKVParallelLinear(config.hidden_size, self.head_dim, total_heads, total_kv_heads, bias, parallel)
        self.num_heads, self.num_kv_heads = self.qkv_proj.num_heads, self.qkv_proj.num_kv_heads
        self.q_size, self.kv_size = self.num_heads * self.head_dim, self.num_kv_heads * self.head_dim
        self.o_proj = RowParallelLinear(total_heads * self.head_dim, config.hidden_size, False, parallel,
                                        unit=total_heads // total_kv_heads * self.head_dim)
        # Qwen3 normalises each head's query and key; OLMoE the whole projection's (all heads'
        # features at once, across the ranks that share them).
        self.qk_norm = config.model_type in ("qwen3", "qwen3_moe")
        self.full_qk_norm = config.model_type == "olmoe"
        if self.qk_norm:
            self.q_norm = RMSNorm(self.head_dim, norm_eps(config))
            self.k_norm = RMSNorm(self.head_dim, norm_eps(config))
        if self.full_qk_norm:
            ranges = self.qkv_proj.sharding.ranges
            self.q_norm = ShardedRMSNorm(total_heads * self.head_dim, ranges[0], norm_eps(config), parallel)
            self.k_norm = ShardedRMSNorm(total_kv_heads * self.head_dim, ranges[1], norm_eps(config), parallel)
        self.clip_qkv = getattr(config, "clip_qkv", None)

    def forward(self, x: torch.Tensor, rotary: tuple[torch.Tensor, torch.Tensor], batch: ForwardBatch) -> torch.Tensor:
        if batch.is_idle:   # no rows, and no collective: attention is whole on each rank then
            return x
        qkv = self.qkv_proj(x)
        if self.full_qk_norm:
            q, k, v = qkv.split([self.q_size, self.kv_size, self.kv_size], dim=-1)
            qkv = torch.cat((self.q_norm(q), self.k_norm(k), v), dim=-1)
        if self.clip_qkv is not None:
            qkv = qkv.clamp(-self.clip_qkv, self.clip_qkv)
        heads = qkv.view(-1, self.num_heads + 2 * self.num_kv_heads, self.head_dim)
        if self.qk_norm:
            q, k, v = heads.split([self.num_heads, self.num_kv_heads, self.num_kv_heads], dim=1)
            heads = torch.cat((self.q_norm(q), self.k_norm(k), v), dim=1)
        # Queries and keys rotate together, in place in the projection's output: one pass of the
        # small rotary ops instead of two, and q, k and v stay views of one tensor.
        apply_rotary(heads[:, :self.num_heads + self.num_kv_heads], *rotary)
        q, k, v = heads.split([self.num_heads, self.num_kv_heads, self.num_kv_heads], dim=1)
        out = batch.attention.forward(q, k, v, self.layer_id, batch)
        return self.parallel.all_reduce(self.o_proj(out.reshape(-1, self.q_size)))


class MLP(nn.Module):
    def __init__(self, config: Any, parallel: ParallelContext | None = None, intermediate_size: int | None = None) -> None:
        super().__init__()
        self.parallel = parallel = parallel or ParallelContext()
        intermediate_size = intermediate_size or config.intermediate_size
        self.gate_up_proj = MergedColumnParallelLinear(config.hidden_size, [intermediate_size] * 2, False, parallel)
        self.intermediate_size = self.gate_up_proj.out_features // 2   # this rank's
        self.down_proj = RowParallelLinear(intermediate_size, config.hidden_size, False, parallel)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate_up = self.gate_up_proj(x)
        if gate_up.dim() == 2 and float32_rows(gate_up) and gate_up.is_contiguous():
            out = torch.empty(gate_up.shape[0], self.intermediate_size)
            kernels().srv_silu_mul(gate_up.data_ptr(), gate_up.shape[0], self.intermediate_size, out.data_ptr())
        else:
            gate, up = gate_up.split(self.intermediate_size, dim=-1)
            out = F.silu(gate) * up
        return self.parallel.all_reduce(self.down_proj(out))


class DecoderLayer(nn.Module):
    def __init__(self, config: Any, layer_id: int, parallel: ParallelContext, mlp: nn.Module) -> None:
        super().__init__()
        self.self_attn = Attention(config, layer_id, parallel.attention)
        # The context the feed-forward block was built with: a block whole on every rank
        # (--moe-dense-tp-size 1) runs on this rank's rows alone under data-parallel attention.
        self.mlp, self.mlp_parallel = mlp, getattr(mlp, "parallel", parallel)
        self.input_layernorm = RMSNorm(config.hidden_size, norm_eps(config))
        self.post_attention_layernorm = RMSNorm(config.hidden_size, norm_eps(config))

    def forward(self, x: torch.Tensor, residual: torch.Tensor | None, rotary: tuple[torch.Tensor, torch.Tensor],
                batch: ForwardBatch) -> tuple[torch.Tensor, torch.Tensor]:
        """(this layer's MLP output, the residual stream before it): the residual additions are
        fused into the norms that follow them. The first layer gets the embeddings and no residual."""
        if residual is None:
            residual, x = x, self.input_layernorm(x)
        else:
            x, residual = self.input_layernorm(x, residual)
        x, residual = self.post_attention_layernorm(self.self_attn(x, rotary, batch), residual)
        return self.mlp_parallel.run_gathered(self.mlp, x), residual


class LlamaForCausalLM(nn.Module):
    """forward(batch) returns a ModelOutput: float32 logits [rows, vocab] of the rows
    `batch.logits_rows()` names (each request's last new token, unless the scheduler asks for
    more), and the hidden states `batch.capture_layers` names, of every new token."""

    # HF checkpoint names of the projections srv stores fused: (fused name, shard index).
    FUSED = {"q_proj": ("qkv_proj", 0), "k_proj": ("qkv_proj", 1), "v_proj": ("qkv_proj", 2),
             "gate_proj": ("gate_up_proj", 0), "up_proj": ("gate_up_proj", 1)}
    # The same, as SGLang and vLLM name it for quantization methods: fused layer -> its shards.
    packed_modules_mapping = {"qkv_proj": ["q_proj", "k_proj", "v_proj"], "gate_up_proj": ["gate_proj", "up_proj"]}

    def __init__(self, config: Any, parallel: ParallelContext | None = None) -> None:
        super().__init__()
        self.config = config
        self.parallel = parallel = parallel or ParallelContext()
        # A pipeline stage builds its own layers (the others are placeholders, so that parameter
        # names keep the checkpoint's layer numbers); the first has the embeddings, the last the
        # final norm and the head.
        self.start, self.end = parallel.layer_range(config.num_hidden_layers)
        self.embed_tokens = VocabParallelEmbedding(config.vocab_size, config.hidden_size, parallel.attention) \
            if parallel.is_first_stage else None
        self.layers = nn.ModuleList(DecoderLayer(config, i - self.start, parallel, self.build_mlp(config, i, parallel))
                                    if self.start <= i < self.end else nn.Identity()
                                    for i in range(config.num_hidden_layers))
        self.norm = RMSNorm(config.hidden_size, norm_eps(config))
        self.tie_word_embeddings = bool(getattr(config, "tie_word_embeddings", False))
        # A tied head gets its own Parameter over the embedding matrix when the weights load: no
        # shared Parameter to re-tie after the model is materialised from the meta device, and the
        # head can be repacked or quantized like any other linear layer.
        self.lm_head = ParallelLMHead(config.hidden_size, config.vocab_size, parallel.head)
        # Kept here: a module that serves the head's weights (a packed layer) takes its place.
        self.vocab_starts = self.lm_head.vocab_starts
        if not parallel.is_last_stage:
            self.norm = self.lm_head = None
        attention = self.layers[self.start].self_attn
        self.rotary = RotaryEmbedding(attention.head_dim, *rope_settings(config))
        self.shapes = LayerShapes(config.hidden_size, attention.num_heads, attention.num_kv_heads, attention.head_dim,
                                  getattr(self.layers[self.start].mlp, "intermediate_size", 0), norm_eps(config))
        # Per batch size: the layers as srv_decode_layers runs them, or None where one lacks a kernel.
        # They hold the addresses of the weights, which must not be replaced after the first decode
        # step (srv never does; the loader and the quantization run before it).
        self.native_layers: dict[tuple[int, torch.dtype], ctypes.Array | None] = {}
        self.native_all_reduce = native_all_reduce(parallel)   # kept: C holds its address during a step
        self.float32_norms: dict[int, RMSNorm] = {}
        self.scratch: list[torch.Tensor] = []   # see _native_scratch
        self.scratch_rows, self.scratch_addresses = 0, []

    def build_mlp(self, config: Any, layer: int, parallel: ParallelContext) -> nn.Module:
        """Layer `layer`'s feed-forward block (a subclass builds its experts here)."""
        return MLP(config, parallel)

    @torch.inference_mode()
    def forward(self, batch: ForwardBatch) -> ModelOutput:
        parallel = self.parallel
        served = self.layers[self.start].input_layernorm.weight.dtype
        x = residual = None   # the first stage's embeddings are looked up below (in C, natively)
        captured: dict[int, torch.Tensor] = {}
        if not parallel.is_first_stage:   # the previous stage's last layer output and residual stream
            rows, width = batch.input_ids.shape[0], self.config.hidden_size
            x, residual = parallel.receive_from_previous_stage(2, (rows, width), self._between_stages(served, batch))
            # and the hidden states the stages before captured, side by side in layer order
            earlier = sorted(i for i in batch.capture_layers if i < self.start)
            if earlier:
                [states] = parallel.receive_from_previous_stage(1, (rows, len(earlier) * width), torch.float32)
                captured = dict(zip(earlier, states.split(width, dim=-1)))
        if not batch.is_idle:
            batch.attention.prepare(batch)
        native = None if batch.capture_layers else self._decode_natively(x, residual, served, batch)
        normed = None   # the final norm's output, where the native layers computed it
        if native is None:
            if x is None:
                x = self.embed_tokens(batch.input_ids)
            rotary = self.rotary(batch.positions, batch.kv_slots.shape[1])
            x, residual = x.to(served), None if residual is None else residual.to(served)
            for i in range(self.start, self.end):
                if i in batch.capture_layers:   # the residual stream entering layer i (a copy: the
                    # layers add into the residual in place, and layer 0's residual is x)
                    captured[i] = (x.clone() if residual is None else x + residual).float()
                x, residual = self.layers[i](x, residual, rotary, batch)
        else:
            x, residual, normed = native
        if not parallel.is_last_stage:
            between = self._between_stages(served, batch)
            parallel.send_to_next_stage(x.to(between), residual.to(between))
            so_far = sorted(i for i in batch.capture_layers if i < self.end)
            if so_far:
                parallel.send_to_next_stage(torch.cat([captured[i] for i in so_far], -1))
            return ModelOutput(None)   # the last stage computes the logits (and returns the hidden states)
        norm = self.norm if x.dtype == self.norm.weight.dtype else self._float32_copy(self.norm)
        if len(self.layers) in batch.capture_layers:
            # The norm may add into the residual it is given: a copy keeps the stream for the head.
            captured[len(self.layers)] = norm(x, residual.clone())[0].float()
        if normed is not None:   # each row's, in order
            x = normed if batch.logits_indices is None else normed[batch.logits_rows()]
        elif batch.logits_indices is None and batch.is_decode:   # every row's logits, in order: no gather
            x, _ = norm(x, residual)
        else:
            rows = batch.logits_rows()
            x, _ = norm(x[rows], residual[rows])
        hidden = torch.cat([captured[i] for i in batch.capture_layers], -1) if batch.capture_layers else None
        return ModelOutput(self.parallel.vocab_logits(self.lm_head, x, self.vocab_starts), hidden)

    @staticmethod
    def _between_stages(served: torch.dtype, batch: ForwardBatch) -> torch.dtype:
        """The dtype a pipeline stage hands the next one the hidden rows in: the native decode
        layers' (float32 for a few rows of a bf16 model), so that a split keeps the arithmetic
        of the unsplit model, else the served dtype. Both stages work it out alike."""
        native = native_products_dtype(served, batch.input_ids.shape[0]) if batch.is_decode else None
        return native or served

    def _float32_copy(self, norm: RMSNorm) -> RMSNorm:
        """A float32 copy of a norm of a model served in another dtype, for its native decode steps
        (kept: the C layers hold its address)."""
        copy = self.float32_norms.get(id(norm))
        if copy is None:
            copy = self.float32_norms[id(norm)] = RMSNorm(norm.weight.shape[0], norm.eps)
            copy.weight.data = norm.weight.detach().float()
        return copy

    def _decode_natively(self, x: torch.Tensor | None, residual: torch.Tensor | None, served: torch.dtype,
                         batch: ForwardBatch) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None] | None:
        """A decode step's layers in one C call, when every product and the attention have a
        kernel (srv.sdk.native.NativeKernel): (the last layer's output, the residual stream, the
        final norm's output or None). The Python layers call the same kernels in the same order;
        one call saves the dozen Python calls a layer costs. The call also looks up the first
        stage's embeddings (x None) where the matrix is whole here, and, where its products are
        float32, applies the last stage's final norm: around the layers of a one-row step, the
        operators these took cost as much as several layers. Products in bf16 arithmetic (see
        native_products_dtype) hand back the layers' output and the stream in the served dtype,
        for its norm and head."""
        rows = batch.input_ids.shape[0]
        products = native_products_dtype(served if x is None else x.dtype, rows)
        if not batch.is_decode or products is None:
            return None
        if self.parallel.attention_data_parallel:   # the MLPs run on every rank's rows
            return None
        if (rows, products) not in self.native_layers:
            self.native_layers[rows, products] = self._native_layers(rows, products)
        layers = self.native_layers[rows, products]
        attention = None if layers is None else batch.attention.native_decode(batch)
        if attention is None:
            return None
        scratch, ends = self._native_scratch(rows), DecodeEnds()
        if x is None:
            table, embedding = self.embed_tokens, getattr(self.embed_tokens, "weight", None)
            if not (type(table) is VocabParallelEmbedding and not table.parallel.is_parallel and embedding.is_contiguous()
                    and embedding.dtype in (torch.float32, torch.bfloat16)):   # torch's look-up or the module's own
                x = table(batch.input_ids)
            else:
                ids = int64_values(batch.input_ids)   # kept until the call returns
                ends.ids, ends.embedding, ends.vocab = ids.data_ptr(), embedding.data_ptr(), embedding.shape[0]
                ends.embedding_bf16 = embedding.dtype == torch.bfloat16
        given = residual is not None   # a later pipeline stage's: the stream so far
        normed = None
        if self.parallel.is_last_stage and products == torch.float32:
            x_out, residual_out = self.scratch[5][:rows], self.scratch[6][:rows]   # read by nothing after the step
            normed = torch.empty(rows, self.shapes.hidden)
            norm = self.norm if self.norm.weight.dtype == torch.float32 else self._float32_copy(self.norm)
            ends.final_norm, ends.final_out = norm.weight.data_ptr(), normed.data_ptr()
        else:
            x_out, residual_out = torch.empty(rows, self.shapes.hidden), torch.empty(rows, self.shapes.hidden)
        if x is not None:
            x_out.copy_(x)
        if given:
            residual_out.copy_(residual)
        cos, sin = self.rotary.tables(batch.kv_slots.shape[1])
        reduce = self.native_all_reduce.kernel
        positions = int64_values(batch.positions)
        bad = kernels().srv_decode_layers(
            ctypes.addressof(layers), len(layers), ctypes.addressof(self.shapes), ctypes.addressof(attention),
            cos.data_ptr(), sin.data_ptr(), positions.data_ptr(), x_out.data_ptr(), residual_out.data_ptr(), rows,
            *scratch, reduce if reduce is None else ctypes.addressof(reduce), int(given), ctypes.byref(ends))
        if bad:
            raise IndexError(f"token id {int(batch.input_ids[bad - 1])} is outside the embedding matrix's "
                             f"{ends.vocab} rows")
        if products != torch.float32:
            return x_out.to(products), residual_out.to(products), None
        return x_out, residual_out, normed

    def _native_scratch(self, rows: int) -> list[int]:
        """The addresses of srv_decode_layers' scratch rows (qkv, attention, normed, gate_up,
        activation), for up to `rows` rows, with two more of `hidden` (self.scratch[5:7]: the
        layers' output and the residual stream where the step ends in the final norm):
        allocated once for the most rows a step has had, rather than several tensors a step, each
        an operator's dispatch on a one-row step's path."""
        if self.scratch_rows < rows:
            shapes = self.shapes
            self.scratch = [torch.empty(rows, size) for size in (
                (shapes.heads + 2 * shapes.kv_heads) * shapes.head_dim, shapes.heads * shapes.head_dim, shapes.hidden,
                2 * shapes.intermediate, shapes.intermediate, shapes.hidden, shapes.hidden)]
            self.scratch_rows, self.scratch_addresses = rows, [t.data_ptr() for t in self.scratch[:5]]
        return self.scratch_addresses

    def _native_layers(self, rows: int, products: torch.dtype) -> ctypes.Array | None:
        if kernels() is None or has_forward_hooks(self):   # a hooked module runs where torch calls its hooks
            return None
        layers = []
        for layer in self.layers[self.start:self.end]:   # this pipeline stage's
            attention, mlp = layer.self_attn, layer.mlp
            if attention.qk_norm or attention.full_qk_norm or attention.clip_qkv is not None or type(mlp) is not MLP \
                    or mlp.parallel is not self.parallel:   # a block whole on each rank needs no all-reduce
                return None
            offered = [native_product(module, rows, products) for module in
                        (attention.qkv_proj, attention.o_proj, mlp.gate_up_proj, mlp.down_proj)]
            if None in offered:
                return None
            norms = [norm if norm.weight.dtype == torch.float32 else self._float32_copy(norm)
                     for norm in (layer.input_layernorm, layer.post_attention_layernorm)]
            layers.append(NativeDecoderLayer(*offered, *(norm.weight.data_ptr() for norm in norms)))
        if self.lm_head is not None and products == torch.float32 and native_product(self.lm_head, rows, products) \
                is None and (getattr(self.lm_head, "weight_dtype", None) or self.lm_head.weight.dtype) != torch.float32:
            return None   # the head takes the float32 rows only from a kernel
        return (NativeDecoderLayer * len(layers))(*layers)

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        params = dict(self.named_parameters())
        loaded: set[str] = set()
        for name, tensor in weights:
            name = self.rename(checkpoint_key(name.removeprefix("model.")))
            if "rotary_emb" in name or (name == "lm_head.weight" and self.tie_word_embeddings):
                continue
            if self._other_stage(name) and not (name == "embed_tokens.weight" and self.tie_word_embeddings
                                                and self.lm_head is not None):
                continue   # another pipeline stage's (a tied head's last stage takes the embeddings)
            taken = self.load_other(name, tensor)
            if taken is not None:
                loaded.update(taken)
                continue
            module_path, _, leaf = name.rpartition(".")
            parent, _, proj = module_path.rpartition(".")
            if proj in self.FUSED:
                fused, shard = self.FUSED[proj]
                if f"{parent}.{fused}.{leaf}" not in params:
                    raise ValueError(f"checkpoint tensor {name!r} has no parameter in this model" + (
                        "" if leaf in ("weight", "bias") else ": it is a quantized checkpoint's; serve it with the "
                        "--quantization its config.json's quantization_config names"))
                target = params[f"{parent}.{fused}.{leaf}"]
                load_shard(name, self.get_submodule(f"{parent}.{fused}"), target,
                           self._fused_shard(target, fused, shard, parent), tensor, shard)
                loaded.add(f"{parent}.{fused}.{leaf}")
                continue
            # This rank's rows or columns of the tensor (all of it at tp=1).
            # (A tied head on a stage without the embeddings takes them in the head's rows.)
            module = self.get_submodule(module_path) if name in params else self.lm_head
            whole, tensor = tensor, rank_part(module, tensor)
            if name in params and hasattr(params[name], "weight_loader"):
                load_weight(name, params[name], params[name].data, tensor)
                loaded.add(name)
            else:
                if name in params:
                    adopt(name, params[name], tensor)
                    loaded.add(name)
                if name == "embed_tokens.weight" and self.tie_word_embeddings and self.lm_head is not None:
                    # The head's own rows: under data-parallel attention the embedding is whole
                    # while the head may split the vocabulary.
                    adopt(name, params["lm_head.weight"], rank_part(self.lm_head, whole))
                    loaded.add("lm_head.weight")
        missing = set(params) - loaded
        if missing:
            raise ValueError(f"checkpoint is missing weights: {sorted(missing)[:8]}")

    def rename(self, name: str) -> str:
        """A checkpoint name as this model's modules spell it (a subclass's own layout)."""
        return name

    def load_other(self, name: str, tensor: torch.Tensor) -> list[str] | None:
        """Load a tensor the layers above do not take (a subclass's experts): the names of the
        parameters it filled, or None where it is an ordinary layer's."""
        return None

    def _other_stage(self, name: str) -> bool:
        """Whether checkpoint weight `name` belongs to another pipeline stage."""
        head, _, rest = name.partition(".")
        if head == "layers":
            return not self.start <= int(rest.split(".", 1)[0]) < self.end
        return (head == "embed_tokens" and self.embed_tokens is None) or (head in ("norm", "lm_head")
                                                                         and self.lm_head is None)

    def _fused_shard(self, target: torch.Tensor, fused: str, shard: int, parent: str) -> torch.Tensor:
        if fused == "gate_up_proj":
            size = self.get_submodule(f"{parent}.{fused}").out_features // 2
            return shard_rows(target, shard * size, size)
        attention = self.get_submodule(parent)
        sizes = [attention.q_size, attention.kv_size, attention.kv_size]
        return shard_rows(target, sum(sizes[:shard]), sizes[shard])


def adopt(name: str, param: nn.Parameter, tensor: torch.Tensor) -> None:
    """The checkpoint's tensor becomes the parameter's data where it has the parameter's dtype.
    The safetensors loader hands out copy-on-write maps of the file, so the weights are read from
    the page cache when first used: copying them into fresh memory cost a warm launch 0.12 s of
    page faults for the default model's 540 MB."""
    if tensor.dtype == param.dtype and tensor.shape == param.shape and tensor.is_contiguous():
        param.data = tensor
    else:
        copy_checked(name, param.data, tensor)


def copy_checked(name: str, target: torch.Tensor, tensor: torch.Tensor) -> None:
    """copy_ would broadcast a smaller tensor over the target."""
    load_weight(name, target, target, tensor)


def rope_settings(config: Any) -> tuple[float, dict[str, Any] | None]:
    """(theta, scaling) from either config layout: transformers 5 groups them in rope_parameters."""
    parameters = getattr(config, "rope_parameters", None) or {}
    theta = parameters.get("rope_theta") or getattr(config, "rope_theta", None) or 10000.0
    return float(theta), parameters or getattr(config, "rope_scaling", None)


def norm_eps(config: Any) -> float:
    return getattr(config, "rms_norm_eps", 1e-6)   # transformers' default for all three


def supports(config: Any) -> bool:
    return any(a in SUPPORTED_ARCHITECTURES for a in (getattr(config, "architectures", None) or []))
