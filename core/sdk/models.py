"""Base classes for model plugins: weight loaders (`--load-format`) and model
implementations (`--model-impl`)."""

from __future__ import annotations

import json
from abc import ABC, abstractmethod
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch import nn

from srv.sdk.moe import MoEBackends
from srv.sdk.parallel import ParallelContext


class ModelConfig:
    """A model directory's config.json as attributes (`config.hidden_size`), with
    `--json-model-override-args` applied: what model implementations are handed.

    Read without transformers, whose import takes seconds of every launch. An attribute the
    file lacks raises AttributeError, so `getattr(config, name, default)` gives the default.
    Implementations built on transformers call `hf()` for its config object.
    """

    def __init__(self, values: dict[str, Any], model_dir: Path | None = None,
                 overrides: dict[str, Any] | None = None, trust_remote_code: bool = False) -> None:
        self._values = {**values, **(overrides or {})}
        self._model_dir, self._overrides = model_dir, dict(overrides or {})
        # --trust-remote-code: transformers may run the directory's own configuration and
        # modeling code (config.json's auto_map).
        self.trust_remote_code = trust_remote_code
        self._hf: Any = None

    @classmethod
    def read(cls, model_dir: Path | str, overrides: dict[str, Any] | None = None,
             trust_remote_code: bool = False) -> ModelConfig:
        model_dir = Path(model_dir)
        return cls(json.loads((model_dir / "config.json").read_text()), model_dir, overrides, trust_remote_code)

    def __getattr__(self, name: str) -> Any:
        values = self.__dict__.get("_values", {})
        if name in values:
            return values[name]
        raise AttributeError(f"config.json has no {name!r}")

    def to_dict(self) -> dict[str, Any]:
        return dict(self._values)

    def hf(self) -> Any:
        """transformers' config for the same directory and overrides (imported on first call)."""
        if self._hf is None:
            from transformers import AutoConfig

            if self._model_dir is None:
                raise ValueError("this ModelConfig was not read from a model directory")
            try:
                self._hf = AutoConfig.from_pretrained(str(self._model_dir), trust_remote_code=self.trust_remote_code)
            except ValueError as exc:
                if "trust_remote_code" in str(exc) and not self.trust_remote_code:
                    raise ValueError(f"{self._model_dir} defines its own model code (config.json's auto_map): "
                                     "srv runs it only with --trust-remote-code") from None
                raise
            for key, value in self._overrides.items():
                setattr(self._hf, key, value)
        return self._hf

    def __repr__(self) -> str:
        return f"ModelConfig({self._model_dir}, architectures={self._values.get('architectures')})"


def materialize(model: nn.Module, dtype: torch.dtype | None = None) -> nn.Module:
    """Give a model built on the meta device empty CPU storage, for a loader to fill; floating
    point parameters in `dtype` where given (the loader's copies round to it as a later `.to`
    would, without a second pass over the weights). Buffers keep their dtype: what a model
    computes for itself (rotary frequencies) may stay float32 on purpose.

    `Module.to_empty` does the same through torch's Python reference of `empty_like`, whose
    first call imports sympy: half a second of every launch. The attributes a linear method set
    on its parameters (srv.sdk.linear's weight_loader) are carried over to the new ones."""
    attributes = {name: dict(p.__dict__) for name, p in model.named_parameters() if p.__dict__}
    parameters = {id(p) for p in model.parameters()}

    def empty(t: torch.Tensor) -> torch.Tensor:
        convert = dtype is not None and t.is_floating_point() and id(t) in parameters
        return torch.empty(t.shape, dtype=dtype if convert else t.dtype)

    model = model._apply(empty)
    for name, param in model.named_parameters():
        param.__dict__.update(attributes.get(name, {}))
    return model


@dataclass
class ModelOutput:
    """What a model's forward returns: float32 logits [rows, vocab] of the rows
    `batch.logits_rows()` names, and, when `batch.capture_layers` names any, those hidden
    states of every new token (see ForwardBatch)."""

    logits: torch.Tensor
    hidden_states: torch.Tensor | None = None


class ModelLoader(ABC):
    """Reads a model's weights in one format.

    `prepare` turns what the user named into a Hugging Face style directory (config.json and
    tokenizer files); `load` fills a built model's parameters from it.
    """

    # The --model-loader-extra-config keys this loader reads; any other is refused by name.
    extra_config_keys: frozenset[str] = frozenset()

    def __init__(self, server_args: Any = None) -> None:
        self.server_args = server_args

    def extra_config(self) -> dict[str, Any]:
        """--model-loader-extra-config (a JSON object), checked against `extra_config_keys`."""
        raw = getattr(self.server_args, "model_loader_extra_config", None) or "{}"
        config = json.loads(raw) if isinstance(raw, str) else dict(raw)
        unknown = sorted(set(config) - self.extra_config_keys)
        if unknown:
            raise ValueError(f"--model-loader-extra-config: {type(self).__name__} does not take {unknown} "
                             f"(it takes {sorted(self.extra_config_keys) or 'no keys'})")
        return config

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

    The module it builds takes a `srv.sdk.attention.ForwardBatch` and returns a `ModelOutput`:
    float32 logits [rows, vocab] of the rows `batch.logits_rows()` names (each request's last
    new token unless the batch asks for more: prompt log-probabilities, verify passes), and the
    hidden states when the batch asks for them. It has `load_weights(named_tensors)` taking
    Hugging Face checkpoint names.

    Under `--tensor-parallel-size` N > 1, srv sets `parallel` (srv.sdk.parallel) before `build`
    in each of N processes, and the model builds this rank's share of every layer
    (srv.sdk.layers), its attention with this rank's heads (`num_heads` and `num_kv_heads` of
    each layer's attention module, which srv reads for the attention backend and KV pool), and
    returns the whole vocabulary's logits on rank 0. Under `--pipeline-parallel-size` P > 1
    each stage builds the layers of `parallel.layer_range`, the first stage the embeddings, the
    last the head: a stage other than the first takes its input from
    `parallel.receive_from_previous_stage`, one other than the last hands its output on with
    `send_to_next_stage` and returns `ModelOutput(None)`. An implementation that does this says
    so with `tensor_parallel = True`; srv refuses N > 1 and P > 1 for the others.

    `moe` (srv.sdk.moe.MoEBackends) is set before `build` too: the MoE runner and token
    exchange the launch chose (`--moe-runner-backend`, `--moe-a2a-backend`) and `--ep-size`,
    which the model hands to each of its `srv.sdk.moe.FusedMoE` layers.
    """

    tensor_parallel = False
    parallel: ParallelContext = ParallelContext()
    moe: MoEBackends = MoEBackends()

    def __init__(self, server_args: Any = None) -> None:
        self.server_args = server_args

    @abstractmethod
    def supports(self, config: ModelConfig) -> bool:
        ...

    @abstractmethod
    def build(self, config: ModelConfig) -> nn.Module:
        ...

    def is_generation(self, config: ModelConfig) -> bool:
        """Whether the model this builds for `config` generates text; False for an encoder,
        whose server embeds (as if launched with --is-embedding)."""
        return True

    def finalize(self, model: nn.Module) -> None:
        """Called once the weights are loaded and cast to the served dtype: repack them for the
        kernels the model runs (optional)."""
