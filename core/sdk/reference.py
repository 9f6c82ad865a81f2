"""The SDK reference in docs/plugins.md, generated from the code (`make docs`; a test checks it)."""

from __future__ import annotations

import importlib
import inspect
import re

from srv.sdk import API_VERSION, hookspecs

MARKER = "<!-- Everything below is generated from the code by `make docs`. -->"
MODULES = ["srv.sdk.registration", "srv.sdk.attention", "srv.sdk.sampling", "srv.sdk.logit_processor",
           "srv.sdk.grammar", "srv.sdk.tools", "srv.sdk.reasoning", "srv.sdk.lora",
           "srv.sdk.cache", "srv.sdk.scheduling", "srv.sdk.models", "srv.sdk.parallel", "srv.sdk.layers",
           "srv.sdk.moe", "srv.sdk.linear", "srv.sdk.quantization",
           "srv.sdk.speculative", "srv.sdk.native", "srv.sdk.paths", "srv.sdk.testing"]


def _doc(obj: object) -> str:
    # The object's own docstring: inherited ones (object.__init__'s) would say nothing useful.
    own = obj.__doc__ if not isinstance(obj, property) else obj.fget.__doc__
    return inspect.cleandoc(own) if own else ""


def _signature(obj: object) -> str:
    try:
        text = str(inspect.signature(obj)).replace("'", "")
    except (TypeError, ValueError):
        return "(...)"
    # Defaults that are functions print with their address; the name is what a reader needs.
    return re.sub(r"<function (\w+) at 0x[0-9a-f]+>", r"\1", text)


def _public_members(cls: type) -> list[tuple[str, object]]:
    members = []
    for name, member in vars(cls).items():
        if name.startswith("_") and name != "__init__":
            continue
        if inspect.isfunction(member) or isinstance(member, property):
            members.append((name, member))
    return members


def _render_class(cls: type) -> list[str]:
    lines = [f"#### `{cls.__name__}`", ""]
    bases = [b.__name__ for b in cls.__bases__ if b is not object]
    if bases:
        lines += [f"Bases: {', '.join(f'`{b}`' for b in bases)}", ""]
    if _doc(cls):
        lines += [_doc(cls), ""]
    for name, member in _public_members(cls):
        if isinstance(member, property):
            lines.append(f"- `{name}` (property){': ' + _doc(member).splitlines()[0] if _doc(member) else ''}")
            continue
        abstract = " *(abstract: implement it)*" if getattr(member, "__isabstractmethod__", False) else ""
        first_line = _doc(member).splitlines()[0] if _doc(member) else ""
        lines.append(f"- `{name}{_signature(member)}`{abstract}{': ' + first_line if first_line else ''}")
    return lines + [""]


def render_reference() -> str:
    lines = [MARKER, "", "## Reference", "", f"SDK version: `{API_VERSION}`.", "", "### Hooks", ""]
    for family in hookspecs.FAMILIES:
        lines.append(f"- `{family.hook}(register)`: {family.description} ({', '.join(f'`{f}`' for f in family.flags)}). "
                     + _doc(getattr(hookspecs, family.hook)).split("\n\n")[-1].replace("\n", " "))
    for name in ("srv_add_launch_arguments", "srv_register_routes"):
        lines.append(f"- `{name}{_signature(getattr(hookspecs, name))}`: "
                     + " ".join(_doc(getattr(hookspecs, name)).split()))
    lines.append("")
    for module_name in MODULES:
        module = importlib.import_module(module_name)
        classes = [obj for _, obj in vars(module).items()
                   if inspect.isclass(obj) and obj.__module__.startswith(module_name) and not obj.__name__.startswith("_")]
        functions = [obj for name, obj in vars(module).items()
                     if inspect.isfunction(obj) and obj.__module__ == module_name and not name.startswith("_")]
        if not classes and not functions:
            continue
        lines += [f"### `{module_name}`", ""]
        if _doc(module):
            lines += [_doc(module), ""]
        for function in functions:
            first_line = _doc(function).splitlines()[0] if _doc(function) else ""
            lines.append(f"- `{function.__name__}{_signature(function)}`{': ' + first_line if first_line else ''}")
        if functions:
            lines.append("")
        for cls in classes:
            lines += _render_class(cls)
    return "\n".join(lines).rstrip() + "\n"


def update_plugins_doc(path: str) -> None:
    """Replace the generated part of docs/plugins.md (after MARKER) with a fresh one."""
    with open(path, encoding="utf-8") as f:
        guide = f.read().split(MARKER)[0]
    with open(path, "w", encoding="utf-8") as f:
        f.write(guide + render_reference())


if __name__ == "__main__":
    import sys

    update_plugins_doc(sys.argv[1])
