"""What a tool-call parser plugin provides (`--tool-call-parser`).

Models announce tool calls in their output in a format their chat template taught them, most
often JSON between markers: `<tool_call>{"name": ..., "arguments": {...}}</tool_call>` (Hermes,
Qwen) or a JSON array of such objects (SmolLM2). A parser names its markers; this base class
finds the calls, in a whole output (`parse`) and in a stream (`stream`, the name of each call
once, then its arguments in pieces as they are generated). A parser also says how to announce
the tools to a model whose chat template does not render them (`tools_prompt`), and how to write
earlier calls back into a conversation (`format_calls`).

Formats that are not one JSON call between two markers (a section of special tokens holding
several calls, arguments as XML key/value tags, a Python list of calls, harmony messages) derive
from `BlockToolCallParser`: it finds where blocks begin, and a `BlockReader` per block reads the
block's calls and content from its growing text; `text_until` and `call_head` are the pieces
such readers share.
"""

from __future__ import annotations

import json
import re
from abc import ABC, abstractmethod
from dataclasses import dataclass, field
from typing import Any

# A call object's name, then the start of its arguments (some models say "parameters"). Some
# models (Llama 3.2, Mistral) put a "type" or "id" string before the name.
_CALL_HEAD = re.compile(r'\{\s*(?:"(?:type|id)"\s*:\s*"(?:[^"\\]|\\.)*"\s*,\s*)*'
                        r'"name"\s*:\s*"((?:[^"\\]|\\.)*)"\s*,\s*"(?:arguments|parameters)"\s*:\s*(?=[{\[])')


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
    # How the default tools prompt says the arguments are written, after its example.
    arguments_hint: str = "with the arguments as a JSON object"

    def parse(self, text: str) -> tuple[str, list[ToolCall]]:
        """The content outside tool-call blocks, and the calls inside them."""
        stream = self.stream()
        content, _ = stream.feed(text)
        content += stream.finish()
        return content.strip(), stream.calls

    def stream(self, fixed_name: str | None = None, whole_output: bool = False) -> "ToolCallStream | BlockCallStream":
        """A reader of one streamed output. `whole_output`: the output was constrained to a JSON
        array of calls (tool_choice "required") or, with `fixed_name`, to that function's
        arguments (a named tool_choice), whatever the format; the same for every parser."""
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
                f"To call functions, reply with the call in exactly this format, {self.arguments_hint}:\n{example}")


def call_head(text: str, position: int = 0) -> tuple[str, int] | None:
    """When `text` has a JSON call object (`{"name": ..., "arguments": ...}`, or "parameters")
    starting at `position`: its name and the offset where its arguments begin, once both are
    written; else None."""
    head = _CALL_HEAD.match(text, position)
    return (json.loads(f'"{head.group(1)}"'), head.end()) if head else None


def partial_suffix(text: str, *markers: str) -> int:
    """The length of the longest end of `text` that is the beginning of one of `markers` (the
    text a stream holds back until it knows whether a marker follows)."""
    return max((_partial_suffix(text, marker) for marker in markers), default=0)


@dataclass
class Span:
    """A stretch of text read up to one of several terminators (`text_until`)."""

    text: str                 # from the start up to the terminator, or as far as it is known
    end: int | None           # the offset just past the terminator; None while none is written
    marker: str | None = None  # the terminator found

    @property
    def marker_start(self) -> int | None:
        """The offset of the terminator itself (to leave it for the next reader)."""
        return None if self.end is None or self.marker is None else self.end - len(self.marker)


def text_until(text: str, start: int, *terminators: str, final: bool = False) -> Span:
    """The text from `start` to the first of `terminators`. While none is written, the text so
    far, less a tail that may be a terminator's beginning (unless `final`: the output ended), so
    that what a stream sends of it is never taken back."""
    found: tuple[int, str] | None = None
    for terminator in terminators:
        at = text.find(terminator, start)
        if at >= 0 and (found is None or at < found[0] or (at == found[0] and len(terminator) > len(found[1]))):
            found = (at, terminator)
    if found is not None:
        return Span(text[start:found[0]], found[0] + len(found[1]), found[1])
    held = 0 if final else partial_suffix(text[start:], *terminators)
    return Span(text[start:len(text) - held], None)


@dataclass
class BlockReading:
    """What a `BlockReader` makes of its block's text so far. Both `calls` and `content` only
    grow as the text grows (a call's arguments a prefix of its final arguments, the content a
    prefix of the block's final content): a stream sends what was added and never takes back."""

    calls: list[ToolCall] = field(default_factory=list)   # each named once its name is known
    content: str = ""          # the part of the block that is message content (most blocks: none)
    end: int | None = None     # the offset just past the block in its text, once that is known


