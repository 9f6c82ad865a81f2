"""What a grammar (constrained decoding) plugin receives and returns.

A request may carry one constraint (`GrammarSpec`): a JSON schema, a regular expression or an
EBNF grammar. The core asks the chosen `GrammarBackend` to compile it once (compiled grammars are
cached and shared between requests) and gives each request its own `GrammarMatcher`. Before each
sampling step the matcher writes the tokens it allows into a row of a packed bitmask (int32,
bit `t % 32` of word `t // 32` set when token `t` is allowed: the layout xgrammar, llguidance and
outlines-core share); after sampling it accepts the chosen token.
"""

from __future__ import annotations

import json
from abc import ABC, abstractmethod
from argparse import Namespace
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Literal

if TYPE_CHECKING:   # the HTTP process checks grammars without importing torch (seconds of launch)
    import torch

GrammarKind = Literal["json_schema", "regex", "ebnf"]
GRAMMAR_KINDS: tuple[str, ...] = ("json_schema", "regex", "ebnf")
ANY_JSON_OBJECT = '{"type": "object"}'


class GrammarError(ValueError):
    """The grammar is invalid or unsupported; the message names the problem (a 400 for the client)."""


@dataclass(frozen=True)
class GrammarSpec:
    """One request's constraint. `value` is the schema as JSON text, the regex, or the EBNF."""

    kind: GrammarKind
    value: str

    @classmethod
    def json_schema(cls, schema: str | dict[str, Any]) -> "GrammarSpec":
        return cls("json_schema", schema if isinstance(schema, str) else json.dumps(schema))

    def schema(self) -> Any:
        """The parsed JSON schema (kind json_schema only)."""
        try:
            return json.loads(self.value)
        except json.JSONDecodeError as exc:
            raise GrammarError(f"the JSON schema is not valid JSON: {exc}") from None


@dataclass
class GrammarVocabulary:
    """The served model's vocabulary, as grammar engines need it.

    tokenizer: the Hugging Face tokenizer; vocab_size: the width of the model's logits (it may
    exceed the tokenizer's, and the extra ids are never allowed); stop_token_ids: the tokens
    that end a request, allowed once the grammar is complete.
    """

    tokenizer: Any
    vocab_size: int
    stop_token_ids: list[int]


@dataclass(frozen=True)
class GrammarOptions:
    """Launch options every backend reads (`--constrained-json-*`, `--disable-outlines-disk-cache`)."""

    whitespace_pattern: str | None = None
    disable_any_whitespace: bool = False
    disable_disk_cache: bool = False

    @classmethod
    def from_args(cls, args: Namespace) -> "GrammarOptions":
        return cls(getattr(args, "constrained_json_whitespace_pattern", None),
                   bool(getattr(args, "constrained_json_disable_any_whitespace", False)),
                   bool(getattr(args, "disable_outlines_disk_cache", False)))


class GrammarMatcher(ABC):
    """One request's position in its grammar."""

    @abstractmethod
    def fill_bitmask(self, bitmask: torch.Tensor, row: int) -> None:
        """Write the allowed next tokens into `bitmask[row]` (every word of the row)."""

    @abstractmethod
    def accept_token(self, token_id: int) -> bool:
        """Advance by one token; False (and no change) when the grammar forbids it."""

    @abstractmethod
    def rollback(self, num_tokens: int) -> None:
        """Undo the last `num_tokens` accepted tokens (speculative decoding)."""

    @abstractmethod
    def is_terminated(self) -> bool:
        """The grammar is complete and a stop token was accepted: nothing more may follow."""


class GrammarBackend(ABC):
    """A constrained-decoding engine for one served vocabulary.

    `compile` may be slow: the core calls it once per distinct spec in each process that needs
    it (the HTTP process compiles to reject an invalid grammar with a 400 before queueing the
    request) and caches the result.
    """

    def __init__(self, vocabulary: GrammarVocabulary, options: GrammarOptions) -> None:
        self.vocabulary, self.options = vocabulary, options

    @abstractmethod
    def compile(self, spec: GrammarSpec) -> Any:
        """The compiled grammar for `spec`; raises `GrammarError` saying what is wrong (srv
        prefixes "invalid <kind>: ")."""

    @abstractmethod
    def matcher(self, compiled: Any) -> GrammarMatcher:
        """A fresh matcher at the start of a compiled grammar."""


def bitmask_words(vocab_size: int) -> int:
    return (vocab_size + 31) // 32


def allocate_bitmask(rows: int, vocab_size: int) -> torch.Tensor:
    """A bitmask with every token allowed in every row."""
    import torch

    return torch.full((rows, bitmask_words(vocab_size)), -1, dtype=torch.int32)


def bitmask_to_bool(bitmask: torch.Tensor, vocab_size: int) -> torch.Tensor:
    """[rows, words] packed bits -> [rows, vocab_size] booleans, True where allowed."""
    import torch

    bits = (bitmask.unsqueeze(-1) >> torch.arange(32, dtype=torch.int32)) & 1
    return bits.view(bitmask.shape[0], -1)[:, :vocab_size].bool()


def apply_bitmask(logits: torch.Tensor, bitmask: torch.Tensor) -> None:
    """Set the logits of disallowed tokens to -inf, in place (rows of logits match rows of bitmask)."""
    logits.masked_fill_(~bitmask_to_bool(bitmask, logits.shape[-1]), float("-inf"))
