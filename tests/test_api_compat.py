"""What SGLang's and OpenAI's clients send: streaming every choice with its logprobs and echo,
/generate with n, /v1/responses, SGLang's response extensions, prompt log-probabilities,
tools with local definitions, independent seeded choices, SGLang's error wording.

The first test holds the streamed and the whole answers of one greedy request to the same text,
tokens, log-probabilities and finish reasons, for every route and option, so the streamed path
cannot lag the other again.
"""

from __future__ import annotations

import json

import httpx
import openai
import pytest
import torch

from test_engine import hf_model
from test_server import MODEL, Server

API_KEY = "compat-key"
AUTH = {"Authorization": f"Bearer {API_KEY}"}


@pytest.fixture(scope="module")
def server():
    server = Server("--api-key", API_KEY, "--tool-call-parser", "smollm2")
    yield server
    server.stop()


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=f"{server.base}/v1", api_key=API_KEY)


def same(a, b, tolerance: float = 1e-3) -> bool:
    """Equal, with floats within `tolerance`: the second of two equal requests reads its prompt's
    keys and values from the prefix cache, which moves log-probabilities in the last digits."""
    if isinstance(a, float) and isinstance(b, float):
        return abs(a - b) <= tolerance
    if isinstance(a, dict) and isinstance(b, dict):
        return a.keys() == b.keys() and all(same(a[k], b[k], tolerance) for k in a)
    if isinstance(a, list) and isinstance(b, list):
        return len(a) == len(b) and all(same(x, y, tolerance) for x, y in zip(a, b))
    return a == b


def post(server: Server, path: str, body: dict) -> httpx.Response:
    return httpx.post(f"{server.base}{path}", json=body, headers=AUTH, timeout=120)


def events(server: Server, path: str, body: dict) -> list[dict]:
    with httpx.stream("POST", f"{server.base}{path}", json={**body, "stream": True}, headers=AUTH,
                      timeout=120) as response:
        assert response.status_code == 200, response.read()
        lines = [line[6:] for line in response.iter_lines() if line.startswith("data: ")]
    assert lines[-1] == "[DONE]"
    return [json.loads(line) for line in lines[:-1]]


# ---- streamed and whole answers agree ---------------------------------------------------------------

