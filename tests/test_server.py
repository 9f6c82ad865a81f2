"""`srv launch` serves the OpenAI API over real HTTP; the official client talks to it."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import time

import httpx
import openai
import pytest

API_KEY = "test-key"


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="module")
def server():
    port = free_port()
    # One torch thread: the client shares this 2-core machine with the server.
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    process = subprocess.Popen([sys.executable, "-m", "srv", "launch", "--port", str(port), "--dtype", "float32",
                                "--api-key", API_KEY], env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
    base = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline:
        try:
            if httpx.get(f"{base}/health").status_code == 200:
                break
        except httpx.TransportError:
            time.sleep(0.3)
        if process.poll() is not None:
            pytest.fail(process.stdout.read().decode())
    yield base
    process.terminate()
    process.wait(timeout=30)


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=f"{server}/v1", api_key=API_KEY)


def test_chat_completion(client):
    reply = client.chat.completions.create(model="SmolLM2-135M-Instruct", temperature=0, max_tokens=20,
                                           messages=[{"role": "user", "content": "What is the capital of France?"}])
    assert "Paris" in reply.choices[0].message.content
    assert reply.usage.total_tokens == reply.usage.prompt_tokens + reply.usage.completion_tokens


def test_streamed_completion_equals_non_streamed(client):
    kwargs = dict(model="SmolLM2-135M-Instruct", prompt="Once upon a time", max_tokens=24, temperature=0)
    full = client.completions.create(**kwargs).choices[0].text
    streamed = "".join(chunk.choices[0].text for chunk in client.completions.create(stream=True, **kwargs))
    assert streamed == full and full


def test_models_route(client):
    assert [m.id for m in client.models.list().data] == ["SmolLM2-135M-Instruct"]


def test_errors_are_openai_shaped_and_the_server_keeps_serving(server, client):
    headers = {"Authorization": f"Bearer {API_KEY}"}
    bad_json = httpx.post(f"{server}/v1/completions", content=b"{bad", headers=headers)
    assert bad_json.status_code == 400 and bad_json.json()["error"]["type"] == "invalid_request_error"
    with pytest.raises(openai.NotFoundError):
        client.completions.create(model="no-such-model", prompt="hi")
    with pytest.raises(openai.BadRequestError):
        client.completions.create(model="SmolLM2-135M-Instruct", prompt="hi", max_tokens=-1)
    with pytest.raises(openai.BadRequestError):
        client.chat.completions.create(model="SmolLM2-135M-Instruct", messages=[])
    assert client.completions.create(model="SmolLM2-135M-Instruct", prompt="hi", max_tokens=2).choices


def test_api_key_is_required_except_for_health(server):
    assert httpx.get(f"{server}/health").status_code == 200
    missing = httpx.get(f"{server}/v1/models")
    assert missing.status_code == 401 and missing.json()["error"]["type"] == "authentication_error"
    assert httpx.get(f"{server}/v1/models", headers={"Authorization": "Bearer wrong"}).status_code == 401
