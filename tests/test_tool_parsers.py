"""The tool-call formats beyond Hermes: the conformance kit for each, realistic outputs, every
way of splitting them into streamed pieces, and what happens to malformed calls."""

from __future__ import annotations

import functools
import json
import random

import pytest

from srv.plugin_manager import load_plugins
from srv.sdk.testing.tools import ToolCallParserKit
from srv.sdk.tools import ToolCall, text_until

NEW_PARSERS = ["llama3", "mistral", "pythonic", "deepseekv3", "kimi_k2", "qwen3_coder", "glm45", "gpt-oss"]


@functools.cache
def registration(name: str):
    return load_plugins()[1].choose("tool_call_parser", name)


def parser(name: str):
    return registration(name).create()


class TestLlama3(ToolCallParserKit):
    backend_name = "llama3"


class TestMistral(ToolCallParserKit):
    backend_name = "mistral"


class TestPythonic(ToolCallParserKit):
    backend_name = "pythonic"


class TestDeepSeekV3(ToolCallParserKit):
    backend_name = "deepseekv3"


class TestKimiK2(ToolCallParserKit):
    backend_name = "kimi_k2"


class TestQwen3Coder(ToolCallParserKit):
    backend_name = "qwen3_coder"


class TestGlm45(ToolCallParserKit):
    backend_name = "glm45"


class TestGptOss(ToolCallParserKit):
    backend_name = "gpt-oss"


# ---- streaming equals parsing, for any split -------------------------------------------------------


def stream_pieces(name: str, pieces: list[str], whole_content: str) -> tuple[str, list[ToolCall], list[ToolCall]]:
    """Feed `pieces`; the content, the calls reassembled from the deltas, and the stream's calls.
    Checks on the way that no content is sent that the whole output does not have there (a
    held-back marker's beginning, say)."""
    stream = parser(name).stream()
    content, names, arguments = "", [], {}
    for piece in pieces:
        new_content, deltas = stream.feed(piece)
        content += new_content
        assert whole_content.startswith(content), f"sent {content!r}, which the whole output does not begin with"
        for delta in deltas:
            if delta.name is not None:
                assert delta.index == len(names)
                names.append(delta.name)
            arguments[delta.index] = arguments.get(delta.index, "") + delta.arguments
    content += stream.finish()
    return content, [ToolCall(n, arguments.get(i, "")) for i, n in enumerate(names)], stream.calls


def splits(text: str, seed: int = 0) -> list[list[str]]:
    rng = random.Random(seed)
    ways = [[text[:i], text[i:]] for i in range(len(text) + 1)] + [list(text)]
    for _ in range(30):
        cuts = sorted(rng.sample(range(1, len(text)), min(len(text) - 1, rng.randint(2, 12))))
        ways.append([text[a:b] for a, b in zip([0, *cuts], [*cuts, len(text)])])
    return ways


def assert_streaming_matches_parse(name: str, text: str) -> None:
    stream = parser(name).stream()
    whole_content, _ = stream.feed(text)
    whole_content += stream.finish()
    parsed_content, parsed_calls = parser(name).parse(text)
    assert whole_content.strip() == parsed_content
    for pieces in splits(text):
        content, from_deltas, calls = stream_pieces(name, pieces, whole_content)
        assert content == whole_content, f"pieces {pieces!r}"
        assert from_deltas == parsed_calls == calls, f"pieces {pieces!r}"


def calls_of(found: list[ToolCall]) -> list[tuple[str, dict]]:
    return [(c.name, json.loads(c.arguments)) for c in found]


WEATHER_PARIS = ("get_weather", {"city": "Paris"})
ADD = ("add", {"a": 1, "b": 2})
NESTED = {"query": 'a "quoted" {brace} [x] (y) ; ü 日本', "filters": {"year": [2024, 2025], "exact": True, "none": None}}

