"""`srv launch` over real HTTP: the official `openai` client and raw httpx against a server
process on a free port, with its scheduler in a process of its own."""

from __future__ import annotations

import concurrent.futures
import json
import math
import os
import signal
import socket
import statistics
import subprocess
import sys
import threading
import time
from pathlib import Path

import httpx
import openai
import pytest
import torch

API_KEY = "test-key"
MODEL = "SmolLM2-135M-Instruct"
AUTH = {"Authorization": f"Bearer {API_KEY}"}


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def descendants(pid: int) -> set[int]:
    found, stack = set(), [pid]
    while stack:
        parent = stack.pop()
        for task in Path(f"/proc/{parent}/task").glob("*"):
            children = (task / "children").read_text().split() if (task / "children").exists() else []
            for child in map(int, children):
                found.add(child)
                stack.append(child)
    return found


def assert_gone(pids: set[int]) -> None:
    """Every process in `pids` exits within seconds (helpers such as multiprocessing's resource
    tracker leave once the server has)."""
    def running(pid: int) -> bool:
        try:
            return Path(f"/proc/{pid}/stat").read_text().split()[2] != "Z"
        except FileNotFoundError:
            return False

    deadline = time.monotonic() + 10
    while time.monotonic() < deadline:
        alive = {pid for pid in pids if running(pid)}
        if not alive:
            return
        time.sleep(0.1)
    raise AssertionError(f"processes left running: {sorted(alive)}")


class Server:
    def __init__(self, *flags: str, env: dict[str, str] | None = None) -> None:
        self.port = free_port()
        self.base = f"http://127.0.0.1:{self.port}"
        # One torch thread: the test client shares this 2-core machine with the server.
        env = {**os.environ, "OMP_NUM_THREADS": "1", **(env or {})}
        self.process = subprocess.Popen([sys.executable, "-m", "srv", "launch", "--port", str(self.port),
                                         "--dtype", "float32", *flags], env=env,
                                        stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
        self.output: list[str] = []
        threading.Thread(target=self._read_output, daemon=True).start()
        deadline = time.monotonic() + 180
        while time.monotonic() < deadline:
            if self.process.poll() is not None:
                raise RuntimeError("server exited:\n" + "".join(self.output))
            try:
                if httpx.get(f"{self.base}/health", timeout=1).status_code == 200:
                    return
            except httpx.TransportError:
                pass
            time.sleep(0.3)
        raise RuntimeError("server did not start:\n" + "".join(self.output))

    def _read_output(self) -> None:
        for line in self.process.stdout:
            self.output.append(line)

    def scheduler_status(self) -> dict:
        return httpx.get(f"{self.base}/get_server_info", headers=AUTH).json()["scheduler"]

    def stop(self, signum: int = signal.SIGTERM) -> int:
        self.process.send_signal(signum)
        return self.process.wait(timeout=60)


def served_once(*flags: str) -> str:
    """Start a server with `flags`, have it complete one prompt, stop it; its output."""
    server = Server(*flags)
    try:
        response = httpx.post(f"{server.base}/v1/completions", headers=AUTH, timeout=60,
                              json={"prompt": [3, 4, 5], "max_tokens": 2})
        assert response.status_code == 200, response.text
    finally:
        server.stop()
    return "".join(server.output)


@pytest.fixture(scope="module")
def server():
    server = Server("--api-key", API_KEY)
    yield server
    server.stop()


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=f"{server.base}/v1", api_key=API_KEY)


def post(server: Server, path: str, body, **kwargs) -> httpx.Response:
    content = body if isinstance(body, bytes) else json.dumps(body).encode()
    return httpx.post(f"{server.base}{path}", content=content, headers=AUTH, timeout=120, **kwargs)


# ---- OpenAI routes --------------------------------------------------------------------------------


def test_chat_completion_with_every_message_kind(client):
    reply = client.chat.completions.create(model=MODEL, temperature=0, max_completion_tokens=20, messages=[
        {"role": "system", "content": "You are a helpful assistant."},
        {"role": "user", "content": [{"type": "text", "text": "What is the capital "}, {"type": "text", "text": "of France?"}]},
    ])
    assert "Paris" in reply.choices[0].message.content
    assert reply.usage.total_tokens == reply.usage.prompt_tokens + reply.usage.completion_tokens
    follow_up = client.chat.completions.create(model=MODEL, temperature=0, max_tokens=10, messages=[
        {"role": "user", "content": "What is 2+2?"}, {"role": "assistant", "content": "4"},
        {"role": "tool", "content": "{\"result\": 4}", "tool_call_id": "call_1"},
        {"role": "user", "content": "And 3+3?"}], user="someone", extra_body={"top_k": 5, "min_p": 0.05,
                                                                             "repetition_penalty": 1.1})
    assert follow_up.choices[0].message.content


