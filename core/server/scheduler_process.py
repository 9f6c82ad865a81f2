"""The scheduler in its own process, reached over ZMQ: the HTTP process stays responsive while
the model computes, and a crash of either side is seen by the other.

Main process                         scheduler process
  PUSH  --- GenerateRequest, ... -->   PULL
  PULL  <-- [RequestOutput, ...] ---   PUSH
"""

from __future__ import annotations

import asyncio
import logging
import multiprocessing
import os
import signal
import tempfile
import threading
import time
from argparse import Namespace
from dataclasses import dataclass
from typing import Any, Callable

import zmq
import zmq.asyncio

from srv.backend_registry import BackendRegistry
from srv.engine.grammar import GrammarCompiler
from srv.engine.tokenizer import import_tokenizer_modules, load_tokenizer
from srv.engine.diagnostics import install_gc_warning
from srv.engine.frontend import Frontend

logger = logging.getLogger("srv.scheduler_process")


@dataclass
class ModelDirKnown:
    """Sent before the weights load: the front end loads the tokenizer from it meanwhile."""
    model_dir: str


@dataclass
class SchedulerReady:
    model_dir: str
    context_len: int
    vocab_size: int
    model_info: dict[str, Any]


@dataclass
class SchedulerFailed:
    error: str


class Shutdown:
    pass


