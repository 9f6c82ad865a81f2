"""Conformance kit for LoRA backends (`--lora-backend`)."""

from __future__ import annotations

from typing import Any, Callable

import pytest
import torch

from srv.sdk.lora import LoRABackend, LoRAProduct, LoRASegment
from srv.sdk.testing.registry import create

IN_FEATURES, OUT_FEATURES = 48, 40


def random_products(generator: torch.Generator, dtype: torch.dtype) -> list[list[LoRAProduct]]:
    """Three adapters of ranks 2, 8 and 4 on a layer of two shards (columns 0-23 and 24-39):
    the first targets both, the second the second shard, the third nothing."""
    def product(offset: int, columns: int, rank: int, scaling: float) -> LoRAProduct:
        return LoRAProduct(offset, torch.randn(rank, IN_FEATURES, generator=generator).to(dtype),
                           torch.randn(columns, rank, generator=generator).to(dtype), scaling)

    return [[product(0, 24, 2, 0.5), product(24, 16, 2, 0.5)], [product(24, 16, 8, 2.0)], []]


def reference(out: torch.Tensor, x: torch.Tensor, products: list[list[LoRAProduct]],
              segments: list[LoRASegment]) -> torch.Tensor:
    expected = out.clone().double()
    for segment in segments:
        if segment.slot < 0:
            continue
        rows = slice(segment.start, segment.end)
        for p in products[segment.slot]:
            delta = (x[rows].double() @ p.a.double().t()) @ p.b.double().t() * p.scaling
            expected[rows, p.offset:p.offset + p.b.shape[0]] += delta
    return expected


class LoRABackendKit:
    """Checks a LoRA backend: `add` puts each segment's adapter products into its rows and
    columns, in place, as the plain products would (float32 and bfloat16), leaves base-model
    rows and other columns alone, and takes segments in any order and of any length. A backend
    that offers C kernels (`native_linear`) must give the base kernel's product plus what `add`
    adds, and follow `set_segments` and `products_changed`.

        class TestMyLoRA(LoRABackendKit):
            backend_name = "mylora"            # the name your plugin registers, or:
            # backend_factory = MyBackend      # (server_args) -> LoRABackend
    """

    backend_name: str | None = None
    backend_factory: Callable[[Any], LoRABackend] | None = None

    def make_backend(self) -> LoRABackend:
        return create(self, "lora_backend", "backend_name", "backend_factory", None)

    # ---- the tests -------------------------------------------------------------------------

    @pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
    def test_segments_get_their_adapters_products(self, dtype: torch.dtype) -> None:
        generator = torch.Generator().manual_seed(0)
        products = random_products(generator, dtype)
        # Requests of adapters 1, base, 0, 2 (targets nothing), 0 again and 1, of 1 to 7 rows.
        segments = [LoRASegment(1, 0, 3), LoRASegment(-1, 3, 5), LoRASegment(0, 5, 12), LoRASegment(2, 12, 13),
                    LoRASegment(0, 13, 14), LoRASegment(1, 14, 20)]
        x = torch.randn(20, IN_FEATURES, generator=generator).to(dtype)
        out = torch.randn(20, OUT_FEATURES, generator=generator).to(dtype)
        expected = reference(out, x, products, [s for s in segments if s.slot >= 0])
        before = out.clone()
        result = self.make_backend().add(out, x, products, [s for s in segments if s.slot >= 0])
        assert result is None, "add works in place and returns nothing"
        # bfloat16 keeps 8 bits: a sum of products near 20 is good to a few tenths.
        atol, rtol = (1e-4, 1e-5) if dtype == torch.float32 else (0.5, 2e-2)
        torch.testing.assert_close(out.double(), expected, atol=atol, rtol=rtol)
        untouched = [*range(3, 5), 12]
        assert torch.equal(out[untouched], before[untouched]), "base-model rows, or an adapter with no product here"

    @pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
    def test_ranks_and_widths_of_real_layers(self, dtype: torch.dtype) -> None:
        """Ranks 16 to 64 and a few hundred columns, as real adapters have (kernels work in
        blocks of ranks and columns: this crosses their edges), on rows of one adapter and many."""
        generator = torch.Generator().manual_seed(3)
        in_features, out_features = 96, 328
        products = [[LoRAProduct(0, torch.randn(rank, in_features, generator=generator).to(dtype) / 10,
                                 torch.randn(out_features - 8, rank, generator=generator).to(dtype) / 10, 2.0)]
                    for rank in (16, 40, 64)]
        segments = [LoRASegment(2, 0, 37), LoRASegment(0, 37, 40), LoRASegment(1, 40, 45), LoRASegment(2, 45, 46)]
        x = torch.randn(46, in_features, generator=generator).to(dtype)
        out = torch.randn(46, out_features, generator=generator).to(dtype)
        expected = reference(out, x, products, segments)
        before = out.clone()
        self.make_backend().add(out, x, products, segments)
        atol, rtol = (1e-4, 1e-5) if dtype == torch.float32 else (0.1, 2e-2)
        torch.testing.assert_close(out.double(), expected, atol=atol, rtol=rtol)
        assert torch.equal(out[:, -8:], before[:, -8:]), "columns no product targets"

    def test_no_segments_change_nothing(self) -> None:
        generator = torch.Generator().manual_seed(1)
        products = random_products(generator, torch.float32)
        out = torch.randn(4, OUT_FEATURES, generator=generator)
        before = out.clone()
        self.make_backend().add(out, torch.randn(4, IN_FEATURES, generator=generator), products, [])
        assert torch.equal(out, before)

    def test_native_linear_is_the_base_kernel_plus_the_adapters(self) -> None:
        from srv.sdk.native import call_linear
        from srv.sdk.packed_linear import PackedLinear

        generator = torch.Generator().manual_seed(2)
        products = random_products(generator, torch.float32)
        base = PackedLinear(torch.randn(OUT_FEATURES, IN_FEATURES, generator=generator), None, keep_rows=True)
        rows = 7
        kernel = base.native_linear(rows) if _has_dense_kernels() else None
        if kernel is None:
            pytest.skip("no C compiler: the base layer has no kernel to wrap")
        backend = self.make_backend()
        segments = [LoRASegment(1, 0, 2), LoRASegment(0, 3, 7)]
        backend.set_segments(segments, rows)
        native = backend.native_linear(kernel, products, IN_FEATURES, OUT_FEATURES)
        if native is None:
            pytest.skip("the backend offers no C kernels (optional)")
        x = torch.randn(rows, IN_FEATURES, generator=generator)
        torch.testing.assert_close(call_linear(native, x, OUT_FEATURES).double(),
                                   reference(base(x), x, products, segments), atol=1e-4, rtol=1e-5)
        # The core empties slot 0 of this layer, then the next batch has other rows.
        products[0] = []
        backend.products_changed(products, 0)
        segments = [LoRASegment(1, 4, 7), LoRASegment(0, 0, 4)]
        backend.set_segments(segments, rows)
        torch.testing.assert_close(call_linear(native, x, OUT_FEATURES).double(),
                                   reference(base(x), x, products, segments), atol=1e-4, rtol=1e-5)
        backend.set_segments([], rows)
        assert torch.equal(call_linear(native, x, OUT_FEATURES), base(x)), "no adapter rows: the base product"


def _has_dense_kernels() -> bool:
    from srv.sdk.packed_linear import kernels

    return kernels() is not None
