"""Formats that put calls in a section of special tokens, each call a head (naming the
function) and JSON arguments between tokens: DeepSeek V3 and Kimi K2.

    <section begin><call begin>HEAD<arguments begin>{...}<call end>...<section end>

A call is named once its head is complete and its arguments stream as they are written. A call
whose head never completes (no arguments token before the call's end) is dropped, as is any
other text inside the section; arguments are the text the model wrote, JSON or not. A call token
without a section around it begins a block of that one call.
"""

from __future__ import annotations

import json
import re

from srv.sdk.tools import BlockReader, BlockReading, BlockToolCallParser, ToolCall, text_until

# Between the arguments and the call's end DeepSeek writes a code fence's closing backticks.
_AFTER_ARGUMENTS = " \t\r\n`"


class SectionCallsParser(BlockToolCallParser):
    section_begin: str
    section_end: str
    call_begin: str
    arguments_begin: str
    call_end: str
    arguments_close = ""        # written after the arguments, before the call's end token
    call_separator = ""         # written between calls

    def block_reader(self) -> BlockReader:
        return _SectionReader(self)

    def name_of(self, head: str) -> str:
        """The function's name in the text between the call's begin and arguments tokens."""
        return head.strip()

    def head_of(self, index: int, call: ToolCall) -> str:
        """The head to write for call `index` of a message."""
        return call.name

    def format_calls(self, calls: list[ToolCall]) -> str:
        written = [f"{self.call_begin}{self.head_of(i, call)}{self.arguments_begin}"
                   f"{json.dumps(json.loads(call.arguments or '{}'), ensure_ascii=False)}{self.arguments_close}"
                   f"{self.call_end}"
                   for i, call in enumerate(calls)]
        return f"{self.section_begin}{self.call_separator.join(written)}{self.section_end}"


class _SectionReader(BlockReader):
    def __init__(self, parser: SectionCallsParser) -> None:
        self.parser = parser
        self._done: list[ToolCall] = []    # calls whose end token was read
        self._position: int | None = None  # where the text after them starts

    def read(self, text: str, final: bool = False) -> BlockReading:
        p = self.parser
        single = not text.startswith(p.section_begin)
        position = self._position if self._position is not None else (0 if single else len(p.section_begin))
        while True:
            if single and self._done:
                return BlockReading(list(self._done), end=position)
            begin = text_until(text, position, p.call_begin, p.section_end)
            if begin.end is None:
                return BlockReading(list(self._done))
            if begin.marker == p.section_end:
                return BlockReading(list(self._done), end=begin.end)
            head = text_until(text, begin.end, p.arguments_begin, p.call_end)
            if head.end is None:
                return BlockReading(list(self._done))
            if head.marker == p.call_end:      # no arguments: not a call
                if single:
                    return BlockReading([], end=head.end)
                position = self._position = head.end
                continue
            arguments = text_until(text, head.end, p.call_end)
            call = ToolCall(p.name_of(head.text), arguments.text.lstrip().rstrip(_AFTER_ARGUMENTS))
            if arguments.end is None:
                return BlockReading([*self._done, call])
            self._done.append(call)
            position = self._position = arguments.end


class DeepSeekV3Parser(SectionCallsParser):
    """DeepSeek V3's calls: `<｜tool▁calls▁begin｜><｜tool▁call▁begin｜>function<｜tool▁sep｜>NAME
    \\n```json\\n{...}\\n```<｜tool▁call▁end｜>...<｜tool▁calls▁end｜>` (full-width bars, and "▁"
    for spaces, as its tokenizer spells the special tokens)."""

    section_begin = "<｜tool▁calls▁begin｜>"
    section_end = "<｜tool▁calls▁end｜>"
    call_begin = "<｜tool▁call▁begin｜>"
    arguments_begin = "\n```json\n"
    call_end = "<｜tool▁call▁end｜>"
    start_markers = (section_begin, call_begin)
    arguments_close = "\n```"
    call_separator = "\n"
    separator = "<｜tool▁sep｜>"

    def name_of(self, head: str) -> str:
        # The head is the call's type ("function"), the separator token, then the name.
        return head.rpartition(self.separator)[2].strip()

    def head_of(self, index: int, call: ToolCall) -> str:
        return f"function{self.separator}{call.name}"


class KimiK2Parser(SectionCallsParser):
    """Kimi K2's calls: `<|tool_calls_section_begin|><|tool_call_begin|>functions.NAME:INDEX
    <|tool_call_argument_begin|>{...}<|tool_call_end|>...<|tool_calls_section_end|>`; the head
    is a call id whose middle is the function's name."""

    section_begin = "<|tool_calls_section_begin|>"
    section_end = "<|tool_calls_section_end|>"
    call_begin = "<|tool_call_begin|>"
    arguments_begin = "<|tool_call_argument_begin|>"
    call_end = "<|tool_call_end|>"
    start_markers = (section_begin, call_begin)

    _ID = re.compile(r"\s*(?:functions\.)?(.*?)(?::\d+)?\s*")

    def name_of(self, head: str) -> str:
        return self._ID.fullmatch(head).group(1)  # type: ignore[union-attr]

    def head_of(self, index: int, call: ToolCall) -> str:
        return f"functions.{call.name}:{index}"

