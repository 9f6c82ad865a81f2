"""`--forward-hooks`: torch forward hooks on the served model's modules, as SGLang specifies them.

The flag is a JSON list of specs, each with `target_modules` (glob patterns matched against the
names `model.named_modules()` gives) and `hook_factory` (an import path, `package.module:function`
or `package.module.function`), and optionally `name` (for the log) and `config` (a JSON object).
The factory is called once a spec with the config (an empty dict without one) and returns the
hook, `hook(module, inputs, output)`, which torch calls after each matched module's forward; a
hook that returns a value replaces the module's output.

A module with hooks runs its layers in Python: the native models' one-call C decode path, which
would skip them, is not taken while any module holds one (`srv.sdk.native.has_forward_hooks`).
"""

from __future__ import annotations

import fnmatch
import logging
from typing import TYPE_CHECKING, Any

from srv.sdk.registration import load_object

if TYPE_CHECKING:   # the flag is checked at launch, in the process that never imports torch
    from torch import nn

logger = logging.getLogger("srv.engine")


def check_forward_hooks(specs: Any) -> list[dict[str, Any]]:
    """The specs, checked for their shape (a ValueError names what is wrong)."""
    if not isinstance(specs, list):
        raise ValueError("--forward-hooks must be a JSON list of hook specs")
    for i, spec in enumerate(specs):
        if not isinstance(spec, dict):
            raise ValueError(f"--forward-hooks[{i}] must be a JSON object")
        unknown = set(spec) - {"name", "target_modules", "hook_factory", "config"}
        if unknown:
            raise ValueError(f"--forward-hooks[{i}]: unknown keys {sorted(unknown)}")
        patterns = spec.get("target_modules")
        if not isinstance(patterns, list) or not patterns or not all(isinstance(p, str) for p in patterns):
            raise ValueError(f"--forward-hooks[{i}]: target_modules must be a non-empty list of glob patterns")
        if not isinstance(spec.get("hook_factory"), str):
            raise ValueError(f"--forward-hooks[{i}]: hook_factory must be an import path (package.module:function)")
        if not isinstance(spec.get("config", {}), dict):
            raise ValueError(f"--forward-hooks[{i}]: config must be a JSON object")
    return specs


def factory_path(path: str) -> str:
    """`package.module:function` as given, or `package.module.function` split at its last dot."""
    if ":" in path:
        return path
    module, _, attribute = path.rpartition(".")
    return f"{module}:{attribute}"


def register_forward_hooks(model: "nn.Module", specs: Any) -> int:
    """Register every spec's hook on its modules; the number of hooks registered. A spec whose
    factory does not import or whose patterns match no module is a ValueError."""
    count = 0
    names = [name for name, _ in model.named_modules() if name]
    for i, spec in enumerate(check_forward_hooks(specs)):
        label = spec.get("name") or spec["hook_factory"]
        try:
            factory = load_object(factory_path(spec["hook_factory"]))
        except (ImportError, AttributeError, ValueError) as exc:
            raise ValueError(f"--forward-hooks {label}: hook_factory {spec['hook_factory']!r} does not import: "
                             f"{exc}") from None
        matched = [name for name in names if any(fnmatch.fnmatchcase(name, p) for p in spec["target_modules"])]
        if not matched:
            raise ValueError(f"--forward-hooks {label}: no module matches {spec['target_modules']} "
                             f"(module names look like {names[:3]})")
        hook = factory(dict(spec.get("config") or {}))
        for name in matched:
            model.get_submodule(name).register_forward_hook(hook)
        count += len(matched)
        logger.info("forward hook %s on %d modules (%s%s)", label, len(matched), ", ".join(matched[:3]),
                    ", ..." if len(matched) > 3 else "")
    return count
