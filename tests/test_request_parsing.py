"""The request parsers under fuzzing (hypothesis): malformed JSON, wrong types, odd unicode, huge
numbers and deep nesting are a 400 naming the problem, never another exception; what parses
turns into sampling parameters or a 400 in the same way."""

from __future__ import annotations

import json

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from srv.engine.limits import RequestLimits
from srv.engine.errors import InvalidRequest
from srv.engine.params import make_sampling_params, max_new_tokens_given
from srv.server.app import APIError, parse_body
from srv.server.chat_tools import ToolCalling
from srv.server.openai_routes import OpenAIRoutes, sampling_params
from srv.server.protocol import ChatCompletionRequest, CompletionRequest, GenerateRequest
from srv.sdk.sampling import SamplingParams

SCHEMAS = (CompletionRequest, ChatCompletionRequest, GenerateRequest)
FUZZ = settings(max_examples=250, deadline=None, suppress_health_check=[HealthCheck.too_slow])

# Unicode as clients send it, lone surrogates included (json.dumps writes them as \\udxxx escapes).
text = st.text(st.characters(codec=None, categories=None), max_size=20)
scalars = st.none() | st.booleans() | st.integers(min_value=-2**70, max_value=2**70) \
    | st.floats(allow_nan=True, allow_infinity=True) | text
json_values = st.recursive(scalars, lambda inner: st.lists(inner, max_size=4)
                           | st.dictionaries(text, inner, max_size=4), max_leaves=12)

VALID = {
    CompletionRequest: {"model": "m", "prompt": "hi", "max_tokens": 4, "temperature": 0.5, "n": 2, "stop": ["x"],
                        "logprobs": 2, "echo": True, "logit_bias": {"12": 1.5}, "seed": 3, "stream": False},
    ChatCompletionRequest: {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 4, "top_logprobs": 2,
                            "logprobs": True, "tools": [{"type": "function", "function": {"name": "f"}}],
                            "tool_choice": {"type": "function", "function": {"name": "f"}},
                            "response_format": {"type": "json_object"}},
    GenerateRequest: {"text": "hi", "sampling_params": {"max_new_tokens": 4, "temperature": 0, "regex": "[a-z]+"},
                      "return_logprob": True, "top_logprobs_num": 2},
}


def json_bytes(value) -> bytes:
    return json.dumps(value, allow_nan=True).encode()


def assert_parses_or_400(schema, raw: bytes):
    try:
        return parse_body(schema, raw)
    except (APIError, InvalidRequest) as exc:
        assert getattr(exc, "status", 400) == 400 and str(exc), exc
        return None


def assert_params_or_400(body) -> None:
    """What a parsed body becomes further on: sampling parameters, fitted to a small model."""
    try:
        if isinstance(body, GenerateRequest):
            raws = body.sampling_params if isinstance(body.sampling_params, list) else [body.sampling_params]
        else:
            if isinstance(body, ChatCompletionRequest):
                ToolCalling.from_request(body.tools, body.tool_choice, parser=_AnyParser())
            else:
                OpenAIRoutes._completion_prompts(body)
            raws = [sampling_params(body, bool(getattr(body, "logprobs", False)), 2)]
        limits = RequestLimits(context_len=64, vocab_size=100, kv_capacity_tokens=128)
        for raw in raws:
            params = make_sampling_params(raw)
            assert isinstance(params, SamplingParams)
            limits.fit([5, 6, 7], params, max_new_tokens_given(raw))
    except (APIError, InvalidRequest) as exc:
        assert getattr(exc, "status", 400) == 400 and str(exc)


class _AnyParser:
    """Tool calling needs a parser object; parsing the request never calls it."""


@FUZZ
@given(st.sampled_from(SCHEMAS), json_values)
def test_any_json_value_parses_or_is_a_400(schema, value):
    body = assert_parses_or_400(schema, json_bytes(value))
    if body is not None:
        assert_params_or_400(body)


@FUZZ
@given(st.sampled_from(SCHEMAS), st.binary(max_size=64))
def test_any_bytes_parse_or_are_a_400(schema, raw):
    assert_parses_or_400(schema, raw)


@FUZZ
@given(st.sampled_from(SCHEMAS), st.data())
def test_a_valid_body_with_one_field_replaced_parses_or_is_a_400(schema, data):
    body = json.loads(json.dumps(VALID[schema]))
    field = data.draw(st.sampled_from(sorted(body) + ["extra"]))
    body[field] = data.draw(json_values)
    parsed = assert_parses_or_400(schema, json_bytes(body))
    if parsed is not None:
        assert_params_or_400(parsed)


@FUZZ
@given(st.sampled_from(SCHEMAS), st.integers(min_value=1, max_value=3000), st.sampled_from(["[", "{\"a\":"]))
def test_deep_nesting_is_a_400(schema, depth, opener):
    closer = "]" if opener == "[" else "}"
    raw = ('{"prompt": ' + opener * depth + "1" + closer * depth + "}").encode()
    assert_parses_or_400(schema, raw)


def test_the_valid_bodies_parse_and_make_sampling_parameters():
    for schema, body in VALID.items():
        parsed = parse_body(schema, json_bytes(body))
        assert_params_or_400(parsed)
    params = make_sampling_params(parse_body(GenerateRequest, json_bytes(VALID[GenerateRequest])).sampling_params)
    assert params.regex == "[a-z]+" and params.max_new_tokens == 4
