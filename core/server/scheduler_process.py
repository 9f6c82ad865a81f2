"""The server's side of the scheduler process, reached over ZMQ: the HTTP process stays
responsive while the model computes, and a crash of either side is seen by the other.

Main process                         scheduler process (`srv.server.scheduler_main`)
  PUSH  --- GenerateRequest, ... -->   PULL
  PULL  <-- [RequestOutput, ...] ---   PUSH
"""

from __future__ import annotations

import asyncio
import logging
import shutil
import threading
from argparse import Namespace
from typing import Any, Callable

import zmq
import zmq.asyncio

from srv.backend_registry import BackendRegistry
from srv.engine.grammar import GrammarCompiler
from srv.engine.tokenizer import import_tokenizer_modules, load_tokenizer
from srv.engine.frontend import Frontend
from srv.server.scheduler_main import ModelDirKnown, SchedulerFailed, SchedulerReady, Shutdown, SpawnedScheduler

logger = logging.getLogger("srv.scheduler_process")


class SchedulerProcess:
    """Connects a `Frontend` to a scheduler process that `spawn_scheduler_process` started."""

    def __init__(self, args: Namespace, registry: BackendRegistry, spawned: SpawnedScheduler,
                 on_death: Callable[[str], None]) -> None:
        self.args, self.registry, self.on_death = args, registry, on_death
        self.process, self._sockets = spawned.process, spawned.sockets
        self._context = zmq.asyncio.Context()
        self._requests = zmq.Context.instance().socket(zmq.PUSH)
        self._requests.bind(self._sockets.requests)
        self._outputs = self._context.socket(zmq.PULL)
        self._outputs.bind(self._sockets.outputs)
        self.frontend: Frontend | None = None
        self.ready: SchedulerReady | None = None
        self._tasks: list[asyncio.Task] = []

    async def start(self) -> Frontend:
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
            self.args, self.registry, tokenizer, message.limits.vocab_size, message.model_info["eos_token_ids"])
        self.frontend = Frontend(self._requests.send_pyobj, tokenizer, self.args, message.limits, message.model_dir,
                                 grammars)
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
        if self.process.is_alive() and self.ready is not None:
            self._requests.send_pyobj(Shutdown())
            await asyncio.to_thread(self.process.join, 10)
        if self.process.is_alive():
            self.process.kill()
            self.process.join()
        self._requests.close(linger=0)
        self._outputs.close(linger=0)
        shutil.rmtree(self._sockets.folder, ignore_errors=True)
