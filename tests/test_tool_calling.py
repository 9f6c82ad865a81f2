"""Tool calling and structured output over HTTP with the official `openai` client, and the
tool-call parsers on their own."""

from __future__ import annotations

import json

import httpx
import jsonschema
import openai
import pytest

from srv.plugin_manager import load_plugins
from srv.sdk.testing.tools import streamed
from test_server import API_KEY, MODEL, Server, post, wait_until_idle

WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "Get the current weather in a city",
    "parameters": {"type": "object", "properties": {"city": {"type": "string", "maxLength": 30},
                                                    "unit": {"type": "string", "enum": ["celsius", "fahrenheit"]}},
                   "required": ["city", "unit"], "additionalProperties": False}}}
ADD = {"type": "function", "function": {
    "name": "add", "description": "Add two integers",
    "parameters": {"type": "object", "properties": {"a": {"type": "integer"}, "b": {"type": "integer"}},
                   "required": ["a", "b"], "additionalProperties": False}}}
TOOLS = [WEATHER, ADD]
SCHEMAS = {tool["function"]["name"]: tool["function"]["parameters"] for tool in TOOLS}
QUESTION = [{"role": "user", "content": "What is the weather like in Paris today?"}]


def parser(name: str):
    return load_plugins()[1].choose("tool_call_parser", name).create()


# ---- parsers ----------------------------------------------------------------------------------------

HERMES_OUTPUT = ('Let me check.\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris", "note": "a}b"}}\n'
                 '</tool_call>\n<tool_call>\n{"name": "add", "arguments": {"a": 1, "b": 2}}\n</tool_call>')
SMOLLM2_OUTPUT = '<tool_call>[{"name": "get_weather", "arguments": {"city": "Paris"}}, {"name": "add", "arguments": {"a": 1}}]</tool_call>'
EXPECTED_CALLS = [("get_weather", {"city": "Paris", "note": "a}b"}), ("add", {"a": 1, "b": 2})]


@pytest.mark.parametrize("name, output, content, calls", [
    ("hermes", HERMES_OUTPUT, "Let me check.", EXPECTED_CALLS),
    ("qwen25", HERMES_OUTPUT, "Let me check.", EXPECTED_CALLS),
    ("smollm2", SMOLLM2_OUTPUT, "", [("get_weather", {"city": "Paris"}), ("add", {"a": 1})]),
    ("hermes", "No tools needed: 3 < 4 and <tool is not a marker.", "No tools needed: 3 < 4 and <tool is not a marker.", []),
])
@pytest.mark.parametrize("piece", [1, 4, 1000])
def test_parsers_find_calls_whole_and_streamed(name, output, content, calls, piece):
    found_content, found = parser(name).parse(output)
    assert found_content == content
    assert [(c.name, json.loads(c.arguments)) for c in found] == calls
    streamed_content, streamed_calls = streamed(parser(name), output, piece)
    assert streamed_content.strip() == content
    assert [(c.name, json.loads(c.arguments)) for c in streamed_calls] == calls


def test_calls_written_back_parse_to_the_same_calls():
    for name in ("hermes", "smollm2"):
        p = parser(name)
        _, calls = p.parse(HERMES_OUTPUT)
        assert p.parse(p.format_calls(calls))[1] == calls
        assert "get_weather" in p.tools_prompt(TOOLS) and p.start_marker in p.tools_prompt(TOOLS)


# ---- over HTTP ----------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def server():
    server = Server("--api-key", API_KEY, "--tool-call-parser", "smollm2", "--grammar-backend", "xgrammar",
                    "--constrained-json-disable-any-whitespace")
    yield server
    server.stop()


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=f"{server.base}/v1", api_key=API_KEY)


def call_of(message) -> tuple[str, dict]:
    [call] = message.tool_calls[:1]
    assert call.type == "function" and call.id.startswith("call_")
    return call.function.name, json.loads(call.function.arguments)


@pytest.mark.parametrize("tool_choice, expected", [
    ("required", None),
    ({"type": "function", "function": {"name": "add"}}, "add"),
])
def test_required_and_named_tool_calls_parse_and_validate(client, tool_choice, expected):
    response = client.chat.completions.create(model=MODEL, messages=QUESTION, tools=TOOLS, tool_choice=tool_choice,
                                              temperature=0, max_tokens=64)
    choice = response.choices[0]
    assert choice.finish_reason == "tool_calls" and choice.message.content is None
    for call in choice.message.tool_calls:
        arguments = json.loads(call.function.arguments)
        jsonschema.validate(arguments, SCHEMAS[call.function.name])
    name, _ = call_of(choice.message)
    assert expected is None or name == expected


@pytest.mark.parametrize("tool_choice", ["required", {"type": "function", "function": {"name": "get_weather"}}])
def test_streamed_tool_calls_name_once_then_arguments_in_pieces(client, tool_choice):
    kwargs = dict(model=MODEL, messages=QUESTION, tools=TOOLS, tool_choice=tool_choice, temperature=0, max_tokens=64)
    whole = client.chat.completions.create(**kwargs).choices[0].message
    chunks = list(client.chat.completions.create(stream=True, **kwargs))
    deltas = [d for chunk in chunks if chunk.choices for d in (chunk.choices[0].delta.tool_calls or [])]
    named = [d for d in deltas if d.function.name]
    assert [d.function.name for d in named] == [c.function.name for c in whole.tool_calls]
    assert all(d.id and d.type == "function" for d in named)
    pieces = [d for d in deltas if not d.function.name]
    assert len(pieces) > 1, "arguments arrive in several pieces"
    arguments = {}
    for d in deltas:
        arguments[d.index] = arguments.get(d.index, "") + (d.function.arguments or "")
    assert [arguments[i] for i in sorted(arguments)] == [c.function.arguments for c in whole.tool_calls]
    assert chunks[-1].choices[0].finish_reason == "tool_calls"


