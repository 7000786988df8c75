"""Load generator for an OpenAI-compatible server on this machine (``mlxc serve``, ``mlx_lm.server``).

Runs a bounded number of streaming requests at each concurrency level (default 1, 4, 16) and
reports aggregate completion tokens/s, request latency p50/p90, time to first token p50/p90,
per-stream decode tokens/s, the level's tokens/s second by second (its median and lowest
whole second: a stall shows there, where the aggregate averages it away), and its tokens/s at
full load (until the first stream has no request left; after that the level drains, as its
streams' last answers end one by one)::

    mlxc serve --model DIR --port 8000 &
    python -m bench.serve_load --url http://127.0.0.1:8000 --out bench/results/serve-mlxc
    mlx_lm.server --model DIR --port 8001 &
    python -m bench.serve_load --url http://127.0.0.1:8001 --out bench/results/serve-mlx-lm

Bounded: ``--requests`` per level (default 2 x concurrency, at least 8) and ``--duration``
seconds per level (no new request starts after it), ``--timeout`` per request. Loopback only:
the URL's host must resolve to 127.0.0.0/8 or ::1, anything else is refused. Standard library
only. Every prompt starts differently, so no server can answer from a cached prefix.
"""

from __future__ import annotations

import argparse
import collections
import http.client
import ipaddress
import json
import math
import os
import socket
import statistics
import sys
import threading
import time
from concurrent.futures import ProcessPoolExecutor
from dataclasses import asdict, dataclass, field
from multiprocessing import get_context
from urllib.parse import urlsplit

from bench.report import write_results

WORDS = [
    "the",
    "quick",
    "brown",
    "fox",
    "jumps",
    "over",
    "a",
    "lazy",
    "dog",
    "while",
    "seven",
    "bright",
    "stars",
    "shine",
    "above",
    "quiet",
    "hills",
    "and",
    "rivers",
    "run",
    "toward",
    "distant",
    "blue",
    "seas",
    "under",
    "the",
    "soft",
    "evening",
    "light",
]


class NotLoopback(ValueError):
    """The server URL does not point at this machine."""


def check_loopback(url: str) -> tuple[str, int, str]:
    """(host, port, base path) of an http URL whose host resolves only to loopback addresses."""
    parts = urlsplit(url)
    if parts.scheme != "http":
        raise NotLoopback(f"only http://127.0.0.1:PORT style URLs are supported, got {url!r}")
    host, port = parts.hostname or "", parts.port or 80
    try:
        infos = socket.getaddrinfo(host, port, proto=socket.IPPROTO_TCP)
    except socket.gaierror as e:
        raise NotLoopback(f"cannot resolve {host!r}: {e}") from e
    addrs = {info[4][0] for info in infos}
    if not addrs or not all(ipaddress.ip_address(a.split("%")[0]).is_loopback for a in addrs):
        raise NotLoopback(f"{host} resolves to {sorted(addrs)}: this tool only loads loopback")
    base = parts.path.rstrip("/")
    base = base.removesuffix("/v1")
    return host, port, base


@dataclass
class Result:
    ok: bool
    start: float
    end: float
    first: float | None  # time of the first content chunk
    tokens: int
    error: str = ""
    # Each content chunk's arrival (perf_counter, CLOCK_MONOTONIC): what ``full_load_tps`` and
    # the timeline count. The report's JSON keeps its summary, ``seconds``, instead.
    times: list[float] = field(default_factory=list, repr=False)

    @property
    def seconds(self) -> dict[int, int]:
        """Content chunks (a token's text each) by the whole second they came in: a level's
        timeline, which shows stalls its aggregate averages away."""
        return dict(collections.Counter(int(t) for t in self.times))

    def report(self) -> dict:
        """The JSON record: the fields, with ``seconds`` for ``times``."""
        fields = {k: v for k, v in asdict(self).items() if k != "times"}
        return {**fields, "seconds": self.seconds}

    @property
    def latency(self) -> float:
        return self.end - self.start

    @property
    def ttft(self) -> float | None:
        return None if self.first is None else self.first - self.start


def prompt_text(i: int, words: int) -> str:
    """A distinct first word per request (no shared prefix to reuse), then ordinary words."""
    body = " ".join(WORDS[(i * 7 + k) % len(WORDS)] for k in range(words))
    return f"w{1000 + i % 30000} {body}"


