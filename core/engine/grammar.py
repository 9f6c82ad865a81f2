"""Compiled grammars for the chosen `--grammar-backend`, cached and shared between requests."""

from __future__ import annotations

import collections
import logging
import threading
import time
from argparse import Namespace
from typing import Any

from srv.backend_registry import BackendRegistry, BackendUnavailable
from srv.sdk.grammar import (GrammarBackend, GrammarError, GrammarMatcher, GrammarOptions, GrammarSpec,
                             GrammarVocabulary)

logger = logging.getLogger("srv.grammar")
COMPILED_CACHE_SIZE = 256


class GrammarCompiler:
    """Builds the backend on first use (most servers never see a grammar) and keeps the most
    recently used compiled grammars. Thread-safe: srv.Engine's front end checks grammars on one
    thread while its scheduler compiles on another."""

    def __init__(self, args: Namespace, registry: BackendRegistry, tokenizer: Any, vocab_size: int,
                 stop_token_ids: list[int]) -> None:
        self.args, self.registry = args, registry
        self.vocabulary = GrammarVocabulary(tokenizer, vocab_size, list(stop_token_ids))
        self._backend: GrammarBackend | None = None
        self._compiled: collections.OrderedDict[GrammarSpec, Any] = collections.OrderedDict()
        self._lock = threading.Lock()

    @property
    def backend(self) -> GrammarBackend:
        if self._backend is None:
            if self.vocabulary.tokenizer is None:
                raise GrammarError("constrained decoding needs the tokenizer (--skip-tokenizer-init is set)")
            try:
                registration = self.registry.choose("grammar", self.args.grammar_backend)
            except BackendUnavailable as exc:
                raise GrammarError(f"constrained decoding is unavailable: {exc}") from None
            self._backend = registration.create(self.vocabulary, GrammarOptions.from_args(self.args))
            logger.info("grammar backend: %s", registration.name)
        return self._backend

    def check(self, spec: GrammarSpec) -> None:
        """Raise `GrammarError` when `spec` does not compile."""
        self._compile(spec)

    def matcher(self, spec: GrammarSpec) -> GrammarMatcher:
        return self.backend.matcher(self._compile(spec))

    def _compile(self, spec: GrammarSpec) -> Any:
        with self._lock:
            compiled = self._compiled.get(spec)
            if compiled is not None:
                self._compiled.move_to_end(spec)
                return compiled
            started = time.perf_counter()
            try:
                compiled = self.backend.compile(spec)
            except GrammarError as exc:
                raise GrammarError(f"invalid {spec.kind}: {exc}") from None
            logger.info("compiled a %s grammar in %.1f ms", spec.kind, (time.perf_counter() - started) * 1e3)
            self._compiled[spec] = compiled
            if len(self._compiled) > COMPILED_CACHE_SIZE:
                self._compiled.popitem(last=False)
            return compiled
