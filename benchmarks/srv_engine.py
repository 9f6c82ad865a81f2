"""srv itself: `srv launch` on the default model with no flag but the address, what a user runs
(it serves the GGUF file's own 4-bit weights, as llama-server does)."""

from __future__ import annotations

import importlib.metadata
import logging
import re
from dataclasses import dataclass, field
from pathlib import Path

from benchmarks.engine import Engine, measure_server, shell_line
from benchmarks.load import SRV
from benchmarks.lora import make_adapters
from benchmarks.results import Run
from benchmarks.servers import ServerProcess, free_port

logger = logging.getLogger("benchmarks")


@dataclass
class SrvEngine(Engine):
    name = "srv"
    adapters: list[Path] = field(default_factory=list)   # the LoRA workloads' (made in prepare)

    def server(self, tag: str, *flags: str) -> ServerProcess:
        port = free_port()
        # Python's bytecode cache is warm for a user (the first run of an install writes it), and
        # the peers' Python (HF) reads theirs from site-packages: an environment that forbids
        # writing it (PYTHONDONTWRITEBYTECODE) would make every srv launch compile srv again.
        return ServerProcess(self.name, self.command(str(port)) + list(flags), port,
                             self.context.log_dir / f"srv-{tag}.log", env={"PYTHONDONTWRITEBYTECODE": ""})

    @staticmethod
    def command(port: str) -> list[str]:
        return [SRV, "launch", "--host", "127.0.0.1", "--port", port]

    def prepare(self) -> None:
        self.version = f"srv {importlib.metadata.version('srv')}, this checkout"
        self.chosen = "no flags: srv's defaults (the file's own Q4_1/Q8_0 weights, `--dtype auto`)"
        adapters = max((w.lora_adapters for w in self.context.workloads), default=0)
        self.adapters = make_adapters(self.context.model.hf_dir, self.adapter_folder, adapters)
        self.server_commands = [shell_line(self.command("PORT") + list(flags)) for flags in self.flag_sets()]
        # A first launch fills what a warm start reuses (the dequantized GGUF, the page cache, the
        # bytecode).
        with self.server("prime") as server:
            logger.info("srv: priming launch")
            server.launch_to_first_token()

    def flags(self, workload) -> tuple[str, ...]:
        """The flags of the server a workload runs on: its own, and its adapters'."""
        adapters = self.adapters[:workload.lora_adapters]
        return workload.srv_flags + (("--lora-paths", *(f"{p.name}={p}" for p in adapters)) if adapters else ())

    @property
    def adapter_folder(self) -> Path:
        return self.context.log_dir / "lora-adapters"

    def config(self, flags: tuple[str, ...]) -> str:
        """The flags as the runs table shows them: adapters by name alone (the server commands
        give their folders)."""
        return re.sub(rf"(\S+)={re.escape(str(self.adapter_folder))}/\S+", r"\1", " ".join(flags))

    def flag_sets(self) -> list[tuple[str, ...]]:
        """The servers a repetition launches: the default (no flags) first, then each workload's
        own flags, in order."""
        return list(dict.fromkeys([(), *(self.flags(w) for w in self.context.workloads)]))

    def run_rep(self, rep: int) -> list[Run]:
        runs = []
        for index, flags in enumerate(self.flag_sets()):
            group = [w for w in self.context.workloads if self.flags(w) == flags]
            # W4 (launch to first token) is the default server's.
            runs += measure_server(self, self.server(f"rep{rep}-{index}", *flags), group, rep, self.config(flags),
                                   fresh_connections=False, with_launch=not flags)
        return runs
