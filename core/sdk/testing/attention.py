"""Conformance kit for attention backends (`--attention-backend`)."""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Callable

import pytest
import torch

from srv.sdk.attention import AttentionBackend, ForwardBatch, KVCache
from srv.sdk.native import call_decode_attention
from srv.sdk.parallel import ParallelContext
from srv.sdk.testing.registry import create

@dataclass(frozen=True)
class BatchShape:
    """A ragged batch: each request's cached tokens and new tokens, and how many slots at the
    start of their slot tables all requests share (a prefix-cache hit on a common prompt)."""

    prefix_lens: list[int]
    extend_lens: list[int]
    shared_prefix: int = 0


# Prefill chunks (prefix 0), decode steps (extend 1), prefix-cache hits (prefix > 0, extend > 1),
# all of them mixed, and requests that share the first slots of their tables.
BATCHES = {
    "prefill": BatchShape([0, 0, 0], [7, 1, 19]),
    "decode": BatchShape([5, 1, 33, 16], [1, 1, 1, 1]),
    "long_decode": BatchShape([150, 64, 71], [1, 1, 1]),   # contexts over a kernel's block of 64 tokens
    "prefix_hits": BatchShape([16, 3, 40], [9, 17, 2]),
    "mixed": BatchShape([0, 12, 7, 0, 30, 1], [13, 1, 5, 1, 1, 16]),
    "shared_prefix_decode": BatchShape([150, 140, 131, 200, 129, 300, 140], [1] * 7, shared_prefix=128),
    "shared_prefix_hits": BatchShape([70, 64, 90], [9, 17, 2], shared_prefix=64),
}
NUM_LAYERS = 2


@dataclass
class AttentionCase:
    """One forward pass: the batch, its random cache and each layer's random q, k, v."""

    prefix_lens: list[int]
    extend_lens: list[int]
    num_heads: int
    num_kv_heads: int
    head_dim: int
    dtype: torch.dtype
    kv_slots: torch.Tensor
    out_cache_loc: torch.Tensor
    positions: torch.Tensor
    k_buffers: list[torch.Tensor]
    v_buffers: list[torch.Tensor]
    qkv: list[tuple[torch.Tensor, torch.Tensor, torch.Tensor]]  # per layer

    def __str__(self) -> str:
        return (f"prefix_lens={self.prefix_lens} extend_lens={self.extend_lens} heads={self.num_heads}/"
                f"{self.num_kv_heads} head_dim={self.head_dim} dtype={self.dtype}")

    def batch(self, backend: AttentionBackend, dtype: torch.dtype, pool: str | None = None) -> ForwardBatch:
        """A ForwardBatch over a fresh copy of the cache, stored in `dtype`, or in the KV pool
        `pool` (a `--kv-cache-dtype` name) for a model served in `dtype`."""
        if pool is None:
            cache = KVCache(1, NUM_LAYERS, self.num_kv_heads, self.head_dim, dtype)
            cache.k_buffers = [b.to(dtype, copy=True) for b in self.k_buffers]
            cache.v_buffers = [b.to(dtype, copy=True) for b in self.v_buffers]
        else:
            cache = kv_pool(pool, self.k_buffers[0].shape[0], self.num_kv_heads, self.head_dim, dtype)
            every_slot = torch.arange(self.k_buffers[0].shape[0])
            for layer in range(NUM_LAYERS):
                cache.store(layer, every_slot, self.k_buffers[layer], self.v_buffers[layer])
        return ForwardBatch(input_ids=torch.zeros_like(self.positions), positions=self.positions,
                            out_cache_loc=self.out_cache_loc, kv_slots=self.kv_slots,
                            prefix_lens=list(self.prefix_lens), extend_lens=list(self.extend_lens),
                            kv_cache=cache, attention=backend)


