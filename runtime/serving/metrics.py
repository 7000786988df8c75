"""Prometheus metrics of ``mlxc serve`` (``GET /metrics``, text format, ``prometheus-client``).

One registry per process (a process serves one model): any layer increments these names
directly (``from mlxc.runtime.serving import metrics; metrics.PREFIX_CACHE_HITS.inc()``). The
gauges (queue depth, running sequences, KV bytes) are read from the scheduler's published stats
at each scrape (:func:`render`), so nothing on the scheduler thread writes them.

Exposed names (counters get prometheus' ``_total`` suffix):

- ``mlxc_requests_total{endpoint, status}``: completion requests answered, by HTTP status
  (``endpoint`` is ``chat`` or ``completions``; a stream counts its status when it starts);
- ``mlxc_request_finished_total{reason}``: generations that ended, by finish reason (``stop``,
  ``length``) or ``failed``;
- ``mlxc_prompt_tokens_total``, ``mlxc_generation_tokens_total``: tokens of finished requests;
- ``mlxc_prefix_cache_hits_total``: requests whose prompt reused cached prefix tokens, and
  ``mlxc_prefix_cache_hit_tokens_total``: the prompt tokens so reused (the prefix cache's);
- ``mlxc_spec_decode_steps_total``, ``mlxc_spec_decode_draft_tokens_total``,
  ``mlxc_spec_decode_accepted_tokens_total``: verification steps of ``--prompt-lookup``, the
  drafts they verified and the drafts kept (summed over the rows of each step);
- ``mlxc_forwards_total{kind}``: the scheduler's model forwards, by kind: ``decode`` (the
  batched step, or a sequence's own step), ``prefill`` (a prompt chunk, or prompts prefilled
  together) and ``verify`` (a speculative verification); on a GPU a forward costs about its
  kernel launches whatever its tokens, so prefill forwards per decode forward say how much of
  a loaded server's device time goes to arriving prompts (the scheduler's CUDA warm-up, its
  throwaway requests before serving, counts in none of these);
- ``mlxc_scheduler_seconds_total{phase}``: wall time of the scheduler thread, by phase:
  ``build`` (the batched decode step's graph), ``dispatch`` (its ``mx.async_eval``: MLX
  encodes the step; on CUDA it also waits for the device about a step's time), ``read``
  (waiting for a step's tokens), ``hand_out`` (giving each sequence its token: grammars,
  detokenising, stop checks, events), ``prefill`` (prompt forwards, and the steps of a
  sequence outside the batch, built and evaluated; prompt batches joined to the batch),
  ``verify`` (speculative steps, whole) and ``tick`` (every tick whole: the phases plus
  cancellations, joins and bookkeeping). Per decode forward, they say where a loaded server's
  step goes beyond the forward itself (``bench.serve_compare`` reports them);
- ``mlxc_queue_depth``, ``mlxc_running_sequences``, ``mlxc_kv_cache_bytes``: gauges;
- ``mlxc_time_to_first_token_seconds``: from the request's arrival to its first token;
- ``mlxc_inter_token_latency_seconds``: between a request's successive tokens;
- ``mlxc_request_latency_seconds``: from arrival to the end of the generation.
"""

from __future__ import annotations

from typing import Any

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from prometheus_client.exposition import CONTENT_TYPE_LATEST

REGISTRY = CollectorRegistry()
CONTENT_TYPE = CONTENT_TYPE_LATEST

REQUESTS = Counter(
    "mlxc_requests",
    "Completion requests answered, by endpoint and HTTP status.",
    ["endpoint", "status"],
    registry=REGISTRY,
)
FINISHED = Counter(
    "mlxc_request_finished",
    "Generations that ended, by finish reason (stop, length) or failed.",
    ["reason"],
    registry=REGISTRY,
)
PROMPT_TOKENS = Counter(
    "mlxc_prompt_tokens", "Prompt tokens of finished requests.", registry=REGISTRY
)
GENERATION_TOKENS = Counter(
    "mlxc_generation_tokens", "Generated tokens of finished requests.", registry=REGISTRY
)
PREFIX_CACHE_HITS = Counter(
    "mlxc_prefix_cache_hits",
    "Requests whose prompt reused cached prefix tokens (incremented by the prefix cache).",
    registry=REGISTRY,
)
PREFIX_CACHE_HIT_TOKENS = Counter(
    "mlxc_prefix_cache_hit_tokens",
    "Prompt tokens served from the prefix cache instead of prefilled.",
    registry=REGISTRY,
)
SPEC_STEPS = Counter(
    "mlxc_spec_decode_steps",
    "Speculative verification steps of the decode batch.",
    registry=REGISTRY,
)
SPEC_DRAFT_TOKENS = Counter(
    "mlxc_spec_decode_draft_tokens",
    "Draft tokens verified (summed over the rows of each step).",
    registry=REGISTRY,
)
SPEC_ACCEPTED_TOKENS = Counter(
    "mlxc_spec_decode_accepted_tokens",
    "Draft tokens kept after verification (summed over the rows of each step).",
    registry=REGISTRY,
)
FORWARDS = Counter(
    "mlxc_forwards",
    "Model forwards of the scheduler, by kind (decode, prefill, verify).",
    ["kind"],
    registry=REGISTRY,
)
# Bound once: the scheduler counts every forward, and ``labels()`` looks its child up each call.
FORWARD_KINDS = ("decode", "prefill", "verify")
DECODE_FORWARDS, PREFILL_FORWARDS, VERIFY_FORWARDS = (FORWARDS.labels(k) for k in FORWARD_KINDS)


