"""The front end of the engine: tokenize and check requests, send them to the scheduler loop,
and turn its outputs into per-request state (incrementally detokenized).

It runs on an asyncio event loop and talks to the scheduler through `send(message)`; whoever
receives the scheduler's outputs calls `dispatch` on that loop. `srv.Engine` wires it to a
scheduler thread, the HTTP server to a scheduler process over ZMQ.
"""

from __future__ import annotations

import asyncio
import itertools
import json
import uuid
from argparse import Namespace
from dataclasses import fields, replace
from typing import Any, AsyncIterator, Callable

from srv.engine.grammar import GrammarCompiler
from srv.engine.io import AbortRequest, ControlRequest, ControlResult, GenerateRequest, RequestOutput
from srv.engine.request_state import RequestState
from srv.engine.tokenizer import TokenizerPool
from srv.sdk.grammar import GRAMMAR_KINDS
from srv.sdk.sampling import SamplingParams

SAMPLING_FIELDS = {f.name for f in fields(SamplingParams)}


class QueueFull(Exception):
    """--max-queued-requests requests are already waiting to start."""


class EngineDead(Exception):
    """The scheduler stopped; no request can be served."""


def make_sampling_params(raw: dict[str, Any] | None) -> SamplingParams:
    raw = dict(raw or {})
    unknown = set(raw) - SAMPLING_FIELDS
    if unknown:
        raise ValueError(f"unknown sampling parameters: {', '.join(sorted(unknown))}")
    if isinstance(raw.get("stop"), str):
        raw["stop"] = [raw["stop"]]
    if isinstance(raw.get("json_schema"), dict):
        raw["json_schema"] = json.dumps(raw["json_schema"])
    if raw.get("logit_bias"):
        raw["logit_bias"] = {int(k): float(v) for k, v in raw["logit_bias"].items()}
    try:
        params = SamplingParams(**raw)
    except TypeError as exc:
        raise ValueError(str(exc)) from None
    checks = [
        (isinstance(params.max_new_tokens, int) and params.max_new_tokens >= 0, "max_new_tokens must be an integer >= 0"),
        (isinstance(params.n, int) and params.n >= 1, "n must be an integer >= 1"),
        (isinstance(params.temperature, (int, float)) and params.temperature >= 0, "temperature must be >= 0"),
        (isinstance(params.top_p, (int, float)) and 0 < params.top_p <= 1, "top_p must be in (0, 1]"),
        (isinstance(params.top_k, int) and (params.top_k == -1 or params.top_k >= 1), "top_k must be -1 or >= 1"),
        (isinstance(params.min_p, (int, float)) and 0 <= params.min_p <= 1, "min_p must be in [0, 1]"),
        (isinstance(params.repetition_penalty, (int, float)) and params.repetition_penalty > 0,
         "repetition_penalty must be > 0"),
        (isinstance(params.top_logprobs, int) and 0 <= params.top_logprobs <= 20, "top_logprobs must be in [0, 20]"),
        (all(isinstance(s, str) and s for s in params.stop), "stop must be a string or a list of non-empty strings"),
        (all(isinstance(t, int) for t in params.stop_token_ids), "stop_token_ids must be integers"),
        (all(isinstance(getattr(params, k), (str, type(None))) for k in GRAMMAR_KINDS),
         "json_schema, regex and ebnf must be strings"),
        (sum(getattr(params, k) is not None for k in GRAMMAR_KINDS) <= 1,
         "give at most one of json_schema, regex and ebnf"),
    ]
    for ok, message in checks:
        if not ok:
            raise ValueError(message)
    return params


