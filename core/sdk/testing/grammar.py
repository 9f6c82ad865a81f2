"""Conformance kit for grammar (constrained decoding) backends (`--grammar-backend`)."""

from __future__ import annotations

import functools
import json
import random
import re
from dataclasses import dataclass, field
from typing import Any, Callable

import pytest
import torch

from srv.sdk.grammar import (GrammarBackend, GrammarError, GrammarMatcher, GrammarOptions, GrammarSpec,
                             GrammarVocabulary, allocate_bitmask, bitmask_to_bool)
from srv.sdk.testing.registry import create

# A text whose merges give the kit's tokenizer multi-character tokens for JSON punctuation
# ('{"', '":', '",'), words, numbers, e-mail addresses and a few non-ASCII characters.
CORPUS = [
    '{"name": "Ada", "age": 36, "tags": ["x", "y"], "ok": true, "value": null, "score": 4.5}',
    '{"address": {"city": "Paris", "zip": 75001}, "color": "green", "size": 2, "count": -3}',
    "The quick brown fox jumps over the lazy dog. 0123456789 -1.5e+10 [1, [2], []]",
    "ada@example.com, user_name@host.org, bob@mail.net; hello hi! café naïve ☃ 日本",
]
SPECIAL_TOKENS = ["<|endoftext|>", "<|im_end|>", "<pad>"]


