"""OpenAI-compatible routes: /v1/models, /v1/completions, /v1/chat/completions."""

from __future__ import annotations

import json
import time
import uuid
from pathlib import Path
from typing import Any, AsyncIterator, Callable

from jinja2 import TemplateError
from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route

from srv.engine.request_state import RequestState
from srv.sdk.grammar import ANY_JSON_OBJECT, GRAMMAR_KINDS
from srv.server.app import APIError, ServerContext, check_choices, checked, event_stream, read_body, until_done
from srv.server.chat_tools import ToolCalling, history_message
from srv.server.protocol import ChatCompletionRequest, CompletionRequest, ResponseFormat, SamplingFields

# OpenAI request fields (and SGLang's extra ones) and the srv sampling parameter each sets.
SAMPLING_FIELDS = {
    "temperature": "temperature", "top_p": "top_p", "top_k": "top_k", "min_p": "min_p",
    "repetition_penalty": "repetition_penalty", "frequency_penalty": "frequency_penalty",
    "presence_penalty": "presence_penalty", "seed": "seed", "logit_bias": "logit_bias", "stop": "stop",
    "stop_token_ids": "stop_token_ids", "min_tokens": "min_new_tokens", "ignore_eos": "ignore_eos", "n": "n",
    "json_schema": "json_schema", "regex": "regex", "ebnf": "ebnf",
}


def response_format_schema(response_format: ResponseFormat | None) -> str | None:
    """The JSON schema a `response_format` constrains the output to, as text (None: free text)."""
    if response_format is None or response_format.type == "text":
        return None
    if response_format.type == "json_object":
        return ANY_JSON_OBJECT
    spec = response_format.json_schema
    if spec is None:
        raise APIError("response_format.json_schema is required for type json_schema", param="response_format")
    # Without a schema any JSON object will do; `strict` changes nothing here, since the
    # output is always constrained to the schema exactly.
    return json.dumps(spec.schema_ or json.loads(ANY_JSON_OBJECT))


def sampling_params(body: SamplingFields, logprobs: bool, top_logprobs: int = 0) -> dict[str, Any]:
    params: dict[str, Any] = {}
    max_tokens = body.max_completion_tokens if body.max_completion_tokens is not None else body.max_tokens
    if max_tokens is not None:
        params["max_new_tokens"] = max_tokens
    for name, ours in SAMPLING_FIELDS.items():
        value = getattr(body, name)
        if value is not None:
            params[ours] = value
    if logprobs:
        params.update(logprobs=True, top_logprobs=top_logprobs)
    schema = response_format_schema(body.response_format)
    if schema is not None:
        if any(kind in params for kind in GRAMMAR_KINDS):
            raise APIError("response_format cannot be combined with json_schema, regex or ebnf", param="response_format")
        params["json_schema"] = schema
    return params


def usage(groups: list[list[RequestState]]) -> dict[str, Any]:
    """Token counts of the n completions of each prompt; a prompt counts once, as in OpenAI's API."""
    prompt_tokens = sum(len(group[0].prompt_ids) for group in groups)
    completion_tokens = sum(len(s.output_ids) for group in groups for s in group)
    cached_tokens = sum(group[0].cached_tokens for group in groups)
    return {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
            "total_tokens": prompt_tokens + completion_tokens,
            "prompt_tokens_details": {"cached_tokens": cached_tokens}}


