"""The grammar backends (xgrammar, llguidance, outlines) pass srv.sdk.testing.GrammarBackendKit,
the kit fails broken backends, and the three backends agree on real vocabularies."""

from __future__ import annotations

import json

import pytest
import torch

for _package in ("xgrammar", "llguidance", "outlines_core"):   # the `grammar` extra
    pytest.importorskip(_package)

from srv.plugins.grammar.llguidance_backend import LLGuidanceBackend, LLGuidanceMatcher  # noqa: E402
from srv.plugins.grammar.outlines_backend import OutlinesBackend, token_bytes  # noqa: E402
from srv.sdk.grammar import (GrammarError, GrammarOptions, GrammarSpec, GrammarVocabulary,  # noqa: E402
                             allocate_bitmask, bitmask_to_bool)
from srv.sdk.testing import GrammarBackendKit  # noqa: E402
from srv.sdk.testing.grammar import CORPUS, NESTED_OBJECT, byte_level_tokenizer  # noqa: E402

# ---- every built-in backend passes the kit ---------------------------------------------------


class TestXGrammar(GrammarBackendKit):
    backend_name = "xgrammar"

    @pytest.mark.parametrize("where", ["plain", pytest.param("maxLength", marks=pytest.mark.xfail(
        strict=True, reason="xgrammar 0.2.9: a string with maxLength is [^\"\\\\\\r\\n]{0,n}, raw controls allowed"))])
    def test_json_strings_refuse_raw_control_characters(self, where: str) -> None:
        super().test_json_strings_refuse_raw_control_characters(where)


class TestLLGuidance(GrammarBackendKit):
    backend_name = "llguidance"


class TestOutlines(GrammarBackendKit):
    backend_name = "outlines"
    supports_ebnf = False
    enforces_number_bounds = False   # outlines-core ignores bounds; srv enforces only small integer ranges (as enums)


def test_grammar_backends_are_registered_by_priority():
    from srv.plugin_manager import load_plugins

    registry = load_plugins()[1]
    names = {r.name: r for r in registry.registrations("grammar")}
    assert {"xgrammar", "llguidance", "outlines", "none"} <= set(names)
    priorities = [names[n].priority for n in ("xgrammar", "llguidance", "outlines", "none")]
    assert priorities == sorted(priorities, reverse=True) and len(set(priorities)) == 4
    assert registry.choose("grammar", "auto").name == "xgrammar"


# ---- and the kit fails broken backends ---------------------------------------------------------
# Each is llguidance (which passes every check) with one bug.


def kit(factory) -> GrammarBackendKit:
    return type("KitOnBrokenBackend", (GrammarBackendKit,), {"backend_factory": staticmethod(factory)})()


def assert_kit_fails(test, *args) -> str:
    with pytest.raises(AssertionError) as failure:
        test(*args)
    return str(failure.value)


class AcceptsForbiddenTokens(LLGuidanceMatcher):
    def accept_token(self, token_id):
        super().accept_token(token_id)
        return True


class ORsIntoTheRow(LLGuidanceMatcher):
    """Sets the allowed bits without clearing the others."""

    def fill_bitmask(self, bitmask, row):
        mine = torch.zeros_like(bitmask)
        super().fill_bitmask(mine, row)
        bitmask[row] |= mine[row]


class FillsEveryRow(LLGuidanceMatcher):
    def fill_bitmask(self, bitmask, row):
        for r in range(bitmask.shape[0]):
            super().fill_bitmask(bitmask, r)


class IgnoresRollback(LLGuidanceMatcher):
    def rollback(self, num_tokens):
        pass


class TerminatesWhenComplete(LLGuidanceMatcher):
    """is_terminated() as soon as the grammar is complete, as LLMatcher.is_stopped() would say."""

    def is_terminated(self):
        return super().is_terminated() or self._matcher.is_stopped()


