"""Base classes for model plugins: weight loaders (`--load-format`) and model
implementations (`--model-impl`)."""

from __future__ import annotations

from abc import ABC, abstractmethod
from pathlib import Path
from typing import Any

from torch import nn


class ModelLoader(ABC):
    """Reads a model's weights in one format.

    `prepare` turns what the user named into a Hugging Face style directory (config.json and
    tokenizer files); `load` fills a built model's parameters from it.
    """

    def __init__(self, server_args: Any = None) -> None:
        self.server_args = server_args

    def accepts(self, path: Path) -> bool:
        """Whether `--load-format auto` should pick this loader for `path`."""
        return False

    def prepare(self, path: Path) -> Path:
        return path

    @abstractmethod
    def load(self, model: nn.Module, model_dir: Path) -> None:
        ...


class ModelImpl(ABC):
    """Builds models for some architectures.

    The module it builds takes a `srv.sdk.attention.ForwardBatch` and returns float32 logits
    [batch, vocab] of each request's last new token, and has `load_weights(named_tensors)`
    taking Hugging Face checkpoint names.
    """

    def __init__(self, server_args: Any = None) -> None:
        self.server_args = server_args

    @abstractmethod
    def supports(self, config: Any) -> bool:
        ...

    @abstractmethod
    def build(self, config: Any) -> nn.Module:
        ...

    def finalize(self, model: nn.Module) -> None:
        """Called once the weights are loaded and cast to the served dtype: repack them for the
        kernels the model runs (optional)."""
