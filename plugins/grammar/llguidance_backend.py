"""llguidance: JSON schemas, regexes and context-free grammars (Lark, or GBNF converted to Lark)
matched by a lazy lexer and an Earley parser over a token trie, with no per-grammar token-mask
precomputation (compiling is cheap, each mask is computed when asked for)."""

from __future__ import annotations

import logging
from typing import Any

import llguidance
import llguidance.hf
import llguidance.torch
import torch
from llguidance import LLMatcher

from srv.sdk.grammar import GrammarBackend, GrammarError, GrammarMatcher, GrammarOptions, GrammarSpec, GrammarVocabulary

logger = logging.getLogger("srv.grammar.llguidance")


class LLGuidanceMatcher(GrammarMatcher):
    """One request's `llguidance.LLMatcher`.

    Two differences from the SDK's contract are bridged here: a token the grammar forbids puts
    an LLMatcher into a permanent error state (so tokens go through `try_consume_tokens`, which
    leaves the state alone when it refuses), and an LLMatcher reports no difference between
    "complete, only a stop token may follow" and "a stop token was accepted" (`is_stopped()` is
    true for both), so the stop token is tracked here and never fed to llguidance.
    """

    def __init__(self, matcher: LLMatcher, stop_token_ids: frozenset[int], vocab_size: int) -> None:
        self._matcher = matcher
        self._stop_token_ids = stop_token_ids
        self._vocab_size = vocab_size
        self._terminated = False

    def fill_bitmask(self, bitmask: torch.Tensor, row: int) -> None:
        if self._terminated:  # nothing may follow a stop token
            bitmask[row].zero_()
            return
        llguidance.torch.fill_next_token_bitmask(self._matcher, bitmask, row)

    def accept_token(self, token_id: int) -> bool:
        if self._terminated:
            return False
        if token_id in self._stop_token_ids:
            if not self._matcher.is_accepting():
                return False
            self._terminated = True
            return True
        if not 0 <= token_id < self._vocab_size:  # an id out of range is an error state for llguidance
            return False
        return self._matcher.try_consume_tokens([token_id]) == 1

    def rollback(self, num_tokens: int) -> None:
        if num_tokens <= 0:
            return
        if self._terminated:
            self._terminated = False
            num_tokens -= 1
        if num_tokens and not self._matcher.rollback(num_tokens):
            raise ValueError(f"llguidance could not roll back {num_tokens} tokens: {self._matcher.get_error()}")

    def is_terminated(self) -> bool:
        return self._terminated


class LLGuidanceBackend(GrammarBackend):
    """Compiled grammars are template matchers, validated once; each request gets a deep copy
    (microseconds, where building an LLMatcher from the grammar text takes about a millisecond).

    json_schema: `whitespace_flexible` is `not options.disable_any_whitespace` (flexible JSON
    whitespace, or none at all), and `options.whitespace_pattern`, when set, is the whitespace
    allowed between JSON tokens. ebnf: GBNF (llama.cpp's syntax, as xgrammar takes it) is
    converted to Lark by llguidance; a grammar already in Lark syntax is used as it is.
    """

    def __init__(self, vocabulary: GrammarVocabulary, options: GrammarOptions) -> None:
        super().__init__(vocabulary, options)
        try:
            self._tokenizer = llguidance.hf.from_tokenizer(
                vocabulary.tokenizer, n_vocab=vocabulary.vocab_size, eos_token=list(vocabulary.stop_token_ids) or None)
        except ValueError as exc:  # "Only fast tokenizers are supported"
            raise ValueError(f"the llguidance grammar backend needs a fast Hugging Face tokenizer: {exc}") from None
        self._stop_token_ids = frozenset(vocabulary.stop_token_ids)
        json_options: dict[str, Any] = {"whitespace_flexible": not options.disable_any_whitespace}
        if options.whitespace_pattern is not None:
            json_options["whitespace_pattern"] = options.whitespace_pattern
        self._json_options = json_options

    def _grammar(self, spec: GrammarSpec) -> str:
        if spec.kind == "json_schema":
            spec.schema()  # GrammarError when the schema is not JSON
            try:
                return LLMatcher.grammar_from_json_schema(spec.value, defaults=self._json_options)
            except ValueError as exc:
                raise GrammarError(str(exc)) from None
        if spec.kind == "regex":
            return LLMatcher.grammar_from_regex(spec.value)
        if spec.kind == "ebnf":
            try:
                return llguidance.grammar_from("ebnf", spec.value)
            except ValueError as exc:  # the GBNF -> Lark conversion names the problem
                raise GrammarError(str(exc)) from None
        raise GrammarError(f"unknown grammar kind {spec.kind!r}")

    def compile(self, spec: GrammarSpec) -> LLMatcher:
        grammar = self._grammar(spec)
        is_error, messages = LLMatcher.validate_grammar_with_warnings(grammar, self._tokenizer)
        if is_error:
            raise GrammarError(messages[0] if messages else "rejected by llguidance")
        for message in messages:
            logger.warning("llguidance: %s", message)
        template = LLMatcher(self._tokenizer, grammar, log_level=0)
        if template.is_error():
            raise GrammarError(template.get_error())
        return template

    def matcher(self, compiled: LLMatcher) -> GrammarMatcher:
        return LLGuidanceMatcher(compiled.deep_copy(), self._stop_token_ids, self.vocabulary.vocab_size)
