"""`srv plugins new <family> <name> [--dir D]`: write a plugin package that installs with pip,
registers a working backend, and tests it with srv's conformance kit."""

from __future__ import annotations

import argparse
import keyword
import re
from pathlib import Path
from string import Template

from srv.sdk import API_VERSION
from srv.sdk.hookspecs import FAMILIES_BY_NAME

TEMPLATES = Path(__file__).with_name("templates")
# Families with a template: the conformance kit each package's tests use, and what it is.
KITS = {
    "attention": ("AttentionBackendKit", "An attention backend"),
    "eviction_policy": ("EvictionPolicyKit", "A prefix-cache eviction policy"),
    "hicache_storage": ("HiCacheStorageKit", "A hierarchical-cache storage backend"),
    "lora_backend": ("LoRABackendKit", "A multi-LoRA kernel"),
    "moe_runner": ("MoERunnerKit", "A MoE expert runner"),
    "schedule_policy": ("SchedulePolicyKit", "A request scheduling policy"),
    "speculative_algorithm": ("SpeculativeAlgorithmKit", "A speculative decoding algorithm"),
}


def render(family: str, name: str) -> dict[str, str]:
    """Relative path -> content of the package for `name` in `family`."""
    package = "srv_" + re.sub(r"\W", "_", name)
    major, minor = (int(part) for part in API_VERSION.split(".")[:2])
    kit, description = KITS[family]
    values = {
        "name": name, "package": package, "family": family, "kit": kit,
        "class_name": "".join(part.capitalize() for part in re.split(r"[\W_]+", name) if part) + "Backend",
        "description": f"{description} ({name})", "hook": FAMILIES_BY_NAME[family].hook,
        "flag": FAMILIES_BY_NAME[family].flags[0].lstrip("-"),
        "sdk_major_minor": f"{major}.{minor}", "sdk_next": f"{major}.{minor + 1}",
    }
    files = {
        "pyproject.toml": "common/pyproject.toml.tmpl",
        "README.md": "common/README.md.tmpl",
        f"{package}/__init__.py": "common/plugin.py.tmpl",
        f"{package}/backend.py": f"{family}/backend.py.tmpl",
        f"tests/test_{package}.py": "common/test_backend.py.tmpl",
    }
    return {path: Template((TEMPLATES / source).read_text()).substitute(values) for path, source in files.items()}


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(prog="srv plugins new", description=__doc__.split("\n\n")[0])
    parser.add_argument("family", choices=sorted(KITS), help="the backend family")
    parser.add_argument("name", help="the backend's name, as users pass it to the family's flag")
    parser.add_argument("--dir", type=Path, help="where to write the package (default: ./srv-NAME)")
    args = parser.parse_args(argv)
    if not re.fullmatch(r"[A-Za-z][\w-]*", args.name) or keyword.iskeyword(args.name):
        parser.error(f"{args.name!r} is not a usable name: letters, digits, _ and -, starting with a letter")
    target = args.dir or Path(f"srv-{args.name}")
    if target.exists() and any(target.iterdir()):
        parser.error(f"{target} exists and is not empty")
    for path, content in render(args.family, args.name).items():
        (target / path).parent.mkdir(parents=True, exist_ok=True)
        (target / path).write_text(content)
    print(f"wrote {target}: pip install {target} && pytest {target / 'tests'}")
    return 0
