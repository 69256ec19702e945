"""Presets: recommended settings shipped inside the package as TOML files, one experiment each (docs/presets.md).

``dturbo presets`` lists them, ``dturbo run --preset NAME`` runs one, ``dturbo config show --preset NAME`` prints its
whole configuration, and ``dturbo.load_config(preset=NAME)`` reads it in Python. A preset holds the keys it sets;
every other key keeps the library's default. The first comment line of a file is its one-line description.
"""

from __future__ import annotations

import tomllib
from importlib import resources
from typing import Any

__all__ = ["PresetError", "describe", "names", "read", "text"]


class PresetError(ValueError):
    """An unknown preset name."""


def _files() -> dict[str, Any]:
    return {p.name[:-5]: p for p in resources.files(__name__).iterdir() if p.name.endswith(".toml")}


def names() -> list[str]:
    """Every preset, in the order ``dturbo presets`` lists them."""
    order = ["quick", "recommended", "speed", "paper"]
    found = sorted(_files())
    return [n for n in order if n in found] + [n for n in found if n not in order]


def text(name: str) -> str:
    """The preset's TOML file as written."""
    files = _files()
    if name not in files:
        import difflib

        close = difflib.get_close_matches(name, list(files), n=1)
        hint = f" (did you mean {close[0]!r}?)" if close else ""
        raise PresetError(f"unknown preset {name!r}{hint}; the presets: {', '.join(names())}")
    return files[name].read_text(encoding="utf-8")


def read(name: str) -> dict[str, Any]:
    """The preset's keys, a mapping shaped like a config TOML."""
    return tomllib.loads(text(name))


def describe(name: str) -> str:
    """The preset's description: its file's first comment, every line of it up to the first that is not a comment,
    joined into one."""
    lines = []
    for line in text(name).splitlines():
        if not line.startswith("#"):
            if lines:
                break
            continue
        lines.append(line.lstrip("#").strip())
    return " ".join(x for x in lines if x)
