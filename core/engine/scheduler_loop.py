"""Runs a Scheduler against incoming messages and turns its steps into `RequestOutput`s.

Transport-free: `srv.Engine` drives it from a thread, the server's scheduler process from ZMQ.
A request that makes the scheduler raise ends with an error and the loop goes on; only a fault
that leaves the process unusable (--crash-on-nan's, one from inside the failure handling)
propagates, and ends the process with its crash dump.
"""

from __future__ import annotations

import collections
import logging
import os
import time
from typing import Any

from srv.engine.io import AbortRequest, ControlRequest, ControlResult, GenerateRequest, RequestOutput
from srv.engine.profiler import StepProfiler
from srv.engine.request import Req
from srv.engine.scheduler import Scheduler

Message = GenerateRequest | AbortRequest | ControlRequest

logger = logging.getLogger("srv.scheduler")
THROUGHPUT_WINDOW_S = 5.0
PAUSE_MODES = ("abort", "retract", "in_place")


class SchedulerLoop:
    def __init__(self, scheduler: Scheduler) -> None:
        self.scheduler = scheduler
        self._sent: dict[str, int] = {}   # output tokens already reported, per request
        self._generated: collections.deque[tuple[float, int]] = collections.deque()
        self._logged_decode_steps = 0
        self.paused = False              # /pause_generation: no steps until /continue_generation
        self.profiler = StepProfiler()
        self._control_outputs: list[RequestOutput] = []   # what a control call ended (aborted requests)

    @property
    def has_work(self) -> bool:
        return self.scheduler.has_work and not self.paused

    def handle(self, message: Message) -> list[RequestOutput | ControlResult]:
        if isinstance(message, GenerateRequest):
            req = Req(message.rid, message.input_ids, message.params, priority=message.priority)
            try:
                self.scheduler.add(req)
            except Exception as exc:
                if not isinstance(exc, ValueError):
                    logger.exception("request %s could not be queued", req.rid)
                return [RequestOutput(message.rid, prompt_tokens=req.prompt_len, error=str(exc))]
            self._sent[req.rid] = 0
            return []
        if isinstance(message, AbortRequest):
            req = self.scheduler.abort(message.rid)
            return [self._output(req)] if req is not None else []
        method = getattr(self, f"control_{message.method}", None)
        if method is None:
            raise ValueError(f"unknown control method {message.method!r}")
        try:
            result = ControlResult(message.call_id, method(**message.args))
        except ValueError as exc:   # the caller's mistake (a bad mode, a profile already running)
            result = ControlResult(message.call_id, None, str(exc))
        outputs, self._control_outputs = self._control_outputs, []
        return [*outputs, result]

    def step(self) -> list[RequestOutput]:
        if self.paused:
            return []
        try:
            stepped = self.scheduler.step()
        except FloatingPointError:   # --crash-on-nan asks for the process to end
            raise
        except Exception as exc:
            logger.exception("a scheduler step failed; failing the requests it held")
            self.scheduler.fail_step(f"internal error: {type(exc).__name__}: {exc}")
            stepped = []
        outputs = [self._output(req) for req in self.scheduler.take_failed() + stepped]
        self.profiler.after_step()
        now, stats = time.monotonic(), self.scheduler.stats
        self._generated.append((now, stats.generated_tokens))
        while now - self._generated[0][0] > THROUGHPUT_WINDOW_S:
            self._generated.popleft()
        interval = self.scheduler.args.decode_log_interval
        if interval > 0 and stats.decode_steps - self._logged_decode_steps >= interval:
            self._logged_decode_steps = stats.decode_steps
            status = self.control_status()
            spec = f", accept len {stats.spec_accept_length:.2f}" if stats.spec_verifies else ""
            logger.info("decode: %d running, %d queued, %.1f tok/s, KV %d/%d tokens (%.0f%%), cache hit rate %.0f%%%s",
                        status["running_requests"], status["waiting_requests"], status["gen_throughput"],
                        status["kv_tokens_in_use"], status["kv_capacity_tokens"],
                        100 * status["kv_tokens_in_use"] / max(status["kv_capacity_tokens"], 1),
                        100 * stats.cached_prompt_tokens / max(stats.prompt_tokens, 1), spec)
        return outputs

    def throughput(self) -> float:
        """Generated tokens per second over the last few seconds."""
        if len(self._generated) < 2:
            return 0.0
        (t0, n0), (t1, n1) = self._generated[0], self._generated[-1]
        return (n1 - n0) / (t1 - t0) if t1 > t0 else 0.0

    def _output(self, req: Req) -> RequestOutput:
        sent = self._sent.get(req.rid, 0)
        out = RequestOutput(
            req.rid, req.output_ids[sent:], req.prompt_len, req.cached_tokens,
            req.finish_reason.value if req.finish_reason else None, req.matched_stop,
            req.logprobs[sent:], req.top_logprobs[sent:], req.error, req.token_ids_logprobs[sent:],
            embedding=req.embedding)
        if req.params.logprob_start_len >= 0 and not req.input_logprobs_sent and req.next_prompt_logprob is None:
            out.input_logprobs, out.input_top_logprobs = req.input_logprobs, req.input_top_logprobs
            req.input_logprobs_sent = True
        if req.finished:
            self._sent.pop(req.rid, None)
        else:
            self._sent[req.rid] = len(req.output_ids)
        return out

    # ---- control methods --------------------------------------------------------------------

    def control_flush_cache(self) -> bool:
        return self.scheduler.flush_cache()

    def control_pause_generation(self, mode: str = "abort") -> bool:
        """Stop stepping. mode "abort" ends every request (as aborted), "retract" gives the
        running requests' KV back (they resume from the prefix cache), "in_place" keeps it all."""
        if mode not in PAUSE_MODES:
            raise ValueError(f"mode {mode!r} is not one of {', '.join(PAUSE_MODES)}")
        scheduler = self.scheduler
        if mode == "abort":
            for req in [*scheduler.running, *scheduler.waiting]:
                scheduler.abort(req.rid)
                self._control_outputs.append(self._output(req))
        elif mode == "retract":
            scheduler.retract_all("generation paused")
        self.paused = True
        logger.info("generation paused (%s)", mode)
        return True

    def control_continue_generation(self) -> bool:
        self.paused = False
        logger.info("generation continues")
        return True

    def control_load(self) -> dict[str, Any]:
        scheduler = self.scheduler
        return {"num_reqs": len(scheduler.running) + len(scheduler.waiting), "num_waiting_reqs": len(scheduler.waiting),
                "num_tokens": scheduler.kv_tokens_in_use()}

    def control_start_profile(self, **options: Any) -> str:
        return self.profiler.start(**options)

    def control_stop_profile(self) -> str:
        return self.profiler.stop()

    def control_status(self) -> dict[str, Any]:
        scheduler = self.scheduler
        return {
            "pid": os.getpid(),
            "running_requests": len(scheduler.running),
            "waiting_requests": len(scheduler.waiting),
            "kv_tokens_in_use": scheduler.kv_tokens_in_use(),
            "kv_capacity_tokens": scheduler.allocator.capacity_tokens,
            "prefix_cached_tokens": scheduler.tree.cached_tokens if scheduler.tree is not None else 0,
            "gen_throughput": self.throughput(),
            **vars(scheduler.stats),
            "spec_accept_length": scheduler.stats.spec_accept_length,
        }
