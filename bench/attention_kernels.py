"""Attention for a few queries per row on CUDA: ``runtime.model.cuda_attention`` against MLX's
own ``scaled_dot_product_attention`` on the same inputs, in one run.

Three cases, each where mlxc's forwards meet a slow path of MLX 0.32's CUDA attention:

- ``ragged``: a decode batch of rows of different lengths (one query per row, a boolean
  ``key_valid`` mask). MLX has no fused kernel for an array mask with one query and runs
  matmul, mask and softmax separately. The same batch with equal rows and no mask (MLX's
  cuDNN decode) is the ``ceiling`` column: what attention would cost if the rows were equal.
- ``verify``: ``K + 1`` queries with the causal mask at a key length that grows every step (a
  speculative verification): MLX's cuDNN path builds a graph per key length.
- ``kv4``: one query against 4-bit keys and values. CUDA mlxc dequantised the live keys
  every step before this kernel (``layers.attend``); the ``ceiling`` is MLX on bf16 keys.
- ``latent``: MLA's decode attention over the latents (``cuda_attention.latent_attention``),
  at DeepSeek's widths (latents 512 wide, rope keys 64; 16 heads as V2-Lite, 128 as V3) and
  MiniCPM3's (256, 32; 40 heads), to 32k keys, one row or a ragged batch. ``MLX`` is the form
  mlxc composed from MLX's ops before the kernel (``latent.composed_attention``), the
  ``ceiling`` MLX's own attention on the two halves joined (its fallback ops for a head that
  wide, which the composed form replaced): neither is an upper bound here.

Each cell evaluates ``--steps`` times, after warm-up, a forward's worth of calls (16, the medium
llama's layers) at one key length, the next evaluation at a longer one (as decode steps go, so
graph builds per shape are in), and reports the median microseconds per call; the shapes are
the medium llama's attention (32 query heads, 8 KV heads, head dim 64).

    python -m bench.attention_kernels --out bench/results/attention-kernels-gpu-h200
    python -m bench.attention_kernels --against before.cuh --out NAME  # an A/B of two headers
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import subprocess
import sys
import time
from pathlib import Path

import mlx.core as mx
import numpy as np

from bench.report import write_results
from bench.run import machine
from mlxc.runtime.model import cuda_attention
from mlxc.runtime.model import latent as mla  # the bench names its MLA case `latent`
from mlxc.runtime.model.cache import KVQuant

HQ, HKV, D = 32, 8, 64
SCALE = D**-0.5


LAYERS = 16  # calls per evaluation, as the medium llama's forward makes


def _time(fn, steps: int) -> float:
    """Median microseconds per call over ``steps`` evaluations of LAYERS calls each (a
    forward's worth: the launches overlap as in a model; each evaluation's key length is new)."""
    for i in range(3):
        mx.eval([fn(i) for _ in range(LAYERS)])
    times = []
    for i in range(steps):
        t = time.perf_counter()
        mx.eval([fn(i + 3) for _ in range(LAYERS)])
        times.append(time.perf_counter() - t)
    return 1e6 * statistics.median(times) / LAYERS


def _buffers(B: int, T: int):
    cap = (T + 256 + 255) // 256 * 256  # a cache buffer grown in steps of 256, as mlx-lm's
    k = mx.random.normal((B, HKV, cap, D)).astype(mx.bfloat16)
    v = mx.random.normal((B, HKV, cap, D)).astype(mx.bfloat16)
    q = mx.random.normal((B, HQ, 8, D)).astype(mx.bfloat16)
    mx.eval(k, v, q)
    return q, k, v


def ragged(B: int, T: int, steps: int) -> dict:
    q, k, v = _buffers(B, T)
    q1 = q[:, :, :1]
    rng = np.random.default_rng(0)
    pad = rng.integers(0, T // 2, B)
    masks = [
        mx.array(np.arange(T + i)[None] >= pad[:, None])[:, None, None, :] for i in range(steps + 3)
    ]
    mx.eval(masks)

    def sl(i):
        return k[:, :, : T + i], v[:, :, : T + i]

    return {
        "ceiling": _time(
            lambda i: mx.fast.scaled_dot_product_attention(q1, *sl(i), scale=SCALE), steps
        ),
        "mlx": _time(
            lambda i: mx.fast.scaled_dot_product_attention(q1, *sl(i), scale=SCALE, mask=masks[i]),
            steps,
        ),
        "mlxc": _time(
            lambda i: cuda_attention.attention(q1, *sl(i), scale=SCALE, mask=masks[i]), steps
        ),
    }


def verify(B: int, T: int, L: int, steps: int) -> dict:
    q, k, v = _buffers(B, T)
    qL = q[:, :, :L]

    def sl(i):  # the key length moves on by about the accepted drafts each step
        return k[:, :, : T + 2 * i], v[:, :, : T + 2 * i]

    return {
        "ceiling": _time(
            lambda i: mx.fast.scaled_dot_product_attention(q[:, :, :1], *sl(i), scale=SCALE), steps
        ),
        "mlx": _time(
            lambda i: mx.fast.scaled_dot_product_attention(qL, *sl(i), scale=SCALE, mask="causal"),
            steps,
        ),
        "mlxc": _time(
            lambda i: cuda_attention.attention(qL, *sl(i), scale=SCALE, mask="causal"), steps
        ),
    }


def kv4(B: int, T: int, steps: int) -> dict:
    q, k, v = _buffers(B, T)
    q1 = q[:, :, :1]
    quant = KVQuant(bits=4, group_size=64)
    kq, vq = quant.quantize(k), quant.quantize(v)
    mx.eval(kq.parts, vq.parts)

    def sl(i):
        return kq[:, :, : T + i], vq[:, :, : T + i]

    def dequantised(i):
        kk, vv = sl(i)
        return mx.fast.scaled_dot_product_attention(
            q1, kk.dequantize(), vv.dequantize(), scale=SCALE
        )

    return {
        "ceiling": _time(
            lambda i: mx.fast.scaled_dot_product_attention(
                q1, k[:, :, : T + i], v[:, :, : T + i], scale=SCALE
            ),
            steps,
        ),
        "mlx": _time(dequantised, steps),
        "mlxc": _time(
            lambda i: cuda_attention.attention(q1, *sl(i), scale=SCALE, mask=None), steps
        ),
    }


def latent(B: int, H: int, C: int, RD: int, T: int, steps: int, chunks=()) -> dict:
    """The cell, and the kernel again at each count of ``chunks`` (key chunks per block row,
    its default's alternatives) as ``mlxc c{n}``."""
    cap = T + steps + 8
    latents = mx.random.normal((B, 1, cap, C)).astype(mx.bfloat16)
    k_pe = mx.random.normal((B, 1, cap, RD)).astype(mx.bfloat16)
    q_lat = mx.random.normal((B, H, 1, C)).astype(mx.bfloat16)
    q_pe = mx.random.normal((B, H, 1, RD)).astype(mx.bfloat16)
    mx.eval(latents, k_pe, q_lat, q_pe)
    pad = np.random.default_rng(0).integers(0, T // 2, B) if B > 1 else np.zeros(1, int)
    masks = [
        mx.array(np.arange(T + i)[None] >= pad[:, None])[:, None, None, :] if B > 1 else None
        for i in range(steps + 3)
    ]
    scale = 0.1

    def sl(i):
        return latents[:, :, : T + i], k_pe[:, :, : T + i]

    def joined(i):
        c, pe = sl(i)
        q = mx.concatenate([q_lat, q_pe], axis=-1)
        k = mx.concatenate([c, pe], axis=-1)
        return mx.fast.scaled_dot_product_attention(q, k, c, scale=scale, mask=masks[i])

    def kernel(n=None):
        return lambda i: cuda_attention.latent_attention(
            q_lat, q_pe, *sl(i), scale=scale, mask=masks[i], chunks=n
        )

    cell = {
        "ceiling": _time(joined, steps),
        "mlx": _time(
            lambda i: mla.composed_attention(q_lat, q_pe, *sl(i), scale=scale, mask=masks[i]),
            steps,
        ),
        "mlxc": _time(kernel(), steps),
    }
    for n in chunks:
        if n <= -(-T // (cuda_attention.WARPS * 32)):  # a round of keys for every warp
            cell[f"mlxc c{n}"] = _time(kernel(n), steps)
    return cell


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("--steps", type=int, default=30)
    ap.add_argument(
        "--cases", default="ragged,verify,kv4,latent", help="which cases, comma-separated"
    )
    ap.add_argument(
        "--latent-chunks",
        default="",
        help="also time the latent kernel at these chunk counts (comma-separated), besides its"
        " default (cuda_attention.LATENT_BLOCK_SUMS)",
    )
    ap.add_argument(
        "--header",
        help="time the kernels of this copy of cuda_attention.cuh, not the package's",
    )
    ap.add_argument(
        "--against",
        help="a copy of cuda_attention.cuh to A/B against: each side runs in processes of its own"
        " (MLX keys a kernel by its source string, which only #includes the header), in"
        " alternating rounds, and the report sets the medians side by side",
    )
    ap.add_argument("--rounds", type=int, default=2, help="rounds of an --against A/B")
    ap.add_argument("--out", required=True)
    args = ap.parse_args(argv)
    if args.against:
        _ab(args)
        return
    if args.header:
        cuda_attention._HEADER = cuda_attention.include_header(Path(args.header).resolve())
    if not cuda_attention.available():
        raise SystemExit(
            "bench.attention_kernels needs MLX's CUDA backend (the kernels are CUDA's)"
        )
    cases = set(args.cases.split(","))
    rows = []
    for B, T in [(1, 2048), (16, 256), (16, 2048), (64, 512)] if "ragged" in cases else []:
        rows.append(
            {"case": "ragged", "batch": B, "keys": T, "queries": 1, **ragged(B, T, args.steps)}
        )
    for B, T, L in [(1, 512, 3), (1, 2048, 5), (8, 1024, 3)] if "verify" in cases else []:
        rows.append(
            {"case": "verify", "batch": B, "keys": T, "queries": L, **verify(B, T, L, args.steps)}
        )
    for B, T in [(1, 2048), (16, 1024)] if "kv4" in cases else []:
        rows.append({"case": "kv4", "batch": B, "keys": T, "queries": 1, **kv4(B, T, args.steps)})
    # (rows, heads, latent width, rope width, keys): V2-Lite's heads, MiniCPM3's widths, ragged
    # batches, and V3's 128 heads (32 tiles of 4 heads a row).
    shapes = [(1, 16, 512, 64, 512), (1, 16, 512, 64, 4096), (1, 16, 512, 64, 32768)]
    shapes += [(1, 40, 256, 32, 4096), (1, 40, 256, 32, 16384), (4, 16, 512, 64, 4096)]
    shapes += [(16, 16, 512, 64, 2048), (1, 128, 512, 64, 1024), (1, 128, 512, 64, 4096)]
    chunks = [int(n) for n in args.latent_chunks.split(",") if n]
    for B, H, C, RD, T in shapes if "latent" in cases else []:
        case = f"latent {H}x{C}+{RD}"
        cell = latent(B, H, C, RD, T, args.steps, chunks)
        rows.append({"case": case, "batch": B, "keys": T, "queries": 1, **cell})
    for r in rows:
        r["mlx_over_mlxc"] = r["mlx"] / r["mlxc"]
        r["mlxc_over_ceiling"] = r["mlxc"] / r["ceiling"]
        print(json.dumps(r), flush=True)
    meta = _meta() | {"header": args.header or "the package's"}
    write_results(args.out, {"meta": meta, "rows": rows}, _markdown(meta, rows))


def _ab(args) -> None:
    """The cases with the package's header ("here") and with ``--against``, alternating, each
    run a process of its own; per cell the median of each side's rounds."""
    common = ["--steps", str(args.steps), "--cases", args.cases]
    common += ["--latent-chunks", args.latent_chunks]
    runs = {"here": [], "against": []}
    for i in range(args.rounds):
        for side, extra in (("here", []), ("against", ["--header", args.against])):
            out = f"{args.out}.{side}{i}"
            cmd = [sys.executable, "-m", "bench.attention_kernels", *common, *extra, "--out", out]
            subprocess.run(cmd, check=True)
            runs[side].append(json.loads(Path(out + ".json").read_text()))
    meta = runs["here"][0]["meta"] | {"against": args.against, "rounds": args.rounds}
    rows = _paired([r["rows"] for r in runs["here"]], [r["rows"] for r in runs["against"]])
    write_results(args.out, {"meta": meta, "rows": rows}, _markdown(meta, rows))


def _paired(here: list[list[dict]], against: list[list[dict]]) -> list[dict]:
    """Each cell's median over the rounds of "here", its kernel's median over those of
    "against" as ``mlxc against``, and the two sides' ratio."""

    def key(r: dict) -> tuple:
        return r["case"], r["batch"], r["keys"], r["queries"]

    rows = []
    for cells in zip(*here, strict=True):
        row = dict(cells[0])
        for name in [k for k in row if isinstance(row[k], float)]:
            row[name] = statistics.median(c[name] for c in cells)
        there = [r for rnd in against for r in rnd if key(r) == key(row)]
        row["mlx_over_mlxc"] = row["mlx"] / row["mlxc"]
        row["mlxc_over_ceiling"] = row["mlxc"] / row["ceiling"]
        row["mlxc against"] = statistics.median(r["mlxc"] for r in there)
        row["against_over_here"] = row["mlxc against"] / row["mlxc"]
        rows.append(row)
    return rows


def _meta() -> dict:
    """The run's machine and versions, and the commit measured."""
    return {
        "device": str(mx.default_device()),
        "mlx": mx.__version__,
        "host": platform.node(),
        "commit": machine("gpu").get("commit", ""),
    }


def _markdown(meta: dict, rows: list[dict]) -> str:
    """The results file's text: a row a cell, then the latent kernel by chunk counts (where
    ``--latent-chunks`` timed them)."""
    lines = [
        "# Attention kernels: mlxc's CUDA kernel against MLX's, microseconds per call",
        "",
        (
            f"MLX {meta['mlx']}, {meta['device']}, mlxc @ {meta['commit']}; 32 query heads, 8 KV"
            " heads, head dim 64, bf16 (latent: heads x latent width + rope width); median per"
            " call of 16-call evaluations. `ceiling`: MLX with no mask on equal rows (ragged), one"
            " query (verify), bf16 keys (kv4), MLX's attention on the joined halves (latent; `MLX`"
            " there: the composed form mlxc ran before the kernel)."
        ),
        "",
        "| case | batch | keys | queries | ceiling | MLX | mlxc | MLX / mlxc | mlxc / ceiling |",
        "|---|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for r in rows:
        lines.append(
            f"| {r['case']} | {r['batch']} | {r['keys']} | {r['queries']} | {r['ceiling']:.1f} |"
            f" {r['mlx']:.1f} | {r['mlxc']:.1f} | {r['mlx_over_mlxc']:.2f}x |"
            f" {r['mlxc_over_ceiling']:.2f}x |"
        )
    by_chunks = [r for r in rows if any(k.startswith("mlxc c") for k in r)]
    if by_chunks:
        lines += [
            "",
            (
                "The latent kernel by key chunks per block row (microseconds per call; `default`:"
                " `cuda_attention.LATENT_BLOCK_SUMS`'s choice):"
            ),
            "",
            "| case | batch | keys | default | by chunks |",
            "|---|---:|---:|---:|---|",
        ]
        for r in by_chunks:
            each = ", ".join(f"{k[6:]}: {v:.1f}" for k, v in r.items() if k.startswith("mlxc c"))
            lines.append(f"| {r['case']} | {r['batch']} | {r['keys']} | {r['mlxc']:.1f} | {each} |")
    if rows and "mlxc against" in rows[0]:
        lines += [
            "",
            (
                f"mlxc's kernels against those of `{meta['against']}` (medians of"
                f" {meta['rounds']} alternating rounds, each side a process of its own;"
                " microseconds per call):"
            ),
            "",
            "| case | batch | keys | queries | mlxc | against | against / mlxc |",
            "|---|---:|---:|---:|---:|---:|---:|",
        ]
        for r in rows:
            lines.append(
                f"| {r['case']} | {r['batch']} | {r['keys']} | {r['queries']} | {r['mlxc']:.1f} |"
                f" {r['mlxc against']:.1f} | {r['against_over_here']:.2f}x |"
            )
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    main()
