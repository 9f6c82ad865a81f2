"""Conformance kit for weight quantization methods (`--quantization`)."""

from __future__ import annotations

from typing import Any, Callable

import pytest
import torch
from torch import nn

from srv.sdk.native import call_linear
from srv.sdk.quantization import QuantizationMethod
from srv.sdk.testing.registry import create

# (out_features, in_features) of the layers the kit quantizes: multiples of 32, as block formats need.
SHAPES = ((96, 64), (64, 160), (192, 96))


class QuantizationMethodKit:
    """Checks that the layers a quantization method puts in compute what they replace.

        class TestMyMethod(QuantizationMethodKit):
            backend_name = "my_method"          # the name your plugin registers, or:
            # method_factory = MyMethod         # (server_args) -> QuantizationMethod

            def make_weight(self, out_features, in_features, generator):
                ...                             # float32 weights your method accepts

    The kit quantizes small models of linear layers made of `make_weight` weights, casts them
    to each of `dtypes` as srv does after loading, and compares every layer's output for
    `row_counts` rows with the float32 product of the original weights: the error, relative
    to the reference's norm, must stay within `relative_tolerance` (bf16 activations by default).
    """

    backend_name: str | None = None
    method_factory: Callable[..., QuantizationMethod] | None = None
    server_args: Any = None
    relative_tolerance: float = 2e-2
    row_counts: tuple[int, ...] = (1, 3, 16, 40)
    dtypes: tuple[torch.dtype, ...] = (torch.float32, torch.bfloat16)

    def make_method(self) -> QuantizationMethod:
        return create(self, "quantization", "backend_name", "method_factory", self.server_args)

    def make_weight(self, out_features: int, in_features: int, generator: torch.Generator) -> torch.Tensor:
        return torch.randn(out_features, in_features, generator=generator) * 0.05

    def make_model(self, bias: bool = False, seed: int = 0) -> nn.Sequential:
        generator = torch.Generator().manual_seed(seed)
        layers = []
        for out_features, in_features in SHAPES:
            layer = nn.Linear(in_features, out_features, bias=bias)
            with torch.no_grad():
                layer.weight.copy_(self.make_weight(out_features, in_features, generator))
                if bias:
                    layer.bias.copy_(torch.randn(out_features, generator=generator))
            layers.append(layer)
        return nn.Sequential(*layers).eval()

    # ---- the tests -------------------------------------------------------------------------

    def test_apply_replaces_the_layers_and_counts_them(self) -> None:
        model = self.make_model()
        replaced = self.make_method().apply(model)
        plain = sum(type(m) is nn.Linear for m in model)
        assert replaced == len(SHAPES) - plain, f"apply returned {replaced}, but {len(SHAPES) - plain} layers changed"
        assert replaced > 0, "the method replaced none of the kit's layers: override make_weight with weights it takes"

    @pytest.mark.parametrize("bias", [False, True])
    def test_products_match_the_original_layers(self, bias: bool) -> None:
        for dtype in self.dtypes:
            original = self.make_model(bias)
            quantized = self.make_model(bias)
            self.make_method().apply(quantized)
            quantized.to(dtype)
            generator = torch.Generator().manual_seed(1)
            for index, (reference_layer, layer) in enumerate(zip(original, quantized)):
                for rows in self.row_counts:
                    x = torch.randn(rows, reference_layer.in_features, generator=generator)
                    with torch.inference_mode():
                        reference = reference_layer(x)
                        out = layer(x.to(dtype))
                    assert out.dtype == dtype, f"layer {index} returned {out.dtype} for {dtype} input"
                    assert out.shape == reference.shape, f"layer {index}: shape {tuple(out.shape)}"
                    error = float((out.float() - reference).norm() / reference.norm())
                    assert error <= self.relative_tolerance, (
                        f"layer {index} {tuple(reference_layer.weight.shape)}, {rows} rows, {dtype}, bias={bias}: "
                        f"relative error {error:.4f} > {self.relative_tolerance}")

    def test_keeps_leading_dimensions(self) -> None:
        model = self.make_model()
        self.make_method().apply(model)
        layer = model[0]
        x = torch.randn(2, 5, SHAPES[0][1])
        with torch.inference_mode():
            assert layer(x).shape == (2, 5, SHAPES[0][0])

    def test_native_linear_matches_forward(self) -> None:
        """`native_linear(rows)`, where a layer offers it, computes the layer's float32 forward
        for that many rows, to the bit (a model may call either for the same batch)."""
        offered = 0
        for bias in (False, True):
            model = self.make_model(bias)
            self.make_method().apply(model)
            generator = torch.Generator().manual_seed(2)
            for index, layer in enumerate(model):
                for rows in self.row_counts:
                    kernel = getattr(layer, "native_linear", lambda rows: None)(rows)
                    if kernel is None:
                        continue
                    offered += 1
                    x = torch.randn(rows, SHAPES[index][1], generator=generator)
                    with torch.inference_mode():
                        expected = layer(x)
                    assert torch.equal(call_linear(kernel, x, expected.shape[1]), expected), \
                        f"layer {index}, {rows} rows, bias={bias}: native_linear differs from forward"
        if not offered:
            pytest.skip("the method's layers offer no native kernel (optional)")
