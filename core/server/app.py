"""The HTTP application: OpenAI-compatible routes (/v1/...) and SGLang's native ones.

Each handler validates its JSON, turns it into an engine request and shapes the answer;
errors come back in OpenAI's shape with a 4xx status and never stop the server.
"""

from __future__ import annotations

import hmac
import json
import time
import uuid
from typing import Any, AsyncIterator, Callable

from starlette.applications import Starlette
from starlette.middleware import Middleware
from starlette.middleware.base import BaseHTTPMiddleware
from starlette.requests import Request
from starlette.responses import JSONResponse, Response, StreamingResponse
from starlette.routing import Route

from srv.engine.engine import Engine


class APIError(Exception):
    def __init__(self, message: str, status: int = 400, param: str | None = None,
                 type_: str = "invalid_request_error") -> None:
        super().__init__(message)
        self.status, self.param, self.type = status, param, type_


def error_response(exc: APIError) -> JSONResponse:
    body = {"error": {"message": str(exc), "type": exc.type, "param": exc.param, "code": exc.status}}
    return JSONResponse(body, status_code=exc.status)


async def read_json(request: Request) -> dict[str, Any]:
    try:
        body = json.loads(await request.body())
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise APIError(f"request body is not valid JSON: {exc}") from None
    if not isinstance(body, dict):
        raise APIError("request body must be a JSON object")
    return body


def sse(data: Any) -> str:
    return f"data: {json.dumps(data)}\n\n"


class ServerApp:
    def __init__(self, engine: Engine, plugin_routes: list[tuple[str, Any, list[str]]] = ()) -> None:
        self.engine = engine
        self.plugin_routes = [Route(path, endpoint, methods=methods) for path, endpoint, methods in plugin_routes]
        args = engine.server_args
        self.model_name = args.served_model_name or args.model_path or "SmolLM2-135M-Instruct"
        self.api_key = args.api_key

    def routes(self) -> list[Route]:
        return [
            Route("/health", self.health, methods=["GET"]),
            Route("/v1/models", self.models, methods=["GET"]),
            Route("/generate", self.generate, methods=["POST"]),
            Route("/v1/completions", self.completions, methods=["POST"]),
            Route("/v1/chat/completions", self.chat_completions, methods=["POST"]),
            *self.plugin_routes,
        ]

    def build(self) -> Starlette:
        async def handle_api_error(request: Request, exc: Exception) -> Response:
            return error_response(exc)

        return Starlette(routes=self.routes(), middleware=[Middleware(BaseHTTPMiddleware, dispatch=self.authorize)],
                         exception_handlers={APIError: handle_api_error})

    async def authorize(self, request: Request, call_next: Any) -> Response:
        if self.api_key and request.url.path != "/health":
            given = request.headers.get("authorization", "").removeprefix("Bearer ").strip()
            if not hmac.compare_digest(given.encode(), self.api_key.encode()):
                return error_response(APIError("invalid or missing API key", 401, type_="authentication_error"))
        return await call_next(request)

    # ---- routes -------------------------------------------------------------------------------

    async def health(self, request: Request) -> Response:
        return Response(status_code=200)

    async def models(self, request: Request) -> Response:
        return JSONResponse({"object": "list", "data": [
            {"id": self.model_name, "object": "model", "created": int(time.time()), "owned_by": "srv"}]})

    def _check_model(self, body: dict[str, Any]) -> None:
        if body.get("model") not in (None, self.model_name):
            raise APIError(f"the model {body['model']!r} does not exist", 404, "model", "not_found_error")

    async def _run(self, prompt: str | None, input_ids: list[int] | None, params: dict[str, Any]) -> dict[str, Any]:
        try:
            return await self.engine.async_generate(prompt, params, input_ids)
        except ValueError as exc:
            raise APIError(str(exc)) from None

    async def _stream(self, prompt: str | None, input_ids: list[int] | None,
                      params: dict[str, Any]) -> AsyncIterator[dict[str, Any]]:
        try:
            stream = await self.engine.async_generate(prompt, params, input_ids, stream=True)
        except ValueError as exc:
            raise APIError(str(exc)) from None
        return stream

    async def generate(self, request: Request) -> Response:
        body = await read_json(request)
        params = body.get("sampling_params") or {}
        if not isinstance(params, dict):
            raise APIError("sampling_params must be an object", param="sampling_params")
        text, ids = body.get("text"), body.get("input_ids")
        if body.get("stream"):
            stream = await self._stream(text, ids, params)

            async def events():
                async for result in stream:
                    yield sse(result)
                yield "data: [DONE]\n\n"

            return StreamingResponse(events(), media_type="text/event-stream")
        return JSONResponse(await self._run(text, ids, params))

    async def completions(self, request: Request) -> Response:
        body = await read_json(request)
        self._check_model(body)
        prompt = body.get("prompt")
        if body.get("suffix"):
            raise APIError("suffix is not supported", param="suffix")
        if isinstance(prompt, list) and prompt and isinstance(prompt[0], int):
            text, ids = None, prompt
        elif isinstance(prompt, str):
            text, ids = prompt, None
        else:
            raise APIError("prompt must be a string or a list of token ids", param="prompt")
        params = openai_sampling_params(body)
        created, rid = int(time.time()), f"cmpl-{uuid.uuid4().hex}"
        if body.get("stream"):
            def chunk(delta: str, finish: str | None, first: bool) -> dict[str, Any]:
                return {"id": rid, "object": "text_completion", "created": created, "model": self.model_name,
                        "choices": [{"index": 0, "text": delta, "logprobs": None, "finish_reason": finish}]}

            return event_stream(await self._stream(text, ids, params), chunk)
        result = await self._run(text, ids, params)
        meta = result["meta_info"]
        return JSONResponse({
            "id": rid, "object": "text_completion", "created": created, "model": self.model_name,
            "choices": [{"index": 0, "text": result["text"], "logprobs": None,
                         "finish_reason": meta["finish_reason"]["type"]}],
            "usage": usage(meta)})

    async def chat_completions(self, request: Request) -> Response:
        body = await read_json(request)
        self._check_model(body)
        messages = body.get("messages")
        if not isinstance(messages, list) or not messages:
            raise APIError("messages must be a non-empty list", param="messages")
        prompt = self.render_chat(messages)
        params = openai_sampling_params(body)
        created, rid = int(time.time()), f"chatcmpl-{uuid.uuid4().hex}"
        if body.get("stream"):
            def chunk(delta: str, finish: str | None, first: bool) -> dict[str, Any]:
                message = {"role": "assistant", "content": delta} if first else {"content": delta}
                return {"id": rid, "object": "chat.completion.chunk", "created": created, "model": self.model_name,
                        "choices": [{"index": 0, "delta": message, "finish_reason": finish}]}

            return event_stream(await self._stream(prompt, None, params), chunk)
        result = await self._run(prompt, None, params)
        meta = result["meta_info"]
        return JSONResponse({
            "id": rid, "object": "chat.completion", "created": created, "model": self.model_name,
            "choices": [{"index": 0, "message": {"role": "assistant", "content": result["text"]},
                         "finish_reason": meta["finish_reason"]["type"]}],
            "usage": usage(meta)})

    def render_chat(self, messages: list[Any]) -> str:
        normalized = []
        for message in messages:
            if not isinstance(message, dict) or "role" not in message:
                raise APIError("each message must be an object with a role", param="messages")
            content = message.get("content")
            if isinstance(content, list):
                content = "".join(part.get("text", "") for part in content if isinstance(part, dict))
            normalized.append({**message, "content": content or ""})
        return self.engine.tokenizer.apply_chat_template(normalized, tokenize=False, add_generation_prompt=True)


