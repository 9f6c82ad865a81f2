"""What a reasoning parser plugin provides (`--reasoning-parser`).

Reasoning models think before they answer, between markers their chat template taught them:
`<think>...</think>` (DeepSeek-R1, Qwen3, GLM-4.5), `◁think▷...◁/think▷` (Kimi), a harmony
analysis channel (gpt-oss). A parser names its markers; this base class splits an output into
the reasoning and the answer (`parse`), or a stream of pieces as they are generated (`stream`),
so that chat responses carry `reasoning_content` beside `content`.

Some templates open the reasoning in the prompt itself (DeepSeek-R1, Qwen3's thinking models):
the output then starts inside it, and everything before the end marker is reasoning whether or
not the model writes the start marker again (`starts_in_reasoning`). Otherwise an output is
reasoning only if it begins (after whitespace) with the start marker. An output that ends before
the end marker is all reasoning (less a beginning of the marker at its very end). Whitespace around the reasoning, and between the end marker and
the answer, belongs to neither.
"""

from __future__ import annotations

from abc import ABC

from srv.sdk.tools import partial_suffix


class ReasoningStream:
    """Splits a streamed output into reasoning and content as pieces arrive.

    feed(piece) -> (reasoning text, content text) that the piece made certain; finish() -> the
    same for what was held back. Joined, the pieces equal `ReasoningParser.parse` of the whole."""

    # Before knowing whether (or where) the reasoning starts; inside it; after its end marker but
    # before the answer's first non-blank character; in the answer.
    OPENING, REASONING, BETWEEN, ANSWER = "opening", "reasoning", "between", "answer"

    def __init__(self, parser: "ReasoningParser") -> None:
        self.parser = parser
        self.state = self.OPENING
        self._pending = ""                # text not yet given out
        self._reasoning_started = False   # whether reasoning text has been given out

    @property
    def in_reasoning(self) -> bool:
        return self.state in (self.OPENING, self.REASONING) and (self.parser.starts_in_reasoning
                                                                 or self.state == self.REASONING)

    def feed(self, piece: str) -> tuple[str, str]:
        self._pending += piece
        reasoning = content = ""
        while True:
            if self.state == self.OPENING:
                text, start = self._pending.lstrip(), self.parser.start_marker
                if text.startswith(start):
                    self._pending, self.state = text[len(start):], self.REASONING
                elif start.startswith(text):
                    return reasoning, content          # maybe the start marker: wait for more
                elif self.parser.starts_in_reasoning:
                    self._pending, self.state = text, self.REASONING
                else:
                    self.state = self.ANSWER           # no reasoning: the output is the answer as it is
            elif self.state == self.REASONING:
                if not self._reasoning_started:
                    self._pending = self._pending.lstrip()
                marker = self.parser.end_marker
                end = self._pending.find(marker)
                if end >= 0:
                    reasoning += self._give_reasoning(self._pending[:end].rstrip())
                    self._pending, self.state = self._pending[end + len(marker):], self.BETWEEN
                    continue
                # A possible beginning of the end marker waits, and so does trailing whitespace:
                # it belongs to the reasoning only if more reasoning follows.
                keep = partial_suffix(self._pending, marker)
                certain = self._pending[:len(self._pending) - keep].rstrip()
                reasoning += self._give_reasoning(certain)
                self._pending = self._pending[len(certain):]
                return reasoning, content
            elif self.state == self.BETWEEN:
                self._pending = self._pending.lstrip()
                if not self._pending:
                    return reasoning, content
                self.state = self.ANSWER
            else:
                content += self._pending
                self._pending = ""
                return reasoning, content

    def _give_reasoning(self, text: str) -> str:
        self._reasoning_started = self._reasoning_started or bool(text)
        return text

    def finish(self) -> tuple[str, str]:
        """What was held back, once the output has ended."""
        rest, self._pending = self._pending, ""
        if self.state == self.OPENING:
            # Blank, or a beginning of the start marker that never completed.
            return (rest.strip(), "") if self.parser.starts_in_reasoning else ("", rest)
        if self.state == self.REASONING:
            # The output ended inside the reasoning, perhaps partway through the end marker.
            rest = rest[:len(rest) - partial_suffix(rest, self.parser.end_marker)]
            return (rest.rstrip() if self._reasoning_started else rest.strip()), ""
        return "", rest


class ReasoningParser(ABC):
    """One reasoning format. Subclasses set the markers and whether outputs start inside the reasoning."""

    start_marker: str = "<think>"
    end_marker: str = "</think>"
    # Whether the chat template opens the reasoning in the prompt, so the output starts inside it.
    starts_in_reasoning: bool = False

    def parse(self, text: str) -> tuple[str, str]:
        """(reasoning, content) of a whole output."""
        stream = self.stream()
        reasoning, content = stream.feed(text)
        more_reasoning, more_content = stream.finish()
        return reasoning + more_reasoning, content + more_content

    def stream(self) -> ReasoningStream:
        return ReasoningStream(self)

    def format(self, reasoning: str, content: str) -> str:
        """An output with this reasoning and answer, as the model writes it (without the start
        marker when the prompt opened the reasoning)."""
        start = "" if self.starts_in_reasoning else self.start_marker
        return f"{start}\n{reasoning}\n{self.end_marker}\n\n{content}"
