"""Attention's two products on packed keys and values (``--kv-bits``): mlxc's
``layers.quantized_product`` against MLX's ``mx.quantized_matmul`` on the same inputs, in one run.

On the CPU ``quantized_product`` reads the codes as float planes through BLAS and applies each
token's scales and biases to the products; elsewhere it is ``quantized_matmul`` itself. Cases:
``scores`` (``q k^T``, ``transpose``) and ``values`` (``p v``) for the small llama's heads (4 KV
heads, 4 query heads each) at 512 cached tokens (``--tokens``), a decode step of 1 and 16
rows and a verification of 8 queries (32 query rows a KV head), over bits, group sizes and
head dims.
The keys are a slice of a longer buffer, as a cache hands them over. Median microseconds of
``--steps`` evaluations of 8 calls in a chain (a forward's layers) each.

    python -m bench.quantized_product --out bench/results/kv4-cpu-product
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import time

from bench.report import write_results

KV_HEADS, CALLS = 4, 8
CASES = [  # (batch, query rows per KV head)
    (1, 4),
    (16, 4),
    (1, 32),
]
QUANTS = [(4, 64, 64), (8, 64, 64), (4, 32, 64), (4, 64, 128), (4, 32, 128), (8, 128, 128)]


def _time(fn, a, steps: int) -> float:
    """Median microseconds per call of ``fn(a)`` over ``steps`` evaluations of CALLS calls,
    each call's input waiting on the one before (as a forward's layers do: independent calls
    would let MLX run every call's first op, then every second, holding all their arrays)."""
    import mlx.core as mx

    def chain():
        x = a
        for _ in range(CALLS):
            x = a + 0 * fn(x).sum()
        return x

    for _ in range(3):
        mx.eval(chain())
    times = []
    for _ in range(steps):
        t = time.perf_counter()
        mx.eval(chain())
        times.append(time.perf_counter() - t)
    return 1e6 * statistics.median(times) / CALLS


def measure(
    batch: int, rows: int, bits: int, group: int, dims: int, tokens: int, steps: int
) -> list[dict]:
    import mlx.core as mx

    from mlxc.runtime.model.cache import KVQuant
    from mlxc.runtime.model.layers import quantized_product

    quant = KVQuant(bits, group)
    shape = (batch, KV_HEADS, tokens + 64, dims)
    keys, values = (quant.quantize(mx.random.normal(shape))[..., :tokens, :] for _ in range(2))
    queries = mx.random.normal((batch, KV_HEADS, rows, dims))
    weights = mx.softmax(mx.random.normal((batch, KV_HEADS, rows, tokens)), axis=-1)
    mx.eval(keys.parts, values.parts, queries, weights)
    out = []
    for case, a, b, transpose in [
        ("scores", queries, keys, True),
        ("values", weights, values, False),
    ]:

        def peer(a, b=b, transpose=transpose):
            return mx.quantized_matmul(
                a, *b.parts, transpose=transpose, group_size=group, bits=bits
            )

        def ours(a, b=b, transpose=transpose):
            return quantized_product(a, b, transpose)

        want, got = peer(a), ours(a)
        error = float(mx.abs(got - want).max() / mx.abs(want).max())
        mlx_us, mlxc_us = _time(peer, a, steps), _time(ours, a, steps)
        out.append(
            {
                "case": case,
                "batch": batch,
                "rows": rows,
                "bits": bits,
                "group": group,
                "dims": dims,
                "mlx_us": mlx_us,
                "mlxc_us": mlxc_us,
                "mlx_over_mlxc": mlx_us / mlxc_us,
                "max_rel_error": error,
            }
        )
    return out


def main() -> None:
    ap = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("--device", choices=["cpu", "gpu"], default="cpu")
    ap.add_argument("--steps", type=int, default=30)
    ap.add_argument("--tokens", type=int, default=512, help="cached tokens (default 512)")
    ap.add_argument("--out", required=True)
    args = ap.parse_args()
    from mlxc.runtime import blas

    blas.preload(args.device)  # before MLX is imported: the CPU planes go through BLAS
    import mlx.core as mx

    mx.set_default_device(mx.cpu if args.device == "cpu" else mx.gpu)
    rows = []
    for batch, n in CASES:
        for bits, group, dims in QUANTS:
            for r in measure(batch, n, bits, group, dims, args.tokens, args.steps):
                print(json.dumps(r), flush=True)
                rows.append(r)
    meta = {
        "device": str(mx.default_device()),
        "mlx": mx.__version__,
        "blas": blas.status().name,
        "host": platform.node(),
    }
    lines = [
        (
            "# Products on packed keys and values: mlxc's `quantized_product` against MLX's"
            " `quantized_matmul`, microseconds per call"
        ),
        "",
        (
            f"MLX {meta['mlx']}, {meta['device']}, {meta['blas']}; {KV_HEADS} KV heads, {args.tokens} cached tokens"
            " (a slice of a longer buffer); rows: query rows per KV head (4: a decode step of 4"
            " query heads a KV head; 32: a verification of 8 queries); median per call of"
            f" evaluations of {CALLS} calls in a chain (a forward's layers). `python -m bench.quantized_product --tokens N --out ...`"
        ),
        "",
        "| case | batch | rows | bits | group | head dim | MLX | mlxc | MLX / mlxc | max rel. error |",
        "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for r in rows:
        lines.append(
            f"| {r['case']} | {r['batch']} | {r['rows']} | {r['bits']} | {r['group']} |"
            f" {r['dims']} | {r['mlx_us']:.0f} | {r['mlxc_us']:.0f} | {r['mlx_over_mlxc']:.2f}x |"
            f" {r['max_rel_error']:.1e} |"
        )
    write_results(args.out, {"meta": meta, "rows": rows}, "\n".join(lines) + "\n")


if __name__ == "__main__":
    main()
