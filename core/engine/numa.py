"""`--numa-node`: each process that computes runs on one NUMA node's cores and allocates from
its memory first.

The i-th entry is the i-th computing process on this machine: data-parallel group by group,
and within a group its tensor-parallel ranks in order (the scheduler process is rank 0).
`spawn_scheduler_processes` hands each group its own slice, and each process binds itself as
it starts: CPU affinity to the node's cores (`/sys/devices/system/node/node<N>/cpulist`) and the
memory policy MPOL_PREFERRED for the node (set_mempolicy; where the kernel refuses it, affinity
alone, whose first-touch allocations land on the node anyway).
"""

from __future__ import annotations

import ctypes
import logging
import os
import platform
from pathlib import Path

logger = logging.getLogger("srv.engine")

NODES = Path("/sys/devices/system/node")
MPOL_PREFERRED = 1
SET_MEMPOLICY = {"x86_64": 238, "aarch64": 237}   # the syscall's number


def parse_cpulist(text: str) -> set[int]:
    """CPUs of a kernel cpulist: "0-3,8,10-11"."""
    cpus: set[int] = set()
    for part in filter(None, text.strip().split(",")):
        first, _, last = part.partition("-")
        cpus.update(range(int(first), int(last or first) + 1))
    return cpus


def node_cpus(node: int) -> set[int]:
    path = NODES / f"node{node}" / "cpulist"
    if not path.exists():
        present = sorted(int(p.name[4:]) for p in NODES.glob("node[0-9]*")) if NODES.exists() else []
        raise ValueError(f"--numa-node {node}: this machine has NUMA nodes {present}")
    return parse_cpulist(path.read_text())


def check_numa_nodes(nodes: list[int], processes: int) -> None:
    """Every node exists, and there is one for each of the `processes` computing processes."""
    for node in nodes:
        node_cpus(node)
    if len(nodes) < processes:
        raise ValueError(f"--numa-node names {len(nodes)} nodes for {processes} processes (one a data-parallel "
                         "group's tensor-parallel rank on this machine)")


def bind_to_numa_node(node: int) -> None:
    """This process's CPU affinity and preferred memory node."""
    cpus = node_cpus(node) & set(range(os.cpu_count() or 1))
    os.sched_setaffinity(0, cpus)
    number = SET_MEMPOLICY.get(platform.machine())
    policy = "memory preferred there"
    if number is None:
        policy = "memory policy left (no set_mempolicy number for this architecture)"
    else:
        mask = (ctypes.c_ulong * (node // 64 + 1))()
        mask[node // 64] = 1 << (node % 64)
        libc = ctypes.CDLL(None, use_errno=True)
        if libc.syscall(number, MPOL_PREFERRED, mask, ctypes.c_ulong(64 * len(mask) + 1)) != 0:
            policy = f"memory policy refused ({os.strerror(ctypes.get_errno())})"
    logger.info("process %d bound to NUMA node %d: cores %s, %s", os.getpid(), node, sorted(cpus), policy)
