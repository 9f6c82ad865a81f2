"""`srv.Engine`: the offline API, like `sglang.Engine`.

    engine = srv.Engine(model_path=..., page_size=16)      # any launch flag, as a keyword
    engine.generate("The capital of France is", {"max_new_tokens": 8, "temperature": 0})

The scheduler runs in a background thread of this process; each request gets a queue of
outputs. The HTTP server runs the same scheduler in its own process.
"""

from __future__ import annotations

import asyncio
import logging
import os
import queue
import threading
import uuid
from argparse import Namespace
from dataclasses import fields, replace
from typing import Any, AsyncIterator, Iterator

import torch

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


def choose_torch_threads() -> None:
    """One torch thread per core this process may run on, unless OMP_NUM_THREADS says otherwise.

    Measured on the 2-core development machine (default model, bf16, 64 tokens per request):
    batch 16 decodes 203 tok/s with 2 threads against 150 with 1, and with the other core kept
    busy by another process 143 against 140; one stream 19 against 16 tok/s. So more threads
    never lost here. Tests that run a client beside the server set OMP_NUM_THREADS=1.
    """
    if "OMP_NUM_THREADS" not in os.environ:
        torch.set_num_threads(len(os.sched_getaffinity(0)))


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
        choose_torch_threads()
        if args.random_seed is not None:
            # Unseeded sampling draws from torch's global generator: --random-seed fixes it.
            torch.manual_seed(args.random_seed)
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

    def _tokenize(self, prompt: str | None, input_ids: list[int] | None) -> list[int]:
        if input_ids is None:
            if prompt is None:
                raise ValueError("give a prompt or input_ids")
            input_ids = self.tokenizer.encode(prompt)
        if not input_ids:
            raise ValueError("the prompt is empty")
        return list(input_ids)

    def _submit(self, input_ids: list[int], params: SamplingParams, priority: int | None = None) -> Req:
        if self._stopped.is_set():
            raise RuntimeError("the engine has stopped")
        if priority is not None and not self.server_args.enable_priority_scheduling:
            raise ValueError("a request priority needs --enable-priority-scheduling")
        req = Req(uuid.uuid4().hex, input_ids, params, priority=priority or 0)
        self._outputs[req.rid] = queue.Queue()
        self._inbox.put(("add", req))
        return req

    def _submit_all(self, prompts: list[str | None], ids: list[list[int] | None], raw_params: list[dict | None],
                    priority: int | None) -> list[list[Req]]:
        """Submit every prompt, n copies each. The prompt of an n > 1 request is prefilled once
        first, so its copies find it in the prefix cache instead of computing it n times."""
        prepared = [(self._tokenize(p, i), make_sampling_params(r)) for p, i, r in zip(prompts, ids, raw_params)]
        warmups = [self._submit(tokens, replace(params, max_new_tokens=0, n=1), priority)
                   for tokens, params in prepared if params.n > 1]
        for warmup in warmups:
            list(self._stream(warmup))
        return [[self._submit(tokens, replace(params, n=1), priority) for _ in range(params.n)]
                for tokens, params in prepared]

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
                 input_ids: list[int] | list[list[int]] | None = None, stream: bool = False,
                 priority: int | None = None) -> Any:
        """Generate for one prompt (a dict back, or a list of n with sampling param n > 1) or a
        list of prompts (a flat list back, in order, n per prompt).

        With stream=True (one prompt, n = 1) returns an iterator of cumulative results.
        """
        batched = isinstance(prompt, list) or bool(input_ids and isinstance(input_ids[0], list))
        prompts = (prompt if batched else [prompt]) if prompt is not None else None
        ids = (input_ids if batched else [input_ids]) if input_ids is not None else None
        count = len(prompts if prompts is not None else ids or [None])
        prompts, ids = prompts or [None] * count, ids or [None] * count
        raw = sampling_params if isinstance(sampling_params, list) else [sampling_params] * count
        if stream and (batched or (raw[0] or {}).get("n", 1) != 1):
            raise ValueError("streaming takes one prompt with n = 1")
        groups = self._submit_all(prompts, ids, raw, priority)
        if stream:
            return self._stream(groups[0][0])
        results = [[list(self._stream(req))[-1] for req in group] for group in groups]
        if not batched:
            return results[0][0] if len(results[0]) == 1 else results[0]
        return [result for group in results for result in group]

    async def async_generate(self, prompt: str | None = None, sampling_params: dict | None = None,
                             input_ids: list[int] | None = None, stream: bool = False,
                             priority: int | None = None) -> Any:
        if stream:
            return self._async_stream(self.generate(prompt, sampling_params, input_ids, True, priority))
        return await asyncio.to_thread(self.generate, prompt, sampling_params, input_ids, False, priority)

    @staticmethod
    async def _async_stream(iterator: Iterator[dict[str, Any]]) -> AsyncIterator[dict[str, Any]]:
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
