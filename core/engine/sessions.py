"""SGLang's sessions (`/open_session`, `session_params` on `/generate`, `/close_session`): a
conversation whose turns continue one another's tokens, each turn's prompt being an earlier
turn's whole context (prompt and output) followed by the new input.

The front end keeps each session's turns as a tree (a turn may branch from any earlier one, by
rid); the scheduler keeps the KV of the session's latest turn locked in the prefix cache, so the
next turn computes only its new tokens however busy the cache is, until the session closes.
"""

from __future__ import annotations

import uuid
from dataclasses import dataclass, field

from srv.engine.errors import InvalidRequest


@dataclass
class Turn:
    prompt: list[int]
    context: list[int]            # prompt and output
    parent: str | None


@dataclass
class Session:
    capacity: int                 # the longest context a turn may have, in tokens
    turns: dict[str, Turn] = field(default_factory=dict)
    last: str | None = None       # the latest turn, which a turn without a parent rid continues


@dataclass(frozen=True)
class SessionParams:
    """`session_params` of a request: the session, the turn it continues (default: the latest),
    where in that turn's context to cut it (offset), whether to leave out that turn's output,
    and whether the new turn replaces the other branches from the same parent."""

    id: str
    rid: str | None = None
    offset: int | None = None
    replace: bool = False
    drop_previous_output: bool = False


class Sessions:
    def __init__(self) -> None:
        self._sessions: dict[str, Session] = {}

    def open(self, capacity: int, session_id: str | None = None) -> str:
        session_id = session_id or uuid.uuid4().hex
        if session_id in self._sessions:
            raise InvalidRequest(f"session {session_id!r} is already open", "session_id")
        self._sessions[session_id] = Session(capacity)
        return session_id

    def close(self, session_id: str) -> None:
        if self._sessions.pop(session_id, None) is None:
            raise InvalidRequest(f"no open session {session_id!r}", "session_id")

    def _session(self, session_id: str) -> Session:
        session = self._sessions.get(session_id)
        if session is None:
            raise InvalidRequest(f"no open session {session_id!r} (/open_session first)", "session_params")
        return session

    def prompt(self, params: SessionParams, new_ids: list[int]) -> list[int]:
        """The prompt of a new turn: the continued turn's context (cut as asked), then `new_ids`."""
        session = self._session(params.id)
        parent = params.rid or session.last
        base: list[int] = []
        if parent is not None:
            turn = session.turns.get(parent)
            if turn is None:
                raise InvalidRequest(f"session {params.id!r} has no finished request {parent!r}", "session_params")
            base = turn.prompt if params.drop_previous_output else turn.context
            if params.offset is not None:
                base = base[:params.offset]
        ids = base + new_ids
        if len(ids) > session.capacity:
            raise InvalidRequest(f"the session's context would be {len(ids)} tokens, more than its capacity of "
                                 f"{session.capacity} (capacity_of_str_len)", "session_params")
        return ids

    def record(self, params: SessionParams, rid: str, prompt: list[int], output: list[int]) -> None:
        """A finished turn (its session may have closed meanwhile)."""
        session = self._sessions.get(params.id)
        if session is None:
            return
        parent = params.rid or session.last
        if params.replace:
            self._drop_children(session, parent)
        session.turns[rid] = Turn(prompt, prompt + output, parent)
        session.last = rid

    @staticmethod
    def _drop_children(session: Session, parent: str | None) -> None:
        stack = [rid for rid, turn in session.turns.items() if turn.parent == parent]
        while stack:
            rid = stack.pop()
            session.turns.pop(rid, None)
            stack += [child for child, turn in session.turns.items() if turn.parent == rid]
