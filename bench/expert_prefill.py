"""A quantised MoE's expert products in a prefill: ``gather_qmm`` against dequantise + ``gather_mm``.

MLX 0.32's CUDA ``gather_qmm`` has no grouped kernel for rows sorted by expert, so a 4-bit MoE
prefilled at a fraction of its bf16 speed; ``QuantizedExpertLinear.dequantizes`` (from
``EXPERT_ROWS`` pairs per expert) dequantises the stacked experts for the product and takes
MLX's grouped GEMM instead. This times one block's expert products (fused gate|up, the
activation, down: ``Experts.gathered`` with the pairs sorted by expert) both ways on the same
inputs, per prompt length, for the bench models' expert shapes and Qwen3-30B-A3B's (4-bit
affine, group 64, bf16 activations, random top-k choices): where the rule should start, and
the extra peak memory of the copy. Median milliseconds of ``--repeats`` evaluated calls.

    python -m bench.expert_prefill --out bench/results/expert-prefill-gpu-h100-s31
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time

# (name, experts E, hidden, expert width, chosen per token k)
SHAPES = [
    ("qwen3_moe medium", 128, 2048, 256, 8),
    ("deepseek_v3 medium", 64, 2048, 512, 8),
    ("gpt_oss medium", 32, 2880, 960, 4),
    ("Qwen3-30B-A3B", 128, 2048, 768, 8),
    ("Qwen3-235B-A22B", 128, 4096, 1536, 8),
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


def measure(repeats: int) -> list[dict]:
    import mlx.core as mx

    from mlxc.runtime.model import dequantized

    rows, rule = [], (dequantized.EXPERT_ROWS, dequantized.EXPERT_BYTES)
    ways = {  # name -> (EXPERT_ROWS, EXPERT_BYTES, the call)
        "gather_qmm": (10**9, 0, lambda e, x, i: e.gathered(x, i, True)),
        "dequantized": (0, 1 << 62, lambda e, x, i: e.gathered(x, i, True)),
        "by_expert": (10**9, 0, lambda e, x, i: e.by_expert(x, i)),
    }
    for name, num, hidden, width, k in SHAPES:
        experts = _experts(num, hidden, width)
        copy = experts.gate_up_proj.weight.shape
        copy_mib = copy[0] * copy[1] * copy[2] * 32 // 4 * 2 / 2**20
        for tokens in TOKENS:
            x = mx.random.normal((tokens, hidden), key=mx.random.key(1)).astype(mx.bfloat16)
            scores = mx.random.uniform(shape=(tokens, num), key=mx.random.key(2))
            indices = mx.argpartition(scores, -k, axis=-1)[:, -k:].astype(mx.uint32)
            mx.eval(x, indices)
            dequantized.EXPERT_ROWS, dequantized.EXPERT_BYTES = (
                rule  # mlxc's own rule, for its column
            )
            row = {
                "shape": f"{name} ({num}, {hidden}, {width}, {k})",
                "tokens": tokens,
                "pairs_per_expert": tokens * k / num,
                "copy_mib": copy_mib,
                "mlxc_dequantizes": experts.gate_up_proj.dequantizes(tokens * k, mx.bfloat16),
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
    dequantized.EXPERT_ROWS, dequantized.EXPERT_BYTES = rule
    return rows


def markdown(result: dict) -> str:
    lines = [
        "# A quantised MoE's expert products in a prefill: gather_qmm, dequantised, by expert",
        "",
        (
            f"`{result['command']}` on {result['device']}, MLX {result['mlx']}. One block's "
            "expert products (gate|up, activation, down), 4-bit affine group 64, bf16, the "
            "pairs sorted by expert: `gather_qmm` (MLX's), `dequantized` (the stacked experts "
            "dequantised, then MLX's `gather_mm`), `by_expert` (the router's choice read on the "
            "host, one `quantized_matmul` per expert's run of rows). Median ms of "
            f"{result['repeats']} evaluated calls; speed-up against gather_qmm. mlxc dequantises "
            f"from {result['dequant_rows']} pairs per expert where gate|up's copy is at most "
            f"{result['dequant_mib']:.0f} MiB (column `mlxc`)."
        ),
        "",
        (
            "| experts (E, hidden, width, k) | tokens | pairs / expert | gather_qmm ms | "
            "dequantized ms | speed-up | by_expert ms | speed-up | gate\\|up copy MiB | "
            "extra peak MiB (qmm / deq / by expert) | mlxc |"
        ),
        "|---|---:|---:|---:|---:|---:|---:|---:|---:|---|---|",
    ]
    for r in result["rows"]:
        peaks = " / ".join(
            f"{r[w + '_peak_mib']:.0f}" for w in ("gather_qmm", "dequantized", "by_expert")
        )
        lines.append(
            f"| {r['shape']} | {r['tokens']} | {r['pairs_per_expert']:.0f} | "
            f"{r['gather_qmm_ms']:.3f} | {r['dequantized_ms']:.3f} | "
            f"**{r['dequantized_speedup']:.2f}x** | {r['by_expert_ms']:.3f} | "
            f"**{r['by_expert_speedup']:.2f}x** | {r['copy_mib']:.0f} | {peaks} | "
            f"{'dequantized' if r['mlxc_dequantizes'] else 'gather_qmm'} |"
        )
    diffs = [
        max(r["dequantized_max_rel_diff"], r["by_expert_max_rel_diff"]) for r in result["rows"]
    ]
    lines += [
        "",
        f"Largest difference from gather_qmm's output, over its largest magnitude: {max(diffs):.1e}.",
    ]
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(prog="python -m bench.expert_prefill", description=__doc__)
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--out", help="write OUT.json and OUT.md")
    args = p.parse_args(argv)

    import mlx.core as mx

    from mlxc.runtime.model import cuda_attention, dequantized

    if not cuda_attention.available():
        raise SystemExit("needs MLX's CUDA backend: the rule applies only there")
    result = {
        "command": "python -m bench.expert_prefill "
        + " ".join(sys.argv[1:] if argv is None else argv),
        "device": mx.device_info().get("device_name", "gpu"),
        "mlx": mx.__version__,
        "repeats": args.repeats,
        "dequant_rows": dequantized.EXPERT_ROWS,
        "dequant_mib": dequantized.EXPERT_BYTES / 2**20,
        "rows": measure(args.repeats),
    }
    text = markdown(result)
    print(text)
    if args.out:
        with open(args.out + ".json", "w") as f:
            json.dump(result, f, indent=1)
        with open(args.out + ".md", "w") as f:
            f.write(text)


if __name__ == "__main__":
    main()
