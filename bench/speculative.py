"""Speculative decoding on an input-repeating task: tokens/s with and without it, the
acceptance rate, greedy output identical, and what a K+1-token verification forward costs
against a one-token step::

    python -m bench.speculative --device cpu --arch llama --size small --out bench/results/spec-cpu
    python -m bench.speculative --device gpu --arch llama --size medium --out bench/results/spec-gpu-h200
    python -m bench.speculative --copier --size small --server-rows 1,4,16 --out bench/results/spec-copier-cpu-small

The task stands for "rewrite this code with one change": the prompt holds a block of "code"
(random token ids) twice, the second time with one token changed, then the block's first
tokens again, so a model that copies continues it. By default the checkpoint has random
weights (``bench.models``) and the drafts come from prompt lookup: the greedy output copies
from the prompt only as far as the model does (random models fall into loops of their own,
which prompt lookup also matches in the output). ``--copier`` uses ``bench.copier`` instead: a
hand-built induction circuit in a narrow llama, written into the bench llama's shape with
zeros around it, so a forward costs the bench model's and the output copies; a narrow copier
that matches one token instead of two is then also measured as a draft model. ``--server-rows`` runs concurrent copy tasks
through the server's scheduler, plain and speculating in the decode batch. The acceptance rate
is measured, not assumed, and reported next to the speed-up.
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


def _log(msg: str) -> None:
    print(msg, file=sys.stderr, flush=True)


def task(ids: tuple[int, int], block: int, seed: int = 0) -> list[int]:
    """The block (token ids drawn from ``range(*ids)``), the block with one change, and the
    block's first quarter."""
    import numpy as np

    rng = np.random.default_rng(seed)
    code = rng.integers(ids[0], ids[1], block).tolist()
    changed = list(code)
    changed[block // 2] = ids[0] + (changed[block // 2] + 1 - ids[0]) % (ids[1] - ids[0])
    return code + changed + code[: block // 4]


def timed(fn, repeats: int) -> tuple[float, object]:
    times, out = [], None
    for _ in range(repeats):
        start = time.perf_counter()
        out = fn()
        times.append(time.perf_counter() - start)
    return statistics.median(times), out


def timed_pair(a, b, repeats: int) -> tuple[float, float, object, object]:
    """``timed`` for two functions, alternated (a, b, a, b, ...) so that a shared machine's
    slow spells fall on both: (median seconds of a, of b, a's output, b's output)."""
    times: tuple[list[float], list[float]] = ([], [])
    outs = [None, None]
    for _ in range(repeats):
        for i, fn in enumerate((a, b)):
            start = time.perf_counter()
            outs[i] = fn()
            times[i].append(time.perf_counter() - start)
    return statistics.median(times[0]), statistics.median(times[1]), *outs


PIPELINED_STEPS = 16  # one-token steps per timing of the pipelined loop (``step_cost``)


def step_cost(model, prompt: list[int], k: int, repeats: int) -> dict:
    """Median seconds of one forward of 1 and of k + 1 tokens on the prompt's cache (rewound
    after each, so every timing starts from the same state), each read back before the next
    as a verification is; and of a one-token step in plain decoding's pipelined loop (each
    step queued before the one before it is read: ``pipelined_step_s``), which a
    verification's time replaces."""
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

    def pipelined():
        y = mx.array([prompt[-1:]])
        for _ in range(PIPELINED_STEPS):
            y_next = mx.argmax(model(y, cache=cache)[:, -1:, :], axis=-1)
            mx.async_eval(y_next)
            y.item()  # the step before, read once the next is queued (generate_tokens)
            y = y_next
        y.item()
        rewind_caches(cache, PIPELINED_STEPS)

    pipelined()
    loop, _ = timed(pipelined, repeats)
    step = loop / PIPELINED_STEPS
    return {
        "one_token_s": out[1],
        "verify_s": out[k + 1],
        "ratio": out[k + 1] / out[1],
        "pipelined_step_s": step,
        "ratio_pipelined": out[k + 1] / step,
    }


def served(model, tokenizer, prompts: list[list[int]], n: int, speculation) -> tuple[float, list]:
    """mlxc's Scheduler (the server's, in-process, no HTTP) answering ``prompts`` together,
    greedy, ``n`` tokens each: (tokens/s from the first request's first token to the last
    answer's end, each answer's tokens). ``speculation``: a ``BatchSpeculation`` or None."""
    import threading

    from mlxc.runtime.serving.scheduler import Delta, SamplingParams, Scheduler

    lock, done = threading.Lock(), threading.Event()
    answers: list[list[int]] = [[] for _ in prompts]
    first: list[float] = []
    finished = [0]

    def emit(row: int):
        def on_event(event) -> None:  # the scheduler thread
            with lock:
                if isinstance(event, Delta):
                    answers[row].append(event.token)
                    if not first:
                        first.append(time.perf_counter())
                else:
                    finished[0] += 1
                    if finished[0] == len(prompts):
                        done.set()

        return on_event

    scheduler = Scheduler(
        model,
        tokenizer,
        max_concurrency=len(prompts),
        max_queue=len(prompts),
        prefix_cache_bytes=0,
        speculation=speculation,
    )
    params = SamplingParams(max_tokens=n, ignore_eos=True)
    for row, ids in enumerate(prompts):  # queued before it starts: the first tick admits all
        scheduler.submit(ids, params, emit(row))
    scheduler.start()
    try:
        done.wait()
        end = time.perf_counter()
    finally:
        scheduler.stop()
    return sum(map(len, answers)) / (end - first[0]), answers


def free_prompt(ids: tuple[int, int], length: int, seed: int) -> list[int]:
    """``length`` distinct token ids from ``range(*ids)`` (as many as it has): a prompt that
    repeats no n-gram, so prompt lookup finds no draft in it."""
    import numpy as np

    return np.random.default_rng(seed).permutation(np.arange(*ids))[:length].tolist()


def served_rows(model, tokenizer, ids, block, n, rows, specs: dict, mixed=False) -> list[dict]:
    """``rows`` concurrent requests through the Scheduler: aggregate tokens/s plain and with
    each of ``specs`` (``BatchSpeculation`` by drafter name), greedy answers compared. Each
    request is its own copy task (another block), so the rows draft from their own prompts;
    ``mixed``: every other request is a prompt without repeats instead (``free_prompt``)."""
    prompts = [
        free_prompt(ids, len(task(ids, block)), seed=1 + i)
        if mixed and i % 2
        else task(ids, block, seed=1 + i)
        for i in range(rows)
    ]
    served(model, tokenizer, prompts[:1], 4, None)  # warm-up: kernels, caches
    plain_tps, plain = served(model, tokenizer, prompts, n, None)
    out = []
    for name, spec in specs.items():
        spec_tps, got = served(model, tokenizer, prompts, n, spec)
        out.append(
            {
                "rows": rows,
                "load": "half copy tasks, half free" if mixed else "copy tasks",
                "drafter": name,
                "k": spec.num_draft_tokens,
                "identical": got == plain,
                "plain_tps": plain_tps,
                "spec_tps": spec_tps,
                "speedup": spec_tps / plain_tps,
            }
        )
        _log(f"rows={rows}: {out[-1]}")
    return out


def report(result: dict) -> str:
    """The Markdown table of one run's result (its JSON)."""
    m, rows = result["machine"], result["rows"]
    where = m.get("device_info", {}).get("device_name") or m.get("cpu", "?")
    lines = [
        (
            f"# Speculative decoding: {result['arch']} {result['size']} "
            f"({result.get('weights', 'random weights')})"
        ),
        "",
        (
            f"{where}, {m.get('cpus')} CPUs, mlx {m.get('mlx')}, device {result['device']}. "
            f"Prompt {result['prompt_tokens']} tokens (a {result['block']}-token block, the block "
            f"with one change, its first quarter); {result['generated']} tokens generated "
            f"greedily, n-gram {result['ngram_size']}; tokens/s over the whole call, the "
            f"prompt's prefill included; each row times plain and speculative decoding "
            f"alternately. Plain decoding: {result['plain_tps']:.1f} tokens/s (median of the "
            f"rows); "
            f"the model's own greedy output copies the block for its first "
            f"{result['copies_block_for']} tokens."
        ),
        *(["", result["note"]] if result.get("note") else []),
        "",
        (
            "| drafter | K | greedy identical | tokens/s | speed-up | acceptance | tokens/step "
            "| 1-token step ms | K+1 verify ms | verify / step | pipelined step ms "
            "| verify / pipelined step |"
        ),
        "|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        lines.append(
            f"| {r.get('drafter', 'prompt lookup')} | {r['k']} | "
            f"{'yes' if r['identical'] else 'NO'} | {r['tps']:.1f} | "
            f"{r['speedup']:.2f}x | {r['acceptance']:.0%} | {r['tokens_per_step']:.2f} | "
            f"{r['one_token_s'] * 1e3:.2f} | {r['verify_s'] * 1e3:.2f} | {r['ratio']:.2f}x | "
            f"{r['pipelined_step_s'] * 1e3:.2f} | {r['ratio_pipelined']:.2f}x |"
        )
    if result.get("server"):
        lines += [
            "",
            (
                "In the server's scheduler (in-process, no HTTP): concurrent requests, each its "
                "own copy task (or, in the mixed load, every other one a prompt without "
                "repeats, where prompt lookup finds no draft), decoded in one batch, plain and "
                "speculating in the batch (`BatchSpeculation`); aggregate tokens/s from the "
                "first token to the last answer's end:"
            ),
            "",
            (
                "| requests | load | drafter | K | greedy identical | plain tokens/s "
                "| speculating tokens/s | speed-up |"
            ),
            "|---|---|---|---|---|---|---|---|",
        ]
        for r in result["server"]:
            lines.append(
                f"| {r['rows']} | {r.get('load', 'copy tasks')} | "
                f"{r.get('drafter', 'prompt lookup')} | {r['k']} | "
                f"{'yes' if r['identical'] else 'NO'} | "
                f"{r['plain_tps']:.1f} | {r['spec_tps']:.1f} | {r['speedup']:.2f}x |"
            )
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m bench.speculative", description=__doc__)
    p.add_argument("--model", help="checkpoint directory (default: write one with bench.models)")
    p.add_argument(
        "--copier",
        action="store_true",
        help="bench.copier's model (llama, --size), which copies, instead of random weights",
    )
    p.add_argument("--arch", default="llama")
    p.add_argument("--size", default="small", choices=["small", "medium"])
    p.add_argument("--device", choices=["cpu", "gpu"], default=None, help="default: MLX's")
    p.add_argument("--block", type=int, default=256, help="tokens of the code block")
    p.add_argument("--max-tokens", type=int, default=128)
    p.add_argument("--num-draft-tokens", type=int, nargs="+", default=[2, 4, 8])
    p.add_argument("--ngram-size", type=int, default=3)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument(
        "--server-rows",
        help="also measure the scheduler at these numbers of concurrent requests (e.g. 1,4,16), "
        "speculating with the largest --num-draft-tokens",
    )
    p.add_argument(
        "--server-mixed",
        action="store_true",
        help="also run each --server-rows level with every other request a prompt without "
        "repeats (prompt lookup drafts for half the rows)",
    )
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

    from bench import copier, models
    from bench.run import machine
    from mlxc.runtime.serving.generate import generate_tokens
    from mlxc.runtime.serving.speculative import (
        DraftModel,
        PromptLookup,
        SpecStats,
        speculative_tokens,
    )

    if args.device:
        mx.set_default_device(mx.gpu if args.device == "gpu" else mx.cpu)
    device = args.device or ("gpu" if mx.default_device() == mx.gpu else "cpu")
    with tempfile.TemporaryDirectory(prefix="mlxc-spec-bench-") as tmp:
        if args.model:
            path = Path(args.model)
        elif args.copier:
            path = copier.write_checkpoint(Path(tmp) / "m", args.size)
        else:
            path = models.write_checkpoint(Path(tmp) / "m", args.arch, args.size)
        record = path / "copier.json"  # a copier knows some ids only: the task draws from them
        copier_info = json.loads(record.read_text()) if record.exists() else None
        model = load_model(str(path))
        mx.eval(model.parameters())
    if copier_info:
        ids = (copier_info["first_id"], copier_info["first_id"] + copier_info["span"])
    else:
        ids = (3, model(mx.array([[0]])).shape[-1])
    prompt = task(ids, args.block)
    n = args.max_tokens

    def plain():
        return list(generate_tokens(model, prompt, max_tokens=n))

    reference = plain()  # also the warm-up
    # How far the model itself copies: the block's continuation after its first quarter.
    expected = prompt[args.block // 4 : args.block]
    copied = next(
        (i for i, (a, b) in enumerate(zip(reference, expected)) if a != b), len(reference)
    )
    # With the copier, a narrow copier drafts too: far cheaper, matching one token instead of
    # two, so its drafts are sometimes wrong (copier.write_draft).
    drafters = {"prompt lookup": lambda k: PromptLookup(args.ngram_size)}
    if copier_info:
        with tempfile.TemporaryDirectory(prefix="mlxc-spec-draft-") as tmp:
            draft = load_model(str(copier.write_draft(Path(tmp) / "d", args.size)))
            mx.eval(draft.parameters())
        drafters["draft model"] = lambda k: DraftModel(draft, k)
    rows = []
    for (name, make), k in itertools.product(drafters.items(), args.num_draft_tokens):
        stats = SpecStats()

        def spec(k=k, stats=stats, make=make):
            stats.__init__()
            return list(
                speculative_tokens(
                    model, prompt, make(k), max_tokens=n, num_draft_tokens=k, stats=stats
                )
            )

        plain_s, spec_s, _, got = timed_pair(plain, spec, args.repeats)
        cost = step_cost(model, prompt, k, args.repeats)
        rows.append(
            {
                "drafter": name,
                "k": k,
                "identical": got == reference,
                "tps": len(got) / spec_s,
                "plain_tps": len(reference) / plain_s,
                "speedup": plain_s / spec_s,
                "acceptance": stats.acceptance,
                "tokens_per_step": len(got) / max(stats.steps + 1, 1),
                "steps": stats.steps,
                **cost,
            }
        )
        _log(f"{name} k={k}: {rows[-1]}")
    server = []
    if args.server_rows:
        from mlxc.runtime.checkpoint.tokenizer import load_tokenizer
        from mlxc.runtime.serving.speculative import BatchSpeculation

        with tempfile.TemporaryDirectory(prefix="mlxc-spec-tok-") as tmp:
            models.write_tokenizer(Path(tmp), model(mx.array([[0]])).shape[-1])
            tokenizer = load_tokenizer(tmp)
        k = max(args.num_draft_tokens)
        for r in (int(x) for x in args.server_rows.split(",")):
            specs = {"prompt lookup": BatchSpeculation(k, args.ngram_size, r)}
            if copier_info:
                specs["draft model"] = BatchSpeculation(k, max_rows=r, draft_model=draft)
            server += served_rows(model, tokenizer, ids, args.block, n, r, specs)
            if args.server_mixed and r > 1:
                server += served_rows(model, tokenizer, ids, args.block, n, r, specs, mixed=True)
    result = {
        "machine": machine(device),
        "device": device,
        "arch": "llama" if copier_info else args.arch,
        "size": args.size,
        "weights": (
            "bench.copier's hand-built induction circuit, zero-padded to this shape"
            if copier_info
            else "random weights"
        ),
        "block": args.block,
        "ngram_size": args.ngram_size,
        "prompt_tokens": len(prompt),
        "generated": len(reference),
        "plain_tps": statistics.median(r["plain_tps"] for r in rows),
        "copies_block_for": copied,
        "rows": rows,
        "server": server,
    }
    text = report(result)
    write_results(args.out, result, text)
    print(text, end="")
    return 0 if all(r["identical"] for r in rows + server) else 1


if __name__ == "__main__":
    sys.exit(main())
