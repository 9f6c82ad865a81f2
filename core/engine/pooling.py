"""How an embedding model turns a prompt's hidden states into one vector.

A sentence-transformers directory says so itself: modules.json lists a Pooling module (its
config picks CLS, mean, max or last-token pooling) and whether a Normalize module follows.
Without one, srv pools as SGLang does for a causal LM served with --is-embedding: the last
token's final hidden state, normalized to unit length.
"""

from __future__ import annotations

import json
import logging
from dataclasses import dataclass
from pathlib import Path

import torch

logger = logging.getLogger("srv.engine")

# "score": the model pools itself (a cross-encoder's classifier): its output row is the vector.
METHODS = ("cls", "mean", "max", "last", "score")
# sentence-transformers' Pooling config keys, in the order it concatenates the poolings it has on.
SENTENCE_TRANSFORMERS_MODES = {"pooling_mode_cls_token": "cls", "pooling_mode_mean_tokens": "mean",
                               "pooling_mode_max_tokens": "max", "pooling_mode_lasttoken": "last"}


@dataclass(frozen=True)
class Pooling:
    method: str = "last"
    normalize: bool = True

    def __post_init__(self) -> None:
        if self.method not in METHODS:
            raise ValueError(f"pooling {self.method!r} is not one of {', '.join(METHODS)}")

    def __call__(self, hidden: torch.Tensor) -> torch.Tensor:
        """hidden: [tokens, dim] of one prompt, float32 -> [dim]."""
        if self.method == "score":
            raise ValueError("a cross-encoder's score is its own output, not a pooling of hidden states")
        if self.method == "cls":
            vector = hidden[0]
        elif self.method == "mean":
            vector = hidden.mean(0)
        elif self.method == "max":
            vector = hidden.max(0).values
        else:
            vector = hidden[-1]
        return torch.nn.functional.normalize(vector, dim=0) if self.normalize else vector

    @classmethod
    def for_model(cls, model_dir: Path) -> Pooling:
        """The pooling a sentence-transformers directory declares, else last-token and normalized."""
        modules_file = model_dir / "modules.json"
        if not modules_file.exists():
            return cls()
        modules = json.loads(modules_file.read_text())
        kinds = [m.get("type", "").rsplit(".", 1)[-1] for m in modules]
        normalize = "Normalize" in kinds
        pooling_module = next((m for m in modules if m.get("type", "").endswith(".Pooling")), None)
        if pooling_module is None:
            return cls("last", normalize)
        config = json.loads((model_dir / pooling_module.get("path", "") / "config.json").read_text())
        mode = config.get("pooling_mode")
        if mode is None:
            modes = [name for key, name in SENTENCE_TRANSFORMERS_MODES.items() if config.get(key)]
            if len(modes) != 1:
                raise ValueError(f"{model_dir}: sentence-transformers pooling {modes or 'none'} "
                                 "(srv pools one way: cls, mean, max or last token)")
            mode = modes[0]
        mode = {"lasttoken": "last", "mean_sqrt_len_tokens": None}.get(mode, mode)
        if mode not in METHODS:
            raise ValueError(f"{model_dir}: sentence-transformers pooling {config.get('pooling_mode')!r} is not "
                             "one srv has (cls, mean, max, lasttoken)")
        return cls(mode, normalize)
