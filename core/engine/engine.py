"""`srv.Engine`: the offline API, like `sglang.Engine`.

    engine = srv.Engine(model_path=..., page_size=16)      # any launch flag, as a keyword
    engine.generate("The capital of France is", {"max_new_tokens": 8, "temperature": 0})

The scheduler runs in a background thread of this process; each request gets a queue of
outputs. The HTTP server runs the same scheduler in its own process.
"""

from __future__ import annotations

import asyncio
import itertools
import logging
import queue
import threading
import uuid
from argparse import Namespace
from dataclasses import fields
from typing import Any, AsyncIterator, Iterator

from srv.args.parser import build_launch_parser, check_launch_args, options_to_argv
from srv.backend_registry import BackendRegistry
from srv.engine.model_runner import ModelRunner
from srv.engine.request import Req
from srv.engine.scheduler import Scheduler
from srv.plugin_manager import load_plugins
from srv.sdk.sampling import SamplingParams

logger = logging.getLogger("srv.engine")

SAMPLING_FIELDS = {f.name for f in fields(SamplingParams)}


def make_sampling_params(raw: dict[str, Any] | None) -> SamplingParams:
    raw = dict(raw or {})
    unknown = set(raw) - SAMPLING_FIELDS
    if unknown:
        raise ValueError(f"unknown sampling parameters: {', '.join(sorted(unknown))}")
    if isinstance(raw.get("stop"), str):
        raw["stop"] = [raw["stop"]]
    if raw.get("logit_bias"):
        raw["logit_bias"] = {int(k): float(v) for k, v in raw["logit_bias"].items()}
    params = SamplingParams(**raw)
    if params.max_new_tokens < 0:
        raise ValueError("max_new_tokens must be >= 0")
    if params.temperature < 0:
        raise ValueError("temperature must be >= 0")
    if not 0 < params.top_p <= 1:
        raise ValueError("top_p must be in (0, 1]")
    return params