# (parser, model output, content, calls)
OUTPUTS = [
    # Llama 3: the whole output, or after <|python_tag|>; ";" between calls.
    ("llama3", '{"name": "get_weather", "parameters": {"city": "Paris"}}', "", [WEATHER_PARIS]),
    ("llama3", '  {"type": "function", "name": "search", "parameters": ' + json.dumps(NESTED) + "}", "",
     [("search", NESTED)]),
    ("llama3", 'Let me check.<|python_tag|>{"name": "get_weather", "parameters": {"city": "Paris"}}; '
               '{"name": "add", "parameters": {"a": 1, "b": 2}}', "Let me check.", [WEATHER_PARIS, ADD]),
    ("llama3", '{"name": "add", "parameters": {"a": 1, "b": 2}} I added them.', "I added them.", [ADD]),
    ("llama3", '{"answer": 42} is the answer.', '{"answer": 42} is the answer.', []),
    ("llama3", 'The call would be {"name": "add", "parameters": {"a": 1, "b": 2}}.',
     'The call would be {"name": "add", "parameters": {"a": 1, "b": 2}}.', []),
    # Mistral: a JSON array after the marker, or NAME[ARGS]{...} per call.
    ("mistral", '[TOOL_CALLS] [{"name": "get_weather", "arguments": {"city": "Paris"}}, '
                '{"name": "add", "arguments": {"a": 1, "b": 2}, "id": "a1B2c3D4e"}]', "", [WEATHER_PARIS, ADD]),
    ("mistral", 'Sure [1]. [TOOL_CALLS] [{"name": "search", "arguments": ' + json.dumps(NESTED) + "}]", "Sure [1].",
     [("search", NESTED)]),
    ("mistral", '[TOOL_CALLS]get_weather[ARGS]{"city": "Paris"}[TOOL_CALLS]add[ARGS]{"a": 1, "b": 2}', "",
     [WEATHER_PARIS, ADD]),
    ("mistral", 'On it.[TOOL_CALLS]add[CALL_ID]x7Yz9AbC1[ARGS] {"a": 1, "b": 2}', "On it.", [ADD]),
    # Pythonic: a list of calls anywhere in the output, optionally in Llama 4's python tokens.
    ("pythonic", '[get_weather(city="Paris"), add(a=1, b=2)]', "", [WEATHER_PARIS, ADD]),
    ("pythonic", "I'll look it up: [search(query='a \"quoted\" {brace} [x] (y) ; ü 日本', "
                 "filters={'year': (2024, 2025), 'exact': True, 'none': None})]", "I'll look it up:",
     [("search", NESTED)]),
    ("pythonic", '<|python_start|>[get_time(), get_weather(city="Paris")]<|python_end|> Done.', "Done.",
     [("get_time", {}), WEATHER_PARIS]),
    ("pythonic", "See [the docs](https://example.com) and [1], or [f(x) for x in y].",
     "See [the docs](https://example.com) and [1], or [f(x) for x in y].", []),
    # DeepSeek V3: a section of calls, each a fenced JSON block.
    ("deepseekv3", "I'll check both cities.<｜tool▁calls▁begin｜><｜tool▁call▁begin｜>function<｜tool▁sep｜>get_weather\n"
                   '```json\n{"city": "Paris"}\n```<｜tool▁call▁end｜>\n<｜tool▁call▁begin｜>function<｜tool▁sep｜>search\n'
                   "```json\n" + json.dumps(NESTED | {"code": "```py\nx\n```"}, ensure_ascii=False)
     + "\n```<｜tool▁call▁end｜><｜tool▁calls▁end｜>", "I'll check both cities.",
     [WEATHER_PARIS, ("search", NESTED | {"code": "```py\nx\n```"})]),
    # Kimi K2: a section of calls named by ids.
    ("kimi_k2", "Let me add them. <|tool_calls_section_begin|> <|tool_call_begin|> functions.add:0 "
                '<|tool_call_argument_begin|> {"a": 1, "b": 2} <|tool_call_end|><|tool_call_begin|>functions.search:1'
                "<|tool_call_argument_begin|>" + json.dumps(NESTED) + "<|tool_call_end|><|tool_calls_section_end|>"
                " Then I will answer.", "Let me add them.  Then I will answer.", [ADD, ("search", NESTED)]),
    # Qwen3-Coder: XML parameters, values converted to JSON when they read as JSON.
    ("qwen3_coder", "Let me check.\n<tool_call>\n<function=get_weather>\n<parameter=city>\nParis\n</parameter>\n"
                    "</function>\n</tool_call>\n<tool_call>\n<function=configure>\n<parameter=count>\n3\n</parameter>\n"
                    "<parameter=verbose>\ntrue\n</parameter>\n<parameter=options>\n{\"depth\": [1, 2]}\n</parameter>\n"
                    "<parameter=note>\n2 < 3 and a </tool_call> inside\nsecond line\n</parameter>\n<parameter=id>\n"
                    '"007"\n</parameter>\n</function>\n</tool_call>', "Let me check.",
     [WEATHER_PARIS, ("configure", {"count": 3, "verbose": True, "options": {"depth": [1, 2]},
                                    "note": "2 < 3 and a </tool_call> inside\nsecond line", "id": "007"})]),
    # GLM-4.5: key/value tags.
    ("glm45", "I will search.\n<tool_call>search\n<arg_key>query</arg_key>\n<arg_value>café ☕ </tool_call> x</arg_value>\n"
              "<arg_key>limit</arg_key>\n<arg_value>5</arg_value>\n<arg_key>tags</arg_key>\n<arg_value>[\"a\", \"b\"]"
              "</arg_value>\n</tool_call><tool_call>add<arg_key>a</arg_key><arg_value>1</arg_value><arg_key>b</arg_key>"
              "<arg_value>2</arg_value></tool_call>", "I will search.",
     [("search", {"query": "café ☕ </tool_call> x", "limit": 5, "tags": ["a", "b"]}), ADD]),
    # gpt-oss: harmony messages; analysis is not content, final is.
    ("gpt-oss", "<|channel|>analysis<|message|>User asks weather in Paris. Call get_weather.<|end|>"
                "<|start|>assistant<|channel|>commentary to=functions.get_weather <|constrain|>json<|message|>"
                '{"city": "Paris"}<|call|>', "", [WEATHER_PARIS]),
    ("gpt-oss", "<|channel|>analysis<|message|>Easy: 1 + 2.<|end|><|start|>assistant<|channel|>final<|message|>"
                "It is 3 — <b>three</b>.<|return|>", "It is 3 — <b>three</b>.", []),
    ("gpt-oss", "<|channel|>commentary<|message|>Checking two things.<|end|><|start|>assistant to=functions.add"
                '<|channel|>commentary json<|message|>{"a": 1, "b": 2}<|call|><|start|>assistant<|channel|>commentary '
                "to=functions.search <|constrain|>json<|message|>" + json.dumps(NESTED), "Checking two things.",
     [ADD, ("search", NESTED)]),
    ("gpt-oss", "<|channel|>analysis to=browser.search code<|message|>{\"query\": \"x\"}<|call|>", "", []),
]


