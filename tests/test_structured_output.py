"""Constrained decoding on the default model, for each grammar backend: outputs that validate,
constrained and free requests in one batch, and invalid grammars rejected."""

from __future__ import annotations

import json
import re

import jsonschema
import pytest

import srv
from srv.engine.default_model import default_model_path

GRAMMAR_BACKENDS = ["xgrammar", "llguidance", "outlines"]
GREEDY = {"temperature": 0.0}

SCHEMAS = {
    "nested object": {
        "type": "object",
        "properties": {"name": {"type": "string", "maxLength": 20},
                       "address": {"type": "object", "properties": {"city": {"type": "string", "maxLength": 20},
                                                                    "zip": {"type": "integer"}},
                                   "required": ["city", "zip"], "additionalProperties": False}},
        "required": ["name", "address"], "additionalProperties": False,
    },
    "array": {"type": "array", "items": {"type": "integer", "minimum": 0, "maximum": 99}, "minItems": 2, "maxItems": 4},
    "enum": {"type": "object", "properties": {"color": {"enum": ["red", "green", "blue"]}}, "required": ["color"],
             "additionalProperties": False},
    "bounded numbers": {"type": "object",
                        "properties": {"age": {"type": "integer", "minimum": 18, "maximum": 65},
                                       "ok": {"type": "boolean"}},
                        "required": ["age", "ok"], "additionalProperties": False},
}
PROMPT = "<|im_start|>user\nReply in JSON.<|im_end|>\n<|im_start|>assistant\n"
FREE_PROMPTS = ["The capital of France is", "def fibonacci(n):"]


@pytest.fixture(scope="module", params=GRAMMAR_BACKENDS)
def engine(request, default_model_dir):
    # Compact JSON: a 135M model under "any whitespace" may spend its whole budget on newlines.
    with srv.Engine(model_path=str(default_model_path()), dtype="float32", grammar_backend=request.param,
                    constrained_json_disable_any_whitespace=True,
                    constrained_json_whitespace_pattern=r"[ ]?") as engine:
        yield engine


def generate(engine: srv.Engine, prompt, params):
    return engine.generate(prompt, params)


@pytest.mark.parametrize("schema", SCHEMAS.values(), ids=SCHEMAS.keys())
def test_json_outputs_validate_against_their_schema(engine, schema):
    out = generate(engine, PROMPT, {**GREEDY, "max_new_tokens": 96, "json_schema": json.dumps(schema)})
    assert out["meta_info"]["finish_reason"]["type"] == "stop", out
    jsonschema.validate(json.loads(out["text"]), schema)


def test_a_schema_given_as_an_object_and_sampled_outputs_validate(engine):
    schema = SCHEMAS["enum"]
    outs = generate(engine, [PROMPT] * 4, {"temperature": 1.0, "seed": 3, "max_new_tokens": 32, "json_schema": schema})
    for out in outs:
        jsonschema.validate(json.loads(out["text"]), schema)


def test_regex_outputs_match(engine):
    pattern = r"(yes|no), [0-9]{2} (cats|dogs)"
    outs = generate(engine, ["Answer:", "Count the animals:"], {**GREEDY, "max_new_tokens": 16, "regex": pattern})
    for out in outs:
        assert re.fullmatch(pattern, out["text"]), out["text"]


def test_ebnf_outputs_follow_the_grammar_or_are_refused(engine):
    grammar = 'root ::= "The answer is " answer "."\nanswer ::= "yes" | "no" | "maybe"'
    params = {**GREEDY, "max_new_tokens": 16, "ebnf": grammar}
    if engine.server_args.grammar_backend == "outlines":
        with pytest.raises(ValueError, match="EBNF"):
            generate(engine, "Question: is the sky blue?", params)
        return
    out = generate(engine, "Question: is the sky blue?", params)
    assert re.fullmatch(r"The answer is (yes|no|maybe)\.", out["text"]), out["text"]


def test_constrained_and_free_requests_share_a_batch_and_free_outputs_are_unchanged(engine):
    free = {**GREEDY, "max_new_tokens": 24}
    alone = [o["output_ids"] for o in generate(engine, FREE_PROMPTS, free)]
    schema = SCHEMAS["bounded numbers"]
    mixed = generate(engine, [FREE_PROMPTS[0], PROMPT, FREE_PROMPTS[1], "Reply:"],
                     [free, {**GREEDY, "max_new_tokens": 48, "json_schema": json.dumps(schema)}, free,
                      {**GREEDY, "max_new_tokens": 8, "regex": "[a-z]{3}"}])
    assert [mixed[0]["output_ids"], mixed[2]["output_ids"]] == alone
    jsonschema.validate(json.loads(mixed[1]["text"]), schema)
    assert re.fullmatch("[a-z]{3}", mixed[3]["text"])


@pytest.mark.parametrize("params, problem", [
    ({"json_schema": "{not json"}, "invalid json_schema"),
    ({"json_schema": json.dumps({"type": "objectx"})}, "invalid json_schema"),
    ({"regex": "[0-9"}, "invalid regex"),
    ({"regex": "a", "json_schema": "{}"}, "at most one"),
])
def test_invalid_grammars_are_refused_and_the_engine_keeps_serving(engine, params, problem):
    with pytest.raises(ValueError, match=problem):
        generate(engine, "x", {**params, "max_new_tokens": 4})
    assert generate(engine, "Hello", {**GREEDY, "max_new_tokens": 2})["meta_info"]["completion_tokens"] == 2