def test_a_tool_result_round_trip(client):
    first = client.chat.completions.create(model=MODEL, messages=QUESTION, tools=TOOLS, temperature=0, max_tokens=64,
                                           tool_choice={"type": "function", "function": {"name": "get_weather"}})
    call = first.choices[0].message.tool_calls[0]
    conversation = QUESTION + [
        {"role": "assistant", "content": None, "tool_calls": [call.model_dump()]},
        {"role": "tool", "tool_call_id": call.id, "content": "It is 22 degrees and sunny."}]
    second = client.chat.completions.create(model=MODEL, messages=conversation, tools=TOOLS, temperature=0,
                                            max_tokens=24)
    assert second.choices[0].message.role == "assistant"
    assert second.usage.prompt_tokens > first.usage.prompt_tokens
    none = client.chat.completions.create(model=MODEL, messages=conversation, tools=TOOLS, tool_choice="none",
                                          temperature=0, max_tokens=8)
    assert none.choices[0].message.tool_calls is None and none.choices[0].message.content


def test_auto_tool_choice_answers_with_content_or_calls(client):
    response = client.chat.completions.create(model=MODEL, messages=QUESTION, tools=TOOLS, temperature=0, max_tokens=48)
    message = response.choices[0].message
    assert message.content or message.tool_calls
    for call in message.tool_calls or []:
        assert call.function.name in SCHEMAS
        json.loads(call.function.arguments)


def test_response_format_json_schema_and_json_object(client):
    schema = {"type": "object", "properties": {"name": {"type": "string", "maxLength": 20},
                                               "age": {"type": "integer", "minimum": 0, "maximum": 120}},
              "required": ["name", "age"], "additionalProperties": False}
    messages = [{"role": "user", "content": "Describe a person as JSON."}]
    response = client.chat.completions.create(
        model=MODEL, messages=messages, temperature=0, max_tokens=64,
        response_format={"type": "json_schema", "json_schema": {"name": "person", "schema": schema, "strict": True}})
    jsonschema.validate(json.loads(response.choices[0].message.content), schema)
    capital = [{"role": "user", "content": "Give the capital of France as JSON."}]
    response = client.chat.completions.create(model=MODEL, messages=capital, temperature=0, max_tokens=64,
                                              response_format={"type": "json_object"})
    assert isinstance(json.loads(response.choices[0].message.content), dict)


def test_native_generate_takes_json_schema_regex_and_ebnf(server):
    schema = {"type": "object", "properties": {"ok": {"type": "boolean"}}, "required": ["ok"]}
    cases = [({"json_schema": json.dumps(schema)}, lambda text: jsonschema.validate(json.loads(text), schema)),
             ({"regex": "[0-9]{3}"}, lambda text: text.isdigit() and len(text) == 3 or pytest.fail(text)),
             ({"ebnf": 'root ::= "yes" | "no"'}, lambda text: text in ("yes", "no") or pytest.fail(text))]
    for constraint, check in cases:
        out = post(server, "/generate", {"text": "Answer:", "sampling_params": {
            "temperature": 0, "max_new_tokens": 16, **constraint}}).json()
        check(out["text"])


@pytest.mark.parametrize("path, body, param", [
    ("/generate", {"text": "x", "sampling_params": {"regex": "[0-9"}}, None),
    ("/generate", {"text": "x", "sampling_params": {"json_schema": "{"}}, None),
    ("/v1/chat/completions", {"messages": QUESTION, "response_format": {"type": "json_schema", "json_schema": {
        "name": "x", "schema": {"type": "objectx"}}}}, None),
    ("/v1/chat/completions", {"messages": QUESTION, "response_format": {"type": "xml"}}, "response_format"),
    ("/v1/chat/completions", {"messages": QUESTION, "tools": [{"type": "function"}]}, "tools"),
    ("/v1/chat/completions", {"messages": QUESTION, "tools": TOOLS, "tool_choice": "always"}, "tool_choice"),
    ("/v1/chat/completions", {"messages": QUESTION, "tools": TOOLS,
                              "tool_choice": {"type": "function", "function": {"name": "nope"}}}, "tool_choice"),
    ("/v1/chat/completions", {"messages": QUESTION, "tool_choice": "required"}, "tool_choice"),
])
def test_invalid_grammars_and_tools_are_a_400_and_the_server_keeps_serving(server, path, body, param):
    response = post(server, path, body)
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert error["type"] == "invalid_request_error" and error["param"] == param and error["message"]
    wait_until_idle(server)   # the refused request was never queued: nothing left running
    ok = post(server, "/generate", {"text": "Hi", "sampling_params": {"max_new_tokens": 2}})
    assert ok.status_code == 200


def test_a_server_without_tool_parser_plugins_refuses_tools_clearly(monkeypatch):
    # Every built-in plugin but the tool-call parsers: the launch picks none, tools get a 400.
    monkeypatch.setenv("SRV_BLOCK_PLUGINS", "tools")
    server = Server("--skip-server-warmup")
    try:
        response = httpx.post(f"{server.base}/v1/chat/completions", json={
            "messages": QUESTION, "tools": TOOLS, "max_tokens": 4}, timeout=60)
        assert response.status_code == 400 and "--tool-call-parser" in response.json()["error"]["message"]
    finally:
        server.stop()
