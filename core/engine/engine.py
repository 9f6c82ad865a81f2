"""`srv.Engine`: the offline API, like `sglang.Engine`.

    engine = srv.Engine(model_path=..., page_size=16)      # any launch flag, as a keyword
    engine.generate("The capital of France is", {"max_new_tokens": 8, "temperature": 0})

The scheduler loop runs in a background thread; the front end runs on a private event loop in
another thread. The HTTP server uses the same front end with the scheduler in its own process.

The scheduler thread also builds the model, so that it is the only thread of the engine that
runs torch's and srv's kernels. Each thread that starts OpenMP work gets a team of threads of its
own, and with more OpenMP threads than cores the GNU runtime's threads stop spinning between
parallel regions: a decode step of a hundred-odd short regions then waits on every wake-up (the
default model's decode ran 2.5 times slower with the model built in the caller's thread).
"""

from __future__ import annotations

import asyncio
import logging
import queue
import threading
from argparse import Namespace
from concurrent.futures import Future
from typing import Any, AsyncIterator, Coroutine, Iterator

from srv.args.parser import build_launch_parser, check_launch_args, options_to_argv
from srv.backend_registry import BackendRegistry
from srv.engine.build import build_scheduler
from srv.engine.frontend import Frontend
from srv.engine.request_state import RequestState
from srv.engine.scheduler_loop import SchedulerLoop
from srv.engine.warmups import FrontendWarmupClient, run_warmups, warmup_names
from srv.plugin_manager import load_plugins
from srv.sdk.warmup import Warmup

