"""How a launch's computing processes are laid out on this machine, from its arguments alone (no
torch: the server process reads it too).

Without data-parallel attention, each of `--data-parallel-size` groups has its own
tensor-parallel ranks in pipeline stages (`--tensor-parallel-size` x `--pipeline-parallel-size`
processes, spread over `--nnodes`). With `--enable-dp-attention`, each group is one process, and
the groups are the ranks of one tensor-parallel group.
"""

from __future__ import annotations

import os
import socket
from argparse import Namespace


def world_size(args: Namespace) -> int:
    """Ranks in a group: tensor-parallel ranks in each of the pipeline stages."""
    return args.tensor_parallel_size * args.pipeline_parallel_size


def local_ranks(args: Namespace) -> range:
    """The ranks of a group that `args.node_rank` runs."""
    per_node = world_size(args) // args.nnodes
    return range(args.node_rank * per_node, (args.node_rank + 1) * per_node)


def processes_per_group(args: Namespace) -> int:
    """Computing processes of one data-parallel group on this machine."""
    return 1 if args.enable_dp_attention else len(local_ranks(args))


def computing_processes(args: Namespace) -> int:
    """Processes that compute at once on this machine: every group's."""
    return processes_per_group(args) * args.data_parallel_size


def init_address(args: Namespace) -> str:
    """HOST:PORT where the group forms: --dist-init-addr, else --nccl-port (SGLang's port for the
    distributed environment; gloo's here) or a free port on this machine."""
    if args.dist_init_addr:
        return args.dist_init_addr
    if args.nccl_port:
        return f"127.0.0.1:{args.nccl_port}"
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return f"127.0.0.1:{probe.getsockname()[1]}"


def torch_threads(args: Namespace, index: int = 0) -> int:
    """Threads for each process that computes: this machine's cores shared among the processes
    that compute at once; under --numa-node, the cores of this process's node (the `index`-th
    entry) shared among the processes bound to it."""
    if args.numa_node:
        from srv.engine.numa import node_cpus

        node = args.numa_node[index]
        return max(1, len(node_cpus(node)) // args.numa_node[:computing_processes(args)].count(node))
    return max(1, len(os.sched_getaffinity(0)) // computing_processes(args))
