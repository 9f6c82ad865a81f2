"""docs/server_arguments.md, generated from the flag table (`make docs`; a test checks it)."""

from __future__ import annotations

import json
from typing import Any

from srv.args.flags import FlagSpec, load_flag_specs, sections
from srv.args.unsupported import NOT_SUPPORTED_YET


def _default(spec: FlagSpec) -> str:
    if spec.default is None:
        return ""
    return f"`{json.dumps(spec.default) if not isinstance(spec.default, str) else spec.default}`"


def _values(spec: FlagSpec) -> str:
    if spec.family:
        auto = "`auto` or " if spec.auto else ""
        return f"{auto}a `{spec.family}` backend (`srv plugins`)"
    if spec.choices:
        return ", ".join(f"`{c}`" for c in spec.choices)
    kind: dict[str, Any] = {"bool": "switch", "json": "JSON"}
    text = kind.get(spec.type, spec.type)
    return f"{text} list" if spec.nargs else text


def render_markdown() -> str:
    specs = load_flag_specs()
    lines = [
        "# Server arguments",
        "",
        "Generated from `core/args/server_arguments.yaml` by `make docs`; do not edit by hand.",
        "",
        "`srv launch` accepts every flag below. Options can also come from `--config FILE.yaml`",
        "(keys with dashes or underscores); flags on the command line override the file.",
        "A flag marked *not supported yet* is accepted, and launch fails naming it when it is set",
        "to anything but its default. The names a backend flag accepts come from the installed",
        "plugins: `srv plugins` lists them.",
        "",
    ]
    for section in sections():
        lines += [f"## {section}", "", "| flag | values | default | description |", "| --- | --- | --- | --- |"]
        for spec in (s for s in specs if s.section == section):
            names = ", ".join(f"`{n}`" for n in spec.names)
            status = " *Not supported yet.*" if spec.name in NOT_SUPPORTED_YET else ""
            status += " *Added by srv.*" if spec.srv else ""
            description = spec.help.replace("|", "\\|") + status
            lines.append(f"| {names} | {_values(spec)} | {_default(spec)} | {description} |")
        lines.append("")
    return "\n".join(lines)


if __name__ == "__main__":
    print(render_markdown(), end="")
