"""A generation request as the scheduler tracks it."""

from __future__ import annotations

import enum
import itertools
from dataclasses import dataclass, field
from typing import Any

from srv.engine.detokenizer import IncrementalDetokenizer
from srv.sdk.grammar import GrammarMatcher
from srv.sdk.sampling import SamplingParams

_arrivals = itertools.count()


class FinishReason(str, enum.Enum):
    STOP = "stop"          # an EOS or stop token, or a stop string
    LENGTH = "length"      # max_new_tokens
    ABORT = "abort"


@dataclass(eq=False)
class Req:
    rid: str
    prompt_ids: list[int]
    params: SamplingParams
    priority: int = 0
    output_ids: list[int] = field(default_factory=list)
    arrival_index: int = field(default_factory=lambda: next(_arrivals))
    # KV state: cache row, tokens whose keys/values are in the cache, slots reserved in the row
    # (whole pages), and the prefix-cache hit.
    row: int | None = None
    kv_len: int = 0
    allocated: int = 0
    cached_prefix_len: int = 0
    cached_tokens: int = 0          # prompt tokens served from the prefix cache, over all admissions
    cache_node: Any = None
    prefix_node: Any = None         # deepest cached prefix while waiting, for scheduling policies
    finish_reason: FinishReason | None = None
    matched_stop: int | str | None = None
    logprobs: list[float] = field(default_factory=list)
    top_logprobs: list[list[tuple[int, float]]] = field(default_factory=list)
    token_ids_logprobs: list[list[float]] = field(default_factory=list)   # params.token_ids_logprob's, per output token
    hidden_states: list[list[float]] = field(default_factory=list)   # return_hidden_states: one a computed position
    # The prompt's log-probabilities, token params.logprob_start_len on (None for token 0).
    input_logprobs: list[float | None] = field(default_factory=list)
    input_top_logprobs: list[list[tuple[int, float]]] = field(default_factory=list)
    input_logprobs_sent: bool = False
    retractions: int = 0
    grammar: GrammarMatcher | None = None   # the request's constraint (json_schema, regex or ebnf)
    # The output's text as far as stop strings need it: the front end cuts its text with the
    # same matcher, so both agree where a stop string ended the request.
    stop_matcher: IncrementalDetokenizer | None = None
    error: str | None = None        # why the scheduler failed this request (it ends as ABORT)
    skipped_since: float | None = None   # when admission first passed it over for lack of KV memory
    embedding: list[float] | None = None  # the pooled prompt, on an embedding server
    session_id: str | None = None         # a session's turn: its KV stays locked in the prefix cache
    token_type_ids: list[int] | None = None   # segment of each prompt token (a cross-encoder's pair)
    # Added to every token id the prefix cache keys this request's KV on: 0 for the base model,
    # an adapter's own offset for a LoRA request, so that KV is shared only under one adapter.
    cache_namespace: int = 0

    @property
    def token_ids(self) -> list[int]:
        return self.prompt_ids + self.output_ids

    def cache_keys(self, end: int) -> list[int]:
        """The prefix cache's keys for the first `end` tokens."""
        tokens = self.token_ids[:end]
        return tokens if not self.cache_namespace else [t + self.cache_namespace for t in tokens]

    @property
    def prompt_len(self) -> int:
        return len(self.prompt_ids)

    @property
    def max_new_tokens(self) -> int:
        return self.params.max_new_tokens

    @property
    def seq_len(self) -> int:
        return len(self.prompt_ids) + len(self.output_ids)

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None

    @property
    def next_prompt_logprob(self) -> int | None:
        """The prompt token whose log-probability comes next (None: none wanted, or all known)."""
        start = self.params.logprob_start_len
        if start < 0:
            return None
        token = min(start, self.prompt_len) + len(self.input_logprobs)
        return token if token < self.prompt_len else None
