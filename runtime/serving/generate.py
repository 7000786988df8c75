"""Single-sequence generation: chunked prefill, then one decode step per token.

The bounded-cache rule runs here as everywhere else: after every prefill chunk and every decode
step, ``enforce_max_kv`` trims each cache back to ``max_kv_size`` live tokens (keeping
``kv_sink`` sink tokens at the front).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from typing import Any

import mlx.core as mx
import numpy as np
from mlx import nn

from mlxc.runtime.model.cache import (
    KVQuant,
    cache_arrays,
    check_kv_limits,
    enforce_max_kv,
    make_caches,
)
from mlxc.runtime.model.cache import trimmable as caches_to_trim
from mlxc.runtime.serving.sample import Sampler, make_sampler


class ContextExceeded(ValueError):
    """A prompt, or a prompt plus the tokens asked for, past the model's context. ``param`` is
    what to change: "prompt" or "max_tokens"."""

    def __init__(self, message: str, param: str) -> None:
        super().__init__(message)
        self.param = param


def completion_budget(
    n_prompt: int, requested: int | None, default: int, context: int | None, max_kv_size: int | None
) -> int:
    """How many tokens to generate after a prompt of ``n_prompt`` (``mlxc generate``'s and the
    server's one rule).

    Without ``max_kv_size``, prompt and completion fit the model's ``context`` (None: unknown,
    no bound): a prompt at or over it, or ``requested`` past the room left, is
    :class:`ContextExceeded`; with nothing requested, ``default`` shrinks to the room. Under
    ``max_kv_size`` the cache slides, so any length fits.
    """
    if context is None or max_kv_size is not None:
        return requested or default
    if n_prompt >= context:
        raise ContextExceeded(
            f"the prompt has {n_prompt} tokens but the model's context is {context} tokens: "
            "shorten it, or keep a sliding window with --max-kv-size N",
            "prompt",
        )
    room = context - n_prompt
    if requested is None:
        return min(default, room)
    if requested > room:
        raise ContextExceeded(
            f"the prompt ({n_prompt} tokens) plus max_tokens ({requested}) exceeds the model's "
            f"context of {context} tokens: ask for at most {room} tokens, or keep a sliding "
            "window with --max-kv-size N",
            "max_tokens",
        )
    return requested


# StreamingLLM (Xiao et al., 2023) found that a few initial tokens soak up attention mass
# ("attention sinks"); evicting them degrades a sliding window sharply, keeping 4 restores it.
DEFAULT_KV_SINK = 4


def vocab_size(model: nn.Module) -> int | None:
    """The rows of ``model``'s token embedding (its config's ``vocab_size``); None when the
    model does not say."""
    return getattr(getattr(model, "args", None), "vocab_size", None)


def check_prompt(prompt_ids: Sequence[int], *models: nn.Module) -> None:
    """Refuse an empty prompt, or a token id outside every model's embedding: MLX's gather
    does not check bounds, so such an id would read outside the table (a crash of the whole
    process, or garbage). The server checks ids against the checkpoint's vocabulary already;
    this holds for every caller (the scheduler, ``generate_tokens``, a draft model)."""
    if not prompt_ids:
        raise ValueError("the prompt is empty: generation needs at least one token")
    vocab = min((n for n in map(vocab_size, models) if n is not None), default=None)
    bad = out_of_range(prompt_ids, vocab)
    if bad is not None:
        raise ValueError(f"token id {bad} is out of range (vocab size {vocab or '?'})")


def out_of_range(ids: Sequence[int], vocab: int | None) -> int | None:
    """A token id of ``ids`` outside ``0 .. vocab - 1`` (the lowest if one is negative, else
    the highest), or None; ``vocab`` None checks the sign only."""
    if not ids:
        return None
    low, high = min(ids), max(ids)
    if low < 0:
        return low
    return high if vocab is not None and high >= vocab else None


def as_model_inputs(inputs: Mapping[str, Any] | None) -> dict[str, Any]:
    """Model keyword inputs with numpy arrays made MLX arrays, other values as they are.

    Prompts are built (``runtime.checkpoint.processor``) where MLX must not be touched, so their vision
    inputs are numpy; call this on the thread that runs the model.
    """
    return {k: mx.array(v) if isinstance(v, np.ndarray) else v for k, v in (inputs or {}).items()}


def prefill_chunks(
    n_tokens: int, chunk_size: int, keep_whole: Sequence[tuple[int, int]] = ()
) -> list[tuple[int, int]]:
    """A prompt's prefill chunks, ``(start, end)``; the last one's logits give the first token.

    Full chunks while more than one chunk remains, then the rest. On a CPU the last token then
    goes alone: only the caches of a chunk before it are evaluated, so its last layer's
    attention output and MLP are never computed (~1/n_layers of the work) at the price of one
    more one-token forward. A CPU forward costs its FLOPs, so that pays (10-20% on the bench's
    small models); a GPU forward costs its kernel launches, and it does not
    (``bench/profile_decode.py`` measures both ways). Generation and the server share this.

    ``keep_whole``: ``(start, end)`` spans no boundary may cut (the model's ``prefill_spans``,
    e.g. Gemma 3's images, bidirectional only within one forward): a boundary inside one moves
    to its end, so that chunk grows past ``chunk_size``.
    """

    def cut(at: int) -> int:
        return next((e for s, e in keep_whole if s < at < e), at)

    bounds, start = [], 0
    while n_tokens - start > chunk_size and (end := cut(start + chunk_size)) < n_tokens:
        bounds.append((start, end))
        start = end
    if n_tokens - start > 1 and mx.default_device() == mx.cpu and cut(n_tokens - 1) < n_tokens:
        bounds.append((start, n_tokens - 1))
        start = n_tokens - 1
    bounds.append((start, n_tokens))
    return bounds


def prefill_spans(model: nn.Module, prompt_ids: Sequence[int]) -> list[tuple[int, int]]:
    """The spans of a prompt that ``model`` needs in one prefill chunk (its ``prefill_spans``
    method; none for a model without one)."""
    spans = getattr(model, "prefill_spans", None)
    return list(spans(prompt_ids)) if spans is not None else []


def prefill_prompt(
    model: nn.Module,
    cache: list,
    prompt_ids: Sequence[int],
    chunk_size: int,
    trim: Callable[[], Any],
    vision_inputs: Mapping[str, Any] | None = None,
) -> mx.array:
    """Forward ``prompt_ids`` into ``cache`` chunk by chunk (``prefill_chunks``, the model's
    ``prefill_spans`` kept whole) and return the last chunk's last logits ``[1, 1, V]`` (lazy).

    After every chunk ``trim()`` applies the caller's ``--max-kv-size`` rule; every chunk but the
    last is then evaluated, which bounds the graph and the memory a long prompt holds.
    ``vision_inputs`` go with the first chunk only (later chunks use the features the model
    keeps on the cache). ``generate_tokens``, speculative decoding and its draft model share this;
    the server's scheduler runs the same chunks one per tick.
    """
    prompt = mx.array(prompt_ids, dtype=mx.int32)[None]
    inputs = as_model_inputs(vision_inputs)
    *body, (start, end) = prefill_chunks(
        len(prompt_ids), chunk_size, prefill_spans(model, prompt_ids)
    )
    for a, b in body:
        model(prompt[:, a:b], cache=cache, **inputs)
        inputs = {}
        trim()
        mx.eval(cache_arrays(cache))
    logits = model(prompt[:, start:end], cache=cache, last_only=True, **inputs)
    trim()
    return logits


def generate_tokens(
    model: nn.Module,
    prompt_ids: list[int],
    *,
    max_tokens: int,
    sampler: Sampler | None = None,
    prefill_chunk_size: int = 2048,
    max_kv_size: int | None = None,
    kv_sink: int = DEFAULT_KV_SINK,
    kv_quant: KVQuant | None = None,
    eos_token_ids: Iterable[int] = (),
    cache: list | None = None,
    vision_inputs: Mapping[str, Any] | None = None,
) -> Iterator[int]:
    """Yield generated token ids one at a time (EOS is not yielded).

    ``sampler``: logits ``[1, V]`` -> ids ``[1]``; greedy when None. The prompt is prefilled in
    chunks of ``prefill_chunk_size`` tokens. ``max_kv_size``: None keeps every token (no limit is
    guessed from the config); else each cache keeps at most that many live tokens after every
    chunk and step: the first ``kv_sink`` (default 4, the attention sinks StreamingLLM found
    necessary; 0 is a plain sliding window) plus the most recent. ``kv_sink`` only matters when
    ``max_kv_size`` is set. ``kv_quant``: keys and values stored quantised (``--kv-bits``;
    None: the model's dtype) in the caches made here. Stops at an id in ``eos_token_ids`` or
    after ``max_tokens`` tokens.

    ``cache``: the model's caches to continue from (``make_caches(model, kv_quant)`` when None). Afterwards
    it holds the prompt and the generated tokens except the last one yielded (plus the EOS token
    when one stopped the run).

    ``vision_inputs``: keyword arguments of the model's image inputs for this prompt (e.g.
    ``pixel_values`` and ``image_grid_thw`` or ``image_sizes``, numpy as ``runtime.checkpoint.processor``
    makes them, or MLX arrays); passed with the first prefill chunk only, later chunks use the
    features the model keeps on the cache.
    """
    check_prompt(prompt_ids, model)
    if max_tokens < 0:
        raise ValueError(f"max_tokens must be >= 0, got {max_tokens}")
    if prefill_chunk_size < 1:
        raise ValueError(f"prefill_chunk_size must be >= 1, got {prefill_chunk_size}")
    check_kv_limits(max_kv_size, kv_sink)
    if max_tokens == 0:
        return
    sampler = sampler or make_sampler()
    eos = set(eos_token_ids)
    cache = make_caches(model, kv_quant) if cache is None else cache
    trimmable = caches_to_trim(model, cache)

    def trim() -> None:
        enforce_max_kv(trimmable, max_kv_size, kv_sink)

    def step(ids: mx.array) -> mx.array:
        logits = model(ids, cache=cache, last_only=True)
        trim()
        return sampler(logits[:, -1, :])

    # The last chunk's final logits give the first token. Each next step is queued with
    # async_eval before the current token is read, so the device never waits on the host.
    logits = prefill_prompt(model, cache, prompt_ids, prefill_chunk_size, trim, vision_inputs)
    y = sampler(logits[:, -1, :])
    mx.async_eval(y)
    for i in range(max_tokens):
        if i + 1 < max_tokens:
            next_y = step(y[:, None])
            mx.async_eval(next_y)
        token = y.item()  # the one host round trip per token
        if token in eos:
            return
        yield token
        if i + 1 < max_tokens:
            y = next_y