def max_tokens(i: int, args) -> int:
    """Request ``i``'s answer length: ``--max-tokens``, or with ``--max-tokens-spread S`` spread
    evenly over ``max_tokens - S .. max_tokens + S`` (mean unchanged), so that streams end at
    different steps instead of in waves."""
    spread = args.max_tokens_spread
    return args.max_tokens + (i * 37) % (2 * spread + 1) - spread if spread else args.max_tokens


def one_request(target, model: str | None, i: int, args) -> Result:
    host, port, base = target
    if args.endpoint == "chat":
        path = f"{base}/v1/chat/completions"
        body = {"messages": [{"role": "user", "content": prompt_text(i, args.prompt_words)}]}
    else:
        path = f"{base}/v1/completions"
        body = {"prompt": prompt_text(i, args.prompt_words)}
    if model is not None:
        body["model"] = model
    body.update(
        max_tokens=max_tokens(i, args),
        temperature=0.0,
        stream=True,
        stream_options={"include_usage": True},
    )
    start = time.perf_counter()
    first, usage, times = None, None, []
    conn = http.client.HTTPConnection(host, port, timeout=args.timeout)
    try:
        conn.request(
            "POST", path, body=json.dumps(body), headers={"Content-Type": "application/json"}
        )
        resp = conn.getresponse()
        if resp.status != 200:
            detail = resp.read(300).decode(errors="replace")
            return Result(False, start, time.perf_counter(), None, 0, f"{resp.status} {detail}")
        for raw in resp:
            line = raw.decode(errors="replace").strip()
            if not line.startswith("data:"):
                continue
            data = line[5:].strip()
            if data == "[DONE]":
                break
            event = json.loads(data)
            if event.get("usage"):
                usage = event["usage"]
            for choice in event.get("choices") or []:
                text = choice.get("text")
                if text is None:
                    text = (choice.get("delta") or {}).get("content")
                if text:
                    times.append(time.perf_counter())
                    if first is None:
                        first = times[0]
        tokens = (usage or {}).get("completion_tokens") or len(times)
        end = time.perf_counter()
        return Result(True, start, end, first, int(tokens), "", times)
    except (OSError, http.client.HTTPException, json.JSONDecodeError) as e:
        end = time.perf_counter()
        return Result(False, start, end, first, len(times), repr(e), times)
    finally:
        conn.close()


