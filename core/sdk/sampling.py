"""What a sampler plugin receives and returns."""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from srv.sdk.grammar import GRAMMAR_KINDS, GrammarSpec, apply_bitmask

if TYPE_CHECKING:   # annotations only: the HTTP process imports this module without torch
    import torch


@dataclass
class SamplingParams:
    """Per-request sampling parameters, with SGLang's names and defaults."""

    max_new_tokens: int = 128
    min_new_tokens: int = 0
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = -1
    min_p: float = 0.0
    repetition_penalty: float = 1.0
    frequency_penalty: float = 0.0
    presence_penalty: float = 0.0
    logit_bias: dict[int, float] | None = None
    seed: int | None = None
    stop: list[str] = field(default_factory=list)
    stop_token_ids: list[int] = field(default_factory=list)
    stop_regex: list[str] = field(default_factory=list)
    no_stop_trim: bool = False        # keep the stop string (or what stop_regex matched) in the text
    ignore_eos: bool = False
    n: int = 1
    logprobs: bool = False
    top_logprobs: int = 0
    # The prompt's log-probabilities from this token on (SGLang's logprob_start_len; -1: none).
    logprob_start_len: int = -1
    # The log-probabilities of these tokens at every output position (SGLang's token_ids_logprob),
    # whichever token is chosen: what scoring reads.
    token_ids_logprob: list[int] = field(default_factory=list)
    # The final hidden state of every position the model computes for the request (SGLang's
    # return_hidden_states, with --enable-return-hidden-states): not sampling, but per request.
    return_hidden_states: bool = False
    # A srv.sdk.logit_processor.CustomLogitProcessor as the request sent it, and its parameters.
    custom_logit_processor: str | None = None
    custom_params: dict | None = None
    # The LoRA adapter serving the request, by name (None: the base model).
    lora_path: str | None = None
    # Constrained decoding: at most one of these (a JSON schema as text, a regex, an EBNF grammar).
    json_schema: str | None = None
    regex: str | None = None
    ebnf: str | None = None

    @property
    def grammar(self) -> GrammarSpec | None:
        for kind in GRAMMAR_KINDS:
            value = getattr(self, kind)
            if value is not None:
                return GrammarSpec(kind, value)
        return None

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0 or self.top_k == 1


@dataclass
class SamplingBatch:
    """One decoding step's requests, in the row order of the logits.

    token_ids[i]: every token of request i so far (prompt then output), for the penalties;
    prompt_lens[i]: how many of those are prompt; eos_token_ids: masked while a request has
    produced fewer than min_new_tokens; vocab_mask: the tokens each row may choose, as the packed
    bitmask of `srv.sdk.grammar` (a grammar's constraint; all ones for a free row), or None when
    every row is free. A sampler never chooses a masked token, and reports log-probabilities of
    the model's own distribution, before the mask (`mask_logits` applies it to its working copy).
    """

    params: list[SamplingParams]
    token_ids: list[list[int]]
    prompt_lens: list[int]
    eos_token_ids: list[int]
    vocab_mask: torch.Tensor | None = None

    def mask_logits(self, logits: torch.Tensor) -> None:
        """Set the logits of tokens the vocab mask forbids to -inf, in place."""
        if self.vocab_mask is not None:
            apply_bitmask(logits, self.vocab_mask)

    def __len__(self) -> int:
        return len(self.params)

    def output_len(self, i: int) -> int:
        return len(self.token_ids[i]) - self.prompt_lens[i]


@dataclass
class SampleOutput:
    """next_token_ids [B]; logprobs [B] of the chosen tokens (after penalties and temperature
    are NOT applied: raw log-softmax of the model's logits), and top_logprobs as (values, ids)
    [B, k] for the largest k any request asked for, when any request asked for them."""

    next_token_ids: torch.Tensor
    logprobs: torch.Tensor | None = None
    top_logprobs: tuple[torch.Tensor, torch.Tensor] | None = None


class Sampler(ABC):
    """Turns a batch of logits [B, vocab] into next tokens."""

    @abstractmethod
    def sample(self, logits: torch.Tensor, batch: SamplingBatch) -> SampleOutput:
        ...
