"""What a plugin hands to `register(...)`, and the availability checks it can attach."""

from __future__ import annotations

import importlib
import importlib.util
from dataclasses import dataclass
from typing import Any, Callable


@dataclass(frozen=True)
class Availability:
    """Whether a backend can run on this machine, and if not, exactly what it needs."""

    ok: bool
    reason: str = ""

    @classmethod
    def yes(cls) -> "Availability":
        return cls(True)

    @classmethod
    def no(cls, reason: str) -> "Availability":
        return cls(False, reason)


AvailabilityCheck = Callable[[], Availability]


def always_available() -> Availability:
    return Availability.yes()


def requires_packages(*modules: str) -> AvailabilityCheck:
    """A check that passes when every named module can be imported."""

    def check() -> Availability:
        missing = [m for m in modules if importlib.util.find_spec(m) is None]
        if missing:
            return Availability.no("needs the Python package(s) " + ", ".join(missing) + " (not installed)")
        return Availability.yes()

    return check


def requires_cuda() -> Availability:
    import torch

    if not torch.cuda.is_available():
        return Availability.no("needs CUDA; torch sees no GPU")
    return Availability.yes()


def requires_cpu_flags(*flags: str) -> AvailabilityCheck:
    """A check that passes when the CPU has every named feature (as /proc/cpuinfo spells it)."""

    def check() -> Availability:
        try:
            with open("/proc/cpuinfo") as cpuinfo:
                present = next((set(line.split(":", 1)[1].split()) for line in cpuinfo if line.startswith("flags")),
                               set())
        except OSError:
            present = set()
        missing = [f for f in flags if f not in present]
        if missing:
            return Availability.no("needs a CPU with " + ", ".join(missing) + " (not in /proc/cpuinfo)")
        return Availability.yes()

    return check


def requires_c_compiler() -> Availability:
    """Passes when `srv.sdk.native` can compile C kernels."""
    from srv.sdk.native import compiler

    if compiler() is None:
        return Availability.no("needs a C compiler to build its kernels (set CC, or install cc, gcc or clang)")
    return Availability.yes()


def all_of(*checks: AvailabilityCheck) -> AvailabilityCheck:
    """A check that passes when every check passes; its reason joins the failing ones."""

    def check() -> Availability:
        reasons = [result.reason for result in (c() for c in checks) if not result.ok]
        return Availability.no("; ".join(reasons)) if reasons else Availability.yes()

    return check


def load_object(path: str) -> Any:
    """Import `"package.module:attribute"`."""
    module_name, _, attribute = path.partition(":")
    obj: Any = importlib.import_module(module_name)
    for part in filter(None, attribute.split(".")):
        obj = getattr(obj, part)
    return obj


@dataclass(frozen=True)
class Registration:
    """One backend of one family, as a plugin registered it.

    name: what users pass to the family's flag.
    factory: a callable building the backend, or an import path `"module:attribute"` to one,
        so that listing plugins never imports heavy kernels.
    description: one line shown by `srv plugins`.
    available: a check run when the backend is listed or chosen.
    priority: when a flag is left on `auto` (or unset), the available backend with the highest
        priority is chosen.
    plugin: the registering plugin's name; distribution: its distribution, filled in by srv.
    """

    family: str
    name: str
    factory: Callable[..., Any] | str
    description: str = ""
    available: AvailabilityCheck = always_available
    priority: int = 0
    plugin: str = ""
    distribution: str = ""

    def availability(self) -> Availability:
        try:
            return self.available()
        except Exception as exc:  # a broken check must not hide the other backends
            return Availability.no(f"availability check failed: {type(exc).__name__}: {exc}")

    def load_factory(self) -> Callable[..., Any]:
        return load_object(self.factory) if isinstance(self.factory, str) else self.factory

    def create(self, *args: Any, **kwargs: Any) -> Any:
        return self.load_factory()(*args, **kwargs)
