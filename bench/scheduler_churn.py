"""The server's scheduler under steady churn: more requests than rows, answers of 16 to 112
tokens, so rows end and join all the time (unlike ``bench.serve_compare``'s equal answers,
which end in waves)::

    python -m bench.scheduler_churn --size small --rows 16 --requests 64

In-process (no HTTP), greedy, every request submitted at once; prints completion tokens/s from
the first submission to the last answer's end. The batch's rows are slots (``CachePool``): this
is the load where joining over a dead row instead of copying the batch shows.
"""

from __future__ import annotations

import argparse
import tempfile
import threading
import time
from pathlib import Path


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(prog="python -m bench.scheduler_churn", description=__doc__)
    p.add_argument("--model", help="checkpoint directory (default: bench.models' llama)")
    p.add_argument("--size", default="small", choices=["small", "medium"])
    p.add_argument("--rows", type=int, default=16, help="the scheduler's max concurrency")
    p.add_argument("--requests", type=int, default=64)
    args = p.parse_args(argv)

    from mlxc import load_model  # noqa: I001  (mlxc first: it may load a BLAS before MLX)
    from mlxc.runtime.checkpoint.tokenizer import load_tokenizer
    from mlxc.runtime.serving import metrics
    from mlxc.runtime.serving.scheduler import Delta, SamplingParams, Scheduler

    from bench import models

    with tempfile.TemporaryDirectory(prefix="mlxc-churn-") as tmp:
        path = Path(args.model or Path(tmp) / "m")
        if not args.model:
            models.write_checkpoint(path, "llama", args.size)
            models.write_tokenizer(path, models.config("llama", args.size)["vocab_size"])
        model, tokenizer = load_model(str(path)), load_tokenizer(path)
    if tokenizer is None:
        raise SystemExit(f"no tokenizer in {path}: the scheduler needs one to decode its answers")
    scheduler = Scheduler(
        model, tokenizer, max_concurrency=args.rows, max_queue=args.requests, prefix_cache_bytes=0
    )
    scheduler.start()
    lock, done, counts = threading.Lock(), threading.Event(), {"tokens": 0, "ended": 0}

    def emit(event) -> None:  # the scheduler thread
        with lock:
            if isinstance(event, Delta):
                counts["tokens"] += 1
            else:
                counts["ended"] += 1
                if counts["ended"] == args.requests:
                    done.set()

    warm = threading.Event()  # compiles and first-step costs stay out of the timing

    def warmed(event) -> None:
        if not isinstance(event, Delta):
            warm.set()

    scheduler.submit([5, 6, 7], SamplingParams(max_tokens=4, ignore_eos=True), warmed)
    warm.wait()
    before = metrics.forward_counts()
    start = time.perf_counter()
    ids = min(30000, model.args.vocab_size - 10)  # prompt ids 10 .. 10 + ids - 1
    for i in range(args.requests):
        prompt = [(i * 7 + j * 3) % ids + 10 for j in range(20 + (i * 13) % 40)]
        params = SamplingParams(max_tokens=16 + (i * 37) % 97, ignore_eos=True)
        scheduler.submit(prompt, params, emit)
    done.wait()
    seconds = time.perf_counter() - start
    stats = scheduler.stats()
    scheduler.stop()
    ran = {k: int(n - before[k]) for k, n in metrics.forward_counts().items()}
    print(
        f"{counts['tokens']} tokens in {seconds:.1f} s: {counts['tokens'] / seconds:.1f} tokens/s "
        f"({args.rows} rows, {args.requests} requests, peak batched {stats['pool']['peak_batched']}); "
        f"{ran['prefill']} prefill and {ran['decode']} decode forwards"
    )


if __name__ == "__main__":
    main()
