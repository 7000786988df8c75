"""Token samplers: greedy, or temperature with top-k, top-p (nucleus) and min-p filtering;
repetition, presence and frequency penalties, logit bias, and log-probabilities.

One batched function, :func:`sample_rows`, samples a token for every row of a logits matrix
``[B, V]``, each row with its own :class:`RowSampler` (its request's parameters, random key and
penalty state). The parameters become per-row arrays, so the work is a fixed number of array
operations whatever ``B``; a stage no row of the batch uses (penalties, top-k, top-p, min-p,
log-probabilities) is skipped, so greedy rows without penalties cost one argmax. Only rows with
a seed need a call of their own (each draws from its own key, so a seeded request gives the same
tokens alone or in any batch). :func:`make_sampler` is the single-request form used by
``mlxc generate``; the server's scheduler calls :func:`sample_rows` on its decode batch.

Order of the stages, as in transformers' ``generate`` and vLLM: logit bias and the penalties on
the model's logits, then temperature, top-k, top-p, min-p, and one draw (Gumbel-max, the same
draw as ``mx.random.categorical``). Log-probabilities are those of the model's own distribution
(log-softmax of the raw logits, before bias, penalties and temperature: vLLM's default).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any, NamedTuple

import mlx.core as mx

Sampler = Callable[[mx.array], mx.array]

MAX_TOP_LOGPROBS = 20  # OpenAI's limit


def greedy(logits: mx.array) -> mx.array:
    """The most likely token of each row: logits ``[B, V]`` -> ids ``[B]`` (int32)."""
    return mx.argmax(logits, axis=-1).astype(mx.int32)


@dataclass(frozen=True)
class SamplingOptions:
    """What one request asks of the sampler (``SamplingParams`` carries the same names)."""

    temperature: float = 0.0
    top_p: float = 1.0
    top_k: int = 0
    min_p: float = 0.0
    seed: int | None = None
    repetition_penalty: float = 1.0  # transformers / vLLM: over prompt and output tokens
    presence_penalty: float = 0.0  # OpenAI: over output tokens
    frequency_penalty: float = 0.0
    logit_bias: tuple[tuple[int, float], ...] = field(default=())
    logprobs: bool = False  # the sampled token's log-probability
    top_logprobs: int = 0  # and this many most likely alternatives


def _check(o: Any) -> None:
    if o.temperature < 0:
        raise ValueError(f"temp must be >= 0, got {o.temperature}")
    if not 0 < o.top_p <= 1:
        raise ValueError(f"top_p must be in (0, 1], got {o.top_p}")
    if o.top_k < 0:
        raise ValueError(f"top_k must be >= 0, got {o.top_k}")
    if not 0 <= o.min_p <= 1:
        raise ValueError(f"min_p must be in [0, 1], got {o.min_p}")
    if o.seed is not None and not -(2**63) <= o.seed < 2**63:
        raise ValueError(f"seed must be a 64-bit signed integer, got {o.seed}")
    if o.repetition_penalty <= 0:
        raise ValueError(f"repetition_penalty must be > 0, got {o.repetition_penalty}")
    if not 0 <= o.top_logprobs <= MAX_TOP_LOGPROBS:
        raise ValueError(f"top_logprobs must be in [0, {MAX_TOP_LOGPROBS}], got {o.top_logprobs}")


class RowSampler:
    """One sequence's sampling: its options, its random key (with a seed) and the counts of the
    tokens it has generated (with a penalty). ``prompt_ids`` feed the repetition penalty.

    ``options`` is any object with :class:`SamplingOptions`' attributes (``SamplingParams``).
    """

    def __init__(self, options: Any, prompt_ids: Iterable[int] = ()) -> None:
        _check(options)
        self.temperature = float(options.temperature)
        self.greedy = self.temperature == 0
        # Greedy makes top-k/top-p/min-p moot: a greedy row keeps them neutral.
        self.top_p = 1.0 if self.greedy else float(options.top_p)
        self.top_k = 0 if self.greedy else int(options.top_k)
        self.min_p = 0.0 if self.greedy else float(getattr(options, "min_p", 0.0))
        seed = options.seed
        self.key = mx.random.key(seed % 2**64) if seed is not None and not self.greedy else None
        self.repetition = float(getattr(options, "repetition_penalty", 1.0))
        self.presence = float(getattr(options, "presence_penalty", 0.0))
        self.frequency = float(getattr(options, "frequency_penalty", 0.0))
        self.bias = tuple(getattr(options, "logit_bias", ()))
        self.logprobs = bool(getattr(options, "logprobs", False))
        self.top_logprobs = int(getattr(options, "top_logprobs", 0))
        # Penalty state, made at the first step (the logits give the width V).
        self.counts_tokens = self.repetition != 1 or self.presence != 0 or self.frequency != 0
        self.adjusts = self.counts_tokens or bool(self.bias)
        self._prompt = list(prompt_ids) if self.repetition != 1 else []
        self.counts: mx.array | None = None  # [V] float32: times each token was generated
        self.seen: mx.array | None = None  # [V] bool: in the prompt (repetition penalty)
        self.bias_row: mx.array | None = None  # [V] float32

    def _state(self, vocab: int) -> None:
        if self.counts is not None or not self.adjusts:
            return
        self.counts = mx.zeros((vocab,), mx.float32)
        seen = mx.zeros((vocab,), mx.bool_)
        ids = [t for t in self._prompt if 0 <= t < vocab]
        if ids:
            seen[mx.array(ids, dtype=mx.int32)] = True
        self.seen = seen
        bias = mx.zeros((vocab,), mx.float32)
        if self.bias:
            ids, values = zip(*self.bias)
            bias[mx.array(ids, dtype=mx.int32)] = mx.array(values, dtype=mx.float32)
        self.bias_row = bias


class Sampled(NamedTuple):
    """The result of one :func:`sample_rows` step (lazy arrays)."""

    tokens: mx.array  # [B] int32
    logprobs: mx.array | None  # [B]: the sampled tokens' log-probabilities (when a row asks)
    top_ids: mx.array | None  # [B, K]: the K most likely tokens, most likely first
    top_logprobs: mx.array | None  # [B, K]
    state: list[mx.array]  # penalty state to evaluate with the tokens

    def arrays(self) -> list[mx.array]:
        """Everything to evaluate in the step (the state too, so its graph stays one step)."""
        out = [self.tokens, *self.state]
        return out + [a for a in (self.logprobs, self.top_ids, self.top_logprobs) if a is not None]


def _column(values: Sequence[float], dtype=mx.float32) -> mx.array:
    return mx.array(values, dtype=dtype)[:, None]


def adjust_logits(logits: mx.array, rows: Sequence[RowSampler]) -> mx.array:
    """Logit bias and penalties on the rows that have any (the others are not touched), from
    each row's history: its prompt and the tokens :func:`sample_rows` gave it so far."""
    which = [i for i, r in enumerate(rows) if r.adjusts]
    if not which:
        return logits
    vocab = logits.shape[-1]
    for i in which:
        rows[i]._state(vocab)
    picked = [rows[i] for i in which]
    index = mx.array(which, dtype=mx.int32)
    sub = logits[index]
    counts = mx.stack([r.counts for r in picked])
    generated = counts > 0
    if any(r.repetition != 1 for r in picked):
        # transformers' RepetitionPenaltyLogitsProcessor: a token already in the prompt or the
        # output is made less likely, negative logits multiplied, positive ones divided.
        seen = mx.stack([r.seen for r in picked]) | generated
        penalty = _column([r.repetition for r in picked])
        sub = mx.where(seen, mx.where(sub < 0, sub * penalty, sub / penalty), sub)
    if any(r.presence != 0 or r.frequency != 0 for r in picked):
        # OpenAI: logit -= count * frequency_penalty + (count > 0) * presence_penalty
        sub = sub - counts * _column([r.frequency for r in picked])
        sub = sub - generated * _column([r.presence for r in picked])
    if any(r.bias for r in picked):
        sub = sub + mx.stack([r.bias_row for r in picked])
    logits = mx.array(logits)  # a copy: the caller's logits stay the model's
    logits[index] = sub
    return logits


