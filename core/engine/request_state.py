"""The front end's view of one request: tokens and text so far, built from `RequestOutput`s."""

from __future__ import annotations

import time
from typing import Any

from srv.engine.detokenizer import IncrementalDetokenizer
from srv.engine.io import RequestOutput
from srv.sdk.sampling import SamplingParams


class RequestState:
    def __init__(self, rid: str, prompt_ids: list[int], params: SamplingParams, tokenizer: Any | None,
                 labels: dict[str, str] | None = None) -> None:
        self.rid, self.prompt_ids, self.params = rid, prompt_ids, params
        self.labels = labels or {}
        self.created_at = time.perf_counter()
        self.first_token_at: float | None = None
        self.previous_token_at: float | None = None
        self.last_token_at: float | None = None
        self.output_ids: list[int] = []
        self.logprobs: list[float] = []
        self.top_logprobs: list[list[tuple[int, float]]] = []
        self.token_ids_logprobs: list[list[float]] = []   # params.token_ids_logprob's, per output token
        self.hidden_states: list[list[float]] = []   # return_hidden_states: one a computed position
        # The prompt's log-probabilities, with logprob_start_len >= 0 (see RequestOutput).
        self.input_logprobs: list[float | None] = []
        self.input_top_logprobs: list[list[tuple[int, float]]] = []
        self.finish_reason: str | None = None
        self.matched_stop: int | str | None = None
        self.error: str | None = None
        self.cached_tokens = 0
        self.embedding: list[float] | None = None
        self.session: Any = None   # the SessionParams of a session's turn
        self.text = ""
        self._detokenizer = IncrementalDetokenizer.for_request(tokenizer, params) if tokenizer is not None else None

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None or self.error is not None

    def update(self, out: RequestOutput) -> str:
        """Apply one step's output; returns the text it added."""
        if out.new_ids:
            now = time.perf_counter()
            self.previous_token_at = self.last_token_at
            self.first_token_at = self.first_token_at or now
            self.last_token_at = now
        self.output_ids += out.new_ids
        self.logprobs += out.logprobs
        self.top_logprobs += out.top_logprobs
        self.token_ids_logprobs += out.token_ids_logprobs
        self.hidden_states += out.hidden_states
        self.cached_tokens = out.cached_tokens
        if out.input_logprobs is not None:
            self.input_logprobs, self.input_top_logprobs = out.input_logprobs, out.input_top_logprobs or []
        self.error = out.error
        if out.embedding is not None:
            self.embedding = out.embedding
        if out.finish_reason is not None:
            self.finish_reason, self.matched_stop = out.finish_reason, out.matched_stop
        if self._detokenizer is None:
            return ""
        # A token at a time, as the scheduler's stop matcher takes them, so both cut alike.
        added = "".join(self._detokenizer.push([token]) for token in out.new_ids)
        if self.finished:
            added += self._detokenizer.finish()
        self.text += added
        return added

    def result(self) -> dict[str, Any]:
        meta: dict[str, Any] = {
            "id": self.rid,
            "prompt_tokens": len(self.prompt_ids),
            "completion_tokens": len(self.output_ids),
            "cached_tokens": self.cached_tokens,
            "finish_reason": {"type": self.finish_reason, "matched": self.matched_stop} if self.finish_reason else None,
        }
        if self.params.logprobs or self.params.top_logprobs:
            meta["output_token_logprobs"] = list(zip(self.logprobs, self.output_ids))
            meta["output_top_logprobs"] = list(self.top_logprobs)
        if self.params.return_hidden_states:
            meta["hidden_states"] = self.hidden_states
        if self.params.token_ids_logprob:
            meta["output_token_ids_logprobs"] = [list(zip(values, self.params.token_ids_logprob))
                                                 for values in self.token_ids_logprobs]
        if self.params.logprob_start_len >= 0:
            start = min(self.params.logprob_start_len, len(self.prompt_ids))
            meta["input_token_logprobs"] = list(zip(self.input_logprobs, self.prompt_ids[start:]))
            meta["input_top_logprobs"] = list(self.input_top_logprobs)
        return {"text": self.text, "output_ids": list(self.output_ids), "meta_info": meta}

    def embedding_result(self) -> dict[str, Any]:
        """SGLang's result of an embedding request."""
        return {"embedding": self.embedding,
                "meta_info": {"id": self.rid, "prompt_tokens": len(self.prompt_ids), "finish_reason": None}}
