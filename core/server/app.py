"""The HTTP application: what every route shares (errors, auth, running a request until it ends
or its client leaves, server-sent events), and the assembly of OpenAI, native and plugin routes.
"""

from __future__ import annotations

import asyncio
import hmac
import json
from argparse import Namespace
from dataclasses import dataclass
from typing import Any, AsyncIterator, Awaitable, Callable

from starlette.applications import Starlette
from starlette.middleware import Middleware
from starlette.requests import Request
from starlette.responses import JSONResponse, Response, StreamingResponse
from starlette.routing import Route

from srv.engine.frontend import EngineDead, Frontend, QueueFull
from srv.engine.request_state import RequestState
from srv.sdk.tools import ToolCallParser
from srv.server.metrics import ServerMetrics
from srv.server.request_log import RequestLog

QUEUE_FULL_RETRY_AFTER_S = 1
DISCONNECT_POLL_S = 0.2


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

    @property
    def tokenizer(self) -> Any:
        return self.frontend.tokenizer

    def labels(self, request: Request) -> dict[str, str] | None:
        """Custom metric labels the request carries in its header (only the allowed ones)."""
        return self.metrics.labels_from_headers(request.headers) if self.metrics is not None else None


def error_response(exc: Exception) -> JSONResponse:
    if isinstance(exc, QueueFull):
        exc, headers = APIError(str(exc), 503, type_="server_overloaded"), {"Retry-After": str(QUEUE_FULL_RETRY_AFTER_S)}
    elif isinstance(exc, EngineDead):
        exc, headers = APIError(str(exc), 503, type_="server_error"), {}
    elif isinstance(exc, ValueError):
        exc, headers = APIError(str(exc)), {}
    else:
        headers = {}
    body = {"error": {"message": str(exc), "type": exc.type, "param": exc.param, "code": exc.status}}
    return JSONResponse(body, status_code=exc.status, headers=headers)


async def read_json(request: Request) -> dict[str, Any]:
    try:
        body = json.loads(await request.body())
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise APIError(f"request body is not valid JSON: {exc}") from None
    if not isinstance(body, dict):
        raise APIError("request body must be a JSON object")
    return body


def field_of(body: dict[str, Any], name: str, kinds: type | tuple[type, ...], default: Any = None) -> Any:
    """body[name] if it has the right JSON type (booleans are not numbers), else a 400."""
    value = body.get(name, default)
    if value is None or value is default:
        return value
    kinds = kinds if isinstance(kinds, tuple) else (kinds,)
    if isinstance(value, bool) and bool not in kinds or not isinstance(value, kinds):
        names = " or ".join(k.__name__.replace("str", "string").replace("dict", "object").replace("list", "array")
                            for k in kinds)
        raise APIError(f"{name} must be {names}", param=name)
    return value


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
    return f"data: {json.dumps(data)}\n\n"


def event_stream(states: AsyncIterator[RequestState], events: Callable[[RequestState, str], list[Any]],
                 closing: Callable[[], list[Any]] = list) -> StreamingResponse:
    """Server-sent events: `events(state, new_text)` for each update, `closing()` at the end,
    then [DONE]. A client that leaves closes `states`, which aborts the request."""

    async def body() -> AsyncIterator[str]:
        sent = ""
        try:
            async for state in states:
                if state.error is not None:
                    yield sse({"error": {"message": state.error, "type": "server_error", "code": 500}})
                    return
                new_text, sent = state.text[len(sent):], state.text
                for event in events(state, new_text):
                    yield sse(event)
            for event in closing():
                yield sse(event)
            yield "data: [DONE]\n\n"
        finally:
            await states.aclose()

    return StreamingResponse(body(), media_type="text/event-stream")


def checked(state: RequestState) -> RequestState:
    if state.error is not None:
        raise APIError(state.error, 500, type_="server_error")
    return state


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
    from srv.server.openai_routes import openai_routes

    async def handle_error(request: Request, exc: Exception) -> Response:
        if isinstance(exc, ClientGone):
            return Response(status_code=499)
        return error_response(exc)

    routes = [*openai_routes(context), *native_routes(context),
              *(Route(path, endpoint, methods=methods) for path, endpoint, methods in plugin_routes)]
    return Starlette(routes=routes, middleware=[Middleware(APIKeyMiddleware, key=context.args.api_key)],
                     exception_handlers={APIError: handle_error, ValueError: handle_error, QueueFull: handle_error,
                                         EngineDead: handle_error, ClientGone: handle_error})
