"""A bounded storm of mixed traffic against a running srv server, from a process of its own.

    python tests/storm.py --base-url http://127.0.0.1:30000 --api-key K --requests 300 --concurrency 32

Completions and chat, streamed or not, n=2, logprobs, stop strings, JSON modes and regexes; a
tenth of the clients leave in the middle of a stream; a tenth send malformed or hostile bodies.
It prints one JSON summary: statuses, 5xx answers, hostile bodies not answered with a 4xx error
object, requests past their deadline, KV memory before and after, and whether greedy output is
the same after the storm as before. Exit status 0 when nothing broke.
"""

from __future__ import annotations

import argparse
import asyncio
import collections
import json
import random
import sys
import time
from typing import Any, Awaitable, Callable

import httpx

MODEL = "SmolLM2-135M-Instruct"
PROMPTS = ["The capital of France is", "Once upon a time", "List three colours:", "def add(a, b):",
           "The weather today", "Write a haiku about the sea.", "1, 2, 3,", "Translate 'cat' to French:"]
GREEDY_PROBES = [{"prompt": "The capital of France is", "max_tokens": 12, "temperature": 0},
                 {"prompt": "Once upon a time", "max_tokens": 12, "temperature": 0, "stop": [","]}]


def hostile_bodies(vocab_size: int) -> list[tuple[str, str, bytes, dict[str, str]]]:
    """(method, path, body, extra headers) a careless or hostile client sends."""
    def body(value: Any) -> bytes:
        return json.dumps(value).encode()

    chat = "/v1/chat/completions"
    return [
        ("POST", "/v1/completions", body({"prompt": [vocab_size], "max_tokens": 1}), {}),
        ("POST", "/v1/completions", body({"prompt": [[1, 2], [vocab_size + 5]], "max_tokens": 1}), {}),
        ("POST", "/generate", body({"input_ids": [vocab_size * 3], "sampling_params": {"max_new_tokens": 1}}), {}),
        ("POST", "/v1/completions", body({"prompt": "hi", "max_tokens": 10**9}), {}),
        ("POST", "/v1/completions", b'{"prompt": ' + b"[" * 100_000 + b"]" * 100_000 + b"}", {}),
        ("POST", "/v1/completions", b'{"prompt": "a \\ud800 b", "max_tokens": 2}', {}),
        ("POST", chat, b'{"messages": [{"role": "user", "content": "x \\udfff"}]}', {}),
        ("POST", "/v1/completions", body({"prompt": "hi", "n": 1000}), {}),
        ("POST", "/v1/completions", body({"prompt": "hi"}), {"content-type": "text/plain"}),
        ("POST", "/v1/completions", b"{not json", {}),
        ("POST", "/v1/completions", b"\xff\xfe\x00garbage", {}),
        ("POST", "/v1/completions", body([1, 2, 3]), {}),
        ("POST", "/v1/completions", body({"prompt": "hi", "temperature": "hot"}), {}),
        ("POST", "/v1/completions", body({"prompt": "hi", "max_tokens": 1e400}), {}),
        ("POST", "/v1/completions", b'{"prompt": "hi", "temperature": NaN}', {}),
        ("POST", "/v1/completions", body({"prompt": "hi", "top_k": 0}), {}),
        ("POST", "/v1/completions", body({"prompt": "hi", "logit_bias": {"x": 1}}), {}),
        ("POST", "/v1/completions", body({"prompt": "hi", "stop": [""]}), {}),
        ("POST", "/v1/completions", body({"prompt": "hi", "regex": "("}), {}),
        ("POST", chat, body({"messages": []}), {}),
        ("POST", chat, body({"messages": [{"role": "wizard", "content": "x"}]}), {}),
        ("POST", chat, body({"messages": [{"role": "user", "content": [{"type": "image_url"}]}]}), {}),
        ("POST", chat, body({"messages": [{"role": "user", "content": "x"}], "tool_choice": "required"}), {}),
        ("POST", chat, body({"messages": [{"role": "user", "content": "x"}], "response_format": {"type": "xml"}}), {}),
        ("POST", "/generate", body({"text": "hi", "sampling_params": {"nonsense": True}}), {}),
        ("POST", "/generate", body({"text": ["a", "b"], "sampling_params": [{}]}), {}),
        ("POST", "/abort_request", body({}), {}),
        ("GET", "/v1/completions", b"", {}),
        ("POST", "/no/such/route", body({}), {}),
        ("POST", "/v1/completions", b"x" * (5 * 2**20), {}),
    ]