def warp_logits(logits: mx.array, rows: Sequence[RowSampler]) -> mx.array:
    """Temperature, then top-k, top-p and min-p filtering (-inf), each row with its own
    parameters; a stage no row uses is skipped. Greedy rows come out unchanged."""
    vocab = logits.shape[-1]
    x = logits / _column([r.temperature or 1.0 for r in rows])
    if any(0 < r.top_k < vocab for r in rows):
        x = _keep_top_k(x, [r.top_k if 0 < r.top_k < vocab else 0 for r in rows])
    if any(r.top_p < 1 for r in rows):
        x = _keep_top_p(x, _column([r.top_p for r in rows]))
    if any(r.min_p > 0 for r in rows):
        x = _keep_min_p(x, _column([r.min_p for r in rows]))
    return x


def _keep_top_k(logits: mx.array, ks: list[int]) -> mx.array:
    """Per row, -inf all but the ``ks[b]`` largest logits (0: all kept). One partition at the
    largest k, then each row's k-th largest read from that block (sorted, k values)."""
    most = max(ks)
    # block[b, j] = -(the (j+1)-th largest logit of row b)
    block = mx.sort(mx.partition(-logits, kth=most - 1, axis=-1)[:, :most], axis=-1)
    kth = -mx.take_along_axis(block, mx.array([max(k, 1) - 1 for k in ks])[:, None], axis=-1)
    kth = mx.where(mx.array(ks)[:, None] > 0, kth, -mx.inf)
    return mx.where(logits < kth, -mx.inf, logits)


def _keep_top_p(logits: mx.array, ps: mx.array) -> mx.array:
    """Per row, keep the most likely tokens until their mass reaches ``ps[b]``; -inf the rest."""
    order = mx.argsort(-logits, axis=-1)
    sorted_probs = mx.take_along_axis(mx.softmax(logits, axis=-1), order, axis=-1)
    # A token stays when the mass strictly before it is below p: the top token always stays.
    # p == 1 keeps every token (rounding could otherwise drop the tail).
    keep_sorted = ((mx.cumsum(sorted_probs, axis=-1) - sorted_probs) < ps) | (ps >= 1)
    keep = mx.put_along_axis(mx.zeros(logits.shape, mx.bool_), order, keep_sorted, axis=-1)
    return mx.where(keep, logits, -mx.inf)