def test_streamed_text_equals_non_streamed(client):
    kwargs = dict(model=MODEL, prompt="Once upon a time", max_tokens=24, temperature=0)
    full = client.completions.create(**kwargs).choices[0].text
    chunks = list(client.completions.create(stream=True, stream_options={"include_usage": True}, **kwargs))
    assert "".join(c.choices[0].text for c in chunks if c.choices) == full and full
    assert chunks[-1].usage.completion_tokens == 24 and not chunks[-1].choices
    messages = [{"role": "user", "content": "Tell me a fact about the sea."}]
    chat = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=24, temperature=0)
    streamed = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=24, temperature=0, stream=True)
    parts = list(streamed)
    assert parts[0].choices[0].delta.role == "assistant"
    assert "".join(p.choices[0].delta.content or "" for p in parts) == chat.choices[0].message.content


def test_models_routes(server, client):
    assert [m.id for m in client.models.list().data] == [MODEL]
    assert client.models.retrieve(MODEL).id == MODEL
    with pytest.raises(openai.NotFoundError):
        client.models.retrieve("no-such-model")


def test_completion_prompt_shapes_echo_n_and_logprobs(server, client):
    ids = [16, 28, 216, 34, 28, 216, 35, 28]
    texts = client.completions.create(model=MODEL, prompt=["1, 2, 3,", "a, b, c,"], max_tokens=6, temperature=0)
    assert [c.index for c in texts.choices] == [0, 1] and all(c.text for c in texts.choices)
    by_ids = client.completions.create(model=MODEL, prompt=ids, max_tokens=6, temperature=0)
    by_id_lists = client.completions.create(model=MODEL, prompt=[ids, ids[:4]], max_tokens=6, temperature=0)
    assert by_id_lists.choices[0].text == by_ids.choices[0].text
    assert by_ids.usage.prompt_tokens == len(ids)
    echo = client.completions.create(model=MODEL, prompt="1, 2, 3,", max_tokens=4, temperature=0, echo=True)
    assert echo.choices[0].text.startswith("1, 2, 3,")
    several = client.completions.create(model=MODEL, prompt="Once upon a time", max_tokens=8, n=3, temperature=1.0)
    assert len(several.choices) == 3 and several.usage.completion_tokens == 24
    assert several.usage.prompt_tokens == client.completions.create(model=MODEL, prompt="Once upon a time",
                                                                    max_tokens=1).usage.prompt_tokens
    with_logprobs = client.completions.create(model=MODEL, prompt="1, 2, 3,", max_tokens=4, temperature=0, logprobs=2)
    lp = with_logprobs.choices[0].logprobs
    assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.top_logprobs) == 4
    assert "".join(lp.tokens) == with_logprobs.choices[0].text
    assert all(len(top) <= 2 and max(top.values()) == pytest.approx(value) for top, value in
               zip(lp.top_logprobs, lp.token_logprobs))
    stopped = client.completions.create(model=MODEL, prompt="1, 2, 3,", max_tokens=20, temperature=0, stop=[" 6"])
    assert stopped.choices[0].finish_reason == "stop" and " 6" not in stopped.choices[0].text


def test_chat_n_seed_and_logprobs(client):
    messages = [{"role": "user", "content": "Name a color."}]
    first = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=8, temperature=1.0, seed=42)
    again = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=8, temperature=1.0, seed=42)
    assert first.choices[0].message.content == again.choices[0].message.content
    several = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=8, n=2)
    assert [c.index for c in several.choices] == [0, 1]
    scored = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=5, temperature=0,
                                            logprobs=True, top_logprobs=3)
    content = scored.choices[0].logprobs.content
    assert "".join(t.token for t in content) == scored.choices[0].message.content
    assert all(len(t.top_logprobs) == 3 and t.top_logprobs[0].logprob == pytest.approx(t.logprob) for t in content)


def test_32_concurrent_requests_equal_their_sequential_outputs(client):
    prompts = [f"Write one sentence about the number {i}." for i in range(32)]

    def complete(prompt: str) -> str:
        return client.completions.create(model=MODEL, prompt=prompt, max_tokens=12, temperature=0).choices[0].text

    sequential = [complete(p) for p in prompts]
    with concurrent.futures.ThreadPoolExecutor(32) as pool:
        assert list(pool.map(complete, prompts)) == sequential


# ---- errors -------------------------------------------------------------------------------------------


