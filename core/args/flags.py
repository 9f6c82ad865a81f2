"""The flag table of `srv launch`, read from server_arguments.yaml beside this file."""

from __future__ import annotations

import functools
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import yaml

SPEC_PATH = Path(__file__).with_name("server_arguments.yaml")


@dataclass(frozen=True)
class FlagSpec:
    """One launch flag.

    type: str, int, float, json (a JSON document) or bool (a switch, set means true).
    family: for a flag that chooses a backend, the plugin family its names come from;
        `auto` adds the name "auto", meaning: let srv pick the best available backend;
        `none` adds the name "none", meaning: no backend of the family.
    srv: a flag srv adds to SGLang's set.
    """

    names: tuple[str, ...]
    section: str
    type: str
    default: Any
    help: str
    nargs: str | None = None
    choices: tuple[Any, ...] | None = None
    family: str | None = None
    auto: bool = False
    none: bool = False
    deprecated: bool = False
    srv: bool = False

    @property
    def name(self) -> str:
        return self.names[0]

    @property
    def dest(self) -> str:
        return self.name.lstrip("-").replace("-", "_")


@functools.cache
def load_flag_specs() -> tuple[FlagSpec, ...]:
    # libyaml's parser where PyYAML has it: the pure-Python one takes a quarter of a second of
    # every launch on this file.
    loader = getattr(yaml, "CSafeLoader", yaml.SafeLoader)
    sections = yaml.load(SPEC_PATH.read_text(encoding="utf-8"), Loader=loader)
    specs = []
    for section in sections:
        for entry in section["flags"]:
            entry = dict(entry)
            entry["names"] = tuple(entry["names"])
            if "choices" in entry:
                entry["choices"] = tuple(entry["choices"])
            specs.append(FlagSpec(section=section["section"], **entry))
    return tuple(specs)


def sections() -> list[str]:
    return list(dict.fromkeys(spec.section for spec in load_flag_specs()))


def flag_spec(name: str) -> FlagSpec:
    """The spec of the flag called `name` (any of its spellings)."""
    return next(spec for spec in load_flag_specs() if name in spec.names)