class Frontend:
    def __init__(self, send: Callable[[Any], None], tokenizer: Any | None, server_args: Namespace,
                 context_len: int, model_dir: str, grammars: GrammarCompiler | None = None) -> None:
        self.send, self.tokenizer, self.args, self.context_len = send, tokenizer, server_args, context_len
        # Compiles each request's grammar before it is queued, so an invalid one is the caller's error.
        self.grammars = grammars
        self._tokenizer_pool = (TokenizerPool(server_args, model_dir, server_args.tokenizer_worker_num)
                                if tokenizer is not None and server_args.tokenizer_worker_num > 1 else None)
        self._queues: dict[str, asyncio.Queue] = {}
        self._calls: dict[int, asyncio.Future] = {}
        self._call_ids = itertools.count()
        self._not_started: set[str] = set()
        self.dead: str | None = None
        # Called with (state, output) after every update: the server's metrics, logs and traces.
        self.observers: list[Callable[[RequestState, RequestOutput], None]] = []

    # ---- from the scheduler -------------------------------------------------------------------

    def dispatch(self, out: RequestOutput | ControlResult) -> None:
        if isinstance(out, ControlResult):
            future = self._calls.pop(out.call_id, None)
            if future is not None and not future.done():
                future.set_result(out.value)
            return
        self._not_started.discard(out.rid)
        queue = self._queues.get(out.rid)
        if queue is not None:
            queue.put_nowait(out)

    def fail_all(self, reason: str) -> None:
        """The scheduler is gone: every waiting caller gets an error instead of hanging."""
        self.dead = reason
        for rid, queue in self._queues.items():
            queue.put_nowait(RequestOutput(rid, error=reason))
        for future in self._calls.values():
            if not future.done():
                future.set_exception(EngineDead(reason))
        self._calls.clear()

    # ---- requests -------------------------------------------------------------------------------

    async def tokenize(self, prompt: str | None, input_ids: list[int] | None) -> list[int]:
        if input_ids is None:
            if prompt is None:
                raise ValueError("give a prompt or input_ids")
            if self.tokenizer is None:
                raise ValueError("the tokenizer is skipped (--skip-tokenizer-init): send input_ids")
            if not isinstance(prompt, str):
                raise ValueError("the prompt must be a string")
            input_ids = (await self._tokenizer_pool.encode(prompt) if self._tokenizer_pool is not None
                         else self.tokenizer.encode(prompt))
        if not isinstance(input_ids, list) or not all(isinstance(t, int) and t >= 0 for t in input_ids):
            raise ValueError("input_ids must be a list of non-negative integers")
        if not input_ids:
            raise ValueError("the prompt is empty")
        if len(input_ids) >= self.context_len:
            if not self.args.allow_auto_truncate:
                raise ValueError(f"the prompt has {len(input_ids)} tokens, more than the context of "
                                 f"{self.context_len} tokens allows (--allow-auto-truncate cuts it)")
            input_ids = input_ids[-(self.context_len - 1):]
        return input_ids

    async def check_grammar(self, params: SamplingParams) -> None:
        spec = params.grammar
        if spec is None:
            return
        if self.grammars is None:
            raise ValueError("constrained decoding needs the tokenizer (--skip-tokenizer-init is set)")
        await asyncio.to_thread(self.grammars.check, spec)

    def _check_can_submit(self, priority: int | None) -> None:
        if self.dead is not None:
            raise EngineDead(self.dead)
        if priority is not None and not self.args.enable_priority_scheduling:
            raise ValueError("a request priority needs --enable-priority-scheduling")
        limit = self.args.max_queued_requests
        if limit is not None and len(self._not_started) >= limit:
            raise QueueFull(f"{len(self._not_started)} requests are queued (--max-queued-requests {limit})")

    def _submit(self, input_ids: list[int], params: SamplingParams, priority: int | None,
                rid: str | None = None, labels: dict[str, str] | None = None) -> RequestState:
        self._check_can_submit(priority)
        if rid is not None and rid in self._queues:
            raise ValueError(f"a request with rid {rid!r} is already running")
        state = RequestState(rid or uuid.uuid4().hex, input_ids, params, self.tokenizer, labels)
        self._queues[state.rid] = asyncio.Queue()
        self._not_started.add(state.rid)
        self.send(GenerateRequest(state.rid, input_ids, params, priority or 0))
        return state

    async def _follow(self, state: RequestState, interval: int = 1) -> AsyncIterator[RequestState]:
        """Yield `state` as outputs arrive (every `interval` tokens, and at the end); abort the
        request if the caller stops listening first."""
        queue = self._queues[state.rid]
        pending = 0
        try:
            while not state.finished:
                out = await queue.get()
                state.update(out)
                for observer in self.observers:
                    observer(state, out)
                pending += len(out.new_ids)
                if state.finished or pending >= interval:
                    pending = 0
                    yield state
        finally:
            self._queues.pop(state.rid, None)
            self._not_started.discard(state.rid)
            if not state.finished and self.dead is None:
                self.send(AbortRequest(state.rid))

    async def stream(self, prompt: str | None, input_ids: list[int] | None, raw_params: dict | None,
                     priority: int | None = None, interval: int = 1, rid: str | None = None,
                     labels: dict[str, str] | None = None) -> AsyncIterator[RequestState]:
        """One request (n = 1), its state after each update. Checks run before the first yield."""
        params = make_sampling_params(raw_params)
        if params.n != 1:
            raise ValueError("streaming takes n = 1")
        await self.check_grammar(params)
        state = self._submit(await self.tokenize(prompt, input_ids), params, priority, rid, labels)
        return self._follow(state, interval)

    async def generate(self, prompts: list[str | None], input_ids: list[list[int] | None],
                       raw_params: list[dict | None], priority: int | None = None,
                       labels: dict[str, str] | None = None) -> list[list[RequestState]]:
        """Every prompt, n copies each, run to the end. The prompt of an n > 1 request is
        prefilled once first, so its copies find it in the prefix cache."""
        prepared = [(await self.tokenize(p, i), make_sampling_params(r)) for p, i, r in zip(prompts, input_ids, raw_params)]
        for _, params in prepared:
            await self.check_grammar(params)
        warmups = [self._submit(ids, replace(params, max_new_tokens=0, n=1), priority, labels=labels)
                   for ids, params in prepared if params.n > 1]
        for warmup in warmups:
            await self._finish(warmup)
        groups = [[self._submit(ids, replace(params, n=1), priority, labels=labels) for _ in range(params.n)]
                  for ids, params in prepared]
        return [list(await asyncio.gather(*(self._finish(s) for s in group))) for group in groups]

    async def _finish(self, state: RequestState) -> RequestState:
        async for _ in self._follow(state):
            pass
        return state

    def abort(self, rid: str) -> None:
        self.send(AbortRequest(rid))

    def close(self) -> None:
        if self._tokenizer_pool is not None:
            self._tokenizer_pool.close()

    async def control(self, method: str) -> Any:
        if self.dead is not None:
            raise EngineDead(self.dead)
        call_id = next(self._call_ids)
        future = asyncio.get_running_loop().create_future()
        self._calls[call_id] = future
        self.send(ControlRequest(call_id, method))
        return await future