@pytest.mark.parametrize("path, body, status, param", [
    ("/v1/completions", b"{bad json", 400, None),
    ("/v1/completions", b"[1, 2]", 400, None),
    ("/v1/completions", {"model": MODEL, "prompt": "hi", "temperature": "hot"}, 400, "temperature"),
    ("/v1/completions", {"model": MODEL, "prompt": "hi", "max_tokens": -1}, 400, "max_tokens"),
    ("/v1/completions", {"model": MODEL, "prompt": "hi", "max_tokens": True}, 400, "max_tokens"),
    ("/v1/completions", {"model": MODEL, "prompt": 7}, 400, "prompt"),
    ("/v1/completions", {"model": MODEL, "prompt": "hi", "suffix": "!"}, 400, "suffix"),
    ("/v1/completions", {"model": MODEL, "prompt": "hi", "top_p": 0}, 400, "top_p"),
    ("/v1/completions", {"model": "no-such-model", "prompt": "hi"}, 404, "model"),
    ("/v1/chat/completions", {"model": MODEL, "messages": []}, 400, "messages"),
    ("/v1/chat/completions", {"model": MODEL, "messages": [{"content": "no role"}]}, 400, "messages"),
    ("/v1/chat/completions", {"model": MODEL, "messages": "hi"}, 400, "messages"),
    ("/v1/completions", {"model": MODEL, "prompt": "word " * 9000}, 400, None),
    ("/generate", {"text": "hi", "sampling_params": {"nonsense": 1}}, 400, "sampling_params"),
    ("/generate", {"input_ids": [-1, 2]}, 400, "input_ids"),
    ("/generate", {"text": "hi", "routed_dp_rank": 1}, 400, "routed_dp_rank"),   # one group: rank 0 only
    ("/generate", {"text": "hi", "data_parallel_rank": -1}, 400, "data_parallel_rank"),
    ("/generate", {"text": "hi", "routed_dp_rank": 0, "data_parallel_rank": 1}, 400, "routed_dp_rank"),
])
def test_bad_input_gets_an_openai_error_and_the_server_keeps_serving(server, client, path, body, status, param):
    response = post(server, path, body)
    assert response.status_code == status, response.text
    error = response.json()["error"]
    assert set(error) == {"message", "type", "param", "code"} and error["code"] == status and error["message"]
    assert error["param"] == param
    assert client.completions.create(model=MODEL, prompt="hi", max_tokens=2).choices


@pytest.mark.parametrize("rank, status, param", [("0", 200, None), ("1", 400, "routed_dp_rank"),
                                                ("first", 400, "X-Data-Parallel-Rank")])
def test_the_data_parallel_rank_header_names_a_group_that_exists(server, rank, status, param):
    response = httpx.post(f"{server.base}/v1/completions", headers={**AUTH, "X-Data-Parallel-Rank": rank},
                          json={"model": MODEL, "prompt": "hi", "max_tokens": 2}, timeout=120)
    assert response.status_code == status, response.text
    if status != 200:
        assert response.json()["error"]["param"] == param


def test_api_key_is_required_except_for_health(server):
    assert httpx.get(f"{server.base}/health").status_code == 200
    missing = httpx.get(f"{server.base}/v1/models")
    assert missing.status_code == 401 and missing.json()["error"]["type"] == "authentication_error"
    assert httpx.get(f"{server.base}/v1/models", headers={"Authorization": "Bearer wrong"}).status_code == 401


# ---- native routes -----------------------------------------------------------------------------------


def test_native_generate_routes(server):
    one = post(server, "/generate", {"text": "The capital of France is",
                                     "sampling_params": {"max_new_tokens": 4, "temperature": 0},
                                     "return_logprob": True, "top_logprobs_num": 2}).json()
    assert one["meta_info"]["completion_tokens"] == 4 and len(one["output_ids"]) == 4
    assert [t for _, t, _ in one["meta_info"]["output_token_logprobs"]] == one["output_ids"]
    by_ids = post(server, "/generate", {"input_ids": [504, 3575, 282, 4649, 314],
                                        "sampling_params": {"max_new_tokens": 4, "temperature": 0}}).json()
    assert by_ids["meta_info"]["prompt_tokens"] == 5
    batch = post(server, "/generate", {"text": ["a", "b"], "sampling_params": {"max_new_tokens": 2}}).json()
    assert len(batch) == 2
    with httpx.stream("POST", f"{server.base}/generate", headers=AUTH, timeout=60,
                      json={"text": "Hello", "stream": True, "sampling_params": {"max_new_tokens": 5}}) as response:
        events = [json.loads(line[6:]) for line in response.iter_lines() if line.startswith("data: {")]
    assert [len(e["output_ids"]) for e in events] == [1, 2, 3, 4, 5]  # cumulative without --stream-output


