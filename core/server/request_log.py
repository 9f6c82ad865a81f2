"""What the server remembers of requests: `--log-requests` lines at `--log-requests-level`
0-3, and the last five minutes of requests, written to `--crash-dump-folder` if the scheduler
dies."""

from __future__ import annotations

import collections
import json
import logging
import time
from argparse import Namespace
from pathlib import Path
from typing import Any

from pydantic import BaseModel

from srv.engine.io import RequestOutput
from srv.engine.request_state import RequestState

logger = logging.getLogger("srv.requests")

CRASH_DUMP_WINDOW_S = 300
PARTIAL_TEXT_CHARS = 2048
TEXT_FIELDS = ("text", "prompt", "messages", "input_ids", "suffix")


class RequestLog:
    def __init__(self, args: Namespace) -> None:
        self.enabled, self.level = args.log_requests, args.log_requests_level
        self.time_stats = args.enable_request_time_stats_logging
        self.dump_folder = Path(args.crash_dump_folder) if args.crash_dump_folder else None
        self._recent: collections.deque[tuple[float, str, dict[str, Any]]] = collections.deque()

    def _shown(self, body: dict[str, Any]) -> dict[str, Any]:
        """Level 0: no text and no sampling parameters; 1: parameters; 2: text cut at 2048
        characters; 3: everything."""
        if self.level >= 3:
            return body
        shown = {}
        for key, value in body.items():
            if key in TEXT_FIELDS:
                if self.level >= 2:
                    shown[key] = _cut(value)
            elif self.level >= 1 or key in ("model", "stream", "n"):
                shown[key] = value
        return shown

    def request(self, route: str, body: BaseModel | dict[str, Any]) -> None:
        if self.dump_folder is None and not self.enabled:
            return
        if isinstance(body, BaseModel):
            body = body.model_dump(exclude_none=True)
        if self.dump_folder is not None:
            now = time.time()
            self._recent.append((now, route, body))
            while self._recent and self._recent[0][0] < now - CRASH_DUMP_WINDOW_S:
                self._recent.popleft()
        if self.enabled:
            logger.info("request %s %s", route, json.dumps(self._shown(body), default=str))

    def response(self, route: str, summary: dict[str, Any]) -> None:
        if self.enabled:
            logger.info("response %s %s", route, json.dumps(self._shown(summary), default=str))

    def observe(self, state: RequestState, out: RequestOutput) -> None:
        """--enable-request-time-stats-logging: one line of timings per finished request."""
        if not (self.time_stats and state.finished) or state.params.max_new_tokens == 0:
            return
        first, last = state.first_token_at, state.last_token_at
        tokens = len(state.output_ids)
        logger.info("request %s finished (%s): prompt %d tokens (%d cached), output %d tokens, ttft %s, e2e %.3f s%s",
                    state.rid, state.finish_reason or "error", len(state.prompt_ids), state.cached_tokens, tokens,
                    f"{first - state.created_at:.3f} s" if first else "-", (last or first or state.created_at)
                    - state.created_at, f", {1e3 * (last - first) / (tokens - 1):.1f} ms/token" if tokens > 1 else "")

    def dump(self, reason: str) -> Path | None:
        if self.dump_folder is None:
            return None
        self.dump_folder.mkdir(parents=True, exist_ok=True)
        path = self.dump_folder / f"crash_dump_{time.strftime('%Y%m%d_%H%M%S')}.json"
        requests = [{"time": t, "route": route, "body": body} for t, route, body in self._recent]
        path.write_text(json.dumps({"reason": reason, "requests": requests}, default=str, indent=1))
        logger.error("wrote the last %d requests to %s", len(requests), path)
        return path


def _cut(value: Any) -> Any:
    text = value if isinstance(value, str) else json.dumps(value, default=str)
    return text if len(text) <= PARTIAL_TEXT_CHARS else text[:PARTIAL_TEXT_CHARS] + "..."