@pytest.mark.parametrize("name, output, content, calls", OUTPUTS)
def test_realistic_outputs_parse(name, output, content, calls):
    found_content, found = parser(name).parse(output)
    assert found_content == content
    assert calls_of(found) == calls


@pytest.mark.parametrize("name, output", [(o[0], o[1]) for o in OUTPUTS])
def test_streaming_any_split_gives_what_parse_gives(name, output):
    assert_streaming_matches_parse(name, output)


# ---- malformed calls ----------------------------------------------------------------------------------

# What SGLang would make of them, where streaming and parsing can agree on it: text the format
# does not take for calls stays content; inside a format's own markers, what is not a call is dropped.
MALFORMED = [
    # Llama 3: <|python_tag|> followed by a built-in tool's Python call: not a JSON call, content.
    ("llama3", '<|python_tag|>brave_search.call(query="x")', 'brave_search.call(query="x")', []),
    # Mistral: the marker followed by neither form is dropped.
    ("mistral", "[TOOL_CALLS] sorry, no tool fits.", "sorry, no tool fits.", []),
    ("mistral", '[TOOL_CALLS] [{"title": "no name"}, {"name": "add", "arguments": {"a": 1, "b": 2}}]', "", [ADD]),
    # Pythonic: a list that is not calls with literal keyword arguments is content, as written.
    ("pythonic", '[get_weather("Paris")]', '[get_weather("Paris")]', []),
    ("pythonic", '[run(cmd=__import__("os").system("ls"))]', '[run(cmd=__import__("os").system("ls"))]', []),
    ("pythonic", "Calling [get_weather(city='Par", "Calling [get_weather(city='Par", []),
    # DeepSeek V3: a call without its ```json fence has no arguments: dropped, the section too.
    ("deepseekv3", "<｜tool▁calls▁begin｜><｜tool▁call▁begin｜>function<｜tool▁sep｜>get_weather {}<｜tool▁call▁end｜>"
                   "<｜tool▁calls▁end｜>After.", "After.", []),
    # Kimi K2: text between calls in the section is dropped.
    ("kimi_k2", "<|tool_calls_section_begin|>noise<|tool_call_begin|>functions.add:0<|tool_call_argument_begin|>"
                '{"a": 1, "b": 2}<|tool_call_end|><|tool_calls_section_end|>', "", [ADD]),
    # Qwen3-Coder: a block without a function is dropped; a missing </parameter> ends at </function>.
    ("qwen3_coder", "<tool_call>\nnothing here\n</tool_call>Text.", "Text.", []),
    ("qwen3_coder", "<tool_call>\n<function=get_weather>\n<parameter=city>\nParis\n</function>\n</tool_call>", "",
     [WEATHER_PARIS]),
    # GLM-4.5: a block without a name is dropped.
    ("glm45", "<tool_call>\n<arg_key>a</arg_key><arg_value>1</arg_value></tool_call>ok", "ok", []),
]


