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
from argparse import Namespace
from multiprocessing.process import BaseProcess
from typing import Any, Callable

import zmq

from srv.backend_registry import BackendRegistry
from srv.engine.grammar import GrammarCompiler
from srv.engine.tokenizer import import_tokenizer_modules, load_tokenizer
from srv.engine.frontend import Frontend
from srv.server.data_parallel import DataParallelRouter
from srv.server.scheduler_main import ModelDirKnown, SchedulerFailed, SchedulerReady, Shutdown, SpawnedScheduler

logger = logging.getLogger("srv.scheduler_process")


class OutputReader:
    """A scheduler process's PULL socket, read on the event loop: the socket's file descriptor
    watched by the loop (`add_reader`), its messages taken without blocking. pyzmq's asyncio
    sockets run a dozen Python calls of futures and flags a message, the most of what this process
    spent on each token of a stream, on the core the model's second thread computes on."""

    def __init__(self, socket: zmq.Socket) -> None:
        self.socket = socket
        self._readable: asyncio.Event | None = None
        self._loop: asyncio.AbstractEventLoop | None = None

    async def next(self) -> Any:
        if self._readable is None:   # on the loop that reads it
            self._readable, self._loop = asyncio.Event(), asyncio.get_running_loop()
            self._loop.add_reader(self.socket.getsockopt(zmq.FD), self._readable.set)
        while True:
            try:
                return self.socket.recv_pyobj(zmq.NOBLOCK)
            except zmq.Again:
                pass
            # ZMQ's descriptor signals edges: a message that came after the failed receive shows
            # in the socket's events (reading them re-arms the descriptor), one after this in it.
            self._readable.clear()
            if not self.socket.getsockopt(zmq.EVENTS) & zmq.POLLIN:
                await self._readable.wait()

    def close(self) -> None:
        if self._loop is not None and not self._loop.is_closed():
            self._loop.remove_reader(self.socket.getsockopt(zmq.FD))
        self.socket.close(linger=0)


class SchedulerProcess:
    """Connects a `Frontend` to the scheduler processes that `spawn_scheduler_processes` started:
    one, or one per data-parallel group behind a `DataParallelRouter`."""

    def __init__(self, args: Namespace, registry: BackendRegistry, spawned: list[SpawnedScheduler],
                 on_death: Callable[[str], None]) -> None:
        self.args, self.registry, self.on_death = args, registry, on_death
        self.processes = [s.process for s in spawned]
        self._folders = [s.sockets.folder for s in spawned]
        self._requests, self._outputs = [], []
        for group in spawned:
            requests = zmq.Context.instance().socket(zmq.PUSH)
            requests.bind(group.sockets.requests)
            outputs = zmq.Context.instance().socket(zmq.PULL)
            outputs.bind(group.sockets.outputs)
            self._requests.append(requests)
            self._outputs.append(OutputReader(outputs))
        self.router = DataParallelRouter([r.send_pyobj for r in self._requests], args.load_balance_method) \
            if len(spawned) > 1 else None
        self.frontend: Frontend | None = None
        self.ready: SchedulerReady | None = None
        self._tasks: list[asyncio.Task] = []

    @property
    def process(self) -> BaseProcess:
        return self.processes[0]

    async def start(self) -> Frontend:
        # Importing transformers' tokenizers takes seconds: done on the other core while the
        # scheduler process imports torch, not after. The tokenizer loads once it is done: two
        # threads importing transformers' lazy submodules at once can see one half-initialised.
        importing = None if self.args.skip_tokenizer_init else asyncio.ensure_future(
            asyncio.to_thread(import_tokenizer_modules))
        tokenizer: asyncio.Future | None = None
        readies = []
        for group in range(len(self.processes)):
            message = await self._next_message(group)
            if isinstance(message, ModelDirKnown):
                if group == 0 and importing is not None:
                    tokenizer = asyncio.ensure_future(self._load_tokenizer(importing, message.model_dir))
                message = await self._next_message(group)
            if isinstance(message, SchedulerFailed):
                raise RuntimeError(f"the scheduler could not start: {message.error}")
            readies.append(message)
        self.ready = message = readies[0]
        if len(readies) > 1:
            logger.info("data parallelism: %d scheduler groups, requests balanced by %s", len(readies),
                        self.args.load_balance_method)
        tokenizer = None if tokenizer is None else await tokenizer
        grammars = None if tokenizer is None else GrammarCompiler(
            self.args, self.registry, tokenizer, message.limits.vocab_size, message.model_info["eos_token_ids"])
        send = self.router.send if self.router is not None else self._requests[0].send_pyobj
        self.frontend = Frontend(send, tokenizer, self.args, message.limits, message.model_dir, grammars)
        self._tasks = [asyncio.create_task(self._receive(group)) for group in range(len(self.processes))]
        self._tasks.append(asyncio.create_task(self._watch()))
        if self.router is not None and self.router.watches_load:
            self._tasks.append(asyncio.create_task(self._watch_load()))
        return self.frontend

    async def _load_tokenizer(self, importing: asyncio.Future, model_dir: str) -> Any:
        await importing
        return await asyncio.to_thread(load_tokenizer, self.args, model_dir)

    async def _next_message(self, group: int) -> Any:
        """A scheduler process's next message while it starts; raises if it exits first."""
        process = self.processes[group]
        message = asyncio.ensure_future(self._outputs[group].next())
        while not message.done():
            await asyncio.wait({message}, timeout=0.2)
            if not message.done() and not process.is_alive():
                message.cancel()
                raise RuntimeError(f"the scheduler process exited with code {process.exitcode} while starting")
        return message.result()

    async def _receive(self, group: int) -> None:
        while True:
            for out in await self._outputs[group].next():
                if self.router is not None:
                    out = self.router.receive(group, out)
                    if out is None:
                        continue
                self.frontend.dispatch(out)

    async def _watch(self) -> None:
        while all(process.is_alive() for process in self.processes):
            await asyncio.sleep(0.2)
        dead = next(process for process in self.processes if not process.is_alive())
        reason = f"the scheduler process died (exit code {dead.exitcode})"
        logger.error(reason)
        self.frontend.fail_all(reason)
        self.on_death(reason)

    async def _watch_load(self) -> None:
        while True:
            self.router.watch_load()
            await asyncio.sleep(self.args.load_watch_interval)

    @property
    def alive(self) -> bool:
        return all(process.is_alive() for process in self.processes)

    async def shutdown(self) -> None:
        for task in self._tasks:
            task.cancel()
        if self.frontend is not None:
            self.frontend.close()
        for process, requests in zip(self.processes, self._requests):
            if process.is_alive() and self.ready is not None:
                requests.send_pyobj(Shutdown())
        for process in self.processes:
            if process.is_alive() and self.ready is not None:
                await asyncio.to_thread(process.join, 10)
            if process.is_alive():
                process.kill()
                process.join()
        for socket in self._requests:
            socket.close(linger=0)
        for reader in self._outputs:
            reader.close()
        for folder in self._folders:
            shutil.rmtree(folder, ignore_errors=True)
