"""Measurements: prefill and decode tokens/s, peak memory, KV bytes per token, for one model.

A *side* is a loaded model plus the generation loop its users run: mlxc's ``generate_tokens``
for ours, mlx-lm's ``generate_step`` for the peer, both greedy, each with its default prefill
chunking (mlxc 512, mlx-lm 2048). Prefill tokens/s is prompt length / time to the first token;
decode tokens/s counts the tokens after the first over the time after the first.

Peak memory is the side's own weights plus the largest extra active memory during the run
(``mx.get_peak_memory`` after ``mx.reset_peak_memory``, minus what was active before), so two
models resident in one process do not inflate each other's numbers.
"""

from __future__ import annotations

import itertools
import statistics
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any

import mlx.core as mx
import numpy as np
from mlx.utils import tree_flatten


@dataclass
class Side:
    """One model under test and the generation loop its users run."""

    name: str  # "mlxc", "mlx-lm", "mlx-lm f32"
    kind: str  # "ours" | "peer"
    model: object
    dtype: str  # compute dtype of the weights, e.g. "float32", "bfloat16", "q4/float32"
    weight_bytes: int = 0
    kv_quant: Any = None  # ours only: a runtime.model.cache.KVQuant (--kv-bits); None: float KV

    def __post_init__(self) -> None:
        self.weight_bytes = sum(v.nbytes for _, v in tree_flatten(self.model.parameters()))

    def make_cache(self) -> list:
        if self.kind == "ours":
            from mlxc.runtime.model.cache import make_caches

            return make_caches(self.model, self.kv_quant)
        from mlx_lm.models.cache import make_prompt_cache

        return make_prompt_cache(self.model)

    def generate(self, ids: list[int], max_tokens: int, cache: list) -> Iterator[int]:
        if self.kind == "ours":
            from mlxc.runtime.serving.generate import generate_tokens

            return generate_tokens(self.model, ids, max_tokens=max_tokens, cache=cache)
        from mlx_lm.generate import generate_step

        steps = generate_step(mx.array(ids), self.model, max_tokens=max_tokens, prompt_cache=cache)
        return (tok for tok, _ in steps)


@dataclass
class Run:
    first_s: float  # time to the first token (prefill + one step)
    decode_tps: float | None  # tokens/s after the first token (None with one token)
    step_ms: list[float]  # the time between consecutive tokens after the first, per token
    peak_bytes: int  # own weights + the run's extra peak
    kv_bytes_per_token: float
    tokens: list[int] = field(default_factory=list)


def kv_bytes_per_token(cache: list) -> float:
    """Bytes of KV state per cached token, summed over layers (slots, not spare capacity).

    Every array of rank >= 3 on a layer cache (its ``arrays()``, quantised parts included; the
    peer's: its attributes) is taken to run along its second-last axis (keys/values
    ``[B, H, T, D]``, MLA latents ``[B, 1, T, R]``). A quantised cache's staging buffers
    (``cache.StagingMixin``: its newest tokens, up to 32, in float on CUDA) are a fixed size
    per layer, not per token: left out, as spare capacity is.
    """
    total = 0.0
    for c in cache:
        if c is None or not getattr(c, "holds_keys", True):
            continue  # recurrent state (mlxc's kind): a fixed size, not per token
        arrays = c.arrays() if hasattr(c, "arrays") else vars(c).values()
        staging = {id(getattr(c, name, None)) for name in ("recent_keys", "recent_values")}
        for v in arrays:
            if isinstance(v, mx.array) and v.ndim >= 3 and v.shape[-2] > 0 and id(v) not in staging:
                total += v.nbytes / v.shape[-2]
    return total