@pytest.mark.parametrize("name, output, content, calls", MALFORMED)
def test_malformed_calls(name, output, content, calls):
    found_content, found = parser(name).parse(output)
    assert found_content == content
    assert calls_of(found) == calls
    assert_streaming_matches_parse(name, output)


@pytest.mark.parametrize("name, output, arguments", [
    ("deepseekv3", "<｜tool▁calls▁begin｜><｜tool▁call▁begin｜>function<｜tool▁sep｜>add\n```json\n{\"a\": 1,}\n```"
                   "<｜tool▁call▁end｜><｜tool▁calls▁end｜>", '{"a": 1,}'),
    ("kimi_k2", "<|tool_calls_section_begin|><|tool_call_begin|>functions.add:0<|tool_call_argument_begin|>{\"a\": "
                "<|tool_call_end|><|tool_calls_section_end|>", '{"a":'),
])
def test_a_named_call_keeps_the_arguments_the_model_wrote(name, output, arguments):
    """A streamed name cannot be taken back, so a named call stands, with its arguments as
    written even when they are not JSON; parse says the same."""
    _, calls = parser(name).parse(output)
    assert [(c.name, c.arguments) for c in calls] == [("add", arguments)]


@pytest.mark.parametrize("name, piece, held", [
    ("deepseekv3", "Hi <｜tool▁calls▁be", "<｜tool▁calls▁be"),
    ("kimi_k2", "Hi <|tool_calls_sec", "<|tool_calls_sec"),
    ("qwen3_coder", "Hi <tool_ca", "<tool_ca"),
    ("glm45", "Hi <tool", "<tool"),
    ("gpt-oss", "Hi <|chan", "<|chan"),
    ("mistral", "Hi [TOOL_", "[TOOL_"),
    ("llama3", "Hi <|python_t", "<|python_t"),
    ("pythonic", "Hi [get_weather", "[get_weather"),
    ("pythonic", "Hi <|python_st", "<|python_st"),
    ("llama3", '{"name": "get_wea', '{"name": "get_wea'),
])
def test_a_partial_marker_is_held_back_until_it_is_known(name, piece, held):
    stream = parser(name).stream()
    assert stream.feed(piece) == (piece[:len(piece) - len(held)], [])
    assert stream.finish() == held      # it never became a marker: content after all


def test_calls_stream_their_name_first_then_arguments_in_pieces():
    output = OUTPUTS[[o[0] for o in OUTPUTS].index("qwen3_coder")][1]
    stream = parser("qwen3_coder").stream()
    deltas = [d for ch in output for d in stream.feed(ch)[1]]
    assert [d.name for d in deltas if d.name] == ["get_weather", "configure"]
    assert len([d for d in deltas if d.index == 1 and d.name is None]) >= 5, "one piece per parameter at least"
    stream = parser("deepseekv3").stream()
    output = OUTPUTS[[o[0] for o in OUTPUTS].index("deepseekv3")][1]
    pieces = [d.arguments for ch in output for d in stream.feed(ch)[1] if d.index == 1 and d.name is None]
    assert len(pieces) > 10 and "".join(pieces) == stream.calls[1].arguments