def broken(matcher_class):
    class Broken(LLGuidanceBackend):
        def matcher(self, compiled):
            return matcher_class(compiled.deep_copy(), self._stop_token_ids, self.vocabulary.vocab_size)
    return Broken


class RaisesValueError(LLGuidanceBackend):
    def compile(self, spec):
        try:
            return super().compile(spec)
        except GrammarError as exc:
            raise ValueError(str(exc)) from None


class SharesOneMatcher(LLGuidanceBackend):
    """Hands every request the same matcher of a compiled grammar."""

    def matcher(self, compiled):
        shared = self.__dict__.setdefault("shared", {})
        if id(compiled) not in shared:
            shared[id(compiled)] = super().matcher(compiled)
        return shared[id(compiled)]


def test_grammar_kit_fails_broken_backends():
    message = assert_kit_fails(kit(broken(AcceptsForbiddenTokens)).test_json_schema_walks_give_valid_json, "enum")
    assert "did not return False for a forbidden token" in message
    message = assert_kit_fails(kit(broken(ORsIntoTheRow)).test_json_schema_accepts_a_valid_document, "array")
    assert "ids past the tokenizer" in message
    assert "changed row 0" in assert_kit_fails(kit(broken(FillsEveryRow)).test_termination)
    message = assert_kit_fails(kit(broken(IgnoresRollback)).test_rollback_restores_earlier_masks)
    assert "rollback(1) after the stop token" in message
    message = assert_kit_fails(kit(broken(TerminatesWhenComplete)).test_json_schema_accepts_a_valid_document, "enum")
    assert "is_terminated() before the stop token" in message
    message = assert_kit_fails(kit(RaisesValueError).test_invalid_grammars_raise_grammar_error, "regex")
    assert "not srv.sdk.grammar.GrammarError" in message
    message = assert_kit_fails(kit(SharesOneMatcher).test_matchers_of_one_compiled_grammar_are_independent)
    assert "changed another matcher" in message
    kit(broken(IgnoresRollback)).test_termination()  # the other checks still hold


# ---- the three backends agree on real vocabularies ----------------------------------------------

SCHEMA = {"type": "object",
          "properties": {"name": {"type": "string"}, "age": {"type": "integer"},
                         "tags": {"type": "array", "items": {"type": "string"}}, "ok": {"type": "boolean"}},
          "required": ["name", "age", "tags", "ok"], "additionalProperties": False}
DOCUMENT = '{"name": "Ada Lovelace ☃", "age": 36, "tags": ["math", "poetry\\n"], "ok": true}'
WRONG = '{"name": "Ada", "age": "36", "tags": [], "ok": true}'   # age is a string
BACKENDS = {"xgrammar": None, "llguidance": LLGuidanceBackend, "outlines": OutlinesBackend}


def byte_fallback_tokenizer():
    """A SentencePiece-style BPE (Llama's normalizer and decoder: "▁" for a space, "<0xC3>" byte
    tokens for what its pieces lack), built in code."""
    from tokenizers import Tokenizer, decoders, models, normalizers, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tokenizer = Tokenizer(models.BPE(unk_token="<unk>"))
    tokenizer.normalizer = normalizers.Sequence([normalizers.Prepend("▁"), normalizers.Replace(" ", "▁")])
    tokenizer.pre_tokenizer = pre_tokenizers.Split("▁", behavior="merged_with_next")
    tokenizer.decoder = decoders.Sequence([decoders.Replace("▁", " "), decoders.ByteFallback(), decoders.Fuse(),
                                           decoders.Strip(" ", 1, 0)])
    trainer = trainers.BpeTrainer(vocab_size=300, special_tokens=["<unk>", "<s>", "</s>"], show_progress=False)
    tokenizer.train_from_iterator([text.encode("ascii", "ignore").decode() for text in CORPUS] * 8, trainer)
    data = json.loads(tokenizer.to_str())
    for byte in range(256):
        data["model"]["vocab"].setdefault(f"<0x{byte:02X}>", len(data["model"]["vocab"]))
    data["model"]["byte_fallback"] = True
    return PreTrainedTokenizerFast(tokenizer_object=Tokenizer.from_str(json.dumps(data)), unk_token="<unk>",
                                   bos_token="<s>", eos_token="</s>")


