"""The public SDK of srv: everything a plugin may import.

A plugin imports from `srv.sdk` and nothing else of srv. Hook specs are in `hookspecs`,
the data a plugin registers in `registration`, the base classes of each family in `attention`,
`sampling`, `grammar`, `tools`, `cache`, `scheduling`, `models`, `linear`, `quantization`,
`speculative` and `moe` (expert runners and token exchanges), the layers split across ranks in
`parallel` and `layers`, dense layers on oneDNN and srv's row-major decode kernel in `packed_linear`, C
kernels built on first use in `native`, the cache directory in `paths`, the memory available in
`system`, and the conformance kits in `testing`.

A plugin module states the SDK versions it works with as a version range, for example
`SRV_SDK_VERSION = ">=0.1,<0.2"`; srv refuses to load it (and says why) when `API_VERSION`
falls outside. The minor version grows with additions, the major with breaking changes.
"""

from srv.sdk.hookspecs import FAMILIES, Family, hookimpl
from srv.sdk.registration import (
    Availability,
    Registration,
    all_of,
    always_available,
    requires_c_compiler,
    requires_cpu_flags,
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
    "requires_c_compiler",
    "requires_cpu_flags",
    "requires_cuda",
    "requires_packages",
]