def event_stream(results: AsyncIterator[dict[str, Any]],
                 chunk: Callable[[str, str | None, bool], dict[str, Any]]) -> StreamingResponse:
    """Server-sent events of the text each engine result adds, built by `chunk`, then [DONE]."""

    async def events() -> AsyncIterator[str]:
        sent, first = "", True
        async for result in results:
            delta, sent = result["text"][len(sent):], result["text"]
            finish = result["meta_info"]["finish_reason"]
            yield sse(chunk(delta, finish and finish["type"], first))
            first = False
        yield "data: [DONE]\n\n"

    return StreamingResponse(events(), media_type="text/event-stream")


def usage(meta: dict[str, Any]) -> dict[str, int]:
    return {"prompt_tokens": meta["prompt_tokens"], "completion_tokens": meta["completion_tokens"],
            "total_tokens": meta["prompt_tokens"] + meta["completion_tokens"]}


def openai_sampling_params(body: dict[str, Any]) -> dict[str, Any]:
    """OpenAI request fields (and SGLang's extra ones) as srv sampling parameters."""
    params: dict[str, Any] = {}
    max_tokens = body.get("max_completion_tokens", body.get("max_tokens"))
    if max_tokens is not None:
        if not isinstance(max_tokens, int) or max_tokens < 0:
            raise APIError("max_tokens must be a non-negative integer", param="max_tokens")
        params["max_new_tokens"] = max_tokens
    for ours, theirs in (("temperature", "temperature"), ("top_p", "top_p"), ("top_k", "top_k"), ("min_p", "min_p"),
                         ("repetition_penalty", "repetition_penalty"), ("frequency_penalty", "frequency_penalty"),
                         ("presence_penalty", "presence_penalty"), ("seed", "seed"), ("logit_bias", "logit_bias"),
                         ("stop", "stop"), ("min_tokens", "min_new_tokens"), ("ignore_eos", "ignore_eos")):
        if body.get(ours) is not None:
            value = body[ours]
            if ours in ("temperature", "top_p", "min_p", "frequency_penalty", "presence_penalty",
                        "repetition_penalty") and not isinstance(value, (int, float)):
                raise APIError(f"{ours} must be a number", param=ours)
            params["min_new_tokens" if ours == "min_tokens" else theirs] = value
    return params