def run_scheduler_process(args: Namespace, requests_addr: str, outputs_addr: str) -> None:
    """Entry point of the child process."""
    logging.basicConfig(level=args.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    logger.info("scheduler process %d started", os.getpid())
    # Ctrl-C in a terminal, or a signal to the whole process group, reaches this process too:
    # the server process shuts it down in order (Shutdown), or it exits once that one is gone.
    for signum in (signal.SIGINT, signal.SIGTERM):
        signal.signal(signum, signal.SIG_IGN)
    install_gc_warning(args.gc_warning_threshold_secs)
    threading.Thread(target=_exit_with_parent, args=(os.getppid(),), name="srv-parent-watch", daemon=True).start()
    context = zmq.Context()
    outputs = context.socket(zmq.PUSH)
    outputs.connect(outputs_addr)
    requests = context.socket(zmq.PULL)
    requests.connect(requests_addr)
    try:
        from srv.engine.engine import build_scheduler
        from srv.engine.scheduler_loop import SchedulerLoop
        from srv.plugin_manager import load_plugins

        runner, scheduler = build_scheduler(args, load_plugins()[1],
                                            lambda model_dir: outputs.send_pyobj(ModelDirKnown(str(model_dir))))
    except Exception as exc:
        logger.exception("the scheduler could not start")
        outputs.send_pyobj(SchedulerFailed(f"{type(exc).__name__}: {exc}"))
        os._exit(1)
    config = runner.config
    outputs.send_pyobj(SchedulerReady(str(runner.model_dir), runner.context_len, config.vocab_size, {
        "architectures": list(getattr(config, "architectures", None) or []),
        "dtype": str(runner.dtype).removeprefix("torch."),
        "kv_capacity_tokens": scheduler.allocator.capacity_tokens,
        "max_running_requests": scheduler.max_running,
        "eos_token_ids": scheduler.eos_ids,
    }))
    # Only now: importing transformers beside the weights' loading slowed that by half.
    scheduler.start_loading_tokenizer()
    loop = SchedulerLoop(scheduler)
    watchdog = Watchdog(args.watchdog_timeout)
    poller = zmq.Poller()
    poller.register(requests, zmq.POLLIN)
    while True:
        outs: list[Any] = []
        timeout = 0 if loop.has_work else 100
        while poller.poll(timeout):
            message = requests.recv_pyobj()
            if isinstance(message, Shutdown):
                return
            outs += loop.handle(message)
            timeout = 0
        with watchdog:
            outs += loop.step()
        if outs:
            outputs.send_pyobj(outs)


def _exit_with_parent(parent: int) -> None:
    """A scheduler whose server was killed (SIGKILL leaves no time to shut it down) must not
    live on holding its memory: once re-parented, it exits."""
    while os.getppid() == parent:
        time.sleep(1.0)
    logger.error("the server process %d is gone; exiting", parent)
    os._exit(4)


class Watchdog:
    """Ends the process when one scheduler step runs longer than --watchdog-timeout seconds:
    a forward pass that never returns must not leave requests hanging forever."""

    def __init__(self, timeout: float) -> None:
        self.timeout = timeout
        self.started: float | None = None
        threading.Thread(target=self._watch, name="srv-watchdog", daemon=True).start()

    def __enter__(self) -> None:
        self.started = time.monotonic()

    def __exit__(self, *exc: Any) -> None:
        self.started = None

    def _watch(self) -> None:
        while True:
            time.sleep(min(1.0, self.timeout / 4))
            started = self.started
            if started is not None and time.monotonic() - started > self.timeout:
                logger.error("watchdog: a scheduler step has run for more than %.0f s; exiting", self.timeout)
                os._exit(3)


class SchedulerProcess:
    """Starts the scheduler process and connects a `Frontend` to it."""

    def __init__(self, args: Namespace, registry: BackendRegistry, on_death: Callable[[str], None]) -> None:
        self.args, self.registry, self.on_death = args, registry, on_death
        self._dir = tempfile.mkdtemp(prefix="srv-")
        self._context = zmq.asyncio.Context()
        self._requests = zmq.Context.instance().socket(zmq.PUSH)
        self._requests.bind(f"ipc://{self._dir}/requests")
        self._outputs = self._context.socket(zmq.PULL)
        self._outputs.bind(f"ipc://{self._dir}/outputs")
        spawn = multiprocessing.get_context("spawn")
        self.process = spawn.Process(target=run_scheduler_process, name="srv-scheduler", daemon=True,
                                     args=(args, f"ipc://{self._dir}/requests", f"ipc://{self._dir}/outputs"))
        self.frontend: Frontend | None = None
        self.ready: SchedulerReady | None = None
        self._tasks: list[asyncio.Task] = []

    async def start(self) -> Frontend:
        self.process.start()
        if not self.args.skip_tokenizer_init:
            # Importing transformers' tokenizers takes seconds: done on the other core while
            # the scheduler process imports torch, not after.
            threading.Thread(target=import_tokenizer_modules, name="srv-tokenizer-import", daemon=True).start()
        tokenizer: asyncio.Future | None = None
        message = await self._next_message()
        if isinstance(message, ModelDirKnown):
            if not self.args.skip_tokenizer_init:
                tokenizer = asyncio.ensure_future(asyncio.to_thread(load_tokenizer, self.args, message.model_dir))
            message = await self._next_message()
        if isinstance(message, SchedulerFailed):
            raise RuntimeError(f"the scheduler could not start: {message.error}")
        self.ready = message
        tokenizer = None if tokenizer is None else await tokenizer
        grammars = None if tokenizer is None else GrammarCompiler(
            self.args, self.registry, tokenizer, message.vocab_size, message.model_info["eos_token_ids"])
        self.frontend = Frontend(self._requests.send_pyobj, tokenizer, self.args, message.context_len,
                                 message.model_dir, grammars)
        self._tasks = [asyncio.create_task(self._receive()), asyncio.create_task(self._watch())]
        return self.frontend

    async def _next_message(self) -> Any:
        """The scheduler process's next message while it starts; raises if it exits first."""
        message = asyncio.ensure_future(self._outputs.recv_pyobj())
        while not message.done():
            await asyncio.wait({message}, timeout=0.2)
            if not message.done() and not self.process.is_alive():
                message.cancel()
                raise RuntimeError(f"the scheduler process exited with code {self.process.exitcode} while starting")
        return message.result()

    async def _receive(self) -> None:
        while True:
            for out in await self._outputs.recv_pyobj():
                self.frontend.dispatch(out)

    async def _watch(self) -> None:
        while self.process.is_alive():
            await asyncio.sleep(0.2)
        reason = f"the scheduler process died (exit code {self.process.exitcode})"
        logger.error(reason)
        self.frontend.fail_all(reason)
        self.on_death(reason)

    @property
    def alive(self) -> bool:
        return self.process.is_alive()

    async def shutdown(self) -> None:
        for task in self._tasks:
            task.cancel()
        if self.frontend is not None:
            self.frontend.close()
        if self.process.is_alive():
            self._requests.send_pyobj(Shutdown())
            await asyncio.to_thread(self.process.join, 10)
        if self.process.is_alive():
            self.process.kill()
            self.process.join()
        self._requests.close(linger=0)
        self._outputs.close(linger=0)
