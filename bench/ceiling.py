"""The device's batched-decode ceiling for a checkpoint: one forward over ``batch`` rows per step,
no HTTP, no scheduler, no sampling beyond argmax, so a server's aggregate tokens/s can be read
against what the same model shape decodes on this machine::

    python -m bench.ceiling --model DIR --batch 1,4,16,64

The loop is the tightest one MLX users write (mlx-lm's model and plain KV caches): all rows
prefill one ``prompt_tokens``-long prompt together, then every step queues the next forward with
``mx.async_eval`` before reading the previous step's tokens, so the host never stalls the device;
the best of ``--repeats`` runs counts. ``bench.serve_compare`` runs it at each stream level's
batch size and records ``ceiling_tps``.

``--scheduler`` also times mlxc's own ``Scheduler`` in this process on the same checkpoint:
``batch`` requests submitted at once (no HTTP, no JSON, events counted and dropped), decode
timed from the moment every row has its first token. Read beside the raw ceiling and the
server's aggregate, it says whether a gap is the step (scheduler, batch cache, sampling) or the
HTTP side (event loop, SSE). ``--mlxc-batch`` times mlxc's model on its own decode batch
(``BatchCache``) in the raw loop, without the scheduler.
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


def measure(
    model_dir: str, batches: list[int], prompt_tokens: int, steps: int, repeats: int = 2
) -> dict[str, dict[int, float | list[float]]]:
    """``{"ceiling": {batch: tokens/s}, "ceiling_runs": {batch: [tokens/s, ...]}}``: the best
    of ``repeats`` timed runs per batch, each batch after one short untimed run. The best,
    because a ceiling is what the loop can do: a run that meets a shape first (a cache length,
    a kernel MLX compiles) or a busy host only lowers it (on a lent H100 the same loop read
    113 and 389 tokens/s at batch 1 in two processes)."""
    import mlx.core as mx
    from mlx_lm import load

    model, tokenizer = load(model_dir)
    if mx.default_device() == mx.cpu:  # as mlxc loads half-precision weights on a CPU
        model.set_dtype(mx.float32)
    vocab = model.args.vocab_size if hasattr(model, "args") else len(tokenizer.vocab)
    best, runs = {}, {}
    for b in batches:
        decode_tps(model, b, prompt_tokens, min(steps, 8), vocab)
        runs[b] = [decode_tps(model, b, prompt_tokens, steps, vocab) for _ in range(repeats)]
        best[b] = max(runs[b])
        mx.clear_cache()
        each = ", ".join(f"{x:.1f}" for x in runs[b])
        print(
            f"[ceiling] batch {b:>3}: {best[b]:.1f} tok/s (runs: {each})",
            file=sys.stderr,
            flush=True,
        )
    del model
    mx.clear_cache()
    return {"ceiling": best, "ceiling_runs": runs}


def mlxc_batch_tps(model_dir: str, batches: list[int], prompt_tokens: int, steps: int) -> dict:
    """``{batch: {tps, async_eval_ms, read_ms}}``: mlxc's model on its decode batch
    (``BatchCache``, rows prefilled one by one as the server does) in ``decode_tps``'s loop,
    without the scheduler; the time inside ``mx.async_eval`` and inside the token read per step
    say whether the host waits on the device, and where."""
    import mlx.core as mx
    import numpy as np

    from mlxc.runtime.checkpoint.loading import load_model
    from mlxc.runtime.model.batch import BatchCache

    model = load_model(model_dir)
    vocab = model.args.vocab_size
    out = {}
    for b in [batches[0], *batches]:
        rng = np.random.default_rng(b)
        rows, first = [], []
        for _ in range(b):
            caches = model.make_cache()
            ids = mx.array(rng.integers(3, min(vocab, 30000), (1, prompt_tokens)))
            first.append(mx.argmax(model(ids, cache=caches)[:, -1, :], axis=-1))
            mx.eval(first[-1], [a for c in caches for a in c.arrays()])
            rows.append(caches)
        batch = BatchCache.like(rows[0])
        batch.extend(rows)
        y = mx.concatenate(first)
        in_async = in_read = 0.0
        start = time.perf_counter()
        for _ in range(steps):
            nxt = mx.argmax(model(y[:, None], cache=batch)[:, -1, :], axis=-1)
            t = time.perf_counter()
            mx.async_eval(nxt)
            u = time.perf_counter()
            y.tolist()
            in_async, in_read = in_async + u - t, in_read + time.perf_counter() - u
            y = nxt
        y.tolist()
        out[b] = {
            "tps": b * steps / (time.perf_counter() - start),
            "async_eval_ms": 1e3 * in_async / steps,
            "read_ms": 1e3 * in_read / steps,
        }
        print(f"[mlxc batch] batch {b:>3}: {out[b]}", file=sys.stderr, flush=True)
        mx.clear_cache()
    return out


class _Level:
    """Counts one level's events: decode is timed from the moment every row has a token."""

    def __init__(self, rows: int) -> None:
        self.rows, self.lock = rows, threading.Lock()
        self.started: set[int] = set()
        self.finished = self.tokens = 0
        self.t0 = self.t1 = 0.0
        self.started_all, self.done = threading.Event(), threading.Event()

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
                        self.started_all.set()
                else:
                    self.tokens += 1

        return on_event


