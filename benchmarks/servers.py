"""A benchmarked server process: started in its own session, timed from launch to its first
streamed token (W4), stopped with its children.

The first-token poll sends a one-token streamed completion again and again until one answers:
a refused connection or a 503 (llama-server loading its model) means "not yet".
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import signal
import socket
import subprocess
import time
from dataclasses import dataclass, field
from pathlib import Path

import httpx

logger = logging.getLogger("benchmarks")

POLL_INTERVAL_S = 0.05
NOT_YET = (httpx.ConnectError, httpx.RemoteProtocolError, httpx.ReadError, httpx.ConnectTimeout)


def free_port() -> int:
    """A port nobody listens on now: the machine is shared, 30000 may be taken."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


class ServerDied(RuntimeError):
    pass


@dataclass
class ServerProcess:
    name: str
    command: list[str]
    port: int
    log_path: Path
    env: dict[str, str] = field(default_factory=dict)
    process: subprocess.Popen | None = None

    @property
    def base_url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def launch_to_first_token(self, timeout_s: float = 600.0) -> float:
        """Start the server and return the seconds until the first token of a first request."""
        self.log_path.parent.mkdir(parents=True, exist_ok=True)
        logger.info("%s: starting: %s", self.name, " ".join(self.command))
        start = time.perf_counter()
        with open(self.log_path, "w") as log:   # the child keeps its own copy of the descriptor
            # A new session: stop() signals the server and the workers it spawns, nothing else.
            self.process = subprocess.Popen(self.command, stdout=log, stderr=subprocess.STDOUT,
                                            start_new_session=True, env={**os.environ, **self.env})
        elapsed = self._first_token(start, timeout_s)
        logger.info("%s: first token %.2fs after launch (pid %d)", self.name, elapsed, self.process.pid)
        return elapsed

    def _first_token(self, start: float, timeout_s: float) -> float:
        body = {"prompt": "Hello", "max_tokens": 1, "temperature": 0.0, "stream": True}
        with httpx.Client(timeout=httpx.Timeout(timeout_s, connect=1.0)) as client:
            while time.perf_counter() - start < timeout_s:
                if self.process is not None and self.process.poll() is not None:
                    raise ServerDied(f"{self.name} exited with {self.process.returncode} while starting; "
                                     f"log: {self.log_path}\n{self.log_tail()}")
                try:
                    with client.stream("POST", self.base_url + "/v1/completions", json=body) as response:
                        if response.status_code == 200:
                            for line in response.iter_lines():
                                if line.startswith("data:") and line[5:].strip() != "[DONE]" \
                                        and json.loads(line[5:]).get("choices"):
                                    return time.perf_counter() - start
                        elif response.status_code != 503:
                            raise ServerDied(f"{self.name} answered HTTP {response.status_code}: "
                                             f"{response.read().decode(errors='replace')[:300]}")
                except NOT_YET:
                    pass
                time.sleep(POLL_INTERVAL_S)
        raise ServerDied(f"{self.name} gave no token within {timeout_s:.0f}s; log: {self.log_path}")

    def log_tail(self, lines: int = 20) -> str:
        try:
            return "\n".join(self.log_path.read_text(errors="replace").splitlines()[-lines:])
        except OSError:
            return ""

    def stop(self, grace_s: float = 30.0) -> None:
        if self.process is None or self.process.poll() is not None:
            return
        pgid = os.getpgid(self.process.pid)
        os.killpg(pgid, signal.SIGTERM)
        try:
            self.process.wait(grace_s)
        except subprocess.TimeoutExpired:
            logger.warning("%s: no exit %.0fs after SIGTERM; killing it", self.name, grace_s)
        # Whatever it spawned and left behind goes too (the group is ours alone).
        with contextlib.suppress(ProcessLookupError):
            os.killpg(pgid, signal.SIGKILL)
        self.process.wait()
        logger.info("%s: stopped", self.name)

    def __enter__(self) -> ServerProcess:
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()
