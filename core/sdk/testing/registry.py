"""How a kit finds the backend it tests: through the installed plugins, exactly as `srv launch`.

`registration` is the one place the SDK reaches into srv's core: it imports
`srv.plugin_manager.load_plugins` lazily, inside the function, because a kit must find an
installed backend by the same entry points, allow/block lists and registry `srv launch` uses.

`registered_temporarily` makes a factory an installed backend for the engines started inside
a `with` block (a throw-away distribution on sys.path whose entry point is
`srv.sdk.testing._temporary_plugin`), so a backend can go through `srv.Engine` before its
package is installed. It is honoured unless SRV_PLUGINS / SRV_BLOCK_PLUGINS exclude
"srv-sdk-testing".
"""

from __future__ import annotations

import importlib
import shutil
import sys
import tempfile
from contextlib import contextmanager
from pathlib import Path
from typing import Any, Callable, Iterator

import pytest

from srv.sdk.registration import Registration

#: family -> name -> factory of the backends `registered_temporarily` currently provides.
TEMPORARY: dict[str, dict[str, Any]] = {}

DISTRIBUTION = "srv-sdk-testing"


def registration(family: str, name: str) -> Registration:
    """The installed backend `name` of `family`; skips the test if it is unavailable here."""
    from srv.plugin_manager import load_plugins  # the SDK's one reach into the core (see above)

    registration = load_plugins()[1].get(family, name)  # unknown names: says what is installed
    availability = registration.availability()
    if not availability.ok:
        pytest.skip(f"{family} backend {name!r} is not available here: {availability.reason}")
    return registration


def create(kit: object, family: str, name_attr: str, factory_attr: str, *args: Any) -> Any:
    """Build the backend a kit names: `factory_attr` if the kit sets it, else the registered
    backend called `name_attr`, with the factory arguments of its family."""
    factory = getattr(type(kit), factory_attr, None)
    if factory is not None:
        return factory(*args)
    name = getattr(type(kit), name_attr, None)
    if name is None:
        raise TypeError(f"{type(kit).__name__}: set {name_attr} (a registered name) or {factory_attr}")
    return registration(family, name).create(*args)


@contextmanager
def registered_temporarily(family: str, name: str, factory: Callable[..., Any]) -> Iterator[str]:
    """Within the block, `factory` is the installed `family` backend `name` (yields `name`)."""
    if name in TEMPORARY.get(family, {}):
        raise ValueError(f"{family} backend {name!r} is already registered temporarily")
    site = Path(tempfile.mkdtemp(prefix="srv-sdk-testing-"))
    info = site / "srv_sdk_testing-0.dist-info"
    info.mkdir()
    (info / "METADATA").write_text(f"Metadata-Version: 2.1\nName: {DISTRIBUTION}\nVersion: 0\n")
    (info / "entry_points.txt").write_text(f"[srv]\n{DISTRIBUTION} = srv.sdk.testing._temporary_plugin\n")
    TEMPORARY.setdefault(family, {})[name] = factory
    sys.path.insert(0, str(site))
    importlib.invalidate_caches()
    try:
        yield name
    finally:
        sys.path.remove(str(site))
        importlib.invalidate_caches()
        del TEMPORARY[family][name]
        shutil.rmtree(site, ignore_errors=True)