def _keep_min_p(logits: mx.array, min_ps: mx.array) -> mx.array:
    """Per row, -inf the tokens less likely than ``min_ps[b]`` times the most likely one
    (transformers' MinPLogitsWarper; the top token always stays)."""
    probs = mx.softmax(logits, axis=-1)
    floor = min_ps * mx.max(probs, axis=-1, keepdims=True)
    return mx.where(probs < floor, -mx.inf, logits)


def _noise(rows: Sequence[RowSampler], shape: tuple[int, int]) -> mx.array:
    """Gumbel noise for the drawing rows (zero for greedy ones): one draw from MLX's global
    generator for the unseeded rows, one from its own key for each seeded row."""
    noise = mx.zeros(shape, mx.float32)
    unseeded = [i for i, r in enumerate(rows) if not r.greedy and r.key is None]
    if unseeded:
        noise[mx.array(unseeded, dtype=mx.int32)] = mx.random.gumbel((len(unseeded), shape[1]))
    for i, r in enumerate(rows):
        if r.key is not None:
            r.key, subkey = mx.random.split(r.key)
            noise[i] = mx.random.gumbel((shape[1],), key=subkey)
    return noise


def _logprobs(raw: mx.array, tokens: mx.array, rows: Sequence[RowSampler]):
    if not any(r.logprobs for r in rows):
        return None, None, None
    lp = raw - mx.logsumexp(raw, axis=-1, keepdims=True)
    chosen = mx.take_along_axis(lp, tokens[:, None], axis=-1)[:, 0]
    k = max(r.top_logprobs for r in rows if r.logprobs)
    if k == 0:
        return chosen, None, None
    k = min(k, raw.shape[-1])
    top = mx.argpartition(-lp, kth=k - 1, axis=-1)[:, :k]
    values = mx.take_along_axis(lp, top, axis=-1)
    order = mx.argsort(-values, axis=-1)
    return (
        chosen,
        mx.take_along_axis(top, order, axis=-1).astype(mx.int32),
        mx.take_along_axis(values, order, axis=-1),
    )


def sample_rows(logits: mx.array, rows: Sequence[RowSampler]) -> Sampled:
    """One token for each row of ``logits [B, V]``, row ``b`` sampled as ``rows[b]`` asks."""
    if all(r.greedy and not (r.adjusts or r.logprobs) for r in rows):
        return Sampled(greedy(logits), None, None, None, [])  # the argmax needs no float32 copy
    raw = logits.astype(mx.float32)
    x = adjust_logits(raw, rows)
    vocab = x.shape[-1]
    if all(r.greedy for r in rows):
        tokens = greedy(x)  # one argmax for the whole batch
    else:
        x = warp_logits(x, rows)
        # Gumbel-max: the argmax of logits plus Gumbel noise is a draw from their softmax.
        tokens = greedy(x + _noise(rows, x.shape))
    counted = [i for i, r in enumerate(rows) if r.counts_tokens]
    state = []
    if counted:
        index = mx.array(counted, dtype=mx.int32)
        hit = mx.arange(vocab)[None, :] == tokens[index][:, None]
        counts = mx.stack([rows[i].counts for i in counted]) + hit
        state.append(counts)
        for j, i in enumerate(counted):
            rows[i].counts = counts[j]
    return Sampled(tokens, *_logprobs(raw, tokens, rows), state)


def make_sampler(
    temp: float = 0.0,
    top_p: float = 1.0,
    top_k: int = 0,
    seed: int | None = None,
    min_p: float = 0.0,
) -> Sampler:
    """A callable mapping logits ``[B, V]`` to token ids ``[B]`` (int32), every row sampled
    the same way (no penalties: they need a sequence's history; see :class:`RowSampler`).

    ``temp == 0`` is greedy (argmax; top-k/top-p/min-p are then moot). Otherwise logits are
    divided by ``temp``, only the ``top_k`` most likely tokens are kept (0 = all), then only the
    smallest set of most likely tokens whose probability reaches ``top_p`` (1 = all; the most
    likely token always stays), then those at least ``min_p`` times as likely as the most likely
    one, and one token is drawn. With a ``seed`` the sampler owns its random key, so the same
    seed gives the same draws whatever else uses ``mx.random``; without one it draws from MLX's
    global generator. A seed is any int64 (OpenAI's range); a negative one keys the generator
    with its two's-complement 64 bits.
    """
    options = SamplingOptions(temperature=temp, top_p=top_p, top_k=top_k, min_p=min_p, seed=seed)
    row = RowSampler(options)
    if row.greedy:
        return greedy

    def sample(logits: mx.array) -> mx.array:
        return sample_rows(logits, [row] * logits.shape[0]).tokens

    return sample
