"""Attention masks, sized from the live window.

``causal(n_queries, n_keys)`` is called by generated code once per forward, with
``n_keys = cache.live_len + n_queries`` (the ``live-window`` label: the live keys once the chunk is
appended). Where the new queries are the last ``n_queries`` of the live keys, MLX's string mask
``"causal"`` (aligned bottom-right) is exact and takes the fast kernel; an array mask is built
only when asked for (``mlxc verify`` forces arrays so it can check every width). On the CPU a
sliding window over a chunk is left unbuilt (``Window``), so that ``layers.attend`` can run the
chunk in blocks against the keys each block's window sees.
"""

from __future__ import annotations

import contextlib
import contextvars

import mlx.core as mx


class MaskWidthError(ValueError):
    """An attention mask whose key width is not the number of live keys."""


class MaskAudit:
    """Counts the array masks checked against their keys inside ``array_masks()``."""

    def __init__(self) -> None:
        self.checked = 0


_audit: contextvars.ContextVar[MaskAudit | None] = contextvars.ContextVar(
    "mlxc_array_masks", default=None
)


@contextlib.contextmanager
def array_masks():
    """Within this block ``causal`` builds explicit arrays, so every width can be checked."""
    audit = MaskAudit()
    token = _audit.set(audit)
    try:
        yield audit
    finally:
        _audit.reset(token)


class Window:
    """The sliding-window causal mask of ``n_queries`` queries, the last of ``n_keys`` keys,
    each attending to its ``window`` latest keys (its own included), left unbuilt.

    Only ``causal`` on the CPU returns one: ``layers.attend`` runs a chunk of more queries
    than a block under it in blocks, each against the keys its window sees (past the window a
    chunk's scores are mostly masked, and MLX's CPU attention computes and exponentiates every
    one); any other reader takes ``array()``, the boolean ``[n_queries, n_keys]`` built once.
    """

    def __init__(self, n_queries: int, n_keys: int, window: int) -> None:
        self.n_queries, self.n_keys, self.window = n_queries, n_keys, window
        self._array: mx.array | None = None

    @property
    def shape(self) -> tuple[int, int]:
        return (self.n_queries, self.n_keys)

    def array(self) -> mx.array:
        if self._array is None:
            self._array = causal_array(self.n_queries, self.n_keys, self.window)
        return self._array


def check(mask: mx.array | Window | str | None, n_queries: int, n_keys: int) -> None:
    """Raise MaskWidthError unless an array (or ``Window``) mask is exactly ``[..., n_queries,
    n_keys]``."""
    if not isinstance(mask, (mx.array, Window)):
        return
    if mask.shape[-1] != n_keys or mask.shape[-2] != n_queries:
        raise MaskWidthError(
            f"mask is {mask.shape[-2]}x{mask.shape[-1]} but attention has {n_queries} queries "
            f"and {n_keys} live keys: a mask must be sized from cache.live_len"
        )
    audit = _audit.get()
    if audit is not None:
        audit.checked += 1


def causal(
    n_queries: int,
    n_keys: int,
    key_valid: mx.array | None = None,
    window: int | None = None,
) -> mx.array | Window | str | None:
    """Causal mask for ``n_queries`` new tokens against ``n_keys`` live keys (queries last).

    ``key_valid`` ``[B, 1, 1, n_keys]``: the columns each row may attend to (the rows of a
    decode batch or of a prompt batch, ``runtime.model.batch``); a query's own column is
    always attended to. ``[B, 1, n_queries, n_keys]``: each query's columns, given whole (a
    decode batch row whose queries are not its last columns, ``BatchKVCache.key_valid``).
    ``window``: a query at key column ``q`` also attends only to columns ``q - window + 1 ..
    q`` (sliding-window attention; a row's live keys are contiguous positions, so columns
    count positions). Returns None when no masking is needed (one query, no
    window, every key valid), ``"causal"`` where the string form is exact, on the CPU a
    ``Window`` for a chunk under a window alone, else a boolean array ``[..., n_queries,
    n_keys]`` (True = attend).
    """
    if n_queries > n_keys:
        raise ValueError(f"{n_queries} queries but only {n_keys} live keys: mask sized wrong")
    if window is not None and n_keys <= window:
        window = None  # every live key is inside the window of every query
    if _audit.get() is None:
        if window is None and key_valid is None:
            return None if n_queries == 1 else "causal"
        if window is None and n_queries == 1:
            # One new query, the last key: causality masks nothing.
            return key_valid
        if key_valid is None and n_queries > 1 and mx.default_device() == mx.cpu:
            return Window(n_queries, n_keys, window)  # a window alone (none returned above)
    mask = causal_array(n_queries, n_keys, window)
    if key_valid is not None and key_valid.shape[-2] == n_queries > 1:
        return mask & key_valid  # per query, its own column included
    if key_valid is not None:
        # Each query also sees its own column: a padding query of a prompt batch
        # (``BatchKVCache.start_rows``) has no valid key before it, and what a backend makes
        # of a query that may attend to nothing is unspecified (the CPU averages every key;
        # an additive -inf mask would give NaN, which the padding's values would carry on).
        own = mx.arange(n_keys)[None, :] == mx.arange(n_keys - n_queries, n_keys)[:, None]
        mask = mask & (key_valid | own)
    return mask


def causal_array(n_queries: int, n_keys: int, window: int | None = None) -> mx.array:
    """The boolean ``[n_queries, n_keys]`` causal (and sliding-window) mask, queries last."""
    q_pos = mx.arange(n_keys - n_queries, n_keys)[:, None]
    k_pos = mx.arange(n_keys)[None, :]
    mask = k_pos <= q_pos
    if window is not None:
        mask = mask & (k_pos > q_pos - window)
    return mask
