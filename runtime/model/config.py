"""Reading typed params out of a Hugging Face config.json (what generated ``from_config`` calls)."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from contextvars import ContextVar
from typing import Any

_MISSING = object()

# The ints a model reads from config.json are sizes, counts and token ids; an MLX array
# dimension is an int32, so nothing larger can be built.
MAX_INT = 2**31 - 1

_reads: ContextVar[dict[str, Any] | None] = ContextVar("mlxc_config_reads", default=None)


class ConfigError(ValueError):
    """config.json lacks a key the spec needs, or holds a value of the wrong type."""


def _find(config: dict, path: str | tuple[str, ...]) -> tuple[str | None, Any]:
    """``(the first of the paths present, its value)``, or ``(None, None)``.

    A null value counts as absent (HF writes ``head_dim: null``).
    """
    for p in path if isinstance(path, tuple) else (path,):
        node: Any = config
        for part in p.split(".") if p else []:
            if not isinstance(node, dict) or node.get(part) is None:
                break
            node = node[part]
        else:
            return p, node
    return None, None


def lookup(config: dict, path: str | tuple[str, ...], default: Any = _MISSING) -> Any:
    """Value at a dotted ``path`` (or the first of several that exists)."""
    found, value = _find(config, path)
    if found is not None:
        return value
    if default is not _MISSING:
        return default
    if isinstance(path, tuple):
        raise ConfigError(f"config.json has none of {', '.join(map(repr, path))}")
    raise ConfigError(f"config.json has no '{path}'")


def read(
    config: dict,
    path: str | tuple[str, ...],
    kind: type | None,
    default: Any = _MISSING,
) -> Any:
    """``lookup`` plus a type check; ints are accepted where floats are expected.

    An int must lie in ``[0, MAX_INT]``. Inside :func:`recording_reads` the value is recorded.
    """
    found, value = _find(config, path)
    if found is None:
        return lookup(config, path, default)  # the default, or the error naming the key
    if kind is None:
        return value
    if kind is float and isinstance(value, int) and not isinstance(value, bool):
        value = float(value)
    elif kind is int and isinstance(value, float) and value.is_integer():
        value = int(value)
    if not isinstance(value, kind) or (kind is int and isinstance(value, bool)):
        raise ConfigError(
            f"config.json '{found}' should be {kind.__name__}, got {type(value).__name__} {value!r}"
        )
    if kind is int and not 0 <= value <= MAX_INT:
        raise ConfigError(
            f"config.json '{found}' is {value}: sizes, counts and token ids lie between 0 and "
            f"{MAX_INT}"
        )
    if (reads := _reads.get()) is not None:
        reads[found] = value
    return value


@contextmanager
def recording_reads() -> Iterator[dict[str, Any]]:
    """Collect ``path -> value`` of every ``read`` inside the block, so that the loader can
    name the config.json entries behind a model that fails to build or to fit its weights."""
    reads: dict[str, Any] = {}
    token = _reads.set(reads)
    try:
        yield reads
    finally:
        _reads.reset(token)


def context_length(config: dict) -> int | None:
    """The model's context, ``max_position_embeddings`` (top level or in ``text_config``)."""
    for key in ("max_position_embeddings", "text_config.max_position_embeddings"):
        value = lookup(config, key, None)
        if isinstance(value, int) and not isinstance(value, bool) and value > 0:
            return value
    return None


def round_up(n: float, k: int) -> int:
    """Smallest multiple of ``k`` that is >= ``n``."""
    n = int(n)
    return n if n % k == 0 else n + k - n % k
