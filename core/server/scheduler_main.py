"""The scheduler process's side: build the scheduler, then serve the requests that arrive over
ZMQ until told to stop. `srv.server.scheduler_process` is the server's side; the first scheduler
process starts from `srv.server.early_scheduler`, and imports this module after torch."""

from __future__ import annotations

import copy
import gc
import logging
import multiprocessing
import os
import shutil
import signal
import tempfile
import threading
import time
from argparse import Namespace
from dataclasses import dataclass
from multiprocessing.process import BaseProcess
from typing import TYPE_CHECKING, Any

import zmq

from srv.engine.diagnostics import install_gc_warning
from srv.engine.layout import init_address, processes_per_group
from srv.engine.numa import bind_to_numa_node

if TYPE_CHECKING:   # pydantic, which it imports, would delay the import of torch
    from srv.engine.limits import RequestLimits
    from srv.server.early_scheduler import EarlyScheduler

logger = logging.getLogger("srv.scheduler_process")


@dataclass
class ModelDirKnown:
    """Sent before the weights load: the front end loads the tokenizer from it meanwhile."""
    model_dir: str


@dataclass
class SchedulerReady:
    model_dir: str
    limits: RequestLimits
    model_info: dict[str, Any]


@dataclass
class SchedulerFailed:
    error: str


class Shutdown:
    pass


@dataclass(frozen=True)
class SchedulerSockets:
    """The folder of the two ZMQ sockets between the server and its scheduler process: the
    server binds them and removes the folder at shutdown, or the scheduler removes it when it
    finds the server killed."""
    folder: str

    @property
    def requests(self) -> str:
        return f"ipc://{self.folder}/requests"

    @property
    def outputs(self) -> str:
        return f"ipc://{self.folder}/outputs"


def run_scheduler_process(args: Namespace, sockets: SchedulerSockets) -> None:
    """Entry point of the child process."""
    logging.basicConfig(level=args.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    logger.info("scheduler process %d started", os.getpid())
    if args.numa_node:
        bind_to_numa_node(args.numa_node[0])
    # Ctrl-C in a terminal, or a signal to the whole process group, reaches this process too:
    # the server process shuts it down in order (Shutdown), or it exits once that one is gone.
    for signum in (signal.SIGINT, signal.SIGTERM):
        signal.signal(signum, signal.SIG_IGN)
    install_gc_warning(args.gc_warning_threshold_secs)
    threading.Thread(target=_exit_with_parent, args=(os.getppid(), sockets), name="srv-parent-watch",
                     daemon=True).start()
    context = zmq.Context()
    outputs = context.socket(zmq.PUSH)
    outputs.connect(sockets.outputs)
    requests = context.socket(zmq.PULL)
    requests.connect(sockets.requests)
    try:
        from srv.engine.build import build_scheduler
        from srv.engine.scheduler_loop import SchedulerLoop
        from srv.plugin_manager import load_plugins

        runner, scheduler = build_scheduler(args, load_plugins()[1],
                                            lambda model_dir: outputs.send_pyobj(ModelDirKnown(str(model_dir))))
        loop = SchedulerLoop(scheduler)
    except Exception as exc:
        logger.exception("the scheduler could not start")
        outputs.send_pyobj(SchedulerFailed(f"{type(exc).__name__}: {exc}"))
        os._exit(1)
    # The model and the modules live until the process ends: a full collection while serving
    # need not walk them (each such pass stalls every request).
    gc.freeze()
    config = runner.config
    outputs.send_pyobj(SchedulerReady(str(runner.model_dir), scheduler.request_limits(), {
        "architectures": list(getattr(config, "architectures", None) or []),
        "dtype": str(runner.dtype).removeprefix("torch."),
        "vocab_size": config.vocab_size,
        "kv_capacity_tokens": scheduler.allocator.capacity_tokens,
        "max_running_requests": scheduler.max_running,
        "chunked_prefill_size": scheduler.chunk_size,
        "eos_token_ids": scheduler.eos_ids,
        "is_generation": not runner.is_embedding,
        "is_cross_encoder": runner.is_cross_encoder,
        "hidden_size": getattr(config, "hidden_size", None),
        # Sentence-transformers' Matryoshka models name the prefixes of their embeddings that
        # still work as embeddings (a list, or true for any).
        "matryoshka_dimensions": getattr(config, "matryoshka_dimensions", None)
        or getattr(config, "is_matryoshka", None),
    }))
    # Not beside the weights' loading (it slowed that by half), nor beside the first requests.
    scheduler.load_tokenizer_when_idle()
    try:
        _serve(loop, Watchdog(args.watchdog_timeout), requests, outputs)
        loop.close()
    except BaseException:
        # A fault the loop does not absorb (--crash-on-nan's, or one in its failure handling)
        # ends the process at once: a normal interpreter exit would wait forever on the ZMQ
        # context, leaving the server to wait on a scheduler that is gone.
        logger.exception("the scheduler failed; exiting")
        os._exit(1)
    scheduler.close()
    for socket in (requests, outputs):
        socket.close(linger=0)
    context.term()


def _serve(loop: Any, watchdog: "Watchdog", requests: zmq.Socket, outputs: zmq.Socket) -> None:
    """Serve the requests that arrive, until told to stop."""
    poller = zmq.Poller()
    poller.register(requests, zmq.POLLIN)
    while True:
        outs: list[Any] = []
        timeout = int(loop.wait_s * 1000)
        receiving = loop.receives_now()
        while receiving and poller.poll(timeout):
            message = requests.recv_pyobj()
            if isinstance(message, Shutdown):
                return
            outs += loop.handle(message)
            timeout = 0
        with watchdog:
            outs += loop.step()
        if outs:
            outputs.send_pyobj(outs)


def _exit_with_parent(parent: int, sockets: SchedulerSockets) -> None:
    """A scheduler whose server was killed (SIGKILL leaves no time to shut it down) must not
    live on holding its memory, nor leave the socket folder behind: once re-parented, it
    removes the folder and exits."""
    while os.getppid() == parent:
        time.sleep(1.0)
    logger.error("the server process %d is gone; exiting", parent)
    shutil.rmtree(sockets.folder, ignore_errors=True)
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


@dataclass
class SpawnedScheduler:
    """A started scheduler process and the sockets it connects to, which `SchedulerProcess`
    binds (ZMQ connects whichever side comes first)."""
    process: BaseProcess
    sockets: SchedulerSockets


def spawn_scheduler_processes(args: Namespace, early: EarlyScheduler | None = None) -> list[SpawnedScheduler]:
    """One scheduler process per data-parallel group (--data-parallel-size); the first one is
    `early` where it was started."""
    spawned = []
    address = None
    if args.enable_dp_attention:   # the groups are the ranks of one torch.distributed group
        address = init_address(args)
    for group in range(args.data_parallel_size):
        sockets = SchedulerSockets(tempfile.mkdtemp(prefix="srv-"))
        group_args = copy.copy(args)
        if args.numa_node:   # each group's processes first: srv.engine.numa
            start = group * processes_per_group(args)
            group_args.numa_node = args.numa_node[start:] + args.numa_node[:start]
        group_args.data_parallel_rank = group
        if address is not None:
            group_args.dp_attention_address = address
        if group == 0 and early is not None:
            process = early.start(group_args, sockets)
        else:
            process = multiprocessing.get_context("spawn").Process(
                target=run_scheduler_process, name=f"srv-scheduler-{group}" if group else "srv-scheduler",
                daemon=True, args=(group_args, sockets))
            process.start()
        spawned.append(SpawnedScheduler(process, sockets))
    return spawned
