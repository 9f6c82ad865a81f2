"""The public SDK of srv: everything a plugin may import.

A plugin imports from `srv.sdk` and nothing else of srv. Hook specs are in `hookspecs`,
the data a plugin registers in `registration`.
"""

from srv.sdk.hookspecs import FAMILIES, Family, hookimpl
from srv.sdk.registration import (
    Availability,
    Registration,
    all_of,
    always_available,
    requires_cuda,
    requires_packages,
)

API_VERSION = "0.1"

__all__ = [
    "API_VERSION",
    "FAMILIES",
    "Availability",
    "Family",
    "Registration",
    "all_of",
    "always_available",
    "hookimpl",
    "requires_cuda",
    "requires_packages",
]
