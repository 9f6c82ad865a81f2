"""What a tool-call parser plugin provides (`--tool-call-parser`).

Models announce tool calls in their output in a format their chat template taught them, most
often JSON between markers: `<tool_call>{"name": ..., "arguments": {...}}</tool_call>` (Hermes,
Qwen) or a JSON array of such objects (SmolLM2). A parser names its markers; this base class
finds the calls, in a whole output (`parse`) and in a stream (`stream`, the name of each call
once, then its arguments in pieces as they are generated). A parser also says how to announce
the tools to a model whose chat template does not render them (`tools_prompt`), and how to write
earlier calls back into a conversation (`format_calls`).
"""

from __future__ import annotations

import json
import re
from abc import ABC
from dataclasses import dataclass
from typing import Any

# A call object's name, then the start of its arguments (some models say "parameters").
_CALL_HEAD = re.compile(r'\{\s*"name"\s*:\s*"((?:[^"\\]|\\.)*)"\s*,\s*"(?:arguments|parameters)"\s*:\s*(?=[{\[])')


@dataclass
class ToolCall:
    name: str
    arguments: str   # a JSON object, as text


@dataclass
class ToolCallDelta:
    """A piece of a streamed call: `name` in the first piece of call `index`, then arguments text."""

    index: int
    name: str | None = None
    arguments: str = ""


class JsonCursor:
    """Where a character stands in JSON text: nesting depth and whether inside a string."""

    def __init__(self) -> None:
        self.depth, self.in_string, self._escaped = 0, False, False

    def step(self, char: str) -> None:
        if self.in_string:
            if self._escaped:
                self._escaped = False
            elif char == "\\":
                self._escaped = True
            elif char == '"':
                self.in_string = False
        elif char == '"':
            self.in_string = True
        elif char in "{[":
            self.depth += 1
        elif char in "}]":
            self.depth -= 1

    @property
    def outside(self) -> bool:
        return self.depth <= 0 and not self.in_string


def json_value_end(text: str, start: int) -> int | None:
    """The end offset of the JSON object or array starting at `text[start]`, None while unclosed."""
    cursor = JsonCursor()
    for i in range(start, len(text)):
        cursor.step(text[i])
        if cursor.outside:
            return i + 1
    return None


class CallScanner:
    """Reads call objects out of the growing text of one block, emitting each call's name once
    and its raw arguments text as far as it is known."""

    def __init__(self, fixed_name: str | None = None) -> None:
        # fixed_name: the whole block is the arguments of that one call (a named tool_choice).
        self.fixed_name = fixed_name
        self.calls: list[ToolCall] = []
        self._position = 0                 # where to look for the next call
        self._arguments_start: int | None = None
        self._emitted = 0                  # arguments characters of the current call sent so far

    def new_block(self) -> None:
        self._position, self._arguments_start = 0, None

    def feed(self, block: str) -> list[ToolCallDelta]:
        deltas: list[ToolCallDelta] = []
        while True:
            if self._arguments_start is None:
                if self.fixed_name is not None:
                    if self.calls or not block.strip():
                        return deltas
                    name, self._arguments_start = self.fixed_name, len(block) - len(block.lstrip())
                else:
                    head = _CALL_HEAD.search(block, self._position)
                    if head is None:
                        return deltas
                    name, self._arguments_start = json.loads(f'"{head.group(1)}"'), head.end()
                self.calls.append(ToolCall(name, ""))
                self._emitted = 0
                deltas.append(ToolCallDelta(len(self.calls) - 1, name=name))
            end = json_value_end(block, self._arguments_start)
            known = block[self._arguments_start: end if end is not None else len(block)]
            if len(known) > self._emitted:
                if deltas and deltas[-1].index == len(self.calls) - 1 and not deltas[-1].arguments:
                    deltas[-1].arguments = known[self._emitted:]
                else:
                    deltas.append(ToolCallDelta(len(self.calls) - 1, arguments=known[self._emitted:]))
                self._emitted = len(known)
            self.calls[-1].arguments = known
            if end is None:
                return deltas
            self._position, self._arguments_start = end, None


