"""The HTTP application: what every route shares (errors, auth, running a request until it ends
or its client leaves, server-sent events), and the assembly of OpenAI, native and plugin routes.
"""

from __future__ import annotations

import asyncio
import hmac
import json
import logging
from argparse import Namespace
from dataclasses import dataclass
from typing import Any, AsyncIterator, Awaitable, Callable, TypeVar

from pydantic import BaseModel, ValidationError
from starlette.applications import Starlette
from starlette.exceptions import HTTPException
from starlette.middleware import Middleware
from starlette.requests import Request
from starlette.responses import JSONResponse, Response, StreamingResponse
from starlette.routing import Route

from srv.engine.frontend import EngineDead, Frontend, QueueFull
from srv.engine.errors import InvalidRequest
from srv.engine.params import validation_error
from srv.engine.request_state import RequestState
from srv.sdk.grammar import GrammarError
from srv.sdk.reasoning import ReasoningParser
from srv.sdk.tools import ToolCallParser
from srv.server.metrics import ServerMetrics
from srv.server.protocol import MAX_CHOICES
from srv.server.request_log import RequestLog

logger = logging.getLogger("srv.server")

QUEUE_FULL_RETRY_AFTER_S = 1
DISCONNECT_POLL_S = 0.2
# Bodies larger than this are parsed and validated in a thread, off the event loop.
OFF_LOOP_BODY_BYTES = 64 * 1024
JSON_MEDIA_TYPES = ("application/json",)

Body = TypeVar("Body", bound=BaseModel)


class APIError(Exception):
    def __init__(self, message: str, status: int = 400, param: str | None = None,
                 type_: str = "invalid_request_error") -> None:
        super().__init__(message)
        self.status, self.param, self.type = status, param, type_


class ClientGone(Exception):
    """The client disconnected before its request finished; the request was aborted."""


@dataclass
class ServerContext:
    frontend: Frontend
    args: Namespace
    model_name: str
    model_info: dict[str, Any]
    log: RequestLog
    alive: Callable[[], bool] = lambda: True
    version: str = ""
    metrics: ServerMetrics | None = None
    tool_parser: ToolCallParser | None = None   # --tool-call-parser, for /v1/chat/completions with tools
    reasoning_parser: ReasoningParser | None = None   # --reasoning-parser: reasoning_content of chat responses
    # Any installed parser by name (/separate_reasoning and /parse_function_call name one).
    reasoning_parsers: Callable[[str], ReasoningParser] | None = None
    tool_parsers: Callable[[str], ToolCallParser] | None = None
    weight_version: str = "default"   # the served weights' label (/update_weight_version)

    @property
    def tokenizer(self) -> Any:
        return self.frontend.tokenizer

    def labels(self, request: Request) -> dict[str, str] | None:
        """Custom metric labels the request carries in its header (only the allowed ones)."""
        return self.metrics.labels_from_headers(request.headers) if self.metrics is not None else None

    @staticmethod
    def dp_rank(request: Request, given: int | None = None) -> int | None:
        """The data-parallel group the caller routed the request to: `given` (a body field), or
        the X-Data-Parallel-Rank header, which SGLang and vLLM read; None lets the router pick."""
        header = request.headers.get(DP_RANK_HEADER)
        if header is None:
            return given
        try:
            rank = int(header)
        except ValueError:
            raise InvalidRequest(f"the {DP_RANK_HEADER} header must be a data-parallel rank (an integer), not "
                                 f"{header!r}", DP_RANK_HEADER) from None
        if given is not None and given != rank:
            raise InvalidRequest(f"the body routes the request to data-parallel rank {given} and the "
                                 f"{DP_RANK_HEADER} header to {rank}", DP_RANK_HEADER)
        return rank


DP_RANK_HEADER = "X-Data-Parallel-Rank"

ERROR_TYPES = {400: "invalid_request_error", 401: "authentication_error", 404: "not_found_error",
               405: "invalid_request_error", 413: "invalid_request_error", 415: "invalid_request_error",
               503: "server_overloaded"}


def as_api_error(exc: Exception) -> tuple[APIError, dict[str, str]]:
    """The error object and headers an exception answers with. Exceptions that say the request
    is wrong are 4xx; anything else is a 500 that names the exception."""
    if isinstance(exc, APIError):
        return exc, {}
    if isinstance(exc, QueueFull):
        return APIError(str(exc), 503, type_="server_overloaded"), {"Retry-After": str(QUEUE_FULL_RETRY_AFTER_S)}
    if isinstance(exc, EngineDead):
        return APIError(str(exc), 503, type_="server_error"), {}
    if isinstance(exc, InvalidRequest):
        return APIError(str(exc), param=exc.param), {}
    if isinstance(exc, GrammarError):
        return APIError(str(exc)), {}
    if isinstance(exc, HTTPException):
        return APIError(exc.detail, exc.status_code, type_=ERROR_TYPES.get(exc.status_code, "invalid_request_error")), \
            dict(exc.headers or {})
    return APIError(f"internal error: {type(exc).__name__}: {exc}", 500, type_="server_error"), {}


