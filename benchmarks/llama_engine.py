"""The llama.cpp peer: the C++ `llama-server` on the same GGUF file.

Slots: 16 for every workload of concurrency up to 16, and one per stream above that, each with
room for its whole request (llama-server splits -c among its slots; the KV cache is unified).
The weight repacking and thread count are picked by a short probe of each candidate: the
repacked int8 kernels are the fastest where they work, and a thread that spins at the step
barrier can be slower than one thread when the cores are shared.
llama-server closes the connection after each streamed response, hence fresh connections.
"""

from __future__ import annotations

import logging
import os
import subprocess
from dataclasses import dataclass, field
from pathlib import Path

from benchmarks.engine import Engine, measure_server, shell_line
from benchmarks.llama_build import LlamaBuild, ensure_llama_server
from benchmarks.load import load_command, run_load
from benchmarks.results import Probe, Run
from benchmarks.servers import ServerDied, ServerProcess, free_port
from benchmarks.workloads import PROBE, Workload

logger = logging.getLogger("benchmarks")

BASE_SLOTS = 16
BASE_CTX = 32768
SLOT_MARGIN = 64     # tokens of slack per slot beyond the request
THREADS = os.cpu_count() or 1
CANDIDATES: tuple[tuple[str, ...], ...] = (
    ("--repack", "-t", str(THREADS)),
    ("--no-repack", "-t", str(THREADS)),
    ("--repack", "-t", "1"),
)


@dataclass(frozen=True)
class SlotConfig:
    slots: int
    ctx: int


def slot_configs(workloads: list[Workload]) -> dict[SlotConfig, list[Workload]]:
    """The workloads by the llama-server configuration that serves them, fewest slots first."""
    by_slots: dict[int, list[Workload]] = {}
    for workload in workloads:
        if workload.srv_flags:   # srv's extra rows
            continue
        by_slots.setdefault(max(BASE_SLOTS, workload.concurrency), []).append(workload)
    return {SlotConfig(slots, max(BASE_CTX, slots * (max(w.context_tokens for w in group) + SLOT_MARGIN))): group
            for slots, group in sorted(by_slots.items())}


@dataclass
class LlamaEngine(Engine):
    build: LlamaBuild = field(default_factory=LlamaBuild)
    binary: Path | None = None
    flags: tuple[str, ...] = CANDIDATES[0]

    name = "llama.cpp"

    def command(self, flags: tuple[str, ...], slots: SlotConfig, port: str) -> list[str]:
        assert self.binary is not None
        return [str(self.binary), "-m", str(self.context.model.gguf), *flags, "-np", str(slots.slots),
                "-c", str(slots.ctx), "--host", "127.0.0.1", "--port", port]

    def server(self, flags: tuple[str, ...], slots: SlotConfig, tag: str) -> ServerProcess:
        port = free_port()
        return ServerProcess(self.name, self.command(flags, slots, str(port)), port,
                             self.context.log_dir / f"llama-{tag}.log")

    def describe_build(self) -> str:
        assert self.binary is not None
        done = subprocess.run([str(self.binary), "--version"], capture_output=True, text=True)
        version = next((line.split(":", 1)[1].strip() for line in (done.stdout + done.stderr).splitlines()
                        if line.startswith("version:")), "unknown version")
        return (f"llama.cpp {version}, vendored in llama-cpp-python {self.build.version}; "
                f"`cmake {' '.join(self.build.cmake_flags)}`")

    def check_flags(self) -> None:
        """Fail early, with the flag's name, when this llama.cpp version lacks one we pass."""
        assert self.binary is not None
        help_text = subprocess.run([str(self.binary), "--help"], capture_output=True, text=True).stdout
        used = {flag for candidate in CANDIDATES for flag in candidate if flag.startswith("-")}
        missing = sorted(flag for flag in used | {"-m", "-np", "-c", "--host", "--port"} if flag not in help_text)
        if missing:
            raise RuntimeError(f"llama-server {self.build.version} lacks {', '.join(missing)}")

    def prepare(self) -> None:
        self.binary = ensure_llama_server(self.build)
        self.check_flags()
        self.version = self.describe_build()
        [slots] = slot_configs([PROBE])
        for i, flags in enumerate(CANDIDATES):
            config = " ".join(flags)
            try:
                with self.server(flags, slots, f"probe{i}") as server:
                    server.launch_to_first_token()
                    command = load_command(server.base_url, PROBE, self.context.model.hf_dir, True)
                    result = run_load(command, f"{self.name} probe {config}")
                if result["failed"]:
                    raise ServerDied(f"{result['failed']} requests failed: {'; '.join(result['errors'])}")
                self.probes.append(Probe(self.name, config, result["output_throughput"]))
                logger.info("%s probe %s: %.1f output tok/s", self.name, config, result["output_throughput"])
            except RuntimeError as exc:   # ServerDied, or a load run that gave no result
                # The AMX kernels die of SIGILL when the build lost their tile-config stores.
                self.probes.append(Probe(self.name, config, None, str(exc).splitlines()[0]))
                logger.warning("%s probe %s failed: %s", self.name, config, str(exc).splitlines()[0])
        working = [p for p in self.probes if p.output_throughput is not None]
        if not working:
            raise RuntimeError("no llama-server configuration worked; see the probe log lines")
        best = max(working, key=lambda p: p.output_throughput or 0.0)
        self.flags = tuple(best.config.split())
        self.chosen = f"`{best.config}`, the fastest of the probed configurations"
        self.server_commands = [shell_line(self.command(self.flags, slots, "PORT"))
                                for slots in slot_configs(self.context.workloads)]

    def run_rep(self, rep: int) -> list[Run]:
        runs: list[Run] = []
        for i, (slots, workloads) in enumerate(slot_configs(self.context.workloads).items()):
            config = f"{' '.join(self.flags)} -np {slots.slots} -c {slots.ctx}"
            runs += measure_server(self, self.server(self.flags, slots, f"rep{rep}-np{slots.slots}"), workloads, rep,
                                   config, fresh_connections=True, with_launch=i == 0)
        return runs