# srv's KV pools besides auto (the served dtype, which the other tests cover), and the scales the
# kit gives a scaled pool's layers: none of them 1, so that a backend that ignores them shows.
KV_POOLS = ("fp8_e4m3", "fp8_e5m2")
POOL_SCALES = ([0.5, 2.0], [0.25, 1.5])


def kv_pool(name: str, num_slots: int, num_kv_heads: int, head_dim: int, dtype: torch.dtype) -> KVCache:
    """The pool `name` builds for a model served in `dtype`, with POOL_SCALES where it is scaled."""
    from srv.sdk.testing.registry import registration

    cache = registration("kv_cache_dtype", name).create(None).create(num_slots, NUM_LAYERS, num_kv_heads, head_dim,
                                                                     dtype)
    if cache.scaled:
        cache.k_scales, cache.v_scales = (list(s) for s in POOL_SCALES)
    return cache


def make_case(shape: BatchShape, num_heads: int = 8, num_kv_heads: int = 2, head_dim: int = 64,
              dtype: torch.dtype = torch.float32, page_size: int = 16, seed: int = 0) -> AttentionCase:
    """A batch over a paged cache whose pages are a random permutation.

    Page 0, holding the padding slot 0, is never used; every slot, used or not, holds random
    values, so reading a wrong slot or a padded one shows. The shared prefix lies in pages of
    its own, which every request's slot table lists first."""
    prefix_lens, extend_lens, shared = shape.prefix_lens, shape.extend_lens, shape.shared_prefix
    assert all(p >= shared for p in prefix_lens), "a shared prefix is cached: within every request's prefix"
    g = torch.Generator().manual_seed(seed)
    seq_lens = [p + e for p, e in zip(prefix_lens, extend_lens)]
    pages_needed = math.ceil(shared / page_size) + sum(math.ceil((n - shared) / page_size) for n in seq_lens)
    num_pages = 2 * pages_needed + 1
    free_pages = (torch.randperm(num_pages - 1, generator=g) + 1).tolist()

    def slots(n: int) -> torch.Tensor:
        pages = [free_pages.pop() for _ in range(math.ceil(n / page_size))]
        return torch.cat([torch.arange(p * page_size, (p + 1) * page_size) for p in pages] or
                         [torch.empty(0, dtype=torch.int64)])[:n]

    common = slots(shared)
    kv_slots = torch.zeros(len(seq_lens), max(seq_lens), dtype=torch.int64)
    for i, n in enumerate(seq_lens):
        kv_slots[i, :n] = torch.cat([common, slots(n - shared)])
    out_cache_loc = torch.cat([kv_slots[i, p:p + e] for i, (p, e) in enumerate(zip(prefix_lens, extend_lens))])
    positions = torch.cat([torch.arange(p, p + e) for p, e in zip(prefix_lens, extend_lens)])
    tokens = int(sum(extend_lens))

    def randn(*size: int) -> torch.Tensor:  # values exactly representable in `dtype`
        return torch.randn(*size, generator=g).to(dtype).float()

    buffer_shape = (num_pages * page_size, num_kv_heads, head_dim)
    return AttentionCase(
        list(prefix_lens), list(extend_lens), num_heads, num_kv_heads, head_dim, dtype, kv_slots,
        out_cache_loc, positions,
        k_buffers=[randn(*buffer_shape) for _ in range(NUM_LAYERS)],
        v_buffers=[randn(*buffer_shape) for _ in range(NUM_LAYERS)],
        qkv=[(randn(tokens, num_heads, head_dim), randn(tokens, num_kv_heads, head_dim),
              randn(tokens, num_kv_heads, head_dim)) for _ in range(NUM_LAYERS)])


