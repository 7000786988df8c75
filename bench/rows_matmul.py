"""Products of a few rows on CUDA: MLX's own against mlxc's kernel (``runtime.model.cuda_matmul``)::

    python -m bench.rows_matmul --out bench/results/rows-matmul-gpu-h100-s28

MLX multiplies one row by a weight with its matrix-vector kernel and two or more with cuBLASLt;
``cuda_matmul.route`` gives a loaded model's dense projections mlxc's kernel for 2 to
``cuda_matmul.MAX_ROWS`` rows. Two parts, both sides in one process:

* **products**: the projections of ``bench.models``' llama medium and its LM head at 1 to 64 rows,
  ``--calls`` independent products a graph, timed as ``bench.encode_costs`` times an operation
  (per product: building the graph, MLX encoding it with the device idle, and the wall time
  from the build's end to the results; median of ``--repeats``). ``x @ w.T`` against
  ``cuda_matmul.matmul`` (MLX's own product where it does not apply: one row, more than
  MAX_ROWS). Independent products overlap on the device, so a kernel of few, long blocks looks
  better here than in a forward, where each product waits for the one before (s29: 0.58-0.86x
  cuBLAS's time here, decode 0.50x); the decode part is the measure that counts;
* **decode**: ``bench.ceiling``'s loop (all rows decode together, each step queued with
  ``mx.async_eval`` before the last one's tokens are read) on mlx-lm's llama medium, its
  ``nn.Linear`` and ``nn.Embedding`` layers routed and not, alternating, best of ``--repeats``
  tokens/s per batch size.
"""

from __future__ import annotations

import argparse
import sys
import tempfile
from pathlib import Path

from bench.report import write_results

SHAPES = [(2048, 3072), (2048, 2048), (2048, 16384), (8192, 2048), (2048, 128256)]  # K, N


def products(rows: list[int], calls: int, repeats: int) -> list[dict]:
    import mlx.core as mx

    from bench.encode_costs import measure
    from mlxc.runtime.model import cuda_matmul

    sides = {
        "mlx": lambda x, w: x @ w.T,
        "mlxc": lambda x, w: cuda_matmul.matmul(x, w) if cuda_matmul.applies(x, w) else x @ w.T,
    }
    out = []
    for K, N in SHAPES:
        n_weights = 4 if N > 20000 else 16  # distinct weights, so the calls do not share one
        ws = [(mx.random.normal((N, K)) * K**-0.5).astype(mx.bfloat16) for _ in range(n_weights)]
        mx.eval(ws)
        for M in rows:
            xs = [mx.random.normal((M, K)).astype(mx.bfloat16) for _ in range(calls)]
            mx.eval(xs)
            row = {"K": K, "N": N, "rows": M}
            for name, fn in sides.items():
                row[name] = measure(_graph(fn, xs, ws), calls, repeats)
            out.append(row)
            print(f"[rows_matmul] {K}x{N} rows {M}: {row}", file=sys.stderr, flush=True)
        mx.clear_cache()
    return out


def _graph(fn, xs: list, ws: list):
    """``build(n)``: ``n`` independent products ``fn(x, w)``, the weights taken in turn."""
    return lambda n: [fn(xs[i], ws[i % len(ws)]) for i in range(n)]


