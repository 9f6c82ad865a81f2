"""Any Hugging Face causal LM on srv's KV cache (`--model-impl transformers`).

The network is transformers' own module, built with a custom attention implementation
registered in `transformers.AttentionInterface`: each attention layer hands its queries, keys
and values (rotary already applied) to srv's attention backend, which stores the keys and values
in the paged KV cache and attends over each request's cached tokens. Everything else
(embeddings, rotary, norms, MLPs, head, logit scaling) is transformers' code, unchanged.

All requests' new tokens run as one sequence of length T (batch dimension 1) at their own
positions; the backend keeps the requests apart and masks causally, so transformers' mask is
not needed. transformers skips building it for any attention implementation it has no mask
function for (`masking_utils._preprocess_mask_arguments` returns None for names missing from
`AttentionMaskInterface`), so srv_paged is deliberately not registered there. `use_cache=False`
keeps transformers from creating a DynamicCache.
"""

from __future__ import annotations

import logging
import re
from typing import Any, Iterable

import torch
from torch import nn

from srv.sdk.attention import ForwardBatch
from srv.sdk.linear import checkpoint_key, load_weight
from srv.sdk.models import ModelOutput

logger = logging.getLogger("srv.models.transformers")

ATTENTION_NAME = "srv_paged"
# The keyword the srv batch travels under: transformers passes a model call's extra keyword
# arguments (`**kwargs: Unpack[TransformersKwargs]`) down to every attention function.
BATCH_KWARG = "srv_batch"


def srv_paged_attention(module: nn.Module, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                        attention_mask: torch.Tensor | None, scaling: float | None = None,
                        dropout: float = 0.0, **kwargs: Any) -> tuple[torch.Tensor, None]:
    """transformers' attention-function signature, on srv's attention backend.

    query: [1, heads, T, head_dim]; key, value: [1, kv_heads, T, head_dim].
    Returns ([1, T, heads, head_dim], None). attention_mask is ignored (None in practice).
    """
    batch: ForwardBatch | None = kwargs.get(BATCH_KWARG)
    if batch is None:
        raise RuntimeError(f"attention implementation {ATTENTION_NAME!r} needs the srv ForwardBatch as the "
                           f"{BATCH_KWARG!r} keyword of the model call")
    if query.shape[0] != 1:
        raise ValueError(f"{ATTENTION_NAME!r} runs one packed sequence (batch dimension 1), got {query.shape[0]}")
    if kwargs.get("softcap") is not None:
        raise NotImplementedError(f"{ATTENTION_NAME!r} does not support attention logit softcapping")
    backend = batch.attention
    q = query[0].transpose(0, 1)                                   # [T, heads, head_dim]
    if scaling is not None and not _close(scaling, backend.scale):
        # The backend scales by head_dim ** -0.5; a model with another factor has it folded into q.
        q = q * (scaling / backend.scale)
    k, v = key[0].transpose(0, 1), value[0].transpose(0, 1)      # [T, kv_heads, head_dim]
    layer_id = getattr(module, "layer_idx", None)
    if layer_id is None:
        raise NotImplementedError(f"{type(module).__name__} has no layer_idx: srv cannot tell its KV cache layer")
    out = backend.forward(q.contiguous(), k.contiguous(), v.contiguous(), layer_id, batch)
    return out.unsqueeze(0), None


def _close(a: float, b: float) -> bool:
    return abs(a - b) <= 1e-9 * max(abs(a), abs(b))


def register_attention() -> None:
    """Register srv_paged in transformers' AttentionInterface (idempotent)."""
    from transformers import AttentionInterface

    if AttentionInterface._global_mapping.get(ATTENTION_NAME) is not srv_paged_attention:
        AttentionInterface.register(ATTENTION_NAME, srv_paged_attention)