class Storm:
    def __init__(self, args: argparse.Namespace) -> None:
        self.args = args
        self.base = args.base_url.rstrip("/")
        self.headers = {"Authorization": f"Bearer {args.api_key}"} if args.api_key else {}
        self.random = random.Random(args.seed)
        self.statuses: collections.Counter[str] = collections.Counter()
        self.server_errors: list[str] = []
        self.hostile_failures: list[str] = []
        self.late: list[str] = []
        self.transport_errors: list[str] = []
        self.durations: list[float] = []
        self.hostile_sent = 0    # each hostile body in turn, so that every one is sent

    async def json(self, client: httpx.AsyncClient, method: str, path: str, body: Any = None) -> Any:
        for attempt in range(3):   # the storm's own calls, outside what it measures
            try:
                response = await client.request(method, self.base + path, json=body, headers=self.headers,
                                                timeout=120)
                break
            except httpx.TransportError:
                if attempt == 2:
                    raise
                await asyncio.sleep(1.0)
        response.raise_for_status()
        return response.json() if response.headers.get("content-type", "").startswith("application/json") else None

    async def status(self, client: httpx.AsyncClient) -> dict[str, Any]:
        return (await self.json(client, "GET", "/get_server_info"))["scheduler"]

    async def wait_idle(self, client: httpx.AsyncClient) -> dict[str, Any]:
        deadline = time.monotonic() + 60
        while True:
            status = await self.status(client)
            if status["running_requests"] == 0 and status["waiting_requests"] == 0 or time.monotonic() > deadline:
                return status
            await asyncio.sleep(0.2)

    async def greedy(self, client: httpx.AsyncClient) -> list[str]:
        return [(await self.json(client, "POST", "/v1/completions", {"model": MODEL, **p}))["choices"][0]["text"]
                for p in GREEDY_PROBES]

    # ---- the traffic ---------------------------------------------------------------------------

    def normal_request(self) -> tuple[str, dict[str, Any], bool]:
        """(path, body, streamed) of one ordinary request, its options drawn at random."""
        r = self.random
        prompt = r.choice(PROMPTS)
        common: dict[str, Any] = {"model": MODEL, "max_tokens": r.randint(1, 12),
                                  "temperature": r.choice([0, 0, 0.7, 1.0]), "seed": r.choice([None, 7])}
        if r.random() < 0.3:
            common["stop"] = r.choice([".", ["\n", ","], [" the"]])
        stream = r.random() < 0.4
        kind = r.random()
        if kind < 0.35:
            body = {**common, "prompt": prompt, "stream": stream}
            if not stream and r.random() < 0.3:
                body["n"] = 2
            if r.random() < 0.3:
                body["logprobs"] = 2
            return "/v1/completions", body, stream
        if kind < 0.75:
            body = {**common, "messages": [{"role": "user", "content": prompt}], "stream": stream}
            if r.random() < 0.3:
                body.update(logprobs=True, top_logprobs=r.choice([0, 3]))
            if r.random() < 0.25:
                body["response_format"] = r.choice([{"type": "json_object"}, {"type": "json_schema", "json_schema": {
                    "name": "x", "schema": {"type": "object", "properties": {"a": {"type": "integer"}}}}}])
            if not stream and r.random() < 0.2:
                body["n"] = 2
            return "/v1/chat/completions", body, stream
        params = {"max_new_tokens": common["max_tokens"], "temperature": common["temperature"]}
        if r.random() < 0.4:
            kind = r.choice(["regex", "json_schema"])
            params[kind] = "[a-z ]+" if kind == "regex" else '{"type": "object"}'
        return "/generate", {"text": prompt, "sampling_params": params, "stream": stream,
                             "return_logprob": r.random() < 0.3, "top_logprobs_num": 2}, stream

    async def one(self, client: httpx.AsyncClient, index: int, hostile: list) -> None:
        r = self.random
        draw = r.random()
        started = time.monotonic()
        label = ""
        try:
            if draw < 0.1:
                method, path, body, extra = hostile[self.hostile_sent % len(hostile)]
                self.hostile_sent += 1
                label = f"hostile {method} {path} {body[:60]!r}"
                response = await client.request(method, self.base + path, content=body,
                                                headers={"content-type": "application/json", **self.headers, **extra},
                                                timeout=self.args.deadline)
                self.record(label, response.status_code)
                if not 400 <= response.status_code < 500:
                    self.hostile_failures.append(f"{label}: {response.status_code}")
                elif not _is_error_object(response):
                    self.hostile_failures.append(f"{label}: {response.status_code} without an error object")
            elif draw < 0.2:
                path, body, _ = self.normal_request()
                body = {**body, "stream": True, "max_tokens": 64, "n": 1}
                if path == "/generate":
                    body["sampling_params"]["max_new_tokens"] = 64
                label = f"disconnect {path}"
                async with client.stream("POST", self.base + path, json=body, headers=self.headers,
                                         timeout=self.args.deadline) as response:
                    self.record(label, response.status_code)
                    lines = 0
                    async for _ in response.aiter_lines():
                        lines += 1
                        if lines >= r.randint(1, 4):
                            break   # leaving the `async with` closes the connection mid-stream
            else:
                path, body, stream = self.normal_request()
                label = f"{'stream' if stream else 'plain'} {path}"
                if stream:
                    async with client.stream("POST", self.base + path, json=body, headers=self.headers,
                                             timeout=self.args.deadline) as response:
                        text = "".join([line async for line in response.aiter_lines()])
                        self.record(label, response.status_code)
                        if '"error"' in text and response.status_code == 200:
                            self.server_errors.append(f"{label}: an error event: {text[:200]}")
                else:
                    response = await client.post(self.base + path, json=body, headers=self.headers,
                                                 timeout=self.args.deadline)
                    self.record(label, response.status_code)
                    if response.status_code != 200:
                        self.server_errors.append(f"{label} {json.dumps(body)[:200]}: {response.status_code} "
                                                  f"{response.text[:200]}")
        except httpx.TimeoutException:
            self.late.append(label)
        except httpx.TransportError as exc:
            self.transport_errors.append(f"{label}: {type(exc).__name__}: {exc}")
        finally:
            self.durations.append(time.monotonic() - started)

    def record(self, label: str, status: int) -> None:
        self.statuses[str(status)] += 1
        if status >= 500:
            self.server_errors.append(f"{label}: {status}")

    async def run(self) -> dict[str, Any]:
        # Idle connections are dropped before uvicorn's keep-alive timeout (5 s) closes them: a
        # request on a connection the server is closing would fail in the client, not the server.
        limits = httpx.Limits(max_connections=self.args.concurrency * 2, keepalive_expiry=2.0)
        async with httpx.AsyncClient(limits=limits) as client:
            info = await self.json(client, "GET", "/get_model_info")
            hostile = hostile_bodies(info.get("vocab_size") or 49152)
            await self.json(client, "POST", "/flush_cache")
            before = await self.greedy(client)
            idle = await self.wait_idle(client)
            await self.json(client, "POST", "/flush_cache")
            kv_idle = (await self.status(client))["kv_tokens_in_use"]
            gate = asyncio.Semaphore(self.args.concurrency)
            started = time.monotonic()

            async def gated(i: int) -> None:
                async with gate:
                    await self.one(client, i, hostile)

            await asyncio.gather(*(gated(i) for i in range(self.args.requests)))
            elapsed = time.monotonic() - started
            idle = await self.wait_idle(client)
            cache_only = idle["kv_tokens_in_use"] == idle["prefix_cached_tokens"]
            after = await self.greedy(client)
            await self.wait_idle(client)
            await self.json(client, "POST", "/flush_cache")
            kv_after = (await self.status(client))["kv_tokens_in_use"]
            metrics = await client.get(self.base + "/metrics", headers=self.headers)
        durations = sorted(self.durations)
        return {
            "requests": self.args.requests, "concurrency": self.args.concurrency, "elapsed_s": round(elapsed, 1),
            "statuses": dict(sorted(self.statuses.items())), "server_errors": self.server_errors,
            "hostile_not_4xx_error_object": self.hostile_failures, "past_deadline": self.late,
            "transport_errors": self.transport_errors,
            "slowest_s": round(durations[-1], 2) if durations else 0.0,
            "p50_s": round(durations[len(durations) // 2], 2) if durations else 0.0,
            "kv_idle": kv_idle, "kv_after": kv_after, "idle_kv_held_only_by_the_prefix_cache": cache_only,
            "greedy_before": before, "greedy_after": after, "greedy_unchanged": before == after,
            "metrics_status": metrics.status_code,
        }


def _is_error_object(response: httpx.Response) -> bool:
    try:
        error = response.json()["error"]
    except (ValueError, KeyError, TypeError):
        return False
    return isinstance(error, dict) and {"message", "type", "param", "code"} <= set(error) and bool(error["message"])


def broke(summary: dict[str, Any]) -> list[str]:
    """What went wrong in a storm, from its summary (empty: nothing)."""
    problems = []
    for key in ("server_errors", "hostile_not_4xx_error_object", "past_deadline", "transport_errors"):
        if summary[key]:
            problems.append(f"{key}: {summary[key][:10]}")
    if summary["kv_after"] != summary["kv_idle"] or not summary["idle_kv_held_only_by_the_prefix_cache"]:
        problems.append(f"KV memory: idle {summary['kv_idle']}, after the storm {summary['kv_after']}")
    if not summary["greedy_unchanged"]:
        problems.append(f"greedy output changed: {summary['greedy_before']} -> {summary['greedy_after']}")
    if summary["metrics_status"] != 200:
        problems.append(f"/metrics answered {summary['metrics_status']}")
    return problems


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--base-url", required=True)
    parser.add_argument("--api-key")
    parser.add_argument("--requests", type=int, default=300)
    parser.add_argument("--concurrency", type=int, default=32)
    parser.add_argument("--deadline", type=float, default=120.0, help="seconds a request may take")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)
    summary = asyncio.run(Storm(args).run())
    summary["problems"] = broke(summary)
    print(json.dumps(summary, indent=1))
    return 1 if summary["problems"] else 0


if __name__ == "__main__":
    sys.exit(main())
