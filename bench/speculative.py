"""Prompt-lookup speculative decoding on an input-repeating task: tokens/s with and without it,
the acceptance rate, greedy output identical, and what a K+1-token verification forward costs
against a one-token step::

    python -m bench.speculative --device cpu --arch llama --size small --out bench/results/spec-cpu
    python -m bench.speculative --device gpu --arch llama --size medium --out bench/results/spec-gpu-h200

The task stands for "rewrite this code with one change": the prompt holds a block of "code"
(random token ids) twice, the second time with one token changed, then the block's first
tokens again, so a model that copies continues it. The checkpoint has random weights
(``bench.models``): its greedy output copies from the prompt only as far as the model does
(random models fall into loops of their own, which prompt lookup also matches in the output).
The acceptance rate is measured, not assumed, and reported next to the speed-up.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path


def _log(msg: str) -> None:
    print(msg, file=sys.stderr, flush=True)


def task(vocab: int, block: int, seed: int = 0) -> list[int]:
    """The block, the block with one change, and the block's first quarter."""
    import numpy as np

    rng = np.random.default_rng(seed)
    code = rng.integers(3, vocab, block).tolist()
    changed = list(code)
    changed[block // 2] = (changed[block // 2] + 1) % vocab
    return code + changed + code[: block // 4]


def timed(fn, repeats: int) -> tuple[float, object]:
    times, out = [], None
    for _ in range(repeats):
        start = time.perf_counter()
        out = fn()
        times.append(time.perf_counter() - start)
    return statistics.median(times), out


def step_cost(model, prompt: list[int], k: int, repeats: int) -> dict:
    """Median seconds of one forward of 1 and of k + 1 tokens on the prompt's cache (rewound
    after each, so every timing starts from the same state)."""
    import mlx.core as mx

    from mlxc.runtime.model.cache import cache_arrays, make_caches, rewind_caches

    cache = make_caches(model)
    mx.eval(model(mx.array([prompt]), cache=cache))
    mx.eval(cache_arrays(cache))
    out = {}
    for n in (1, k + 1):
        ids = mx.array([prompt[-n:]])

        def forward(ids=ids, n=n):
            mx.eval(model(ids, cache=cache))
            rewind_caches(cache, n)

        forward()  # warm-up
        out[n], _ = timed(forward, repeats * 5)
    return {"one_token_s": out[1], "verify_s": out[k + 1], "ratio": out[k + 1] / out[1]}


def report(result: dict) -> str:
    """The Markdown table of one run's result (its JSON)."""
    m, rows = result["machine"], result["rows"]
    where = m.get("device_info", {}).get("device_name") or m.get("cpu", "?")
    lines = [
        f"# Prompt-lookup speculative decoding: {result['arch']} {result['size']} (random weights)",
        "",
        (
            f"{where}, {m.get('cpus')} CPUs, mlx {m.get('mlx')}, device {result['device']}. "
            f"Prompt {result['prompt_tokens']} tokens (a {result['block']}-token block, the block "
            f"with one change, its first quarter); {result['generated']} tokens generated "
            f"greedily, n-gram {result['ngram_size']}. Plain decoding: "
            f"{result['plain_tps']:.1f} tokens/s; the model's own greedy output copies the block "
            f"for its first {result['copies_block_for']} tokens."
        ),
        "",
        (
            "| K | greedy identical | tokens/s | speed-up | acceptance | tokens/step "
            "| 1-token step ms | K+1 verify ms | verify / step |"
        ),
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        lines.append(
            f"| {r['k']} | {'yes' if r['identical'] else 'NO'} | {r['tps']:.1f} | "
            f"{r['speedup']:.2f}x | {r['acceptance']:.0%} | {r['tokens_per_step']:.2f} | "
            f"{r['one_token_s'] * 1e3:.2f} | {r['verify_s'] * 1e3:.2f} | {r['ratio']:.2f}x |"
        )
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m bench.speculative", description=__doc__)
    p.add_argument("--model", help="checkpoint directory (default: write one with bench.models)")
    p.add_argument("--arch", default="llama")
    p.add_argument("--size", default="small", choices=["small", "medium"])
    p.add_argument("--device", choices=["cpu", "gpu"], default=None, help="default: MLX's")
    p.add_argument("--block", type=int, default=256, help="tokens of the code block")
    p.add_argument("--max-tokens", type=int, default=128)
    p.add_argument("--num-draft-tokens", type=int, nargs="+", default=[2, 4, 8])
    p.add_argument("--ngram-size", type=int, default=3)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--out", help="write OUT.json and OUT.md")
    p.add_argument("--report", help="only write the Markdown of this JSON result beside it")
    args = p.parse_args(argv)
    if args.report:
        path = Path(args.report)
        path.with_suffix(".md").write_text(report(json.loads(path.read_text())))
        return 0
    if not args.out:
        p.error("--out is required")

    # mlxc first: on a Linux CPU it loads an optimised BLAS before MLX is imported.
    from mlxc import load_model  # noqa: I001

    import mlx.core as mx

    from bench import models
    from bench.run import machine
    from mlxc.runtime.serving.generate import generate_tokens
    from mlxc.runtime.serving.speculative import PromptLookup, SpecStats, speculative_tokens

    if args.device:
        mx.set_default_device(mx.gpu if args.device == "gpu" else mx.cpu)
    device = args.device or ("gpu" if mx.default_device() == mx.gpu else "cpu")
    with tempfile.TemporaryDirectory(prefix="mlxc-spec-bench-") as tmp:
        path = args.model or str(models.write_checkpoint(Path(tmp) / "m", args.arch, args.size))
        model = load_model(path)
        mx.eval(model.parameters())
    vocab = model(mx.array([[0]])).shape[-1]
    prompt = task(vocab, args.block)
    n = args.max_tokens

    def plain():
        return list(generate_tokens(model, prompt, max_tokens=n))

    plain_s, reference = timed(plain, args.repeats)
    # How far the model itself copies: the block's continuation after its first quarter.
    expected = prompt[args.block // 4 : args.block]
    copied = next(
        (i for i, (a, b) in enumerate(zip(reference, expected)) if a != b), len(reference)
    )
    rows = []
    for k in args.num_draft_tokens:
        stats = SpecStats()

        def spec(k=k, stats=stats):
            stats.__init__()
            drafter = PromptLookup(args.ngram_size)
            return list(
                speculative_tokens(
                    model, prompt, drafter, max_tokens=n, num_draft_tokens=k, stats=stats
                )
            )

        spec_s, got = timed(spec, args.repeats)
        cost = step_cost(model, prompt, k, args.repeats)
        rows.append(
            {
                "k": k,
                "identical": got == reference,
                "tps": len(got) / spec_s,
                "speedup": plain_s / spec_s,
                "acceptance": stats.acceptance,
                "tokens_per_step": len(got) / max(stats.steps + 1, 1),
                "steps": stats.steps,
                **cost,
            }
        )
        _log(f"k={k}: {rows[-1]}")
    result = {
        "machine": machine(device),
        "device": device,
        "arch": args.arch,
        "size": args.size,
        "block": args.block,
        "ngram_size": args.ngram_size,
        "prompt_tokens": len(prompt),
        "generated": len(reference),
        "plain_tps": len(reference) / plain_s,
        "copies_block_for": copied,
        "rows": rows,
    }
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.with_suffix(".json").write_text(json.dumps(result, indent=2))
    text = report(result)
    out.with_suffix(".md").write_text(text)
    print(text, end="")
    return 0 if all(r["identical"] for r in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
