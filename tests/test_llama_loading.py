"""The native Llama's weight loading: the fused projections get the checkpoint's shards, the
other weights are the safetensors loader's copy-on-write maps of the file, and a weight of the
wrong shape is refused by name."""

from __future__ import annotations

import os
import re
from pathlib import Path

import pytest
import torch
from safetensors import safe_open

from srv.plugins.models.llama import LlamaForCausalLM
from srv.plugins.models.loaders import SafetensorsLoader
from srv.sdk.models import materialize

FUSED = {"qkv_proj": ("q_proj", "k_proj", "v_proj"), "gate_up_proj": ("gate_proj", "up_proj")}


def tiny_checkpoint(folder: Path, tie: bool) -> Path:
    from transformers import LlamaConfig, LlamaForCausalLM as HFLlama

    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=48, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, tie_word_embeddings=tie,
                         architectures=["LlamaForCausalLM"])
    HFLlama(config).save_pretrained(folder)
    return folder


def build(folder: Path, dtype: torch.dtype | None = None) -> LlamaForCausalLM:
    from transformers import AutoConfig

    with torch.device("meta"):
        model = LlamaForCausalLM(AutoConfig.from_pretrained(folder))
    return materialize(model, dtype)


def file_mapped(tensor: torch.Tensor, file: Path) -> bool:
    """Whether the tensor's data lies in a mapping of `file`."""
    address = tensor.data_ptr()
    for line in Path(f"/proc/{os.getpid()}/maps").read_text().splitlines():
        fields = line.split(maxsplit=5)
        start, end = (int(part, 16) for part in fields[0].split("-"))
        if start <= address < end:
            return len(fields) == 6 and Path(fields[5]) == file
    return False


def checkpoint(folder: Path) -> dict[str, torch.Tensor]:
    with safe_open(str(folder / "model.safetensors"), framework="pt") as f:
        return {name.removeprefix("model."): f.get_tensor(name).clone() for name in f.keys()}


@pytest.mark.parametrize("tie", [True, False])
def test_weights_load_from_the_file_map_and_fused_shards_are_copied(tmp_path, tie):
    folder = tiny_checkpoint(tmp_path, tie)
    model = build(folder)
    SafetensorsLoader().load(model, folder)
    expected = checkpoint(folder)
    if tie:
        expected["lm_head.weight"] = expected["embed_tokens.weight"]
    for name, param in model.named_parameters():
        module, _, leaf = name.rpartition(".")
        parent, _, fused = module.rpartition(".")
        if fused in FUSED:
            parts = [expected[f"{parent}.{shard}.{leaf}"] for shard in FUSED[fused]]
            assert torch.equal(param, torch.cat(parts)), name
            assert not file_mapped(param, folder / "model.safetensors"), name
        else:
            assert torch.equal(param, expected[name]), name
            assert file_mapped(param, folder / "model.safetensors"), name


@pytest.mark.parametrize("tie", [True, False])
def test_weights_loaded_straight_in_the_served_dtype_equal_a_conversion_after_loading(tmp_path, tie):
    """srv materializes a model in the dtype it serves (unless a quantization method computes
    from the float weights): the loader's copies round as converting the loaded model would."""
    folder = tiny_checkpoint(tmp_path, tie)
    converted = build(folder)
    SafetensorsLoader().load(converted, folder)
    converted.to(torch.bfloat16)
    direct = build(folder, torch.bfloat16)
    assert all(p.dtype == torch.bfloat16 for p in direct.parameters())
    SafetensorsLoader().load(direct, folder)
    expected = converted.state_dict()
    for name, tensor in direct.state_dict().items():
        assert tensor.dtype == expected[name].dtype and torch.equal(tensor, expected[name]), name


def test_writing_a_loaded_weight_leaves_the_file_as_it_was(tmp_path):
    folder = tiny_checkpoint(tmp_path, tie=False)
    model = build(folder)
    SafetensorsLoader().load(model, folder)
    with torch.no_grad():
        model.norm.weight.fill_(7.0)
    assert not torch.equal(checkpoint(folder)["norm.weight"], model.norm.weight)


@pytest.mark.parametrize("name", ["model.norm.weight", "model.layers.0.self_attn.k_proj.weight"])
@pytest.mark.parametrize("shape", [(1,), (3, 3)])
def test_a_weight_of_another_shape_is_refused_by_name(tmp_path, name, shape):
    """A one-element tensor would have been broadcast over the whole weight by copy_."""
    folder = tiny_checkpoint(tmp_path, tie=True)
    with safe_open(str(folder / "model.safetensors"), framework="pt") as f:
        weights = {key: f.get_tensor(key) for key in f.keys()}
    weights[name] = torch.ones(shape)
    with pytest.raises(ValueError, match=re.escape(f"{name.removeprefix('model.')} has shape {list(shape)}")):
        build(folder).load_weights(weights.items())


def test_multithread_load_of_sharded_files_gives_the_same_weights(tmp_path):
    """--model-loader-extra-config {"enable_multithread_load": true, "num_threads": 2}: shards read
    at once, the same weights; a key the loader does not take is refused by name."""
    from argparse import Namespace

    from transformers import LlamaConfig, LlamaForCausalLM as HFLlama

    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=48, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, architectures=["LlamaForCausalLM"])
    HFLlama(config).save_pretrained(tmp_path, max_shard_size="20KB")
    assert len(list(tmp_path.glob("*.safetensors"))) > 2
    plain, threaded = build(tmp_path), build(tmp_path)
    SafetensorsLoader().load(plain, tmp_path)
    extra = '{"enable_multithread_load": true, "num_threads": 2}'
    SafetensorsLoader(Namespace(model_loader_extra_config=extra)).load(threaded, tmp_path)
    for (name, a), (_, b) in zip(plain.state_dict().items(), threaded.state_dict().items()):
        assert torch.equal(a, b), name
    with pytest.raises(ValueError, match="does not take \\['load_fast'\\]"):
        SafetensorsLoader(Namespace(model_loader_extra_config='{"load_fast": 1}')).load(build(tmp_path), tmp_path)


def test_weight_loader_disable_mmap_reads_the_file_into_memory(tmp_path):
    """--weight-loader-disable-mmap: the same weights, none of them a map of the file."""
    from argparse import Namespace

    folder = tiny_checkpoint(tmp_path, tie=False)
    mapped, read = build(folder), build(folder)
    SafetensorsLoader().load(mapped, folder)
    SafetensorsLoader(Namespace(weight_loader_disable_mmap=True, model_loader_extra_config=None)).load(read, folder)
    for (name, a), (_, b) in zip(mapped.named_parameters(), read.named_parameters()):
        assert torch.equal(a, b), name
        assert not file_mapped(b, folder / "model.safetensors"), name