class TransformersModel(nn.Module):
    """A transformers causal LM whose attention runs on srv's KV cache.

    forward(batch) returns a ModelOutput: float32 logits [rows, vocab] of the rows
    batch.logits_rows() names, and the last hidden states when the batch captures them;
    load_weights(named_tensors) takes the checkpoint's (Hugging Face) names.
    """

    def __init__(self, config: Any, trust_remote_code: bool = False) -> None:
        super().__init__()
        from transformers import AutoModelForCausalLM

        register_attention()
        self.config = config
        self.hf = AutoModelForCausalLM.from_config(config, attn_implementation=ATTENTION_NAME,
                                                   trust_remote_code=trust_remote_code)
        if self.hf.config._attn_implementation != ATTENTION_NAME:
            raise RuntimeError(f"{type(self.hf).__name__} did not take attention implementation {ATTENTION_NAME!r}")
        self.hf.config.use_cache = False
        self._logits_to_keep = self.hf._supports_logits_to_keep()
        _warn_about_ignored_attention_settings(config)

    @torch.inference_mode()
    def forward(self, batch: ForwardBatch) -> ModelOutput:
        batch.attention.prepare(batch)
        rows = batch.logits_rows()
        kwargs = {"logits_to_keep": rows} if self._logits_to_keep else {}
        # The full causal-LM forward, so that each model's own head logic (logit scaling,
        # final softcapping) applies; logits_to_keep runs the head on the asked rows only.
        out = self.hf(input_ids=batch.input_ids[None], position_ids=batch.positions[None], use_cache=False,
                      output_hidden_states=bool(batch.capture_layers), **kwargs, **{BATCH_KWARG: batch})
        logits = out.logits[0]
        # transformers numbers its hidden states as ForwardBatch.capture_layers does.
        hidden = torch.cat([out.hidden_states[i][0] for i in batch.capture_layers], -1).float() \
            if batch.capture_layers else None
        return ModelOutput((logits if self._logits_to_keep else logits[rows]).float(), hidden)

    # ---- weights ------------------------------------------------------------------------------

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        """Load checkpoint tensors by name, strictly: every parameter and persistent buffer must
        be loaded (a tied copy such as lm_head.weight counts as loaded with its source), and
        every checkpoint tensor must land somewhere.

        Names go through transformers' own checkpoint conversions (renamings such as GPT-NeoX's
        embed_out -> lm_head, base-model prefix added or removed); tensors that a conversion
        combines (per-expert MoE weights fused into one) are handed to transformers' loader.
        """
        from transformers.core_model_loading import WeightConverter, WeightRenaming, rename_source_key

        hf = self.hf
        hf.tie_weights()
        targets = hf.state_dict(keep_vars=True)          # parameters (tied copies too) and persistent buffers
        aliases = _tied_aliases(hf)                      # tied copy -> the name it shares storage with
        conversions = _weight_conversions(hf)
        renamings = [c for c in conversions if isinstance(c, WeightRenaming)]
        converters = [c for c in conversions if isinstance(c, WeightConverter)]
        ignore_unexpected = _patterns(getattr(hf, "_keys_to_ignore_on_load_unexpected", None),
                                      [r"rotary_emb\.inv_freq$", r"(^|\.)position_ids$"])
        ignore_missing = _patterns(getattr(hf, "_keys_to_ignore_on_load_missing", None), [])
        loaded: set[str] = set()
        copies: dict[str, torch.Tensor] = {}
        to_convert: dict[str, torch.Tensor] = {}
        unexpected: list[str] = []
        with torch.no_grad():
            for name, tensor in weights:
                name = checkpoint_key(name)
                key, converter = rename_source_key(name, renamings, converters, hf.base_model_prefix, targets)
                if key not in targets and name in targets:
                    key, converter = name, None
                if converter is not None:
                    to_convert[name] = tensor
                elif key in aliases:
                    copies[key] = tensor                 # loaded below, only if its source is not
                elif key in targets:
                    _copy(key, targets[key], tensor)
                    loaded.add(key)
                elif not (ignore_unexpected and ignore_unexpected.search(key)):
                    unexpected.append(name)
            for key, tensor in copies.items():
                if aliases[key] not in loaded:
                    _copy(key, targets[key], tensor)
                    loaded.add(aliases[key])
        if to_convert:
            loaded |= self._load_converted(to_convert, conversions, unexpected)
        if unexpected:
            raise ValueError(f"checkpoint has weights the model does not: {sorted(unexpected)[:8]}")
        missing = [name for name in targets if name not in loaded and aliases.get(name) not in loaded
                   and not (ignore_missing and ignore_missing.search(name))]
        if missing:
            raise ValueError(f"checkpoint is missing weights: {sorted(missing)[:8]}")
        hf.tie_weights()

    def _load_converted(self, tensors: dict[str, torch.Tensor], conversions: list, unexpected: list[str]) -> set[str]:
        """Tensors a transformers WeightConverter combines: loaded by transformers' own loader.
        Returns the model names it filled."""
        from transformers.core_model_loading import convert_and_load_state_dict_in_model
        from transformers.modeling_utils import LoadStateDictConfig

        before = set(self.hf.state_dict())
        info, _ = convert_and_load_state_dict_in_model(self.hf, tensors, LoadStateDictConfig(weight_mapping=conversions))
        if info.mismatched_keys:
            raise ValueError(f"checkpoint shapes do not match the model: {sorted(info.mismatched_keys)[:8]}")
        if info.conversion_errors:
            raise ValueError(f"converting checkpoint weights failed: {info.conversion_errors}")
        unexpected += sorted(info.unexpected_keys)
        return before - set(info.missing_keys)

    def _apply(self, fn, recurse=True):
        """Keep the model right across the runner's `materialize` and `.to(dtype)`.

        `materialize` (empty storage for the meta-device build) unties tied parameters and leaves the
        non-persistent buffers (rotary inv_freq and the like) uninitialised: no checkpoint has
        them, so no loader fills them. `.to(dtype)` would round inv_freq to bfloat16, where
        transformers keeps it in float32.
        """
        was_meta = any(p.is_meta for p in self.hf.parameters())
        before = dict(self.hf.named_non_persistent_buffers())
        result = super()._apply(fn, recurse)
        after = dict(self.hf.named_non_persistent_buffers())
        for name, old in before.items():
            if not old.is_meta and old.is_floating_point() and after[name].dtype != old.dtype:
                _set_buffer(self.hf, name, old.to(device=after[name].device))
        if was_meta and not any(p.is_meta for p in self.hf.parameters()):
            self.hf.tie_weights()
        if any(old.is_meta and not after[name].is_meta for name, old in before.items()):
            self._initialise_non_persistent_buffers()
        return result

    def _initialise_non_persistent_buffers(self) -> None:
        """transformers' own initialisation (as in from_pretrained), restricted to the
        non-persistent buffers: every other tensor is flagged as initialised so it is left alone
        (the loader overwrites them anyway)."""
        non_persistent = {name for name, _ in self.hf.named_non_persistent_buffers()}
        for name, tensor in [*self.hf.named_parameters(), *self.hf.named_buffers()]:
            tensor._is_hf_initialized = name not in non_persistent
        for module in self.hf.modules():
            module.__dict__.pop("_is_hf_initialized", None)
        self.hf.initialize_weights()


