"""Every backend the loaded plugins registered, by family, and the rules for choosing one."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Iterable

from srv.sdk.hookspecs import FAMILIES, FAMILIES_BY_NAME
from srv.sdk.registration import Registration

AUTO = "auto"
NONE = "none"   # for families a flag may leave without a backend (--quantization none)


@dataclass(frozen=True)
class PluginFailure:
    """A plugin that could not be loaded or failed while registering its backends."""

    plugin: str
    distribution: str
    error: str

    def describe(self) -> str:
        return f"plugin {self.plugin!r} from distribution {self.distribution!r} failed: {self.error}"


class BackendError(Exception):
    """A backend choice that cannot be honoured; the message says why and what would work."""


class RegistryConflict(BackendError):
    pass


class UnknownBackend(BackendError):
    pass


class BackendUnavailable(BackendError):
    pass


def _failure_note(failures: Iterable[PluginFailure]) -> str:
    lines = [f.describe() for f in failures]
    return ("\n  " + "\n  ".join(lines)) if lines else ""


class BackendRegistry:
    def __init__(self, failures: Iterable[PluginFailure] = ()) -> None:
        self._backends: dict[str, dict[str, Registration]] = {f.name: {} for f in FAMILIES}
        self.failures: list[PluginFailure] = list(failures)

    def add(self, registration: Registration) -> None:
        family = self._backends[registration.family]
        existing = family.get(registration.name)
        if existing is not None:
            raise RegistryConflict(
                f"{registration.family} backend {registration.name!r} is registered twice: by "
                f"distribution {existing.distribution!r} (plugin {existing.plugin!r}) and by "
                f"distribution {registration.distribution!r} (plugin {registration.plugin!r})"
            )
        family[registration.name] = registration

    def names(self, family: str) -> list[str]:
        return sorted(self._backends[family])

    def registrations(self, family: str) -> list[Registration]:
        return [self._backends[family][name] for name in self.names(family)]

    def get(self, family: str, name: str) -> Registration:
        try:
            return self._backends[family][name]
        except KeyError:
            installed = ", ".join(self.names(family)) or "none"
            raise UnknownBackend(
                f"unknown {family} backend {name!r} ({FAMILIES_BY_NAME[family].description}); "
                f"installed: {installed}{_failure_note(self.failures)}"
            ) from None

    def choose_default(self, family: str, name: str, default: str) -> Registration:
        """`choose`, except that a flag's documented default (SGLang's, which may be a GPU kernel)
        that is unavailable here gives the best available backend. The launch check refuses the
        same name where the command line gives it."""
        registration = self._backends.get(family, {}).get(name)
        if name == default and (registration is None or not registration.availability().ok):
            return self.choose(family, AUTO)
        return self.choose(family, name)

    def choose(self, family: str, name: str | None) -> Registration:
        """The backend to use for `name`, or the best available one for None / "auto"."""
        if name is None or name == AUTO:
            candidates = sorted(self.registrations(family), key=lambda r: -r.priority)
            for registration in candidates:
                if registration.availability().ok:
                    return registration
            reasons = "; ".join(f"{r.name}: {r.availability().reason}" for r in candidates) or "none installed"
            raise BackendUnavailable(f"no available {family} backend ({reasons}){_failure_note(self.failures)}")
        registration = self.get(family, name)
        availability = registration.availability()
        if not availability.ok:
            usable = [r.name for r in self.registrations(family) if r.availability().ok]
            raise BackendUnavailable(
                f"{name}: {availability.reason} (available {family} backends: {', '.join(usable) or 'none'})"
            )
        return registration
