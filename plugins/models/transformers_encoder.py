"""Hugging Face encoder models (BERT, RoBERTa, XLM-R and the like) served for their embeddings
(`--model-impl transformers`, chosen for an encoder architecture).

The network is transformers' own base model (`AutoModel`), built with an attention
implementation registered in `transformers.AttentionInterface` that attends bidirectionally
within each request. As with srv's causal models, the batch's requests run as one packed
sequence (batch dimension 1) at their own positions; each request comes whole (the scheduler
never splits an embedding request into chunks, nor takes part of it from the prefix cache), so
its tokens attend to each other and to nothing else, and no KV cache is written.

The module returns no logits; its hidden states (ForwardBatch.capture_layers, numbered as
transformers' `output_hidden_states`) are what the embedding worker pools.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from srv.sdk.attention import ForwardBatch
from srv.sdk.models import ModelOutput
from srv.plugins.models.transformers_impl import BATCH_KWARG, TransformersModel

ATTENTION_NAME = "srv_encoder"
# Model types whose position ids start after the padding token's id.
OFFSET_POSITIONS = {"roberta", "xlm-roberta", "camembert", "xlm-roberta-xl"}


def srv_encoder_attention(module: nn.Module, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                          attention_mask: torch.Tensor | None, scaling: float | None = None,
                          dropout: float = 0.0, **kwargs: Any) -> tuple[torch.Tensor, None]:
    """transformers' attention-function signature: full attention within each request.

    query, key, value: [1, heads, T, head_dim]. Returns ([1, T, heads, head_dim], None)."""
    batch: ForwardBatch | None = kwargs.get(BATCH_KWARG)
    if batch is None:
        raise RuntimeError(f"attention implementation {ATTENTION_NAME!r} needs the srv ForwardBatch as the "
                           f"{BATCH_KWARG!r} keyword of the model call")
    if any(batch.prefix_lens):
        raise ValueError("an encoder computes each request whole: a request came with cached tokens")
    outputs, start = [], 0
    for length in batch.extend_lens:
        end = start + length
        outputs.append(F.scaled_dot_product_attention(query[:, :, start:end], key[:, :, start:end],
                                                      value[:, :, start:end], scale=scaling))
        start = end
    return torch.cat(outputs, dim=2).transpose(1, 2), None


def register_attention() -> None:
    from transformers import AttentionInterface

    if AttentionInterface._global_mapping.get(ATTENTION_NAME) is not srv_encoder_attention:
        AttentionInterface.register(ATTENTION_NAME, srv_encoder_attention)


class TransformersEncoder(TransformersModel):
    """A transformers encoder on packed requests: its base model (embedding models), or a
    cross-encoder (`...ForSequenceClassification`, BERT and RoBERTa families).

    forward(batch) returns a ModelOutput: for a base model no logit columns, and the hidden
    states `batch.capture_layers` names, of every token; for a cross-encoder each request's
    score, its classifier's output on the request's first token ([CLS]) with the sigmoid a
    single-label cross-encoder's score takes (as sentence-transformers' CrossEncoder gives it).
    load_weights is TransformersModel's."""

    def __init__(self, config: Any) -> None:
        nn.Module.__init__(self)
        from transformers import AutoModel, AutoModelForSequenceClassification

        register_attention()
        self.config = config
        self.classifies = is_cross_encoder(config)
        build = AutoModelForSequenceClassification if self.classifies else AutoModel
        self.hf = build.from_config(config, attn_implementation=ATTENTION_NAME)
        if self.hf.config._attn_implementation != ATTENTION_NAME:
            raise RuntimeError(f"{type(self.hf).__name__} did not take attention implementation {ATTENTION_NAME!r}")
        # RoBERTa-style embeddings number positions from padding_idx + 1 (transformers derives
        # them from the padding in the ids, which a packed sequence has none of).
        self.position_offset = config.pad_token_id + 1 if config.model_type in OFFSET_POSITIONS else 0

    @torch.inference_mode()
    def forward(self, batch: ForwardBatch) -> ModelOutput:
        ids = batch.input_ids[None]
        positions = batch.positions[None] + self.position_offset
        # Segment 0 for every token, as a tokenizer gives a single text; passed explicitly because
        # the model's default buffer is only max_position_embeddings long and the packed
        # sequence may be longer.
        segments = batch.token_type_ids[None] if batch.token_type_ids is not None else torch.zeros_like(ids)
        base = self.hf.base_model if self.classifies else self.hf
        out = base(input_ids=ids, position_ids=positions, token_type_ids=segments,
                   output_hidden_states=bool(batch.capture_layers), **{BATCH_KWARG: batch})
        hidden = torch.cat([out.hidden_states[i][0] for i in batch.capture_layers], -1).float() \
            if batch.capture_layers else None
        if not self.classifies:
            return ModelOutput(torch.empty(batch.logits_rows().numel(), 0), hidden)
        first = torch.tensor([0, *batch.extend_lens[:-1]]).cumsum(0)
        return ModelOutput(self._scores(out.last_hidden_state[0, first][:, None]), hidden)

    def _scores(self, cls_rows: torch.Tensor) -> torch.Tensor:
        """[requests, 1, hidden] of the requests' first tokens -> [requests, labels]."""
        if getattr(self.hf.base_model, "pooler", None) is not None:   # BERT: the pooler, then the classifier
            logits = self.hf.classifier(self.hf.base_model.pooler(cls_rows))
        else:   # RoBERTa's classification head reads the first token itself
            logits = self.hf.classifier(cls_rows)
        logits = logits.float()
        return torch.sigmoid(logits) if logits.shape[-1] == 1 else logits


# Cross-encoders whose classification head srv applies to the first token's hidden state.
CROSS_ENCODER_TYPES = {"bert", "roberta", "xlm-roberta"}


def is_cross_encoder(config: Any) -> bool:
    return any(a.endswith("ForSequenceClassification") for a in getattr(config, "architectures", None) or [])


def supports(config: Any) -> bool:
    """Encoder-only architectures transformers builds as a base model (`AutoModel`), or as a
    BERT- or RoBERTa-family cross-encoder, whose attention dispatches through AttentionInterface
    and takes absolute position ids."""
    import transformers
    from transformers import AutoModel, AutoModelForSequenceClassification

    if int(transformers.__version__.split(".")[0]) < 5:
        return False
    if getattr(config, "is_decoder", False) or getattr(config, "is_encoder_decoder", False):
        return False
    classifies = is_cross_encoder(config)
    if classifies and config.model_type not in CROSS_ENCODER_TYPES:
        return False
    try:
        model_class = (AutoModelForSequenceClassification if classifies else AutoModel)._model_mapping[type(config)]
    except (KeyError, ValueError):
        return False
    architectures = getattr(config, "architectures", None) or []
    if model_class.__name__ not in architectures:
        return False
    if getattr(config, "position_embedding_type", "absolute") != "absolute":
        return False   # relative position biases need the whole sequence's distances, not packed rows
    return bool(getattr(model_class, "_supports_attention_backend", False))