class ToolCallStream:
    """Splits a streamed output into content (outside the markers) and tool-call deltas."""

    def __init__(self, parser: "ToolCallParser", fixed_name: str | None = None, whole_output: bool = False) -> None:
        self.parser = parser
        self.scanner = CallScanner(fixed_name)
        self._inside = whole_output        # constrained output: all of it is one block, no markers
        self._whole_output = whole_output
        self._pending = ""                 # text not yet attributed
        self._block = ""
        # Where the search for the end marker stands in the block, and the JSON around it there:
        # a marker inside a JSON string (an argument's value) does not end the block.
        self._cursor, self._scan_position = JsonCursor(), 0

    def feed(self, text: str) -> tuple[str, list[ToolCallDelta]]:
        self._pending += text
        content, deltas = "", []
        while self._pending:
            if not self._inside:
                start = self._pending.find(self.parser.start_marker)
                if start < 0:
                    # Hold back a tail that may be the beginning of a marker.
                    keep = _partial_suffix(self._pending, self.parser.start_marker)
                    content += self._pending[:len(self._pending) - keep]
                    self._pending = self._pending[len(self._pending) - keep:]
                    break
                content += self._pending[:start]
                self._pending = self._pending[start + len(self.parser.start_marker):]
                self._inside, self._block = True, ""
            self._block += self._pending
            self._pending = ""
            end = self._find_end() if self.parser.end_marker and not self._whole_output else -1
            if end < 0:
                deltas += self.scanner.feed(self._block)
                break
            self._block, self._pending = self._block[:end], self._block[end + len(self.parser.end_marker):]
            deltas += self.scanner.feed(self._block)
            self._inside = False
            self.scanner.new_block()
            self._cursor, self._scan_position = JsonCursor(), 0
        return content, deltas

    def _find_end(self) -> int:
        """The offset of the end marker in the block, outside any JSON value; -1 if not there yet."""
        block, marker = self._block, self.parser.end_marker
        i = self._scan_position
        while i < len(block):
            if self._cursor.outside and block[i] == marker[0]:
                if block.startswith(marker, i):
                    return i
                if marker.startswith(block[i:]):
                    break                  # maybe the marker's beginning: look again with more text
            self._cursor.step(block[i])
            i += 1
        self._scan_position = i
        return -1

    def finish(self) -> str:
        """Content held back at the end (a partial marker that never completed)."""
        rest, self._pending = ("" if self._inside else self._pending), ""
        return rest

    @property
    def calls(self) -> list[ToolCall]:
        return self.scanner.calls


def _partial_suffix(text: str, marker: str) -> int:
    for size in range(min(len(marker) - 1, len(text)), 0, -1):
        if marker.startswith(text[-size:]):
            return size
    return 0


class ToolCallParser(ABC):
    """One tool-call format. Subclasses set the markers and may reword the prompts."""

    start_marker: str = "<tool_call>"
    end_marker: str = "</tool_call>"
    # Whether a block holds a JSON array of calls (True) or one call object (False).
    array: bool = False

    def parse(self, text: str) -> tuple[str, list[ToolCall]]:
        """The content outside tool-call blocks, and the calls inside them."""
        stream = self.stream()
        content, _ = stream.feed(text)
        content += stream.finish()
        return content.strip(), stream.calls

    def stream(self, fixed_name: str | None = None, whole_output: bool = False) -> ToolCallStream:
        return ToolCallStream(self, fixed_name, whole_output)

    def format_calls(self, calls: list[ToolCall]) -> str:
        """Earlier calls written back as the model would have written them."""
        objects = [{"name": c.name, "arguments": json.loads(c.arguments or "{}")} for c in calls]
        if self.array:
            return f"{self.start_marker}{json.dumps(objects)}{self.end_marker}"
        return "\n".join(f"{self.start_marker}\n{json.dumps(o)}\n{self.end_marker}" for o in objects)

    def tools_prompt(self, tools: list[dict[str, Any]]) -> str:
        """System-prompt text announcing `tools` (OpenAI tool objects) and the call format."""
        functions = [tool.get("function", tool) for tool in tools]
        example = self.format_calls([ToolCall("function_name", '{"argument": "value"}')])
        return ("You can call functions. Here are the available functions, as JSON schemas:\n"
                f"<tools>{json.dumps(functions)}</tools>\n"
                "To call functions, reply with the call in exactly this format, with the arguments as a "
                f"JSON object:\n{example}")
