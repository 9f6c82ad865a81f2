"""OpenAI's harmony format (gpt-oss): the output is a sequence of messages,

    <|start|>assistant<|channel|>CHANNEL [to=RECIPIENT] [<|constrain|>json]<|message|>BODY<|end|>

the first without `<|start|>assistant` (the prompt ends with it), the recipient sometimes
before the channel, a call's message ending with `<|call|>` and the last with `<|return|>`.
A message to `functions.NAME` is a call of NAME: named once its header is complete, its body
(JSON arguments) streamed as it arrives. The body of a message in the `final` channel, or in
`commentary` without a recipient (a preamble harmony means for the user), is content; other
messages (`analysis`, the chain of thought; calls to built-in tools) are not. Text outside
messages is content, so an output without harmony tokens is all content.
"""

from __future__ import annotations

import json
import re

from srv.sdk.tools import BlockReader, BlockReading, BlockToolCallParser, ToolCall, text_until

START, CHANNEL, MESSAGE = "<|start|>", "<|channel|>", "<|message|>"
ENDS = ("<|end|>", "<|call|>", "<|return|>")
_RECIPIENT = re.compile(r"to=([^\s<]+)")
_CHANNEL_NAME = re.compile(r"<\|channel\|>\s*(\w+)")
CONTENT_CHANNELS = ("final", "commentary")


class HarmonyParser(BlockToolCallParser):
    start_markers = (START, CHANNEL)

    def block_reader(self) -> BlockReader:
        return _MessageReader()

    def format_calls(self, calls: list[ToolCall]) -> str:
        return "".join(f"{START}assistant{CHANNEL}commentary to=functions.{call.name} <|constrain|>json{MESSAGE}"
                       f"{json.dumps(json.loads(call.arguments or '{}'), ensure_ascii=False)}<|call|>"
                       for call in calls)


class _MessageReader(BlockReader):
    def read(self, text: str, final: bool = False) -> BlockReading:
        header = text_until(text, 1, MESSAGE, *ENDS, START)
        if header.end is None:
            return BlockReading()
        if header.marker != MESSAGE:             # a message without a body: nothing to read
            return BlockReading(end=header.end if header.marker in ENDS else header.marker_start)
        head = text[:header.end]
        # A body ends at its end token, or (end tokens missing) where the next message starts.
        body = text_until(text, header.end, *ENDS, START, CHANNEL, final=final)
        end = None if body.end is None else (body.end if body.marker in ENDS else body.marker_start)
        recipient = _RECIPIENT.search(head)
        if recipient is not None:
            if recipient.group(1).startswith("functions."):
                call = ToolCall(recipient.group(1)[len("functions."):], body.text.strip())
                return BlockReading([call], end=end)
            return BlockReading(end=end)         # a built-in tool's call: not ours to report
        channel = _CHANNEL_NAME.search(head)
        if channel is not None and channel.group(1) in CONTENT_CHANNELS:
            return BlockReading(content=body.text, end=end)
        return BlockReading(end=end)