def clients(concurrency: int) -> int:
    """Client processes for ``concurrency`` streams: one per 8 streams, at most a quarter of the
    CPUs. Each streamed token costs the client Python work (a chunked line read, a JSON parse)
    under its process's one GIL: on the 2-core CPU, against a tiny model's server, one process
    of 64 streams measured 2.2k tokens/s where four measured 3.3k (on the H200's 16-CPU host,
    at ~4k tokens/s, the number of processes made no difference)."""
    return max(1, min(math.ceil(concurrency / 8), (os.cpu_count() or 1) // 4))


def _stream_requests(
    target, model, ids: range, threads: int, deadline: float, args
) -> tuple[list[Result], float]:
    """``threads`` streams taking request ids from ``ids`` in turn until they run out or the
    deadline passes: the results in any order, and when the first stream stopped (from then on
    fewer streams than ``threads`` had a request in flight)."""
    lock = threading.Lock()
    pending = iter(ids)
    results: list[Result] = []
    stopped: list[float] = []

    def worker():
        while True:
            with lock:
                i = next(pending, None)
            if i is None or time.perf_counter() > deadline:
                with lock:
                    stopped.append(time.perf_counter())
                return
            r = one_request(target, model, i, args)
            with lock:
                results.append(r)

    workers = [threading.Thread(target=worker, daemon=True) for _ in range(threads)]
    for t in workers:
        t.start()
    for t in workers:
        t.join(args.duration + args.timeout + 5)
    return results, min(stopped, default=time.perf_counter())


def run_level(
    target, model: str | None, concurrency: int, args, first_id: int | None = None
) -> dict:
    """``first_id``: the first request's id, which picks its prompt (default: the level's own
    prompts, ``concurrency * 100_000`` on)."""
    n_requests = args.requests or max(8, 2 * concurrency)
    n_clients = min(args.clients or clients(concurrency), concurrency)
    t0 = time.perf_counter()  # CLOCK_MONOTONIC: the client processes' clocks agree with it
    deadline = t0 + args.duration
    if first_id is None:
        first_id = concurrency * 100_000
    if n_clients == 1:
        ids = range(first_id, first_id + n_requests)
        results, full_until = _stream_requests(target, model, ids, concurrency, deadline, args)
    else:
        # Streams and requests dealt round-robin: client c takes every n_clients-th id. Forked
        # (this process has no threads yet): a spawned child would re-import this module by a
        # name that ``python -m`` does not leave on its path.
        with ProcessPoolExecutor(n_clients, mp_context=get_context("fork")) as pool:
            shares = [
                pool.submit(
                    _stream_requests,
                    target,
                    model,
                    range(first_id + c, first_id + n_requests, n_clients),
                    len(range(c, concurrency, n_clients)),
                    deadline,
                    args,
                )
                for c in range(n_clients)
            ]
            done = [share.result() for share in shares]
        results = [r for share_results, _ in done for r in share_results]
        full_until = min(stopped for _, stopped in done)
    # From the first request's start: the client processes' start-up is not the server's time.
    begin = min((r.start for r in results), default=t0)
    wall = (max((r.end for r in results), default=begin) - begin) or 1e-9
    ok = [r for r in results if r.ok]
    lat = sorted(r.latency for r in ok)
    ttft = sorted(r.ttft for r in ok if r.ttft is not None)
    per_stream = [
        (r.tokens - 1) / (r.end - r.first)
        for r in ok
        if r.first and r.tokens > 1 and r.end > r.first
    ]
    total = sum(r.tokens for r in ok)
    full_s = full_until - begin
    timeline = by_second(results)
    whole = timeline[1:-1]  # the first and last seconds are partly outside the level
    return {
        "concurrency": concurrency,
        "requests": len(results),
        "errors": len(results) - len(ok),
        "first_errors": [r.error for r in results if not r.ok][:3],
        "completion_tokens": total,
        "wall_s": round(wall, 3),
        "aggregate_tps": total / wall,
        "full_load_s": round(full_s, 3),
        "full_load_tps": full_load_tps(ok, begin, full_until),
        "latency_p50_s": _pct(lat, 50),
        "latency_p90_s": _pct(lat, 90),
        "ttft_p50_s": _pct(ttft, 50),
        "ttft_p90_s": _pct(ttft, 90),
        "stream_tps_median": statistics.median(per_stream) if per_stream else None,
        "second_tps_median": statistics.median(whole) if whole else None,
        "second_tps_min": min(whole) if whole else None,
        "tps_by_second": timeline,
        "results": [r.report() for r in results],
    }


def full_load_tps(ok: list[Result], begin: float, until: float) -> float | None:
    """Tokens/s from the level's start (``begin``) until its first stream found no request left
    (``until``): while every stream had one, so a batching server's batch was full but for the
    gaps between a stream's requests. After it the level drains, its streams' last answers
    ending one by one, and the aggregate counts that too. Counted in content chunks, weighed
    to tokens (a chunk holds one token's text or, where text was held back, several's)."""
    chunks = sum(len(r.times) for r in ok)
    if until <= begin or not chunks:
        return None
    in_window = sum(1 for r in ok for t in r.times if t <= until)
    return in_window * sum(r.tokens for r in ok) / chunks / (until - begin)


def by_second(results: list[Result]) -> list[int]:
    """Content chunks per whole second of the monotonic clock, from the level's first chunk's
    second to its last's (every client process's clock is the same CLOCK_MONOTONIC)."""
    counts = collections.Counter()
    for r in results:
        counts.update(r.seconds)
    if not counts:
        return []
    return [counts[t] for t in range(min(counts), max(counts) + 1)]


def _pct(sorted_values: list[float], q: float) -> float | None:
    if not sorted_values:
        return None
    k = (len(sorted_values) - 1) * q / 100
    lo, hi = int(k), min(int(k) + 1, len(sorted_values) - 1)
    return sorted_values[lo] + (sorted_values[hi] - sorted_values[lo]) * (k - lo)


def first_model(target, timeout: float) -> str:
    host, port, base = target
    conn = http.client.HTTPConnection(host, port, timeout=timeout)
    try:
        conn.request("GET", f"{base}/v1/models")
        resp = conn.getresponse()
        data = json.loads(resp.read())
        return data["data"][0]["id"]
    finally:
        conn.close()


def markdown(report: dict) -> str:
    lines = [
        (
            f"**{report['label']}** — {report['url']}, model `{report['model']}`, "
            f"{report['settings']['endpoint']}, {report['settings']['max_tokens']} max tokens, "
            f"~{report['settings']['prompt_words']}-word prompts"
        ),
        "",
        (
            "| streams | requests | errors | aggregate tok/s | latency p50 / p90 s | "
            "TTFT p50 / p90 s | per-stream tok/s | tok/s by second: median / lowest | "
            "full-load tok/s |"
        ),
        "|---|---|---|---|---|---|---|---|---|",
    ]

    def f(x, d=2):
        return "—" if x is None else f"{x:.{d}f}"

    for lv in report["levels"]:
        lines.append(
            f"| {lv['concurrency']} | {lv['requests']} | {lv['errors']} | "
            f"{f(lv['aggregate_tps'], 1)} | {f(lv['latency_p50_s'])} / {f(lv['latency_p90_s'])} | "
            f"{f(lv['ttft_p50_s'])} / {f(lv['ttft_p90_s'])} | {f(lv['stream_tps_median'], 1)} | "
            f"{f(lv.get('second_tps_median'), 0)} / {f(lv.get('second_tps_min'), 0)} | "
            f"{f(lv.get('full_load_tps'), 1)} |"
        )
    levels = {lv["concurrency"]: lv for lv in report["levels"]}
    if 1 in levels and levels[1]["aggregate_tps"]:
        top = max(levels)
        lines += [
            "",
            (
                f"Scaling: {top} streams give "
                f"{levels[top]['aggregate_tps'] / levels[1]['aggregate_tps']:.2f}x the aggregate "
                "tokens/s of 1 stream."
            ),
        ]
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(
        prog="python -m bench.serve_load", description=__doc__.split("\n")[0]
    )
    p.add_argument("--url", default="http://127.0.0.1:8000", help="server base URL (loopback)")
    p.add_argument("--model", default=None, help="model id (default: the first of /v1/models)")
    p.add_argument("--concurrency", default="1,4,16")
    p.add_argument("--requests", type=int, default=None, help="per level (default 2 x streams)")
    p.add_argument("--max-tokens", type=int, default=64)
    p.add_argument(
        "--max-tokens-spread",
        type=int,
        default=0,
        help="answer lengths spread over max-tokens +- this (streams then end at different steps)",
    )
    p.add_argument("--prompt-words", type=int, default=64)
    p.add_argument("--endpoint", choices=["completions", "chat"], default="completions")
    p.add_argument("--duration", type=float, default=120.0, help="seconds per level, at most")
    p.add_argument("--timeout", type=float, default=300.0, help="seconds per request")
    p.add_argument(
        "--clients", type=int, default=None, help="client processes (default: one per 8 streams)"
    )
    p.add_argument("--label", default=None)
    p.add_argument("--out", default=None, help="write OUT.json and OUT.md")
    args = p.parse_args(argv)

    try:
        target = check_loopback(args.url)
    except NotLoopback as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    model = args.model
    if model is None:
        try:
            model = first_model(target, args.timeout)
        except (OSError, http.client.HTTPException, KeyError, IndexError, ValueError) as e:
            # mlx_lm.server's /v1/models scans the Hugging Face cache and fails for a local
            # directory; requests without "model" get its --model.
            print(f"note: no model id from /v1/models ({e!r}); sending none", file=sys.stderr)
    levels = []
    for c in [int(x) for x in args.concurrency.split(",")]:
        lv = run_level(target, model, c, args)
        print(
            f"{c:>3} streams: {lv['requests']} requests, {lv['errors']} errors, "
            f"{lv['aggregate_tps']:.1f} tok/s aggregate, latency p50 {lv['latency_p50_s']}",
            file=sys.stderr,
        )
        levels.append(lv)
    report = {
        "label": args.label or args.url,
        "url": args.url,
        "model": model,
        "settings": {k: v for k, v in vars(args).items() if k not in ("out",)},
        "levels": levels,
    }
    text = markdown(report)
    print(text)
    if args.out:
        write_results(args.out, report, text)
    return 0 if all(lv["errors"] == 0 for lv in levels) else 1


if __name__ == "__main__":
    sys.exit(main())