def decode(model_dir: Path, batches: list[int], steps: int, repeats: int) -> list[dict]:
    import mlx.core as mx
    from mlx import nn
    from mlx_lm import load

    from bench.ceiling import decode_tps
    from mlxc.runtime.model import cuda_matmul

    model, _ = load(str(model_dir))
    if mx.default_device() == mx.cpu:  # as bench.ceiling: mlxc computes in float32 there
        model.set_dtype(mx.float32)
    vocab = model.args.vocab_size
    routed = {cuda_matmul.RowsLinear: nn.Linear, cuda_matmul.RowsEmbedding: nn.Embedding}

    def use(kernel: bool) -> None:
        if kernel:
            cuda_matmul.route(model)
            return
        for _, m in model.named_modules():
            m.__class__ = routed.get(type(m), type(m))

    out = []
    for b in batches:
        tps = {"mlx": [], "mlxc": []}
        for r in range(repeats):
            for side, runs in tps.items():
                use(side == "mlxc")
                if r == 0:
                    decode_tps(model, b, 64, 8, vocab)  # kernels compiled, caches grown
                runs.append(decode_tps(model, b, 64, steps, vocab))
        row = {"batch": b, "mlx_runs": tps["mlx"], "mlxc_runs": tps["mlxc"]}
        row["mlx"], row["mlxc"] = max(tps["mlx"]), max(tps["mlxc"])
        out.append(row)
        print(f"[rows_matmul] decode batch {b}: {row}", file=sys.stderr, flush=True)
        mx.clear_cache()
    use(False)
    return out


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(prog="python -m bench.rows_matmul", description=__doc__)
    p.add_argument("--rows", default="1,2,4,8,16,32,64", help="rows per product, comma-separated")
    p.add_argument("--batches", default="1,2,4,8,16,32", help="decode batch sizes")
    p.add_argument("--calls", type=int, default=48, help="independent products per graph")
    p.add_argument("--steps", type=int, default=64, help="decode steps per timed run")
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--out", required=True, help="write OUT.json and OUT.md")
    args = p.parse_args(argv)

    import mlx.core as mx  # a CUDA benchmark: no CPU BLAS to pick first

    from bench import models
    from mlxc.runtime.model import cuda_attention

    if not cuda_attention.available():
        sys.exit("bench.rows_matmul needs MLX's CUDA backend")
    rows = [int(r) for r in args.rows.split(",")]
    batches = [int(b) for b in args.batches.split(",")]
    with tempfile.TemporaryDirectory(prefix="mlxc-rows-") as tmp:
        path = Path(tmp) / "llama"
        models.write_checkpoint(path, "llama", "medium")
        models.write_tokenizer(path, models.config("llama", "medium")["vocab_size"])
        table = products(rows, args.calls, args.repeats)
        steps = decode(path, batches, args.steps, args.repeats)
    device = mx.device_info().get("device_name", "gpu")
    result = {"args": vars(args), "device": device, "mlx": mx.__version__}
    result |= {"products": table, "decode": steps}
    write_results(args.out, result, _markdown(result))
    print(_markdown(result))


def _markdown(r: dict) -> str:
    a = r["args"]
    lines = [
        f"# Products of a few rows: MLX's against mlxc's kernel ({r['device']}, MLX {r['mlx']})",
        "",
        (
            f"`python -m bench.rows_matmul --rows {a['rows']} --batches {a['batches']} --calls "
            f"{a['calls']} --steps {a['steps']} --repeats {a['repeats']}`. bf16. Products: "
            f"{a['calls']} independent ones a graph, microseconds per product (build: the graph "
            "in Python; encode: `mx.async_eval` with the device idle; wall: the build's end to "
            f"the results), median of {a['repeats']}. mlxc takes MLX's own product where its "
            "kernel does not apply (one row, more than `cuda_matmul.MAX_ROWS`)."
        ),
        "",
        "| K x N | rows | MLX build / encode / wall | mlxc build / encode / wall | wall mlxc / MLX |",
        "|---|---:|---|---|---:|",
    ]
    for p in r["products"]:
        m, c = p["mlx"], p["mlxc"]
        cells = [f"{s['build']:.1f} / {s['encode']:.1f} / {s['wall']:.1f}" for s in (m, c)]
        ratio = c["wall"] / m["wall"]
        lines.append(
            f"| {p['K']}x{p['N']} | {p['rows']} | {cells[0]} | {cells[1]} | {ratio:.2f}x |"
        )
    lines += [
        "",
        (
            "Decode (mlx-lm's llama medium, `bench.ceiling`'s loop, 64-token prompts, "
            f"{a['steps']} steps), tokens/s, best of {a['repeats']} alternated runs:"
        ),
        "",
        "| batch | MLX's products | mlxc's kernel routed | mlxc / MLX | runs MLX / mlxc |",
        "|---:|---:|---:|---:|---|",
    ]
    for d in r["decode"]:
        runs = " / ".join(", ".join(f"{x:.0f}" for x in d[k]) for k in ("mlx_runs", "mlxc_runs"))
        lines.append(
            f"| {d['batch']} | {d['mlx']:.0f} | {d['mlxc']:.0f} | {d['mlxc'] / d['mlx']:.2f}x "
            f"| {runs} |"
        )
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    main()
