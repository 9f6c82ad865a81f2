"""outlines-core: JSON schemas and regexes compiled to a token-level automaton (an `Index`: every
state's allowed tokens and their next states, computed once per grammar). No EBNF.

Two properties of outlines-core 0.2.14 shape this module:

- `Index` walks a regex-automata DFA whose matches are reported one byte late, and keeps a token
  only when the state after its last byte is not such a delayed match, or is a full match. A
  token that crosses the end of a match without ending on one is therefore dropped: after "12"
  under `[0-9]+(\\.[0-9]+)?` the token "." is never allowed, "1." never is, and `a|ab` never gets
  past "a" (the DFA also stops at the first, leftmost-first match). Here every regex R is compiled
  as `(?:R)S`, S being one sentinel character that no token of the vocabulary can spell: matches
  then happen only after S, so no token is dropped, and a state is complete for R exactly when
  the sentinel token leads from it to a final state.
- `Vocabulary.from_pretrained` downloads from the Hugging Face hub; the vocabulary is built here
  from the loaded tokenizer instead (the bytes of every token, special tokens left out).
"""

from __future__ import annotations

import json
import logging
import re
from typing import Any

import torch
from outlines_core import Guide, Index, Vocabulary
from outlines_core.json_schema import build_regex_from_schema

from srv.sdk.grammar import (GrammarBackend, GrammarError, GrammarMatcher, GrammarOptions, GrammarSpec,
                             GrammarVocabulary, bitmask_words)

logger = logging.getLogger("srv.grammar.outlines")

# U+10FFFF, a noncharacter. Its UTF-8 form starts with 0xF4, and every token holding a 0xF4 byte
# is left out of the vocabulary, so no token sequence can spell it: the model loses plane 16
# (U+100000..U+10FFFF, private use), nothing else.
SENTINEL = "\U0010FFFF"
SENTINEL_REGEX = r"\x{10FFFF}"
_EXCLUDED_BYTE = SENTINEL.encode()[0]

# JSON schema keywords outlines-core 0.2.14 accepts but does not enforce.
IGNORED_NUMBER_KEYWORDS = ("minimum", "maximum", "exclusiveMinimum", "exclusiveMaximum", "multipleOf")
MAX_INTEGER_ENUM = 1024   # a larger range would make a regex alternation too big to be worth it


def _gpt2_byte_decoder() -> dict[str, int]:
    """The byte-level BPE alphabet (GPT-2's `bytes_to_unicode`), reversed: character -> byte."""
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    chars, extra = list(printable), 0
    for byte in range(256):
        if byte not in printable:
            printable.append(byte)
            chars.append(256 + extra)
            extra += 1
    return {chr(c): b for b, c in zip(printable, chars)}


_BYTE_TOKEN = re.compile(r"<0x([0-9A-Fa-f]{2})>")


def _vocabulary_kind(tokenizer: Any, tokens: list[str | None]) -> str:
    """byte_level (GPT-2 style, "Ġ" for a space), byte_fallback (SentencePiece: "▁" for a space,
    "<0x0A>" byte tokens) or raw (tokens are their text)."""
    backend = getattr(tokenizer, "backend_tokenizer", None)
    decoder = repr(getattr(backend, "decoder", None)) if backend is not None else ""
    if "ByteLevel" in decoder:
        return "byte_level"
    if "ByteFallback" in decoder or "Metaspace" in decoder or "▁" in decoder:
        return "byte_fallback"
    present = set(tokens)
    if "<0x0A>" in present or any(t is not None and t.startswith("▁") for t in tokens[:2000]):
        return "byte_fallback"
    if "Ċ" in present or "Ġ" in present:
        return "byte_level"
    return "raw"


def token_bytes(tokenizer: Any, vocab_size: int, exclude: set[int]) -> dict[int, bytes]:
    """Token id -> the bytes it stands for, for every id below min(len(tokenizer), vocab_size)
    but the special tokens, the ids in `exclude` and tokens that stand for no bytes."""
    count = min(len(tokenizer), vocab_size)
    tokens = tokenizer.convert_ids_to_tokens(list(range(count)))
    added = getattr(tokenizer, "added_tokens_decoder", {}) or {}
    special = set(tokenizer.all_special_ids) | {i for i, t in added.items() if getattr(t, "special", False)}
    kind = _vocabulary_kind(tokenizer, tokens)
    byte_decoder = _gpt2_byte_decoder()
    result: dict[int, bytes] = {}
    for token_id, token in enumerate(tokens):
        if token is None or token_id in special or token_id in exclude:
            continue
        if token_id in added:  # added (not special) tokens are plain text in every kind of vocabulary
            data = str(added[token_id]).encode()
        elif kind == "byte_level" and all(c in byte_decoder for c in token):
            data = bytes(byte_decoder[c] for c in token)
        elif kind == "byte_fallback":
            byte = _BYTE_TOKEN.fullmatch(token)
            data = bytes([int(byte.group(1), 16)]) if byte else token.replace("▁", " ").encode()
        else:
            data = token.encode()
        if data:
            result[token_id] = data
    return result