COMPLETIONS = {
    "plain": {"prompt": "The capital of France is"},
    "n=2": {"prompt": "The capital of France is", "n": 2},
    "prompts": {"prompt": ["Once upon a time", "1, 2, 3,"]},
    "token prompts": {"prompt": [[504, 3575, 282], [1, 2, 3]], "n": 2},
    "logprobs": {"prompt": "Once upon a time", "logprobs": 3},
    "echo": {"prompt": "Once upon a time", "echo": True},
    "echo+logprobs": {"prompt": "Once upon a time", "echo": True, "logprobs": 2, "n": 2},
    "stop": {"prompt": "1, 2, 3,", "stop": [" 5"]},
    "stop_regex": {"prompt": "1, 2, 3,", "stop_regex": "[0-9], 6"},
    "json": {"prompt": "A JSON object:", "response_format": {"type": "json_object"}},
}
CHATS = {
    "plain": {},
    "n=2": {"n": 2},
    "logprobs": {"logprobs": True, "top_logprobs": 2, "n": 2},
    "stop": {"stop": [" there"]},
    "json_schema": {"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {
        "type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"]}}}},
    "tools": {"tools": [{"type": "function", "function": {"name": "get_weather", "parameters": {
        "type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}}],
        "tool_choice": "required", "n": 2},
}
GENERATES = {
    "plain": {"text": "The capital of France is"},
    "n=2": {"text": "The capital of France is", "sampling_params": {"n": 2}},
    "batch": {"text": ["Once upon a time", "1, 2, 3,"], "return_logprob": True, "top_logprobs_num": 2},
    "logprobs": {"text": "Once", "return_logprob": True, "logprob_start_len": 0, "return_text_in_logprobs": True},
    "regex": {"text": "Pick a number:", "sampling_params": {"regex": "[0-9]+ (apples|pears)", "n": 2}},
}


def gathered_completions(chunks: list[dict]) -> dict[int, dict]:
    choices: dict[int, dict] = {}
    for chunk in chunks:
        for piece in chunk["choices"]:
            c = choices.setdefault(piece["index"], {"text": "", "tokens": [], "logprobs": [], "top": [],
                                                    "finish": None, "matched": None})
            c["text"] += piece["text"]
            if piece["logprobs"]:
                c["tokens"] += piece["logprobs"]["tokens"]
                c["logprobs"] += piece["logprobs"]["token_logprobs"]
                c["top"] += piece["logprobs"]["top_logprobs"]
            if piece["finish_reason"]:
                c["finish"], c["matched"] = piece["finish_reason"], piece["matched_stop"]
    return choices


def whole_completions(response: dict) -> dict[int, dict]:
    return {c["index"]: {"text": c["text"], "tokens": c["logprobs"]["tokens"] if c["logprobs"] else [],
                         "logprobs": c["logprobs"]["token_logprobs"] if c["logprobs"] else [],
                         "top": c["logprobs"]["top_logprobs"] if c["logprobs"] else [],
                         "finish": c["finish_reason"], "matched": c["matched_stop"]} for c in response["choices"]}


@pytest.mark.parametrize("options", COMPLETIONS.values(), ids=COMPLETIONS.keys())
def test_streamed_completions_carry_what_the_whole_answer_does(server, options):
    body = {"model": MODEL, "max_tokens": 8, "temperature": 0, **options}
    whole = post(server, "/v1/completions", body)
    assert whole.status_code == 200, whole.text
    streamed = events(server, "/v1/completions", body)
    gathered, expected = gathered_completions(streamed), whole_completions(whole.json())
    assert same(gathered, expected), (gathered, expected)
    if options.get("logprobs") is not None:
        assert all(piece["logprobs"] for chunk in streamed for piece in chunk["choices"])


def gathered_chats(chunks: list[dict]) -> dict[int, dict]:
    choices: dict[int, dict] = {}
    for chunk in chunks:
        for piece in chunk["choices"]:
            c = choices.setdefault(piece["index"], {"content": "", "calls": {}, "logprobs": [], "finish": None,
                                                    "matched": None, "roles": 0})
            delta = piece["delta"]
            c["roles"] += delta.get("role") == "assistant"
            c["content"] += delta.get("content") or ""
            for call in delta.get("tool_calls") or []:
                entry = c["calls"].setdefault(call["index"], {"name": "", "arguments": ""})
                entry["name"] += call["function"].get("name") or ""
                entry["arguments"] += call["function"].get("arguments") or ""
            if piece["logprobs"]:
                c["logprobs"] += piece["logprobs"]["content"]
            if piece["finish_reason"]:
                c["finish"], c["matched"] = piece["finish_reason"], piece["matched_stop"]
    return choices


@pytest.mark.parametrize("options", CHATS.values(), ids=CHATS.keys())
def test_streamed_chats_carry_what_the_whole_answer_does(server, options):
    body = {"model": MODEL, "messages": [{"role": "user", "content": "Say hi to Ann."}], "max_tokens": 24,
            "temperature": 0, **options}
    whole = post(server, "/v1/chat/completions", body)
    assert whole.status_code == 200, whole.text
    streamed = gathered_chats(events(server, "/v1/chat/completions", body))
    assert sorted(streamed) == list(range(len(whole.json()["choices"])))
    for choice in whole.json()["choices"]:
        got, message = streamed[choice["index"]], choice["message"]
        assert got["roles"] == 1
        assert got["content"].strip() == (message["content"] or "")
        calls = [{"name": c["function"]["name"], "arguments": c["function"]["arguments"]}
                 for c in message.get("tool_calls") or []]
        assert list(got["calls"].values()) == calls
        assert same(got["logprobs"], (choice["logprobs"] or {}).get("content") or [])
        assert (got["finish"], got["matched"]) == (choice["finish_reason"], choice["matched_stop"])


@pytest.mark.parametrize("options", GENERATES.values(), ids=GENERATES.keys())
def test_streamed_generate_carries_what_the_whole_answer_does(server, options):
    body = {**options, "sampling_params": {"max_new_tokens": 8, "temperature": 0, **options.get("sampling_params", {})}}
    whole = post(server, "/generate", body)
    assert whole.status_code == 200, whole.text
    results = whole.json() if isinstance(whole.json(), list) else [whole.json()]
    last: dict[int, dict] = {}
    for event in events(server, "/generate", body):   # cumulative without --stream-output
        last[event.get("index", 0)] = event
    expected = [{**r, **({"index": i} if len(results) > 1 else {})} for i, r in enumerate(results)]
    got = [last[i] for i in range(len(results))]
    for result in got + expected:   # timing and cache hits are the run's own
        result["meta_info"].pop("cached_tokens")
        result["meta_info"].pop("id")
    assert same(got, expected), (got, expected)


# ---- one item each ------------------------------------------------------------------------------------


def test_streamed_choices_with_usage_at_the_end_and_in_every_chunk(client):
    chunks = list(client.completions.create(model=MODEL, prompt=["a", "b"], n=2, max_tokens=4, temperature=0,
                                            stream=True, stream_options={"include_usage": True}))
    assert {c.index for chunk in chunks for c in chunk.choices} == {0, 1, 2, 3}
    assert sum(1 for chunk in chunks for c in chunk.choices if c.finish_reason) == 4
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == 16
    every = list(client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "hi"}],
                                                max_tokens=4, temperature=0, stream=True,
                                                stream_options={"continuous_usage_stats": True}))
    counts = [chunk.usage.completion_tokens for chunk in every if chunk.choices]
    assert counts == sorted(counts) and counts[-1] == 4 and every[0].usage.prompt_tokens > 0