def _tied_aliases(model: nn.Module) -> dict[str, str]:
    """Each tied copy's name -> the name of the parameter it is (the first name of that tensor)."""
    first: dict[int, str] = {}
    aliases = {}
    for name, param in model.named_parameters(remove_duplicate=False):
        if id(param) in first:
            aliases[name] = first[id(param)]
        else:
            first[id(param)] = name
    return aliases


def _weight_conversions(model: nn.Module) -> list:
    """transformers' checkpoint renamings and conversions for this model (as from_pretrained applies)."""
    from transformers.conversion_mapping import get_model_conversion_mapping

    return list(get_model_conversion_mapping(model) or [])


def _copy(name: str, target: torch.Tensor, tensor: torch.Tensor) -> None:
    load_weight(name, target, target.data, tensor)


def _set_buffer(model: nn.Module, name: str, tensor: torch.Tensor) -> None:
    parent, _, leaf = name.rpartition(".")
    model.get_submodule(parent)._buffers[leaf] = tensor


def _patterns(patterns: Iterable[str] | None, extra: list[str]) -> re.Pattern | None:
    everything = [*(patterns or []), *extra]
    return re.compile("|".join(f"({p})" for p in everything)) if everything else None


def _warn_about_ignored_attention_settings(config: Any) -> None:
    """srv's backends attend over the whole context in every layer: sliding-window and chunked
    layers give the reference's outputs only while the context fits in their window."""
    text = config.get_text_config() if hasattr(config, "get_text_config") else config
    layer_types = set(getattr(text, "layer_types", None) or [])
    window = getattr(text, "sliding_window", None) or getattr(text, "attention_chunk_size", None)
    local = layer_types - {"full_attention"} if layer_types else getattr(text, "use_sliding_window", True)
    if window and local:
        logger.warning("--model-impl transformers attends over the whole context in every layer: outputs "
                       "differ from the reference's past its %s-token attention window", window)


ATTENTION_LAYER_TYPES = {"full_attention", "sliding_attention", "chunked_attention"}


def causal_lm_class(config: Any, trust_remote_code: bool = False) -> type | None:
    """The class AutoModelForCausalLM builds for `config`: from transformers' own mapping, or with
    --trust-remote-code the one the model directory's code defines (config.json's auto_map)."""
    from transformers import AutoModelForCausalLM

    try:
        return AutoModelForCausalLM._model_mapping[type(config)]
    except (KeyError, ValueError):
        pass
    remote = (getattr(config, "auto_map", None) or {}).get("AutoModelForCausalLM")
    if remote is None or not trust_remote_code:
        return None
    from transformers.dynamic_module_utils import get_class_from_dynamic_module

    return get_class_from_dynamic_module(remote, config._name_or_path)


def supports(config: Any, trust_remote_code: bool = False) -> bool:
    """Causal LMs transformers can build (its AutoModelForCausalLM mapping, or with
    --trust-remote-code the model's own code) whose layers all attend through AttentionInterface."""
    import transformers

    if int(transformers.__version__.split(".")[0]) < 5:
        return False  # needs transformers 5's initialisation, tying and weight-conversion APIs
    architectures = getattr(config, "architectures", None) or []
    model_class = causal_lm_class(config, trust_remote_code)
    if model_class is None:
        return False
    # "...ForCausalLM", or the mapping's own name for it (GPT2LMHeadModel and the like).
    if not any(a.endswith("ForCausalLM") or a == model_class.__name__ for a in architectures):
        return False
    text = config.get_text_config() if hasattr(config, "get_text_config") else config
    if getattr(text, "attn_logit_softcapping", None):
        return False  # srv's backends have no attention logit softcapping (Gemma 2)
    if getattr(text, "kv_lora_rank", None):
        raise ValueError(f"{architectures[0]} attends with multi-head latent attention (keys and values of "
                         "different sizes, cached as one compressed latent per token): srv's KV cache holds keys "
                         "and values of one head size, so DeepSeek-V2/V3-style models are not supported yet")
    if set(getattr(text, "layer_types", None) or []) - ATTENTION_LAYER_TYPES:
        return False  # linear-attention / state-space layers keep state srv's KV cache does not hold
    # Whether the model's attention layers dispatch through AttentionInterface.
    return bool(getattr(model_class, "_supports_attention_backend", False))