class OpenAIRoutes:
    def __init__(self, context: ServerContext) -> None:
        self.context = context
        template = context.args.chat_template
        if template and Path(template).is_file():
            template = Path(template).read_text(encoding="utf-8")
        self.chat_template = template or None

    def check_model(self, model: str | None) -> None:
        if model is not None and model != self.context.model_name:
            raise APIError(f"the model {model!r} does not exist", 404, "model", "not_found_error")

    def _tokenizer(self) -> Any:
        if self.context.tokenizer is None:
            raise APIError("this server runs with --skip-tokenizer-init: use /generate with input_ids")
        return self.context.tokenizer

    def token_text(self, token: int) -> str:
        return self._tokenizer().decode([token])

    # ---- /v1/models ------------------------------------------------------------------------------

    def _model_card(self) -> dict[str, Any]:
        return {"id": self.context.model_name, "object": "model", "created": 0, "owned_by": "srv",
                "root": self.context.model_name, "max_model_len": self.context.frontend.context_len}

    async def models(self, request: Request) -> Response:
        return JSONResponse({"object": "list", "data": [self._model_card()]})

    async def model(self, request: Request) -> Response:
        if request.path_params["model"] != self.context.model_name:
            raise APIError(f"the model {request.path_params['model']!r} does not exist", 404, "model", "not_found_error")
        return JSONResponse(self._model_card())

    def _stream(self, body: SamplingFields, states: AsyncIterator[RequestState], rid: str, created: int,
                kind: str, choice: Callable[[RequestState, str, bool], dict[str, Any] | None]) -> Response:
        """Chunks of one streamed choice, and a last chunk with usage if stream_options ask."""
        include_usage = bool(body.stream_options is not None and body.stream_options.include_usage)
        header = {"id": rid, "object": kind, "created": created, "model": self.context.model_name}
        last: list[RequestState] = []
        started: list[bool] = []       # a chunk went out (the first one carries the role)

        def events(state: RequestState, text: str) -> list[Any]:
            last[:] = [state]
            piece = choice(state, text, not started)
            if piece is None:
                return []
            started[:] = [True]
            return [{**header, "choices": [piece]}]

        def closing() -> list[Any]:
            return [{**header, "choices": [], "usage": usage([last])}] if include_usage else []

        return event_stream(states, events, closing)

    # ---- /v1/completions ---------------------------------------------------------------------

    @staticmethod
    def _completion_prompts(body: CompletionRequest) -> tuple[list[str | None], list[list[int] | None]]:
        prompt = body.prompt
        if isinstance(prompt, str):
            return [prompt], [None]
        if all(isinstance(p, str) for p in prompt):
            return list(prompt), [None] * len(prompt)
        if all(isinstance(t, int) for t in prompt):
            return [None], [prompt]
        return [None] * len(prompt), list(prompt)

    def _completion_logprobs(self, state: RequestState, offset: int) -> dict[str, Any]:
        tokens = [self.token_text(t) for t in state.output_ids]
        offsets, position = [], offset
        for token in tokens:
            offsets.append(position)
            position += len(token)
        return {"tokens": tokens, "token_logprobs": list(state.logprobs),
                "top_logprobs": [{self.token_text(t): lp for t, lp in top} for top in state.top_logprobs],
                "text_offset": offsets}

    async def completions(self, request: Request) -> Response:
        body = await read_body(request, CompletionRequest, self.context)
        self.context.log.request("/v1/completions", body)
        self.check_model(body.model)
        if body.suffix:
            raise APIError("suffix is not supported", param="suffix")
        logprobs = body.logprobs or 0
        echo = bool(body.echo)
        prompts, ids = self._completion_prompts(body)
        check_choices(len(prompts), body.n)
        params = sampling_params(body, bool(logprobs), logprobs)
        created, rid = int(time.time()), f"cmpl-{uuid.uuid4().hex}"
        frontend = self.context.frontend
        if body.stream:
            if len(prompts) > 1 or params.get("n", 1) > 1:
                raise APIError("streaming takes one prompt with n = 1", param="stream")
            states = await frontend.stream(prompts[0], ids[0], params, interval=self.context.args.stream_interval,
                                           labels=self.context.labels(request))
            return self._stream(body, states, rid, created, "text_completion", lambda state, text, first: {
                "index": 0, "text": text, "logprobs": None, "finish_reason": state.finish_reason})
        groups = await until_done(request, frontend.generate(prompts, ids, [params] * len(prompts),
                                                             labels=self.context.labels(request)))
        choices = []
        for prompt, group in zip(prompts, groups):
            for state in group:
                checked(state)
                prefix = (prompt if prompt is not None else self._tokenizer().decode(state.prompt_ids)) if echo else ""
                choices.append({"index": len(choices), "text": prefix + state.text, "finish_reason": state.finish_reason,
                                "logprobs": self._completion_logprobs(state, len(prefix)) if logprobs else None})
        response = {"id": rid, "object": "text_completion", "created": created, "model": self.context.model_name,
                    "choices": choices, "usage": usage(groups)}
        self.context.log.response("/v1/completions", {"id": rid, "text": [c["text"] for c in choices],
                                                      "usage": response["usage"]})
        return JSONResponse(response)

    # ---- /v1/chat/completions ------------------------------------------------------------------

    def render_chat(self, body: ChatCompletionRequest, tools: ToolCalling | None = None) -> str:
        """The prompt the chat template makes of the messages (and tools)."""
        normalized = []
        for message in body.messages:
            fields = message.model_dump(exclude_unset=True)
            content = message.content
            if isinstance(content, list):
                content = "".join(part.text for part in content)
            normalized.append(history_message({**fields, "content": content or ""}, self.context.tool_parser,
                                              self.template_source))
        kwargs = {}
        if tools is not None:
            normalized = tools.announce(normalized, self.template_source)
            kwargs = tools.template_kwargs(self.template_source)
        try:
            return self._tokenizer().apply_chat_template(normalized, chat_template=self.chat_template, tokenize=False,
                                                         add_generation_prompt=True, **kwargs)
        except TemplateError as exc:   # the template's raise_exception: messages it does not take
            raise APIError(f"the chat template refused the messages: {exc}", param="messages") from None

    @property
    def template_source(self) -> str:
        return self.chat_template or getattr(self._tokenizer(), "chat_template", None) or ""

    def _chat_logprobs(self, state: RequestState) -> dict[str, Any]:
        def entry(token: int, logprob: float) -> dict[str, Any]:
            text = self.token_text(token)
            return {"token": text, "logprob": logprob, "bytes": list(text.encode())}

        return {"content": [{**entry(t, lp), "top_logprobs": [entry(i, v) for i, v in top]}
                            for t, lp, top in zip(state.output_ids, state.logprobs,
                                                  state.top_logprobs or [[]] * len(state.output_ids))]}

    async def chat_completions(self, request: Request) -> Response:
        body = await read_body(request, ChatCompletionRequest, self.context)
        self.context.log.request("/v1/chat/completions", body)
        self.check_model(body.model)
        check_choices(1, body.n)
        tools = ToolCalling.from_request(body.tools, body.tool_choice, self.context.tool_parser)
        # Rendering a long conversation takes a while: off the event loop.
        prompt = await self.context.frontend.off_loop(self.render_chat, body, tools)
        want_logprobs = bool(body.logprobs)
        params = sampling_params(body, want_logprobs, body.top_logprobs or 0)
        tool_schema = tools.json_schema() if tools is not None else None
        if tool_schema is not None:
            if any(kind in params for kind in GRAMMAR_KINDS):
                raise APIError("a required or named tool_choice cannot be combined with response_format, json_schema, "
                               "regex or ebnf", param="tool_choice")
            params["json_schema"] = json.dumps(tool_schema)
        created, rid = int(time.time()), f"chatcmpl-{uuid.uuid4().hex}"
        frontend = self.context.frontend
        if body.stream:
            if params.get("n", 1) > 1:
                raise APIError("streaming takes n = 1", param="stream")
            states = await frontend.stream(prompt, None, params, interval=self.context.args.stream_interval,
                                           labels=self.context.labels(request))
            return self._stream(body, states, rid, created, "chat.completion.chunk", self._chat_chunk(tools))
        [group] = await until_done(request, frontend.generate([prompt], [None], [params],
                                                              labels=self.context.labels(request)))
        choices = []
        for i, state in enumerate(group):
            message, called = ((tools.message(checked(state).text) if tools is not None
                               else ({"role": "assistant", "content": checked(state).text}, False)))
            choices.append({"index": i, "message": message,
                            "logprobs": self._chat_logprobs(state) if want_logprobs else None,
                            "finish_reason": "tool_calls" if called and state.finish_reason == "stop" else state.finish_reason})
        response = {"id": rid, "object": "chat.completion", "created": created, "model": self.context.model_name,
                    "choices": choices, "usage": usage([group])}
        self.context.log.response("/v1/chat/completions", {"id": rid, "messages": [c["message"] for c in choices],
                                                           "usage": response["usage"]})
        return JSONResponse(response)

    @staticmethod
    def _chat_chunk(tools: ToolCalling | None) -> Callable[[RequestState, str, bool], dict[str, Any] | None]:
        """The choice of each streamed chunk: content deltas, and with tools, tool-call deltas."""
        stream = tools.stream() if tools is not None else None

        def choice(state: RequestState, text: str, first: bool) -> dict[str, Any] | None:
            delta: dict[str, Any] = {"role": "assistant"} if first else {}
            finish = state.finish_reason
            if stream is None:
                delta["content"] = text
            else:
                content, deltas = stream.feed(text)
                if finish is not None:
                    content += stream.finish()
                if content:
                    delta["content"] = content
                if deltas:
                    delta["tool_calls"] = tools.delta_objects(deltas)
                if stream.calls and finish == "stop":
                    finish = "tool_calls"
                if not delta and finish is None:
                    return None
            return {"index": 0, "delta": delta, "logprobs": None, "finish_reason": finish}

        return choice


def openai_routes(context: ServerContext) -> list[Route]:
    routes = OpenAIRoutes(context)
    return [
        Route("/v1/models", routes.models, methods=["GET"]),
        Route("/v1/models/{model:path}", routes.model, methods=["GET"]),
        Route("/v1/completions", routes.completions, methods=["POST"]),
        Route("/v1/chat/completions", routes.chat_completions, methods=["POST"]),
    ]
