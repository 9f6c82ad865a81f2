"""Tool calling in /v1/chat/completions: check `tools` and `tool_choice`, show the tools to the
model, constrain its output when a call is required, and turn the output into OpenAI `tool_calls`.

With `tool_choice` "required" the output is a JSON array of calls, and with a named function it
is that function's arguments, each constrained by a JSON schema built from the tools, so the
calls always parse. With "auto" the model writes calls in its own format, which the
`--tool-call-parser` plugin reads.
"""

from __future__ import annotations

import json
import uuid
from dataclasses import dataclass, field
from typing import Any

from srv.sdk.tools import ToolCall, ToolCallDelta, ToolCallParser, ToolCallStream
from srv.server.app import APIError
from srv.server.protocol import NamedToolChoice, Tool

ANY_OBJECT: dict[str, Any] = {"type": "object"}


@dataclass
class ToolCalling:
    """One request's tools, and what its tool_choice makes of the output."""

    parser: ToolCallParser
    functions: list[dict[str, Any]]
    choice: str                       # "auto" or "required", or "named" for one function
    named: str | None = None
    calls: list[ToolCall] = field(default_factory=list)
    ids: list[str] = field(default_factory=list)

    @classmethod
    def from_request(cls, tools: list[Tool] | None, choice: str | NamedToolChoice | None,
                     parser: ToolCallParser | None) -> "ToolCalling | None":
        """None when the request does not call tools (no tools, or tool_choice "none")."""
        if tools is None:
            if choice not in (None, "none"):
                raise APIError("tool_choice needs tools", param="tool_choice")
            return None
        functions = [tool.function.model_dump(exclude_none=True) for tool in tools]
        names = {function["name"] for function in functions}
        named = None
        if choice is None:
            choice = "auto"
        elif isinstance(choice, NamedToolChoice):
            named = choice.function.name
            if named not in names:
                raise APIError(f"tool_choice names the function {named!r}, which is not among the tools",
                               param="tool_choice")
            choice = "named"
        if choice == "none":
            return None
        if parser is None:
            raise APIError("tool calling needs a tool-call parser (--tool-call-parser)", param="tools")
        return cls(parser, functions, choice, named)

    # ---- the prompt ------------------------------------------------------------------------------

    def template_kwargs(self, template_source: str) -> dict[str, Any]:
        """The tools for a chat template that renders them."""
        return {"tools": [{"type": "function", "function": f} for f in self.functions]} if "tools" in template_source else {}

    def announce(self, messages: list[dict[str, Any]], template_source: str) -> list[dict[str, Any]]:
        """For a template that does not render tools, the parser's tools prompt goes first in
        the system message."""
        if "tools" in template_source:
            return messages
        prompt = self.parser.tools_prompt([{"type": "function", "function": f} for f in self.functions])
        if messages and messages[0]["role"] == "system":
            return [{**messages[0], "content": f"{prompt}\n\n{messages[0]['content']}".rstrip()}, *messages[1:]]
        return [{"role": "system", "content": prompt}, *messages]

    # ---- constraining the output ---------------------------------------------------------------

    def json_schema(self) -> dict[str, Any] | None:
        def parameters(function: dict[str, Any]) -> dict[str, Any]:
            return function.get("parameters") or ANY_OBJECT

        if self.choice == "named":
            return parameters(next(f for f in self.functions if f["name"] == self.named))
        if self.choice == "required":
            calls = [{"type": "object", "properties": {"name": {"const": f["name"]}, "arguments": parameters(f)},
                      "required": ["name", "arguments"], "additionalProperties": False} for f in self.functions]
            return {"type": "array", "minItems": 1, "items": calls[0] if len(calls) == 1 else {"anyOf": calls}}
        return None

    # ---- reading the output ----------------------------------------------------------------------

    def stream(self) -> ToolCallStream:
        return self.parser.stream(fixed_name=self.named, whole_output=self.choice != "auto")

    def message(self, text: str) -> tuple[dict[str, Any], bool]:
        """The assistant message for a whole output, and whether it holds calls."""
        stream = self.stream()
        content, _ = stream.feed(text)
        content = (content + stream.finish()).strip()
        calls = [self._call_object(i, call) for i, call in enumerate(stream.calls)]
        message: dict[str, Any] = {"role": "assistant", "content": content or None}
        if calls:
            message["tool_calls"] = calls
        return message, bool(calls)

    def _call_id(self, index: int) -> str:
        while len(self.ids) <= index:
            self.ids.append(f"call_{uuid.uuid4().hex[:24]}")
        return self.ids[index]

    def _call_object(self, index: int, call: ToolCall) -> dict[str, Any]:
        return {"id": self._call_id(index), "type": "function",
                "function": {"name": call.name, "arguments": call.arguments}}

    def delta_objects(self, deltas: list[ToolCallDelta]) -> list[dict[str, Any]]:
        """OpenAI's streamed form: id, type and name in a call's first delta, then argument pieces."""
        objects = []
        for delta in deltas:
            if delta.name is not None:
                objects.append({"index": delta.index, "id": self._call_id(delta.index), "type": "function",
                                "function": {"name": delta.name, "arguments": delta.arguments}})
            else:
                objects.append({"index": delta.index, "function": {"arguments": delta.arguments}})
        return objects


def history_message(message: dict[str, Any], parser: ToolCallParser | None, template_source: str) -> dict[str, Any]:
    """An assistant message with tool_calls from earlier in the conversation, as the template
    needs it: structured (arguments as objects) for a template that renders tool_calls, else
    written into the content in the parser's format."""
    calls = message.get("tool_calls")
    if not calls:
        return message
    parsed = []
    for call in calls:
        arguments = call["function"].get("arguments") or "{}"
        try:
            value = json.loads(arguments) if isinstance(arguments, str) else arguments
        except json.JSONDecodeError:
            raise APIError(f"the arguments of tool call {call.get('id')!r} are not valid JSON", param="messages") from None
        parsed.append((call, value))
    if "tool_calls" in template_source:
        return {**message, "tool_calls": [{**call, "function": {**call["function"], "arguments": value}}
                                          for call, value in parsed]}
    if parser is None:
        raise APIError("tool calls in the conversation need a tool-call parser (--tool-call-parser)", param="messages")
    text = parser.format_calls([ToolCall(call["function"].get("name", ""), json.dumps(value)) for call, value in parsed])
    return {**{k: v for k, v in message.items() if k != "tool_calls"},
            "content": f"{message.get('content') or ''}{text}"}
