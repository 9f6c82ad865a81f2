"""`srv bench serve`: a load generator for any OpenAI-compatible server (srv, SGLang, vLLM,
llama.cpp's llama-server), in the manner of `sglang.bench_serving` with its random dataset.

Every request streams (`stream: true`, `stream_options.include_usage`) so the time to the first
token and the gaps between tokens come from the server-sent chunks; it asks for exactly
`max_tokens` tokens with `ignore_eos` at temperature 0. Arrivals follow a Poisson process of
`--request-rate` (all at once when infinite), with at most `--concurrency` requests in flight.
"""

from __future__ import annotations

import asyncio
import json
import logging
import math
import time
from dataclasses import dataclass, field
from typing import Any

import httpx

from srv.bench.prompts import Prompt, arrival_times, generate_prompts
from srv.engine.tokenizer import hf_tokenizer
from srv.bench.stats import RequestResult, per_token_gaps, summarize

logger = logging.getLogger("srv.bench")

ENDPOINTS = {"completions": "/v1/completions", "chat": "/v1/chat/completions"}


@dataclass
class ServeConfig:
    base_url: str = "http://127.0.0.1:30000"
    endpoint: str = "completions"
    model: str | None = None
    api_key: str | None = None
    concurrency: int | None = None
    request_rate: float = math.inf
    num_prompts: int = 100
    input_len: int = 1024
    output_len: int = 128
    range_ratio: float = 1.0
    shared_prefix_len: int = 0
    num_shared_prefixes: int = 1
    instruction: str = ""      # put before every prompt's words, on a line of its own
    seed: int = 0
    warmup_requests: int = 1
    fresh_connections: bool = False
    tokenizer: str | None = None
    timeout: float = 600.0
    disable_tqdm: bool = False
    extra_body: dict[str, Any] = field(default_factory=dict)   # merged into every request


def request_body(config: ServeConfig, model: str | None, prompt: Prompt) -> dict[str, Any]:
    body: dict[str, Any] = {
        "max_tokens": prompt.output_len, "temperature": 0.0, "ignore_eos": True,
        "stream": True, "stream_options": {"include_usage": True},
    }
    body.update(config.extra_body)
    if model is not None:
        body["model"] = model
    text = f"{config.instruction}\n\n{prompt.text}" if config.instruction else prompt.text
    if config.endpoint == "chat":
        body["messages"] = [{"role": "user", "content": text}]
    else:
        body["prompt"] = text
    return body


def chunk_text(choice: dict[str, Any]) -> str:
    """The text a streamed choice adds: `text` (completions) or `delta.content` (chat)."""
    if "text" in choice:
        return choice.get("text") or ""
    delta = choice.get("delta") or {}
    return (delta.get("content") or "") + (delta.get("reasoning_content") or "")


def error_message(payload: Any) -> str:
    if isinstance(payload, dict):
        error = payload.get("error", payload)
        if isinstance(error, dict):
            return str(error.get("message") or error)
        return str(error)
    return str(payload)


async def send_request(client: httpx.AsyncClient, url: str, headers: dict[str, str], body: dict[str, Any],
                       prompt: Prompt) -> RequestResult:
    """Send one streamed request and time its chunks; never raises."""
    result = RequestResult(prompt_len=prompt.input_len)
    text_times: list[float] = []
    choice_times: list[float] = []
    started = time.perf_counter()
    try:
        async with client.stream("POST", url, json=body, headers=headers) as response:
            if response.status_code != 200:
                raw = (await response.aread()).decode(errors="replace")
                try:
                    detail = error_message(json.loads(raw))
                except json.JSONDecodeError:
                    detail = raw.strip()[:300]
                result.error = f"HTTP {response.status_code}: {detail}"
                return result
            async for line in response.aiter_lines():
                line = line.strip()
                if not line.startswith("data:"):
                    continue       # blank lines, comments, event names
                payload = line[len("data:"):].strip()
                if payload == "[DONE]":
                    break
                now = time.perf_counter()
                data = json.loads(payload)
                if "error" in data:
                    result.error = f"stream error: {error_message(data)}"
                    return result
                usage = data.get("usage")
                if usage:
                    result.prompt_tokens = usage.get("prompt_tokens", result.prompt_tokens)
                    result.completion_tokens = usage.get("completion_tokens", result.completion_tokens)
                for choice in data.get("choices") or []:
                    choice_times.append(now)
                    if chunk_text(choice):
                        text_times.append(now)
            result.latency = time.perf_counter() - started
    except Exception as exc:   # noqa: BLE001 - a failed request is a result, not a crash
        result.error = f"{type(exc).__name__}: {exc}" if str(exc) else type(exc).__name__
        return result
    # Tokens that decode to no text (special tokens, held-back bytes) still arrive as chunks.
    times = text_times or choice_times
    result.chunks = len(times)
    if not times or result.output_tokens == 0:
        result.error = "the stream ended without any output token"
        return result
    result.ttft = times[0] - started
    result.itl = per_token_gaps(times, result.output_tokens)
    result.success = True
    return result