def test_info_health_and_cache_routes(server):
    assert httpx.get(f"{server.base}/health_generate").status_code == 200
    info = httpx.get(f"{server.base}/get_model_info", headers=AUTH).json()
    assert info["is_generation"] and info["architectures"] == ["LlamaForCausalLM"]
    server_info = httpx.get(f"{server.base}/get_server_info", headers=AUTH).json()
    assert server_info["port"] == server.port and "api_key" not in server_info
    assert server_info["scheduler"]["kv_capacity_tokens"] > 0
    assert post(server, "/flush_cache", {}).status_code == 200
    assert server.scheduler_status()["kv_tokens_in_use"] == 0


def test_abort_request_route(server):
    results = []

    def stream():
        with httpx.stream("POST", f"{server.base}/generate", headers=AUTH, timeout=60, json={
                "text": "Count:", "rid": "abort-me", "stream": True,
                "sampling_params": {"max_new_tokens": 2000, "ignore_eos": True}}) as response:
            results.extend(json.loads(line[6:]) for line in response.iter_lines() if line.startswith("data: {"))

    thread = threading.Thread(target=stream)
    thread.start()
    time.sleep(1.0)
    assert post(server, "/abort_request", {"rid": "abort-me"}).status_code == 200
    thread.join(timeout=30)
    assert results[-1]["meta_info"]["finish_reason"]["type"] == "abort"
    assert results[-1]["meta_info"]["completion_tokens"] < 2000


def wait_until_idle(server: Server) -> dict:
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline:
        status = server.scheduler_status()
        if status["running_requests"] == 0 and status["waiting_requests"] == 0:
            return status
        time.sleep(0.1)
    raise AssertionError(f"still busy: {status}")


def test_a_client_that_disconnects_frees_its_request(server):
    long = {"model": MODEL, "prompt": "Count to a million:", "max_tokens": 3000, "ignore_eos": True}
    with httpx.stream("POST", f"{server.base}/v1/completions", headers=AUTH, json={**long, "stream": True}) as response:
        for i, _ in enumerate(response.iter_lines()):
            if i > 5:
                break
    assert wait_until_idle(server)
    with pytest.raises(httpx.ReadTimeout):
        httpx.post(f"{server.base}/v1/completions", json=long, headers=AUTH, timeout=1.0)
    started = time.monotonic()
    wait_until_idle(server)
    assert time.monotonic() - started < 5
    assert post(server, "/flush_cache", {}).status_code == 200
    assert server.scheduler_status()["kv_tokens_in_use"] == 0


def test_health_answers_fast_during_a_long_prefill(server):
    body = {"model": MODEL, "prompt": "The quick brown fox jumps over the lazy dog. " * 200, "max_tokens": 1}
    worker = threading.Thread(target=post, args=(server, "/v1/completions", body))
    worker.start()
    time.sleep(0.3)
    latencies = []
    probe = httpx.Client()  # one connection: a new client alone costs ~25 ms of set-up
    while worker.is_alive():
        started = time.monotonic()
        assert probe.get(f"{server.base}/health").status_code == 200
        latencies.append(time.monotonic() - started)
        time.sleep(0.05)
    print(f"{len(latencies)} probes during the prefill")
    worker.join()
    # An event loop blocked by the prefill would hold a probe for most of the prefill (seconds);
    # one slow probe of ~0.1 s is the OS giving both cores to torch for a moment, not a block.
    assert len(latencies) >= 10, "the prefill finished too fast to measure"
    assert statistics.median(latencies) < 0.05, latencies
    assert max(latencies) < 0.5, latencies


@pytest.mark.parametrize("prefix", ["", "/v1"])
def test_tokenize_and_detokenize_round_trip_as_the_tokenizer_does(server, default_model_dir, prefix):
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(default_model_dir)
    texts = ["Hello, world!", "<|im_start|>user\nhi<|im_end|>"]
    one = post(server, f"{prefix}/tokenize", {"prompt": texts[0]}).json()
    assert one["tokens"] == tokenizer.encode(texts[0]) and one["count"] == len(one["tokens"])
    assert one["max_model_len"] > 0
    both = post(server, f"{prefix}/tokenize", {"prompt": texts, "add_special_tokens": False}).json()
    assert both["tokens"] == [tokenizer.encode(t, add_special_tokens=False) for t in texts]
    assert both["count"] == [len(t) for t in both["tokens"]]
    assert post(server, f"{prefix}/detokenize", {"tokens": one["tokens"]}).json() == {"text": texts[0]}
    texts_back = post(server, f"{prefix}/detokenize", {"tokens": both["tokens"], "skip_special_tokens": True}).json()
    assert texts_back["text"] == [tokenizer.decode(t, skip_special_tokens=True) for t in both["tokens"]]


