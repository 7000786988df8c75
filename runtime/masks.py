"""Attention masks, sized from the live window.

``causal(n_queries, n_keys)`` is called by generated code with ``n_keys = cache.live_len`` (the
``live-window`` label). Where the new queries are the last ``n_queries`` of the live keys, MLX's
string mask ``"causal"`` (aligned bottom-right) is exact and takes the fast kernel; an array mask
is built only when asked for (``mlxc verify`` forces arrays so it can check every width).
"""

from __future__ import annotations

import contextlib
import contextvars

import mlx.core as mx

_force_arrays = contextvars.ContextVar("mlxc_force_array_masks", default=False)


@contextlib.contextmanager
def array_masks():
    """Within this block, ``causal`` returns explicit boolean arrays instead of ``"causal"``."""
    token = _force_arrays.set(True)
    try:
        yield
    finally:
        _force_arrays.reset(token)


def causal(n_queries: int, n_keys: int, window: int | None = None) -> mx.array | str | None:
    """Causal mask for ``n_queries`` new tokens against ``n_keys`` live keys (queries last).

    Returns None when no masking is needed (one query, no window), ``"causal"`` where the
    string form is exact, else a boolean ``[n_queries, n_keys]`` array (True = attend).
    """
    if n_queries > n_keys:
        raise ValueError(f"{n_queries} queries but only {n_keys} live keys: mask sized wrong")
    if window is None and not _force_arrays.get():
        return None if n_queries == 1 else "causal"
    q_pos = mx.arange(n_keys - n_queries, n_keys)[:, None]
    k_pos = mx.arange(n_keys)[None, :]
    mask = k_pos <= q_pos
    if window is not None:
        mask = mask & (k_pos > q_pos - window)
    return mask