def run_once(side: Side, ids: list[int], max_tokens: int) -> Run:
    mx.clear_cache()
    base = mx.get_active_memory()
    mx.reset_peak_memory()
    cache = side.make_cache()
    times, tokens = [], []
    start = time.perf_counter()
    for tok in side.generate(ids, max_tokens, cache):
        times.append(time.perf_counter())
        tokens.append(tok)
    peak = mx.get_peak_memory() - base
    if not times:
        raise RuntimeError(f"{side.name} generated no token")
    decode = (len(times) - 1) / (times[-1] - times[0]) if len(times) > 1 else None
    return Run(
        first_s=times[0] - start,
        decode_tps=decode,
        step_ms=[1e3 * (b - a) for a, b in itertools.pairwise(times)],
        peak_bytes=side.weight_bytes + max(peak, 0),
        kv_bytes_per_token=kv_bytes_per_token(cache),
        tokens=tokens,
    )


def prompt(n: int, vocab: int, seed: int = 0) -> list[int]:
    """A deterministic prompt of ``n`` token ids (random ids: the model is random too)."""
    rng = np.random.default_rng(seed)
    return [int(x) for x in rng.integers(3, min(vocab, 30000), n)]


def in_turn(items: Sequence, round_: int) -> list:
    """``items`` in the order of round ``round_``: rotated by the round, so that over
    ``len(items)`` rounds each takes every place equally often. The first run of a round ran
    7-16% slower than the same code run later in it (an H100, s40, decode after a prompt), so a
    fixed order would favour whatever never goes first."""
    k = round_ % len(items) if items else 0
    return [*items[k:], *items[:k]]


@dataclass
class Cell:
    """Repeated runs of one measurement on several sides, interleaved (ours, peer, ours, ...)."""

    label: str
    ids: list[int]
    max_tokens: int


def measure(
    sides: list[Side],
    cell: Cell,
    *,
    repeats: int,
    budget_s: float,
    warmup: bool,
    log: Callable[[str], None] = print,
) -> dict[str, dict]:
    """Median over up to ``repeats`` interleaved runs (stopping once ``budget_s`` is spent),
    each repeat taking the sides in turn (``in_turn``)."""
    if warmup:
        for side in sides:
            run_once(side, cell.ids, cell.max_tokens)
    runs: dict[str, list[Run]] = {s.name: [] for s in sides}
    start = time.perf_counter()
    for r in range(repeats):
        for side in in_turn(sides, r):
            runs[side.name].append(run_once(side, cell.ids, cell.max_tokens))
        if time.perf_counter() - start > budget_s and r + 1 < repeats:
            log(f"    {cell.label}: time budget spent after {r + 1} repeat(s)")
            break
    out = {}
    for side in sides:
        rs = runs[side.name]
        first = statistics.median(r.first_s for r in rs)
        decodes = [r.decode_tps for r in rs if r.decode_tps is not None]
        steps = [r for r in rs if r.step_ms]
        out[side.name] = {
            "prefill_tps": len(cell.ids) / first,
            "first_token_s": first,
            "decode_tps": statistics.median(decodes) if decodes else None,
            "peak_bytes": max(r.peak_bytes for r in rs),
            "kv_bytes_per_token": rs[-1].kv_bytes_per_token,
            "repeats": len(rs),
            "first_token_s_all": [round(r.first_s, 5) for r in rs],
            "decode_tps_all": [round(d, 3) for d in decodes],
            # The typical step and the longest: a mean rate well under 1000 / median step
            # means some steps stalled (the machine, a compile), not that every step is slow.
            "decode_step_ms_median": (
                statistics.median(statistics.median(r.step_ms) for r in steps) if steps else None
            ),
            "decode_step_ms_max": max(max(r.step_ms) for r in steps) if steps else None,
            "tokens": rs[-1].tokens[:8],
        }
        log(
            f"    {cell.label:>14} {side.name:<12} prefill {out[side.name]['prefill_tps']:9.1f} tok/s"
            + (
                f"  decode {out[side.name]['decode_tps']:8.2f} tok/s"
                if out[side.name]["decode_tps"]
                else ""
            )
            + f"  peak {out[side.name]['peak_bytes'] / 2**20:8.1f} MiB  ({len(rs)}x)"
        )
    return out
