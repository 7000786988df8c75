"""Where a decode step (and a prefill) spends its time: mlxc against mlx-lm, same weights.

    python -m bench.profile_decode --arch qwen3 --size small [--device cpu|gpu]

Runs both models under ONE identical loop (so the loops' differences drop out), then each under
its own generation loop, and reports per step: host time to build the graph (Python), time to
evaluate it, and the total; plus a few mlxc variants that isolate candidate costs:

* prefill projecting only the last position onto the vocabulary, two ways: slicing the hidden
  state before ``lm_head`` (one pass; what ``generate_tokens`` does on a GPU), or mlx-lm's way,
  all but the last token with only the caches evaluated, then a one-token step (what
  ``generate_tokens`` does on a CPU: the first pass skips the last layer's attention output
  and MLP, ``runtime.serving.generate.prefill_chunks``).

A compiled decode step was measured once, by a prototype since removed: it does not pay on the
CUDA backend (``bench/results/gpu-h200-compiled-decode-proto.md``).

Numbers are medians over ``--steps`` steps after ``--warmup`` steps.
"""

from __future__ import annotations

import argparse
import itertools
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path

from bench.report import write_results


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(prog="python -m bench.profile_decode")
    p.add_argument("--arch", default="qwen3")
    p.add_argument("--size", default="small")
    p.add_argument("--device", choices=["cpu", "gpu"], default="cpu")
    p.add_argument("--prompt", type=int, default=256)
    p.add_argument("--steps", type=int, default=48)
    p.add_argument("--warmup", type=int, default=8)
    p.add_argument("--work-dir", default=None)
    p.add_argument("--out", default=None, help="write OUT.json")
    args = p.parse_args(argv)

    from mlxc.runtime import blas

    st = blas.preload(args.device)
    import mlx.core as mx
    from mlx_lm.models.cache import make_prompt_cache
    from mlx_lm.utils import load_model as peer_load

    import mlxc
    from bench import models
    from bench.harness import prompt

    mx.set_default_device(mx.gpu if args.device == "gpu" else mx.cpu)
    print(st.reason, file=sys.stderr)
    work = Path(args.work_dir or tempfile.mkdtemp(prefix="mlxc-prof-"))
    ckpt = work / f"{args.arch}-{args.size}-bf16"
    if not (ckpt / "config.json").exists():
        models.write_checkpoint(ckpt, args.arch, args.size)
    ours = mlxc.load_model(ckpt)
    peer, _ = peer_load(ckpt)
    if args.device == "cpu":
        peer.set_dtype(mx.float32)  # the same compute dtype as mlxc on the CPU
    mx.eval(peer.parameters())
    vocab = json.loads((ckpt / "config.json").read_text())["vocab_size"]
    ids = prompt(args.prompt, vocab, 1)
    report: dict = {"device": args.device, "arch": args.arch, "size": args.size, "blas": st.name}

    def same_loop(model, cache):
        """Prefill, then decode steps: (build seconds, eval seconds) per step."""
        logits = model(mx.array([ids]), cache=cache)
        y = mx.argmax(logits[:, -1, :], axis=-1)
        mx.eval(y)
        builds, evals = [], []
        for _ in range(args.warmup + args.steps):
            t0 = time.perf_counter()
            logits = model(y[:, None], cache=cache)
            y = mx.argmax(logits[:, -1, :], axis=-1)
            t1 = time.perf_counter()
            mx.eval(y)
            t2 = time.perf_counter()
            builds.append(t1 - t0)
            evals.append(t2 - t1)
        b, e = builds[args.warmup :], evals[args.warmup :]
        return {
            "build_ms": 1e3 * statistics.median(b),
            "eval_ms": 1e3 * statistics.median(e),
            "step_ms": 1e3 * statistics.median(x + y for x, y in zip(b, e, strict=True)),
        }

    report["same_loop"] = {
        "mlxc": same_loop(ours, ours.make_cache()),
        "mlx-lm": same_loop(peer, make_prompt_cache(peer)),
    }

    def own_loop(side_gen):
        times = []
        for _ in side_gen():
            times.append(time.perf_counter())
        d = [b - a for a, b in itertools.pairwise(times)][args.warmup :]
        return {"step_ms": 1e3 * statistics.median(d)}

    from mlx_lm.generate import generate_step

    from mlxc.runtime.serving.generate import generate_tokens

    n = args.warmup + args.steps + 1
    report["own_loop"] = {
        "mlxc": own_loop(lambda: generate_tokens(ours, ids, max_tokens=n)),
        "mlx-lm": own_loop(
            lambda: (t for t, _ in generate_step(mx.array(ids), peer, max_tokens=n))
        ),
    }

    # Prefill: every position's logits (mlxc today), the last position's only (one pass,
    # hidden state sliced before the vocabulary projection), or mlx-lm's way (all but the last
    # token, then a one-token step).
    def project_last(model, x, cache):
        h = model.model(x, cache)[:, -1:, :]
        if model.args.tie_word_embeddings:
            return model.model.embed_tokens.as_linear(h)
        return model.lm_head(h)

    def prefill(model, cache_fn, last_only, reps: int = 3) -> float:
        ts = []
        for _ in range(reps):
            cache = cache_fn()
            t0 = time.perf_counter()
            if last_only == "slice":
                out = project_last(model, mx.array([ids]), cache)
            elif last_only:
                body = model(mx.array([ids[:-1]]), cache=cache)
                del body
                mx.eval([a for c in cache for a in vars(c).values() if isinstance(a, mx.array)])
                out = model(mx.array([ids[-1:]]), cache=cache)
            else:
                out = model(mx.array([ids]), cache=cache)[:, -1, :]
            mx.eval(mx.argmax(out.reshape(-1, out.shape[-1])[-1]))
            ts.append(time.perf_counter() - t0)
        return len(ids) / statistics.median(ts)

    report["prefill_tps"] = {
        "mlxc all positions": prefill(ours, ours.make_cache, False),
        "mlxc last position (L-1, then 1)": prefill(ours, ours.make_cache, True),
        "mlxc last position (sliced hidden)": prefill(ours, ours.make_cache, "slice"),
        "mlx-lm all positions": prefill(peer, lambda: make_prompt_cache(peer), False),
        "mlx-lm last position (L-1, then 1)": prefill(peer, lambda: make_prompt_cache(peer), True),
    }
    print(json.dumps(report, indent=1))
    if args.out:
        write_results(args.out, report, None)


if __name__ == "__main__":
    main()
