"""Formats that write each argument as a key and a text value in XML-like tags inside
`<tool_call>...</tool_call>`: Qwen3-Coder and GLM-4.5.

A call is named once its name is written; its arguments stream as JSON, one key/value pair as
each value's closing tag arrives, and the closing brace when the call ends. A value is JSON when
it reads as JSON, else a string (see `values`). The end marker inside a value is part of the
value: the block ends at `</tool_call>` outside values only. A block without a call in it is
dropped. A call cut off by the end of the output keeps the pairs read so far, without the
closing brace.
"""

from __future__ import annotations

import json

from srv.plugins.tools.values import object_text, text_value, value_text
from srv.sdk.tools import BlockReader, BlockReading, BlockToolCallParser, ToolCall, text_until


class _PairsParser(BlockToolCallParser):
    start_markers = ("<tool_call>",)
    arguments_hint = "one element per argument, its value as plain text (JSON for numbers, booleans, arrays and objects)"


class Qwen3CoderParser(_PairsParser):
    """Qwen3-Coder's calls: `<tool_call>\\n<function=NAME>\\n<parameter=KEY>\\nVALUE\\n</parameter>
    \\n...</function>\\n</tool_call>`; one newline around each value is layout, not value. A value
    whose `</parameter>` is missing ends at `</function>`."""

    def block_reader(self) -> BlockReader:
        return _Qwen3CoderReader()

    def format_calls(self, calls: list[ToolCall]) -> str:
        written = []
        for call in calls:
            parameters = "".join(f"<parameter={key}>\n{value_text(value)}\n</parameter>\n"
                                 for key, value in json.loads(call.arguments or "{}").items())
            written.append(f"<tool_call>\n<function={call.name}>\n{parameters}</function>\n</tool_call>")
        return "\n".join(written)


class _Qwen3CoderReader(BlockReader):
    def read(self, text: str, final: bool = False) -> BlockReading:
        calls: list[ToolCall] = []
        position = len("<tool_call>")
        while True:
            function = text_until(text, position, "<function=", "</tool_call>")
            if function.end is None:
                return BlockReading(calls)
            if function.marker == "</tool_call>":
                return BlockReading(calls, end=function.end)
            name = text_until(text, function.end, ">")
            if name.end is None:
                return BlockReading(calls)
            call, pairs = ToolCall(name.text.strip(), "{"), []
            calls.append(call)
            position = name.end
            while True:
                tag = text_until(text, position, "<parameter=", "</function>", "</tool_call>")
                if tag.end is None:
                    return BlockReading(calls)
                if tag.marker != "<parameter=":
                    # `</tool_call>` without `</function>` ends the call too; the block's loop reads it.
                    call.arguments = object_text(pairs, closed=True)
                    position = tag.end if tag.marker == "</function>" else tag.marker_start
                    break
                key = text_until(text, tag.end, ">")
                value = text_until(text, key.end, "</parameter>", "</function>") if key.end is not None else None
                if value is None or value.end is None:
                    return BlockReading(calls)
                pairs.append((key.text.strip(), text_value(_without_layout(value.text))))
                call.arguments = object_text(pairs, closed=False)
                position = value.end if value.marker == "</parameter>" else value.marker_start


def _without_layout(value: str) -> str:
    value = value[1:] if value.startswith("\n") else value
    return value[:-1] if value.endswith("\n") else value


class Glm45Parser(_PairsParser):
    """GLM-4.5's calls: `<tool_call>NAME\\n<arg_key>KEY</arg_key>\\n<arg_value>VALUE</arg_value>
    \\n...</tool_call>`, one call per block (GLM-4.6/4.7 leave out the newlines)."""

    def block_reader(self) -> BlockReader:
        return _Glm45Reader()

    def format_calls(self, calls: list[ToolCall]) -> str:
        written = []
        for call in calls:
            pairs = "".join(f"<arg_key>{key}</arg_key>\n<arg_value>{value_text(value)}</arg_value>\n"
                            for key, value in json.loads(call.arguments or "{}").items())
            written.append(f"<tool_call>{call.name}\n{pairs}</tool_call>")
        return "\n".join(written)


class _Glm45Reader(BlockReader):
    def read(self, text: str, final: bool = False) -> BlockReading:
        start = len("<tool_call>")
        while start < len(text) and text[start].isspace():
            start += 1
        name = text_until(text, start, "\n", "<arg_key>", "</tool_call>")
        if name.end is None:
            return BlockReading()
        if not name.text.strip():
            # No name: not a call; the block still ends at its end marker.
            end = text_until(text, start, "</tool_call>")
            return BlockReading(end=end.end)
        call, pairs = ToolCall(name.text.strip(), "{"), []
        position = name.end if name.marker == "\n" else name.marker_start
        while True:
            key_tag = text_until(text, position, "<arg_key>", "</tool_call>")
            if key_tag.end is None:
                return BlockReading([call])
            if key_tag.marker == "</tool_call>":
                call.arguments = object_text(pairs, closed=True)
                return BlockReading([call], end=key_tag.end)
            key = text_until(text, key_tag.end, "</arg_key>")
            value_tag = text_until(text, key.end, "<arg_value>") if key.end is not None else None
            value = text_until(text, value_tag.end, "</arg_value>") if value_tag and value_tag.end is not None else None
            if value is None or value.end is None:
                return BlockReading([call])
            pairs.append((key.text.strip(), text_value(value.text)))
            call.arguments = object_text(pairs, closed=False)
            position = value.end