@functools.lru_cache(maxsize=1)
def byte_level_tokenizer() -> Any:
    """A byte-level BPE `PreTrainedTokenizerFast` (GPT-2's alphabet: every byte is a token, "Ġ"
    marks a space) trained in code on `CORPUS`: 419 tokens, the first three special
    ("<|endoftext|>" 0, "<|im_end|>" 1 the eos, "<pad>" 2). Deterministic; nothing is downloaded."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=800, special_tokens=SPECIAL_TOKENS, show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tokenizer.train_from_iterator(CORPUS * 8, trainer)
    return PreTrainedTokenizerFast(tokenizer_object=tokenizer, unk_token="<|endoftext|>", eos_token="<|im_end|>",
                                   pad_token="<pad>", clean_up_tokenization_spaces=False)


# ---- what the kit asks of a backend -------------------------------------------------------------

NESTED_OBJECT = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 6},
        "address": {"type": "object",
                    "properties": {"city": {"type": "string", "maxLength": 6},
                                   "zip": {"type": "integer", "minimum": 0, "maximum": 99999}},
                    "required": ["city", "zip"], "additionalProperties": False},
    },
    "required": ["name", "address"], "additionalProperties": False,
}
ARRAY = {"type": "array", "items": {"type": "integer", "minimum": -50, "maximum": 50}, "minItems": 1, "maxItems": 4}
ENUM = {
    "type": "object",
    "properties": {"color": {"enum": ["red", "green", "blue"]}, "size": {"enum": [1, 2, 3, "large"]},
                   "ok": {"type": "boolean"}},
    "required": ["color", "size", "ok"], "additionalProperties": False,
}
NUMBERS = {
    "type": "object",
    "properties": {"score": {"type": "number", "minimum": 0, "maximum": 10},
                   "count": {"type": "integer", "minimum": -5, "maximum": 5}},
    "required": ["score", "count"], "additionalProperties": False,
}
SCHEMAS = {"nested_object": NESTED_OBJECT, "array": ARRAY, "enum": ENUM, "numbers": NUMBERS}
VALID_DOCUMENTS = {
    "nested_object": '{"name": "Ada", "address": {"city": "Paris", "zip": 75001}}',
    "array": "[1, -3, 42]",
    "enum": '{"color": "green", "size": "large", "ok": true}',
    "numbers": '{"score": 4.5, "count": -3}',
}
# Regexes, with a text each matches. "number": after a complete "12" the grammar may go on.
REGEXES = {
    "email": (r"[a-z]{1,8}@[a-z]{2,6}\.(com|org|net)", "ada@host.org"),
    "number": (r"-?(0|[1-9][0-9]{0,4})(\.[0-9]{1,3})?", "-12.5"),
    "alternatives": (r"(hi|hello)( [a-z]{1,5})?!", "hello fox!"),
}
# GBNF, as xgrammar and llama.cpp take it; the Python regex its language equals.
EBNF = ('root ::= "[" (item ("," item)*)? "]"\nitem ::= [0-9] | "[" [0-9]? "]" | "\\"" [a-z]{1,3} "\\""',
        r'\[((?:[0-9]|\[[0-9]?\]|"[a-z]{1,3}")(?:,(?:[0-9]|\[[0-9]?\]|"[a-z]{1,3}"))*)?\]',
        '[1,[2],"hi",[]]')
INVALID = {
    "json_schema": ['{"type": "nonsense"}', '{"type": "object", "properties": {"a": {"type": "integer"}'],
    "regex": ["(unclosed", "[a-"],
    "ebnf": ['root ::= undefined_rule', 'root ::= "a" ('],
}
NUMBER_KEYWORDS = ("minimum", "maximum", "exclusiveMinimum", "exclusiveMaximum", "multipleOf")


def without_number_bounds(schema: Any) -> Any:
    """The schema without numeric bounds (for a backend with enforces_number_bounds = False)."""
    if isinstance(schema, dict):
        return {k: without_number_bounds(v) for k, v in schema.items() if k not in NUMBER_KEYWORDS}
    if isinstance(schema, list):
        return [without_number_bounds(v) for v in schema]
    return schema


@dataclass
class Walk:
    """A matcher driven through a grammar: the tokens accepted (the stop token excluded), the
    allowed set before each of them, and whether it ended with an accepted stop token."""

    tokens: list[int] = field(default_factory=list)
    masks: list[torch.Tensor] = field(default_factory=list)
    stopped: bool = False


# Row 1 is filled; rows 0 and 2 hold these words and must keep them.
ROW_GUARDS = (0x5A5A5A5A, -0x36543211)
MAX_WALK_TOKENS = 300


class GrammarBackendKit:
    """Checks a grammar backend on a byte-level BPE tokenizer whose vocabulary is narrower than
    the model's (ids from len(tokenizer) to vocab_size are padding) with two stop tokens.

        class TestMyGrammar(GrammarBackendKit):
            backend_name = "my_grammar"         # the name your plugin registers, or:
            # backend_factory = MyBackend       # (GrammarVocabulary, GrammarOptions) -> GrammarBackend
            supports_ebnf = False               # if compile() refuses every ebnf spec

    Matchers are driven by seeded random walks: each step fills one row of a bitmask, checks
    the allowed set, offers a forbidden token (it must be refused and change nothing), and
    accepts a random allowed token, or a stop token once allowed; the text must then satisfy the
    grammar (JSON parsed and validated with `jsonschema`, regexes with `re.fullmatch`).
    Known gaps are declared, not hidden: `enforces_number_bounds = False` for a backend that
    ignores minimum/maximum, `refuses_special_tokens = False` for one that lets special tokens
    (other than the stop tokens) stand for their text.
    """

    backend_name: str | None = None
    backend_factory: Callable[[GrammarVocabulary, GrammarOptions], GrammarBackend] | None = None
    options: GrammarOptions = GrammarOptions()
    supports_ebnf: bool = True
    enforces_number_bounds: bool = True
    refuses_special_tokens: bool = True
    seeds: tuple[int, ...] = (0, 1, 2)
    extra_vocab: int = 45   # padding ids past the tokenizer (not a multiple of 32 in all)

    # ---- setup -----------------------------------------------------------------------------

    def make_tokenizer(self) -> Any:
        return byte_level_tokenizer()

    def make_vocabulary(self) -> GrammarVocabulary:
        """The kit's tokenizer, extra_vocab padding ids, stop tokens <|im_end|> and <|endoftext|>.

        Override it together with make_tokenizer for a tokenizer without those two tokens."""
        tokenizer = self.make_tokenizer()
        stop = [tokenizer.convert_tokens_to_ids(t) for t in ("<|im_end|>", "<|endoftext|>")]
        return GrammarVocabulary(tokenizer, len(tokenizer) + self.extra_vocab, stop)

    def make_backend(self) -> GrammarBackend:
        return create(self, "grammar", "backend_name", "backend_factory", self.make_vocabulary(), self.options)

    def backend(self) -> GrammarBackend:
        """The backend, built once per kit class (and options)."""
        key = (type(self), self.options)
        if key not in _BACKENDS:
            _BACKENDS[key] = self.make_backend()
        return _BACKENDS[key]

    def matcher(self, spec: GrammarSpec) -> GrammarMatcher:
        backend = self.backend()
        return backend.matcher(backend.compile(spec))

    # ---- driving a matcher -----------------------------------------------------------------

    def allowed(self, matcher: GrammarMatcher, step: str) -> torch.Tensor:
        """The allowed set [vocab_size] after checking the fill's contract."""
        vocabulary = self.backend().vocabulary
        tokenizer, size = vocabulary.tokenizer, vocabulary.vocab_size
        bitmask = allocate_bitmask(3, size)   # row 1 starts all-allowed: every word must be written
        bitmask[0].fill_(ROW_GUARDS[0])
        bitmask[2].fill_(ROW_GUARDS[1])
        matcher.fill_bitmask(bitmask, 1)
        assert bitmask.dtype == torch.int32 and bitmask.shape == (3, (size + 31) // 32), \
            f"{step}: fill_bitmask changed the bitmask's dtype or shape"
        for row, guard in ((0, ROW_GUARDS[0]), (2, ROW_GUARDS[1])):
            assert (bitmask[row] == guard).all(), f"{step}: fill_bitmask(bitmask, 1) changed row {row}"
        allowed = bitmask_to_bool(bitmask[1:2], size)[0]
        beyond = allowed[len(tokenizer):].nonzero().flatten().tolist()
        assert not beyond, f"{step}: ids past the tokenizer ({len(tokenizer)}..{size - 1}) allowed: {beyond[:8]}"
        if self.refuses_special_tokens:  # their text is not in the output (skip_special_tokens)
            special = [i for i in tokenizer.all_special_ids if i not in vocabulary.stop_token_ids and allowed[i]]
            assert not special, f"{step}: special tokens {special} allowed"
        assert allowed.any(), f"{step}: no token allowed (a dead end before the grammar is complete)"
        return allowed

    def walk(self, spec: GrammarSpec, seed: int, check_forbidden: bool = True) -> Walk:
        """A seeded random walk to a stop token; checks every step's contract."""
        vocabulary = self.backend().vocabulary
        stop_ids = list(vocabulary.stop_token_ids)
        matcher, rng, walk = self.matcher(spec), random.Random(seed), Walk()
        for step in range(MAX_WALK_TOKENS):
            where = f"{spec.kind} {spec.value[:60]!r}, seed {seed}, after {self.text(walk.tokens)!r}"
            assert not matcher.is_terminated(), f"{where}: is_terminated() before any stop token was accepted"
            allowed = self.allowed(matcher, where)
            walk.masks.append(allowed)
            if check_forbidden:
                self.offer_forbidden(matcher, allowed, rng, where)
            stops = [s for s in stop_ids if allowed[s]]
            choices = [t for t in allowed.nonzero().flatten().tolist() if t not in stop_ids]
            if stops and (not choices or rng.random() < 0.5 or step > MAX_WALK_TOKENS // 3):
                assert matcher.accept_token(stops[0]), f"{where}: accept_token refused stop token {stops[0]}, " \
                    "which the mask allowed"
                assert matcher.is_terminated(), f"{where}: not is_terminated() after accepting stop token {stops[0]}"
                walk.stopped = True
                return walk
            token = rng.choice(choices)
            assert matcher.accept_token(token), f"{where}: accept_token refused token {token} " \
                f"({self.text([token])!r}), which the mask allowed"
            walk.tokens.append(token)
        raise AssertionError(f"{spec.kind} {spec.value[:60]!r}, seed {seed}: no stop token allowed after "
                             f"{MAX_WALK_TOKENS} tokens: {self.text(walk.tokens)[:200]!r}")

    def offer_forbidden(self, matcher: GrammarMatcher, allowed: torch.Tensor, rng: random.Random, where: str) -> None:
        """A forbidden token is refused and leaves the allowed set as it was.

        One plain token, and a stop token while the grammar is incomplete."""
        size = len(self.backend().vocabulary.tokenizer)
        forbidden = (~allowed[:size]).nonzero().flatten().tolist()
        candidates = [t for t in forbidden if t not in self.backend().vocabulary.stop_token_ids]
        offered = [rng.choice(candidates)] if candidates else []
        offered += [s for s in self.backend().vocabulary.stop_token_ids if not allowed[s]][:1]
        for token in offered:
            assert matcher.accept_token(token) is False, \
                f"{where}: accept_token({token} {self.text([token])!r}) did not return False for a forbidden token"
            assert not matcher.is_terminated(), f"{where}: a refused token terminated the matcher"
        if offered:
            again = self.allowed(matcher, where)
            assert torch.equal(again, allowed), f"{where}: refusing token(s) {offered} changed the allowed set"

    def text(self, tokens: list[int]) -> str:
        return self.backend().vocabulary.tokenizer.decode(tokens, skip_special_tokens=False,
                                                          clean_up_tokenization_spaces=False)

    def accept_all(self, spec: GrammarSpec, text: str) -> GrammarMatcher:
        """Feed `text`'s tokens, each of which must be allowed and accepted; then a stop token."""
        tokenizer = self.backend().vocabulary.tokenizer
        tokens = tokenizer.encode(text, add_special_tokens=False)
        matcher = self.matcher(spec)
        for i, token in enumerate(tokens):
            where = f"{spec.kind} {spec.value[:60]!r}: {text!r} after {self.text(tokens[:i])!r}"
            assert self.allowed(matcher, where)[token], f"{where}: token {token} {self.text([token])!r} not allowed"
            assert matcher.accept_token(token), f"{where}: accept_token refused token {token} {self.text([token])!r}"
        stop = self.backend().vocabulary.stop_token_ids
        allowed = self.allowed(matcher, f"{spec.kind}: after all of {text!r}")
        assert all(allowed[s] for s in stop), f"{spec.kind}: stop tokens {stop} not all allowed after {text!r}"
        assert not matcher.is_terminated(), f"{spec.kind}: is_terminated() before the stop token"
        assert matcher.accept_token(stop[0]) and matcher.is_terminated(), \
            f"{spec.kind}: not terminated after accepting stop token {stop[0]} after {text!r}"
        return matcher

    # ---- the tests -------------------------------------------------------------------------

    @pytest.mark.parametrize("name", list(SCHEMAS))
    def test_json_schema_walks_give_valid_json(self, name: str) -> None:
        """Random walks through a schema give JSON that satisfies it (checked with jsonschema)."""
        jsonschema = pytest.importorskip("jsonschema")
        schema = SCHEMAS[name]
        spec = GrammarSpec.json_schema(schema)
        check = schema if self.enforces_number_bounds else without_number_bounds(schema)
        for seed in self.seeds:
            walk = self.walk(spec, seed)
            text = self.text(walk.tokens)
            try:  # raw control characters in strings: test_json_strings_refuse_raw_control_characters
                document = json.loads(text, strict=False)
            except json.JSONDecodeError as exc:
                raise AssertionError(f"{name}, seed {seed}: the output is not JSON ({exc}): {text!r}") from None
            errors = [e.message for e in jsonschema.Draft202012Validator(check).iter_errors(document)]
            assert not errors, f"{name}, seed {seed}: {text!r} does not satisfy the schema: {errors}"

    @pytest.mark.parametrize("name", list(SCHEMAS))
    def test_json_schema_accepts_a_valid_document(self, name: str) -> None:
        """Every token of a valid document is allowed and accepted, then a stop token ends it."""
        self.accept_all(GrammarSpec.json_schema(SCHEMAS[name]), VALID_DOCUMENTS[name])

    @pytest.mark.parametrize("where", ["plain", "maxLength"])
    def test_json_strings_refuse_raw_control_characters(self, where: str) -> None:
        """JSON strings hold no raw U+0000..U+001F (RFC 8259), length-constrained or not."""
        schema = {"type": "object", "properties": {"s": {"type": "string"} if where == "plain" else
                                                   {"type": "string", "maxLength": 8}},
                  "required": ["s"], "additionalProperties": False}
        spec = GrammarSpec.json_schema(schema)
        tokenizer = self.backend().vocabulary.tokenizer
        control = {i: text for i in range(len(tokenizer))
                   if len(text := self.text([i])) == 1 and ord(text) < 0x20}
        assert len(control) >= 20, "kit self-check: the tokenizer should have a token per control character"
        matcher = self.matcher(spec)
        for token in tokenizer.encode('{"s": "a', add_special_tokens=False):
            assert matcher.accept_token(token)
        allowed = self.allowed(matcher, f"{where} string")
        raw = [repr(text) for i, text in control.items() if allowed[i]]
        assert not raw, f"inside a {where} JSON string, raw control characters are allowed: {', '.join(raw)}"

    @pytest.mark.parametrize("name", list(REGEXES))
    def test_regex_walks_match_and_valid_text_is_accepted(self, name: str) -> None:
        """Random walks through a regex give text it fully matches; a matching text is accepted."""
        pattern, example = REGEXES[name]
        spec = GrammarSpec("regex", pattern)
        for seed in self.seeds:
            text = self.text(self.walk(spec, seed).tokens)
            assert re.fullmatch(pattern, text), f"regex {pattern!r}, seed {seed}: {text!r} does not match"
        self.accept_all(spec, example)

    def test_ebnf_walks_match_and_valid_text_is_accepted(self) -> None:
        """The same for a GBNF grammar (unless supports_ebnf is False: compile refuses it)."""
        grammar, equivalent, example = EBNF
        spec = GrammarSpec("ebnf", grammar)
        if not self.supports_ebnf:
            with pytest.raises(GrammarError):
                self.backend().compile(spec)
            return
        for seed in self.seeds:
            text = self.text(self.walk(spec, seed).tokens)
            assert re.fullmatch(equivalent, text), f"ebnf, seed {seed}: {text!r} is not in the grammar's language"
        self.accept_all(spec, example)

    @pytest.mark.parametrize("kind", list(INVALID))
    def test_invalid_grammars_raise_grammar_error(self, kind: str) -> None:
        """compile() raises GrammarError (a ValueError) naming the problem.

        For kind ebnf, on any grammar when the backend does not support EBNF."""
        backend = self.backend()
        specs = [GrammarSpec(kind, value) for value in INVALID[kind]]
        if kind == "ebnf" and not self.supports_ebnf:
            specs.append(GrammarSpec("ebnf", EBNF[0]))
        for spec in specs:
            try:
                backend.compile(spec)
            except GrammarError as exc:
                assert str(exc), f"invalid {kind} {spec.value!r}: GrammarError without a message"
            except Exception as exc:
                raise AssertionError(f"invalid {kind} {spec.value!r}: raised {type(exc).__name__} ({exc}), "
                                     "not srv.sdk.grammar.GrammarError") from None
            else:
                raise AssertionError(f"invalid {kind} {spec.value!r} compiled without an error")

    def test_rollback_restores_earlier_masks(self) -> None:
        """rollback(k) returns to the state k accepted tokens earlier.

        The stop token counts as one; rollback(0) changes nothing; the same tokens are then
        accepted again."""
        spec = GrammarSpec.json_schema(NESTED_OBJECT)
        walk = self.walk(spec, seed=7, check_forbidden=False)
        assert walk.stopped and len(walk.tokens) >= 8, "kit self-check: the walk is too short"
        stop = self.backend().vocabulary.stop_token_ids[0]
        matcher = self.matcher(spec)
        for token in walk.tokens:
            assert matcher.accept_token(token), "a token accepted once was refused by a fresh matcher"
        assert matcher.accept_token(stop) and matcher.is_terminated()
        matcher.rollback(1)
        assert not matcher.is_terminated(), "rollback(1) after the stop token: still is_terminated()"
        position = len(walk.tokens)
        assert torch.equal(self.allowed(matcher, "rollback over the stop token"), walk.masks[position]), \
            "rollback(1) after the stop token: the allowed set differs from before the stop token"
        matcher.rollback(0)
        assert torch.equal(self.allowed(matcher, "rollback(0)"), walk.masks[position]), "rollback(0) changed the state"
        for k in (1, 3, 2, len(walk.tokens) - 6):
            matcher.rollback(k)
            position -= k
            assert torch.equal(self.allowed(matcher, f"rollback({k})"), walk.masks[position]), \
                f"rollback({k}) to {self.text(walk.tokens[:position])!r}: the allowed set differs from before"
            for token in walk.tokens[position:position + 1]:   # one step forward again
                assert matcher.accept_token(token), f"after rollback({k}): token {token} refused"
                position += 1
        matcher.rollback(position)
        assert torch.equal(self.allowed(matcher, "rollback to the start"), walk.masks[0]), \
            f"rollback({position}) to the start: the allowed set differs from a fresh matcher's"
        for token in walk.tokens:
            assert matcher.accept_token(token), "after rolling back everything, the same tokens were refused"
        assert matcher.accept_token(stop) and matcher.is_terminated()

    def test_termination(self) -> None:
        """Stop tokens are refused until the grammar is complete, then all allowed; none follows one.

        is_terminated() only after a stop token is accepted, and then nothing is accepted."""
        vocabulary = self.backend().vocabulary
        spec = GrammarSpec("regex", r"[a-z]{2,4}")
        matcher = self.matcher(spec)
        tokens = vocabulary.tokenizer.encode("ab", add_special_tokens=False)
        assert not any(self.allowed(matcher, "start")[s] for s in vocabulary.stop_token_ids), \
            "a stop token is allowed before the grammar is complete"
        for stop in vocabulary.stop_token_ids:
            assert matcher.accept_token(stop) is False, f"stop token {stop} accepted before the grammar is complete"
        for token in tokens:
            assert matcher.accept_token(token)
        for stop in vocabulary.stop_token_ids:
            assert self.allowed(matcher, "complete")[stop], \
                f"stop token {stop} not allowed once the grammar is complete"
        assert not matcher.is_terminated(), "is_terminated() before a stop token was accepted"
        last = vocabulary.stop_token_ids[-1]
        assert matcher.accept_token(last) and matcher.is_terminated(), \
            f"not is_terminated() after accepting stop token {last}"
        assert matcher.accept_token(tokens[0]) is False, "a token was accepted after the stop token"
        assert matcher.is_terminated()

    def test_matchers_of_one_compiled_grammar_are_independent(self) -> None:
        """Matchers of one compiled grammar do not see each other's tokens.

        The core shares compiled grammars between requests."""
        backend = self.backend()
        compiled = backend.compile(GrammarSpec.json_schema(ENUM))
        first, second = backend.matcher(compiled), backend.matcher(compiled)
        fresh = self.allowed(second, "fresh")
        for token in backend.vocabulary.tokenizer.encode('{"color": "red"', add_special_tokens=False):
            assert first.accept_token(token)
        assert not torch.equal(self.allowed(first, "advanced"), fresh), "kit self-check: the mask should change"
        assert torch.equal(self.allowed(second, "untouched"), fresh), \
            "accepting tokens in one matcher changed another matcher of the same compiled grammar"
        third = backend.matcher(compiled)
        assert torch.equal(self.allowed(third, "new"), fresh), "a new matcher does not start at the grammar's start"


_BACKENDS: dict[tuple[type, GrammarOptions], GrammarBackend] = {}
