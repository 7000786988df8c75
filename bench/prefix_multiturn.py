"""Time to first token of a multi-turn chat, ``mlxc serve`` with its prefix cache on and off::

    python -m bench.prefix_multiturn --arch llama --size small --out bench/results/prefix-cpu-small

Each conversation is a system prompt then ``--turns`` user turns; every turn re-sends the whole
history (as chat clients do) with the previous answers, so from turn 2 on the server can resume
from the previous turn's prompt and prefill only the last answer and the new message. The two
servers (``--prefix-cache-bytes`` default, then 0) run one after the other on the same
checkpoint, one conversation at a time; greedy, so both see the same histories (the report says
whether their answers matched). ``--repeats`` conversations per server, each starting with a
word of its own (no conversation reuses another's prefix); the median per turn is reported,
with the ``cached_tokens`` each turn reported. Without ``--model`` a random checkpoint is
written with ``bench.models``. Loopback only.
"""

from __future__ import annotations

import argparse
import http.client
import json
import os
import platform
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from bench import serve_load
from bench.report import write_results
from bench.serve_compare import _wait_ready


def words(seed: int, n: int) -> str:
    return " ".join(serve_load.WORDS[(seed * 11 + 3 * k) % len(serve_load.WORDS)] for k in range(n))


def turn(port: int, messages: list[dict], max_tokens: int, timeout: float) -> dict:
    """One streamed chat turn: its answer, time to first token and usage."""
    body = {
        "messages": messages,
        "max_tokens": max_tokens,
        "temperature": 0.0,
        "ignore_eos": True,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=timeout)
    start, first, text, usage = time.perf_counter(), None, [], {}
    try:
        conn.request(
            "POST", "/v1/chat/completions", json.dumps(body), {"Content-Type": "application/json"}
        )
        resp = conn.getresponse()
        if resp.status != 200:
            raise RuntimeError(f"{resp.status} {resp.read(300).decode(errors='replace')}")
        for raw in resp:
            line = raw.decode(errors="replace").strip()
            if not line.startswith("data:") or line == "data: [DONE]":
                continue
            event = json.loads(line[5:])
            usage = event.get("usage") or usage
            for choice in event.get("choices") or []:
                delta = (choice.get("delta") or {}).get("content")
                if delta:
                    first = first or time.perf_counter()
                    text.append(delta)
    finally:
        conn.close()
    details = usage.get("prompt_tokens_details") or {}
    return {
        "ttft": None if first is None else first - start,
        "text": "".join(text),
        "prompt_tokens": usage.get("prompt_tokens"),
        "cached_tokens": details.get("cached_tokens", 0),
    }


def conversation(port: int, seed: int, args) -> list[dict]:
    messages = [{"role": "system", "content": f"w{2000 + seed} " + words(seed, args.system_words)}]
    turns = []
    for t in range(args.turns):
        messages.append({"role": "user", "content": words(seed * 31 + t, args.turn_words)})
        result = turn(port, messages, args.max_tokens, args.timeout)
        messages.append({"role": "assistant", "content": result["text"]})
        turns.append(result)
    return turns


def serve(model: str, extra: list[str], port: int, args, log: Path) -> list[list[dict]]:
    command = [sys.executable, "-m", "mlxc.cli", "serve", "--model", model, "--port", str(port)]
    command += ["--max-concurrency", "1", *args.serve_args.split(), *extra]
    print(f"[{log.stem}] {' '.join(command)}  (log: {log})", file=sys.stderr, flush=True)
    with open(log, "wb") as out:
        proc = subprocess.Popen(
            command, stdout=out, stderr=subprocess.STDOUT, cwd=tempfile.gettempdir()
        )
    try:
        _wait_ready(f"http://127.0.0.1:{port}", proc, args.startup_timeout)
        conversation(port, 999, argparse.Namespace(**{**vars(args), "turns": 2}))  # warm up
        return [conversation(port, seed, args) for seed in range(args.repeats)]
    finally:
        proc.terminate()
        try:
            proc.wait(30)
        except subprocess.TimeoutExpired:
            proc.kill()