class _Timers:
    """Wall time inside some of a scheduler's methods (wrapped on the instance), per call."""

    NAMES = ("_tick", "_decode_batch", "_read_tokens", "_accept")

    def __init__(self, scheduler) -> None:
        self.total = dict.fromkeys(self.NAMES, 0.0)
        self.calls = dict.fromkeys(self.NAMES, 0)
        for name in self.NAMES:
            setattr(scheduler, name, self._wrap(name, getattr(scheduler, name)))

    def _wrap(self, name, method):
        def timed(*args, **kwargs):
            start = time.perf_counter()
            try:
                return method(*args, **kwargs)
            finally:
                self.total[name] += time.perf_counter() - start
                self.calls[name] += 1

        return timed

    def reset(self) -> None:
        self.total = dict.fromkeys(self.NAMES, 0.0)
        self.calls = dict.fromkeys(self.NAMES, 0)

    def per_tick_ms(self) -> dict[str, float]:
        ticks = max(self.calls["_tick"], 1)
        return {name.strip("_"): 1e3 * t / ticks for name, t in self.total.items()}


def scheduler_tps(model_dir: str, batches: list[int], prompt_tokens: int, steps: int) -> dict:
    """``{batch: tokens/s}`` of mlxc's Scheduler decoding ``batch`` requests together, and
    ``{batch: {method: ms per tick}}`` of where its thread spent the decode (the tick's total,
    building the batched step, reading its tokens (a device wait plus ``accept``), ``accept``
    alone: detokenizing, stop strings, events)."""
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
        prefix_cache_bytes=0,  # every level's prompts prefill in full, the warm-up's included
    )
    timers = _Timers(scheduler)
    scheduler.start()
    params = SamplingParams(max_tokens=steps + 1, ignore_eos=True)
    out, breakdown = {}, {}
    for i, b in enumerate([batches[0], *batches]):  # the first level is untimed: kernels compile
        rng = np.random.default_rng(b)
        level = _Level(b)
        for row in range(b):
            ids = [int(x) for x in rng.integers(3, min(vocab, 30000), prompt_tokens)]
            scheduler.submit(ids, params, level.emit(row))
        level.started_all.wait()
        timers.reset()
        level.done.wait()
        if i:
            out[b] = level.tokens / (level.t1 - level.t0)
            breakdown[b] = timers.per_tick_ms()
            times = ", ".join(f"{k} {v:.2f}" for k, v in breakdown[b].items())
            print(
                f"[scheduler] batch {b:>3}: {out[b]:.1f} tok/s; ms per tick: {times}",
                file=sys.stderr,
                flush=True,
            )
    scheduler.stop()
    return out, breakdown


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m bench.ceiling", description=__doc__)
    p.add_argument("--model", required=True, help="checkpoint directory mlx-lm can load")
    p.add_argument("--batch", default="1,4,16,64", help="batch sizes, comma-separated")
    p.add_argument("--prompt-tokens", type=int, default=64)
    p.add_argument("--steps", type=int, default=64)
    p.add_argument("--repeats", type=int, default=2, help="timed runs per batch; the best counts")
    p.add_argument("--scheduler", action="store_true", help="also time mlxc's Scheduler")
    p.add_argument("--mlxc-batch", action="store_true", help="also time mlxc's decode batch")
    args = p.parse_args(argv)
    try:  # the optimised CPU BLAS mlxc picks, before MLX loads (a no-op on GPU backends)
        from mlxc.runtime import blas

        blas.preload()
    except ImportError:
        pass
    batches = [int(x) for x in args.batch.split(",")]
    result = measure(args.model, batches, args.prompt_tokens, args.steps, args.repeats)
    if args.mlxc_batch:
        result["mlxc_batch"] = mlxc_batch_tps(args.model, batches, args.prompt_tokens, args.steps)
    if args.scheduler:
        tps, breakdown = scheduler_tps(args.model, batches, args.prompt_tokens, args.steps)
        result["scheduler"], result["scheduler_ms_per_tick"] = tps, breakdown
    print(json.dumps(result))
    return 0


if __name__ == "__main__":
    sys.exit(main())
