"""What every benchmarked engine provides, and the measurement shared by the two servers."""

from __future__ import annotations

import contextlib
import logging
import os
import shlex
import subprocess
import sys
from abc import ABC, abstractmethod
from dataclasses import dataclass, field
from pathlib import Path
from typing import Iterator

from benchmarks.load import load_command, run_load
from benchmarks.model import BenchModel
from benchmarks.results import LAUNCH, Probe, Run, serve_metrics
from benchmarks.servers import ServerProcess
from benchmarks.workloads import Workload

logger = logging.getLogger("benchmarks")

REPO = Path(__file__).resolve().parent.parent


@dataclass
class BenchContext:
    model: BenchModel
    workloads: list[Workload]
    log_dir: Path


def shell_line(command: list[str]) -> str:
    """A command as one shell line, with the repository and home folders shortened for reading."""
    line = shlex.join(command)
    return line.replace(str(REPO) + "/", "").replace(str(Path.home()), "~")


@dataclass
class Engine(ABC):
    context: BenchContext
    version: str = ""                                  # what was measured: version, build, packages
    chosen: str = ""                                   # the configuration measured, in words
    probes: list[Probe] = field(default_factory=list)
    server_commands: list[str] = field(default_factory=list)
    load_commands: list[str] = field(default_factory=list)

    name = ""

    @abstractmethod
    def prepare(self) -> None:
        """Build or install, pick the fastest configuration, and warm every cache a launch uses."""

    @abstractmethod
    def run_rep(self, rep: int) -> list[Run]:
        """One repetition: W4 and every workload."""


@contextlib.contextmanager
def cpu_hog(wanted: bool) -> Iterator[None]:
    """A process spinning on the machine's last core while the block runs (when `wanted`)."""
    if not wanted:
        yield
        return
    core = max(os.sched_getaffinity(0))
    hog = subprocess.Popen([sys.executable, "-c", "while True: pass"],
                           preexec_fn=lambda: os.sched_setaffinity(0, {core}))
    try:
        yield
    finally:
        hog.kill()
        hog.wait()


def verify_counts(base_url: str) -> tuple[int, int]:
    """The server's verify steps and the tokens they gave, so far (srv's scheduler counters)."""
    import httpx

    status = httpx.get(f"{base_url}/get_server_info", timeout=30).json()["scheduler"]
    return status["spec_verifies"], status["spec_accepted_tokens"]


def measure_server(engine: Engine, server: ServerProcess, workloads: list[Workload], rep: int, config: str,
                   fresh_connections: bool, with_launch: bool) -> list[Run]:
    """Launch `server` (timing W4 when `with_launch`), run `workloads` against it, stop it."""
    runs = []
    with server:
        launch_s = server.launch_to_first_token()
        if with_launch:
            runs.append(Run(engine.name, rep, LAUNCH, {"launch_to_first_token_s": launch_s}, config))
        for workload in workloads:
            command = load_command(server.base_url, workload, engine.context.model.hf_dir, fresh_connections)
            line = shell_line(command).replace(server.base_url, "http://127.0.0.1:PORT")
            if line not in engine.load_commands:
                engine.load_commands.append(line)
            before = verify_counts(server.base_url) if workload.speculative else (0, 0)
            with cpu_hog(workload.hog):
                result = run_load(command, f"{engine.name} {workload.name}")
            metrics = serve_metrics(result)
            if workload.speculative:
                # This workload's own: the server's counters also hold the workloads before it.
                verifies, tokens = (after - first for after, first in zip(verify_counts(server.base_url), before))
                metrics["spec_accept_length"] = tokens / verifies if verifies else 0.0
            runs.append(Run(engine.name, rep, workload.name, metrics, config))
            logger.info("%s rep %d %s: %.1f output tok/s, TTFT p50 %.0f ms, TPOT p50 %.1f ms", engine.name, rep,
                        workload.name, result["output_throughput"], result["ttft_median_s"] * 1e3,
                        result["tpot_median_s"] * 1e3)
    return runs
