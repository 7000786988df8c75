"""How much a second Python thread holding the GIL slows the scheduler::

    python -m bench.gil_contention --size medium --levels 16,64 --out bench/results/gil-...

mlxc's Scheduler in-process (``bench.ceiling.scheduler_tps``: every row decoding, no HTTP),
alone and beside a thread that burns Python in bursts, as a server's event loop does once per
step (parsing, SSE chunks; a write syscall every ~30 us, which releases the GIL as a socket send
does): ``light`` 1 ms busy then 4 ms asleep, ``heavy`` 4 ms and 4 ms, and ``heavy`` again with
Python's switch interval at 0.5 ms instead of 5 ms; then alone again, so the spread between the
two runs alone says how steady the machine is. What it answers: whether the served rate's gap
to the scheduler's own is the two sharing one GIL (``runtime.serving.frontend``'s reason).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import threading
import time
from pathlib import Path

from bench.report import write_results

BURNER = "gil-burner"  # the burning thread's name
# (label, busy ms, asleep ms, switch interval s)
VARIANTS = (
    ("alone", 0, 0, 0.005),
    ("light 1/4 ms", 1, 4, 0.005),
    ("heavy 4/4 ms", 4, 4, 0.005),
    ("heavy 4/4 ms, switch 0.5 ms", 4, 4, 0.0005),
    ("alone again", 0, 0, 0.005),
)


def _burn(stop: threading.Event, busy_ms: float, asleep_ms: float) -> None:
    out = os.open(os.devnull, os.O_WRONLY)
    try:
        while not stop.is_set():
            end = time.perf_counter() + busy_ms / 1e3
            while time.perf_counter() < end:
                x = 0
                for i in range(300):  # ~15-30 us of Python
                    x += i * i
                os.write(out, b"x" * 64)
            time.sleep(asleep_ms / 1e3)
    finally:
        os.close(out)


def run(model_dir: str, levels: list[int], prompt_tokens: int, steps: int) -> list[dict]:
    from bench import ceiling

    rows = []
    for label, busy, asleep, interval in VARIANTS:
        default = sys.getswitchinterval()
        sys.setswitchinterval(interval)
        stop = threading.Event()
        burner = None
        if busy:
            burner = threading.Thread(
                target=_burn, args=(stop, busy, asleep), name=BURNER, daemon=True
            )
            burner.start()
        try:
            tps, ticks = ceiling.scheduler_tps(model_dir, levels, prompt_tokens, steps)
        finally:
            stop.set()
            if burner is not None:
                burner.join()
            sys.setswitchinterval(default)
        rows.append({"variant": label, "tps": tps, "ms_per_tick": ticks})
        print(f"[gil] {label}: {json.dumps({k: round(v) for k, v in tps.items()})}", flush=True)
    return rows


def markdown(rows: list[dict], levels: list[int], command: str, machine: str) -> str:
    alone = {b: max(r["tps"][b] for r in rows if r["variant"].startswith("alone")) for b in levels}
    lines = [
        "### The scheduler beside a thread holding the GIL",
        "",
        (
            f"`{command}` ({machine}). Tokens/s of mlxc's Scheduler in-process, every row"
            " decoding; in brackets the share of the faster run alone; ms per tick from"
            " `bench.ceiling`."
        ),
        "",
        "| variant | " + " | ".join(f"{b} rows tok/s" for b in levels) + " | ms per tick |",
        "|---|" + "---|" * len(levels) + "---|",
    ]
    for r in rows:
        cells = [f"{r['tps'][b]:,.0f} ({r['tps'][b] / alone[b]:.2f})" for b in levels]
        ticks = ", ".join(f"{b}: {r['ms_per_tick'][b]['tick']:.2f}" for b in levels)
        lines.append(f"| {r['variant']} | " + " | ".join(cells) + f" | {ticks} |")
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m bench.gil_contention", description=__doc__)
    p.add_argument("--model", help="checkpoint directory (default: bench.models' llama)")
    p.add_argument("--size", default="small", choices=["small", "medium"])
    p.add_argument("--levels", default="16,64", help="rows decoding together, comma-separated")
    p.add_argument("--prompt-tokens", type=int, default=32)
    p.add_argument("--steps", type=int, default=128)
    p.add_argument("--out", help="write OUT.json and OUT.md")
    args = p.parse_args(argv)
    import mlxc  # noqa: I001, F401  (first: it may load a BLAS before MLX)
    import mlx.core as mx
    from bench import models

    levels = [int(x) for x in args.levels.split(",")]
    command = "python -m bench.gil_contention " + " ".join(argv or sys.argv[1:])
    machine = f"{mx.default_device()}, mlx {mx.__version__}, {os.cpu_count()} CPUs"
    with tempfile.TemporaryDirectory(prefix="mlxc-gil-") as tmp:
        path = Path(args.model or Path(tmp) / "m")
        if not args.model:
            models.write_checkpoint(path, "llama", args.size)
            models.write_tokenizer(path, models.config("llama", args.size)["vocab_size"])
        rows = run(str(path), levels, args.prompt_tokens, args.steps)
    text = markdown(rows, levels, command, machine)
    print(text)
    if args.out:
        write_results(args.out, {"command": command, "machine": machine, "rows": rows}, text)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
