"""Loading plugins from the `srv` entry-point group and asking them for their backends.

Built-in plugins are entry points of the srv distribution itself, so they load exactly like a
third-party package's. Two environment variables choose what loads, matched against entry-point
or distribution names:

    SRV_PLUGINS=a,b        load only these (an empty value loads none)
    SRV_BLOCK_PLUGINS=c,d  never load these
"""

from __future__ import annotations

import os
import traceback
from dataclasses import dataclass, field, replace
from importlib.metadata import EntryPoint, entry_points
from typing import Any

import pluggy
from packaging.specifiers import InvalidSpecifier, SpecifierSet

from srv.backend_registry import BackendRegistry, PluginFailure
from srv.sdk import API_VERSION, hookspecs
from srv.sdk.registration import Registration

ENTRY_POINT_GROUP = "srv"
ALLOW_ENV = "SRV_PLUGINS"
BLOCK_ENV = "SRV_BLOCK_PLUGINS"


def _normalize(name: str) -> str:
    return name.strip().lower().replace("_", "-")


def _names_from_env(variable: str) -> set[str] | None:
    value = os.environ.get(variable)
    if value is None:
        return None
    return {_normalize(n) for n in value.split(",") if n.strip()}


@dataclass
class PluginInfo:
    name: str
    distribution: str
    version: str
    hooks: list[str] = field(default_factory=list)


class PluginManager:
    def __init__(self) -> None:
        self._pm = pluggy.PluginManager(hookspecs.PROJECT_NAME)
        self._pm.add_hookspecs(hookspecs)
        self._origin: dict[str, tuple[str, str]] = {}
        self.failures: list[PluginFailure] = []

    @property
    def hook(self) -> Any:
        return self._pm.hook

    def register(self, plugin: object, name: str, distribution: str = "", version: str = "") -> None:
        self._pm.register(plugin, name=name)
        self._origin[name] = (distribution or name, version)

    def load_entry_points(self) -> None:
        allowed = _names_from_env(ALLOW_ENV)
        blocked = _names_from_env(BLOCK_ENV) or set()
        for ep in entry_points(group=ENTRY_POINT_GROUP):
            distribution = ep.dist.name if ep.dist else ""
            version = ep.dist.version if ep.dist else ""
            names = {_normalize(ep.name), _normalize(distribution)}
            if names & blocked or (allowed is not None and not names & allowed):
                continue
            if self._pm.get_plugin(ep.name) is not None:
                continue
            self._load(ep, distribution, version)

    def _load(self, ep: EntryPoint, distribution: str, version: str) -> None:
        try:
            module = ep.load()
        except Exception as exc:
            self.failures.append(PluginFailure(ep.name, distribution, _describe(exc)))
            return
        mismatch = sdk_mismatch(module)
        if mismatch:
            self.failures.append(PluginFailure(ep.name, distribution, mismatch))
            return
        self.register(module, ep.name, distribution, version)

    def plugins(self) -> list[PluginInfo]:
        infos = []
        for name, plugin in self._pm.list_name_plugin():
            distribution, version = self._origin.get(name, (name, ""))
            hooks = sorted(impl.name for impl in self._pm.get_hookcallers(plugin) or [])
            infos.append(PluginInfo(name, distribution, version, hooks))
        return sorted(infos, key=lambda p: (p.distribution, p.name))

    def build_registry(self) -> BackendRegistry:
        """Ask every plugin for its backends, one plugin at a time so each is attributed."""
        registry = BackendRegistry(self.failures)
        for family in hookspecs.FAMILIES:
            caller = getattr(self._pm.hook, family.hook)
            for impl in caller.get_hookimpls():
                distribution, _ = self._origin.get(impl.plugin_name, (impl.plugin_name, ""))
                collected: list[Registration] = []
                try:
                    impl.function(register=_collector(family.name, collected))
                except Exception as exc:
                    registry.failures.append(PluginFailure(impl.plugin_name, distribution, _describe(exc)))
                    continue
                for registration in collected:
                    registry.add(_attributed(registration, impl.plugin_name, distribution))
        return registry

    def routes(self) -> list[tuple[str, Any, list[str]]]:
        """(path, endpoint, methods) of every route plugins add through `srv_register_routes`."""
        collected: list[tuple[str, Any, list[str]]] = []

        def register(path: str, endpoint: Any, methods: list[str] | None = None) -> None:
            collected.append((path, endpoint, list(methods or ["GET"])))

        self._pm.hook.srv_register_routes(register=register)
        return collected

    def add_launch_arguments(self, parser: Any) -> None:
        for impl in self._pm.hook.srv_add_launch_arguments.get_hookimpls():
            distribution, _ = self._origin.get(impl.plugin_name, (impl.plugin_name, ""))
            impl.function(parser=parser.add_argument_group(f"plugin {impl.plugin_name} ({distribution})"))


def _collector(family: str, collected: list[Registration]) -> hookspecs.Register:
    def register(name: str, factory: Any, **details: Any) -> None:
        collected.append(Registration(family, name, factory, **details))

    return register


def _attributed(registration: Registration, plugin: str, distribution: str) -> Registration:
    return replace(registration, plugin=plugin, distribution=distribution)


def sdk_mismatch(module: object) -> str | None:
    """Why a plugin's declared `SRV_SDK_VERSION` range excludes this srv's SDK, if it does."""
    wanted = getattr(module, "SRV_SDK_VERSION", None)
    if wanted is None:
        return None
    try:
        specifier = SpecifierSet(wanted)
    except InvalidSpecifier:
        return f"SRV_SDK_VERSION {wanted!r} is not a version range such as '>=0.1,<0.2'"
    if API_VERSION in specifier:
        return None
    return f"needs srv SDK {wanted}, but this srv provides SDK {API_VERSION}"


def _describe(exc: BaseException) -> str:
    where = traceback.extract_tb(exc.__traceback__)[-1] if exc.__traceback__ else None
    location = f" (at {where.filename}:{where.lineno})" if where else ""
    return f"{type(exc).__name__}: {exc}{location}"


def load_plugins() -> tuple[PluginManager, BackendRegistry]:
    """The plugin manager with every allowed entry point loaded, and the registry they fill."""
    manager = PluginManager()
    manager.load_entry_points()
    return manager, manager.build_registry()
