"""OpenAI's Responses API: POST /v1/responses (streamed or not), GET and DELETE /v1/responses/{id}.

A response request becomes a chat request (instructions as the system message, input items as
messages, function tools and `text.format` as they are in chat), so it renders, samples and
calls tools exactly as /v1/chat/completions does; the answer is a response object whose output
is a message item and function_call items. Stored responses (`store`, the default) are kept in
memory, the most recent MAX_STORED of them, for retrieval and for `previous_response_id`.
"""

from __future__ import annotations

import collections
import json
import time
import uuid
from typing import Any, AsyncIterator, Literal

from pydantic import BaseModel, ConfigDict, Field
from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route

from srv.engine.params import NonEmptyStr, StrictInput, Temperature, TokenCount, TopLogprobs, TopP
from srv.engine.request_state import RequestState
from srv.server.app import APIError, ServerContext, SSEResponse, checked, read_body, sse, until_done
from srv.server.chat_tools import ToolCalling
from srv.server.openai_routes import OpenAIRoutes, sampling_params
from srv.server.protocol import ChatCompletionRequest

MAX_STORED = 1024


class InputText(StrictInput):
    type: Literal["input_text", "output_text", "text"]
    text: str


class MessageItem(StrictInput):
    model_config = ConfigDict(extra="ignore")

    type: Literal["message"] = "message"
    role: Literal["user", "assistant", "system", "developer"]
    content: str | list[InputText]


class FunctionCallItem(StrictInput):
    model_config = ConfigDict(extra="ignore")

    type: Literal["function_call"]
    call_id: str
    name: str
    arguments: str


class FunctionCallOutputItem(StrictInput):
    model_config = ConfigDict(extra="ignore")

    type: Literal["function_call_output"]
    call_id: str
    output: str


class FunctionTool(StrictInput):
    type: Literal["function"]
    name: NonEmptyStr
    description: str | None = None
    parameters: dict[str, Any] | None = None
    strict: bool | None = None


class NamedFunction(StrictInput):
    type: Literal["function"]
    name: str


class TextFormat(StrictInput):
    type: Literal["text", "json_object", "json_schema"]
    name: str | None = None
    schema_: dict[str, Any] | None = Field(None, alias="schema")
    strict: bool | None = None


class TextConfig(StrictInput):
    format: TextFormat | None = None


class ResponsesRequest(StrictInput):
    """POST /v1/responses."""

    model_config = ConfigDict(extra="ignore")

    model: str | None = None
    input: str | list[MessageItem | FunctionCallItem | FunctionCallOutputItem]
    instructions: str | None = None
    max_output_tokens: TokenCount | None = None
    temperature: Temperature | None = None
    top_p: TopP | None = None
    top_logprobs: TopLogprobs | None = None
    stream: bool | None = None
    store: bool | None = None
    previous_response_id: str | None = None
    tools: list[FunctionTool] | None = None
    tool_choice: Literal["none", "auto", "required"] | NamedFunction | None = None
    parallel_tool_calls: bool | None = None
    text: TextConfig | None = None
    metadata: dict[str, str] | None = None
    user: str | None = None
    seed: int | None = None


class ResponseObject(BaseModel):
    """What POST /v1/responses answers (for the OpenAPI document)."""

    id: str
    object: Literal["response"]
    created_at: int
    status: str
    model: str
    output: list[dict[str, Any]]
    usage: dict[str, Any] | None


def _item_id(kind: str) -> str:
    return f"{kind}_{uuid.uuid4().hex}"


