"""Conformance kit for reasoning parsers (`--reasoning-parser`)."""

from __future__ import annotations

from typing import Callable

import pytest

from srv.sdk.reasoning import ReasoningParser
from srv.sdk.testing.registry import create

# Reasoning and answers that trip naive parsers: markup, braces, blank lines, unicode.
KIT_SAMPLES = [
    ("The user wants 2 + 2.\n\nThat is 4; check: 4 - 2 = 2.", "2 + 2 = **4**."),
    ("Think about <b>tags</b>, {braces} and a < b.", "Done: ü, 日本, 🙂."),
    ("One line.", ""),
]


def streamed(parser: ReasoningParser, text: str, piece: int) -> tuple[str, str]:
    """(reasoning, content) of `text` fed to a stream in pieces of `piece` characters."""
    stream = parser.stream()
    reasoning = content = ""
    for i in range(0, len(text), piece):
        more_reasoning, more_content = stream.feed(text[i:i + piece])
        reasoning, content = reasoning + more_reasoning, content + more_content
    more_reasoning, more_content = stream.finish()
    return reasoning + more_reasoning, content + more_content


class ReasoningParserKit:
    """Checks a reasoning parser: outputs it writes (`format`) split back into the same
    reasoning and answer, whole and streamed in pieces of any size, with no part of a marker
    in either; an output cut inside the reasoning is all reasoning; and, unless the format's
    outputs start inside the reasoning, an output without it is all answer, unchanged.

        class TestMyParser(ReasoningParserKit):
            backend_name = "myformat"          # the name your plugin registers, or:
            # parser_factory = MyParser        # () -> ReasoningParser
    """

    backend_name: str | None = None
    parser_factory: Callable[[], ReasoningParser] | None = None

    def make_parser(self) -> ReasoningParser:
        return create(self, "reasoning_parser", "backend_name", "parser_factory")

    # ---- the tests -------------------------------------------------------------------------

    @pytest.mark.parametrize("piece", [1, 2, 3, 7, 10_000])
    @pytest.mark.parametrize("sample", range(len(KIT_SAMPLES)))
    def test_written_outputs_split_back_whole_and_streamed(self, sample: int, piece: int) -> None:
        parser = self.make_parser()
        reasoning, answer = KIT_SAMPLES[sample]
        text = parser.format(reasoning, answer)
        assert parser.parse(text) == (reasoning, answer), f"parse(format(...)) of {text!r}"
        assert streamed(self.make_parser(), text, piece) == (reasoning, answer), f"streamed in pieces of {piece}"

    @pytest.mark.parametrize("piece", [1, 4, 10_000])
    def test_an_output_cut_inside_the_reasoning_is_all_reasoning(self, piece: int) -> None:
        parser = self.make_parser()
        reasoning = KIT_SAMPLES[0][0]
        text = parser.format(reasoning, "the answer")
        cut = text[:text.index(parser.end_marker) + len(parser.end_marker) // 2]
        assert parser.parse(cut) == (reasoning, ""), f"an output ending in a partial end marker: {cut!r}"
        assert streamed(self.make_parser(), cut, piece) == (reasoning, "")

    @pytest.mark.parametrize("piece", [1, 3, 10_000])
    def test_an_output_without_reasoning_is_all_answer(self, piece: int) -> None:
        parser = self.make_parser()
        if parser.starts_in_reasoning:
            pytest.skip("this format's outputs start inside the reasoning")
        text = "No reasoning: 2 < 3, <b>bold</b>, {braces}.\n"
        assert parser.parse(text) == ("", text)
        assert streamed(self.make_parser(), text, piece) == ("", text)

    def test_the_stream_says_whether_it_is_inside_the_reasoning(self) -> None:
        parser = self.make_parser()
        text = parser.format("thinking", "answer")
        stream = parser.stream()
        stream.feed(text[:text.index(parser.end_marker)])
        assert stream.in_reasoning
        stream.feed(text[text.index(parser.end_marker):])
        assert not stream.in_reasoning