logger = logging.getLogger("srv.engine")


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
        if args.data_parallel_size > 1:
            raise ValueError("--data-parallel-size: srv.Engine runs one scheduler; `srv launch` serves data-parallel "
                             "groups behind one server")
        if args.delete_ckpt_after_loading:
            raise ValueError("--delete-ckpt-after-loading deletes the checkpoint after `srv launch`'s warm-up; "
                             "srv.Engine has none (delete it once the engine is built)")
        if args.numa_node:
            raise ValueError("--numa-node binds the processes `srv launch` starts; srv.Engine computes in the process "
                             "that calls it (bind that one, with numactl or os.sched_setaffinity)")
        self.server_args = args
        self._inbox: queue.Queue = queue.Queue()
        self._stopped = threading.Event()
        self._frontend_ready = threading.Event()
        built: Future = Future()
        self._thread = threading.Thread(target=self._run_scheduler, args=(args, registry, built),
                                        name="srv-scheduler", daemon=True)
        self._thread.start()
        self.runner, self.scheduler = built.result()   # the build's exception, raised here
        try:
            self.tokenizer = self.scheduler.tokenizer
            self._events = asyncio.new_event_loop()
            self.frontend = Frontend(self._inbox.put, self.tokenizer, args, self.scheduler.request_limits(),
                                     str(self.runner.model_dir), self.scheduler.grammars)
        except BaseException:
            self._stopped.set()   # the scheduler thread closes what it built and ends
            raise
        finally:
            self._frontend_ready.set()
        threading.Thread(target=self._events.run_forever, name="srv-frontend", daemon=True).start()
        if warmup_names(args):
            self._run(run_warmups(args, registry, self.warmup_client()))

    def warmup_client(self) -> FrontendWarmupClient:
        """The srv.sdk.warmup.WarmupClient of this engine (what `--warmups` run on)."""
        return FrontendWarmupClient(self.frontend, self.scheduler.chunk_size, self.scheduler.max_running)

    def warm_up(self, warmup: Warmup) -> None:
        """Run a warm-up (a srv.sdk.warmup.Warmup) through this engine."""
        self._run(warmup.run(self.warmup_client()))

    # ---- the scheduler thread ----------------------------------------------------------------

    def _run_scheduler(self, args: Namespace, registry: BackendRegistry, built: Future) -> None:
        try:
            runner, scheduler = build_scheduler(args, registry)
        except BaseException as exc:
            built.set_exception(exc)
            return
        built.set_result((runner, scheduler))
        self._frontend_ready.wait()
        loop = None
        try:
            if self._stopped.is_set():
                return
            loop = SchedulerLoop(scheduler)
            while not self._stopped.is_set():
                outputs = []
                try:
                    if loop.receives_now():
                        wait = loop.wait_s
                        message = self._inbox.get(timeout=wait) if wait else self._inbox.get_nowait()
                        while True:
                            outputs += loop.handle(message)
                            message = self._inbox.get_nowait()
                except queue.Empty:
                    pass
                outputs += loop.step()
                for out in outputs:
                    self._events.call_soon_threadsafe(self.frontend.dispatch, out)
        except Exception as exc:  # surface the failure to every waiting caller, then stop
            logger.exception("scheduler failed")
            self._events.call_soon_threadsafe(self.frontend.fail_all, f"scheduler failed: {exc!r}")
        finally:
            if loop is not None:
                loop.close()
            scheduler.close()

    # ---- requests -------------------------------------------------------------------------------

    def _run(self, coroutine: Coroutine) -> Any:
        return asyncio.run_coroutine_threadsafe(coroutine, self._events).result()

    @staticmethod
    def _split(prompt: Any, input_ids: Any, sampling_params: Any) -> tuple[bool, list, list, list]:
        batched = isinstance(prompt, list) or bool(input_ids and isinstance(input_ids[0], list))
        prompts = (prompt if batched else [prompt]) if prompt is not None else None
        ids = (input_ids if batched else [input_ids]) if input_ids is not None else None
        count = len(prompts if prompts is not None else ids or [None])
        raw = sampling_params if isinstance(sampling_params, list) else [sampling_params] * count
        return batched, prompts or [None] * count, ids or [None] * count, raw

    async def _generate(self, prompt: Any, sampling_params: Any, input_ids: Any, priority: int | None) -> Any:
        batched, prompts, ids, raw = self._split(prompt, input_ids, sampling_params)
        groups = await self.frontend.generate(prompts, ids, raw, priority)
        results = [[_checked(state).result() for state in group] for group in groups]
        if not batched:
            return results[0][0] if len(results[0]) == 1 else results[0]
        return [result for group in results for result in group]

    async def _stream(self, prompt: Any, sampling_params: Any, input_ids: Any,
                      priority: int | None) -> AsyncIterator[dict[str, Any]]:
        async for state in await self.frontend.stream(prompt, input_ids, sampling_params, priority):
            yield _checked(state).result()

    def generate(self, prompt: str | list[str] | None = None, sampling_params: dict | list[dict] | None = None,
                 input_ids: list[int] | list[list[int]] | None = None, stream: bool = False,
                 priority: int | None = None) -> Any:
        """Generate for one prompt (a dict back, or a list of n with sampling param n > 1) or a
        list of prompts (a flat list back, in order, n per prompt).

        With stream=True (one prompt, n = 1) returns an iterator of cumulative results.
        """
        if not stream:
            return self._run(self._generate(prompt, sampling_params, input_ids, priority))
        if self._split(prompt, input_ids, sampling_params)[0]:
            raise ValueError("streaming takes one prompt")
        return self._iterate(self._stream(prompt, sampling_params, input_ids, priority))

    def _iterate(self, results: AsyncIterator[dict[str, Any]]) -> Iterator[dict[str, Any]]:
        try:
            while True:
                try:
                    yield self._run(results.__anext__())
                except StopAsyncIteration:
                    return
        finally:
            self._run(results.aclose())

    async def async_generate(self, prompt: str | None = None, sampling_params: dict | None = None,
                             input_ids: list[int] | None = None, stream: bool = False,
                             priority: int | None = None) -> Any:
        if not stream:
            future = asyncio.run_coroutine_threadsafe(
                self._generate(prompt, sampling_params, input_ids, priority), self._events)
            return await asyncio.wrap_future(future)
        return self._async_iterate(self._stream(prompt, sampling_params, input_ids, priority))

    async def _async_iterate(self, results: AsyncIterator[dict[str, Any]]) -> AsyncIterator[dict[str, Any]]:
        try:
            while True:
                try:
                    yield await asyncio.wrap_future(asyncio.run_coroutine_threadsafe(results.__anext__(), self._events))
                except StopAsyncIteration:
                    return
        finally:
            await asyncio.wrap_future(asyncio.run_coroutine_threadsafe(results.aclose(), self._events))

    def encode(self, prompt: str | list[str] | None = None,
               input_ids: list[int] | list[list[int]] | None = None) -> Any:
        """An embedding model's vector of a prompt ({"embedding": [...], "meta_info": {...}}),
        or a list of them for a list of prompts, as sglang.Engine.encode returns."""
        batched, prompts, ids, _ = self._split(prompt, input_ids, None)
        states = self._run(self.frontend.embed(prompts, ids))
        results = [_checked(state).embedding_result() for state in states]
        return results if batched else results[0]

    def load_lora_adapter(self, lora_name: str, lora_path: str) -> list[str]:
        """Load a PEFT adapter (the server launched with --enable-lora); returns the loaded names."""
        return self._run(self.frontend.load_lora_adapter(lora_name, lora_path))

    def unload_lora_adapter(self, lora_name: str) -> list[str]:
        return self._run(self.frontend.unload_lora_adapter(lora_name))

    def flush_cache(self) -> bool:
        return self._run(self.frontend.control("flush_cache"))

    def status(self) -> dict[str, Any]:
        """Scheduler counters: running and waiting requests, KV tokens in use, cache hits..."""
        return self._run(self.frontend.control("status"))

    def shutdown(self) -> None:
        self.frontend.close()
        self._stopped.set()
        self._thread.join(timeout=5)
        self._events.call_soon_threadsafe(self._events.stop)

    def __enter__(self) -> "Engine":
        return self

    def __exit__(self, *exc: Any) -> None:
        self.shutdown()


def _checked(state: RequestState) -> RequestState:
    if state.error is not None:
        raise ValueError(state.error)
    return state
