"""Conformance kit for weight quantization methods (`--quantization`)."""

from __future__ import annotations

from dataclasses import dataclass
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

    def quantized_model(self, bias: bool = False, seed: int = 0) -> tuple[nn.Sequential, int]:
        """`make_model`'s model quantized as srv does it at launch: the method's slots put in
        (`prepare`), the float weights loaded into them, then `apply`. Returns it and what
        `apply` counted."""
        model = self.make_model(bias, seed)
        weights = model.state_dict()
        method = self.make_method()
        method.prepare(model)
        model.load_state_dict(weights)
        return model, method.apply(model)

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
        model, replaced = self.quantized_model()
        plain = sum(type(m) is nn.Linear for m in model)
        assert replaced == len(SHAPES) - plain, f"apply returned {replaced}, but {len(SHAPES) - plain} layers changed"
        assert replaced > 0, "the method replaced none of the kit's layers: override make_weight with weights it takes"

    @pytest.mark.parametrize("bias", [False, True])
    def test_products_match_the_original_layers(self, bias: bool) -> None:
        for dtype in self.dtypes:
            original = self.make_model(bias)
            quantized = self.quantized_model(bias)[0].to(dtype)
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
        layer = self.quantized_model()[0][0]
        x = torch.randn(2, 5, SHAPES[0][1])
        with torch.inference_mode():
            assert layer(x).shape == (2, 5, SHAPES[0][0])

    def test_native_linear_matches_forward(self) -> None:
        """`native_linear(rows)`, where a layer offers it, computes the layer's float32 forward
        for that many rows, to the bit (a model may call either for the same batch)."""
        offered = 0
        for bias in (False, True):
            model = self.quantized_model(bias)[0]
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


# Prompts of the accuracy measure: prose, code, a list, a question and chat-like text.
ACCURACY_PROMPTS = (
    "The capital of France is",
    "def fibonacci(n):",
    "Once upon a time, in a land far away,",
    "List three colors:",
    "Question: What is the boiling point of water at sea level?\nAnswer:",
    "The quick brown fox jumps over",
    "import numpy as np\n\nx = np.array(",
    "Dear Sir or Madam,\n\nI am writing to",
)


@dataclass(frozen=True)
class Accuracy:
    """How close a quantized model's next-token choices are to float32's, along float32's own
    greedy continuations (each position scored with the same context for both):

    top1_logprob_error: the mean absolute difference of the log-probability the two give
        float32's greedy token;
    greedy_agreement: the share of positions where the quantized model's greedy token is
        float32's.
    """

    top1_logprob_error: float
    greedy_agreement: float
    positions: int


def measure_accuracy(make_engine: Callable[..., Any], engine_flags: dict[str, Any],
                     reference_flags: dict[str, Any] | None = None, prompts: tuple[str, ...] = ACCURACY_PROMPTS,
                     steps: int = 32) -> Accuracy:
    """`Accuracy` of make_engine(**engine_flags) against make_engine(**reference_flags) (float32,
    unquantized by default) over `steps` greedy tokens of each prompt; make_engine is srv.Engine
    or the srv_engine_factory fixture (the engines are closed here)."""
    reference_flags = reference_flags or {"dtype": "float32", "quantization": "none"}
    with make_engine(**reference_flags) as reference:
        prompt_ids = [reference.tokenizer.encode(p) for p in prompts]
        greedy = {"max_new_tokens": steps, "temperature": 0, "ignore_eos": True}
        continuations = [r["output_ids"] for r in reference.generate(input_ids=prompt_ids, sampling_params=greedy)]
        expected = _scored(reference, prompt_ids, continuations)
    with make_engine(**engine_flags) as engine:
        observed = _scored(engine, prompt_ids, continuations)
    errors, agreements = [], []
    for want, got in zip(expected, observed):
        for (logprob, _), (their_logprob, their_best) in zip(want, got):
            errors.append(abs(their_logprob - logprob))
            agreements.append(their_best)
    return Accuracy(sum(errors) / len(errors), sum(agreements) / len(agreements), len(errors))


def _scored(engine: Any, prompt_ids: list[list[int]], continuations: list[list[int]]) -> list[list[tuple[float, bool]]]:
    """Per continuation token: (its log-probability, whether it is the model's greedy choice)."""
    params = [{"max_new_tokens": 1, "temperature": 0, "logprob_start_len": len(p), "top_logprobs": 1}
              for p in prompt_ids]
    results = engine.generate(input_ids=[p + c for p, c in zip(prompt_ids, continuations)], sampling_params=params)
    scored = []
    for result, continuation in zip(results, continuations):
        meta = result["meta_info"]
        logprobs = [logprob for logprob, _ in meta["input_token_logprobs"]]
        best = [top[0][0] for top in meta["input_top_logprobs"]]
        scored.append([(lp, b == token) for lp, b, token in zip(logprobs, best, continuation)])
    return scored
