"""Serving: generation and sampling, the scheduler (admission queue, the step with its pool and
batched decode, per-sequence output), the engine, and the HTTP app with its request schemas,
limits and host/origin guard."""
