"""`srv plugins [--json]`: every plugin distribution, its hooks, and every backend by family."""

from __future__ import annotations

import argparse
import json
import sys
from typing import Any

from srv.backend_registry import BackendRegistry, RegistryConflict
from srv.plugin_manager import PluginManager, load_plugins
from srv.sdk.hookspecs import FAMILIES


def describe(manager: PluginManager, registry: BackendRegistry) -> dict[str, Any]:
    backends = {}
    for family in FAMILIES:
        rows = []
        for registration in registry.registrations(family.name):
            availability = registration.availability()
            rows.append({
                "name": registration.name,
                "description": registration.description,
                "available": availability.ok,
                "reason": availability.reason,
                "priority": registration.priority,
                "plugin": registration.plugin,
                "distribution": registration.distribution,
            })
        backends[family.name] = rows
    return {
        "plugins": [vars(p) for p in manager.plugins()],
        "failures": [vars(f) for f in registry.failures],
        "backends": backends,
    }


def render_text(report: dict[str, Any]) -> str:
    lines = ["Plugins:"]
    for plugin in report["plugins"]:
        lines.append(f"  {plugin['distribution']} {plugin['version']}  [{plugin['name']}]  hooks: "
                     + (", ".join(plugin["hooks"]) or "none"))
    if report["failures"]:
        lines.append("Failed to load:")
        lines += [f"  {f['distribution']} [{f['plugin']}]: {f['error']}" for f in report["failures"]]
    lines.append("Backends:")
    for family in FAMILIES:
        rows = report["backends"][family.name]
        lines.append(f"  {family.name} ({family.description}; {', '.join(family.flags)})")
        if not rows:
            lines.append("    (none installed)")
        width = max((len(r["name"]) for r in rows), default=0)
        for row in rows:
            state = "available" if row["available"] else f"unavailable: {row['reason']}"
            lines.append(f"    {row['name']:<{width}}  {state}  ({row['distribution']})  {row['description']}")
    return "\n".join(lines)


def main(argv: list[str]) -> int:
    if argv[:1] == ["new"]:
        from srv.cli.new_plugin import main as new_plugin

        return new_plugin(argv[1:])
    parser = argparse.ArgumentParser(prog="srv plugins", description="List plugins and their backends.",
                                     epilog="srv plugins new FAMILY NAME writes a new plugin package.")
    parser.add_argument("--json", action="store_true", help="print JSON instead of text")
    args = parser.parse_args(argv)
    try:
        manager, registry = load_plugins()
    except RegistryConflict as exc:
        print(f"srv plugins: error: {exc}", file=sys.stderr)
        return 1
    report = describe(manager, registry)
    print(json.dumps(report, indent=2) if args.json else render_text(report))
    return 0