def summary(runs: dict[str, list[list[dict]]], turns: int) -> list[dict]:
    rows = []
    for t in range(turns):
        row = {"turn": t + 1}
        for label, convs in runs.items():
            ttfts = [c[t]["ttft"] for c in convs if c[t]["ttft"] is not None]
            row[f"ttft_{label}"] = statistics.median(ttfts) if ttfts else None
            row[f"cached_{label}"] = statistics.median(c[t]["cached_tokens"] for c in convs)
            row["prompt_tokens"] = statistics.median(c[t]["prompt_tokens"] for c in convs)
        row["same_answers"] = all(
            a[t]["text"] == b[t]["text"] for a, b in zip(runs["on"], runs["off"])
        )
        rows.append(row)
    return rows


def markdown(report: dict) -> str:
    lines = [
        f"# Prefix cache, multi-turn time to first token ({report['label']})",
        "",
        (
            f"Machine: {report['machine']}. Server: `mlxc serve {report['serve_args']}`, one "
            f"conversation at a time, {report['repeats']} conversations per server (median per "
            f"turn): a {report['system_words']}-word system prompt, {report['turn_words']}-word user "
            f"turns, {report['max_tokens']}-token answers (greedy)."
        ),
        "",
        "| turn | prompt tokens | cached tokens | TTFT off (s) | TTFT on (s) | off / on | same answers |",
        "|---|---|---|---|---|---|---|",
    ]
    note = [""] + [report["note"]] if report.get("note") else []
    for r in report["turns"]:
        off, on = r["ttft_off"], r["ttft_on"]
        ratio = f"{off / on:.2f}x" if off and on else "-"
        lines.append(
            f"| {r['turn']} | {r['prompt_tokens']:.0f} | {r['cached_on']:.0f} | "
            f"{off:.3f} | {on:.3f} | {ratio} | {'yes' if r['same_answers'] else 'NO'} |"
        )
    return "\n".join(lines + note) + "\n"


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(
        prog="python -m bench.prefix_multiturn", description=__doc__.split("\n")[0]
    )
    p.add_argument("--model", help="checkpoint directory (default: a bench.models checkpoint)")
    p.add_argument("--arch", default="llama")
    p.add_argument("--size", default="small", choices=("small", "medium"))
    p.add_argument("--turns", type=int, default=6)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--system-words", type=int, default=600)
    p.add_argument("--turn-words", type=int, default=120)
    p.add_argument("--max-tokens", type=int, default=32)
    p.add_argument("--serve-args", default="", help="more `mlxc serve` flags, one string")
    p.add_argument("--port", type=int, default=8765)
    p.add_argument("--timeout", type=float, default=600)
    p.add_argument("--startup-timeout", type=float, default=600)
    p.add_argument("--out", required=True, help="path stem: writes OUT.json and OUT.md")
    p.add_argument("--note", default="", help="a line for the report (the machine's load, say)")
    args = p.parse_args(argv)

    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory() as work:
        model = args.model
        if model is None:
            from bench import models

            model = str(models.write_checkpoint(Path(work) / args.arch, args.arch, args.size))
            models.write_tokenizer(Path(model), models.config(args.arch, args.size)["vocab_size"])
        runs = {}
        for label, extra in (("on", []), ("off", ["--prefix-cache-bytes", "0"])):
            log = out.parent / f"{out.name}.{label}.log"
            runs[label] = serve(model, extra, args.port, args, log)
    report = {
        "label": out.name,
        "machine": f"{platform.machine()} {platform.processor() or ''} {os.cpu_count()} cores".strip(),
        "serve_args": args.serve_args,
        "note": args.note,
        **{k: getattr(args, k) for k in ("repeats", "system_words", "turn_words", "max_tokens")},
        "turns": summary(runs, args.turns),
        "runs": runs,
    }
    write_results(out, report, markdown(report))
    print(markdown(report))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