class BlockReader(ABC):
    """Reads one block of a streamed output; a fresh one for each block, so it may keep its
    progress between calls (to avoid reading the same text again)."""

    @abstractmethod
    def read(self, text: str, final: bool = False) -> BlockReading:
        """The block so far: `text` is the block from its start (its opening marker included) as
        far as it is generated, longer at each call. `final`: the output ended inside the block;
        only the reading's content is used then (calls must be known from earlier readings)."""


class BlockCallStream:
    """A stream for a `BlockToolCallParser`: text outside blocks is content, sent at once except
    a tail that may begin a block; each block is read by its own reader, and the calls and
    content of its readings are sent as they grow."""

    def __init__(self, parser: "BlockToolCallParser") -> None:
        self.parser = parser
        self.calls: list[ToolCall] = []
        self._pending = ""                 # text after the last block, not yet sent as content
        self._at_start = True              # nothing but whitespace came before _pending
        self._reader: BlockReader | None = None
        self._block = ""
        self._first_call = 0               # the index in self.calls of the block's first call
        self._content_sent = 0             # characters of the block's content already sent

    def feed(self, text: str) -> tuple[str, list[ToolCallDelta]]:
        self._pending += text
        content, deltas = "", []
        while self._pending:
            if self._reader is None:
                found = self.parser.find_block(self._pending, self._at_start)
                offset = len(self._pending) if found is None else found[0]
                before, self._pending = self._pending[:offset], self._pending[offset:]
                content += before
                self._at_start = self._at_start and not before.strip()
                if found is None or not found[1]:
                    break                  # no block, or maybe one: wait for more text
                self._reader, self._block = self.parser.block_reader(), ""
                self._first_call, self._content_sent, self._at_start = len(self.calls), 0, False
            self._block += self._pending
            self._pending = ""
            reading = self._reader.read(self._block)
            content += self._send(reading, deltas)
            if reading.end is None:
                break
            if reading.end <= 0:
                raise ValueError(f"{type(self._reader).__name__} ended a block before its start")
            self._pending, self._reader = self._block[reading.end:], None
        return content, deltas

    def _send(self, reading: BlockReading, deltas: list[ToolCallDelta]) -> str:
        for i, call in enumerate(reading.calls):
            index = self._first_call + i
            if index == len(self.calls):
                self.calls.append(ToolCall(call.name, ""))
                deltas.append(ToolCallDelta(index, name=call.name))
            sent = self.calls[index].arguments
            if len(call.arguments) > len(sent):
                piece = call.arguments[len(sent):]
                if deltas and deltas[-1].index == index and not deltas[-1].arguments:
                    deltas[-1].arguments = piece      # with the name, in one delta
                else:
                    deltas.append(ToolCallDelta(index, arguments=piece))
                self.calls[index].arguments = call.arguments
        new_content = reading.content[self._content_sent:]
        self._content_sent = len(reading.content)
        return new_content

    def finish(self) -> str:
        """Content held back at the end: text that might have begun a block, or what the reader
        of a block left open says is content."""
        rest, self._pending = self._pending, ""
        if self._reader is not None:
            rest = self._reader.read(self._block, final=True).content[self._content_sent:]
            self._reader = None
        return rest


class BlockToolCallParser(ToolCallParser):
    """A format that is not one JSON call between two markers: blocks begin at any of
    `start_markers` (or where `find_block` says), and a per-format `BlockReader` reads each
    block: where it ends, the calls in it and any content in it. What streams when is the
    reader's choice: a call's name once it is known and its arguments as they arrive (JSON
    arguments written as they are, or built from key/value pieces as each one completes), or a
    whole call at the end of its block where only the complete block says whether it is a call.

    Only the auto tool_choice reads the format: constrained outputs (`stream(whole_output=True)`)
    are JSON whatever the format, read as `ToolCallParser` reads them."""

    start_markers: tuple[str, ...] = ()

    def find_block(self, text: str, at_output_start: bool) -> tuple[int, bool] | None:
        """Where the next block begins in `text`: `(offset, True)` where one begins, `(offset,
        False)` where one may begin but more text must tell (the stream holds the text from
        there), None where none does. `at_output_start`: only whitespace precedes `text`."""
        found = [(at, marker) for marker in self.start_markers if (at := text.find(marker)) >= 0]
        if found:
            return min(found)[0], True
        held = partial_suffix(text, *self.start_markers)
        return (len(text) - held, False) if held else None

    @abstractmethod
    def block_reader(self) -> BlockReader:
        """A reader for one block."""

    def stream(self, fixed_name: str | None = None, whole_output: bool = False) -> "ToolCallStream | BlockCallStream":
        if whole_output:
            return ToolCallStream(self, fixed_name, whole_output)
        return BlockCallStream(self)
