"""What one `make bench` run measured, as dataclasses that round-trip through results.json."""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

LAUNCH = "launch"   # the workload name of W4, launch to first token

# The keys kept from `srv bench serve --json` (the HF peer reports the same ones).
SERVE_METRICS = ("completed", "failed", "duration_s", "output_tokens", "output_throughput",
                 "ttft_median_s", "tpot_median_s", "itl_median_s")


@dataclass
class Run:
    """One measurement: an engine, a repetition, a workload (or LAUNCH) and its numbers."""

    engine: str
    rep: int
    workload: str
    metrics: dict[str, float]
    config: str = ""        # the engine configuration that served it, e.g. llama-server's slots


@dataclass
class Probe:
    """One candidate configuration of a peer, measured once to pick the fastest."""

    engine: str
    config: str
    output_throughput: float | None      # None: it did not work
    error: str = ""


@dataclass
class Commands:
    """The exact command lines, for the report: servers, load generator runs, the HF script."""

    servers: dict[str, list[str]] = field(default_factory=dict)   # engine -> server command lines
    loads: dict[str, list[str]] = field(default_factory=dict)     # engine -> `srv bench serve` lines


@dataclass
class BenchResults:
    repeats: int
    quick: bool
    machine: dict[str, Any]
    limits: dict[str, Any]
    engines: list[str]
    versions: dict[str, str] = field(default_factory=dict)  # engine -> its version and build, in words
    chosen: dict[str, str] = field(default_factory=dict)    # engine -> the configuration measured
    probes: list[Probe] = field(default_factory=list)
    runs: list[Run] = field(default_factory=list)
    commands: Commands = field(default_factory=Commands)
    errors: list[str] = field(default_factory=list)    # what failed, for the report's header
    duration_s: float = 0.0

    def save(self, path: Path) -> None:
        path.write_text(json.dumps(asdict(self), indent=2) + "\n", encoding="utf-8")

    @classmethod
    def load(cls, path: Path) -> BenchResults:
        data = json.loads(path.read_text(encoding="utf-8"))
        data["probes"] = [Probe(**p) for p in data["probes"]]
        data["runs"] = [Run(**r) for r in data["runs"]]
        data["commands"] = Commands(**data["commands"])
        return cls(**data)


def serve_metrics(result: dict[str, Any]) -> dict[str, float]:
    return {key: result[key] for key in SERVE_METRICS}