@pytest.mark.parametrize("path,body,param", [
    ("/tokenize", {}, "prompt"), ("/tokenize", {"prompt": 5}, "prompt"), ("/tokenize", {"prompt": []}, "prompt"),
    ("/detokenize", {"tokens": []}, "tokens"), ("/detokenize", {"tokens": [1, -2]}, "tokens"),
    ("/v1/detokenize", {"tokens": [10 ** 9]}, "tokens")])
def test_tokenize_routes_refuse_bad_input_with_an_error_object(server, path, body, param):
    response = post(server, path, body)
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert error["code"] == 400 and error["param"] == param, error


# ---- flags and process life ---------------------------------------------------------------------------


def test_server_flags(tmp_path, default_model_dir):
    from transformers import AutoTokenizer

    template = tmp_path / "template.jinja"
    template.write_text("{% for m in messages %}[{{ m.role }}] {{ m.content }}\n{% endfor %}[assistant]")
    server = Server("--max-queued-requests", "1", "--allow-auto-truncate", "--stream-output", "--log-requests",
                    "--log-requests-level", "0", "--context-length", "64", "--skip-server-warmup",
                    "--served-model-name", "my-model", "--chat-template", str(template), "--stream-interval", "2",
                    "--tokenizer-path", str(default_model_dir), "--preferred-sampling-params", '{"temperature": 0.6}')
    try:
        client = openai.OpenAI(base_url=f"{server.base}/v1", api_key="unused")
        assert [m.id for m in client.models.list().data] == ["my-model"]
        info = httpx.get(f"{server.base}/get_model_info").json()
        assert info["preferred_sampling_params"] == {"temperature": 0.6}
        reply = client.chat.completions.create(model="my-model", max_tokens=1,
                                               messages=[{"role": "user", "content": "Hi there"}])
        tokenizer = AutoTokenizer.from_pretrained(default_model_dir)
        assert reply.usage.prompt_tokens == len(tokenizer.encode("[user] Hi there\n[assistant]"))
        long = post(server, "/generate", {"text": "secret words " * 50, "sampling_params": {"max_new_tokens": 2}})
        assert long.status_code == 200 and long.json()["meta_info"]["prompt_tokens"] == 63
        with httpx.stream("POST", f"{server.base}/generate", timeout=60, json={
                "text": "Hello", "stream": True, "sampling_params": {"max_new_tokens": 4, "ignore_eos": True}}) as r:
            events = [json.loads(line[6:]) for line in r.iter_lines() if line.startswith("data: {")]
        # --stream-interval 2 with --stream-output: two new tokens per event
        assert [len(e["output_ids"]) for e in events] == [2, 2]
        statuses = []

        def request() -> None:
            statuses.append(post(server, "/generate", {"text": "Count:", "sampling_params": {
                "max_new_tokens": 400, "ignore_eos": True}}))

        threads = [threading.Thread(target=request) for _ in range(4)]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join()
        refused = [r for r in statuses if r.status_code == 503]
        assert refused and all(r.headers["retry-after"] == "1" for r in refused)
        assert any(r.status_code == 200 for r in statuses)
    finally:
        assert server.stop() == 0
    logged = "".join(server.output)
    assert "request /generate" in logged and "secret words" not in logged


def test_scheduler_death_fails_requests_and_exits_non_zero(tmp_path):
    # A KV cache that holds the long request whatever memory the machine has free now (sized from
    # free memory, the default can be smaller than the request when the page cache is large).
    server = Server("--crash-dump-folder", str(tmp_path / "dumps"), "--skip-server-warmup",
                    "--max-total-tokens", "8192")
    children = descendants(server.process.pid)
    scheduler = server.scheduler_status()["pid"]
    assert scheduler in children
    outcome = {}

    def request() -> None:
        outcome["response"] = post(server, "/v1/completions", {"prompt": "Count:", "max_tokens": 3000,
                                                               "ignore_eos": True})

    thread = threading.Thread(target=request)
    thread.start()
    time.sleep(1.0)
    os.kill(scheduler, signal.SIGKILL)
    thread.join(timeout=30)
    response = outcome["response"]
    assert response.status_code >= 500 and "scheduler process died" in response.json()["error"]["message"]
    assert server.process.wait(timeout=30) != 0
    assert_gone(children)
    [dump] = (tmp_path / "dumps").glob("crash_dump_*.json")
    assert json.loads(dump.read_text())["requests"][0]["body"]["prompt"] == "Count:"


@pytest.mark.parametrize("signum", [signal.SIGTERM, signal.SIGINT])
def test_signals_shut_down_cleanly_with_no_orphans(signum, tmp_path):
    server = Server("--skip-server-warmup", env={"TMPDIR": str(tmp_path)})
    children = descendants(server.process.pid)
    assert children
    assert [p.name for p in tmp_path.glob("srv-*/*")] != []    # the ZMQ sockets' folder
    assert server.stop(signum) == 0
    assert_gone(children)
    assert list(tmp_path.glob("srv-*")) == []


