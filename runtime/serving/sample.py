"""Token samplers: greedy, or temperature with top-k and top-p (nucleus) filtering."""

from __future__ import annotations

from collections.abc import Callable

import mlx.core as mx

Sampler = Callable[[mx.array], mx.array]


def greedy(logits: mx.array) -> mx.array:
    """The most likely token of each row: logits ``[B, V]`` -> ids ``[B]`` (int32)."""
    return mx.argmax(logits, axis=-1).astype(mx.int32)


def make_sampler(
    temp: float = 0.0, top_p: float = 1.0, top_k: int = 0, seed: int | None = None
) -> Sampler:
    """A callable mapping logits ``[B, V]`` to token ids ``[B]`` (int32).

    ``temp == 0`` is greedy (argmax; top-k/top-p are then moot). Otherwise logits are divided
    by ``temp``, only the ``top_k`` most likely tokens are kept (0 = all), then only the smallest
    set of most likely tokens whose probability reaches ``top_p`` (1 = all; the most likely token
    always stays), and one token is drawn. With a ``seed`` the sampler owns its random key, so
    the same seed gives the same draws whatever else uses ``mx.random``; without one it draws
    from MLX's global generator. A seed is any int64 (OpenAI's range); a negative one keys the
    generator with its two's-complement 64 bits.
    """
    if temp < 0:
        raise ValueError(f"temp must be >= 0, got {temp}")
    if not 0 < top_p <= 1:
        raise ValueError(f"top_p must be in (0, 1], got {top_p}")
    if top_k < 0:
        raise ValueError(f"top_k must be >= 0, got {top_k}")
    if seed is not None and not -(2**63) <= seed < 2**63:
        raise ValueError(f"seed must be a 64-bit signed integer, got {seed}")

    if temp == 0:
        return greedy

    key = [mx.random.key(seed % 2**64)] if seed is not None else None

    def sample(logits: mx.array) -> mx.array:
        logits = logits.astype(mx.float32) / temp
        if 0 < top_k < logits.shape[-1]:
            logits = _keep_top_k(logits, top_k)
        if top_p < 1:
            logits = _keep_top_p(logits, top_p)
        subkey = None
        if key is not None:
            key[0], subkey = mx.random.split(key[0])
        return mx.random.categorical(logits, axis=-1, key=subkey).astype(mx.int32)

    return sample


def _keep_top_k(logits: mx.array, k: int) -> mx.array:
    """Set all but the ``k`` largest logits of each row to -inf."""
    # Indices past the k-th after a partition by descending logit are the ones to drop.
    drop = mx.argpartition(-logits, kth=k - 1, axis=-1)[..., k:]
    return mx.put_along_axis(logits, drop, mx.array(-mx.inf, logits.dtype), axis=-1)


def _keep_top_p(logits: mx.array, p: float) -> mx.array:
    """Keep the most likely tokens until their probability mass reaches ``p``; -inf the rest."""
    order = mx.argsort(-logits, axis=-1)
    sorted_probs = mx.take_along_axis(mx.softmax(logits, axis=-1), order, axis=-1)
    # A token stays when the mass strictly before it is below p: the top token always stays.
    keep_sorted = (mx.cumsum(sorted_probs, axis=-1) - sorted_probs) < p
    keep = mx.put_along_axis(mx.zeros(logits.shape, mx.bool_), order, keep_sorted, axis=-1)
    return mx.where(keep, logits, -mx.inf)
