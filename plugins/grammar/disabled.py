"""`--grammar-backend none`: constrained decoding off, as in SGLang."""

from __future__ import annotations

from typing import Any

from srv.sdk.grammar import GrammarBackend, GrammarError, GrammarMatcher, GrammarSpec


class DisabledGrammarBackend(GrammarBackend):
    def compile(self, spec: GrammarSpec) -> Any:
        raise GrammarError(f"constrained decoding is off (--grammar-backend none): a {spec.kind} "
                           "constraint cannot be served")

    def matcher(self, compiled: Any) -> GrammarMatcher:
        raise GrammarError("constrained decoding is off (--grammar-backend none)")