def _strip_anchors(regex: str) -> str:
    """Outlines matches the whole text anyway; `^`/`$` around it would stop it before the sentinel."""
    if regex.startswith("^"):
        regex = regex[1:]
    if regex.endswith("$"):
        backslashes = len(regex) - 1 - len(regex[:-1].rstrip("\\"))
        if backslashes % 2 == 0:  # not an escaped "\$"
            regex = regex[:-1]
    return regex


def _bounded_integers_as_enums(schema: Any) -> Any:
    """outlines-core ignores numeric bounds; an integer with both bounds and a small range is
    rewritten as the enum of its values, which it does enforce."""
    if isinstance(schema, list):
        return [_bounded_integers_as_enums(value) for value in schema]
    if not isinstance(schema, dict):
        return schema
    schema = {key: _bounded_integers_as_enums(value) for key, value in schema.items()}
    if schema.get("type") == "integer":
        low = schema.get("minimum", schema["exclusiveMinimum"] + 1 if isinstance(schema.get("exclusiveMinimum"), int) else None)
        high = schema.get("maximum", schema["exclusiveMaximum"] - 1 if isinstance(schema.get("exclusiveMaximum"), int) else None)
        if isinstance(low, int) and isinstance(high, int) and 0 <= high - low < MAX_INTEGER_ENUM:
            step = schema.get("multipleOf")
            rest = {k: v for k, v in schema.items() if k not in IGNORED_NUMBER_KEYWORDS and k != "type"}
            return {**rest, "enum": [n for n in range(low, high + 1) if not isinstance(step, int) or n % step == 0]}
    return schema


def _ignored_number_keywords(schema: Any) -> set[str]:
    found: set[str] = set()
    if isinstance(schema, dict):
        found |= {k for k in IGNORED_NUMBER_KEYWORDS if isinstance(schema.get(k), (int, float))}
        for value in schema.values():
            found |= _ignored_number_keywords(value)
    elif isinstance(schema, list):
        for value in schema:
            found |= _ignored_number_keywords(value)
    return found


class OutlinesGrammar:
    """A compiled grammar: the Index of `(?:R)S`, and which of its states are complete for R."""

    def __init__(self, index: Index, sentinel_id: int) -> None:
        self.index, self.sentinel_id = index, sentinel_id
        self._complete: dict[int, bool] = {}

    def is_complete(self, state: int) -> bool:
        complete = self._complete.get(state)
        if complete is None:
            after = self.index.get_next_state(state, self.sentinel_id)
            complete = after is not None and self.index.is_final_state(after)
            self._complete[state] = complete   # a benign race between threads: same value
        return complete


class OutlinesMatcher(GrammarMatcher):
    """A Guide over the compiled Index. Stop tokens are handled here (outlines' own end-of-sequence
    id is beyond the logits): allowed exactly where R is complete, never fed to the Guide."""

    def __init__(self, grammar: OutlinesGrammar, backend: "OutlinesBackend") -> None:
        self._grammar, self._backend = grammar, backend
        self._guide = Guide(grammar.index, max_rollback=backend.max_rollback)
        self._tokens: list[int] = []      # accepted (stop token excluded), to replay a long rollback
        self._terminated = False
        self._scratch = torch.empty(backend.index_words, dtype=torch.int32)

    def fill_bitmask(self, bitmask: torch.Tensor, row: int) -> None:
        target = bitmask[row]
        if self._terminated:  # nothing may follow a stop token
            target.zero_()
            return
        # The Index spans the sentinel and outlines' end-of-sequence ids, past the logits: write
        # its mask aside, keep the part for real tokens, then add the stop tokens where R is complete.
        self._guide.write_mask_into(self._scratch.data_ptr(), self._scratch.numel(), 4)
        target.copy_(self._scratch[:target.numel()])
        target &= self._backend.real_token_words
        if self._grammar.is_complete(self._guide.get_state()):
            target |= self._backend.stop_token_words

    def accept_token(self, token_id: int) -> bool:
        if self._terminated:
            return False
        if token_id in self._backend.stop_token_ids:
            if not self._grammar.is_complete(self._guide.get_state()):
                return False
            self._terminated = True
            return True
        if not 0 <= token_id < self._backend.vocabulary.vocab_size:
            return False
        try:
            self._guide.advance(token_id, return_tokens=False)
        except ValueError:  # no transition: the Guide's state is unchanged
            return False
        self._tokens.append(token_id)
        return True

    def rollback(self, num_tokens: int) -> None:
        if num_tokens <= 0:
            return
        if self._terminated:
            self._terminated = False
            num_tokens -= 1
        if not num_tokens:
            return
        if num_tokens > len(self._tokens):
            raise ValueError(f"cannot roll back {num_tokens} tokens: only {len(self._tokens)} were accepted")
        del self._tokens[-num_tokens:]
        if num_tokens <= self._guide.get_allowed_rollback():
            self._guide.rollback_state(num_tokens)
        else:  # beyond the Guide's history: replay from the start
            self._guide.reset()
            for token_id in self._tokens:
                self._guide.advance(token_id, return_tokens=False)

    def is_terminated(self) -> bool:
        return self._terminated


