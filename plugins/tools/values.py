"""Arguments written as key/value text (XML-like formats, Python calls), turned into JSON.

Formats that write each argument's value as plain text leave its type to the reader: a value
that reads as JSON (a number, true, an object...) is that JSON value, any other is a string.
Writing a call back does the reverse, quoting a string that would otherwise read as JSON.
"""

from __future__ import annotations

import json
from typing import Any


def text_value(raw: str) -> Any:
    """The JSON value of an argument written as text."""
    try:
        return json.loads(raw)
    except ValueError:
        return raw


def value_text(value: Any) -> str:
    """An argument's value written as text, so that `text_value` reads it back unchanged."""
    if isinstance(value, str) and not _reads_as_json(value):
        return value
    return json.dumps(value, ensure_ascii=False)


def _reads_as_json(raw: str) -> bool:
    try:
        json.loads(raw)
    except ValueError:
        return False
    return True


def object_text(pairs: list[tuple[str, Any]], closed: bool) -> str:
    """The arguments object of `pairs` as JSON text, without its closing brace while more pairs
    may follow: each such text begins the next, so it can be streamed as pairs complete."""
    body = ", ".join(f"{json.dumps(key, ensure_ascii=False)}: {json.dumps(value, ensure_ascii=False)}"
                     for key, value in pairs)
    return "{" + body + ("}" if closed else "")
