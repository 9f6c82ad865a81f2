"""Tiny quantized checkpoints written from a float one, as a quantization format stores them."""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import Any, Callable

import torch
from safetensors.torch import load_file, save_file

# (the tensors a projection stores, by name after its module prefix; its dequantized float weight)
LayerTensors = tuple[dict[str, torch.Tensor], torch.Tensor]


def write_quantized_checkpoint(source: Path, target: Path, quantize_layer: Callable[[str, torch.Tensor], LayerTensors],
                               quantization_config: dict[str, Any]) -> dict[str, torch.Tensor]:
    """`source` copied to `target` with each projection's weight stored as `quantize_layer(name,
    weight)` says, and `quantization_config` in config.json. Returns every weight as the
    reference model should hold it: the projections dequantized, the rest as they were."""
    shutil.copytree(source, target)
    out, dequantized = {}, {}
    for name, tensor in load_file(str(source / "model.safetensors")).items():
        if not name.endswith("proj.weight"):
            out[name] = dequantized[name] = tensor
            continue
        stored, dequantized[name] = quantize_layer(name, tensor)
        prefix = name.removesuffix("weight")
        out.update({prefix + key: value for key, value in stored.items()})
    save_file(out, str(target / "model.safetensors"), metadata={"format": "pt"})
    config = json.loads((source / "config.json").read_text())
    (target / "config.json").write_text(json.dumps({**config, "quantization_config": quantization_config}))
    return dequantized
