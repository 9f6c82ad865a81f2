"""llama.cpp's `llama-server`, built once from the sources vendored in the llama-cpp-python sdist
and cached outside the repository, so that later runs start at once.

The build lives where it was made (CMake bakes the absolute path of its shared libraries into
the binary), and a stamp file written last marks it complete: an interrupted build is redone.
"""

from __future__ import annotations

import json
import logging
import shutil
import subprocess
import sys
import tarfile
from dataclasses import dataclass, field
from pathlib import Path

logger = logging.getLogger("benchmarks")

STAMP = "srv-bench-build.json"


@dataclass(frozen=True)
class LlamaBuild:
    version: str = "0.3.36"
    # GGML_NATIVE targets this CPU. -fno-dse: GCC 12's dead-store elimination drops the AMX
    # tile-config stores of the int8 kernels used for Q4_1, which then die of SIGILL.
    cmake_flags: tuple[str, ...] = ("-DGGML_NATIVE=ON", "-DLLAMA_CURL=OFF", "-DCMAKE_C_FLAGS=-fno-dse",
                                    "-DCMAKE_CXX_FLAGS=-fno-dse", "-DCMAKE_BUILD_TYPE=Release")
    jobs: int = 2
    cache_root: Path = field(default_factory=lambda: Path.home() / ".cache" / "srv" / "bench")

    @property
    def root(self) -> Path:
        return self.cache_root / f"llama.cpp-{self.version}"

    @property
    def source(self) -> Path:
        return self.root / f"llama_cpp_python-{self.version}" / "vendor" / "llama.cpp"

    @property
    def binary(self) -> Path:
        return self.source / "build" / "bin" / "llama-server"

    def recipe(self) -> dict[str, object]:
        return {"version": self.version, "cmake_flags": list(self.cmake_flags)}

    def is_built(self) -> bool:
        try:
            stamp = json.loads((self.root / STAMP).read_text())
        except (OSError, ValueError):
            return False
        return stamp == self.recipe() and self.binary.is_file()


def _run(command: list[str], cwd: Path, what: str) -> None:
    """Run a build step, logging its percentage lines so a long build shows it is alive."""
    logger.info("llama.cpp: %s: %s", what, " ".join(command))
    process = subprocess.Popen(command, cwd=cwd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    tail: list[str] = []
    assert process.stdout is not None
    for line in process.stdout:
        line = line.rstrip()
        tail = (tail + [line])[-30:]
        if line.startswith("[") and "%]" in line:
            logger.info("llama.cpp: %s", line)
    if process.wait() != 0:
        raise RuntimeError(f"llama.cpp {what} failed (exit {process.returncode}):\n" + "\n".join(tail))


def ensure_llama_server(build: LlamaBuild) -> Path:
    """The path of a working llama-server binary, building it first when the cache lacks it."""
    if build.is_built():
        logger.info("llama.cpp: cached llama-server %s", build.binary)
        return build.binary
    shutil.rmtree(build.root, ignore_errors=True)
    build.root.mkdir(parents=True)
    _run([sys.executable, "-m", "pip", "download", "--quiet", "--no-deps", "--no-binary", ":all:",
          f"llama-cpp-python=={build.version}", "-d", str(build.root)], build.root, "download the sdist")
    [archive] = build.root.glob("llama_cpp_python-*.tar.gz")
    logger.info("llama.cpp: unpacking %s", archive.name)
    with tarfile.open(archive) as tar:
        tar.extractall(build.root, filter="data")
    archive.unlink()
    _run(["cmake", "-B", "build", *build.cmake_flags], build.source, "configure")
    _run(["cmake", "--build", "build", f"-j{build.jobs}", "--target", "llama-server"], build.source, "build")
    if not build.binary.is_file():
        raise RuntimeError(f"the llama.cpp build ended without {build.binary}")
    (build.root / STAMP).write_text(json.dumps(build.recipe(), indent=2) + "\n")
    logger.info("llama.cpp: built %s", build.binary)
    return build.binary
