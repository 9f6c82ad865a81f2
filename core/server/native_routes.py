"""SGLang's native routes: /generate, /health, /health_generate, /get_model_info,
/get_server_info, /flush_cache, /abort_request, /separate_reasoning, /parse_function_call,
/open_session and /close_session, /tokenize and /detokenize (also under /v1/)."""

from __future__ import annotations

import json
from typing import Any

from starlette.requests import Request
from starlette.responses import JSONResponse, PlainTextResponse, Response
from starlette.routing import Route

from srv.backend_registry import BackendError
from srv.engine.frontend import EngineDead
from srv.engine.request_state import RequestState
from srv.engine.params import SamplingParamsInput
from srv.server.app import (APIError, ServerContext, Step, check_choices, checked, event_stream, read_body,
                            until_done)
from srv.engine.sessions import SessionParams
from srv.server.protocol import (AbortRequestBody, CloseSessionRequest, DetokenizeRequest, GenerateRequest,
                                 OpenSessionRequest, ParseFunctionCallRequest, SeparateReasoningRequest,
                                 TokenizeRequest)


class NativeRoutes:
    def __init__(self, context: ServerContext) -> None:
        self.context = context

    async def health(self, request: Request) -> Response:
        return Response(status_code=200 if self.context.alive() else 503)

    async def health_generate(self, request: Request) -> Response:
        """Healthy only if the scheduler produces a token (an embedding server: an embedding)."""
        if not self.context.alive():
            return Response(status_code=503)
        try:
            state = await self.context.frontend.probe()
        except EngineDead:
            return Response(status_code=503)
        return Response(status_code=200 if state.error is None else 503)

    def _result(self, state: RequestState, body: GenerateRequest, step: Step | None = None) -> dict[str, Any]:
        """SGLang's result of a choice: all of it, or with --stream-output what `step` added."""
        result = checked(state).result()
        tokens = range(len(state.output_ids))
        if step is not None:
            tokens, result["text"] = step.tokens, step.text
            result["output_ids"] = [state.output_ids[i] for i in tokens]
        if body.return_logprob:
            text = self._token_text if body.return_text_in_logprobs else (lambda token: None)
            meta = result["meta_info"]
            meta["output_token_logprobs"] = [[state.logprobs[i], state.output_ids[i], text(state.output_ids[i])]
                                             for i in tokens]
            meta["output_top_logprobs"] = [[[v, t, text(t)] for t, v in state.top_logprobs[i]] for i in tokens] \
                if state.top_logprobs else []
            if state.params.token_ids_logprob:
                ids = state.params.token_ids_logprob
                meta["output_token_ids_logprobs"] = [[[v, t, text(t)] for v, t in zip(state.token_ids_logprobs[i], ids)]
                                                     for i in tokens]
            if state.params.logprob_start_len >= 0 and (step is None or step.first):
                prompt = state.prompt_ids[min(state.params.logprob_start_len, len(state.prompt_ids)):]
                meta["input_token_logprobs"] = [[lp, t, text(t)] for lp, t in zip(state.input_logprobs, prompt)]
                meta["input_top_logprobs"] = [[[v, t, text(t)] for t, v in top] or None
                                              for top in state.input_top_logprobs]
        return result

    def _token_text(self, token: int) -> str | None:
        tokenizer = self.context.tokenizer
        return tokenizer.decode([token]) if tokenizer is not None else None

    @staticmethod
    def _params(body: GenerateRequest, given: SamplingParamsInput | None) -> SamplingParamsInput:
        params = given or SamplingParamsInput()
        if body.return_hidden_states:
            params = params.model_copy(update={"return_hidden_states": True})
        if body.custom_logit_processor is not None:
            params = params.model_copy(update={"custom_logit_processor": body.custom_logit_processor})
        if body.lora_path is not None:
            params = params.model_copy(update={"lora_path": body.lora_path})
        if body.return_logprob:
            params = params.model_copy(update={"logprobs": True, "top_logprobs": body.top_logprobs_num or 0,
                                               "logprob_start_len": body.logprob_start_len,
                                               "token_ids_logprob": body.token_ids_logprob})
        return params

    async def generate(self, request: Request) -> Response:
        """One prompt (one result, or a list of n with n > 1) or a batch (a flat list, n per
        prompt), streamed or not; streamed choices of a batch or of n > 1 carry their index."""
        body = await read_body(request, GenerateRequest, self.context)
        self.context.log.request("/generate", body)
        text, ids, given = body.text, body.input_ids, body.sampling_params
        if text is not None and ids is not None:
            raise APIError("give text or input_ids, not both", param="input_ids")
        batched = isinstance(text, list) or (ids is not None and isinstance(ids[0], list))
        if batched:
            count = len(text) if text is not None else len(ids)
            texts = text if text is not None else [None] * count
            idss = ids if ids is not None else [None] * count
        else:
            if isinstance(given, list):
                raise APIError("sampling_params must be an object for one prompt", param="sampling_params")
            count, texts, idss = 1, [text], [ids]
        if isinstance(given, list) and len(given) != count:
            raise APIError(f"sampling_params has {len(given)} entries for {count} prompts", param="sampling_params")
        params = [self._params(body, p) for p in (given if isinstance(given, list) else [given] * count)]
        check_choices(count, max((p.n or 1) for p in params))
        frontend = self.context.frontend
        session = SessionParams(**body.session_params.model_dump()) if body.session_params is not None else None
        if session is not None and batched:
            raise APIError("a session's turn is one prompt", param="session_params")
        groups = await frontend.submit(texts, idss, params, body.priority, self.context.labels(request), body.rid,
                                       session, self.context.dp_rank(request, body.routed_rank()))
        single = not batched and len(groups[0]) == 1
        if body.stream:
            return self._stream(groups, body, single)
        await until_done(request, frontend.wait(groups))
        results = [self._result(state, body) for group in groups for state in group]
        self.context.log.response("/generate", {"results": results})
        return JSONResponse(results[0] if single else results)

    def _stream(self, groups: list[list[RequestState]], body: GenerateRequest, single: bool) -> Response:
        # --stream-output sends each update's new text and tokens; otherwise everything so far.
        incremental = self.context.args.stream_output

        def events(index: int, state: RequestState, step: Step) -> list[Any]:
            result = self._result(state, body, step if incremental else None)
            if not single:
                result["index"] = index
            return [result]

        frontend = self.context.frontend
        return event_stream(frontend.follow(groups, self.context.args.stream_interval), events,
                            on_close=lambda: frontend.release(groups))

    async def get_model_info(self, request: Request) -> Response:
        args = self.context.args
        return JSONResponse({"model_path": args.model_path or self.context.model_name,
                             "tokenizer_path": args.tokenizer_path or self.context.model_info.get("model_dir"),
                             "is_generation": self.context.model_info.get("is_generation", True),
                             "served_model_name": self.context.model_name, "weight_version": self.context.weight_version,
                             "preferred_sampling_params": json.loads(args.preferred_sampling_params)
                             if args.preferred_sampling_params else None,
                             **self.context.model_info})

    async def get_server_info(self, request: Request) -> Response:
        status = await self.context.frontend.control("status")
        return JSONResponse({**{k: v for k, v in vars(self.context.args).items() if k != "api_key"},
                             "version": self.context.version, "scheduler": status,
                             "max_total_num_tokens": status["kv_capacity_tokens"],
                             "max_running_requests": self.context.model_info.get("max_running_requests"),
                             "internal_states": [{"avg_spec_accept_length": status["spec_accept_length"]}]})

    async def flush_cache(self, request: Request) -> Response:
        if await self.context.frontend.control("flush_cache"):
            return PlainTextResponse("Cache flushed.\n")
        raise APIError("cannot flush the cache while requests are running or open sessions hold their KV")

    async def metrics(self, request: Request) -> Response:
        body, content_type = self.context.metrics.exposition(await self.context.frontend.control("status"))
        return Response(body, media_type=content_type)

    async def tokenize(self, request: Request) -> Response:
        body = await read_body(request, TokenizeRequest, self.context)
        frontend = self.context.frontend
        prompts = body.prompt if isinstance(body.prompt, list) else [body.prompt]
        tokens = [await frontend.tokenize(prompt, None, body.add_special_tokens) for prompt in prompts]
        single = not isinstance(body.prompt, list)
        return JSONResponse({"tokens": tokens[0] if single else tokens,
                             "count": len(tokens[0]) if single else [len(t) for t in tokens],
                             "max_model_len": frontend.context_len})

    async def detokenize(self, request: Request) -> Response:
        body = await read_body(request, DetokenizeRequest, self.context)
        tokenizer = self.context.tokenizer
        if tokenizer is None:
            raise APIError("the tokenizer is skipped (--skip-tokenizer-init)")
        single = not isinstance(body.tokens[0], list)
        lists = [body.tokens] if single else body.tokens
        vocabulary = len(tokenizer)
        for ids in lists:
            bad = next((t for t in ids if t >= vocabulary), None)
            if bad is not None:
                raise APIError(f"token id {bad} is not in the vocabulary ({vocabulary} tokens)", param="tokens")
        texts = [await self.context.frontend.off_loop(
            lambda ids=ids: tokenizer.decode(ids, skip_special_tokens=body.skip_special_tokens)) for ids in lists]
        return JSONResponse({"text": texts[0] if single else texts})

    @staticmethod
    def _parser(name: str | None, make: Any, default: Any, param: str, flag: str) -> Any:
        """The installed parser `name`, else the server's own (its flag's)."""
        if name is not None:
            try:
                return make(name)
            except BackendError as exc:
                raise APIError(str(exc), param=param) from None
        if default is None:
            raise APIError(f"name a {param} (the server has no {flag})", param=param)
        return default

    async def separate_reasoning(self, request: Request) -> Response:
        body = await read_body(request, SeparateReasoningRequest, self.context)
        parser = self._parser(body.reasoning_parser, self.context.reasoning_parsers, self.context.reasoning_parser,
                              "reasoning_parser", "--reasoning-parser")
        reasoning, text = await self.context.frontend.off_loop(parser.parse, body.text)
        return JSONResponse({"text": text, "reasoning_text": reasoning})

    async def parse_function_call(self, request: Request) -> Response:
        body = await read_body(request, ParseFunctionCallRequest, self.context)
        parser = self._parser(body.tool_call_parser, self.context.tool_parsers, self.context.tool_parser,
                              "tool_call_parser", "--tool-call-parser")
        text, calls = await self.context.frontend.off_loop(parser.parse, body.text)
        names = [tool.function.name for tool in body.tools or []]
        return JSONResponse({"normal_text": text, "calls": [
            {"tool_index": names.index(call.name) if call.name in names else -1, "name": call.name,
             "parameters": call.arguments} for call in calls]})

    async def open_session(self, request: Request) -> Response:
        body = await read_body(request, OpenSessionRequest, self.context)
        return JSONResponse(self.context.frontend.open_session(body.capacity_of_str_len, body.session_id))

    async def close_session(self, request: Request) -> Response:
        body = await read_body(request, CloseSessionRequest, self.context)
        await self.context.frontend.close_session(body.session_id)
        return Response(status_code=200)

    async def abort_request(self, request: Request) -> Response:
        body = await read_body(request, AbortRequestBody, self.context)
        if body.abort_all:
            self.context.frontend.abort_all()
        elif body.rid is not None:
            self.context.frontend.abort(body.rid)
        else:
            raise APIError("give the rid of the request to abort, or abort_all", param="rid")
        return Response(status_code=200)


def native_routes(context: ServerContext) -> list[Route]:
    routes = NativeRoutes(context)
    metrics = [Route("/metrics", routes.metrics, methods=["GET"])] if context.metrics is not None else []
    return [*metrics,
        Route("/health", routes.health, methods=["GET"]),
        Route("/health_generate", routes.health_generate, methods=["GET"]),
        Route("/generate", routes.generate, methods=["POST", "PUT"]),
        Route("/get_model_info", routes.get_model_info, methods=["GET"]),
        Route("/get_server_info", routes.get_server_info, methods=["GET"]),
        Route("/flush_cache", routes.flush_cache, methods=["POST"]),
        Route("/abort_request", routes.abort_request, methods=["POST"]),
        Route("/separate_reasoning", routes.separate_reasoning, methods=["POST"]),
        Route("/parse_function_call", routes.parse_function_call, methods=["POST"]),
        Route("/open_session", routes.open_session, methods=["POST"]),
        Route("/close_session", routes.close_session, methods=["POST"]),
        *(Route(f"{prefix}/{name}", getattr(routes, name), methods=["POST"])
          for prefix in ("", "/v1") for name in ("tokenize", "detokenize")),
    ]
