"""`--quantization gguf`: GGUF blocks recovered exactly from the dequantized weights, the layers
that fit no format left dense, the batch-size dispatch, and the default model served from its
own 4-bit weights. (The QuantizationMethodKit runs in test_sdk_testing; the served model is held
to the bf16 tolerance against HF in test_engine.)"""

from __future__ import annotations

import pytest
import torch
from torch import nn

import srv
from srv.plugins.quantization.gguf import (DENSE_FROM_ROWS, GGUFLinear, int4_planes, q4_1_planes, q8_0_planes)
from test_sdk_testing import gguf_weight


def weight(kind: str, rows: int = 96, columns: int = 128, seed: int = 0) -> torch.Tensor:
    return gguf_weight(kind, rows, columns, torch.Generator().manual_seed(seed))


def test_q4_1_blocks_rebuild_the_file_weights():
    w = weight("Q4_1")
    [(q, scale, zero)] = q4_1_planes(w)
    assert q.min() >= 0 and q.max() <= 15 and torch.equal(q, q.round())
    rebuilt = ((q - 8).view(96, -1, 32) * scale[..., None] + zero[..., None]).view_as(w)
    assert torch.allclose(rebuilt, w, rtol=0, atol=1e-6)
    assert q8_0_planes(w) is None


def test_q8_0_blocks_rebuild_the_file_weights_from_two_planes():
    w = weight("Q8_0")
    assert q4_1_planes(w) is None
    rebuilt = torch.zeros_like(w)
    for q, scale, zero in q8_0_planes(w):
        assert q.min() >= 0 and q.max() <= 15
        rebuilt += ((q - 8).view(96, -1, 32) * scale[..., None] + zero[..., None]).view_as(w)
    assert torch.allclose(rebuilt, w, rtol=0, atol=1e-6)


@pytest.mark.parametrize("w", [
    torch.randn(64, 128),                                             # plain floats
    torch.cat([weight("Q4_1", 64), torch.randn(32, 128)]),             # a fused layer, one part not GGUF
    weight("Q4_1", 64, 128)[:, :100],                                 # rows not made of 32-value blocks
], ids=["float", "mixed", "ragged"])
def test_weights_in_no_supported_format_stay_dense(w):
    assert int4_planes(w) is None


def test_small_batches_read_the_planes_and_large_ones_the_dense_copy():
    dense = nn.Linear(128, 96, bias=False)
    with torch.no_grad():
        dense.weight.copy_(weight("Q4_1"))
    layer = GGUFLinear(int4_planes(dense.weight), dense)
    calls = []
    layer.dense.register_forward_hook(lambda *_: calls.append("dense"))
    layer.planes[0].register_forward_hook(lambda *_: calls.append("planes"))
    with torch.inference_mode():
        layer(torch.randn(DENSE_FROM_ROWS - 1, 128))
        layer(torch.randn(DENSE_FROM_ROWS, 128))
    assert calls == ["planes", "dense"]


def test_default_model_serves_every_linear_layer_from_its_gguf_blocks():
    with srv.Engine(quantization="gguf", dtype="float32") as engine:
        layers = [m for m in engine.runner.model.modules() if isinstance(m, GGUFLinear)]
        config = engine.runner.config
        # Four projections per decoder layer (q/k/v and gate/up fused) and the vocabulary head.
        assert len(layers) == 4 * config.num_hidden_layers + 1
        assert [len(m.planes) for m in layers].count(2) == 1   # the head: Q8_0 token embeddings
        result = engine.generate("The capital of France is", {"max_new_tokens": 8, "temperature": 0})
        assert result["meta_info"]["completion_tokens"] == 8


def test_gguf_quantization_refuses_a_model_that_is_not_gguf(tiny_models):
    with pytest.raises(ValueError, match="--quantization gguf serves a .gguf file"):
        srv.Engine(model_path=str(tiny_models["llama"]), quantization="gguf")