class Benchmark:
    def __init__(self, config: ServeConfig) -> None:
        self.config = config
        self.url = config.base_url.rstrip("/") + ENDPOINTS[config.endpoint]
        self.headers = {"Authorization": f"Bearer {config.api_key}"} if config.api_key else {}
        self.timeout = httpx.Timeout(config.timeout, connect=min(config.timeout, 30.0))

    def _client(self) -> httpx.AsyncClient:
        limit = self.config.concurrency if self.config.concurrency and not self.config.fresh_connections else None
        return httpx.AsyncClient(timeout=self.timeout, limits=httpx.Limits(
            max_connections=limit, max_keepalive_connections=limit))

    async def resolve_model(self, client: httpx.AsyncClient) -> str | None:
        if self.config.model:
            return self.config.model
        try:
            response = await client.get(self.config.base_url.rstrip("/") + "/v1/models", headers=self.headers)
            response.raise_for_status()
            model = response.json()["data"][0]["id"]
            logger.info("model: %s (the first of GET /v1/models)", model)
            return model
        except Exception as exc:   # noqa: BLE001 - the requests report what is wrong
            logger.warning("GET /v1/models failed (%s: %s); sending requests without a model name",
                           type(exc).__name__, exc)
            return None

    async def _send(self, client: httpx.AsyncClient | None, model: str | None, prompt: Prompt) -> RequestResult:
        body = request_body(self.config, model, prompt)
        if client is not None:
            return await send_request(client, self.url, self.headers, body, prompt)
        async with self._client() as fresh:   # --fresh-connections: one connection per request
            return await send_request(fresh, self.url, self.headers, body, prompt)

    async def run(self) -> dict[str, Any]:
        from tqdm import tqdm

        config = self.config
        tokenizer = hf_tokenizer(config.tokenizer) if config.tokenizer else None
        prompts = generate_prompts(config.num_prompts + config.warmup_requests, config.input_len, config.output_len,
                                   config.range_ratio, config.seed, config.shared_prefix_len, tokenizer,
                                   config.num_shared_prefixes)
        prompts, warmups = prompts[:config.num_prompts], prompts[config.num_prompts:]
        shared = self._client()
        try:
            model = await self.resolve_model(shared)
            # Several names (LoRA adapters, say): request i sends the i-th, in turn.
            models = model.split(",") if model else [None]
            client = None if config.fresh_connections else shared
            for i, prompt in enumerate(warmups):
                warm = await self._send(client, models[i % len(models)], prompt)
                if warm.success:
                    logger.info("warm-up request %d/%d: %d tokens in %.2fs", i + 1, len(warmups),
                                warm.output_tokens, warm.latency)
                else:
                    logger.warning("warm-up request %d/%d failed: %s", i + 1, len(warmups), warm.error)
            logger.info("benchmark: %d prompts to %s, %s, request rate %s, concurrency %s", len(prompts), self.url,
                        "fresh connections" if config.fresh_connections else "pooled connections",
                        config.request_rate, config.concurrency or "unlimited")
            arrivals = arrival_times(len(prompts), config.request_rate, config.seed)
            limit = asyncio.Semaphore(config.concurrency) if config.concurrency else None
            bar = tqdm(total=len(prompts), disable=config.disable_tqdm, unit="req", desc="srv bench serve")
            start = time.perf_counter()

            async def one(arrival: float, prompt: Prompt, model: str | None) -> RequestResult:
                delay = arrival - (time.perf_counter() - start)
                if delay > 0:
                    await asyncio.sleep(delay)
                if limit is None:
                    result = await self._send(client, model, prompt)
                else:
                    async with limit:
                        result = await self._send(client, model, prompt)
                bar.update(1)
                return result

            results = await asyncio.gather(*(one(t, p, models[i % len(models)])
                                             for i, (t, p) in enumerate(zip(arrivals, prompts))))
            duration = time.perf_counter() - start
            bar.close()
        finally:
            await shared.aclose()
        summary = summarize(results, duration)
        for error in summary["errors"]:
            logger.warning("failed request: %s", error)
        logger.info("done: %d completed, %d failed in %.2fs", summary["completed"], summary["failed"], duration)
        return {
            "base_url": config.base_url, "endpoint": config.endpoint, "model": model,
            "num_prompts": config.num_prompts, "input_len": config.input_len, "output_len": config.output_len,
            "range_ratio": config.range_ratio, "shared_prefix_len": config.shared_prefix_len,
            "num_shared_prefixes": config.num_shared_prefixes,
            "instruction": config.instruction,
            # JSON has no infinity: null means every request is sent at once.
            "request_rate": None if math.isinf(config.request_rate) else config.request_rate,
            "concurrency": config.concurrency, "fresh_connections": config.fresh_connections,
            "extra_body": config.extra_body,
            "tokenizer": config.tokenizer, **summary,
        }


def run_serve_benchmark(config: ServeConfig) -> dict[str, Any]:
    if config.endpoint not in ENDPOINTS:
        raise ValueError(f"--endpoint must be one of {', '.join(ENDPOINTS)}")
    if config.concurrency is not None and config.concurrency < 1:
        raise ValueError("--concurrency must be >= 1")
    return asyncio.run(Benchmark(config).run())