def error_response(exc: Exception) -> JSONResponse:
    error, headers = as_api_error(exc)
    body = {"error": {"message": str(error), "type": error.type, "param": error.param, "code": error.status}}
    return JSONResponse(body, status_code=error.status, headers=headers)


async def read_body(request: Request, schema: type[Body], context: ServerContext) -> Body:
    """The request's JSON body checked against `schema`: 415 for a body that is not JSON, 413
    past --max-request-body-bytes (before it is read whole), 400 naming the first bad field."""
    media_type = request.headers.get("content-type", "").split(";")[0].strip().lower()
    if media_type and media_type not in JSON_MEDIA_TYPES and not media_type.endswith("+json"):
        raise APIError(f"the request body must be JSON (Content-Type: application/json), not {media_type}", 415)
    limit = context.args.max_request_body_bytes
    declared = request.headers.get("content-length", "")
    if declared.isdigit() and int(declared) > limit:
        raise _too_large(limit)
    chunks, size = [], 0
    async for chunk in request.stream():
        size += len(chunk)
        if size > limit:
            raise _too_large(limit)
        chunks.append(chunk)
    raw = b"".join(chunks)
    if len(raw) > OFF_LOOP_BODY_BYTES:
        return await context.frontend.off_loop(parse_body, schema, raw)
    return parse_body(schema, raw)


async def read_optional_body(request: Request, schema: type[Body], context: ServerContext) -> Body:
    """`read_body`, or the schema's defaults when the request sends no body (a GET, a bare POST)."""
    if request.method == "GET" or not (await request.body()).strip():
        return schema()
    return await read_body(request, schema, context)


def parse_body(schema: type[Body], raw: bytes) -> Body:
    """`raw` as `schema`, or an APIError (400) saying what is wrong with it."""
    try:
        return schema.model_validate_json(raw)
    except ValidationError as exc:
        error = exc.errors(include_url=False, include_input=False)[0]
        if error["type"] == "json_invalid":
            raise APIError(f"the request body is not valid JSON: {error['ctx']['error']}") from None
        if error["type"] == "model_type" and not error["loc"]:
            raise APIError("the request body must be a JSON object") from None
        raise validation_error(exc) from None


def check_choices(prompts: int, n: int | None) -> None:
    """Every prompt times n is a request of its own: a bound keeps one call from flooding the queue."""
    if prompts * (n or 1) > MAX_CHOICES:
        raise APIError(f"{prompts} prompts with n = {n} make {prompts * (n or 1)} choices; at most {MAX_CHOICES} "
                       "are allowed in one request", param="n")


def _too_large(limit: int) -> APIError:
    return APIError(f"the request body is larger than {limit} bytes (--max-request-body-bytes)", 413)


async def until_done(request: Request, work: Awaitable[Any]) -> Any:
    """Await `work`, cancelling it (which aborts its requests) if the client goes away first."""
    task = asyncio.ensure_future(work)
    while True:
        done, _ = await asyncio.wait({task}, timeout=DISCONNECT_POLL_S)
        if done:
            return task.result()
        if await request.is_disconnected():
            task.cancel()
            raise ClientGone


def sse(data: Any) -> str:
    return f"data: {json.dumps(data, allow_nan=False)}\n\n"


def error_event(message: str, status: int = 500) -> str:
    return sse({"error": {"message": message, "type": "server_error", "param": None, "code": status}})


@dataclass
class Step:
    """What one update of a choice adds: text, the range of its new tokens, whether this is the
    choice's first piece and whether it ends with it."""
    text: str
    tokens: range
    first: bool
    ending: bool

    @classmethod
    def whole(cls, state: RequestState) -> "Step":
        """A finished choice in one piece (a response that is not streamed)."""
        return cls(state.text, range(len(state.output_ids)), True, True)


class ChoiceProgress:
    """How far each streamed choice has gone out (updates may repeat a state unchanged)."""

    def __init__(self) -> None:
        self._text: dict[int, int] = {}
        self._tokens: dict[int, int] = {}
        self._ended: set[int] = set()

    def advance(self, index: int, state: RequestState) -> Step | None:
        if index in self._ended:
            return None
        first = index not in self._text
        text_sent, tokens_sent = self._text.get(index, 0), self._tokens.get(index, 0)
        text, tokens, ending = state.text[text_sent:], range(tokens_sent, len(state.output_ids)), state.finished
        if not first and not text and not tokens and not ending:
            return None
        self._text[index], self._tokens[index] = len(state.text), len(state.output_ids)
        if ending:
            self._ended.add(index)
        return Step(text, tokens, first, ending)


