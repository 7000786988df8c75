"""Quantised products through a dequantised copy (``runtime.model.dequantized``), timed against
MLX's quantised kernels on the same inputs, in one run::

    python -m bench.dequantized --out bench/results/dequantized-cpu-s31
    python -m bench.dequantized --part experts --out bench/results/dequantized-gpu-h100-s31

``--part products``: one linear's product, ``mx.quantized_matmul`` against ``x @
dequantize(w).T`` (``dequantized.product``), per row count, for a few weight shapes (4-bit
affine, group 64; float32 rows on the CPU, bf16 on a GPU): where a rule for dense layers should
start on this device (the CPU's is ``CPU_ROWS``).

``--part experts`` (CUDA): one MoE block's expert products (fused gate|up, the activation,
down: ``Experts.gathered`` with the pairs sorted by expert) three ways: MLX's ``gather_qmm``;
the stacked experts dequantised, then MLX's ``gather_mm`` (what mlxc takes from
``EXPERT_ROWS`` pairs per expert: the whole stack, or groups of experts one after another where
a whole copy would pass ``EXPERT_BYTES``); and ``Experts.by_expert`` (the router's choice read
on the host, one ``quantized_matmul`` per expert's run of rows), per prompt length, for the
bench models' expert shapes and three real ones (random top-k choices).

Median milliseconds of ``--repeats`` evaluated calls, and the extra peak memory of one.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time

from bench.report import write_results

# (name, experts E, hidden, expert width, chosen per token k)
SHAPES = [
    ("qwen3_moe medium", 128, 2048, 256, 8),
    ("deepseek_v3 medium", 64, 2048, 512, 8),
    ("gpt_oss medium", 32, 2880, 960, 4),
    ("Qwen3-30B-A3B", 128, 2048, 768, 8),
    ("Qwen3-235B-A22B", 128, 4096, 1536, 8),
    ("DeepSeek-V3", 256, 7168, 2048, 8),
]
TOKENS = [32, 128, 512, 2048]


def _experts(num: int, hidden: int, width: int):
    import mlx.core as mx
    from mlx import nn

    from mlxc.runtime.model.moe import ExpertLinear, Experts

    experts = Experts(hidden, width, num)
    # As loading leaves it: gate and up fused into one stacked linear.
    experts.gate_up_proj = ExpertLinear(hidden, 2 * width, num)
    del experts["gate_proj"], experts["up_proj"]
    nn.quantize(experts, 64, 4, class_predicate=lambda _, m: hasattr(m, "to_quantized"))
    experts.set_dtype(mx.bfloat16)
    mx.eval(experts.parameters())
    return experts


def _time(fn, repeats: int) -> tuple[float, float]:
    """Median ms of ``repeats`` evaluated calls, and the extra peak MiB of one call."""
    import mlx.core as mx

    mx.eval(fn())
    mx.synchronize()
    base = mx.get_active_memory()
    mx.reset_peak_memory()
    mx.eval(fn())
    peak = (mx.get_peak_memory() - base) / 2**20
    times = []
    for _ in range(repeats):
        t = time.perf_counter()
        mx.eval(fn())
        times.append(time.perf_counter() - t)
    return 1e3 * statistics.median(times), peak


# (name, out, in) of a dense linear's weight, and the row counts timed, per device
DENSE = [("2,048 x 2,048", 2048, 2048), ("gate|up 16,384 x 2,048", 16384, 2048)]
DENSE_ROWS = {"cpu": [1, 2, 3, 4, 8, 16, 64, 256], "gpu": [16, 256, 1024, 2048, 4096]}


def measure_products(repeats: int, rows: list[dict], on_row) -> None:
    """Time each dense weight at each row count, appending to ``rows``, ``on_row()`` after
    each."""
    import mlx.core as mx
    from mlx import nn

    from mlxc.runtime.model import dequantized

    device = "cpu" if mx.default_device() == mx.cpu else "gpu"
    dtype = mx.float32 if device == "cpu" else mx.bfloat16
    for name, out, width in DENSE[: 1 if device == "cpu" else None]:
        layer = nn.QuantizedLinear(width, out, bias=False, group_size=64, bits=4)
        layer.set_dtype(dtype)
        mx.eval(layer.parameters())
        for n in DENSE_ROWS[device]:
            x = mx.random.normal((n, width), key=mx.random.key(n)).astype(dtype)
            mx.eval(x)
            row = {"weight": name, "rows": n}
            ways = {
                "quantized_matmul": lambda layer=layer, x=x: nn.QuantizedLinear.__call__(layer, x),
                "dequantized": lambda layer=layer, x=x: dequantized.product(x, layer),
            }
            outputs = {}
            for way, call in ways.items():
                row[way + "_ms"], row[way + "_peak_mib"] = _time(call, repeats)
                outputs[way] = call().astype(mx.float32)
            want = outputs["quantized_matmul"]
            err = mx.abs(outputs["dequantized"] - want).max() / mx.abs(want).max()
            row["max_rel_diff"] = err.item()
            row["speedup"] = row["quantized_matmul_ms"] / row["dequantized_ms"]
            rows.append(row)
            print(row, flush=True)
            on_row()


def measure_experts(repeats: int, shapes: list[str] | None, rows: list[dict], on_row) -> None:
    """Time one MoE block's expert products three ways for each shape (those whose names
    contain one of ``shapes``; None: all) and prompt length, appending to ``rows``,
    ``on_row()`` after each."""
    import mlx.core as mx

    from mlxc.runtime.model import dequantized

    rule = (dequantized.EXPERT_ROWS, dequantized.EXPERT_BYTES)
    ways = {  # name -> (EXPERT_ROWS, EXPERT_BYTES, the call)
        "gather_qmm": (10**9, 0, lambda e, x, i: e.gathered(x, i, True)),
        "dequantized": (0, rule[1], lambda e, x, i: e.gathered(x, i, True)),
        "by_expert": (10**9, 0, lambda e, x, i: e.by_expert(x, i)),
    }
    for name, num, hidden, width, k in SHAPES:
        if shapes and not any(part in name for part in shapes):
            continue
        experts = _experts(num, hidden, width)
        gate_up = experts.gate_up_proj
        copy_mib = dequantized.copy_bytes(gate_up.weight.shape, gate_up.bits, mx.bfloat16) / 2**20
        for tokens in TOKENS:
            x = mx.random.normal((tokens, hidden), key=mx.random.key(1)).astype(mx.bfloat16)
            scores = mx.random.uniform(shape=(tokens, num), key=mx.random.key(2))
            indices = mx.argpartition(scores, -k, axis=-1)[:, -k:].astype(mx.uint32)
            mx.eval(x, indices)
            dequantized.EXPERT_ROWS, dequantized.EXPERT_BYTES = rule  # mlxc's, for its column
            row = {
                "shape": f"{name} ({num}, {hidden}, {width}, {k})",
                "tokens": tokens,
                "pairs_per_expert": tokens * k / num,
                "copy_mib": copy_mib,
                "mlxc_experts_per_copy": experts.experts_per_copy(tokens * k, mx.bfloat16),
            }
            outputs = {}
            for way, (rows_rule, bytes_rule, call) in ways.items():
                dequantized.EXPERT_ROWS, dequantized.EXPERT_BYTES = rows_rule, bytes_rule

                def products(call=call, experts=experts, x=x, indices=indices):
                    return call(experts, x, indices)

                row[way + "_ms"], row[way + "_peak_mib"] = _time(products, repeats)
                outputs[way] = products().astype(mx.float32)
            want = outputs["gather_qmm"]
            for way in ("dequantized", "by_expert"):
                err = mx.abs(outputs[way] - want).max() / mx.abs(want).max()
                row[way + "_max_rel_diff"] = err.item()
                row[way + "_speedup"] = row["gather_qmm_ms"] / row[way + "_ms"]
            rows.append(row)
            print(row, flush=True)
            on_row()
    dequantized.EXPERT_ROWS, dequantized.EXPERT_BYTES = rule


def markdown(result: dict) -> str:
    lines = [
        "# Quantised products: MLX's kernels against a dequantised copy",
        "",
        (
            f"`{result['command']}` on {result['device']}, MLX {result['mlx']}; median ms of "
            f"{result['repeats']} evaluated calls; speed-up: MLX's time over the copy's."
        ),
    ]
    if result.get("partial"):
        lines += ["", "**Partial**: the run stopped before its last row."]
    if result.get("products"):
        lines += [
            "",
            (
                "**One linear** (4-bit affine, group 64; `dequantized.product` against "
                f"`quantized_matmul`; mlxc's CPU rule: from {result['cpu_rows']} rows)"
            ),
            "",
            (
                "| weight (out x in) | rows | quantized_matmul ms | dequantized ms | speed-up | "
                "extra peak MiB (qmm / deq) | max diff / max |"
            ),
            "|---|---:|---:|---:|---:|---|---:|",
        ]
        for r in result["products"]:
            lines.append(
                f"| {r['weight']} | {r['rows']} | {r['quantized_matmul_ms']:.3f} | "
                f"{r['dequantized_ms']:.3f} | **{r['speedup']:.2f}x** | "
                f"{r['quantized_matmul_peak_mib']:.0f} / {r['dequantized_peak_mib']:.0f} | "
                f"{r['max_rel_diff']:.1e} |"
            )
    if result.get("experts"):
        lines += _experts_table(result)
    return "\n".join(lines) + "\n"


def _experts_table(result: dict) -> list[str]:
    lines = [
        "",
        (
            "**One MoE block's expert products** (gate|up, activation, down), 4-bit affine "
            "group 64, bf16, the pairs sorted by expert: `gather_qmm` (MLX's), `dequantized` "
            "(the stacked experts dequantised, then MLX's `gather_mm`; where gate|up's copy "
            f"passes {result['expert_mib']:.0f} MiB, in groups of experts within it, one after "
            "another, bounded by expert counts read on the host), `by_expert` (the router's "
            "choice read on the host, one `quantized_matmul` per expert's run of rows); "
            "speed-up against gather_qmm. mlxc dequantises from "
            f"{result['expert_rows']} pairs per expert (column `mlxc`: the experts a copy "
            "holds)."
        ),
        "",
        (
            "| experts (E, hidden, width, k) | tokens | pairs / expert | gather_qmm ms | "
            "dequantized ms | speed-up | by_expert ms | speed-up | gate\\|up copy MiB | "
            "extra peak MiB (qmm / deq / by expert) | mlxc |"
        ),
        "|---|---:|---:|---:|---:|---:|---:|---:|---:|---|---|",
    ]
    for r in result["experts"]:
        peaks = " / ".join(
            f"{r[w + '_peak_mib']:.0f}" for w in ("gather_qmm", "dequantized", "by_expert")
        )
        lines.append(
            f"| {r['shape']} | {r['tokens']} | {r['pairs_per_expert']:.0f} | "
            f"{r['gather_qmm_ms']:.3f} | {r['dequantized_ms']:.3f} | "
            f"**{r['dequantized_speedup']:.2f}x** | {r['by_expert_ms']:.3f} | "
            f"**{r['by_expert_speedup']:.2f}x** | {r['copy_mib']:.0f} | {peaks} | "
            f"{_mlxc_way(r)} |"
        )
    diffs = [
        max(r["dequantized_max_rel_diff"], r["by_expert_max_rel_diff"]) for r in result["experts"]
    ]
    lines += [
        "",
        f"Largest difference from gather_qmm's output, over its largest magnitude: {max(diffs):.1e}.",
    ]
    return lines


def _mlxc_way(row: dict) -> str:
    per = row["mlxc_experts_per_copy"]
    return f"dequantized, {per} experts a copy" if per else "gather_qmm"


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(prog="python -m bench.dequantized", description=__doc__)
    p.add_argument("--part", choices=["products", "experts", "both"], default="products")
    p.add_argument("--device", choices=["cpu", "gpu"], default=None, help="default: MLX's")
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument(
        "--shapes", help="comma-separated parts of the expert shapes' names to run (default: all)"
    )
    p.add_argument("--out", help="write OUT.json and OUT.md")
    args = p.parse_args(argv)

    from mlxc.runtime import blas

    blas.preload(args.device)  # before MLX is imported: OpenBLAS on the CPU
    import mlx.core as mx

    from mlxc.runtime.model import cuda_attention, dequantized

    if args.device:
        mx.set_default_device(mx.gpu if args.device == "gpu" else mx.cpu)
    if args.part != "products" and not cuda_attention.available():
        raise SystemExit("--part experts needs MLX's CUDA backend: the rule applies only there")
    gpu = mx.default_device() == mx.gpu
    result = {
        "command": "python -m bench.dequantized "
        + " ".join(sys.argv[1:] if argv is None else argv),
        "device": mx.device_info().get("device_name", "gpu") if gpu else "cpu",
        "blas": None if gpu else blas.status().as_dict(),
        "mlx": mx.__version__,
        "repeats": args.repeats,
        "cpu_rows": dequantized.CPU_ROWS,
        "expert_rows": dequantized.EXPERT_ROWS,
        "expert_mib": dequantized.EXPERT_BYTES / 2**20,
    }

    def save() -> None:
        """Write what is measured so far: a run cut short (a lent GPU's time limit) keeps its
        rows, marked partial until the last."""
        if args.out:
            write_results(args.out, result, markdown(result))

    result["partial"] = True
    if args.part in ("products", "both"):
        measure_products(args.repeats, result.setdefault("products", []), save)
    if args.part in ("experts", "both"):
        shapes = args.shapes.split(",") if args.shapes else None
        measure_experts(args.repeats, shapes, result.setdefault("experts", []), save)
    result["partial"] = False
    save()
    print(markdown(result))


if __name__ == "__main__":
    main()
