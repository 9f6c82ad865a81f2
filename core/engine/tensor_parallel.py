"""Tensor-parallel ranks (`--tensor-parallel-size`) in pipeline stages (`--pipeline-parallel-size`):
one process each, in one torch.distributed group (gloo on CPU).

Rank 0 is the process that schedules (the scheduler process, or `srv.Engine`'s): it starts the
other ranks of its node, and each command it runs on its model (allocate the KV pool, run a
forward pass) it first broadcasts, so every rank runs the same pass on its own share of the
layers and of the KV heads. Only rank 0 samples and answers. `--nnodes`, `--node-rank` and
`--dist-init-addr` spread the ranks over machines: node 0 holds rank 0, and each other node's
`srv launch` starts its own ranks and serves no HTTP (`serve_node`).

A rank that dies ends the group: rank 0 watches the ranks it started and exits when one does
(the server then reports the scheduler's death and exits non-zero); a collective with a rank
gone fails within `--dist-timeout`, and a failed collective ends the process; a rank whose
parent is gone exits.
"""

from __future__ import annotations

import gc
import logging
import os
import pickle
import subprocess
import sys
import threading
import time
from argparse import Namespace
from datetime import timedelta
from typing import Any

import torch

from srv.engine.layout import init_address, local_ranks, torch_threads
from srv.engine.shm_collectives import SharedMemoryCollectives, create_segment
from srv.sdk.parallel import ParallelContext

logger = logging.getLogger("srv.tensor_parallel")

# Ranks other than 0 wait on the command group between batches for as long as the server idles.
IDLE_TIMEOUT = timedelta(days=365)


class ParallelGroup:
    """This process's rank in the group, the collectives (`context`) and the command channel."""

    def __init__(self, args: Namespace, rank: int, address: str) -> None:
        import torch.distributed as dist

        tp, pp = args.tensor_parallel_size, args.pipeline_parallel_size
        size = tp * pp
        stage, tp_rank = divmod(rank, tp)
        timeout = timedelta(seconds=args.dist_timeout) if args.dist_timeout else timedelta(minutes=10)
        logger.info("rank %d of %d (pipeline stage %d, tensor-parallel rank %d): joining the group at %s", rank, size,
                    stage, tp_rank, address)
        # Ranks on one machine meet in shared memory, set up by rank 0 before the group forms:
        # one segment for the commands, one for each stage's all-reduces.
        shared = args.nnodes == 1 and not args.disable_custom_all_reduce
        name = address.replace(":", "-")
        segments = [(f"{name}-commands", size)] + [(f"{name}-stage{s}", tp) for s in range(pp) if tp > 1]
        if shared and rank == 0:
            for segment, ranks in segments:
                create_segment(segment, ranks)
        dist.init_process_group("gloo", init_method=f"tcp://{address}", rank=rank, world_size=size, timeout=timeout)
        self.rank, self.size = rank, size
        # Every rank makes every stage's group, in the same order (torch.distributed's rule).
        stages = [dist.new_group(list(range(s * tp, (s + 1) * tp))) for s in range(pp)] if pp > 1 else [dist.group.WORLD]
        seconds = timeout.total_seconds()
        self.channel = SharedMemoryCollectives(f"{name}-commands", rank, size, seconds) if shared else None
        self.local = SharedMemoryCollectives(f"{name}-stage{stage}", tp_rank, tp, seconds) if shared and tp > 1 else None
        self.context = ParallelContext(tp_rank, tp, stages[stage], local=self.local, pp_rank=stage, pp_size=pp)
        # Commands travel on a group of their own, whose waits never time out: an idle server
        # leaves the other ranks waiting for the next batch.
        self.commands = dist.new_group(backend="gloo", timeout=IDLE_TIMEOUT)
        if shared:
            dist.barrier()   # every rank has mapped the segments
            if rank == 0:
                for segment, _ in segments:
                    SharedMemoryCollectives.unlink(segment)
        self.children: list[subprocess.Popen] = []
        self.watcher: threading.Thread | None = None
        self.closing = False
        self.last_sent = time.perf_counter()   # when rank 0 last sent a command
        # Ranks on other nodes are no children of this one: an idle rank 0 finds one gone only
        # by a collective (ModelRunner.keep_alive).
        self.has_remote_ranks = args.nnodes > 1

    def send(self, name: str, **payload: Any) -> None:
        """Rank 0: have every other rank run `name(**payload)` on its ModelRunner."""
        import torch.distributed as dist

        started = self.last_sent = time.perf_counter()
        if self.channel is not None:
            self.channel.send((name, payload))
        else:
            dist.broadcast_object_list([(name, payload)], src=0, group=self.commands)
        self.context.collective_seconds += time.perf_counter() - started

    def receive(self) -> tuple[str, dict[str, Any]]:
        import torch.distributed as dist

        if self.channel is not None:
            return self.channel.receive()
        message: list[Any] = [None]
        dist.broadcast_object_list(message, src=0, group=self.commands)
        return message[0]

    def watch(self, children: dict[int, subprocess.Popen]) -> None:
        """Rank 0: exit when a rank it started (rank -> process) exits: a collective would wait on it."""
        self.children = list(children.values())

        def watch() -> None:
            while not self.closing:
                for rank, child in children.items():
                    code = child.poll()
                    if code is not None and not self.closing:
                        logger.error("tensor-parallel rank %d exited with code %d; stopping", rank, code)
                        os._exit(1)
                time.sleep(0.2)

        self.watcher = threading.Thread(target=watch, name="srv-tp-watch", daemon=True)
        self.watcher.start()

    def close(self) -> None:
        """Rank 0: stop the other ranks."""
        if self.rank != 0 or self.closing:
            return
        self.closing = True
        try:
            self.send("stop")
        except RuntimeError:
            pass
        for child in self.children:
            try:
                child.wait(10)
            except subprocess.TimeoutExpired:
                child.kill()
        if self.watcher is not None:
            # Its last reference to this group must go while the interpreter lives: dropped at
            # exit, the process group's destructor aborts the process (std::terminate).
            self.watcher.join()
        import torch.distributed as dist

        # A process may form another group later (srv.Engine in tests, a reload).
        dist.destroy_process_group()