class OutlinesBackend(GrammarBackend):
    """json_schema: `build_regex_from_schema` with `options.whitespace_pattern` (outlines' default,
    `[ ]?`, when unset; none at all with `options.disable_any_whitespace`). outlines-core 0.2.14
    accepts but does not enforce numeric bounds (minimum, maximum, exclusive*, multipleOf): a
    warning names them. `options.disable_disk_cache` has nothing to disable: outlines-core keeps
    no disk cache (outlines' own cache lives in the `outlines` package, unused here)."""

    max_rollback = 32   # Guide's history; a longer rollback replays the accepted tokens

    def __init__(self, vocabulary: GrammarVocabulary, options: GrammarOptions) -> None:
        super().__init__(vocabulary, options)
        vocab_size = vocabulary.vocab_size
        self.stop_token_ids = frozenset(vocabulary.stop_token_ids)
        tokens = token_bytes(vocabulary.tokenizer, vocab_size, exclude=set(self.stop_token_ids))
        by_bytes: dict[bytes, list[int]] = {}
        for token_id, data in tokens.items():
            if _EXCLUDED_BYTE not in data:
                by_bytes.setdefault(data, []).append(token_id)
        self.sentinel_id, self.eos_id = vocab_size, vocab_size + 1
        by_bytes[SENTINEL.encode()] = [self.sentinel_id]
        self._vocabulary = Vocabulary(self.eos_id, by_bytes)
        self.index_words = bitmask_words(self.eos_id + 1)
        words = bitmask_words(vocab_size)
        ids = torch.arange(words * 32)
        self.real_token_words = _pack(ids < vocab_size)
        self.stop_token_words = _pack(torch.isin(ids, torch.tensor(sorted(self.stop_token_ids), dtype=torch.long)))
        if options.whitespace_pattern is not None:
            self._whitespace = options.whitespace_pattern
        else:
            self._whitespace = "" if options.disable_any_whitespace else None

    def _regex(self, spec: GrammarSpec) -> str:
        if spec.kind == "ebnf":
            raise GrammarError("the outlines grammar backend does not support EBNF grammars "
                               "(use --grammar-backend xgrammar or llguidance)")
        if spec.kind == "regex":
            return _strip_anchors(spec.value)
        if spec.kind != "json_schema":
            raise GrammarError(f"unknown grammar kind {spec.kind!r}")
        schema = _bounded_integers_as_enums(spec.schema())
        try:
            regex = build_regex_from_schema(json.dumps(schema), self._whitespace)
        except (ValueError, TypeError) as exc:
            raise GrammarError(str(exc)) from None
        ignored = _ignored_number_keywords(schema)
        if ignored:
            logger.warning("outlines-core does not enforce %s in JSON schemas: generated numbers may be out of range",
                           ", ".join(sorted(ignored)))
        return regex

    def compile(self, spec: GrammarSpec) -> OutlinesGrammar:
        regex = self._regex(spec)
        try:
            index = Index(f"(?:{regex}){SENTINEL_REGEX}", self._vocabulary)
        except (ValueError, TypeError) as exc:
            where = "" if spec.kind == "regex" else f"the regex built from the schema, {regex!r}: "
            raise GrammarError(f"{where}{exc}") from None
        return OutlinesGrammar(index, self.sentinel_id)

    def matcher(self, compiled: OutlinesGrammar) -> GrammarMatcher:
        return OutlinesMatcher(compiled, self)


def _pack(allowed: torch.Tensor) -> torch.Tensor:
    """[words * 32] booleans -> [words] int32 bitmask words (bit t % 32 of word t // 32)."""
    bits = allowed.view(-1, 32).to(torch.int64) << torch.arange(32, dtype=torch.int64)
    words = bits.sum(-1)
    return torch.where(words >= 2**31, words - 2**32, words).to(torch.int32)
