"""SGLang's native routes: /generate, /health, /health_generate, /get_model_info,
/get_server_info, /flush_cache, /abort_request."""

from __future__ import annotations

from typing import Any

from starlette.requests import Request
from starlette.responses import JSONResponse, PlainTextResponse, Response
from starlette.routing import Route

from srv.engine.frontend import EngineDead
from srv.engine.request_state import RequestState
from srv.server.app import APIError, ServerContext, checked, event_stream, field_of, read_json, until_done


class NativeRoutes:
    def __init__(self, context: ServerContext) -> None:
        self.context = context

    async def health(self, request: Request) -> Response:
        return Response(status_code=200 if self.context.alive() else 503)

    async def health_generate(self, request: Request) -> Response:
        """Healthy only if the scheduler produces a token."""
        if not self.context.alive():
            return Response(status_code=503)
        try:
            states = await self.context.frontend.stream(None, [0], {"max_new_tokens": 1, "temperature": 0})
            async for state in states:
                pass
        except EngineDead:
            return Response(status_code=503)
        return Response(status_code=200 if state.error is None else 503)

    def _result(self, state: RequestState, body: dict[str, Any], since: int = 0, text_since: int = 0) -> dict[str, Any]:
        result = checked(state).result()
        result["text"] = result["text"][text_since:]
        result["output_ids"] = result["output_ids"][since:]
        if field_of(body, "return_logprob", bool):
            result["meta_info"]["output_token_logprobs"] = [
                [lp, token, None] for lp, token in zip(state.logprobs, state.output_ids)]
            result["meta_info"]["output_top_logprobs"] = [[[v, i, None] for i, v in top] for top in state.top_logprobs]
        return result

    def _params(self, body: dict[str, Any], raw: Any) -> dict[str, Any]:
        if raw is not None and not isinstance(raw, dict):
            raise APIError("sampling_params must be an object", param="sampling_params")
        params = dict(raw or {})
        if field_of(body, "return_logprob", bool):
            params.update(logprobs=True, top_logprobs=field_of(body, "top_logprobs_num", int) or 0)
        return params

    async def generate(self, request: Request) -> Response:
        body = await read_json(request)
        self.context.log.request("/generate", body)
        text, ids = body.get("text"), body.get("input_ids")
        priority = field_of(body, "priority", int)
        batched = isinstance(text, list) or (isinstance(ids, list) and bool(ids) and isinstance(ids[0], list))
        frontend = self.context.frontend
        if not batched:
            if text is not None and not isinstance(text, str):
                raise APIError("text must be a string or a list of strings", param="text")
            params = self._params(body, body.get("sampling_params"))
            states = await frontend.stream(text, ids, params, priority, interval=self.context.args.stream_interval,
                                           rid=field_of(body, "rid", str), labels=self.context.labels(request))
            if field_of(body, "stream", bool):
                return self._stream(states, body)

            async def last() -> RequestState:
                async for state in states:
                    pass
                return state
            result = self._result(await until_done(request, last()), body)
            self.context.log.response("/generate", result)
            return JSONResponse(result)
        if field_of(body, "stream", bool):
            raise APIError("streaming takes one prompt", param="stream")
        count = len(text) if isinstance(text, list) else len(ids)
        raw = body.get("sampling_params")
        raw_list = raw if isinstance(raw, list) else [raw] * count
        params = [self._params(body, r) for r in raw_list]
        groups = await until_done(request, frontend.generate(
            text if isinstance(text, list) else [None] * count, ids if isinstance(ids, list) else [None] * count,
            params, priority, self.context.labels(request)))
        results = [self._result(state, body) for group in groups for state in group]
        self.context.log.response("/generate", {"results": results})
        return JSONResponse(results)

    def _stream(self, states: Any, body: dict[str, Any]) -> Response:
        # --stream-output sends each update's new text and tokens; otherwise everything so far.
        incremental = self.context.args.stream_output
        sent = {"ids": 0, "text": 0}

        def events(state: RequestState, new_text: str) -> list[Any]:
            since, text_since = (sent["ids"], sent["text"]) if incremental else (0, 0)
            sent["ids"], sent["text"] = len(state.output_ids), len(state.text)
            return [self._result(state, body, since, text_since)]

        return event_stream(states, events)

    async def get_model_info(self, request: Request) -> Response:
        args = self.context.args
        return JSONResponse({"model_path": args.model_path or self.context.model_name,
                             "tokenizer_path": args.tokenizer_path or self.context.model_info.get("model_dir"),
                             "is_generation": True, "served_model_name": self.context.model_name,
                             **self.context.model_info})

    async def get_server_info(self, request: Request) -> Response:
        status = await self.context.frontend.control("status")
        return JSONResponse({**{k: v for k, v in vars(self.context.args).items() if k != "api_key"},
                             "version": self.context.version, "scheduler": status})

    async def flush_cache(self, request: Request) -> Response:
        if await self.context.frontend.control("flush_cache"):
            return PlainTextResponse("Cache flushed.\n")
        raise APIError("cannot flush the cache while requests are running")

    async def metrics(self, request: Request) -> Response:
        body, content_type = self.context.metrics.exposition(await self.context.frontend.control("status"))
        return Response(body, media_type=content_type)

    async def abort_request(self, request: Request) -> Response:
        body = await read_json(request)
        rid = field_of(body, "rid", str)
        if not rid:
            raise APIError("rid is required", param="rid")
        self.context.frontend.abort(rid)
        return Response(status_code=200)


def native_routes(context: ServerContext) -> list[Route]:
    routes = NativeRoutes(context)
    metrics = [Route("/metrics", routes.metrics, methods=["GET"])] if context.metrics is not None else []
    return [*metrics,
        Route("/health", routes.health, methods=["GET"]),
        Route("/health_generate", routes.health_generate, methods=["GET"]),
        Route("/generate", routes.generate, methods=["POST"]),
        Route("/get_model_info", routes.get_model_info, methods=["GET"]),
        Route("/get_server_info", routes.get_server_info, methods=["GET"]),
        Route("/flush_cache", routes.flush_cache, methods=["POST"]),
        Route("/abort_request", routes.abort_request, methods=["POST"]),
    ]