class ResponsesRoutes:
    def __init__(self, context: ServerContext, chat: OpenAIRoutes) -> None:
        self.context, self.chat = context, chat
        # id -> (the response object, the conversation it ends: messages for previous_response_id)
        self.stored: collections.OrderedDict[str, tuple[dict[str, Any], list[dict[str, Any]]]] = \
            collections.OrderedDict()

    # ---- the request as a chat request -------------------------------------------------------

    def _messages(self, body: ResponsesRequest) -> list[dict[str, Any]]:
        messages: list[dict[str, Any]] = []
        if body.previous_response_id is not None:
            if body.previous_response_id not in self.stored:
                raise APIError(f"Previous response with id '{body.previous_response_id}' not found.", 404,
                               "previous_response_id", "not_found_error")
            messages += self.stored[body.previous_response_id][1]
        if body.instructions:
            messages = [m for m in messages if m["role"] != "system"]
            messages.insert(0, {"role": "system", "content": body.instructions})
        items = [MessageItem(role="user", content=body.input)] if isinstance(body.input, str) else body.input
        for item in items:
            if isinstance(item, MessageItem):
                content = item.content if isinstance(item.content, str) else "".join(p.text for p in item.content)
                messages.append({"role": item.role, "content": content})
            elif isinstance(item, FunctionCallItem):
                call = {"id": item.call_id, "type": "function", "function": {"name": item.name,
                                                                               "arguments": item.arguments}}
                if messages and messages[-1]["role"] == "assistant" and "tool_calls" in messages[-1]:
                    messages[-1]["tool_calls"].append(call)
                else:
                    messages.append({"role": "assistant", "content": None, "tool_calls": [call]})
            else:
                messages.append({"role": "tool", "tool_call_id": item.call_id, "content": item.output})
        if not any(m["role"] != "system" for m in messages):
            raise APIError("input must hold at least one message", param="input")
        return messages

    def _chat_request(self, body: ResponsesRequest, messages: list[dict[str, Any]]) -> ChatCompletionRequest:
        chat: dict[str, Any] = {"messages": messages, "max_tokens": body.max_output_tokens,
                                "temperature": body.temperature, "top_p": body.top_p, "seed": body.seed,
                                "logprobs": bool(body.top_logprobs), "top_logprobs": body.top_logprobs}
        if body.tools:
            chat["tools"] = [{"type": "function", "function": tool.model_dump(exclude_none=True, by_alias=True,
                                                                              exclude={"type"})} for tool in body.tools]
        if isinstance(body.tool_choice, NamedFunction):
            chat["tool_choice"] = {"type": "function", "function": {"name": body.tool_choice.name}}
        elif body.tool_choice is not None:
            chat["tool_choice"] = body.tool_choice
        format_ = body.text.format if body.text is not None else None
        if format_ is not None and format_.type != "text":
            chat["response_format"] = {"type": format_.type} if format_.type == "json_object" else {
                "type": "json_schema", "json_schema": {"name": format_.name or "response", "schema": format_.schema_,
                                                       "strict": format_.strict}}
        return ChatCompletionRequest.model_validate({k: v for k, v in chat.items() if v is not None})

    # ---- the route -----------------------------------------------------------------------------

    async def create(self, request: Request) -> Response:
        body = await read_body(request, ResponsesRequest, self.context)
        self.context.log.request("/v1/responses", body)
        adapter = self.chat.check_model(body.model)
        messages = self._messages(body)
        chat = self._chat_request(body, messages)
        tools = ToolCalling.from_request(chat.tools, chat.tool_choice, self.context.tool_parser)
        prompt = await self.context.frontend.off_loop(self.chat.render_chat, chat, tools)
        params = sampling_params(chat, bool(chat.logprobs), chat.top_logprobs or 0, adapter)
        tool_schema = tools.json_schema() if tools is not None else None
        if tool_schema is not None:
            params["json_schema"] = json.dumps(tool_schema)
        [[state]] = await self.context.frontend.submit([prompt], [None], [params], labels=self.context.labels(request),
                                                       dp_rank=self.context.dp_rank(request))
        response = self._response(body, "in_progress")
        if body.stream:
            return self._stream(body, response, state, tools, messages)
        await until_done(request, self.context.frontend.wait([[state]]))
        self._complete(response, checked(state), tools)
        self._store(body, response, messages)
        return JSONResponse(response)

    def _response(self, body: ResponsesRequest, status: str) -> dict[str, Any]:
        format_ = body.text.format.model_dump(by_alias=True, exclude_none=True) \
            if body.text is not None and body.text.format is not None else {"type": "text"}
        tool_choice = body.tool_choice.model_dump() if isinstance(body.tool_choice, NamedFunction) \
            else body.tool_choice or "auto"
        return {"id": _item_id("resp"), "object": "response", "created_at": int(time.time()), "status": status,
                "model": self.context.model_name, "output": [], "error": None, "incomplete_details": None,
                "instructions": body.instructions, "max_output_tokens": body.max_output_tokens,
                "temperature": body.temperature if body.temperature is not None else 1.0,
                "top_p": body.top_p if body.top_p is not None else 1.0,
                "tools": [t.model_dump(exclude_none=True) for t in body.tools or []], "tool_choice": tool_choice,
                "parallel_tool_calls": body.parallel_tool_calls is not False, "text": {"format": format_},
                "previous_response_id": body.previous_response_id, "metadata": body.metadata or {},
                "store": body.store is not False, "truncation": "disabled", "usage": None, "user": body.user}

    def _output(self, state: RequestState, tools: ToolCalling | None) -> list[dict[str, Any]]:
        """The output items of a finished request: its message, then its function calls."""
        text, calls = state.text, []
        if tools is not None:
            own = tools.for_choice()
            stream = own.stream()
            content, _ = stream.feed(text)
            text = (content + stream.finish()).strip()
            calls = own.tool_calls(stream)
        items = []
        if text or not calls:
            items.append({"type": "message", "id": _item_id("msg"), "status": "completed", "role": "assistant",
                          "content": [{"type": "output_text", "text": text, "annotations": [], "logprobs": []}]})
        items += [{"type": "function_call", "id": _item_id("fc"), "call_id": call["id"], "status": "completed",
                   "name": call["function"]["name"], "arguments": call["function"]["arguments"]} for call in calls]
        return items

    def _complete(self, response: dict[str, Any], state: RequestState, tools: ToolCalling | None) -> None:
        response["output"] = self._output(state, tools)
        incomplete = state.finish_reason == "length"
        response["status"] = "incomplete" if incomplete else "completed"
        response["incomplete_details"] = {"reason": "max_output_tokens"} if incomplete else None
        prompt, output = len(state.prompt_ids), len(state.output_ids)
        response["usage"] = {"input_tokens": prompt, "input_tokens_details": {"cached_tokens": state.cached_tokens},
                             "output_tokens": output, "output_tokens_details": {"reasoning_tokens": 0},
                             "total_tokens": prompt + output}

    def _store(self, body: ResponsesRequest, response: dict[str, Any], messages: list[dict[str, Any]]) -> None:
        if body.store is False:
            return
        answer: list[dict[str, Any]] = []
        for item in response["output"]:
            if item["type"] == "message":
                answer.append({"role": "assistant", "content": item["content"][0]["text"]})
            else:
                call = {"id": item["call_id"], "type": "function",
                        "function": {"name": item["name"], "arguments": item["arguments"]}}
                if answer and "tool_calls" in answer[-1]:
                    answer[-1]["tool_calls"].append(call)
                else:
                    answer.append({"role": "assistant", "content": None, "tool_calls": [call]})
        self.stored[response["id"]] = (response, messages + answer)
        while len(self.stored) > MAX_STORED:
            self.stored.popitem(last=False)

    def _stream(self, body: ResponsesRequest, response: dict[str, Any], state: RequestState,
                tools: ToolCalling | None, messages: list[dict[str, Any]]) -> Response:
        """OpenAI's response events: created, the message's text deltas (only once no function
        call can follow when tools are in play), the items done, completed."""
        frontend = self.context.frontend
        updates = frontend.follow([[state]], self.context.args.stream_interval)
        sequence = iter(range(1 << 62))

        def event(kind: str, **fields: Any) -> str:
            return f"event: {kind}\n" + sse({"type": kind, "sequence_number": next(sequence), **fields})

        async def body_events() -> AsyncIterator[str]:
            message_id, sent = _item_id("msg"), 0
            yield event("response.created", response=response)
            yield event("response.in_progress", response=response)
            try:
                if tools is None:
                    part = {"type": "output_text", "text": "", "annotations": [], "logprobs": []}
                    yield event("response.output_item.added", output_index=0, item={
                        "type": "message", "id": message_id, "status": "in_progress", "role": "assistant", "content": []})
                    yield event("response.content_part.added", item_id=message_id, output_index=0, content_index=0,
                                part=part)
                async for _, update in updates:
                    if update.error is not None:
                        response.update(status="failed", error={"code": "server_error", "message": update.error})
                        yield event("response.failed", response=response)
                        return
                    if tools is None and len(update.text) > sent:
                        yield event("response.output_text.delta", item_id=message_id, output_index=0,
                                    content_index=0, delta=update.text[sent:], logprobs=[])
                        sent = len(update.text)
                self._complete(response, state, tools)
                for index, item in enumerate(response["output"]):
                    if item["type"] == "message":
                        item["id"] = message_id
                        text = item["content"][0]["text"]
                        if tools is not None:
                            yield event("response.output_item.added", output_index=index,
                                        item={**item, "status": "in_progress", "content": []})
                            yield event("response.content_part.added", item_id=message_id, output_index=index,
                                        content_index=0, part={**item["content"][0], "text": ""})
                            yield event("response.output_text.delta", item_id=message_id, output_index=index,
                                        content_index=0, delta=text, logprobs=[])
                        yield event("response.output_text.done", item_id=message_id, output_index=index,
                                    content_index=0, text=text, logprobs=[])
                        yield event("response.content_part.done", item_id=message_id, output_index=index,
                                    content_index=0, part=item["content"][0])
                    else:
                        yield event("response.output_item.added", output_index=index,
                                    item={**item, "status": "in_progress", "arguments": ""})
                        yield event("response.function_call_arguments.delta", item_id=item["id"], output_index=index,
                                    delta=item["arguments"])
                        yield event("response.function_call_arguments.done", item_id=item["id"], output_index=index,
                                    arguments=item["arguments"], name=item["name"])
                    yield event("response.output_item.done", output_index=index, item=item)
                self._store(body, response, messages)
                yield event("response.completed", response=response)
            finally:
                await updates.aclose()

        return SSEResponse(body_events(), lambda: frontend.release([[state]]))

    async def retrieve(self, request: Request) -> Response:
        return JSONResponse(self._stored(request.path_params["response_id"])[0])

    async def delete(self, request: Request) -> Response:
        response_id = request.path_params["response_id"]
        self._stored(response_id)
        del self.stored[response_id]
        return JSONResponse({"id": response_id, "object": "response", "deleted": True})

    def _stored(self, response_id: str) -> tuple[dict[str, Any], list[dict[str, Any]]]:
        if response_id not in self.stored:
            raise APIError(f"Response with id '{response_id}' not found.", 404, "response_id", "not_found_error")
        return self.stored[response_id]


def responses_routes(context: ServerContext, chat: OpenAIRoutes) -> list[Route]:
    routes = ResponsesRoutes(context, chat)
    return [Route("/v1/responses", routes.create, methods=["POST"]),
            Route("/v1/responses/{response_id}", routes.retrieve, methods=["GET"]),
            Route("/v1/responses/{response_id}", routes.delete, methods=["DELETE"])]
