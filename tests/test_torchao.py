"""`--torchao-config`: torchao's CPU quantizations of a float checkpoint, chosen by the flag, each
within its stated bound on the default model; the GPU-only values and stored-quantized
checkpoints refused, naming why."""

from __future__ import annotations

import json
import shutil

import pytest

import srv
from srv.sdk.testing.quantization import measure_accuracy

# value: (top-1 log-probability error at most, greedy agreement at least), docs/quantization.md
BOUNDS = {"int8wo": (0.08, 0.93), "int8dq": (0.25, 0.85), "int4wo-32": (0.75, 0.60), "fp8wo": (0.15, 0.90)}


@pytest.mark.parametrize("value", sorted(BOUNDS))
def test_default_model_within_the_stated_bound(value):
    accuracy = measure_accuracy(srv.Engine, {"dtype": "float32", "torchao_config": value})
    error, agreement = BOUNDS[value]
    assert accuracy.top1_logprob_error <= error, accuracy
    assert accuracy.greedy_agreement >= agreement, accuracy


@pytest.mark.parametrize("dtype", ["bfloat16", "float32"])
def test_the_flag_chooses_the_method_and_quantizes_all_but_the_head(tiny_models, dtype):
    with srv.Engine(model_path=str(tiny_models["llama"]), dtype=dtype, torchao_config="int8dq",
                    max_total_tokens=256) as engine:
        assert engine.runner.quantization_name == "torchao"
        model = engine.runner.model
        assert type(model.layers[0].mlp.down_proj.weight.data).__name__ == "Int8Tensor"
        assert type(model.lm_head.weight.data).__name__ != "Int8Tensor"
        result = engine.generate(input_ids=[[5, 6, 7]], sampling_params={"max_new_tokens": 4, "temperature": 0,
                                                                         "ignore_eos": True})
    assert len(result[0]["output_ids"]) == 4


@pytest.mark.parametrize("value,message", [
    ("fp8dq-per_row", "compute capability 8.9"), ("gemlite-4-64", "gemlite"), ("int3wo", "one of int8wo")])
def test_values_this_machine_cannot_run_are_refused(tiny_models, value, message):
    with pytest.raises(ValueError, match=message):
        srv.Engine(model_path=str(tiny_models["llama"]), dtype="float32", torchao_config=value, max_total_tokens=256)


def test_a_stored_quantized_checkpoint_is_refused(tiny_models, tmp_path):
    shutil.copytree(tiny_models["llama"], tmp_path / "m")
    config = json.loads((tmp_path / "m" / "config.json").read_text())
    config["quantization_config"] = {"quant_method": "fp8", "activation_scheme": "dynamic"}
    (tmp_path / "m" / "config.json").write_text(json.dumps(config))
    with pytest.raises(ValueError, match="stored quantized"):
        srv.Engine(model_path=str(tmp_path / "m"), dtype="float32", torchao_config="int8wo", max_total_tokens=256)


def test_the_method_by_name_needs_the_flag(tiny_models):
    with pytest.raises(ValueError, match="needs --torchao-config"):
        srv.Engine(model_path=str(tiny_models["llama"]), dtype="float32", quantization="torchao",
                   max_total_tokens=256)