def continuation_ids(tokenizer, text: str) -> list[int]:
    """`text`'s tokens as generated after other text (no SentencePiece "▁" prepended to it)."""
    ids = tokenizer.encode("\n" + text, add_special_tokens=False)
    head = tokenizer.convert_ids_to_tokens(ids[:2])
    if head == ["▁", "<0x0A>"]:
        ids = ids[2:]
    else:
        ids = tokenizer.encode(text, add_special_tokens=False)
    assert tokenizer.decode(ids) == text
    return ids


@pytest.fixture(scope="module", params=["smollm2", "byte_fallback"])
def vocabulary(request) -> GrammarVocabulary:
    if request.param == "smollm2":
        from transformers import AutoTokenizer

        tokenizer = AutoTokenizer.from_pretrained(request.getfixturevalue("default_model_dir"))
        return GrammarVocabulary(tokenizer, 49152, [tokenizer.eos_token_id])
    tokenizer = byte_fallback_tokenizer()
    return GrammarVocabulary(tokenizer, len(tokenizer) + 7, [tokenizer.eos_token_id])


@pytest.fixture(scope="module")
def backends(vocabulary):
    from srv.plugins.grammar.xgrammar_backend import XGrammarBackend

    factories = dict(BACKENDS, xgrammar=XGrammarBackend)
    return {name: factory(vocabulary, GrammarOptions()) for name, factory in factories.items()}


def first_refused(backend, spec: GrammarSpec, tokens: list[int], stop: int) -> int | None:
    """The index of the first token the backend's mask forbids or its matcher refuses (len(tokens)
    stands for the stop token), or None when all of them and then the stop token are accepted."""
    matcher = backend.matcher(backend.compile(spec))
    bitmask = allocate_bitmask(1, backend.vocabulary.vocab_size)
    for i, token in enumerate([*tokens, stop]):
        matcher.fill_bitmask(bitmask, 0)
        allowed = bool(bitmask_to_bool(bitmask, backend.vocabulary.vocab_size)[0, token])
        accepted = matcher.accept_token(token)
        assert allowed == accepted, f"token {i} ({token}): the mask says {allowed}, accept_token says {accepted}"
        if not accepted:
            return i
    assert matcher.is_terminated()
    return None


def test_backends_agree_on_a_document(backends, vocabulary):
    """Every backend accepts the tokens of a valid document, then the stop token; and refuses an
    invalid one at the same token."""
    tokenizer, stop = vocabulary.tokenizer, vocabulary.stop_token_ids[0]
    spec = GrammarSpec.json_schema(SCHEMA)
    good, wrong = continuation_ids(tokenizer, DOCUMENT), continuation_ids(tokenizer, WRONG)
    assert {name: first_refused(b, spec, good, stop) for name, b in backends.items()} == dict.fromkeys(backends)
    refused = {name: first_refused(b, spec, wrong, stop) for name, b in backends.items()}
    assert len(set(refused.values())) == 1 and None not in refused.values(), refused
    assert '"age": "' in tokenizer.decode(wrong[:refused["xgrammar"] + 1]), "refused elsewhere than at the quote"


def test_outlines_token_bytes(vocabulary):
    """Byte-level ("Ġ", "Ċ") and byte-fallback ("▁", "<0x0A>") tokens become the bytes they stand
    for; special tokens have none."""
    tokenizer = vocabulary.tokenizer
    data = token_bytes(tokenizer, vocabulary.vocab_size, exclude=set())
    for text in ('{"name": "café"}\n', "x ☃ 12.5"):
        ids = continuation_ids(tokenizer, text)
        assert b"".join(data[i] for i in ids) == text.encode()
    assert not set(tokenizer.all_special_ids) & set(data)


# ---- backend specifics ---------------------------------------------------------------------------


