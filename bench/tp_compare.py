"""Tensor parallelism against one process, on the same checkpoint: the sharded model's logits
against the unsharded model's, and prefill and decode tokens/s at TP=N against TP=1::

    python -m bench.tp_compare --device gpu --size medium --archs llama,qwen3 --ranks 2 \\
        --out bench/results/tp-gpu-h200x2

Each architecture's checkpoint (``bench.models``, bf16) runs in a process of its own (TP=1) and
under ``mlx.launch -n RANKS`` (TP=N: ``--backend``, nccl on CUDA, ring on this machine's
loopback elsewhere), which loads it sharded (``load_model(group=...)``, as ``mlxc generate``
does under ``mlx.launch``). The two alternate, ``--repeats`` times, each a fresh process whose
loading is not timed; medians are reported. In each process: a warm-up generation, then per
prompt length one greedy generation (``bench.harness.run_once``: prefill tokens/s to the first
token, decode tokens/s after it, the rank's peak memory: its share of the weights plus the
run's extra peak).

Logits: the last position's logits of a fixed prompt, as ``max |TP=N - TP=1| / std(TP=1)``.
The ranks add their partial sums in another order than one process does, so the two differ by
rounding: in float32 (the CPU's compute dtype) within 1e-4 of the logits' spread; in bf16 by
about what bf16 rounding alone moves them, which the TP=1 process measures beside them (the same
prompt's logits with the checkpoint loaded as float32 against bf16: ``bf16_floor``). A sharded
run passes when its difference is within 1e-4 (float32) or 2x that floor (bf16, float16).
Greedy tokens are compared too (``tokens_equal``: the leading tokens both runs generated alike;
random weights leave near-ties that rounding can flip, so a shorter run of equal tokens is
reported, not failed).
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

import numpy as np

from bench.report import write_results

ROOT = Path(__file__).resolve().parent.parent
FLOAT32_TOL = 1e-4  # of the logits' standard deviation
FLOOR_FACTOR = 2.0  # a half-precision run: within this many bf16 floors


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(prog="python -m bench.tp_compare", description=__doc__)
    p.add_argument("--device", choices=["cpu", "gpu"], default="gpu")
    p.add_argument("--size", choices=["small", "medium"], default="medium")
    p.add_argument("--archs", default="llama", help="comma-separated bench.models names")
    p.add_argument("--ranks", type=int, default=2)
    p.add_argument("--backend", default=None, help="mlx.launch's: nccl on gpu, ring on cpu")
    p.add_argument("--prefill", default="512,2048", help="prompt lengths, comma-separated")
    p.add_argument("--decode-tokens", type=int, default=128)
    p.add_argument("--logits-prompt", type=int, default=64)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--work-dir", default=None, help="checkpoints go here (default: a temp dir)")
    p.add_argument("--out", default=None, help="write OUT.json and OUT.md")
    p.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--model", help=argparse.SUPPRESS)
    p.add_argument("--worker-out", help=argparse.SUPPRESS)
    p.add_argument("--floor", action="store_true", help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.worker:
        worker(args)
        return
    backend = args.backend or ("nccl" if args.device == "gpu" else "ring")
    with tempfile.TemporaryDirectory(prefix="mlxc-tp-") as tmp:
        work = Path(args.work_dir or tmp)
        rows = {arch: compare_arch(arch, args, backend, work) for arch in args.archs.split(",")}
    result = {"command": " ".join(argv or sys.argv[1:]), "backend": backend, "rows": rows}
    result["machine"] = rows[next(iter(rows))].pop("machine")
    for row in rows.values():
        row.pop("machine", None)
    text = markdown(result, args)
    print(text)
    if args.out:
        write_results(args.out, result, text)


def compare_arch(arch: str, args, backend: str, work: Path) -> dict:
    from bench import models

    path = work / f"{arch}-{args.size}"
    if not (path / "config.json").exists():
        print(f"== writing {arch} {args.size} to {path}", flush=True)
        models.write_checkpoint(path, arch, args.size)
    runs: dict[int, list[dict]] = {1: [], args.ranks: []}
    for r in range(args.repeats):
        for ranks, done in runs.items():
            print(f"== {arch}: TP={ranks}, repeat {r + 1} of {args.repeats}", flush=True)
            done.append(spawn(path, ranks, args, backend, work, repeat=r))
    one, many = runs[1], runs[args.ranks]
    logits_one = np.load(one[0]["logits"])
    spread = float(logits_one.std())
    diff = max(float(abs(np.load(m["logits"]) - logits_one).max()) for m in many) / spread
    floor = one[0].get("bf16_floor")
    tol = FLOAT32_TOL if floor is None else FLOOR_FACTOR * floor
    row = {
        "dtype": one[0]["dtype"],
        "logits_diff": diff,
        "bf16_floor": floor,
        "tolerance": tol,
        "logits_ok": diff <= tol,
        "tokens_equal": min(_leading_equal(one[0]["tokens"], m["tokens"]) for m in many),
        "tokens": len(one[0]["tokens"]),
        "machine": one[0]["machine"],
        "levels": {},
    }
    for n in one[0]["cells"]:
        cell = {}
        for ranks, rs in runs.items():
            cell[ranks] = {
                key: statistics.median(r["cells"][n][key] for r in rs)
                for key in ("prefill_tps", "decode_tps", "peak_bytes")
            }
            cell[ranks]["all_decode"] = [round(r["cells"][n]["decode_tps"], 1) for r in rs]
        row["levels"][n] = cell
    return row


def spawn(path: Path, ranks: int, args, backend: str, work: Path, repeat: int) -> dict:
    """One run in fresh processes; its numbers (rank 0's), the logits beside them. The TP=1
    run of the first repeat also measures the bf16 floor."""
    out = work / f"{path.name}-tp{ranks}-{repeat}.json"
    out.unlink(missing_ok=True)
    cmd = [sys.executable, "-m", "bench.tp_compare", "--worker", "--model", str(path)]
    cmd += ["--device", args.device, "--prefill", args.prefill, "--worker-out", str(out)]
    cmd += ["--decode-tokens", str(args.decode_tokens), "--logits-prompt", str(args.logits_prompt)]
    if ranks == 1:
        cmd += ["--floor"] if repeat == 0 else []
    else:
        cmd = [*launch_prefix(ranks, backend), *cmd]
    env = {
        **os.environ,
        "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")]),
    }
    done = subprocess.run(cmd, cwd=ROOT, check=False, env=env)
    if done.returncode != 0 or not out.exists():
        raise SystemExit(f"the TP={ranks} run failed (exit {done.returncode}): {' '.join(cmd)}")
    return json.loads(out.read_text())


def launch_prefix(ranks: int, backend: str) -> list[str]:
    """``mlx.launch -n RANKS --backend BACKEND ... --`` on this host: for ring a free loopback
    port a rank; for nccl NVLink multicast kept off in every rank (``NCCL_NVLS_ENABLE=0``: on
    shared machines a program using it can take the host's GPUs out of service)."""
    cmd = [str(Path(sys.executable).with_name("mlx.launch")), "-n", str(ranks)]
    cmd += ["--backend", backend]
    if backend == "ring":
        cmd += ["-p", str(free_ports(ranks))]
    elif backend == "nccl":
        cmd += ["--env", "NCCL_NVLS_ENABLE=0"]
    return [*cmd, "--"]


def free_ports(n: int) -> int:
    """A port p with p .. p + n - 1 free on loopback (the ring backend takes one per rank)."""
    for _ in range(50):
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        socks = []
        try:
            for q in range(port, min(port + n, 65536)):
                socks.append(socket.socket())
                socks[-1].bind(("127.0.0.1", q))
            if len(socks) == n:
                return port
        except OSError:
            continue
        finally:
            for s in socks:
                s.close()
    raise RuntimeError("no free ports")


def worker(args) -> None:
    """One process of a run (under ``mlx.launch``: one rank): load, measure, and on rank 0
    write the numbers, the greedy tokens and the logits (beside them, ``.npy``)."""
    from mlxc.runtime import blas

    blas.preload(args.device)  # before MLX is imported
    import mlx.core as mx

    from bench import harness
    from bench.run import _dtype_of, machine
    from mlxc.runtime.checkpoint.loading import load_model
    from mlxc.runtime.serving.distributed import world

    mx.set_default_device(mx.gpu if args.device == "gpu" else mx.cpu)
    group = world()
    model = load_model(args.model, group=group)
    side = harness.Side("mlxc", "ours", model, _dtype_of(model))
    config = json.loads((Path(args.model) / "config.json").read_text())
    vocab = config.get("vocab_size") or config["text_config"]["vocab_size"]
    ids = harness.prompt(args.logits_prompt, vocab, seed=1)
    logits = model(mx.array([ids]))[0, -1].astype(mx.float32)
    mx.eval(logits)  # on every rank: the forward's all-reduces need them all
    result = {"dtype": side.dtype, "cells": {}, "machine": machine(args.device)}
    if args.floor and side.dtype != "float32":
        whole = load_model(args.model, dtype=mx.float32)
        exact = whole(mx.array([ids]))[0, -1]
        result["bf16_floor"] = float(mx.abs(exact - logits).max() / exact.std())
        del whole
    harness.run_once(side, harness.prompt(32, vocab), 8)  # warm-up: kernels compiled
    for n in (int(x) for x in args.prefill.split(",")):
        run = harness.run_once(side, harness.prompt(n, vocab), args.decode_tokens + 1)
        result["cells"][str(n)] = {
            "prefill_tps": n / run.first_s,
            "decode_tps": run.decode_tps,
            "peak_bytes": run.peak_bytes,
        }
        result["tokens"] = run.tokens
    if group is None or group.rank() == 0:
        out = Path(args.worker_out)
        result["logits"] = str(out.with_suffix(".npy"))
        np.save(result["logits"], np.array(logits))
        out.write_text(json.dumps(result) + "\n")


def _leading_equal(a: list[int], b: list[int]) -> int:
    n = 0
    for x, y in zip(a, b, strict=False):
        if x != y:
            break
        n += 1
    return n


def markdown(result: dict, args) -> str:
    m = result["machine"]
    device = m.get("device_info", {}).get("device_name", m.get("cpu", args.device))
    setting = (
        f"`python -m bench.tp_compare {result['command']}`: {device}, MLX {m.get('mlx')}, "
        f"mlx.launch backend {result['backend']}; medians of {args.repeats} alternating runs, "
        "each a fresh process. Logits: max |TP=N - TP=1| / std(TP=1) at a fixed prompt's last "
        f"position; tolerance {FLOAT32_TOL:g} in float32, else {FLOOR_FACTOR:g}x the bf16 floor "
        "(TP=1's logits loaded as float32 against its own). Tokens equal: the leading greedy "
        "tokens both generated alike. Peak: the rank's weights plus the run's extra peak."
    )
    header = (
        "| model | dtype | prompt | prefill TP=1 | TP=N | ratio | decode TP=1 | TP=N | ratio "
        "| peak MiB TP=1 / TP=N rank | logits diff | tolerance | tokens equal |"
    )
    title = f"# Tensor parallelism: TP={args.ranks} against one process"
    lines = [title, "", setting, "", header, "|---" * 13 + "|"]
    for arch, row in result["rows"].items():
        for n, cell in row["levels"].items():
            a, b = cell[1], cell[args.ranks]
            lines.append(
                f"| {arch} | {row['dtype']} | {n} | {a['prefill_tps']:,.0f} | "
                f"{b['prefill_tps']:,.0f} | **{b['prefill_tps'] / a['prefill_tps']:.2f}x** | "
                f"{a['decode_tps']:,.1f} | {b['decode_tps']:,.1f} | "
                f"**{b['decode_tps'] / a['decode_tps']:.2f}x** | "
                f"{a['peak_bytes'] / 2**20:,.0f} / {b['peak_bytes'] / 2**20:,.0f} | "
                f"{row['logits_diff']:.2e} | {row['tolerance']:.1e} "
                f"{'ok' if row['logits_ok'] else '**over**'} | "
                f"{row['tokens_equal']} / {row['tokens']} |"
            )
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    main()
