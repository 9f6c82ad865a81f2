"""The messages between the front end (tokenizer side) and the scheduler loop.

The same dataclasses travel through a queue when the scheduler runs in a thread (`srv.Engine`)
and pickled over ZMQ when it runs in its own process (`srv launch`).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from srv.sdk.sampling import SamplingParams


@dataclass
class GenerateRequest:
    rid: str
    input_ids: list[int]
    params: SamplingParams
    priority: int = 0
    session_id: str | None = None   # the session whose latest turn this is (its KV stays cached)
    token_type_ids: list[int] | None = None   # segment of each token: a cross-encoder's text pair
    dp_rank: int | None = None   # the data-parallel group the caller routed it to (else the router picks)


@dataclass
class AbortRequest:
    rid: str


@dataclass
class ControlRequest:
    """Ask the scheduler loop something between steps: `method` names a `control_*` method,
    called with `args` as keywords."""

    call_id: int
    method: str
    args: dict[str, Any] = field(default_factory=dict)


@dataclass
class RequestOutput:
    """What one request gained in one step: its new tokens, and how it ended if it did."""

    rid: str
    new_ids: list[int] = field(default_factory=list)
    prompt_tokens: int = 0
    cached_tokens: int = 0
    finish_reason: str | None = None
    matched_stop: int | str | None = None
    logprobs: list[float] = field(default_factory=list)
    top_logprobs: list[list[tuple[int, float]]] = field(default_factory=list)
    error: str | None = None
    token_ids_logprobs: list[list[float]] = field(default_factory=list)
    hidden_states: list[list[float]] = field(default_factory=list)   # positions computed since the last output
    # Once the prompt is computed, with logprob_start_len >= 0: the log-probability of each
    # prompt token from there on (None for the first token of the prompt), and their top ones.
    input_logprobs: list[float | None] | None = None
    input_top_logprobs: list[list[tuple[int, float]]] | None = None
    embedding: list[float] | None = None   # an embedding server's pooled prompt, once computed

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None or self.error is not None


@dataclass
class ControlResult:
    call_id: int
    value: Any
    error: str | None = None   # the control method refused the call (the caller's mistake)
