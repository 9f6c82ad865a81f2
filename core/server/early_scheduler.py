"""The scheduler process started before the launch's flags are parsed. This module imports only
the standard library's process tools: the spawned process unpickles its entry point from here,
so whatever this module imports delays the import of torch, the longest part of its start."""

from __future__ import annotations

import gc
import multiprocessing
import signal
from multiprocessing.process import BaseProcess
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from argparse import Namespace

    from srv.server.scheduler_main import SchedulerSockets


class EarlyScheduler:
    """A scheduler process that imports torch while the server process loads the plugins and
    parses the flags, then waits for its arguments (`spawn_scheduler_processes` sends them)."""

    def __init__(self) -> None:
        context = multiprocessing.get_context("spawn")
        self._connection, child_end = context.Pipe()
        self.process = context.Process(target=_run_early, args=(child_end,), name="srv-scheduler", daemon=True)
        self.process.start()
        child_end.close()

    def start(self, args: Namespace, sockets: SchedulerSockets) -> BaseProcess:
        self._connection.send((args, sockets))
        self._connection.close()
        return self.process

    def cancel(self) -> None:
        """No scheduler after all (a flag's error, another node's launch): it ends at once."""
        self._connection.close()
        if self.process.is_alive():
            self.process.kill()   # it ignores SIGTERM, as a scheduler process does
        self.process.join()


def _run_early(connection: Any) -> None:
    for signum in (signal.SIGINT, signal.SIGTERM):   # as run_scheduler_process, from the start
        signal.signal(signum, signal.SIG_IGN)
    import torch  # noqa: F401 (the reason this process starts before the flags are parsed)

    # Torch's modules are objects that live as long as the process: out of the collector's
    # reach, the full collections that the rest of the start triggers do not walk them again.
    gc.freeze()

    from srv.server.scheduler_main import run_scheduler_process

    try:
        args, sockets = connection.recv()
    except EOFError:   # cancelled, or the server process is gone
        return
    connection.close()
    run_scheduler_process(args, sockets)