class SSEResponse(StreamingResponse):
    """Server-sent events that run `on_close` however the response ends, even when the client
    left before the first event (a body iterator that never started cannot clean up)."""

    def __init__(self, body: AsyncIterator[str], on_close: Callable[[], None]) -> None:
        super().__init__(body, media_type="text/event-stream")
        self.on_close = on_close

    async def __call__(self, scope: dict, receive: Any, send: Any) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            self.on_close()


def event_stream(updates: AsyncIterator[tuple[int, RequestState]],
                 events: Callable[[int, RequestState, Step], list[Any]],
                 closing: Callable[[], list[Any]] = list, on_close: Callable[[], None] = lambda: None) -> SSEResponse:
    """Server-sent events: `events(index, state, step)` for each choice's update, `closing()` at
    the end, then [DONE]. The response's end (a client that leaves included) closes `updates`,
    which aborts what has not finished, and calls `on_close`."""
    progress = ChoiceProgress()

    async def body() -> AsyncIterator[str]:
        try:
            async for index, state in updates:
                if state.error is not None:
                    yield error_event(state.error)
                    return
                step = progress.advance(index, state)
                if step is not None:
                    for event in events(index, state, step):
                        yield sse(event)
            for event in closing():
                yield sse(event)
            yield "data: [DONE]\n\n"
        except Exception as exc:   # the stream has begun: an error event ends it, not a dropped connection
            logger.exception("a streamed response failed")
            yield error_event(f"internal error: {type(exc).__name__}: {exc}")
        finally:
            await updates.aclose()

    return SSEResponse(body(), on_close)


def checked(state: RequestState) -> RequestState:
    if state.error is not None:
        raise APIError(state.error, 500, type_="server_error")
    return state


class ErrorBoundary:
    """Whatever a route raises is answered with an error object (a 500 for the unexpected), so
    no exception reaches uvicorn, which would drop the keep-alive connection after its own 500.
    An exception after the response began (a stream) can only end that response."""

    def __init__(self, app: Any) -> None:
        self.app = app

    async def __call__(self, scope: dict, receive: Any, send: Any) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        started = False

        async def watched_send(message: dict) -> None:
            nonlocal started
            started = started or message["type"] == "http.response.start"
            await send(message)

        try:
            await self.app(scope, receive, watched_send)
        except Exception as exc:
            logger.exception("%s %s failed", scope.get("method"), scope.get("path"))
            if not started:
                await error_response(exc)(scope, receive, send)


class APIKeyMiddleware:
    """Bearer-token check on every route but the health checks (plain ASGI: a wrapping
    middleware would hide client disconnects from the routes)."""

    OPEN_PATHS = ("/health", "/health_generate")

    def __init__(self, app: Any, key: str | None) -> None:
        self.app, self.key = app, key

    async def __call__(self, scope: dict, receive: Any, send: Any) -> None:
        if self.key and scope["type"] == "http" and scope["path"] not in self.OPEN_PATHS:
            given = dict(scope["headers"]).get(b"authorization", b"").decode(errors="replace")
            if not hmac.compare_digest(given.removeprefix("Bearer ").strip().encode(), self.key.encode()):
                response = error_response(APIError("invalid or missing API key", 401, type_="authentication_error"))
                await response(scope, receive, send)
                return
        await self.app(scope, receive, send)


def build_app(context: ServerContext, plugin_routes: list[tuple[str, Any, list[str]]] = ()) -> Starlette:
    from srv.server.native_routes import native_routes
    from srv.server.embedding_routes import embedding_routes
    from srv.server.score_routes import score_routes
    from srv.server.admin_routes import admin_routes
    from srv.server.weights_routes import weights_routes
    from srv.server.openai_routes import openai_routes

    from srv.server.openapi import openapi_route

    async def handle_error(request: Request, exc: Exception) -> Response:
        if isinstance(exc, ClientGone):
            return Response(status_code=499)
        if isinstance(exc, HTTPException) and exc.status_code == 404:
            exc = APIError(f"no route {request.url.path}", 404, type_="not_found_error")
        elif isinstance(exc, HTTPException) and exc.status_code == 405:
            allowed = (exc.headers or {}).get("Allow", "")
            exc = HTTPException(405, f"{request.method} is not allowed on {request.url.path} (allowed: {allowed})",
                                exc.headers)
        return error_response(exc)

    routes = [*openai_routes(context), *native_routes(context), *embedding_routes(context), *score_routes(context),
              *admin_routes(context), *weights_routes(context),
              *(Route(path, endpoint, methods=methods) for path, endpoint, methods in plugin_routes)]
    routes.append(openapi_route(routes, context))
    return Starlette(routes=routes, middleware=[Middleware(ErrorBoundary),
                                                Middleware(APIKeyMiddleware, key=context.args.api_key)],
                     exception_handlers={cls: handle_error for cls in (APIError, InvalidRequest, GrammarError, QueueFull,
                                                                       EngineDead, ClientGone, HTTPException)})