def kit_vocabulary() -> GrammarVocabulary:
    tokenizer = byte_level_tokenizer()
    return GrammarVocabulary(tokenizer, len(tokenizer) + 45, [tokenizer.convert_tokens_to_ids("<|im_end|>")])


def accepts(backend, spec: GrammarSpec, text: str) -> bool:
    tokenizer = backend.vocabulary.tokenizer
    matcher = backend.matcher(backend.compile(spec))
    return all(matcher.accept_token(t) for t in tokenizer.encode(text, add_special_tokens=False)) \
        and matcher.accept_token(backend.vocabulary.stop_token_ids[0])


@pytest.mark.parametrize("backend_class", [LLGuidanceBackend, OutlinesBackend])
def test_json_whitespace_options(backend_class):
    spec = GrammarSpec.json_schema({"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"]})
    texts = ['{"a":1}', '{"a": 1}', '{"a":\n1}']
    cases = {GrammarOptions(): [True, True, backend_class is LLGuidanceBackend],  # outlines' default: [ ]?
             GrammarOptions(disable_any_whitespace=True): [True, False, False],
             GrammarOptions(whitespace_pattern=r"\n?"): [True, False, True]}
    for options, expected in cases.items():
        backend = backend_class(kit_vocabulary(), options)
        assert [accepts(backend, spec, text) for text in texts] == expected, options


def test_outlines_works_around_delayed_matches():
    """outlines-core's Index drops a token that crosses the end of a match without ending on one
    ("." after "36" under a decimal regex, the second alternative of a|ab); the backend allows them."""
    from outlines_core import Index, Vocabulary

    tokenizer = byte_level_tokenizer()
    dot, number = tokenizer.convert_tokens_to_ids("."), tokenizer.encode("36", add_special_tokens=False)
    assert len(number) == 1
    regex = r"-?(0|[1-9][0-9]{0,4})(\.[0-9]{1,3})?"
    plain = Index(regex, Vocabulary(10_000, {b".": [dot], b"36": number, b"5": [1000]}))
    after_number = plain.get_next_state(plain.get_initial_state(), number[0])
    assert dot not in plain.get_allowed_tokens(after_number), "outlines-core fixed this: drop the workaround?"
    backend = OutlinesBackend(kit_vocabulary(), GrammarOptions())
    assert accepts(backend, GrammarSpec("regex", regex), "36.5")
    alternatives = GrammarSpec("regex", "ab|abc")
    assert accepts(backend, alternatives, "abc") and accepts(backend, alternatives, "ab")
    assert accepts(backend, GrammarSpec("regex", "^(ab)*$"), "abab")


def test_outlines_rolls_back_past_its_guide_history():
    """A rollback longer than the Guide's history replays the tokens kept."""
    backend = OutlinesBackend(kit_vocabulary(), GrammarOptions())
    backend.max_rollback = 2
    compiled = backend.compile(GrammarSpec.json_schema(NESTED_OBJECT))
    tokens = byte_level_tokenizer().encode('{"name": "Ada", "address": {"city": "Paris", "zip": 75001}}',
                                           add_special_tokens=False)
    matcher, reference = backend.matcher(compiled), backend.matcher(compiled)
    assert all(matcher.accept_token(t) for t in tokens) and all(reference.accept_token(t) for t in tokens[:3])
    matcher.rollback(len(tokens) - 3)
    bitmask = allocate_bitmask(2, backend.vocabulary.vocab_size)
    matcher.fill_bitmask(bitmask, 0)
    reference.fill_bitmask(bitmask, 1)
    assert torch.equal(bitmask[0], bitmask[1])
    with pytest.raises(ValueError, match="only 3"):
        matcher.rollback(4)


def test_outlines_refuses_ebnf_by_name():
    with pytest.raises(GrammarError, match="EBNF"):
        OutlinesBackend(kit_vocabulary(), GrammarOptions()).compile(GrammarSpec("ebnf", 'root ::= "a"'))
