"""Reasoning parsers (`--reasoning-parser`): every built-in format through the kit, and the
server's reasoning_content (whole, streamed, held until it ends) and /separate_reasoning, on the
default model with its output held to a think-tagged shape by a regex."""

from __future__ import annotations

import json
import re

import httpx
import openai
import pytest

from srv.sdk.testing import ReasoningParserKit

from test_server import AUTH, API_KEY, MODEL, Server, post


class TestDeepSeekR1(ReasoningParserKit):
    backend_name = "deepseek-r1"


class TestQwen3(ReasoningParserKit):
    backend_name = "qwen3"


class TestQwen3Thinking(ReasoningParserKit):
    backend_name = "qwen3-thinking"


class TestDeepSeekV3(ReasoningParserKit):
    backend_name = "deepseek-v3"


class TestGLM45(ReasoningParserKit):
    backend_name = "glm45"


class TestKimi(ReasoningParserKit):
    backend_name = "kimi"


class TestGptOss(ReasoningParserKit):
    backend_name = "gpt-oss"


def test_outputs_that_start_inside_the_reasoning():
    from srv.plugins.reasoning.formats import OpenedThinkParser, ThinkParser

    opened = OpenedThinkParser()
    assert opened.parse("plan a, then b\n</think>\n\nAnswer") == ("plan a, then b", "Answer")
    assert opened.parse("<think>plan</think>Answer") == ("plan", "Answer")   # the marker written again
    assert opened.parse("no end marker yet") == ("no end marker yet", "")
    assert ThinkParser().parse("plan</think>Answer") == ("", "plan</think>Answer")


# ---- over HTTP --------------------------------------------------------------------------------

# The shape the output is held to: reasoning in think tags, then an answer.
SHAPE = r"<think>\n[a-z]{2,8}( [a-z]{2,8}){1,3}\n</think>\n\n[A-Z][a-z]{2,8}( [a-z]{2,8}){1,3}\."


@pytest.fixture(scope="module")
def server():
    server = Server("--api-key", API_KEY, "--reasoning-parser", "qwen3")
    yield server
    server.stop()


def chat(stream: bool = False, **extra) -> dict:
    return {"model": MODEL, "messages": [{"role": "user", "content": "Why is the sky blue?"}],
            "max_tokens": 60, "temperature": 0, "regex": SHAPE, "stream": stream, **extra}


def test_reasoning_content_whole_and_streamed(server):
    client = openai.OpenAI(base_url=f"{server.base}/v1", api_key=API_KEY)
    whole = post(server, "/v1/chat/completions", chat()).json()["choices"][0]["message"]
    assert whole["reasoning_content"] and whole["content"]
    text = f"<think>\n{whole['reasoning_content']}\n</think>\n\n{whole['content']}"
    assert re.fullmatch(SHAPE, text), text
    chunks = list(client.chat.completions.create(**{k: v for k, v in chat(True).items() if k != "regex"},
                                                 extra_body={"regex": SHAPE}))
    reasoning = "".join(getattr(c.choices[0].delta, "reasoning_content", None) or "" for c in chunks if c.choices)
    content = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert (reasoning, content) == (whole["reasoning_content"], whole["content"])
    assert sum(bool(getattr(c.choices[0].delta, "reasoning_content", None)) for c in chunks if c.choices) > 1


def stream_deltas(server, body) -> list[dict]:
    with httpx.stream("POST", f"{server.base}/v1/chat/completions", json=body, headers=AUTH, timeout=120) as response:
        lines = [line[6:] for line in response.iter_lines() if line.startswith("data: ") and line != "data: [DONE]"]
    return [json.loads(line)["choices"][0]["delta"] for line in lines if json.loads(line)["choices"]]


def test_stream_reasoning_false_sends_the_reasoning_once_it_ends(server):
    deltas = stream_deltas(server, chat(True, stream_reasoning=False))
    pieces = [d["reasoning_content"] for d in deltas if d.get("reasoning_content")]
    assert len(pieces) == 1 and " " in pieces[0]
    assert "".join(d.get("content") or "" for d in deltas).endswith(".")


def test_separate_reasoning_false_keeps_the_tags_in_content(server):
    message = post(server, "/v1/chat/completions", chat(separate_reasoning=False)).json()["choices"][0]["message"]
    assert message["content"].startswith("<think>") and message.get("reasoning_content") is None


def test_chat_template_kwargs_reach_the_template(server):
    body = chat(chat_template_kwargs={"enable_thinking": False})
    assert post(server, "/v1/chat/completions", body).status_code == 200


def test_separate_reasoning_route(server):
    text = "<think>\nstep one\n</think>\n\nThe answer."
    assert post(server, "/separate_reasoning", {"text": text}).json() == {"text": "The answer.",
                                                                            "reasoning_text": "step one"}
    kimi = post(server, "/separate_reasoning", {"text": "◁think▷x◁/think▷y", "reasoning_parser": "kimi"}).json()
    assert kimi == {"text": "y", "reasoning_text": "x"}
    bad = post(server, "/separate_reasoning", {"text": "x", "reasoning_parser": "nope"})
    assert bad.status_code == 400 and bad.json()["error"]["param"] == "reasoning_parser"
    assert post(server, "/separate_reasoning", {"reasoning_parser": "kimi"}).json()["error"]["param"] == "text"


# A chat template that opens the reasoning in the prompt, as DeepSeek-R1's and Qwen3's thinking
# models' templates do: the output starts inside it.
OPENING_TEMPLATE = ("{% for m in messages %}<|im_start|>{{ m.role }}\n{{ m.content }}<|im_end|>\n{% endfor %}"
                    "{% if add_generation_prompt %}<|im_start|>assistant\n<think>\n{% endif %}")
OPENED_SHAPE = r"[a-z]{2,8}( [a-z]{2,8}){1,3}\n</think>\n\n[A-Z][a-z]{2,8}( [a-z]{2,8}){1,3}\."


def test_a_template_that_opens_the_reasoning_with_deepseek_r1(tmp_path):
    template = tmp_path / "opening.jinja"
    template.write_text(OPENING_TEMPLATE)
    server = Server("--api-key", API_KEY, "--reasoning-parser", "deepseek-r1", "--chat-template", str(template))
    try:
        body = {**chat(), "regex": OPENED_SHAPE}
        message = post(server, "/v1/chat/completions", body).json()["choices"][0]["message"]
        assert re.fullmatch(OPENED_SHAPE, f"{message['reasoning_content']}\n</think>\n\n{message['content']}")
        deltas = stream_deltas(server, {**body, "stream": True})
        assert "".join(d.get("reasoning_content") or "" for d in deltas) == message["reasoning_content"]
        assert "".join(d.get("content") or "" for d in deltas) == message["content"]
    finally:
        server.stop()
