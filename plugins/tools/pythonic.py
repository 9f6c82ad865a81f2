"""Calls written as a Python list of function calls: `[get_weather(city="Paris"), search()]`
(Llama 4, and models fine-tuned on that form), optionally between `<|python_start|>` and
`<|python_end|>`.

Only the complete list says whether it is a list of calls, so each call is sent, name and
arguments at once, when the list's closing bracket arrives; until then the text is held back.
The list is read with `ast` and never run: each item must be a call of a (dotted) name with
keyword arguments whose values are literals (strings, numbers, booleans, None, and lists,
tuples and dicts of them), rendered as JSON. A list that is not that (positional arguments,
expressions, a syntax error) is content, as written, like text the list never closes.
"""

from __future__ import annotations

import ast
import json
import re
from typing import Any

from srv.plugins.tools.values import object_text
from srv.sdk.tools import BlockReader, BlockReading, BlockToolCallParser, ToolCall, partial_suffix

PYTHON_START, PYTHON_END = "<|python_start|>", "<|python_end|>"
# A list that starts with a call: an opening bracket, a name, an opening parenthesis.
_LIST_START = re.compile(r"\[\s*[A-Za-z_][\w.]*\s*\(")
# The end of the text that may still become such a start.
_OPEN_TAIL = re.compile(r"\[\s*(?:[A-Za-z_][\w.]*\s*)?\Z")


class PythonicParser(BlockToolCallParser):
    start_markers = (PYTHON_START,)

    def find_block(self, text: str, at_output_start: bool) -> tuple[int, bool] | None:
        starts = [at for at in (text.find(PYTHON_START),) if at >= 0]
        if (match := _LIST_START.search(text)) is not None:
            starts.append(match.start())
        if starts:
            return min(starts), True
        tails = [len(text) - held for held in (partial_suffix(text, PYTHON_START),) if held]
        if (tail := _OPEN_TAIL.search(text)) is not None:
            tails.append(tail.start())
        return (min(tails), False) if tails else None

    def block_reader(self) -> BlockReader:
        return _CallListReader()

    def format_calls(self, calls: list[ToolCall]) -> str:
        written = []
        for call in calls:
            arguments = ", ".join(f"{key}={value!r}" for key, value in json.loads(call.arguments or "{}").items())
            written.append(f"{call.name}({arguments})")
        return f"[{', '.join(written)}]"

    def tools_prompt(self, tools: list[dict[str, Any]]) -> str:
        functions = [tool.get("function", tool) for tool in tools]
        example = self.format_calls([ToolCall("func_name1", '{"param1": "value1", "param2": 2}'),
                                     ToolCall("func_name2", '{"param": true}')])
        return ("You can call the functions below, described by JSON schemas. To call them, answer with "
                "only a Python list of calls, each with keyword arguments, like this:\n"
                f"{example}\n\nThe functions:\n{json.dumps(functions)}")


class _CallListReader(BlockReader):
    def __init__(self) -> None:
        self._scanner: _Brackets | None = None

    def read(self, text: str, final: bool = False) -> BlockReading:
        start = len(PYTHON_START) if text.startswith(PYTHON_START) else 0
        while start < len(text) and text[start].isspace():
            start += 1
        if start == len(text):
            return BlockReading(content=_without_tokens(text) if final else "")
        if text[start] != "[":
            return BlockReading(end=start)     # a lone <|python_start|>: dropped, the rest is content
        if self._scanner is None:
            self._scanner = _Brackets(start)
        close = self._scanner.advance(text)
        if close is None:
            return BlockReading(content=_without_tokens(text) if final else "")
        calls = _calls_of(text[start:close])
        content = "" if calls is not None else _without_tokens(text[:close])
        after = len(text) - len(text[close:].lstrip())   # the first character after the list
        tail = text[after:]
        if tail.startswith(PYTHON_END):
            return BlockReading(calls or [], content, end=after + len(PYTHON_END))
        if tail and not PYTHON_END.startswith(tail):
            return BlockReading(calls or [], content, end=close)   # what follows is content
        # Only whitespace after the list, or maybe the beginning of <|python_end|>: wait.
        return BlockReading(calls or [], content + (text[close:] if final else ""))


def _without_tokens(text: str) -> str:
    return text.replace(PYTHON_START, "").replace(PYTHON_END, "")


class _Brackets:
    """Finds the bracket that closes the one at `start`, outside Python strings, reading each
    character once across calls."""

    def __init__(self, start: int) -> None:
        self.position, self.depth, self.quote, self.escaped = start, 0, "", False
        self.close: int | None = None

    def advance(self, text: str) -> int | None:
        """The offset just past the closing bracket, None while it is not written."""
        if self.close is not None:
            return self.close
        i = self.position
        while i < len(text):
            char = text[i]
            if self.quote:
                if self.escaped:
                    self.escaped = False
                elif char == "\\":
                    self.escaped = True
                elif text.startswith(self.quote, i):
                    i += len(self.quote) - 1
                    self.quote = ""
                elif len(self.quote) == 3 and self.quote.startswith(text[i:]):
                    break                        # maybe the end of a triple-quoted string: wait
            elif char in "'\"":
                if text.startswith(char * 3, i):
                    self.quote, i = char * 3, i + 2
                elif (char * 3).startswith(text[i:]):
                    break                        # a string or a triple-quoted one: wait
                else:
                    self.quote = char
            elif char in "([{":
                self.depth += 1
            elif char in ")]}":
                self.depth -= 1
                if self.depth == 0:
                    self.close = i + 1
                    return self.close
            i += 1
        self.position = i
        return None


def _calls_of(source: str) -> list[ToolCall] | None:
    """The calls of a Python list of calls, None if `source` is not one."""
    try:
        tree = ast.parse(source, mode="eval").body
    except (SyntaxError, ValueError):
        return None
    if not isinstance(tree, ast.List) or not tree.elts:
        return None
    calls = []
    for item in tree.elts:
        if not isinstance(item, ast.Call) or item.args or (name := _dotted_name(item.func)) is None:
            return None
        pairs = []
        for keyword in item.keywords:
            if keyword.arg is None:          # **kwargs
                return None
            try:
                value = _json_value(ast.literal_eval(keyword.value))
                json.dumps(value, allow_nan=False)
            except (ValueError, TypeError, SyntaxError, RecursionError):
                return None
            pairs.append((keyword.arg, value))
        calls.append(ToolCall(name, object_text(pairs, closed=True)))
    return calls


def _dotted_name(node: ast.expr) -> str | None:
    if isinstance(node, ast.Name):
        return node.id
    if isinstance(node, ast.Attribute) and (base := _dotted_name(node.value)) is not None:
        return f"{base}.{node.attr}"
    return None


def _json_value(value: Any) -> Any:
    """A literal as JSON sees it: tuples as lists; anything without a JSON form raises."""
    if isinstance(value, (list, tuple)):
        return [_json_value(item) for item in value]
    if isinstance(value, dict):
        if not all(isinstance(key, str) for key in value):
            raise TypeError("JSON object keys are strings")
        return {key: _json_value(item) for key, item in value.items()}
    if value is None or isinstance(value, (str, bool, int, float)):
        return value
    raise TypeError(f"{type(value).__name__} has no JSON form")