def test_n_on_generate_is_a_list_and_each_obeys_the_regex(server):
    results = post(server, "/generate", {"text": "Pick:", "sampling_params": {
        "n": 3, "max_new_tokens": 6, "temperature": 1.0, "seed": 3, "regex": "[a-c]{1,4}"}}).json()
    assert isinstance(results, list) and len(results) == 3
    import re
    assert all(re.fullmatch("[a-c]{1,4}", r["text"]) for r in results)


def test_seeded_choices_are_independent_and_the_same_again(client):
    def sample():
        return [c.text for c in client.completions.create(model=MODEL, prompt="Once upon a time", max_tokens=8,
                                                          temperature=1, n=4, seed=7).choices]
    first = sample()
    assert len(set(first)) > 1 and sample() == first


def test_matched_stop_names_what_ended_each_choice(server):
    stop = post(server, "/v1/completions", {"prompt": "1, 2, 3,", "max_tokens": 12, "temperature": 0,
                                            "stop": [" 5"]}).json()["choices"][0]
    assert (stop["finish_reason"], stop["matched_stop"], stop["text"]) == ("stop", " 5", " 4,")
    length = post(server, "/v1/completions", {"prompt": "1, 2, 3,", "max_tokens": 2, "temperature": 0}).json()
    assert length["choices"][0]["matched_stop"] is None
    eos = post(server, "/v1/chat/completions", {"messages": [{"role": "user", "content": "Say hi"}],
                                                "temperature": 0, "max_tokens": 60}).json()["choices"][0]
    assert eos["finish_reason"] == "stop" and isinstance(eos["matched_stop"], int)


def test_stop_regex_and_no_stop_trim(server):
    cut = post(server, "/generate", {"text": "1, 2, 3,", "sampling_params": {
        "max_new_tokens": 20, "temperature": 0, "stop_regex": r"[0-9], 6"}}).json()
    assert cut["meta_info"]["finish_reason"] == {"type": "stop", "matched": r"[0-9], 6"} and cut["text"] == " 4, "
    kept = post(server, "/generate", {"text": "1, 2, 3,", "sampling_params": {
        "max_new_tokens": 20, "temperature": 0, "stop_regex": r"[0-9], 6", "no_stop_trim": True}}).json()
    assert kept["text"] == " 4, 5, 6"
    bad = post(server, "/generate", {"text": "x", "sampling_params": {"stop_regex": "("}})
    assert bad.status_code == 400 and bad.json()["error"]["param"] == "stop_regex"


def test_continue_final_message_prefills_the_answer(server):
    messages = [{"role": "user", "content": "What is the capital of France?"},
                {"role": "assistant", "content": "The capital of France is"}]
    reply = post(server, "/v1/chat/completions", {"messages": messages, "continue_final_message": True,
                                                  "max_tokens": 3, "temperature": 0}).json()
    assert reply["choices"][0]["message"]["content"].strip().startswith("Paris")
    bad = post(server, "/v1/chat/completions", {"messages": messages[:1], "continue_final_message": True})
    assert bad.status_code == 400 and bad.json()["error"]["param"] == "continue_final_message"


def test_prompt_logprobs_are_the_models(server, default_model_dir):
    """/generate's input_token_logprobs equal transformers' log-softmax over the same prompt."""
    prompt = [504, 3575, 282, 4649, 314, 7042]
    result = post(server, "/generate", {"input_ids": prompt, "sampling_params": {"max_new_tokens": 1, "temperature": 0},
                                        "return_logprob": True, "logprob_start_len": 2, "top_logprobs_num": 3}).json()
    meta = result["meta_info"]
    with torch.inference_mode():
        logits = hf_model(str(default_model_dir))(torch.tensor([prompt])).logits[0].float()
    expected = torch.log_softmax(logits, -1)
    assert [t for _, t, _ in meta["input_token_logprobs"]] == prompt[2:]
    got = torch.tensor([lp for lp, _, _ in meta["input_token_logprobs"]])
    want = torch.stack([expected[p - 1, prompt[p]] for p in range(2, len(prompt))])
    torch.testing.assert_close(got, want, atol=2e-3, rtol=0)
    assert [[t for _, t, _ in top] for top in meta["input_top_logprobs"]] == \
        [expected[p - 1].topk(3).indices.tolist() for p in range(2, len(prompt))]
    first = post(server, "/generate", {"input_ids": prompt, "sampling_params": {"max_new_tokens": 1},
                                       "return_logprob": True, "logprob_start_len": 0}).json()
    assert first["meta_info"]["input_token_logprobs"][0][0] is None


