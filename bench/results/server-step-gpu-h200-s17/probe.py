"""Probe: per decode step at batch B (medium llama), mlx-lm plain-cache ceiling vs mlxc's model on
its BatchCache with equal rows and with ragged rows, and ragged + sample_rows; host build ms,
async_eval ms, read ms, total ms per step."""

import tempfile
import time
from pathlib import Path

import mlx.core as mx
import numpy as np

from bench import models


def loop(step, y, steps, label, B):
    tb = ta = tr = 0.0
    for _ in range(4):
        nxt = step(y)
        mx.async_eval(nxt)
        y.tolist()
        y = nxt
    start = time.perf_counter()
    for _ in range(steps):
        t0 = time.perf_counter()
        nxt = step(y)
        t1 = time.perf_counter()
        mx.async_eval(nxt)
        t2 = time.perf_counter()
        y.tolist()
        t3 = time.perf_counter()
        tb += t1 - t0
        ta += t2 - t1
        tr += t3 - t2
        y = nxt
    y.tolist()
    tot = (time.perf_counter() - start) / steps
    print(
        f"B={B:3d} {label:28s} step {tot * 1e3:6.2f} ms  build {tb / steps * 1e3:5.2f}  async_eval {ta / steps * 1e3:5.2f}  read {tr / steps * 1e3:5.2f}  tok/s {B / tot:8.0f}",
        flush=True,
    )
    return y


import os

SIZE = os.environ.get("SIZE", "medium")
BATCHES = [int(x) for x in os.environ.get("BATCHES", "1,16,64").split(",")]
STEPS = int(os.environ.get("STEPS", "64"))


def main():
    tmp = Path(tempfile.mkdtemp())
    path = tmp / "m"
    models.write_checkpoint(path, "llama", SIZE)
    models.write_tokenizer(path, models.config("llama", SIZE)["vocab_size"])
    from mlx_lm import load
    from mlx_lm.models.cache import make_prompt_cache

    from mlxc.runtime.checkpoint.loading import load_model
    from mlxc.runtime.model.batch import BatchCache

    peer, _ = load(str(path))
    ours = load_model(str(path))
    for B in BATCHES:
        rng = np.random.default_rng(B)
        ids = mx.array(rng.integers(3, 30000, (B, 512)))
        cache = make_prompt_cache(peer)
        y = mx.argmax(peer(ids, cache=cache)[:, -1, :], axis=-1)
        mx.eval(y)
        loop(
            lambda y, cache=cache: mx.argmax(peer(y[:, None], cache=cache)[:, -1, :], axis=-1),
            y,
            STEPS,
            "mlx-lm plain (ceiling)",
            B,
        )
        for ragged in (False, True):
            rows, first = [], []
            for b in range(B):
                n = 512 - ((b * 37) % 128 if ragged else 0)
                c = ours.make_cache()
                first.append(mx.argmax(ours(ids[b : b + 1, :n], cache=c)[:, -1, :], axis=-1))
                mx.eval(first[-1], [a for x in c for a in x.arrays()])
                rows.append(c)
            batch = BatchCache.like(rows[0])
            batch.extend(rows)
            y = mx.concatenate(first)
            loop(
                lambda y, batch=batch: mx.argmax(ours(y[:, None], cache=batch)[:, -1, :], axis=-1),
                y,
                STEPS,
                f"mlxc batch {'ragged' if ragged else 'equal'}",
                B,
            )
        mx.clear_cache()


main()