def forward_counts() -> dict[str, float]:
    """``mlxc_forwards_total`` so far, by kind (benchmarks and tests read differences of it)."""
    value = REGISTRY.get_sample_value
    return {kind: value("mlxc_forwards_total", {"kind": kind}) or 0.0 for kind in FORWARD_KINDS}


SCHEDULER_SECONDS = Counter(
    "mlxc_scheduler_seconds",
    "Wall time of the scheduler thread, by phase (build, dispatch, read, hand_out, prefill, "
    "verify; tick: whole ticks).",
    ["phase"],
    registry=REGISTRY,
)
SCHEDULER_PHASES = ("build", "dispatch", "read", "hand_out", "prefill", "verify", "tick")


def scheduler_seconds() -> dict[str, float]:
    """``mlxc_scheduler_seconds_total`` so far, by phase (tests read differences of it; a
    served benchmark reads ``/metrics``)."""
    value = REGISTRY.get_sample_value
    return {
        phase: value("mlxc_scheduler_seconds_total", {"phase": phase}) or 0.0
        for phase in SCHEDULER_PHASES
    }


QUEUE_DEPTH = Gauge("mlxc_queue_depth", "Requests waiting for a slot.", registry=REGISTRY)
RUNNING = Gauge(
    "mlxc_running_sequences", "Sequences admitted (prefilling or decoding).", registry=REGISTRY
)
KV_BYTES = Gauge(
    "mlxc_kv_cache_bytes", "Bytes held by the running sequences' caches.", registry=REGISTRY
)
_LATENCY = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120)
TIME_TO_FIRST_TOKEN = Histogram(
    "mlxc_time_to_first_token_seconds",
    "From a request's arrival to its first generated token.",
    buckets=_LATENCY,
    registry=REGISTRY,
)
INTER_TOKEN_LATENCY = Histogram(
    "mlxc_inter_token_latency_seconds",
    "Between successive generated tokens of a request.",
    buckets=(0.001, 0.0025, 0.005, 0.01, 0.02, 0.04, 0.08, 0.16, 0.32, 0.64, 1.28, 2.56),
    registry=REGISTRY,
)
REQUEST_LATENCY = Histogram(
    "mlxc_request_latency_seconds",
    "From a request's arrival to the end of its generation.",
    buckets=_LATENCY,
    registry=REGISTRY,
)


# The families the scheduler counts. When HTTP runs in a process of its own
# (``runtime.serving.frontend``) the engine's process holds these and the HTTP process the rest;
# its ``/metrics`` joins the two.
ENGINE_FAMILIES = frozenset(
    {
        "mlxc_prefix_cache_hits",
        "mlxc_prefix_cache_hit_tokens",
        "mlxc_spec_decode_steps",
        "mlxc_spec_decode_draft_tokens",
        "mlxc_spec_decode_accepted_tokens",
        "mlxc_forwards",
        "mlxc_scheduler_seconds",
    }
)


class _Families:
    """A collector of some of ``REGISTRY``'s metric families."""

    def __init__(self, keep) -> None:
        self.keep = keep

    def collect(self):
        return [family for family in REGISTRY.collect() if self.keep(family.name)]


def _text(keep) -> bytes:
    registry = CollectorRegistry(auto_describe=False)
    registry.register(_Families(keep))
    return generate_latest(registry)


def render(stats: dict[str, Any], engine_text: bytes | None = None) -> bytes:
    """The exposition text, with the gauges set from ``Scheduler.stats()``. ``engine_text``:
    the engine process's :func:`render_engine` (HTTP in a process of its own), which replaces
    this process's copies of those families."""
    QUEUE_DEPTH.set(stats["waiting"])
    RUNNING.set(stats["running"])
    KV_BYTES.set(stats["pool"]["bytes"])
    if engine_text is None:
        return generate_latest(REGISTRY)
    return _text(lambda name: name not in ENGINE_FAMILIES) + engine_text


def render_engine() -> bytes:
    """The engine process's share of the exposition text: the :data:`ENGINE_FAMILIES`."""
    return _text(lambda name: name in ENGINE_FAMILIES)


class TokenClock:
    """One request's token timing: time to first token, then the gaps between tokens."""

    def __init__(self, arrival: float) -> None:
        self.arrival = arrival
        self.last: float | None = None

    def token(self, now: float) -> None:
        if self.last is None:
            TIME_TO_FIRST_TOKEN.observe(now - self.arrival)
        else:
            INTER_TOKEN_LATENCY.observe(now - self.last)
        self.last = now

    def finished(self, now: float, reason: str, prompt_tokens: int, completion_tokens: int):
        FINISHED.labels(reason=reason).inc()
        PROMPT_TOKENS.inc(prompt_tokens)
        GENERATION_TOKENS.inc(completion_tokens)
        REQUEST_LATENCY.observe(now - self.arrival)
