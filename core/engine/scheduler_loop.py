"""Runs a Scheduler against incoming messages and turns its steps into `RequestOutput`s.

Transport-free: `srv.Engine` drives it from a thread, the server's scheduler process from ZMQ.
"""

from __future__ import annotations

import os
from typing import Any

from srv.engine.io import AbortRequest, ControlRequest, ControlResult, GenerateRequest, RequestOutput
from srv.engine.request import Req
from srv.engine.scheduler import Scheduler

Message = GenerateRequest | AbortRequest | ControlRequest


class SchedulerLoop:
    def __init__(self, scheduler: Scheduler) -> None:
        self.scheduler = scheduler
        self._sent: dict[str, int] = {}   # output tokens already reported, per request

    @property
    def has_work(self) -> bool:
        return self.scheduler.has_work

    def handle(self, message: Message) -> list[RequestOutput | ControlResult]:
        if isinstance(message, GenerateRequest):
            req = Req(message.rid, message.input_ids, message.params, priority=message.priority)
            try:
                self.scheduler.add(req)
            except ValueError as exc:
                return [RequestOutput(message.rid, prompt_tokens=req.prompt_len, error=str(exc))]
            self._sent[req.rid] = 0
            return []
        if isinstance(message, AbortRequest):
            req = self.scheduler.abort(message.rid)
            return [self._output(req)] if req is not None else []
        method = getattr(self, f"control_{message.method}", None)
        if method is None:
            raise ValueError(f"unknown control method {message.method!r}")
        return [ControlResult(message.call_id, method())]

    def step(self) -> list[RequestOutput]:
        return [self._output(req) for req in self.scheduler.step()]

    def _output(self, req: Req) -> RequestOutput:
        sent = self._sent.get(req.rid, 0)
        out = RequestOutput(
            req.rid, req.output_ids[sent:], req.prompt_len, req.cached_tokens,
            req.finish_reason.value if req.finish_reason else None, req.matched_stop,
            req.logprobs[sent:], req.top_logprobs[sent:])
        if req.finished:
            self._sent.pop(req.rid, None)
        else:
            self._sent[req.rid] = len(req.output_ids)
        return out

    # ---- control methods --------------------------------------------------------------------

    def control_flush_cache(self) -> bool:
        return self.scheduler.flush_cache()

    def control_status(self) -> dict[str, Any]:
        scheduler = self.scheduler
        return {
            "pid": os.getpid(),
            "running_requests": len(scheduler.running),
            "waiting_requests": len(scheduler.waiting),
            "kv_tokens_in_use": scheduler.kv_tokens_in_use(),
            "kv_capacity_tokens": scheduler.allocator.capacity_tokens,
            "prefix_cached_tokens": scheduler.tree.cached_tokens if scheduler.tree is not None else 0,
            **vars(scheduler.stats),
        }
