"""OpenAI-compatible routes: /v1/models, /v1/completions, /v1/chat/completions."""

from __future__ import annotations

import json
import time
import uuid
from pathlib import Path
from typing import Any, Callable

from jinja2 import TemplateError
from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route

from srv.engine.params import SharedSamplingFields
from srv.engine.request_state import RequestState
from srv.sdk.grammar import ANY_JSON_OBJECT, GRAMMAR_KINDS
from srv.sdk.reasoning import ReasoningStream
from srv.sdk.tools import ToolCallStream
from srv.server.app import (APIError, ServerContext, Step, check_choices, checked, event_stream, read_body,
                            until_done)
from srv.server.chat_tools import ToolCalling, history_message
from srv.server.protocol import ChatCompletionRequest, CompletionRequest, ResponseFormat, SamplingFields, TextPart

# OpenAI's request fields (and SGLang's extra ones) that set a sampling parameter: the ones
# /generate names alike, and min_tokens.
SAMPLING_FIELDS = {**{name: name for name in SharedSamplingFields.model_fields}, "min_tokens": "min_new_tokens"}


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


def sampling_params(body: SamplingFields, logprobs: bool, top_logprobs: int = 0,
                    lora_path: str | None = None) -> dict[str, Any]:
    params: dict[str, Any] = {"lora_path": lora_path} if lora_path else {}
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

    def check_model(self, model: str | None) -> str | None:
        """The LoRA adapter `model` names ("base:adapter" or the adapter's name; None: the base
        model); a 404 for a model the server does not serve."""
        if model is None or model == self.context.model_name:
            return None
        adapters = self.context.frontend.lora_names
        base, _, adapter = model.rpartition(":")
        if base == self.context.model_name and adapter in adapters:
            return adapter
        if model in adapters:
            return model
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
        adapters = [{**self._model_card(), "id": name, "parent": self.context.model_name}
                    for name in self.context.frontend.lora_names]
        return JSONResponse({"object": "list", "data": [self._model_card(), *adapters]})

    async def model(self, request: Request) -> Response:
        if request.path_params["model"] != self.context.model_name:
            raise APIError(f"the model {request.path_params['model']!r} does not exist", 404, "model", "not_found_error")
        return JSONResponse(self._model_card())

    async def _respond(self, request: Request, body: SamplingFields, groups: list[list[RequestState]], kind: str,
                       choice: Callable[[int, RequestState, Step], dict[str, Any] | None],
                       final: Callable[[dict[str, Any]], dict[str, Any]] = lambda piece: piece) -> Response:
        """The response to `submit`'s groups: streamed, a chunk per choice's update (`choice`
        makes its piece from the step), or once every choice ends, each piece made by the same
        `choice` from the whole output and turned into a final choice by `final`."""
        rid, created = f"{'chatcmpl' if kind == 'chat' else 'cmpl'}-{uuid.uuid4().hex}", int(time.time())
        header = {"id": rid, "created": created, "model": self.context.model_name}
        frontend = self.context.frontend
        states = [state for group in groups for state in group]
        if body.stream:
            options = body.stream_options
            include_usage = bool(options and options.include_usage)
            continuous = bool(options and options.continuous_usage_stats)
            chunk_kind = "chat.completion.chunk" if kind == "chat" else "text_completion"

            def events(index: int, state: RequestState, step: Step) -> list[Any]:
                piece = choice(index, state, step)
                if piece is None:
                    return []
                chunk = {**header, "object": chunk_kind, "choices": [piece]}
                if continuous:
                    chunk["usage"] = usage([[state]])
                return [chunk]

            def closing() -> list[Any]:
                return [{**header, "object": chunk_kind, "choices": [], "usage": usage(groups)}] if include_usage else []

            return event_stream(frontend.follow(groups, self.context.args.stream_interval), events, closing,
                                lambda: frontend.release(groups))

        await until_done(request, frontend.wait(groups))
        choices = [final(choice(index, checked(state), Step.whole(state))) for index, state in enumerate(states)]
        response = {**header, "object": "chat.completion" if kind == "chat" else "text_completion",
                    "choices": choices, "usage": usage(groups)}
        self.context.log.response(request.url.path, {"id": rid, "choices": choices, "usage": response["usage"]})
        return JSONResponse(response)

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

    def _completion_logprobs(self, state: RequestState, tokens: range, offset: int) -> tuple[dict[str, Any], int]:
        """OpenAI's legacy logprobs of `state`'s tokens in `tokens`, the first at text offset
        `offset`; and the offset after them."""
        texts = [self.token_text(state.output_ids[i]) for i in tokens]
        offsets = []
        for text in texts:
            offsets.append(offset)
            offset += len(text)
        top = [{self.token_text(t): lp for t, lp in state.top_logprobs[i]} for i in tokens] \
            if state.top_logprobs else [None] * len(texts)
        return {"tokens": texts, "token_logprobs": [state.logprobs[i] for i in tokens], "top_logprobs": top,
                "text_offset": offsets}, offset

    def _prompt_logprobs(self, state: RequestState, output: dict[str, Any]) -> dict[str, Any]:
        """`output`'s legacy logprobs with the echoed prompt's before them (the first token's
        log-probability is null, as in OpenAI's API)."""
        texts = [self.token_text(t) for t in state.prompt_ids]
        offsets = [sum(map(len, texts[:i])) for i in range(len(texts))]
        top = [{self.token_text(t): lp for t, lp in entry} or None for entry in state.input_top_logprobs]
        return {"tokens": texts + output["tokens"], "token_logprobs": list(state.input_logprobs) + output["token_logprobs"],
                "top_logprobs": top + output["top_logprobs"], "text_offset": offsets + output["text_offset"]}

    async def completions(self, request: Request) -> Response:
        body = await read_body(request, CompletionRequest, self.context)
        self.context.log.request("/v1/completions", body)
        adapter = self.check_model(body.model)
        if body.suffix:
            raise APIError("suffix is not supported", param="suffix")
        logprobs = body.logprobs or 0
        prompts, ids = self._completion_prompts(body)
        check_choices(len(prompts), body.n)
        params = sampling_params(body, body.logprobs is not None, logprobs, adapter)
        if body.echo and body.logprobs is not None:   # OpenAI's legacy API: the prompt's log-probabilities too
            params["logprob_start_len"] = 0
        groups = await self.context.frontend.submit(prompts, ids, [params] * len(prompts),
                                                    labels=self.context.labels(request),
                                                    dp_rank=self.context.dp_rank(request))
        prompt_of = [prompt for prompt, group in zip(prompts, groups) for _ in group]
        offsets: dict[int, int] = {}

        def choice(index: int, state: RequestState, step: Step) -> dict[str, Any]:
            prefix = ""
            if step.first and body.echo:
                prompt = prompt_of[index]
                prefix = prompt if prompt is not None else self._tokenizer().decode(state.prompt_ids)
            piece: dict[str, Any] = {"index": index, "text": prefix + step.text, "logprobs": None,
                                     "finish_reason": state.finish_reason if step.ending else None,
                                     "matched_stop": state.matched_stop if step.ending else None}
            if body.logprobs is not None:
                logprobs, offsets[index] = self._completion_logprobs(state, step.tokens,
                                                                     offsets.get(index, len(prefix)))
                piece["logprobs"] = self._prompt_logprobs(state, logprobs) if step.first and body.echo else logprobs
            return piece

        return await self._respond(request, body, groups, "completion", choice)

    # ---- /v1/chat/completions ------------------------------------------------------------------

    def render_chat(self, body: ChatCompletionRequest, tools: ToolCalling | None = None) -> str:
        """The prompt the chat template makes of the messages (and tools). With
        continue_final_message, a last assistant message is the start of the answer."""
        messages = list(body.messages)
        prefill = ""
        if body.continue_final_message:
            if messages[-1].role != "assistant":
                raise APIError("continue_final_message needs the last message to be the assistant's",
                               param="continue_final_message")
            prefill = _text_of(messages.pop().content)
        normalized = [history_message({**message.model_dump(exclude_unset=True), "content": _text_of(message.content)},
                                      self.context.tool_parser, self.template_source) for message in messages]
        kwargs = dict(body.chat_template_kwargs or {})
        if tools is not None:
            normalized = tools.announce(normalized, self.template_source)
            kwargs.update(tools.template_kwargs(self.template_source))
        add_generation_prompt = body.add_generation_prompt is not False or bool(prefill)
        try:
            prompt = self._tokenizer().apply_chat_template(normalized, chat_template=self.chat_template, tokenize=False,
                                                           add_generation_prompt=add_generation_prompt, **kwargs)
        except TemplateError as exc:   # the template's raise_exception: messages it does not take
            raise APIError(f"the chat template refused the messages: {exc}", param="messages") from None
        return prompt + prefill

    @property
    def template_source(self) -> str:
        return self.chat_template or getattr(self._tokenizer(), "chat_template", None) or ""

    def _chat_logprobs(self, state: RequestState, tokens: range) -> dict[str, Any]:
        def entry(token: int, logprob: float) -> dict[str, Any]:
            text = self.token_text(token)
            return {"token": text, "logprob": logprob, "bytes": list(text.encode())}

        return {"content": [{**entry(state.output_ids[i], state.logprobs[i]),
                             "top_logprobs": [entry(t, v) for t, v in state.top_logprobs[i]] if state.top_logprobs else []}
                            for i in tokens]}

    async def chat_completions(self, request: Request) -> Response:
        body = await read_body(request, ChatCompletionRequest, self.context)
        self.context.log.request("/v1/chat/completions", body)
        adapter = self.check_model(body.model)
        check_choices(1, body.n)
        tools = ToolCalling.from_request(body.tools, body.tool_choice, self.context.tool_parser)
        # Rendering a long conversation takes a while: off the event loop.
        prompt = await self.context.frontend.off_loop(self.render_chat, body, tools)
        params = sampling_params(body, bool(body.logprobs), body.top_logprobs or 0, adapter)
        tool_schema = tools.json_schema() if tools is not None else None
        if tool_schema is not None:
            if any(kind in params for kind in GRAMMAR_KINDS):
                raise APIError("a required or named tool_choice cannot be combined with response_format, json_schema, "
                               "regex or ebnf", param="tool_choice")
            params["json_schema"] = json.dumps(tool_schema)
        groups = await self.context.frontend.submit([prompt], [None], [params], labels=self.context.labels(request),
                                                    dp_rank=self.context.dp_rank(request))
        streams: dict[int, ToolCallStream] = {}
        calling: dict[int, ToolCalling] = {}
        reasoning = self.context.reasoning_parser if body.separate_reasoning else None
        thinking: dict[int, ReasoningStream] = {}
        held_reasoning: dict[int, str] = {}   # with stream_reasoning false: the reasoning until it ends

        def split_reasoning(index: int, text: str, ending: bool) -> tuple[str, str]:
            """(reasoning, content) of a step's text, as far as the choice's reasoning stream knows."""
            stream = thinking.setdefault(index, reasoning.stream())
            thought, content = stream.feed(text)
            if ending:
                more_thought, more_content = stream.finish()
                thought, content = thought + more_thought, content + more_content
            if body.stream and not body.stream_reasoning:
                held_reasoning[index] = held_reasoning.get(index, "") + thought
                thought = held_reasoning.pop(index) if ending or not stream.in_reasoning else ""
            return thought, content

        def choice(index: int, state: RequestState, step: Step) -> dict[str, Any] | None:
            delta: dict[str, Any] = {"role": "assistant"} if step.first else {}
            finish = state.finish_reason if step.ending else None
            text = step.text
            if reasoning is not None:
                thought, text = split_reasoning(index, text, step.ending)
                if thought:
                    delta["reasoning_content"] = thought
            if tools is None:
                if text or reasoning is None:
                    delta["content"] = text
            else:
                own = calling.setdefault(index, tools.for_choice())
                stream = streams.setdefault(index, own.stream())
                content, deltas = stream.feed(text)
                if step.ending:
                    content += stream.finish()
                if content:
                    delta["content"] = content
                if deltas:
                    delta["tool_calls"] = own.delta_objects(deltas)
                if stream.calls and finish == "stop":
                    finish = "tool_calls"
            if body.stream and not step.first and not delta and finish is None and not step.tokens:
                return None
            return {"index": index, "delta": delta,
                    "logprobs": self._chat_logprobs(state, step.tokens) if body.logprobs else None,
                    "finish_reason": finish, "matched_stop": state.matched_stop if step.ending else None}

        def final(piece: dict[str, Any]) -> dict[str, Any]:
            """The whole output's piece as a message: its text, and with tools the calls read from it."""
            delta = piece.pop("delta")
            index, content = piece["index"], delta.get("content", "")
            message: dict[str, Any] = {"role": "assistant", "content": content}
            if reasoning is not None:
                message["reasoning_content"] = delta.get("reasoning_content") or None
            if tools is not None:
                message["content"] = content.strip() or None
                calls = calling[index].tool_calls(streams[index])
                if calls:
                    message["tool_calls"] = calls
            return {"index": index, "message": message, **{k: v for k, v in piece.items() if k != "index"}}

        return await self._respond(request, body, groups, "chat", choice, final)


def _text_of(content: str | list[TextPart] | None) -> str:
    """A message's content as text (its text parts joined)."""
    if isinstance(content, list):
        return "".join(part.text for part in content)
    return content or ""


def openai_routes(context: ServerContext) -> list[Route]:
    from srv.server.responses_routes import responses_routes

    routes = OpenAIRoutes(context)
    return [
        Route("/v1/models", routes.models, methods=["GET"]),
        Route("/v1/models/{model:path}", routes.model, methods=["GET"]),
        Route("/v1/completions", routes.completions, methods=["POST"]),
        Route("/v1/chat/completions", routes.chat_completions, methods=["POST"]),
        *responses_routes(context, routes),
    ]
