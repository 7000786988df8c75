"""Reading typed params out of a Hugging Face config.json (what generated ``from_config`` calls)."""

from __future__ import annotations

from typing import Any

_MISSING = object()
_MISSING_HERE = object()


class ConfigError(ValueError):
    """config.json lacks a key the spec needs, or holds a value of the wrong type."""


def lookup(config: dict, path: str | tuple[str, ...], default: Any = _MISSING) -> Any:
    """Value at a dotted ``path`` (or the first of several that exists).

    A null value counts as absent (HF writes ``head_dim: null``).
    """
    if isinstance(path, tuple):
        for p in path:
            value = lookup(config, p, _MISSING_HERE)
            if value is not _MISSING_HERE:
                return value
        if default is _MISSING:
            raise ConfigError(f"config.json has none of {', '.join(map(repr, path))}")
        return default
    node: Any = config
    for part in path.split(".") if path else []:
        if not isinstance(node, dict) or node.get(part) is None:
            if default is _MISSING:
                raise ConfigError(f"config.json has no '{path}'")
            return default
        node = node[part]
    return node


def read(
    config: dict, path: str | tuple[str, ...], kind: type | None, default: Any = _MISSING
) -> Any:
    """``lookup`` plus a type check; ints are accepted where floats are expected."""
    value = lookup(config, path, default)
    if value is default or kind is None:
        return value
    if kind is float and isinstance(value, int) and not isinstance(value, bool):
        return float(value)
    if kind is int and isinstance(value, float) and value.is_integer():
        return int(value)
    if not isinstance(value, kind) or (kind is int and isinstance(value, bool)):
        raise ConfigError(
            f"config.json '{path}' should be {kind.__name__}, got {type(value).__name__} {value!r}"
        )
    return value


def round_up(n: int | float, k: int) -> int:
    """Smallest multiple of ``k`` that is >= ``n``."""
    n = int(n)
    return n if n % k == 0 else n + k - n % k