def test_pythonic_calls_arrive_whole_when_the_list_closes():
    stream = parser("pythonic").stream()
    assert stream.feed('[get_weather(city="Paris"), add(a=1') == ("", [])
    _, deltas = stream.feed(", b=2)]")
    assert [(d.index, d.name, json.loads(d.arguments)) for d in deltas] == [(0, *WEATHER_PARIS), (1, *ADD)]


@pytest.mark.parametrize("name", NEW_PARSERS)
def test_constrained_outputs_are_json_whatever_the_format(name):
    """tool_choice "required" and a named function constrain the output to JSON; every parser reads it."""
    _, calls = _feed_all(parser(name).stream(whole_output=True), '[{"name": "add", "arguments": {"a": 1, "b": 2}}]')
    assert calls_of(calls) == [ADD]
    _, calls = _feed_all(parser(name).stream(fixed_name="add", whole_output=True), '{"a": 1, "b": 2}')
    assert calls_of(calls) == [ADD]


def _feed_all(stream, text):
    content = "".join(stream.feed(ch)[0] for ch in text) + stream.finish()
    return content, stream.calls


@pytest.mark.parametrize("name", NEW_PARSERS)
def test_calls_written_back_keep_strings_that_look_like_json(name):
    calls = [ToolCall("echo", json.dumps({"text": "42", "flag": "true", "empty": "", "nl": "\nx\n", "n": 1.5}))]
    p = parser(name)
    assert calls_of(p.parse(p.format_calls(calls))[1]) == calls_of(calls)


# Pieces of each format, joined at random into outputs well-formed or not.
FRAGMENTS = {
    "llama3": ['<|python_tag|>', '{"name": "a", "parameters": ', '{"x": 1}', "}", ";", " ", "text", "{", '"', "\\"],
    "mistral": ["[TOOL_CALLS]", " [", '{"name": "a", "arguments": ', '{"x": "]"}', "}", "]", ",", "add", "[ARGS]",
                "[CALL_ID]", "x"],
    "pythonic": ["[", "f(", "a=1", ", ", ")", "]", "'s'", '"', "<|python_start|>", "<|python_end|>", "text", '"""'],
    "deepseekv3": ["<｜tool▁calls▁begin｜>", "<｜tool▁call▁begin｜>", "function", "<｜tool▁sep｜>", "name", "\n```json\n",
                   '{"a": 1}', "\n```", "<｜tool▁call▁end｜>", "<｜tool▁calls▁end｜>", "x", "<"],
    "kimi_k2": ["<|tool_calls_section_begin|>", "<|tool_call_begin|>", "functions.f:0", "<|tool_call_argument_begin|>",
                '{"a": 1}', "<|tool_call_end|>", "<|tool_calls_section_end|>", "x", "<|"],
    "qwen3_coder": ["<tool_call>", "</tool_call>", "<function=f>", "</function>", "<parameter=a>", "</parameter>", "\n",
                    "1", "x", "<"],
    "glm45": ["<tool_call>", "</tool_call>", "f", "\n", "<arg_key>", "</arg_key>", "<arg_value>", "</arg_value>", "2", "<"],
    "gpt-oss": ["<|start|>", "assistant", "<|channel|>", "final", "analysis", "commentary", " to=functions.f",
                "<|message|>", '{"a": 1}', "<|end|>", "<|call|>", "<|return|>", "x", "<|"],
}


@pytest.mark.parametrize("name", NEW_PARSERS)
def test_streaming_matches_parse_on_random_outputs(name):
    rng = random.Random(name)
    for _ in range(25):
        text = "".join(rng.choice(FRAGMENTS[name]) for _ in range(rng.randint(1, 14)))
        stream = parser(name).stream()
        whole_content, _ = stream.feed(text)
        whole_content += stream.finish()
        _, calls = parser(name).parse(text)
        for pieces in [list(text), *splits(text, rng.randrange(1000))[::9]]:
            content, from_deltas, streamed_calls = stream_pieces(name, pieces, whole_content)
            assert content == whole_content and from_deltas == calls == streamed_calls, f"{text!r} in {pieces!r}"


def test_text_until_holds_back_a_possible_terminator():
    assert text_until("abc</par", 0, "</parameter>").text == "abc"
    assert text_until("abc</par", 0, "</parameter>", final=True).text == "abc</par"
    span = text_until("ab</x>cd</y>", 0, "</y>", "</x>")
    assert (span.text, span.end, span.marker, span.marker_start) == ("ab", 6, "</x>", 2)
