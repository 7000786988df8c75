"""The device's batched-decode ceiling for a checkpoint: one forward over ``batch`` rows per step,
no HTTP, no scheduler, no sampling beyond argmax, so a server's aggregate tokens/s can be read
against what the same model shape decodes on this machine::

    python -m bench.ceiling --model DIR --batch 1,4,16,64

The loop is the tightest one MLX users write (mlx-lm's model and plain KV caches): all rows
prefill one ``prompt_tokens``-long prompt together, then every step queues the next forward with
``mx.async_eval`` before reading the previous step's tokens, so the host never stalls the device.
``bench.serve_compare`` runs it at each stream level's batch size and records ``ceiling_tps``.

``--scheduler`` also times mlxc's own ``Scheduler`` in this process on the same checkpoint:
``batch`` requests submitted at once (no HTTP, no JSON, events counted and dropped), decode
timed from the moment every row has its first token. Read beside the raw ceiling and the
server's aggregate, it says whether a gap is the step (scheduler, batch cache, sampling) or the
HTTP side (event loop, SSE).
"""

from __future__ import annotations

import argparse
import json
import sys
import threading
import time


def decode_tps(model, batch: int, prompt_tokens: int, steps: int, vocab: int) -> float:
    """Aggregate decode tokens/s (``batch * steps`` over the decode time) of one run."""
    import mlx.core as mx
    import numpy as np
    from mlx_lm.models.cache import make_prompt_cache

    rng = np.random.default_rng(batch)
    ids = mx.array(rng.integers(3, min(vocab, 30000), (batch, prompt_tokens)))
    cache = make_prompt_cache(model)

    def step(tokens):
        return mx.argmax(model(tokens, cache=cache)[:, -1, :], axis=-1)

    y = step(ids)
    mx.eval(y)
    start = time.perf_counter()
    for _ in range(steps):
        nxt = step(y[:, None])
        mx.async_eval(nxt)
        y.tolist()  # the host reads each step's tokens, one step behind, as a server must
        y = nxt
    y.tolist()
    return batch * steps / (time.perf_counter() - start)


def measure(model_dir: str, batches: list[int], prompt_tokens: int, steps: int) -> dict[int, float]:
    """``{batch: tokens/s}``, each after one untimed warm-up run of the same batch."""
    import mlx.core as mx
    from mlx_lm import load

    model, tokenizer = load(model_dir)
    if mx.default_device() == mx.cpu:  # as mlxc loads half-precision weights on a CPU
        model.set_dtype(mx.float32)
    vocab = model.args.vocab_size if hasattr(model, "args") else len(tokenizer.vocab)
    out = {}
    for b in batches:
        decode_tps(model, b, prompt_tokens, min(steps, 8), vocab)
        out[b] = decode_tps(model, b, prompt_tokens, steps, vocab)
        mx.clear_cache()
        print(f"[ceiling] batch {b:>3}: {out[b]:.1f} tok/s", file=sys.stderr, flush=True)
    del model
    mx.clear_cache()
    return out


class _Level:
    """Counts one level's events: decode is timed from the moment every row has a token."""

    def __init__(self, rows: int) -> None:
        self.rows, self.lock = rows, threading.Lock()
        self.started: set[int] = set()
        self.finished = self.tokens = 0
        self.t0 = self.t1 = 0.0
        self.done = threading.Event()

    def emit(self, row: int):
        from mlxc.runtime.serving.scheduler import Delta

        def on_event(event) -> None:  # the scheduler thread
            with self.lock:
                if not isinstance(event, Delta):
                    self.finished += 1
                    if self.finished == self.rows:
                        self.t1 = time.perf_counter()
                        self.done.set()
                elif row not in self.started:
                    self.started.add(row)
                    if len(self.started) == self.rows:
                        self.t0, self.tokens = time.perf_counter(), 0
                else:
                    self.tokens += 1

        return on_event


def scheduler_tps(model_dir: str, batches: list[int], prompt_tokens: int, steps: int) -> dict:
    """``{batch: tokens/s}`` of mlxc's Scheduler decoding ``batch`` requests together."""
    import numpy as np

    from mlxc.runtime.checkpoint.loading import load_checkpoint
    from mlxc.runtime.serving.scheduler import SamplingParams, Scheduler

    ckpt = load_checkpoint(model_dir)
    vocab = len(ckpt.tokenizer)
    most = max(batches)
    scheduler = Scheduler(
        None,
        ckpt.tokenizer,
        load=ckpt.load_model,
        eos_token_ids=ckpt.eos_token_ids,
        max_concurrency=most,
        max_queue=most,
    )
    scheduler.start()
    params = SamplingParams(max_tokens=steps + 1, ignore_eos=True)
    out = {}
    for i, b in enumerate([batches[0], *batches]):  # the first level is untimed: kernels compile
        rng = np.random.default_rng(b)
        level = _Level(b)
        for row in range(b):
            ids = [int(x) for x in rng.integers(3, min(vocab, 30000), prompt_tokens)]
            scheduler.submit(ids, params, level.emit(row))
        level.done.wait()
        if i:
            out[b] = level.tokens / (level.t1 - level.t0)
            print(f"[scheduler] batch {b:>3}: {out[b]:.1f} tok/s", file=sys.stderr, flush=True)
    scheduler.stop()
    return out


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m bench.ceiling", description=__doc__)
    p.add_argument("--model", required=True, help="checkpoint directory mlx-lm can load")
    p.add_argument("--batch", default="1,4,16,64", help="batch sizes, comma-separated")
    p.add_argument("--prompt-tokens", type=int, default=64)
    p.add_argument("--steps", type=int, default=64)
    p.add_argument("--scheduler", action="store_true", help="also time mlxc's Scheduler")
    args = p.parse_args(argv)
    try:  # the optimised CPU BLAS mlxc picks, before MLX loads (a no-op on GPU backends)
        from mlxc.runtime import blas

        blas.preload()
    except ImportError:
        pass
    batches = [int(x) for x in args.batch.split(",")]
    result = {"ceiling": measure(args.model, batches, args.prompt_tokens, args.steps)}
    if args.scheduler:
        result["scheduler"] = scheduler_tps(args.model, batches, args.prompt_tokens, args.steps)
    print(json.dumps(result))
    return 0


if __name__ == "__main__":
    sys.exit(main())
