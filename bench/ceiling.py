"""The device's batched-decode ceiling for a checkpoint: one forward over ``batch`` rows per step,
no HTTP, no scheduler, no sampling beyond argmax, so a server's aggregate tokens/s can be read
against what the same model shape decodes on this machine::

    python -m bench.ceiling --model DIR --batch 1,4,16,64

The loop is the tightest one MLX users write (mlx-lm's model and plain KV caches): all rows
prefill one ``prompt_tokens``-long prompt together, then every step queues the next forward with
``mx.async_eval`` before reading the previous step's tokens, so the host never stalls the device.
``bench.serve_compare`` runs it at each stream level's batch size and records ``ceiling_tps``.
"""

from __future__ import annotations

import argparse
import json
import sys
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


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m bench.ceiling", description=__doc__)
    p.add_argument("--model", required=True, help="checkpoint directory mlx-lm can load")
    p.add_argument("--batch", default="1,4,16,64", help="batch sizes, comma-separated")
    p.add_argument("--prompt-tokens", type=int, default=64)
    p.add_argument("--steps", type=int, default=64)
    args = p.parse_args(argv)
    try:  # the optimised CPU BLAS mlxc picks, before MLX loads (a no-op on GPU backends)
        from mlxc.runtime import blas

        blas.preload()
    except ImportError:
        pass
    batches = [int(x) for x in args.batch.split(",")]
    print(json.dumps(measure(args.model, batches, args.prompt_tokens, args.steps)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
