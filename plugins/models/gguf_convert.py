"""Turn a GGUF checkpoint into a cached Hugging Face model directory.

The directory holds `config.json`, float32 `model.safetensors` under Hugging Face tensor names,
the tokenizer files (with the chat template in `tokenizer_config.json`) and
`generation_config.json`. It lives in `<cache>/gguf/<first 16 hex of the file's sha256>/`, is built
in a temporary sibling and renamed into place, and counts as complete only once its marker file
exists (written last), so a crash never leaves a half-written cache behind and a second call for
the same bytes, under any file name, only hashes the file.

Heavy libraries (torch, numpy, gguf, safetensors, transformers) are imported on the cold path only.
"""

from __future__ import annotations

import hashlib
import importlib.util
import json
import logging
import os
import pathlib
import secrets
import shutil
import tempfile
import time
from typing import Any

from srv.sdk.gguf_names import hf_expert_name, hf_name, hf_row_order
from srv.sdk.paths import cache_root as srv_cache_root, write_atomically

logger = logging.getLogger("srv.plugins.models.gguf")

MARKER = "srv-gguf-complete.json"
FORMAT_VERSION = 1  # bump when the directory's contents change, to rebuild old caches
_CHUNK = 8 << 20

# GGUF architecture -> (HF architecture class, HF model_type)
ARCHITECTURES = {
    "llama": ("LlamaForCausalLM", "llama"),
    "qwen2": ("Qwen2ForCausalLM", "qwen2"),
    "qwen3": ("Qwen3ForCausalLM", "qwen3"),
    "qwen2moe": ("Qwen2MoeForCausalLM", "qwen2_moe"),
    "qwen3moe": ("Qwen3MoeForCausalLM", "qwen3_moe"),
}


def convert_gguf(gguf_path: str | os.PathLike, cache_root: str | os.PathLike | None = None) -> pathlib.Path:
    """Return a Hugging Face model directory for `gguf_path`, converting it on first use."""
    path = pathlib.Path(gguf_path).expanduser().resolve()
    if not path.is_file():
        raise FileNotFoundError(f"GGUF file not found: {path}")
    root = pathlib.Path(cache_root or srv_cache_root()).expanduser()
    gguf_root = root / "gguf"
    digest = _remembered_sha256(path, root / "gguf-digests")
    final = gguf_root / digest[:16]
    if _is_complete(final):
        logger.info("GGUF cache hit for %s: %s", path.name, final)
        return final

    gguf_root.mkdir(parents=True, exist_ok=True)
    _remove_stale_builds(gguf_root, final.name)
    tmp = gguf_root / f".tmp-{final.name}-{os.getpid()}-{secrets.token_hex(4)}"
    tmp.mkdir()  # unlike mkdtemp, honours the umask: the cache may be shared
    start = time.perf_counter()
    try:
        logger.info("converting GGUF %s into %s", path, final)
        _build(path, tmp)
        (tmp / MARKER).write_text(json.dumps(
            {"format": FORMAT_VERSION, "sha256": digest, "source": str(path)}, indent=2) + "\n")
        _install(tmp, final)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)  # gone already unless something failed
    logger.info("GGUF conversion of %s done in %.1f s: %s", path.name, time.perf_counter() - start, final)
    return final


def _remembered_sha256(path: pathlib.Path, memo_dir: pathlib.Path) -> str:
    """The file's sha256, remembered under its path, inode, size and modification time: hashing
    the default model's file took a tenth of a second of every launch."""
    stat = path.stat()
    key = f"{path}\0{stat.st_ino}\0{stat.st_size}\0{stat.st_mtime_ns}"
    memo = memo_dir / hashlib.sha256(key.encode()).hexdigest()[:32]
    try:
        digest = memo.read_text()
        if len(digest) == 64:
            return digest
    except OSError:
        pass
    digest = _sha256(path)
    try:
        write_atomically(memo, lambda tmp: tmp.write_text(digest))
    except OSError as exc:  # a read-only cache: the next launch hashes the file again
        logger.warning("could not remember the sha256 of %s: %s", path, exc)
    return digest


