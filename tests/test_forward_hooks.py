"""--forward-hooks: SGLang's hook specs register torch forward hooks on the served model's
modules; hooked layers run in Python on every step (decode included), a hook's return value
replaces the module's output, and bad specs are refused by name."""

from __future__ import annotations

import json

import pytest
import torch

import srv
from srv.args.parser import parse_launch_args
from srv.plugin_manager import load_plugins
from test_engine import GREEDY, assert_matches_hf, make_engine, random_prompts

CALLS: list[tuple[str, tuple[int, ...]]] = []


def record_calls(config: dict) -> object:
    """A hook factory: the hook notes the output shape of each call, under the config's label."""
    def hook(module: torch.nn.Module, inputs: tuple, output: torch.Tensor) -> None:
        CALLS.append((config.get("label", ""), tuple(output.shape)))
    return hook


def favour_token(config: dict) -> object:
    """A hook factory whose hook raises one token's logit far above the rest."""
    def hook(module: torch.nn.Module, inputs: tuple, output: torch.Tensor) -> torch.Tensor:
        output = output.clone()
        output[..., config["token"]] += 1e4
        return output
    return hook


def hooks(*specs: dict) -> str:
    return json.dumps(list(specs))


def test_hooks_run_on_every_layer_of_every_step_and_keep_the_output(tiny_models):
    CALLS.clear()
    prompts = random_prompts(2, seed=21)
    spec = {"name": "mlp-shapes", "target_modules": ["layers.*.mlp"], "hook_factory": "test_forward_hooks:record_calls",
            "config": {"label": "mlp"}}
    with make_engine(tiny_models["llama"], forward_hooks=hooks(spec)) as engine:
        layers = len(engine.runner.model.layers)
        results = engine.generate(input_ids=prompts, sampling_params=GREEDY)
        steps = engine.scheduler.stats.forward_steps
    assert_matches_hf(engine, tiny_models["llama"], prompts, results)
    # Decode steps too: the hooked layers never take the one-call C path.
    assert len(CALLS) == layers * steps and {label for label, _ in CALLS} == {"mlp"}


def test_a_hook_returning_a_value_replaces_the_output(tiny_models):
    spec = {"target_modules": ["lm_head"], "hook_factory": "test_forward_hooks.favour_token", "config": {"token": 7}}
    with make_engine(tiny_models["llama"], forward_hooks=hooks(spec)) as engine:
        result = engine.generate(input_ids=[3, 4, 5], sampling_params={"max_new_tokens": 5, "temperature": 0,
                                                                      "ignore_eos": True})
    assert result["output_ids"] == [7] * 5


@pytest.mark.parametrize("specs,message", [
    ('{"target_modules": ["x"]}', "must be a JSON list"),
    ('[{"target_modules": [], "hook_factory": "a:b"}]', "target_modules must be a non-empty list"),
    ('[{"target_modules": ["x"]}]', "hook_factory must be an import path"),
    ('[{"target_modules": ["x"], "hook_factory": "a:b", "when": 1}]', "unknown keys ['when']"),
])
def test_malformed_specs_are_refused_at_launch(specs, message, capsys):
    with pytest.raises(SystemExit):
        parse_launch_args(["--forward-hooks", specs], *load_plugins())
    assert message in capsys.readouterr().err


@pytest.mark.parametrize("spec,message", [
    ({"target_modules": ["no_such.*"], "hook_factory": "test_forward_hooks:record_calls"}, "no module matches"),
    ({"target_modules": ["lm_head"], "hook_factory": "no_such_module:hook"}, "does not import"),
])
def test_specs_that_match_nothing_or_do_not_import_fail_the_start(tiny_models, spec, message):
    with pytest.raises(ValueError, match=message):
        srv.Engine(model_path=str(tiny_models["llama"]), dtype="float32", forward_hooks=hooks(spec))


def test_tensor_dumps_of_two_implementations_compare_layer_by_layer(tiny_models, tmp_path):
    """--debug-tensor-dump-output-folder: a file a forward pass of each module's output; srv's
    layers and transformers' give the same embedding and logits (and the layers agree, srv's
    layer output being transformers' less the residual it keeps apart)."""
    prompt, passes = [3, 9, 27, 4, 8], 3
    for impl in ("auto", "transformers"):
        with make_engine(tiny_models["llama"], model_impl=impl, debug_tensor_dump_output_folder=str(tmp_path / impl),
                         disable_radix_cache=True) as engine:
            engine.generate(input_ids=prompt, sampling_params={"max_new_tokens": passes, "temperature": 0,
                                                               "ignore_eos": True})
    native = [torch.load(f) for f in sorted((tmp_path / "auto" / "TP0_PP0").glob("pass*.pt"))]
    hf = [torch.load(f) for f in sorted((tmp_path / "transformers" / "TP0_PP0").glob("pass*.pt"))]
    assert len(native) == len(hf) >= passes
    first, reference = native[0], hf[0]
    assert {"embed_tokens", "layers.0.0", "layers.0.1", "lm_head"} <= set(first)
    assert {"hf.model.embed_tokens", "hf.model.layers.0", "hf.lm_head"} <= set(reference)
    assert torch.equal(first["embed_tokens"], reference["hf.model.embed_tokens"][0])
    layer, want = first["layers.0.0"] + first["layers.0.1"], reference["hf.model.layers.0"][0]   # srv's output
    # and the residual it carries. The two sum in different orders (and the kernels by the CPU's
    # vector width): a few float32 ulps of the largest values, wherever the element is small.
    assert torch.allclose(layer, want, atol=1e-5 * float(want.abs().max()))
    logits = reference["hf.lm_head"][0]
    assert torch.allclose(first["lm_head"], logits, atol=1e-5 * float(logits.abs().max()) + 1e-4)


def test_a_dump_input_file_runs_its_ids_through_the_model_and_ends_the_server(tiny_models, tmp_path):
    """--debug-tensor-dump-input-file (SGLang's debugging run): the file's ids go through the
    model, their layers are dumped, and the server exits without listening."""
    import os
    import subprocess
    import sys

    import numpy

    numpy.save(tmp_path / "ids.npy", numpy.array([3, 9, 27, 4, 8]))
    result = subprocess.run([sys.executable, "-m", "srv", "launch", "--model-path", str(tiny_models["llama"]),
                             "--dtype", "float32", "--debug-tensor-dump-input-file", str(tmp_path / "ids.npy"),
                             "--debug-tensor-dump-output-folder", str(tmp_path / "dump")],
                            capture_output=True, text=True, timeout=180, env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert result.returncode == 0, result.stdout + result.stderr
    assert "ran the 5 token ids" in result.stdout + result.stderr
    first = torch.load(sorted((tmp_path / "dump" / "TP0_PP0").glob("pass*.pt"))[0])
    assert first["embed_tokens"].shape[0] == 5
