"""The device's time in a decode step's attention at batch one, kernel by kernel (CUDA)::

    python -m bench.attention_devtime --keys 600,2048 --out bench/results/attention-devtime-gpu-h100

A batch-one decode step on a GPU is bound by the host, so tokens/s cannot say whether a 4-bit
cache's attention kernel or its step's host work costs it speed against the float cache. This
reads the device's own kernel records (CUPTI, through ``torch.profiler`` in the same process:
it sees MLX's launches too) for one attention layer's work a step, at llama medium's shapes
(32 query heads, 8 KV heads, head dim 64, bf16), over ``LAYERS`` caches of ``--keys`` tokens:

* ``float``: the float cache's live slices, MLX's one-query kernel (as ``mlxc generate`` runs);
* ``float, mlxc kernel on buffers``: its whole buffers through mlxc's kernel
  (``cuda_attention.BUFFER_DECODE``);
* ``kv4``: the 4-bit cache (group 64), its newest tokens staged in float
  (``cache.StagingMixin``), through mlxc's kernel;
* ``kv4, unstaged``: the 4-bit cache quantising each token on arrival (``cache.staging`` off).

``--chunks`` also runs ``kv4`` with the kernel's keys split into each given number of chunks.
Each row: wall time a layer (host and device, the step evaluated), device time a layer (every
kernel's), and the kernels that took most. Needs torch with CUDA beside MLX's CUDA backend.
"""

from __future__ import annotations

import argparse
import json
import sys
import time

from bench.report import write_results

HQ, HKV, D, LAYERS, STEPS = 32, 8, 64, 16, 40


def _caches(kind: str, n: int) -> list:
    import mlx.core as mx

    from mlxc.runtime.model import cache

    caches = []
    for _ in range(LAYERS):
        c = cache.QuantizedKVCache(cache.KVQuant(4, 64)) if kind == "kv4" else cache.KVCache()
        k, v = (mx.random.normal((1, HKV, n, D)).astype(mx.bfloat16) for _ in range(2))
        c.update_and_fetch(k, v)
        caches.append(c)
    mx.eval(cache.cache_arrays(caches))
    return caches


def measure(kind: str, n: int) -> dict:
    """One variant's row: ``kind`` "float" or "kv4" under the module flags as set."""
    import mlx.core as mx
    import torch
    from torch.profiler import ProfilerActivity, profile

    from mlxc.runtime.model import layers

    caches = _caches(kind, n)
    q, kn, vn = (mx.random.normal((1, h, 1, D)).astype(mx.bfloat16) for h in (HQ, HKV, HKV))
    mx.eval(q, kn, vn)

    def step():
        x = q
        for c in caches:
            k, v = c.update_and_fetch(kn, vn)
            x = layers.attend(x, k, v, scale=D**-0.5, mask=None)
        mx.eval(x)

    for _ in range(5):  # kernel compiles, buffers grown
        step()
    start = time.perf_counter()
    # Without CUDA (the tests' CPU) the CPU's records: no kernels, wall times only.
    cuda = torch.cuda.is_available()
    with profile(activities=[ProfilerActivity.CUDA if cuda else ProfilerActivity.CPU]) as prof:
        for _ in range(STEPS):
            step()
    wall = (time.perf_counter() - start) / STEPS / LAYERS
    kernels = []
    for e in prof.key_averages():
        t = getattr(e, "device_time_total", None) or getattr(e, "cuda_time_total", 0)
        if t > 0:
            kernels.append(
                {"kernel": e.key, "us": t / STEPS / LAYERS, "calls": e.count / STEPS / LAYERS}
            )
    kernels.sort(key=lambda k: -k["us"])
    device = sum(k["us"] for k in kernels)
    return {"wall_us": wall * 1e6, "device_us": device, "kernels": kernels[:6]}


def run(keys: list[int], chunk_counts: list[int]) -> list[dict]:
    from mlxc.runtime.model import cache, cuda_attention

    real_chunks, real_staging = cuda_attention._chunks, cache.staging
    real_buffers = cuda_attention.BUFFER_DECODE
    rows = []
    for n in keys:
        variants = [
            ("float", "float", {}),
            ("float, mlxc kernel on buffers", "float", {"buffers": True}),
            ("kv4", "kv4", {}),
            ("kv4, unstaged", "kv4", {"unstaged": True}),
        ]
        variants += [(f"kv4, {c} chunks", "kv4", {"chunks": c}) for c in chunk_counts]
        for name, kind, opts in variants:
            cuda_attention.BUFFER_DECODE = opts.get("buffers", real_buffers)
            cache.staging = (lambda k, v: False) if opts.get("unstaged") else real_staging
            if "chunks" in opts:
                cuda_attention._chunks = lambda blocks, rounds, target=512, c=opts["chunks"]: c
                cuda_attention._launch.cache_clear()
            try:
                row = {"variant": name, "keys": n} | measure(kind, n)
            finally:
                cuda_attention.BUFFER_DECODE = real_buffers
                cache.staging = real_staging
                if "chunks" in opts:
                    cuda_attention._chunks = real_chunks
                    cuda_attention._launch.cache_clear()
            rows.append(row)
            print(json.dumps({k: v for k, v in row.items() if k != "kernels"}), file=sys.stderr)
    return rows


def report(result: dict) -> str:
    lines = [
        f"# Attention's device time at batch one ({result['device']})",
        "",
        (
            f"`{result['command']}`: MLX {result['mlx']}, commit {result['commit']}; {LAYERS} "
            f"layers' caches of llama medium's shapes ({HQ} query heads, {HKV} KV heads, head dim "
            f"{D}, bf16), {STEPS} steps under CUPTI (`torch.profiler`). Per layer a step: wall "
            "(host and device, each step evaluated) and device time (all kernels), and the "
            "kernel that took most."
        ),
        "",
        "| keys | variant | wall us | device us | top kernel (us) |",
        "|---:|---|---:|---:|---|",
    ]
    for r in result["rows"]:
        top = r["kernels"][0] if r["kernels"] else {"kernel": "-", "us": 0.0}
        lines.append(
            f"| {r['keys']:,} | {r['variant']} | {r['wall_us']:.1f} | {r['device_us']:.1f} | "
            f"{top['kernel'][:60]} ({top['us']:.1f}) |"
        )
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m bench.attention_devtime", description=__doc__)
    p.add_argument("--keys", default="600,2048", help="cached tokens, comma-separated")
    p.add_argument("--chunks", default="", help="also kv4 at these chunk counts (e.g. 4,8,16)")
    p.add_argument("--out", required=True, help="write OUT.json and OUT.md")
    args = p.parse_args(argv)

    import mlxc  # noqa: F401, I001  (before MLX: it may load a BLAS)
    import mlx.core as mx

    from bench.run import machine

    if not mx.cuda.is_available():
        p.error("needs MLX's CUDA backend (and torch with CUDA for the kernel records)")
    keys = [int(k) for k in args.keys.split(",")]
    chunk_counts = [int(c) for c in args.chunks.split(",") if c]
    info = machine("gpu")
    result = {
        "command": "python -m bench.attention_devtime " + " ".join(argv or sys.argv[1:]),
        "device": info.get("device_info", {}).get("device_name", "gpu"),
        "mlx": mx.__version__,
        "commit": info.get("commit", ""),
        "machine": info,
        "rows": run(keys, chunk_counts),
    }
    write_results(args.out, result, report(result))
    print(report(result))
    return 0


if __name__ == "__main__":
    sys.exit(main())
