"""Formats that write calls as JSON objects without an end marker: Llama 3.1/3.2 and Mistral.

The calls are read as they are written: a call is named once its object's name and the start
of its arguments are written, and its arguments stream as they arrive. A call's object ends its
block's last call when the next character is neither a separator nor another object; what
follows is content. An object without a name and arguments is dropped (as SGLang drops objects
it cannot take for calls); a call's arguments are the text the model wrote, JSON or not.
"""

from __future__ import annotations

import json
import re
from typing import Any

from srv.sdk.tools import (BlockReader, BlockReading, BlockToolCallParser, ToolCall, call_head, json_value_end,
                           text_until)


class _CallObjects:
    """Reads a sequence of JSON call objects from `position`, separated by `separator` (and
    whitespace); the sequence ends at `closer` (consumed) or, without one, at the first other
    character. Keeps the completed calls so that the text is read once."""

    def __init__(self, position: int, separator: str, closer: str | None) -> None:
        self.position, self.separator, self.closer = position, separator, closer
        self.done: list[ToolCall] = []

    def read(self, text: str) -> BlockReading:
        while True:
            at = self.position
            while at < len(text) and (text[at].isspace() or text[at] == self.separator):
                at += 1
            if at == len(text):
                return BlockReading(list(self.done))
            if text[at] != "{":
                end = at + 1 if text[at] == self.closer else at
                return BlockReading(list(self.done), end=end)
            head = call_head(text, at)
            object_end = json_value_end(text, at)
            if head is None:
                if object_end is None:
                    return BlockReading(list(self.done))   # maybe a call whose head is not written yet
                self.position = object_end                  # an object that is not a call
                continue
            name, arguments_start = head
            arguments_end = json_value_end(text, arguments_start)
            call = ToolCall(name, text[arguments_start:arguments_end if arguments_end is not None else len(text)])
            if object_end is None:
                return BlockReading([*self.done, call])
            self.done.append(call)
            self.position = object_end


def _arguments_json(call: ToolCall) -> str:
    return json.dumps(json.loads(call.arguments or "{}"), ensure_ascii=False)


class Llama3Parser(BlockToolCallParser):
    """Llama 3.1/3.2 custom-tool calls: `{"name": ..., "parameters": {...}}`, several separated
    by `;`, either the whole output (it starts with the object) or after `<|python_tag|>`. An
    output that starts with a JSON object that is not a call is content."""

    python_tag = "<|python_tag|>"
    start_markers = (python_tag,)

    def find_block(self, text: str, at_output_start: bool) -> tuple[int, bool] | None:
        if at_output_start:
            start = len(text) - len(text.lstrip())
            if start < len(text) and text[start] == "{":
                if call_head(text, start) is not None:
                    return start, True
                if json_value_end(text, start) is None:
                    return start, False       # a call's head may still come
        return super().find_block(text, at_output_start)

    def block_reader(self) -> BlockReader:
        return _Llama3Reader(self.python_tag)

    def format_calls(self, calls: list[ToolCall]) -> str:
        objects = [f'{{"name": {json.dumps(c.name, ensure_ascii=False)}, "parameters": {_arguments_json(c)}}}'
                   for c in calls]
        return self.python_tag + "; ".join(objects)

    def tools_prompt(self, tools: list[dict[str, Any]]) -> str:
        functions = [tool.get("function", tool) for tool in tools]
        return ("You have access to the functions below, described by JSON schemas. To call one or more of "
                'them, answer with only JSON objects of the form {"name": function name, "parameters": '
                "object of argument names and values}, separated by semicolons, and nothing else.\n\n"
                + "\n\n".join(json.dumps(function, indent=2) for function in functions))


class _Llama3Reader(BlockReader):
    def __init__(self, python_tag: str) -> None:
        self.python_tag = python_tag
        self.objects: _CallObjects | None = None

    def read(self, text: str, final: bool = False) -> BlockReading:
        if self.objects is None:
            self.objects = _CallObjects(len(self.python_tag) if text.startswith(self.python_tag) else 0, ";", None)
        return self.objects.read(text)


class MistralParser(BlockToolCallParser):
    """Mistral's calls: `[TOOL_CALLS] [{"name": ..., "arguments": {...}}, ...]`, a JSON array
    after the marker, or the newer form of one call per marker, `[TOOL_CALLS]NAME[ARGS]{...}`
    (with `[CALL_ID]ID` before `[ARGS]` in some versions). A marker followed by neither is
    dropped and the text after it is content."""

    marker = "[TOOL_CALLS]"
    start_markers = (marker,)

    def block_reader(self) -> BlockReader:
        return _MistralReader(len(self.marker))

    def format_calls(self, calls: list[ToolCall]) -> str:
        objects = [f'{{"name": {json.dumps(c.name, ensure_ascii=False)}, "arguments": {_arguments_json(c)}}}'
                   for c in calls]
        return f"{self.marker} [{', '.join(objects)}]"

    def tools_prompt(self, tools: list[dict[str, Any]]) -> str:
        functions = [tool.get("function", tool) for tool in tools]
        example = self.format_calls([ToolCall("function_name", '{"argument": "value"}')])
        return (f"[AVAILABLE_TOOLS] {json.dumps([{'type': 'function', 'function': f} for f in functions])}"
                "[/AVAILABLE_TOOLS]\nTo call tools, answer with the marker and a JSON array of calls, "
                f"like this:\n{example}")


# A call of the newer form: its name, then `[ARGS]` or `[CALL_ID]`.
_NAME = re.compile(r"\s*([\w.\-]+)")


class _MistralReader(BlockReader):
    def __init__(self, start: int) -> None:
        self.start = start
        self.objects: _CallObjects | None = None

    def read(self, text: str, final: bool = False) -> BlockReading:
        at = self.start
        while at < len(text) and text[at].isspace():
            at += 1
        if at == len(text):
            return BlockReading()
        if text[at] == "[":                       # the array form; the newer one starts with a name
            if self.objects is None:
                self.objects = _CallObjects(at + 1, ",", "]")
            return self.objects.read(text)
        return self._read_named(text)

    def _read_named(self, text: str) -> BlockReading:
        name = _NAME.match(text, self.start)
        if name is None:
            return BlockReading(end=self.start)
        rest = text[name.end():]
        if not rest or "[ARGS]".startswith(rest) or "[CALL_ID]".startswith(rest):
            return BlockReading()
        if rest.startswith("[CALL_ID]"):
            arguments_marker = text_until(text, name.end(), "[ARGS]")
            if arguments_marker.end is None:
                return BlockReading()
            arguments_start = arguments_marker.end
        elif rest.startswith("[ARGS]"):
            arguments_start = name.end() + len("[ARGS]")
        else:
            return BlockReading(end=self.start)
        while arguments_start < len(text) and text[arguments_start].isspace():
            arguments_start += 1
        if arguments_start == len(text):
            return BlockReading()
        if text[arguments_start] != "{":
            return BlockReading(end=self.start)
        end = json_value_end(text, arguments_start)
        call = ToolCall(name.group(1), text[arguments_start:end if end is not None else len(text)])
        return BlockReading([call], end=end)
