"""--numa-node: the scheduler process (and each tensor-parallel rank) binds itself to its node's
cores and memory; nodes the machine lacks, or too few for the processes, are refused at launch."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

import srv
from srv.args.parser import parse_launch_args
from srv.engine.numa import node_cpus, parse_cpulist
from srv.plugin_manager import load_plugins
from test_server import served_once

pytestmark = pytest.mark.skipif(not os.path.exists("/sys/devices/system/node/node0"),
                                reason="the kernel shows no NUMA nodes")


def test_cpulists_parse_as_the_kernel_writes_them():
    assert parse_cpulist("0-3,8,10-11\n") == {0, 1, 2, 3, 8, 10, 11}
    assert parse_cpulist("5") == {5} and parse_cpulist("") == set()


@pytest.mark.parametrize("flags,message", [
    (["--numa-node", "4096"], "this machine has NUMA nodes [0"),
    (["--tp-size", "2", "--numa-node", "0"], "names 1 nodes for 2 processes"),
])
def test_nodes_the_launch_cannot_use_are_refused(flags, message, capsys):
    with pytest.raises(SystemExit):
        parse_launch_args(flags, *load_plugins())
    assert message in capsys.readouterr().err


def test_binding_sets_the_affinity_to_the_nodes_cores():
    code = ("import logging, os, sys; logging.basicConfig(level='INFO', stream=sys.stdout); "
            "from srv.engine.numa import bind_to_numa_node; bind_to_numa_node(0); print(sorted(os.sched_getaffinity(0)))")
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip().splitlines()[-1] == str(sorted(node_cpus(0) & set(range(os.cpu_count()))))
    assert "bound to NUMA node 0" in result.stdout


@pytest.mark.parametrize("flags,processes", [(["--numa-node", "0"], 1), (["--tp-size", "2", "--numa-node", "0", "0"], 2)])
def test_the_servers_processes_bind_themselves(tiny_models, flags, processes):
    output = served_once("--model-path", str(tiny_models["llama"]), *flags, "--skip-server-warmup")
    assert output.count("bound to NUMA node 0") == processes, output


def test_the_in_process_engine_leaves_binding_to_its_caller(tiny_models):
    with pytest.raises(ValueError, match="srv.Engine computes in the process that calls it"):
        srv.Engine(model_path=str(tiny_models["llama"]), numa_node=[0])
