"""Random PEFT-format LoRA adapters on the default model's shapes, for the W1-with-adapters row:
made from the model's config.json (no model load), every linear layer a target, as the issue's
workload asks (rank 16, all linear layers)."""

from __future__ import annotations

import json
from pathlib import Path

LORA_RANK = 16
TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


def target_shapes(config: dict) -> dict[str, tuple[int, int]]:
    """(in_features, out_features) of each target module."""
    hidden, inter = config["hidden_size"], config["intermediate_size"]
    head_dim = config.get("head_dim") or hidden // config["num_attention_heads"]
    q, kv = config["num_attention_heads"] * head_dim, config["num_key_value_heads"] * head_dim
    return {"q_proj": (hidden, q), "k_proj": (hidden, kv), "v_proj": (hidden, kv), "o_proj": (q, hidden),
            "gate_proj": (hidden, inter), "up_proj": (hidden, inter), "down_proj": (inter, hidden)}


def make_adapters(model_dir: Path, folder: Path, count: int, rank: int = LORA_RANK) -> list[Path]:
    """`count` adapters a0, a1, ... under `folder` (made once; kept for later runs)."""
    import torch
    from safetensors.torch import save_file

    config = json.loads((Path(model_dir) / "config.json").read_text())
    shapes = target_shapes(config)
    paths = []
    for index in range(count):
        path = folder / f"a{index}"
        paths.append(path)
        if (path / "adapter_model.safetensors").exists():
            continue
        path.mkdir(parents=True, exist_ok=True)
        generator = torch.Generator().manual_seed(index)
        tensors = {}
        for layer in range(config["num_hidden_layers"]):
            for module, (fan_in, fan_out) in shapes.items():
                parent = "mlp" if module in ("gate_proj", "up_proj", "down_proj") else "self_attn"
                key = f"base_model.model.model.layers.{layer}.{parent}.{module}"
                tensors[f"{key}.lora_A.weight"] = torch.randn(rank, fan_in, generator=generator) / fan_in ** 0.5
                tensors[f"{key}.lora_B.weight"] = torch.randn(fan_out, rank, generator=generator) * 0.01
        save_file(tensors, str(path / "adapter_model.safetensors"))
        (path / "adapter_config.json").write_text(json.dumps(
            {"peft_type": "LORA", "r": rank, "lora_alpha": 2 * rank, "target_modules": list(TARGETS)}))
    return paths
