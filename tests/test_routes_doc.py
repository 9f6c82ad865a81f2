"""docs/routes.md names every route the server serves, each with its methods and an example."""

from __future__ import annotations

import re
from argparse import Namespace
from pathlib import Path

from srv.args.parser import build_launch_parser
from srv.plugin_manager import load_plugins
from srv.server.app import ServerContext, build_app
from srv.server.request_log import RequestLog

DOC = Path(__file__).parent.parent / "docs" / "routes.md"


def served_routes() -> set[tuple[str, str]]:
    manager, registry = load_plugins()
    args = build_launch_parser(manager, registry).parse_args(["--enable-metrics"])

    class Frontend:   # the app is only built here, never called
        tokenizer = None

    from srv.server.metrics import ServerMetrics

    context = ServerContext(Frontend(), args, "model", {}, RequestLog(args), metrics=ServerMetrics(args, "model"))
    app = build_app(context)
    return {(method, route.path.replace("{model:path}", "{model}")) for route in app.routes
            for method in (route.methods or ()) if method != "HEAD"}


def test_every_route_is_documented_with_an_example():
    text = DOC.read_text()
    documented = set()
    for line in text.splitlines():
        cells = [cell.strip() for cell in line.split("|")]
        if len(cells) < 4 or not cells[1].startswith("`"):
            continue
        assert "curl" in cells[2], f"no example request for {cells[1]}"
        for methods, path in re.findall(r"`((?:GET|POST|PUT|DELETE)(?:, (?:GET|POST|PUT|DELETE))*) (/[^`]*)`", cells[1]):
            for method in methods.split(", "):
                documented.add((method, path))
        for also in re.findall(r"also `(\w+)`", cells[1]):
            for path in re.findall(r"`(?:GET|POST|PUT|DELETE) (/[^`]*)`", cells[1]):
                documented.add((also, path))
    missing = served_routes() - documented
    assert not missing, f"docs/routes.md does not show {sorted(missing)}"
