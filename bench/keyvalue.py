"""KEY=VALUE settings from the command line (`--set`, `--tag`), shared by every subcommand."""
from __future__ import annotations

import ast
from typing import Any

from systems.base import ConfigError


def parse_value(text: str) -> Any:
    """A Python literal (2, 1e-3, True, "x") or, failing that, the text itself."""
    try:
        return ast.literal_eval(text)
    except (ValueError, SyntaxError):
        return text


def parse_sets(items: list[str]) -> dict[str, Any]:
    out = {}
    for item in items:
        key, sep, value = item.partition("=")
        if not sep or not key.strip() or not value.strip():
            raise ConfigError(f"malformed --set {item!r}: write key=value, e.g. --set tp=2")
        out[key.strip()] = parse_value(value.strip())
    return out
