"""Incremental detokenization for streaming: the text of a request's output as tokens arrive.

Each push decodes only a small window of ids (the prefix/read-offset method of vLLM and HF's
TextIteratorStreamer): `decode(ids[prefix:])` minus `decode(ids[prefix:read])` is the new text,
held back while it ends with "\\ufffd" (an incomplete multi-byte character). Text that could be
the start of a stop string is held back too, until the next tokens show whether it is one.

It is also srv's one stop-string matcher: the scheduler ends a request where its copy finds a
stop string, and the front end's copy, fed the same tokens, cuts the text at the same place.
"""

from __future__ import annotations

import logging
from typing import Any

from srv.sdk.sampling import SamplingParams

logger = logging.getLogger("srv.detokenizer")
# What one search of a stop_regex may take before the pattern is given up.
REGEX_TIMEOUT_S = 0.05

REPLACEMENT_CHAR = "\ufffd"


class IncrementalDetokenizer:
    """After all tokens and `finish()`, `text == tokenizer.decode(output_ids, skip_special_tokens=...)`,
    cut just before the first stop string if one matched.

    The prompt is deliberately not used as decode context: the invariant is decoding the output
    alone, and prompt context changes that text for some tokenizers (SentencePiece decoders drop
    the leading space of the first token only when it is first; a prompt ending in part of a
    UTF-8 character would merge with the output's bytes). Windows after the first start at a
    token that follows a complete character, so they decode exactly as the whole output does.
    """

    def __init__(self, tokenizer: Any, skip_special_tokens: bool = True, stop: list[str] | None = None,
                 min_tokens: int = 0, stop_regex: list[str] | None = None, keep_stop: bool = False) -> None:
        import regex

        self.tokenizer = tokenizer
        self.skip_special_tokens = skip_special_tokens
        self.stops = [s for s in (stop or []) if s]
        self.patterns = [regex.compile(pattern) for pattern in stop_regex or []]
        # Stop strings count only once this many tokens are out (SGLang's min_new_tokens).
        self.min_tokens = min_tokens
        self.keep_stop = keep_stop    # the text keeps what stopped it (SGLang's no_stop_trim)
        self.ids: list[int] = []
        self._prefix_offset = 0   # window start: decoding from here gives the context for new text
        self._read_offset = 0     # ids before this are in the emitted (or stop-pending) text
        self._pending = ""        # final text held back: it may be the start of a stop string
        self._text = ""
        self._stopped: str | None = None

    @classmethod
    def for_request(cls, tokenizer: Any, params: SamplingParams) -> "IncrementalDetokenizer":
        """The detokenizer of a request's output, stopping as its sampling parameters say (the
        scheduler's and the front end's copies are made here, so they match alike)."""
        return cls(tokenizer, stop=params.stop, min_tokens=params.min_new_tokens, stop_regex=params.stop_regex,
                   keep_stop=params.no_stop_trim)

    @property
    def text(self) -> str:
        return self._text

    @property
    def stopped(self) -> str | None:
        return self._stopped

    def push(self, new_ids: list[int]) -> str:
        """Feed newly generated token ids; return the text that became final (may be "")."""
        if self._stopped is not None:
            return ""
        self.ids.extend(new_ids)
        prefix_text, new_text = self._decode_window()
        if new_text.endswith(REPLACEMENT_CHAR) or not new_text.startswith(prefix_text):
            return ""
        delta = new_text[len(prefix_text):]
        # Ids that add no text (skipped special tokens) stay inside the window: a window opening on
        # them decodes as if it were the start of the text (a SentencePiece leading space dropped).
        if delta:
            self._prefix_offset = self._read_offset
        self._read_offset = len(self.ids)
        return self._release(delta, final=False)

    def finish(self) -> str:
        """The request ended: return the text still held back, an incomplete UTF-8 tail included."""
        if self._stopped is not None:
            return ""
        prefix_text, new_text = self._decode_window()
        self._prefix_offset = self._read_offset = len(self.ids)
        return self._release(new_text[len(prefix_text):], final=True)

    def _decode_window(self) -> tuple[str, str]:
        window = self.ids[self._prefix_offset:]
        n = self._read_offset - self._prefix_offset
        decode = self.tokenizer.decode
        prefix_text = decode(window[:n], skip_special_tokens=self.skip_special_tokens) if n else ""
        return prefix_text, decode(window, skip_special_tokens=self.skip_special_tokens)

    def _release(self, delta: str, final: bool) -> str:
        """Emit pending + delta up to a stop string or stop_regex match (ending the stream) or,
        unless final, up to the start of its longest tail that could still become one."""
        text = self._pending + delta
        active = len(self.ids) >= self.min_tokens
        if active and (self.stops or self.patterns):
            # Earliest match; at one position, the shortest (the one completed first).
            hits = [(i, len(s), s) for s in self.stops if (i := text.find(s)) >= 0]
            for pattern in self.patterns:
                match = self._search(pattern, text, partial=False)
                if match is not None and match.end() > match.start():
                    hits.append((match.start(), match.end() - match.start(), pattern.pattern))
            if hits:
                i, length, self._stopped = min(hits)
                end = i + length if self.keep_stop else i
                self._pending = ""
                self._text += text[:end]
                return text[:end]
        held = 0
        if active and not final:
            held = max((k for s in self.stops for k in range(min(len(s) - 1, len(text)), 0, -1)
                        if text.endswith(s[:k])), default=0)
            for pattern in self.patterns:
                match = self._search(pattern, text, partial=True)
                if match is not None and match.partial:
                    held = max(held, len(text) - match.start())
        out, self._pending = text[:len(text) - held], text[len(text) - held:]
        self._text += out
        return out

    def _search(self, pattern: Any, text: str, partial: bool) -> Any:
        """The first (possibly partial) match of a stop_regex. A pattern that takes longer than
        REGEX_TIMEOUT_S on this text (catastrophic backtracking) no longer stops the request."""
        try:
            return pattern.search(text, partial=partial, timeout=REGEX_TIMEOUT_S)
        except TimeoutError:
            logger.warning("stop_regex %r took more than %.2f s; it is ignored from now on", pattern.pattern,
                           REGEX_TIMEOUT_S)
            self.patterns = [p for p in self.patterns if p is not pattern]
            return None