def _sha256(path: pathlib.Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(_CHUNK):
            digest.update(chunk)
    return digest.hexdigest()


def _is_complete(directory: pathlib.Path) -> bool:
    try:
        return json.loads((directory / MARKER).read_text()).get("format") == FORMAT_VERSION
    except (OSError, ValueError, AttributeError):
        return False


def _remove_stale_builds(gguf_root: pathlib.Path, key: str) -> None:
    """Delete temporary builds of this key left by processes that no longer run."""
    for stale in gguf_root.glob(f".tmp-{key}-*"):
        pid = stale.name.split("-")[2]
        if pid.isdigit() and not _alive(int(pid)):
            logger.info("removing an interrupted GGUF conversion: %s", stale)
            shutil.rmtree(stale, ignore_errors=True)


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except OSError:  # exists but not ours, or a platform without signal 0
        return True
    return True


def _install(tmp: pathlib.Path, final: pathlib.Path) -> None:
    """Rename the finished build into place; an incomplete or outdated directory there is replaced."""
    try:
        os.rename(tmp, final)
        return
    except OSError:
        if _is_complete(final):  # another process finished the same conversion first
            logger.info("another process completed %s first; keeping it", final)
            return
    old = final.with_name(f".old-{final.name}-{os.getpid()}")
    os.rename(final, old)
    os.rename(tmp, final)
    logger.info("replaced an incomplete or outdated GGUF cache at %s", final)
    shutil.rmtree(old, ignore_errors=True)


def _build(path: pathlib.Path, out: pathlib.Path) -> None:
    import gguf

    reader = gguf.GGUFReader(path)
    meta = {key: _field_value(field, gguf.GGUFValueType) for key, field in reader.fields.items()
            if not key.startswith("tokenizer.ggml.") or key.endswith("_id")}
    tensor_names = {t.name for t in reader.tensors}
    config = _hf_config(meta, tensor_names, reader)
    logger.info("GGUF %s: architecture %s, %d layers, %d tensors", path.name, meta["general.architecture"],
                config["num_hidden_layers"], len(reader.tensors))
    (out / "config.json").write_text(json.dumps(config, indent=2) + "\n")
    generation = {k: config[k] for k in ("bos_token_id", "eos_token_id", "pad_token_id") if k in config}
    (out / "generation_config.json").write_text(json.dumps(generation, indent=2) + "\n")
    _write_weights(reader, config, meta["general.architecture"], out / "model.safetensors")
    _write_tokenizer(path, out)


def _field_value(field: Any, types: Any) -> Any:
    """A metadata value as Python: a scalar, a string, or a list of them."""
    is_string = field.types and field.types[-1] == types.STRING
    values = [bytes(field.parts[i]).decode("utf-8", "replace") if is_string else field.parts[i].tolist()[0]
              for i in field.data]
    return values if field.types and field.types[0] == types.ARRAY else (values[0] if values else None)


def _hf_config(meta: dict[str, Any], tensor_names: set[str], reader: Any) -> dict[str, Any]:
    arch = meta["general.architecture"]
    if arch not in ARCHITECTURES:
        raise ValueError(f"GGUF architecture {arch!r} is not supported (supported: {', '.join(ARCHITECTURES)})")
    hf_class, model_type = ARCHITECTURES[arch]

    def get(key: str, default: Any = None) -> Any:
        return meta.get(f"{arch}.{key}", default)

    if arch == "llama" and get("expert_count"):   # llama.cpp writes Mixtral as a Llama with experts
        hf_class, model_type = "MixtralForCausalLM", "mixtral"

    heads, hidden = get("attention.head_count"), get("embedding_length")
    config: dict[str, Any] = {
        "architectures": [hf_class],
        "model_type": model_type,
        "hidden_act": "silu",
        "hidden_size": hidden,
        "intermediate_size": get("feed_forward_length"),
        "num_hidden_layers": get("block_count"),
        "num_attention_heads": heads,
        "num_key_value_heads": get("attention.head_count_kv", heads),
        "head_dim": get("attention.key_length") or get("rope.dimension_count") or hidden // heads,
        "rms_norm_eps": get("attention.layer_norm_rms_epsilon"),
        "rope_theta": get("rope.freq_base", 10000.0),
        "vocab_size": get("vocab_size") or next(int(t.shape[-1]) for t in reader.tensors
                                                if t.name == "token_embd.weight"),
        "max_position_embeddings": get("context_length"),
        "tie_word_embeddings": "output.weight" not in tensor_names,
        "torch_dtype": "float32",
    }
    if arch not in ("qwen2", "qwen2moe"):  # Qwen2 always has q/k/v biases and no switch for them
        config["attention_bias"] = "blk.0.attn_q.bias" in tensor_names
    else:
        config["use_sliding_window"] = False
    if model_type == "mixtral":   # its experts' width is the MLP's, and its weights always sum to one
        config.update(num_local_experts=get("expert_count"), num_experts_per_tok=get("expert_used_count"),
                      intermediate_size=get("expert_feed_forward_length") or get("feed_forward_length"))
    elif get("expert_count"):
        # llama.cpp rescales Qwen3-MoE's chosen weights to one and Qwen2-MoE's not, as their
        # released configs do.
        config.update(num_experts=get("expert_count"), num_experts_per_tok=get("expert_used_count"),
                      moe_intermediate_size=get("expert_feed_forward_length"), norm_topk_prob=arch == "qwen3moe")
        if get("expert_shared_feed_forward_length"):
            config["shared_expert_intermediate_size"] = get("expert_shared_feed_forward_length")
    scaling = get("rope.scaling.type")
    if scaling and scaling != "none":
        config["rope_scaling"] = {"rope_type": scaling, "factor": get("rope.scaling.factor", 1.0)}
        if get("rope.scaling.original_context_length"):
            config["rope_scaling"]["original_max_position_embeddings"] = get("rope.scaling.original_context_length")
    if "rope_freqs.weight" in tensor_names:
        logger.warning("GGUF has llama3-style rope_freqs factors that config.json cannot express; they are dropped")
    for key in ("bos", "eos", "padding"):
        token = meta.get(f"tokenizer.ggml.{key}_token_id")
        if token is not None:
            config["pad_token_id" if key == "padding" else f"{key}_token_id"] = token
    return config


def _write_weights(reader: Any, config: dict[str, Any], arch: str, target: pathlib.Path) -> None:
    import numpy as np
    import torch
    from gguf.quants import dequantize
    from safetensors.torch import save_file
    from tqdm.auto import tqdm

    tensors = {}
    for tensor in tqdm(reader.tensors, desc="Dequantizing GGUF", unit="tensor", disable=None):
        name = hf_name(tensor.name)
        shape = tuple(int(n) for n in reversed(tensor.shape))  # GGUF lists dimensions innermost first
        if name is None and hf_expert_name(tensor.name, 0) is not None:   # each expert its own tensor
            weights = np.asarray(dequantize(tensor.data, tensor.tensor_type), dtype=np.float32).reshape(shape)
            for expert in range(shape[0]):
                tensors[mixtral_name(hf_expert_name(tensor.name, expert), config)] = \
                    torch.from_numpy(weights[expert].copy())
            continue
        if name is None:
            continue
        weights = np.asarray(dequantize(tensor.data, tensor.tensor_type), dtype=np.float32).reshape(shape)
        weights = hf_row_order(tensor.name, weights, arch, config)
        if name.endswith("shared_expert_gate.weight"):   # GGUF keeps the one-output gate as a vector
            weights = weights.reshape(1, -1)
        if not (weights.flags.writeable and weights.flags.c_contiguous):
            weights = weights.copy()
        tensors[mixtral_name(name, config)] = torch.from_numpy(weights)
    save_file(tensors, str(target), metadata={"format": "pt"})
    os.chmod(target, (target.parent / "config.json").stat().st_mode & 0o777)  # safetensors writes 0600
    size = sum(t.numel() for t in tensors.values()) * 4
    logger.info("wrote %d float32 tensors (%.0f MB) to %s", len(tensors), size / 1e6, target.name)


MIXTRAL_EXPERTS = {"gate_proj": "w1", "down_proj": "w2", "up_proj": "w3"}


def mixtral_name(name: str, config: dict[str, Any]) -> str:
    """A sparse block's tensor as Mixtral's checkpoints name it (`block_sparse_moe`, experts'
    `w1`, `w2`, `w3`); other models' names as they are."""
    if config["model_type"] != "mixtral" or ".mlp." not in name:
        return name
    name = name.replace(".mlp.", ".block_sparse_moe.")
    head, _, leaf = name.rpartition(".")
    module, _, projection = head.rpartition(".")
    return f"{module}.{MIXTRAL_EXPERTS.get(projection, projection)}.{leaf}" if ".experts." in name else name


def _write_tokenizer(path: pathlib.Path, out: pathlib.Path) -> None:
    """transformers converts the GGUF vocabulary; the chat template goes into tokenizer_config.json."""
    from transformers import AutoTokenizer

    with tempfile.TemporaryDirectory() as isolated:
        source = pathlib.Path(isolated) / path.name  # keep stray files beside the GGUF from interfering
        try:
            source.symlink_to(path)
        except OSError:
            source = path
        tokenizer = AutoTokenizer.from_pretrained(str(source.parent), gguf_file=source.name)
    tokenizer.save_pretrained(str(out), save_jinja_files=False)
    config_file = out / "tokenizer_config.json"
    tokenizer_config = json.loads(config_file.read_text(encoding="utf-8"))
    jinja = out / "chat_template.jinja"
    template = tokenizer_config.get("chat_template") or getattr(tokenizer, "chat_template", None)
    if template is None and jinja.is_file():
        template = jinja.read_text(encoding="utf-8")
    jinja.unlink(missing_ok=True)  # one place for the template: tokenizer_config.json
    if template is not None and tokenizer_config.get("chat_template") != template:
        tokenizer_config["chat_template"] = template
        config_file.write_text(json.dumps(tokenizer_config, indent=2, ensure_ascii=False) + "\n", encoding="utf-8")
    logger.info("saved the tokenizer (%d tokens%s)", len(tokenizer),
                ", with its chat template" if template is not None else ", no chat template")