class Engine:
    def __init__(self, **server_args: Any) -> None:
        manager, registry = load_plugins()
        parser = build_launch_parser(manager, registry)
        args = parser.parse_args(options_to_argv(server_args, parser, "Engine arguments"))
        check_launch_args(args, parser)
        self._start(args, registry)

    @classmethod
    def from_args(cls, args: Namespace, registry: BackendRegistry) -> "Engine":
        """An engine for arguments `srv launch` has already parsed and checked."""
        engine = cls.__new__(cls)
        engine._start(args, registry)
        return engine

    def _start(self, args: Namespace, registry: BackendRegistry) -> None:
        self.server_args = args
        self.runner = ModelRunner(self.server_args, registry)
        self.tokenizer = self._load_tokenizer()
        self.scheduler = Scheduler(self.server_args, self.runner, registry)
        self.scheduler.tokenizer = self.tokenizer
        self._inbox: queue.Queue = queue.Queue()
        self._outputs: dict[str, queue.Queue] = {}
        self._stopped = threading.Event()
        self._thread = threading.Thread(target=self._loop, name="srv-scheduler", daemon=True)
        self._thread.start()

    def _load_tokenizer(self) -> Any:
        from transformers import AutoTokenizer

        path = self.server_args.tokenizer_path or str(self.runner.model_dir)
        return AutoTokenizer.from_pretrained(path, use_fast=self.server_args.tokenizer_mode != "slow")

    # ---- the scheduler thread ----------------------------------------------------------------

    def _loop(self) -> None:
        while not self._stopped.is_set():
            try:
                self._drain_inbox(block=not self.scheduler.has_work)
                for req in self.scheduler.step():
                    self._outputs[req.rid].put(req)
            except Exception as exc:  # surface the failure to every waiting caller, then stop
                logger.exception("scheduler failed")
                for out in self._outputs.values():
                    out.put(exc)
                self._stopped.set()

    def _drain_inbox(self, block: bool) -> None:
        try:
            item = self._inbox.get(timeout=0.1) if block else self._inbox.get_nowait()
        except queue.Empty:
            return
        while True:
            kind, payload = item
            if kind == "add":
                try:
                    self.scheduler.add(payload)
                except ValueError as exc:
                    self._outputs[payload.rid].put(exc)
            elif kind == "abort":
                req = self.scheduler.abort(payload)
                if req is not None:
                    self._outputs[req.rid].put(req)
            else:
                payload()
            try:
                item = self._inbox.get_nowait()
            except queue.Empty:
                return

    def call_in_scheduler(self, fn: Any) -> Any:
        """Run `fn()` on the scheduler thread between steps and return its result."""
        result: queue.Queue = queue.Queue()
        self._inbox.put(("call", lambda: result.put(fn())))
        return result.get()

    # ---- requests -------------------------------------------------------------------------------

    def _submit(self, prompt: str | None, input_ids: list[int] | None, params: dict | None) -> Req:
        if self._stopped.is_set():
            raise RuntimeError("the engine has stopped")
        if input_ids is None:
            if prompt is None:
                raise ValueError("give a prompt or input_ids")
            input_ids = self.tokenizer.encode(prompt)
        if not input_ids:
            raise ValueError("the prompt is empty")
        req = Req(uuid.uuid4().hex, list(input_ids), make_sampling_params(params))
        self._outputs[req.rid] = queue.Queue()
        self._inbox.put(("add", req))
        return req

    def _stream(self, req: Req) -> Iterator[dict[str, Any]]:
        out = self._outputs[req.rid]
        try:
            while True:
                item = out.get()
                if isinstance(item, Exception):
                    raise item
                yield self._result(item)
                if item.finished:
                    return
        finally:
            if not req.finished:
                self._inbox.put(("abort", req.rid))
            self._outputs.pop(req.rid, None)

    def _result(self, req: Req) -> dict[str, Any]:
        output_ids = list(req.output_ids)
        text = self.tokenizer.decode(output_ids, skip_special_tokens=True)
        if isinstance(req.matched_stop, str) and req.finished:
            text = text[: text.find(req.matched_stop)] if req.matched_stop in text else text
        meta: dict[str, Any] = {
            "id": req.rid,
            "prompt_tokens": req.prompt_len,
            "completion_tokens": len(output_ids),
            "cached_tokens": req.cached_tokens,
            "finish_reason": None if not req.finished else
            {"type": req.finish_reason.value, "matched": req.matched_stop},
        }
        if req.params.logprobs or req.params.top_logprobs:
            meta["output_token_logprobs"] = list(zip(req.logprobs, output_ids))
            meta["output_top_logprobs"] = list(req.top_logprobs)
        return {"text": text, "output_ids": output_ids, "meta_info": meta}

    def generate(self, prompt: str | list[str] | None = None, sampling_params: dict | list[dict] | None = None,
                 input_ids: list[int] | list[list[int]] | None = None, stream: bool = False) -> Any:
        """Generate for one prompt (a dict back) or a list of them (a list back, in order).

        With stream=True (single prompt only) returns an iterator of cumulative results.
        """
        batched = isinstance(prompt, list) or (input_ids is not None and input_ids and isinstance(input_ids[0], list))
        if not batched:
            req = self._submit(prompt, input_ids, sampling_params)
            results = self._stream(req)
            if stream:
                return results
            return list(results)[-1]
        prompts = prompt if prompt is not None else [None] * len(input_ids)
        ids = input_ids if input_ids is not None else [None] * len(prompts)
        params = sampling_params if isinstance(sampling_params, list) else itertools.repeat(sampling_params)
        reqs = [self._submit(p, i, s) for p, i, s in zip(prompts, ids, params)]
        return [list(self._stream(r))[-1] for r in reqs]

    async def async_generate(self, prompt: str | None = None, sampling_params: dict | None = None,
                             input_ids: list[int] | None = None, stream: bool = False) -> Any:
        if stream:
            return self._async_stream(prompt, sampling_params, input_ids)
        return await asyncio.to_thread(self.generate, prompt, sampling_params, input_ids)

    async def _async_stream(self, prompt, sampling_params, input_ids) -> AsyncIterator[dict[str, Any]]:
        iterator = self.generate(prompt, sampling_params, input_ids, stream=True)
        sentinel = object()
        while (item := await asyncio.to_thread(next, iterator, sentinel)) is not sentinel:
            yield item

    def flush_cache(self) -> bool:
        return self.call_in_scheduler(self.scheduler.flush_cache)

    def shutdown(self) -> None:
        self._stopped.set()
        self._thread.join(timeout=5)

    def __enter__(self) -> "Engine":
        return self

    def __exit__(self, *exc: Any) -> None:
        self.shutdown()
