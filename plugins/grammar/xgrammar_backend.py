"""xgrammar: JSON schemas, regexes and EBNF compiled to a pushdown automaton with a token-mask
cache; the default grammar backend of SGLang."""

from __future__ import annotations

import os
import re
from typing import Any

import torch
import xgrammar

from srv.sdk.grammar import GrammarBackend, GrammarError, GrammarMatcher, GrammarOptions, GrammarSpec, GrammarVocabulary


# xgrammar's C++ errors start with "[time] file.cc:line: ", which says nothing to a client.
_LOG_PREFIX = re.compile(r"^\[[\d:]+\] \S+:\d+: ", re.MULTILINE)


class XGrammarMatcher(GrammarMatcher):
    def __init__(self, matcher: xgrammar.GrammarMatcher) -> None:
        self._matcher = matcher

    def fill_bitmask(self, bitmask: torch.Tensor, row: int) -> None:
        self._matcher.fill_next_token_bitmask(bitmask, row)

    def accept_token(self, token_id: int) -> bool:
        return self._matcher.accept_token(token_id)

    def rollback(self, num_tokens: int) -> None:
        self._matcher.rollback(num_tokens)

    def is_terminated(self) -> bool:
        return self._matcher.is_terminated()


class XGrammarBackend(GrammarBackend):
    def __init__(self, vocabulary: GrammarVocabulary, options: GrammarOptions) -> None:
        super().__init__(vocabulary, options)
        info = _without_special_tokens(xgrammar.TokenizerInfo.from_huggingface(
            vocabulary.tokenizer, vocab_size=vocabulary.vocab_size, stop_token_ids=vocabulary.stop_token_ids),
            vocabulary)
        self._compiler = xgrammar.GrammarCompiler(info, max_threads=len(os.sched_getaffinity(0)))

    def compile(self, spec: GrammarSpec) -> Any:
        try:
            if spec.kind == "json_schema":
                return self._compiler.compile_json_schema(
                    spec.value, any_whitespace=not self.options.disable_any_whitespace)
            if spec.kind == "regex":
                return self._compiler.compile_regex(spec.value)
            return self._compiler.compile_grammar(spec.value)
        except Exception as exc:   # xgrammar raises RuntimeError/ValueError subclasses with the parser's message
            raise GrammarError(_LOG_PREFIX.sub("", str(exc)).strip()) from None

    def matcher(self, compiled: Any) -> GrammarMatcher:
        return XGrammarMatcher(xgrammar.GrammarMatcher(compiled))


def _without_special_tokens(info: xgrammar.TokenizerInfo, vocabulary: GrammarVocabulary) -> xgrammar.TokenizerInfo:
    """xgrammar treats special tokens such as <|im_start|> as their text, so they could appear
    inside a JSON string; an empty token is one it never allows (stop tokens aside)."""
    tokenizer = vocabulary.tokenizer
    special = set(tokenizer.all_special_ids) | {i for i, t in tokenizer.added_tokens_decoder.items() if t.special}
    special -= set(vocabulary.stop_token_ids)
    if not special:
        return info
    encoded = [""] * vocabulary.vocab_size
    for token, index in tokenizer.get_vocab().items():
        if index < vocabulary.vocab_size and index not in special:
            encoded[index] = token
    return xgrammar.TokenizerInfo.from_vocab_and_metadata(encoded, info.dump_metadata())
