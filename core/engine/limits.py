"""What one request may ask of the served model: token ids inside the vocabulary, a prompt and
output that fit the context and the KV cache. The front end applies these rules once, before a
request is queued, so the scheduler never holds a request that can never run.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, replace

from srv.engine.errors import InvalidRequest
from srv.sdk.sampling import SamplingParams

logger = logging.getLogger("srv.frontend")


@dataclass(frozen=True)
class RequestLimits:
    """context_len: tokens of prompt and output together; vocab_size: rows of the embedding;
    kv_capacity_tokens: slots of the whole KV cache; allow_auto_truncate: cut what does not fit
    (the prompt's start, then the output) instead of refusing it; embedding: the model embeds
    prompts and generates nothing."""

    context_len: int
    vocab_size: int
    kv_capacity_tokens: int
    allow_auto_truncate: bool = False
    embedding: bool = False

    def fit(self, input_ids: list[int], params: SamplingParams,
            max_new_tokens_given: bool) -> tuple[list[int], SamplingParams]:
        """The request's tokens and parameters once they fit, or InvalidRequest saying why not.

        max_new_tokens the caller did not choose is cut to what fits; one the caller chose is
        refused when it does not fit (OpenAI's and SGLang's rule), or cut under --allow-auto-truncate.
        """
        if not input_ids:
            raise InvalidRequest("the prompt is empty")
        bad = next((t for t in input_ids if not 0 <= t < self.vocab_size), None)
        if bad is not None:
            raise InvalidRequest(f"the input contains token id {bad}, outside the vocabulary of "
                                 f"{self.vocab_size} tokens (ids 0 to {self.vocab_size - 1})")
        bad = next((t for t in params.token_ids_logprob if t >= self.vocab_size), None)
        if bad is not None:
            raise InvalidRequest(f"token_ids_logprob names token id {bad}, outside the vocabulary of "
                                 f"{self.vocab_size} tokens", "token_ids_logprob")
        if len(input_ids) >= self.context_len:
            if not self.allow_auto_truncate:
                raise InvalidRequest(f"The input ({len(input_ids)} tokens) is longer than the model's context "
                                     f"length ({self.context_len} tokens).")
            logger.warning("the input (%d tokens) is longer than the context (%d tokens): keeping its last %d",
                           len(input_ids), self.context_len, self.context_len - 1)
            input_ids = input_ids[-(self.context_len - 1):]
        wanted = params.max_new_tokens
        # The last output token is never fed back, so it needs no KV slot.
        room = min(self.context_len - len(input_ids), self.kv_capacity_tokens + 1 - len(input_ids))
        if room < 1:
            raise InvalidRequest(f"the input ({len(input_ids)} tokens) does not fit the KV cache of "
                                 f"{self.kv_capacity_tokens} tokens (--max-total-tokens, --mem-fraction-static)")
        if wanted <= room:
            return input_ids, params
        if max_new_tokens_given and not self.allow_auto_truncate:
            total = len(input_ids) + wanted
            if total > self.context_len:
                raise InvalidRequest(
                    f"Requested token count exceeds the model's maximum context length of {self.context_len} "
                    f"tokens. You requested a total of {total} tokens: {len(input_ids)} tokens from the input "
                    f"messages and {wanted} tokens for the completion. Please reduce the number of tokens in the "
                    "input messages or the completion to fit within the limit.")
            raise InvalidRequest(f"the request needs {total - 1} KV cache slots ({len(input_ids)} input and "
                                 f"{wanted} completion tokens), more than the KV cache's {self.kv_capacity_tokens} "
                                 "(--max-total-tokens, --mem-fraction-static)")
        return input_ids, replace(params, max_new_tokens=room)
