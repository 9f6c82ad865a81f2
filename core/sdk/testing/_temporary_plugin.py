"""The plugin behind `srv.sdk.testing.registered_temporarily`: one registration hook per
family, registering whatever that context manager currently holds."""

from __future__ import annotations

from srv.sdk import hookimpl
from srv.sdk.hookspecs import FAMILIES, Family
from srv.sdk.testing.registry import TEMPORARY


def _hook(family: Family):
    def register_backends(register):
        for name, factory in TEMPORARY.get(family.name, {}).items():
            register(name, factory, description="registered for a test by srv.sdk.testing")

    register_backends.__name__ = family.hook
    return hookimpl(register_backends)


for _family in FAMILIES:
    globals()[_family.hook] = _hook(_family)