def verify_case(dtype: torch.dtype = torch.float32, seed: int = 0) -> AttentionCase:
    """A speculative verify pass (ForwardMode.TARGET_VERIFY): a request's last token and three
    drafts as four decode rows over one slot table, row j seeing the cache up to its own
    position (the keys and values of the rows before it included), beside a plain decode row."""
    case = make_case(BatchShape([20, 21, 22, 23, 9], [1, 1, 1, 1, 1]), dtype=dtype, seed=seed)
    table = case.kv_slots[3, :24].clone()
    for j in range(4):
        case.kv_slots[j] = 0
        case.kv_slots[j, :21 + j] = table[:21 + j]
    case.out_cache_loc[:4] = table[20:24]
    return case


def run(backend: AttentionBackend, case: AttentionCase, dtype: torch.dtype,
        pool: str | None = None) -> tuple[list[torch.Tensor], ForwardBatch]:
    """As the model runner does: `prepare` once for the batch, then `forward` for every layer."""
    batch = case.batch(backend, dtype, pool)
    backend.prepare(batch)
    outputs = [backend.forward(q.to(dtype), k.to(dtype), v.to(dtype), layer, batch)
               for layer, (q, k, v) in enumerate(case.qkv)]
    return outputs, batch


class AttentionBackendKit:
    """Checks an attention backend against srv's reference backend and the AttentionBackend contract.

        class TestMyAttention(AttentionBackendKit):
            backend_name = "my_attention"        # the name your plugin registers, or:
            # backend_factory = MyAttention      # (num_heads, num_kv_heads, head_dim, scale) -> backend

    The reference (`reference_name`) runs in float32 on the same (dtype-rounded) inputs;
    `tolerances` maps a dtype to the (atol, rtol) outputs must meet. A backend that is
    registered but unavailable on this machine is skipped with its availability reason.
    """

    backend_name: str | None = None
    backend_factory: Callable[..., AttentionBackend] | None = None
    reference_name: str = "torch_native"
    tolerances: dict[torch.dtype, tuple[float, float]] = {torch.float32: (1e-5, 1e-5),
                                                          torch.bfloat16: (2e-2, 2e-2),
                                                          torch.float16: (5e-3, 5e-3)}

    def make_backend(self, num_heads: int, num_kv_heads: int, head_dim: int) -> AttentionBackend:
        return create(self, "attention", "backend_name", "backend_factory",
                      num_heads, num_kv_heads, head_dim, head_dim ** -0.5)

    def make_reference(self, num_heads: int, num_kv_heads: int, head_dim: int) -> AttentionBackend:
        from srv.sdk.testing.registry import registration

        return registration("attention", self.reference_name).create(num_heads, num_kv_heads, head_dim,
                                                                      head_dim ** -0.5)

    def assert_matches_reference(self, case: AttentionCase, backend: AttentionBackend | None = None) -> None:
        shape = (case.num_heads, case.num_kv_heads, case.head_dim)
        backend = backend or self.make_backend(*shape)
        expected, _ = run(self.make_reference(*shape), case, torch.float32)
        actual, _ = run(backend, case, case.dtype)
        atol, rtol = self.tolerances[case.dtype]
        for layer, (out, ref) in enumerate(zip(actual, expected)):
            torch.testing.assert_close(out.float(), ref, atol=atol, rtol=rtol,
                                       msg=lambda m: f"layer {layer} differs from {self.reference_name} ({case}): {m}")

    # ---- the tests -------------------------------------------------------------------------

    @pytest.mark.parametrize("kind", list(BATCHES))
    def test_ragged_batches_match_reference(self, kind: str) -> None:
        self.assert_matches_reference(make_case(BATCHES[kind], seed=len(kind)))

    @pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["float32", "bfloat16"])
    def test_verify_rows_match_reference(self, dtype: torch.dtype) -> None:
        """Speculative verify passes are decode rows sharing a slot table (see verify_case)."""
        self.assert_matches_reference(verify_case(dtype))

    @pytest.mark.parametrize("kind", ["mixed", "decode"])
    @pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16],
                             ids=["float32", "bfloat16", "float16"])
    @pytest.mark.parametrize("head_dim", [64, 128, 20])
    @pytest.mark.parametrize("heads", [(4, 4), (8, 2)], ids=["mha", "gqa"])
    @pytest.mark.parametrize("page_size", [1, 16])
    def test_layouts_match_reference(self, page_size: int, heads: tuple[int, int], head_dim: int,
                                     dtype: torch.dtype, kind: str) -> None:
        self.assert_matches_reference(make_case(BATCHES[kind], *heads, head_dim=head_dim, dtype=dtype,
                                                page_size=page_size, seed=page_size + head_dim))

    @pytest.mark.parametrize("rank", [0, 1])
    def test_tensor_parallel_head_shares_match_reference(self, rank: int) -> None:
        """Under --tensor-parallel-size 2 a backend is built with its rank's heads: SmolLM2's 9
        query heads in 3 key/value groups become 6/2 on rank 0 and 3/1 on rank 1."""
        share = ParallelContext(rank, 2).partition(3)[1]
        self.assert_matches_reference(make_case(BATCHES["mixed"], 3 * share, share, head_dim=64, seed=rank))

    @pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["float32", "bfloat16"])
    def test_output_shape_and_dtype(self, dtype: torch.dtype) -> None:
        case = make_case(BATCHES["mixed"], dtype=dtype)
        outputs, _ = run(self.make_backend(case.num_heads, case.num_kv_heads, case.head_dim), case, dtype)
        for (q, _, _), out in zip(case.qkv, outputs):
            assert out.shape == q.shape, f"forward returned {tuple(out.shape)}, expected q's {tuple(q.shape)}"
            assert out.dtype == dtype, f"forward returned {out.dtype} for {dtype} inputs"
            assert torch.isfinite(out).all(), "forward returned non-finite values"

    @pytest.mark.parametrize("kind", ["mixed", "decode"])
    @pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16],
                             ids=["float32", "bfloat16", "float16"])
    def test_forward_stores_new_kv_at_out_cache_loc(self, kind: str, dtype: torch.dtype) -> None:
        """forward stores this step's k and v at out_cache_loc, in the cache's dtype, and nowhere else.

        That is AttentionBackend.forward's contract; q, k and v must not be modified either."""
        case = make_case(BATCHES[kind], dtype=dtype)
        originals = [tuple(t.to(dtype, copy=True) for t in qkv) for qkv in case.qkv]
        _, batch = run(self.make_backend(case.num_heads, case.num_kv_heads, case.head_dim), case, dtype)
        others = torch.ones(case.k_buffers[0].shape[0], dtype=torch.bool)
        others[case.out_cache_loc] = False
        for layer, (q, k, v) in enumerate(originals):
            for name, new, before, after in (("k", k, case.k_buffers[layer], batch.kv_cache.k_buffers[layer]),
                                             ("v", v, case.v_buffers[layer], batch.kv_cache.v_buffers[layer])):
                assert torch.equal(after[case.out_cache_loc], new), f"layer {layer}: {name} not stored at out_cache_loc"
                assert torch.equal(after[others], before[others].to(dtype)), \
                    f"layer {layer}: {name} written outside out_cache_loc"
            assert all(torch.equal(a.to(dtype), b) for a, b in zip(case.qkv[layer], originals[layer])), \
                "forward modified q, k or v"

    @pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["float32", "bfloat16"])
    def test_native_decode_is_none_or_matches_forward(self, dtype: torch.dtype) -> None:
        """`native_decode` (optional) gives None for batches with prefill tokens, which its
        kernel's signature cannot express, and for decode batches either None or a kernel that
        stores and attends as `forward` does, layer by layer, on float32 q, k and v and a cache
        of `dtype`: the same outputs and the same cache, to the bit."""
        for seed, kind in enumerate(BATCHES):
            case = make_case(BATCHES[kind], dtype=dtype, seed=seed)
            backend = self.make_backend(case.num_heads, case.num_kv_heads, case.head_dim)
            native_batch = case.batch(backend, dtype)
            backend.prepare(native_batch)
            kernel = backend.native_decode(native_batch)
            if not native_batch.is_decode:
                assert kernel is None, f"{kind}: native_decode returned a kernel for a batch with prefill tokens"
            if kernel is None:
                continue
            native = [call_decode_attention(kernel, layer, q, k, v) for layer, (q, k, v) in enumerate(case.qkv)]
            # forward as a float32 model calls it: float32 q, k and v, whatever the cache's dtype.
            forward_backend = self.make_backend(case.num_heads, case.num_kv_heads, case.head_dim)
            batch = case.batch(forward_backend, dtype)
            forward_backend.prepare(batch)
            expected = [forward_backend.forward(q, k, v, layer, batch) for layer, (q, k, v) in enumerate(case.qkv)]
            for layer in range(NUM_LAYERS):
                assert torch.equal(native[layer], expected[layer]), f"{kind}, layer {layer}: outputs differ from forward"
                for name in ("k_buffers", "v_buffers"):
                    assert torch.equal(getattr(native_batch.kv_cache, name)[layer],
                                       getattr(batch.kv_cache, name)[layer]), \
                        f"{kind}, layer {layer}: {name} differ from forward's"

    @pytest.mark.parametrize("kind", ["mixed", "decode", "long_decode", "shared_prefix_decode", "prefix_hits"])
    @pytest.mark.parametrize("pool", KV_POOLS)
    def test_kv_pools_match_reference(self, pool: str, kind: str) -> None:
        """On every KV pool (`--kv-cache-dtype`: float8 with a scale a layer), the backend reads the
        values the pool holds: the reference's output on the same pool, in float32."""
        case = make_case(BATCHES[kind], seed=len(kind))
        shape = (case.num_heads, case.num_kv_heads, case.head_dim)
        expected, _ = run(self.make_reference(*shape), case, torch.float32, pool)
        actual, _ = run(self.make_backend(*shape), case, torch.float32, pool)
        atol, rtol = self.tolerances[torch.float32]
        for layer, (out, ref) in enumerate(zip(actual, expected)):
            torch.testing.assert_close(out, ref, atol=atol, rtol=rtol,
                                       msg=lambda m: f"{pool}, layer {layer}: differs from {self.reference_name}: {m}")

    @pytest.mark.parametrize("kind", ["mixed", "decode"])
    @pytest.mark.parametrize("pool", KV_POOLS)
    def test_forward_stores_into_kv_pools_as_the_pool_does(self, pool: str, kind: str) -> None:
        """forward stores this step's k and v as the pool's own `store` would: the same bytes."""
        case = make_case(BATCHES[kind], seed=3)
        _, batch = run(self.make_backend(case.num_heads, case.num_kv_heads, case.head_dim), case, torch.float32,
                       pool)
        expected = kv_pool(pool, case.k_buffers[0].shape[0], case.num_kv_heads, case.head_dim, torch.float32)
        for layer, (_, k, v) in enumerate(case.qkv):
            expected.store(layer, case.out_cache_loc, k, v)
            for name in ("k_buffers", "v_buffers"):
                stored = getattr(batch.kv_cache, name)[layer][case.out_cache_loc]
                want = getattr(expected, name)[layer][case.out_cache_loc]
                assert torch.equal(stored.view(torch.uint8), want.view(torch.uint8)), \
                    f"{pool}, layer {layer}: {name} at out_cache_loc differ from the pool's own store"

    def test_prepare_once_then_layers_and_batches_reuse_one_backend(self) -> None:
        """One backend serves every batch: prepare once per batch, then forward per layer.

        Each layer's forward (different k and v per layer) reuses the batch's metadata; a
        later batch of other shapes must not see the previous batch's metadata."""
        backend = self.make_backend(8, 2, 64)
        for seed, kind in enumerate(["mixed", "decode", "prefix_hits", "prefill"]):
            self.assert_matches_reference(make_case(BATCHES[kind], seed=seed), backend)