HANGING_ATTENTION = """
import time

from srv.sdk import hookimpl
from srv.sdk.attention import AttentionBackend


class HangingAttention(AttentionBackend):
    def attend(self, q, layer_id, batch):
        time.sleep(3600)


@hookimpl
def srv_register_attention_backends(register):
    register("hang", HangingAttention, description="never returns (watchdog test)")
"""


def test_watchdog_ends_a_forward_pass_that_never_returns(fake_dists, monkeypatch):
    fake_dists.add("srv-hang", {"hang": "hang_plugin"}, {"hang_plugin": HANGING_ATTENTION})
    monkeypatch.setenv("PYTHONPATH", fake_dists.env["PYTHONPATH"])
    server = Server("--attention-backend", "hang", "--watchdog-timeout", "3", "--skip-server-warmup")
    started = time.monotonic()
    response = post(server, "/v1/completions", {"prompt": "hi", "max_tokens": 2})
    assert response.status_code >= 500 and "exit code 3" in response.json()["error"]["message"]
    assert server.process.wait(timeout=30) != 0
    assert time.monotonic() - started < 30


def test_skip_tokenizer_init_serves_token_ids():
    server = Server("--skip-tokenizer-init", "--skip-server-warmup")
    try:
        result = post(server, "/generate", {"input_ids": [504, 3575, 282, 4649, 314],
                                            "sampling_params": {"max_new_tokens": 3, "temperature": 0}}).json()
        assert len(result["output_ids"]) == 3 and result["text"] == ""
        assert post(server, "/generate", {"text": "hi"}).status_code == 400
        chat = post(server, "/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}]})
        assert chat.status_code == 400 and "--skip-tokenizer-init" in chat.json()["error"]["message"]
    finally:
        assert server.stop() == 0


def test_the_scheduler_does_not_outlive_a_killed_server(tmp_path):
    """Nor does the folder of their sockets (in TMPDIR), which the server had no time to remove."""
    server = Server("--skip-server-warmup", env={"TMPDIR": str(tmp_path)})
    scheduler = server.scheduler_status()["pid"]
    def socket_folders() -> list[Path]:
        return [p for p in tmp_path.iterdir() if p.name.startswith("srv-")]

    assert len(socket_folders()) == 1
    server.process.kill()
    server.process.wait()
    assert_gone({scheduler})
    assert socket_folders() == []


def test_http_process_reaches_the_scheduler_start_without_torch():
    """Importing torch takes seconds; the scheduler process needs it, the HTTP process does not
    before it starts that process (launch time, W4 in BENCHMARKS.md)."""
    code = ("import sys\n"
            "from srv.plugin_manager import PluginManager\n"
            "from srv.args.parser import parse_launch_args\n"
            "manager = PluginManager(); manager.load_entry_points(); registry = manager.build_registry()\n"
            "parse_launch_args([], manager, registry)\n"
            "import srv.server.launch\n"
            "print(sorted(m for m in ('torch', 'transformers') if m in sys.modules))\n")
    assert printed_by(code) == "[]"


def test_early_scheduler_entry_point_imports_only_the_standard_library():
    """The spawned scheduler process unpickles its entry point before it imports torch: the
    module that holds it must not delay that (zmq and srv's engine modules are imported after)."""
    code = ("import sys\n"
            "before = set(sys.modules)\n"
            "import srv.server.early_scheduler\n"
            "new = set(sys.modules) - before\n"
            "print(sorted(m for m in new if m.split('.')[0] not in sys.stdlib_module_names and m != 'srv' "
            "and m not in ('__mp_main__', 'srv.server', 'srv.server.early_scheduler')))\n")
    assert printed_by(code) == "[]"


def printed_by(code: str) -> str:
    """What a fresh Python process running `code` prints."""
    return subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout.strip()


def test_score_route_gives_label_probabilities_after_query_and_item(server, default_model_dir):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(default_model_dir)
    model = AutoModelForCausalLM.from_pretrained(default_model_dir, dtype=torch.float32).eval()
    labels = [tokenizer.encode(w, add_special_tokens=False)[0] for w in (" yes", " no", " maybe")]
    query, items = "Is the sky blue? Answer:", [" I think", " Surely", " Well,"]

    def reference(text: str) -> list[float]:
        with torch.inference_mode():
            logits = model(torch.tensor([tokenizer.encode(text)])).logits[0, -1]
        return torch.log_softmax(logits.float(), -1)[labels].tolist()

    body = {"model": MODEL, "query": query, "items": items, "label_token_ids": labels}
    response = post(server, "/v1/score", body).json()
    assert response["object"] == "scoring" and response["usage"]["prompt_tokens"] > 0
    for item, got in zip(items, response["scores"]):
        assert got == pytest.approx([math.exp(v) for v in reference(query + item)], rel=2e-3)
    softmaxed = post(server, "/v1/score", {**body, "apply_softmax": True}).json()["scores"]
    assert all(sum(row) == pytest.approx(1) for row in softmaxed)
    first = post(server, "/v1/score", {**body, "items": items[0], "item_first": True}).json()["scores"][0]
    assert first == pytest.approx([math.exp(v) for v in reference(items[0] + query)], rel=2e-3)
    ids = post(server, "/v1/score", {**body, "query": tokenizer.encode(query),
                                     "items": [tokenizer.encode(i, add_special_tokens=False) for i in items]})
    for got, want in zip(ids.json()["scores"], response["scores"]):
        assert got == pytest.approx(want, rel=1e-4)
    assert post(server, "/v1/rerank", {"query": "a", "documents": ["b"]}).status_code == 400   # not an embedding model
    for bad, param in [({**body, "label_token_ids": []}, "label_token_ids"),
                       ({**body, "label_token_ids": [10**7]}, "token_ids_logprob"),
                       ({**body, "items": [[1, 2]]}, "items")]:
        answer = post(server, "/v1/score", bad)
        assert answer.status_code == 400 and answer.json()["error"]["param"] == param, answer.text


# ---- operations routes ----------------------------------------------------------------------------


def generate_in_background(server: Server, body: dict) -> tuple[threading.Thread, list]:
    results: list = []
    thread = threading.Thread(target=lambda: results.append(post(server, "/generate", body).json()))
    thread.start()
    return thread, results


def wait_for_load(server: Server, requests: int) -> None:
    deadline = time.monotonic() + 30
    while httpx.get(f"{server.base}/get_load", headers=AUTH).json()[0]["num_reqs"] < requests:
        assert time.monotonic() < deadline, "the requests never reached the scheduler"
        time.sleep(0.05)


def test_ping_get_load_and_put_generate(server):
    assert httpx.get(f"{server.base}/ping", headers=AUTH).text == "pong"
    [load] = httpx.get(f"{server.base}/get_load", headers=AUTH).json()
    assert load["dp_rank"] == 0 and {"num_reqs", "num_waiting_reqs", "num_tokens"} <= set(load)
    body = {"text": "Hi", "sampling_params": {"max_new_tokens": 2, "temperature": 0}}
    put = httpx.put(f"{server.base}/generate", json=body, headers=AUTH, timeout=60).json()
    assert put["output_ids"] == post(server, "/generate", body).json()["output_ids"]


@pytest.mark.parametrize("mode", ["in_place", "retract"])
def test_a_paused_server_holds_its_requests_and_continues_them(server, mode):
    body = {"text": "Count to ten:", "sampling_params": {"max_new_tokens": 24, "temperature": 0, "ignore_eos": True}}
    alone = post(server, "/generate", body).json()["output_ids"]
    thread, results = generate_in_background(server, body)
    wait_for_load(server, 1)
    assert post(server, "/pause_generation", {"mode": mode}).json()["success"]
    time.sleep(1.0)
    assert thread.is_alive() and httpx.get(f"{server.base}/get_load", headers=AUTH).json()[0]["num_reqs"] == 1
    assert post(server, "/continue_generation", b"").status_code == 200
    thread.join(timeout=60)
    assert results[0]["output_ids"] == alone   # greedy, and resumed where it stood


def test_pause_with_abort_and_abort_all_end_the_requests(server):
    body = {"text": "Count:", "sampling_params": {"max_new_tokens": 2000, "ignore_eos": True}}
    thread, results = generate_in_background(server, body)
    wait_for_load(server, 1)
    assert post(server, "/pause_generation", b"").status_code == 200    # mode "abort" by default
    thread.join(timeout=30)
    assert results[0]["meta_info"]["finish_reason"]["type"] == "abort"
    post(server, "/continue_generation", b"")
    threads = [generate_in_background(server, body) for _ in range(2)]
    wait_for_load(server, 2)
    assert post(server, "/abort_request", {"abort_all": True}).status_code == 200
    for thread, results in threads:
        thread.join(timeout=30)
        assert results[0]["meta_info"]["finish_reason"]["type"] == "abort"
    assert post(server, "/abort_request", {}).json()["error"]["param"] == "rid"
    assert post(server, "/pause_generation", {"mode": "later"}).status_code == 400


def test_profile_routes_write_a_chrome_trace(server, tmp_path):
    import gzip

    started = post(server, "/start_profile", {"output_dir": str(tmp_path), "num_steps": 2, "profile_id": "t"}).json()
    assert started["path"] == str(tmp_path / "t-TP-0.trace.json.gz")
    post(server, "/generate", {"text": "Hi", "sampling_params": {"max_new_tokens": 4}})
    trace = json.loads(gzip.decompress(Path(started["path"]).read_bytes()))
    assert trace["traceEvents"]
    assert post(server, "/stop_profile", b"").status_code == 400    # it stopped after its two steps
    assert post(server, "/start_profile", {"activities": ["GPU"]}).status_code == 400
    post(server, "/start_profile", {"output_dir": str(tmp_path)})
    assert post(server, "/start_profile", {"output_dir": str(tmp_path)}).status_code == 400   # one at a time
    assert Path(post(server, "/stop_profile", b"").json()["path"]).exists()


def test_configure_logging_turns_request_logs_on_and_off(server):
    answer = post(server, "/configure_logging", {"log_requests": True, "log_requests_level": 2}).json()
    assert answer["log_requests"] is True and answer["log_requests_level"] == 2
    post(server, "/generate", {"text": "logged-prompt-xyz", "sampling_params": {"max_new_tokens": 1}})
    post(server, "/configure_logging", {"log_requests": False})
    deadline = time.monotonic() + 5
    while not any("logged-prompt-xyz" in line for line in server.output) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert any("logged-prompt-xyz" in line for line in server.output)
    assert post(server, "/configure_logging", {"log_requests_level": 7}).status_code == 400


def test_parse_function_call_route(server):
    tools = [{"type": "function", "function": {"name": "get_weather", "parameters": {"type": "object"}}}]
    text = 'Let me check. <tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>'
    answer = post(server, "/parse_function_call", {"text": text, "tools": tools}).json()
    assert answer["normal_text"] == "Let me check."
    assert answer["calls"] == [{"tool_index": 0, "name": "get_weather", "parameters": '{"city": "Paris"}'}]
    kimi = ("<|tool_calls_section_begin|><|tool_call_begin|>functions.get_weather:0<|tool_call_argument_begin|>"
            '{"city": "Rome"}<|tool_call_end|><|tool_calls_section_end|>')
    answer = post(server, "/parse_function_call", {"text": kimi, "tool_call_parser": "kimi_k2", "tools": tools}).json()
    assert [(c["name"], json.loads(c["parameters"])) for c in answer["calls"]] == [("get_weather", {"city": "Rome"})]
    assert post(server, "/parse_function_call", {"text": "x", "tool_call_parser": "nope"}).status_code == 400


# ---- sessions -------------------------------------------------------------------------------------


def test_a_session_continues_its_turns_and_keeps_their_kv(server):
    sid = post(server, "/open_session", {"capacity_of_str_len": 400}).json()
    first_ids, more = list(range(1000, 1040)), list(range(2000, 2010))
    params = {"max_new_tokens": 6, "temperature": 0, "ignore_eos": True}

    def turn(ids, **session):
        return post(server, "/generate", {"input_ids": ids, "sampling_params": params,
                                          "session_params": {"id": sid, **session}}).json()

    def plain(ids):
        return post(server, "/generate", {"input_ids": ids, "sampling_params": params}).json()["output_ids"]

    first = turn(first_ids)
    assert first["output_ids"] == plain(first_ids)
    second = turn(more)   # continues the latest turn: its prompt and output, then the new ids
    context = first_ids + first["output_ids"] + more
    assert second["meta_info"]["prompt_tokens"] == len(context) and second["output_ids"] == plain(context)
    assert second["meta_info"]["cached_tokens"] >= 32
    # A branch from the first turn without its output, and one cut at an offset.
    branch = turn(more, rid=first["meta_info"]["id"], drop_previous_output=True)
    assert branch["meta_info"]["prompt_tokens"] == len(first_ids + more)
    cut = turn(more, rid=first["meta_info"]["id"], offset=10)
    assert cut["output_ids"] == plain(first_ids[:10] + more)
    # The latest turn's KV is locked in the prefix cache: no flush while the session is open.
    assert post(server, "/flush_cache", b"").status_code == 400
    for body, param in [({"input_ids": more, "session_params": {"id": "nope"}}, "session_params"),
                        ({"input_ids": list(range(3000, 3400)), "session_params": {"id": sid}}, "session_params"),
                        ({"input_ids": [more, more], "session_params": {"id": sid}}, "session_params"),
                        ({"input_ids": more, "sampling_params": {"n": 2}, "session_params": {"id": sid}}, "n")]:
        answer = post(server, "/generate", body)
        assert answer.status_code == 400 and answer.json()["error"]["param"] == param, answer.text
    assert post(server, "/close_session", {"session_id": sid}).status_code == 200
    assert post(server, "/close_session", {"session_id": sid}).status_code == 400
    assert post(server, "/flush_cache", b"").status_code == 200