def start_ranks(args: Namespace, ranks: range, address: str) -> dict[int, subprocess.Popen]:
    """Start a process for each of `ranks` (`python -m srv.engine.tensor_parallel`), handed the
    launch's arguments on standard input."""
    children = {}
    for rank in ranks:
        child = subprocess.Popen([sys.executable, "-m", "srv.engine.tensor_parallel"], stdin=subprocess.PIPE)
        child.stdin.write(pickle.dumps((args, rank, address)))
        child.stdin.close()
        children[rank] = child
    return children


def join_as_rank_zero(args: Namespace) -> ParallelGroup:
    """Rank 0 (node 0): start this node's other ranks, then form the group with them."""
    address = init_address(args)
    children = start_ranks(args, local_ranks(args)[1:], address)
    group = ParallelGroup(args, 0, address)
    group.watch(children)
    return group


def run_rank(args: Namespace, rank: int, address: str) -> None:
    """A rank other than 0: build this rank's share of the model, then run rank 0's commands
    until it says stop."""
    from srv.engine.model_runner import ModelRunner
    from srv.plugin_manager import load_plugins

    gc.freeze()   # torch's modules: as the scheduler process does (srv.server.early_scheduler)
    index = rank - local_ranks(args)[0]
    if args.numa_node:
        from srv.engine.numa import bind_to_numa_node

        bind_to_numa_node(args.numa_node[index])
    if "OMP_NUM_THREADS" not in os.environ:
        torch.set_num_threads(torch_threads(args, index))
    parent = os.getppid()

    def exit_with_parent() -> None:
        while os.getppid() == parent:
            time.sleep(1.0)
        logger.error("tensor-parallel rank %d: the process that started it is gone; exiting", rank)
        os._exit(4)

    threading.Thread(target=exit_with_parent, name="srv-parent-watch", daemon=True).start()
    group = ParallelGroup(args, rank, address)
    runner = ModelRunner(args, load_plugins()[1], tensor_parallel=group)
    # A full collection on any rank stalls the whole group's step: none walks the model.
    gc.freeze()
    logger.info("tensor-parallel rank %d: ready", rank)
    while True:
        try:
            name, payload = group.receive()
        except RuntimeError as exc:   # gloo's, rank 0 gone (the shared-memory wait has no end)
            logger.error("tensor-parallel rank %d: rank 0 is gone (%s); exiting", rank, exc)
            os._exit(1)
        if name == "stop":
            logger.info("tensor-parallel rank %d: stopping", rank)
            return
        try:
            getattr(runner, name)(**payload)
        except Exception:
            # Rank 0 ran the same command on the same inputs and fails the same way (a request
            # it then fails): the group goes on. A collective that fails ends the process.
            logger.exception("tensor-parallel rank %d: %s failed", rank, name)


def serve_node(args: Namespace) -> int:
    """`srv launch --node-rank K` for K > 0: start this node's ranks and wait for them; the exit
    code is the first non-zero one."""
    address = args.dist_init_addr
    children = start_ranks(args, local_ranks(args), address)
    logger.info("node %d of %d: tensor-parallel ranks %s started, joining %s", args.node_rank, args.nnodes,
                list(local_ranks(args)), address)
    codes = [child.wait() for child in children.values()]
    return next((code for code in codes if code), 0)


def main() -> None:
    args, rank, address = pickle.loads(sys.stdin.buffer.read())
    logging.basicConfig(level=args.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    try:
        run_rank(args, rank, address)
    except Exception:
        logger.exception("tensor-parallel rank %d failed", rank)
        os._exit(1)
    os._exit(0)


if __name__ == "__main__":
    main()
