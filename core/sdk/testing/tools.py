"""Conformance kit for tool-call parsers (`--tool-call-parser`)."""

from __future__ import annotations

import json
from typing import Any, Callable

import pytest

from srv.sdk.tools import ToolCall, ToolCallParser
from srv.sdk.testing.registry import create

KIT_TOOLS: list[dict[str, Any]] = [
    {"type": "function", "function": {"name": "get_weather", "description": "Weather in a city",
                                      "parameters": {"type": "object", "properties": {"city": {"type": "string"}}}}},
    {"type": "function", "function": {"name": "search", "description": "Search the web",
                                      "parameters": {"type": "object", "properties": {"query": {"type": "string"}}}}},
]
# Arguments that trip naive parsers: markers, braces and quotes inside strings, nesting, unicode.
KIT_CALLS = [
    ToolCall("get_weather", json.dumps({"city": "Paris"})),
    ToolCall("search", json.dumps({"query": 'a "quoted" {brace} </tool_call> ü', "filters": {"year": [2024, 2025]}})),
]


def streamed(parser: ToolCallParser, text: str, piece: int) -> tuple[str, list[ToolCall]]:
    """Feed `text` in pieces; the content and the calls as a client would reassemble them."""
    stream = parser.stream()
    content, names, arguments = "", [], {}
    for i in range(0, len(text), piece):
        new_content, deltas = stream.feed(text[i:i + piece])
        content += new_content
        for delta in deltas:
            if delta.name is not None:
                assert delta.index == len(names), f"call {delta.index} named out of order or twice"
                names.append(delta.name)
            else:
                assert delta.index < len(names), "arguments streamed before their call was named"
            arguments[delta.index] = arguments.get(delta.index, "") + delta.arguments
    content += stream.finish()
    return content, [ToolCall(name, arguments.get(i, "")) for i, name in enumerate(names)]


def same_calls(found: list[ToolCall], expected: list[ToolCall]) -> bool:
    return [(c.name, json.loads(c.arguments)) for c in found] == [(c.name, json.loads(c.arguments)) for c in expected]


class ToolCallParserKit:
    """Checks a tool-call parser: the calls it writes (`format_calls`) parse back to the same
    calls, whole and streamed in pieces of any size (each call named once, in order, then its
    arguments); text around the calls stays content; text without calls is all content; the
    tools prompt names every tool.

        class TestMyParser(ToolCallParserKit):
            backend_name = "myformat"          # the name your plugin registers, or:
            # parser_factory = MyParser        # () -> ToolCallParser
    """

    backend_name: str | None = None
    parser_factory: Callable[[], ToolCallParser] | None = None

    def make_parser(self) -> ToolCallParser:
        return create(self, "tool_call_parser", "backend_name", "parser_factory")

    # ---- the tests -------------------------------------------------------------------------

    @pytest.mark.parametrize("piece", [1, 2, 5, 10_000])
    def test_written_calls_parse_back_whole_and_streamed(self, piece: int) -> None:
        parser = self.make_parser()
        text = parser.format_calls(KIT_CALLS)
        content, calls = parser.parse(text)
        assert same_calls(calls, KIT_CALLS), f"parse(format_calls(calls)) gave {calls}"
        assert content.strip() == "", f"no content expected around the calls, got {content!r}"
        content, calls = streamed(self.make_parser(), text, piece)
        assert same_calls(calls, KIT_CALLS), f"streamed in pieces of {piece}: {calls}"
        assert content.strip() == ""

    @pytest.mark.parametrize("piece", [1, 3, 10_000])
    def test_text_without_calls_is_all_content(self, piece: int) -> None:
        text = "No call here: 2 < 3, {braces} and \"quotes\"; <tool is not a marker."
        assert self.make_parser().parse(text) == (text, [])
        assert streamed(self.make_parser(), text, piece) == (text, [])

    def test_content_before_the_calls_is_kept(self) -> None:
        parser = self.make_parser()
        content, calls = parser.parse("Let me look that up. " + parser.format_calls(KIT_CALLS[:1]))
        assert content == "Let me look that up."
        assert same_calls(calls, KIT_CALLS[:1])

    def test_tools_prompt_names_every_tool(self) -> None:
        prompt = self.make_parser().tools_prompt(KIT_TOOLS)
        assert isinstance(prompt, str)
        for tool in KIT_TOOLS:
            assert tool["function"]["name"] in prompt, f"tools_prompt does not mention {tool['function']['name']}"
