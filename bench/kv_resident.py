"""Resident KV memory under ``--max-kv-size N`` while a generation runs 10x past N.

Loads a benchmark checkpoint (``bench.models``, written to a temporary directory unless
``--model`` is given), generates ``--factor`` x N tokens greedily with ``max_kv_size=N``, and
samples the caches' live bytes, their allocated buffer bytes and MLX's active memory every
N/4 tokens. Flat means: once the window is full, allocated KV bytes and active memory stop
growing::

    python -m bench.kv_resident --arch llama --max-kv-size 256 --out bench/results/kv-cpu
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
from pathlib import Path


def _allocated(cache: list) -> int:
    return sum(
        a.nbytes
        for c in cache
        for a in (getattr(c, "keys", None), getattr(c, "values", None))
        if a is not None
    )


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m bench.kv_resident", description=__doc__)
    p.add_argument("--model", help="checkpoint directory (default: write one with bench.models)")
    p.add_argument("--arch", default="llama")
    p.add_argument("--size", default="small", choices=["small", "medium"])
    p.add_argument("--max-kv-size", type=int, default=256)
    p.add_argument("--factor", type=int, default=10, help="generate factor x max-kv-size tokens")
    p.add_argument("--out", required=True, help="write OUT.json and OUT.md")
    args = p.parse_args(argv)

    # mlxc first: on a Linux CPU it loads an optimised BLAS before MLX is imported.
    from mlxc import load_model  # noqa: I001

    import mlx.core as mx

    from bench import models
    from mlxc.runtime.serving.generate import generate_tokens

    n = args.max_kv_size
    with tempfile.TemporaryDirectory(prefix="mlxc-kv-bench-") as tmp:
        path = args.model or str(models.write_checkpoint(Path(tmp) / "m", args.arch, args.size))
        model = load_model(path)
        mx.eval(model.parameters())  # read every weight before the directory goes
    cache = model.make_cache()
    samples = []
    prompt = list(range(10, 10 + n // 2))
    every = max(n // 4, 1)
    for i, _ in enumerate(
        generate_tokens(model, prompt, max_tokens=args.factor * n, max_kv_size=n, cache=cache)
    ):
        if (i + 1) % every == 0:
            samples.append(
                {
                    "tokens": len(prompt) + i + 1,
                    "live_kv_bytes": sum(c.nbytes for c in cache),
                    "allocated_kv_bytes": _allocated(cache),
                    "active_bytes": mx.get_active_memory(),
                }
            )
    full = next(s for s in samples if s["tokens"] >= n)
    last = samples[-1]
    tail = [s for s in samples if s["tokens"] >= n]
    lines = [
        (
            f"### Resident KV under --max-kv-size {n}: {args.arch} {args.size} "
            f"({mx.device_info().get('device_name', '?')}, mlx {mx.__version__})"
        ),
        "",
        "| tokens | live KV MiB | allocated KV MiB | MLX active MiB |",
        "|---|---|---|---|",
    ]
    shown = samples[:: max(len(samples) // 12, 1)]
    for s in shown + ([last] if shown[-1] is not last else []):
        lines.append(
            f"| {s['tokens']} | {s['live_kv_bytes'] / 2**20:.2f} | "
            f"{s['allocated_kv_bytes'] / 2**20:.2f} | {s['active_bytes'] / 2**20:.1f} |"
        )
    growth = max(s["active_bytes"] for s in tail) - full["active_bytes"]
    lines += [
        "",
        (
            f"From the first full window ({full['tokens']} tokens) to {last['tokens']} tokens "
            f"({last['tokens'] / n:.1f}x N): allocated KV "
            f"{full['allocated_kv_bytes'] / 2**20:.2f} -> max "
            f"{max(s['allocated_kv_bytes'] for s in tail) / 2**20:.2f} MiB; MLX active memory grew "
            f"by at most {growth / 2**20:.2f} MiB."
        ),
    ]
    text = "\n".join(lines) + "\n"
    print(text)
    Path(f"{args.out}.json").write_text(json.dumps({"args": vars(args), "samples": samples}) + "\n")
    Path(f"{args.out}.md").write_text(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
