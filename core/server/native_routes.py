"""SGLang's native routes: /generate, /health, /health_generate, /get_model_info,
/get_server_info, /flush_cache, /abort_request."""

from __future__ import annotations

from typing import Any

from starlette.requests import Request
from starlette.responses import JSONResponse, PlainTextResponse, Response
from starlette.routing import Route

from srv.engine.frontend import EngineDead
from srv.engine.request_state import RequestState
from srv.engine.params import SamplingParamsInput
from srv.server.app import APIError, ServerContext, check_choices, checked, event_stream, read_body, until_done
from srv.server.protocol import AbortRequestBody, GenerateRequest


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

    def _result(self, state: RequestState, body: GenerateRequest, since: int = 0,
                text_since: int = 0) -> dict[str, Any]:
        result = checked(state).result()
        result["text"] = result["text"][text_since:]
        result["output_ids"] = result["output_ids"][since:]
        if body.return_logprob:
            result["meta_info"]["output_token_logprobs"] = [
                [lp, token, None] for lp, token in zip(state.logprobs, state.output_ids)]
            result["meta_info"]["output_top_logprobs"] = [[[v, i, None] for i, v in top] for top in state.top_logprobs]
        return result

    @staticmethod
    def _params(body: GenerateRequest, given: SamplingParamsInput | None) -> SamplingParamsInput:
        params = given or SamplingParamsInput()
        if body.return_logprob:
            params = params.model_copy(update={"logprobs": True, "top_logprobs": body.top_logprobs_num or 0})
        return params

    async def generate(self, request: Request) -> Response:
        body = await read_body(request, GenerateRequest, self.context)
        self.context.log.request("/generate", body)
        text, ids, given = body.text, body.input_ids, body.sampling_params
        batched = isinstance(text, list) or (ids is not None and isinstance(ids[0], list))
        frontend = self.context.frontend
        if not batched:
            if isinstance(given, list):
                raise APIError("sampling_params must be an object for one prompt", param="sampling_params")
            states = await frontend.stream(text, ids, self._params(body, given), body.priority,
                                           interval=self.context.args.stream_interval, rid=body.rid,
                                           labels=self.context.labels(request))
            if body.stream:
                return self._stream(states, body)

            async def last() -> RequestState:
                async for state in states:
                    pass
                return state
            result = self._result(await until_done(request, last()), body)
            self.context.log.response("/generate", result)
            return JSONResponse(result)
        if body.stream:
            raise APIError("streaming takes one prompt", param="stream")
        if text is not None and ids is not None:
            raise APIError("give text or input_ids, not both", param="input_ids")
        count = len(text) if text is not None else len(ids)
        if isinstance(given, list) and len(given) != count:
            raise APIError(f"sampling_params has {len(given)} entries for {count} prompts", param="sampling_params")
        params = [self._params(body, p) for p in (given if isinstance(given, list) else [given] * count)]
        check_choices(count, max((p.n or 1) for p in params))
        groups = await until_done(request, frontend.generate(
            text if text is not None else [None] * count, ids if ids is not None else [None] * count,
            params, body.priority, self.context.labels(request)))
        results = [self._result(state, body) for group in groups for state in group]
        self.context.log.response("/generate", {"results": results})
        return JSONResponse(results)

    def _stream(self, states: Any, body: GenerateRequest) -> Response:
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
        body = await read_body(request, AbortRequestBody, self.context)
        self.context.frontend.abort(body.rid)
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
