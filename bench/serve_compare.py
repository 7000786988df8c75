"""Server throughput, mlxc against mlx-lm, in one run: ``mlxc serve`` and ``mlx_lm.server`` on
the same checkpoint, one after the other on this machine, each loaded by ``bench.serve_load``
at the same concurrency levels, and the device's ceiling at each level's batch size
(``bench.ceiling``: one batched decode forward per step of the same checkpoint, no HTTP, no
scheduler); one table with all three and the ratios::

    python -m bench.serve_compare --arch llama --size small --out bench/results/serve-cpu-small

Without ``--model`` a random checkpoint is written with ``bench.models`` (deterministic, with a
word-level tokenizer). Each server runs with its defaults except mlxc's ``--max-concurrency``,
set to the largest level so every stream is admitted at once (mlx-lm's server batches up to its
``--decode-concurrency``, default 32). The servers listen on loopback only.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shlex
import signal
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path

from bench import serve_load
from bench.report import write_results


def _wait_ready(url: str, proc: subprocess.Popen, timeout: float) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"server exited with {proc.returncode} before it was ready")
        try:
            # mlx_lm.server has no /health; both answer a completion of one token.
            body = json.dumps({"prompt": "hi", "max_tokens": 1}).encode()
            req = urllib.request.Request(
                url + "/v1/completions", body, {"Content-Type": "application/json"}
            )
            with urllib.request.urlopen(req, timeout=60) as r:
                if r.status == 200:
                    return
        except OSError:
            time.sleep(1)
    raise RuntimeError(f"server at {url} not ready after {timeout} s")


# The counters read from a server's /metrics: name -> (prometheus sample, its one label).
COUNTERS = {
    "forwards": ("mlxc_forwards_total", "kind"),
    "scheduler_s": ("mlxc_scheduler_seconds_total", "phase"),
}


def counters(url: str) -> dict[str, dict[str, float]] | None:
    """The server's ``COUNTERS`` by label value, from ``/metrics``; None from a server without
    them (mlx_lm.server)."""
    try:
        with urllib.request.urlopen(url + "/metrics", timeout=30) as r:
            text = r.read().decode()
    except OSError:
        return None
    out = {}
    for key, (sample, label) in COUNTERS.items():
        pattern = rf'^{sample}\{{{label}="(\w+)"\}} ([0-9.e+-]+)$'
        out[key] = {value: float(n) for value, n in re.findall(pattern, text, re.MULTILINE)}
    return out if out["forwards"] else None


def thread_cpu(pid: int) -> dict[str, float] | None:
    """CPU seconds (user + system) each thread of process ``pid`` has used, summed by thread
    name: ``main`` for its first thread (a server's HTTP event loop, or under ``mlxc serve``'s
    split the engine process's reader), the OS name for the others (mlxc names its scheduler
    thread ``mlxc-scheduler``), and ``child`` for every thread of the processes it started
    (``mlxc serve``'s HTTP process). None without Linux's /proc."""
    tasks = Path(f"/proc/{pid}/task")
    if not tasks.is_dir():
        return None
    used: dict[str, float] = {}
    for task in tasks.iterdir():
        name = "main" if task.name == str(pid) else _read(task / "comm")
        if name is not None:
            used[name] = used.get(name, 0.0) + _cpu_s(task)
        for child in (_read(task / "children") or "").split():
            child_tasks = Path(f"/proc/{child}/task")
            for child_task in child_tasks.iterdir() if child_tasks.is_dir() else ():
                used["child"] = used.get("child", 0.0) + _cpu_s(child_task)
    return used


def _read(path: Path) -> str | None:
    try:
        return path.read_text().strip()
    except OSError:  # the thread or process ended meanwhile
        return None


def _cpu_s(task: Path) -> float:
    """User + system CPU seconds of one /proc task (0 once it has ended)."""
    stat = _read(task / "stat")
    if stat is None:
        return 0.0
    fields = stat.rsplit(")", 1)[1].split()  # utime, stime: fields 14, 15 after the name
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def ptx_modules() -> int | None:
    """Kernel modules in MLX's CUDA compile cache (``MLX_PTX_CACHE_DIR``, else
    ``$TMPDIR/mlx/<version>/ptx``): one file per module MLX has compiled on this machine, so
    the count's growth over a level is what the level waited for NVRTC to compile. None where
    there is no such cache (not CUDA)."""
    given = os.environ.get("MLX_PTX_CACHE_DIR")
    dirs = [Path(given)] if given else list(Path(tempfile.gettempdir(), "mlx").glob("*/ptx"))
    dirs = [d for d in dirs if d.is_dir()]
    if not dirs:
        return None
    return sum(1 for d in dirs for _ in d.rglob("*.ptx"))


def _compiled(before: int | None, after: int | None) -> int | None:
    return None if before is None or after is None else after - before


def measure(
    name: str, command: list[str], port: int, args, log_dir: Path, cwd: str, cpu: bool = True
) -> dict:
    """Start one server, load it at every level, stop it; the serve_load report.

    ``cwd``: away from a source checkout, whose ``mlxc/`` would shadow the installed package.
    ``cpu``: report the server process's CPU time by thread (not for ``mlx.launch``, whose own
    process is the launcher). The server runs in a session of its own, so that stopping it
    reaches every process it started (a launcher's ranks)."""
    url = f"http://127.0.0.1:{port}"
    log = log_dir / f"{Path(args.out).name}.{name}.log"
    print(f"[{name}] {' '.join(command)}  (log: {log})", file=sys.stderr, flush=True)
    with open(log, "wb") as out:
        proc = subprocess.Popen(
            command, stdout=out, stderr=subprocess.STDOUT, cwd=cwd, start_new_session=True
        )
    try:
        _wait_ready(url, proc, args.startup_timeout)
        levels = []
        load_args = argparse.Namespace(
            requests=None,
            max_tokens=args.max_tokens,
            max_tokens_spread=args.max_tokens_spread,
            prompt_words=args.prompt_words,
            endpoint="completions",
            duration=args.duration,
            timeout=args.timeout,
            clients=None,
        )
        target = serve_load.check_loopback(url)
        # One full request first: the first decode steps of a server compile its kernels.
        serve_load.one_request(target, None, 999_999, load_args)
        for streams in args.levels:
            # Then one unmeasured wave at the level's concurrency, on prompts of its own (no
            # prompt cache can answer the measured ones from it): what a server builds once per
            # batch shape (kernels, cuBLAS plans) stays out of the level, as in the ceiling's.
            warm = argparse.Namespace(**{**vars(load_args), "requests": streams})
            modules = ptx_modules()
            serve_load.run_level(target, None, streams, warm, first_id=streams * 100_000 + 50_000)
            cpu_before = thread_cpu(proc.pid) if cpu else None
            before, warmed = counters(url), ptx_modules()
            measured = max(8, args.requests_per_stream * streams)
            level_args = argparse.Namespace(**{**vars(load_args), "requests": measured})
            level = serve_load.run_level(target, None, streams, level_args)
            after, cpu_after = counters(url), thread_cpu(proc.pid) if cpu else None
            level["ptx_compiled"] = {
                "warm_wave": _compiled(modules, warmed),
                "level": _compiled(warmed, ptx_modules()),
            }
            if before is not None and after is not None:  # the level's forwards, phases
                for key, now in after.items():
                    level[key] = {k: now[k] - before[key].get(k, 0.0) for k in now}
            if cpu_before is not None and cpu_after is not None:
                level["thread_cpu_s"] = {
                    k: round(v - cpu_before.get(k, 0.0), 3) for k, v in cpu_after.items()
                }
            print(
                f"[{name}] {streams:>3} streams: {level['aggregate_tps']:.1f} tok/s, "
                f"{level['errors']} errors",
                file=sys.stderr,
                flush=True,
            )
            levels.append(level)
        return {"label": name, "command": command, "levels": levels}
    finally:
        _signal_session(proc.pid, signal.SIGTERM)
        try:
            proc.wait(30)
        except subprocess.TimeoutExpired:
            _signal_session(proc.pid, signal.SIGKILL)
            proc.wait()


def _signal_session(pid: int, sig: int) -> None:
    """``sig`` to every process of the session ``pid`` leads (none left: nothing to do)."""
    try:
        os.killpg(pid, sig)
    except ProcessLookupError:
        pass


def mlxc_command(model: str, args) -> list[str]:
    """``mlxc serve`` on ``model`` as the run starts it: under ``mlx.launch`` with
    ``--mlxc-ranks`` above one (tensor parallelism: every rank runs every forward, rank 0
    binds HTTP)."""
    serve = [sys.executable, "-m", "mlxc.cli", "serve", "--model", model]
    serve += ["--port", str(args.port), "--max-concurrency", str(max(args.levels))]
    serve += shlex.split(args.mlxc_args)
    if args.mlxc_ranks == 1:
        return serve
    from bench.tp_compare import launch_prefix

    return [*launch_prefix(args.mlxc_ranks, _backend(args)), *serve]


def _backend(args) -> str:
    return args.mlxc_backend or ("nccl" if args.gpu else "ring")


def measure_ceiling(model: str, args) -> dict[str, dict[int, float]]:
    """``bench.ceiling`` in its own process (the servers have exited), at every level."""
    command = [sys.executable, "-m", "bench.ceiling", "--model", model]
    command += ["--batch", ",".join(map(str, args.levels)), "--steps", str(args.max_tokens)]
    command += ["--prompt-tokens", str(args.prompt_words), "--scheduler"]
    print(f"[ceiling] {' '.join(command)}", file=sys.stderr, flush=True)
    out = subprocess.run(command, check=True, stdout=subprocess.PIPE, text=True).stdout
    result = json.loads(out.strip().splitlines()[-1])
    return {k: {int(b): x for b, x in v.items()} for k, v in result.items()}


def markdown(report: dict) -> str:
    ours, peer = report["mlxc"], report["mlx-lm"]
    lines = [
        f"### Server throughput: mlxc serve vs mlx_lm.server ({_machine(report['machine'])})",
        "",
        (
            f"`{report['command']}`. Checkpoint: {report['checkpoint']}; completions, streaming, "
            f"{report['max_tokens']} tokens per request"
            + (f" (+- {report['max_tokens_spread']})" if report.get("max_tokens_spread") else "")
            + f", ~{report['prompt_words']}-word prompts, "
            f"every prompt different, {report.get('requests_per_stream', 2)} requests per stream "
            "(at least 8) per level. Aggregate = completion tokens / wall time of the level, "
            "which follows an unmeasured wave of as many requests as streams. "
            "Ceiling = `bench.ceiling`: one batched decode forward per step at the level's batch "
            "size (mlx-lm's model, plain KV caches, async_eval), no HTTP, no scheduler; the "
            "best of its runs (`ceiling_runs` in the JSON). "
            "Scheduler = mlxc's Scheduler in-process on the same checkpoint, no HTTP. "
            "Full load = the level's tokens/s until its first stream had no request left "
            "(`bench.serve_load`), while every stream had one, as the ceiling's batch always "
            "has: after it the level drains, its streams' last answers ending one by one."
            + (
                f" mlxc serve ran with `{report['mlxc_args']}`; the scheduler, the ceiling and "
                "mlx_lm.server without."
                if report.get("mlxc_args")
                else ""
            )
            + (
                f" mlxc serve ran sharded over {report['mlxc_ranks']} ranks (`mlx.launch`, "
                f"backend {report['mlxc_backend']}); the scheduler, the ceiling and mlx_lm.server "
                "in one process."
                if report.get("mlxc_ranks", 1) > 1
                else ""
            )
        ),
        "",
        (
            "| streams | mlxc tok/s | scheduler tok/s | ceiling tok/s | mlxc / ceiling | "
            "mlxc full load tok/s | full load / ceiling | "
            "mlx-lm tok/s | mlxc / mlx-lm | mlx-lm full load tok/s | mlxc / mlx-lm at full load "
            "| mlxc TTFT p50 s | mlx-lm TTFT p50 s | errors mlxc / mlx-lm |"
        ),
        "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for a, b in zip(ours["levels"], peer["levels"]):
        lines.append(
            f"| {a['concurrency']} | {a['aggregate_tps']:.1f} | {a['scheduler_tps']:.1f} | "
            f"{a['ceiling_tps']:.1f} | **{a['ceiling_ratio']:.2f}** | "
            f"{_num(a.get('full_load_tps'), 1)} | "
            f"**{_num(a.get('full_load_ceiling_ratio'))}** | "
            f"{b['aggregate_tps']:.1f} | **{_times(_ratio(a['aggregate_tps'], b['aggregate_tps']))}** | "
            f"{_num(b.get('full_load_tps'), 1)} | "
            f"{_times(_ratio(a.get('full_load_tps'), b.get('full_load_tps')))} | "
            f"{_num(a['ttft_p50_s'])} | {_num(b['ttft_p50_s'])} | {a['errors']} / {b['errors']} |"
        )
    counted = [a for a in ours["levels"] if "forwards" in a]
    if counted:
        lines += [
            "",
            "mlxc's model forwards per level (`mlxc_forwards_total`): "
            + "; ".join(
                f"{a['concurrency']} streams: {a['forwards'].get('prefill', 0):.0f} prefill, "
                f"{a['forwards'].get('decode', 0):.0f} decode{_rows(a)}"
                for a in counted
            )
            + ". Rows: the level's tokens after each request's first (which its prefill "
            "makes) per decode forward, the batch a decode forward ran on average (the "
            "ceiling's is always the level's streams).",
        ]
    phased = [a for a in counted if a.get("scheduler_s") and a["forwards"].get("decode")]
    if phased:
        lines += [
            "",
            "mlxc's scheduler thread per decode forward, ms of wall time by phase "
            "(`mlxc_scheduler_seconds_total`; `other`: the ticks less their phases): "
            + "; ".join(f"{a['concurrency']} streams: {_per_forward(a)}" for a in phased)
            + ".",
        ]
    lines += ["", _by_second(ours, peer)]
    compiled = [a for a in ours["levels"] if (a.get("ptx_compiled") or {}).get("level") is not None]
    if compiled:
        lines += [
            "",
            "Kernel modules MLX compiled (NVRTC) while mlxc served, in the unmeasured wave / in the "
            "measured level (`bench.serve_compare.ptx_modules`): "
            + "; ".join(
                f"{a['concurrency']} streams: {a['ptx_compiled']['warm_wave']} / "
                f"{a['ptx_compiled']['level']}"
                for a in compiled
            )
            + ".",
        ]
    timed = [a for a in ours["levels"] if a.get("thread_cpu_s") and a["completion_tokens"]]
    if timed:
        lines += [
            "",
            "mlxc's CPU time per streamed token by thread, microseconds (`/proc`; `main`: the "
            "first thread, the HTTP event loop in one process, the engine's reader beside an HTTP "
            "process; `child`: the HTTP process, all its threads): "
            + "; ".join(f"{a['concurrency']} streams: {_per_token(a)}" for a in timed)
            + ".",
        ]
    lines.append("")
    for side in (ours, peer):
        first, last = side["levels"][0], side["levels"][-1]
        if first["aggregate_tps"]:
            lines.append(
                f"- {side['label']}: {last['concurrency']} streams give "
                f"{last['aggregate_tps'] / first['aggregate_tps']:.2f}x the aggregate of "
                f"{first['concurrency']}."
            )
    return "\n".join(lines) + "\n"


def _by_second(ours: dict, peer: dict) -> str:
    """The line of each level's tokens/s second by second: the median and the lowest whole
    second, each side (``bench.serve_load``): a stall (a compile, a prompt burst) shows in the
    lowest where the aggregate averages it away."""

    def pair(level: dict) -> str:
        median, low = level.get("second_tps_median"), level.get("second_tps_min")
        return "—" if median is None else f"{median:,.0f} / {low:,.0f}"

    return (
        "Tokens/s by whole second, median / lowest, mlxc and mlx-lm: "
        + "; ".join(
            f"{a['concurrency']} streams: {pair(a)} and {pair(b)}"
            for a, b in zip(ours["levels"], peer["levels"])
        )
        + "."
    )


def _machine(m: dict) -> str:
    where = m.get("device_info", {}).get("device_name") or m.get("cpu", "?")
    return f"{where}, {m.get('cpus')} CPUs, mlx {m.get('mlx')}, mlx-lm {m.get('mlx_lm')}"


def _per_token(level: dict) -> str:
    """``main 69, mlxc-scheduler 114, child 45, other 830``: a level's CPU microseconds per
    token (``child`` only where the server started processes)."""
    cpu = level["thread_cpu_s"]
    parts = {"main": cpu.get("main", 0.0), "mlxc-scheduler": cpu.get("mlxc-scheduler", 0.0)}
    if "child" in cpu:
        parts["child"] = cpu["child"]
    parts["other"] = sum(v for k, v in cpu.items() if k not in (*parts, "child"))
    return ", ".join(f"{k} {v / level['completion_tokens'] * 1e6:.0f}" for k, v in parts.items())


def _rows(level: dict) -> str:
    """`` (51.7 rows)``: completion tokens after each request's first per decode forward."""
    decode = level["forwards"].get("decode", 0)
    if not decode:
        return ""
    after_first = level["completion_tokens"] - (level["requests"] - level["errors"])
    return f" ({after_first / decode:.1f} rows)"


def _per_forward(level: dict) -> str:
    """``build 1.1, dispatch 1.9, ...``: a level's scheduler phases in ms per decode forward."""
    spent, n = level["scheduler_s"], level["forwards"]["decode"]
    parts = {k: v for k, v in spent.items() if k != "tick"}
    parts["other"] = spent.get("tick", 0.0) - sum(parts.values())
    return ", ".join(f"{k} {v / n * 1e3:.2f}" for k, v in parts.items())


def _num(x, digits: int = 2) -> str:
    return "—" if x is None else f"{x:.{digits}f}"


def _times(x: float | None) -> str:
    return "—" if x is None else f"{x:.2f}x"


def _ratio(a: float | None, b: float | None) -> float | None:
    return a / b if a is not None and b else None


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m bench.serve_compare", description=__doc__)
    p.add_argument("--model", help="checkpoint directory (default: write one with bench.models)")
    p.add_argument("--arch", default="llama")
    p.add_argument("--size", default="small", choices=["small", "medium"])
    p.add_argument("--levels", default="1,4,16,64", help="concurrent streams, comma-separated")
    p.add_argument("--max-tokens", type=int, default=64)
    p.add_argument(
        "--max-tokens-spread",
        type=int,
        default=0,
        help="answer lengths spread over max-tokens +- this (bench.serve_load)",
    )
    p.add_argument("--prompt-words", type=int, default=64)
    p.add_argument(
        "--requests-per-stream",
        type=int,
        default=2,
        help="requests per level per stream (at least 8 in all): more amortise the level's start "
        "and end, when its streams fill and drain, for a steadier rate",
    )
    p.add_argument("--duration", type=float, default=120.0, help="seconds per level, at most")
    p.add_argument("--timeout", type=float, default=300.0, help="seconds per request")
    p.add_argument("--startup-timeout", type=float, default=300.0)
    p.add_argument("--port", type=int, default=18300)
    p.add_argument(
        "--mlxc-args",
        default="",
        help="more flags for mlxc serve, e.g. '--kv-bits 4' (mlx_lm.server and the ceiling run "
        "without them)",
    )
    p.add_argument(
        "--mlxc-ranks",
        type=int,
        default=1,
        help="run mlxc serve under mlx.launch -n N (tensor parallelism; rank 0 serves HTTP)",
    )
    p.add_argument(
        "--mlxc-backend", default=None, help="mlx.launch's backend: nccl with --gpu, else ring"
    )
    p.add_argument("--gpu", action="store_true", help="record the run as a GPU run")
    p.add_argument("--out", required=True, help="write OUT.json and OUT.md")
    args = p.parse_args(argv)
    args.levels = [int(x) for x in args.levels.split(",")]

    from bench import models, run

    with tempfile.TemporaryDirectory(prefix="mlxc-serve-bench-") as tmp:
        model = args.model and str(Path(args.model).resolve())
        if model is None:
            model = str(Path(tmp) / f"{args.arch}-{args.size}")
            models.write_checkpoint(Path(model), args.arch, args.size)
            models.write_tokenizer(Path(model), models.config(args.arch, args.size)["vocab_size"])
        log_dir = Path(args.out).parent
        log_dir.mkdir(parents=True, exist_ok=True)
        py = sys.executable
        ours = measure(
            "mlxc", mlxc_command(model, args), args.port, args, log_dir, tmp, args.mlxc_ranks == 1
        )
        peer = measure(
            "mlx-lm",
            [py, "-m", "mlx_lm.server", "--model", model, "--port", str(args.port + 1)],
            args.port + 1,
            args,
            log_dir,
            tmp,
        )
        ceiling = measure_ceiling(model, args)
    for level in ours["levels"]:
        level["ceiling_tps"] = ceiling["ceiling"][level["concurrency"]]
        level["ceiling_runs"] = ceiling["ceiling_runs"][level["concurrency"]]
        level["scheduler_tps"] = ceiling["scheduler"][level["concurrency"]]
        level["scheduler_ms_per_tick"] = ceiling["scheduler_ms_per_tick"][level["concurrency"]]
        level["ceiling_ratio"] = level["aggregate_tps"] / level["ceiling_tps"]
        level["full_load_ceiling_ratio"] = _ratio(level.get("full_load_tps"), level["ceiling_tps"])
    report = {
        "command": "python -m bench.serve_compare " + " ".join(argv or sys.argv[1:]),
        "machine": run.machine("gpu" if args.gpu else "cpu"),
        "checkpoint": args.model or f"bench.models {args.arch} {args.size} (random, bf16)",
        "max_tokens": args.max_tokens,
        "max_tokens_spread": args.max_tokens_spread,
        "prompt_words": args.prompt_words,
        "requests_per_stream": args.requests_per_stream,
        "mlxc_args": args.mlxc_args,
        "mlxc_ranks": args.mlxc_ranks,
        "mlxc_backend": _backend(args),
        "ld_preload": os.environ.get("LD_PRELOAD", ""),
        "mlxc": ours,
        "mlx-lm": peer,
    }
    text = markdown(report)
    print(text)
    write_results(args.out, report, text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
