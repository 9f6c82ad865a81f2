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
from dataclasses import dataclass, field, replace
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
        """None when the request does not call tools (no tools, or tool_choice "none"). The
        errors a client may match on are SGLang's words."""
        if not tools:
            if choice == "required":
                raise APIError("Tools cannot be empty if tool choice is set to required.", param="tool_choice")
            if isinstance(choice, NamedToolChoice):
                raise APIError("Tools cannot be empty if tool choice is set to a specific tool.", param="tool_choice")
            return None
        functions = [tool.function.model_dump(exclude_none=True) for tool in tools]
        for i, function in enumerate(functions):
            _check_parameters(i, function.get("parameters"))
        named = None
        if choice is None:
            choice = "auto"
        elif isinstance(choice, NamedToolChoice):
            named = choice.function.name
            if named not in {function["name"] for function in functions}:
                raise APIError(f"Tool '{named}' not found in tools list.", param="tool_choice")
            choice = "named"
        if choice == "none":
            return None
        if parser is None:
            raise APIError("tool calling needs a tool-call parser (--tool-call-parser)", param="tools")
        return cls(parser, functions, choice, named)

    def for_choice(self) -> "ToolCalling":
        """A copy for one choice of the request: its own calls and call ids."""
        return replace(self, calls=[], ids=[])

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
            # Each tool's parameters move under the array's items; their local definitions
            # ($defs, definitions) move to the root with them, renamed per tool.
            definitions: dict[str, Any] = {}
            calls = [{"type": "object", "properties": {
                "name": {"const": f["name"]}, "arguments": _hoist_definitions(parameters(f), f"tool{i}_", definitions)},
                "required": ["name", "arguments"], "additionalProperties": False} for i, f in enumerate(self.functions)]
            schema = {"type": "array", "minItems": 1, "items": calls[0] if len(calls) == 1 else {"anyOf": calls}}
            if definitions:
                schema["$defs"] = definitions
            return schema
        return None

    # ---- reading the output ----------------------------------------------------------------------

    def stream(self) -> ToolCallStream:
        return self.parser.stream(fixed_name=self.named, whole_output=self.choice != "auto")

    def tool_calls(self, stream: ToolCallStream) -> list[dict[str, Any]]:
        """The tool_calls of a finished output, as OpenAI's message carries them."""
        return [self._call_object(i, call) for i, call in enumerate(stream.calls)]

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


def _check_parameters(index: int, parameters: Any) -> None:
    """A tool's parameters must be a JSON schema (SGLang checks them against draft 2020-12)."""
    if parameters is None:
        return
    from jsonschema import Draft202012Validator, SchemaError

    try:
        Draft202012Validator.check_schema(parameters)
    except SchemaError as exc:
        raise APIError(f"Tool {index} function has invalid 'parameters' schema: {exc.message}", param="tools") from None
    except RecursionError:
        raise APIError(f"Tool {index} function 'parameters' schema is too deeply nested or contains a cycle.",
                       param="tools") from None


def _hoist_definitions(schema: dict[str, Any], prefix: str, into: dict[str, Any]) -> dict[str, Any]:
    """`schema` with its local definitions moved into `into` under `prefix` and every local
    reference rewritten to match (a reference to the schema's own root included), so that it
    keeps its meaning inside a larger schema."""
    local = {**schema.get("definitions", {}), **schema.get("$defs", {})}
    body = {k: v for k, v in schema.items() if k not in ("$defs", "definitions")}

    def rewrite(node: Any) -> Any:
        if isinstance(node, dict):
            node = {k: rewrite(v) for k, v in node.items()}
            ref = node.get("$ref")
            if isinstance(ref, str):
                if ref == "#":
                    node["$ref"] = f"#/$defs/{prefix}root"
                    into.setdefault(f"{prefix}root", None)
                for kind in ("#/$defs/", "#/definitions/"):
                    if ref.startswith(kind):
                        node["$ref"] = f"#/$defs/{prefix}{ref[len(kind):]}"
            return node
        if isinstance(node, list):
            return [rewrite(item) for item in node]
        return node

    for name, definition in local.items():
        into[f"{prefix}{name}"] = rewrite(definition)
    body = rewrite(body)
    if f"{prefix}root" in into:
        into[f"{prefix}root"] = body
    return body


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