def test_echo_with_logprobs_gives_the_prompts_logprobs(client):
    choice = client.completions.create(model=MODEL, prompt="The capital of France is", max_tokens=2, temperature=0,
                                       echo=True, logprobs=1).choices[0]
    assert choice.text.startswith("The capital of France is")
    assert choice.logprobs.token_logprobs[0] is None and len(choice.logprobs.tokens) == 5 + 2
    assert "".join(choice.logprobs.tokens) == choice.text


def test_responses_api(client):
    first = client.responses.create(model=MODEL, input="What is the capital of France?", max_output_tokens=8,
                                    instructions="Answer in one word.", temperature=0)
    assert first.object == "response" and first.status in ("completed", "incomplete") and first.output_text
    assert first.usage.output_tokens > 0 and client.responses.retrieve(first.id).id == first.id
    follow_up = client.responses.create(model=MODEL, input="And of Italy?", previous_response_id=first.id,
                                        max_output_tokens=8, temperature=0)
    assert follow_up.usage.input_tokens > first.usage.input_tokens
    streamed = list(client.responses.create(model=MODEL, input="What is the capital of France?",
                                            max_output_tokens=8, instructions="Answer in one word.", temperature=0,
                                            stream=True))
    kinds = [event.type for event in streamed]
    assert kinds[0] == "response.created" and kinds[-1] == "response.completed"
    deltas = "".join(event.delta for event in streamed if event.type == "response.output_text.delta")
    assert deltas == first.output_text == streamed[-1].response.output_text
    as_json = client.responses.create(model=MODEL, input="Give me a JSON object.", max_output_tokens=30,
                                      text={"format": {"type": "json_object"}}, temperature=0)
    json.loads(as_json.output_text) if as_json.status == "completed" else None
    called = client.responses.create(model=MODEL, input="What's the weather in Paris?", tool_choice="required",
                                     tools=[{"type": "function", "name": "get_weather", "parameters": {
                                         "type": "object", "properties": {"city": {"type": "string"}},
                                         "required": ["city"]}}], max_output_tokens=40, temperature=0)
    [call] = [item for item in called.output if item.type == "function_call"]
    assert call.name == "get_weather" and "city" in json.loads(call.arguments)
    client.responses.delete(first.id)
    with pytest.raises(openai.NotFoundError):
        client.responses.retrieve(first.id)


def test_server_info_names_the_kv_size_and_version(server):
    info = httpx.get(f"{server.base}/get_server_info", headers=AUTH).json()
    assert info["max_total_num_tokens"] == info["scheduler"]["kv_capacity_tokens"] > 0 and info["version"]


def test_a_tool_with_local_definitions_takes_tool_choice_required(client):
    tool = {"type": "function", "function": {"name": "book", "parameters": {
        "type": "object", "properties": {"when": {"$ref": "#/$defs/date"}}, "required": ["when"],
        "$defs": {"date": {"type": "string", "pattern": "^2026-1[0-2]-[0-3][0-9]$"}}}}}
    reply = client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "Book for Dec 3."}],
                                           tools=[tool], tool_choice="required", max_tokens=40, temperature=0)
    [call] = reply.choices[0].message.tool_calls
    import re
    assert call.function.name == "book" and re.fullmatch("2026-1[0-2]-[0-3][0-9]", json.loads(call.function.arguments)["when"])


@pytest.mark.parametrize("body, message", [
    ({"tools": [{"type": "function", "function": {"name": "f"}}],
      "tool_choice": {"type": "function", "function": {"name": "g"}}}, "Tool 'g' not found in tools list."),
    ({"tool_choice": "required"}, "Tools cannot be empty if tool choice is set to required."),
    ({"tools": [{"type": "function", "function": {"name": "f", "parameters": {"type": "nonsense"}}}]},
     "Tool 0 function has invalid 'parameters' schema: "),
])
def test_tool_errors_in_sglangs_words(server, body, message):
    response = post(server, "/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}], **body})
    assert response.status_code == 400 and response.json()["error"]["message"].startswith(message)
