"""Where a K+1-token verification forward's extra time goes, against a one-token step::

    python -m bench.verify_probe --device gpu --size medium --queries 1,3,5,9 --out bench/results/verify-probe-gpu-h200

Speculative decoding pays off when verifying K drafts costs little more than one decode step
(issue target: <= 1.2x). This times, at the bench llama's shapes (``--arch``: another
``bench.models`` architecture's forward), each kind of work in a forward at 1 and at K+1 query
tokens: the whole forward on a prompt's cache (rewound after each), as the runtime runs it
(``forward``: on a GPU several tokens go to the device in pieces of ``layers.PIECE_LAYERS``
layers, ``layers.early_dispatch``) and in one piece (``forward_whole``, alternated with it;
also split into building its graph, MLX encoding it and the wait for the device), every
projection of one layer and the LM head alone (``count`` independent copies per evaluation, so a
kernel's launch is in its time, as in a forward), and attention over the prompt's keys through
mlxc's ``attend`` (the mask a verification uses: ``"causal"``, or None for one query). A ratio
far above the rest names the kernel to fix.

Each float projection is also timed as one matrix-vector product per row (``_as_rows``, the
``*_as_rows`` rows): whether MLX's matrix-vector kernel, which it gives one row, beats the
cuBLAS GEMM it gives several.

On CUDA, where ``attend`` sends a verification's few queries to mlxc's kernel
(``runtime.model.cuda_attention``), the whole forward and attention are also timed through
``layers.composed_attention`` instead (matmul, softmax, matmul: what a prefill chunk takes there):
``forward_composed`` and ``attention_composed``, whether that costs a verification less; and
the forward's parts with every product through MLX's (``forward_mlx_products_*``: cuBLAS for
several rows) instead of mlxc's kernel (``runtime.model.cuda_matmul``).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path

from bench.report import write_results


def _per_call(fn, count: int, repeats: int) -> float:
    """Median seconds per call of ``fn`` (which builds one lazy result), ``count`` calls per
    evaluation."""
    import mlx.core as mx

    mx.eval([fn() for _ in range(count)])  # warm-up (kernel compiles)
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        mx.eval([fn() for _ in range(count)])
        times.append((time.perf_counter() - start) / count)
    return statistics.median(times)


def _forward_parts(model, ids, cache, n: int, repeats: int) -> dict:
    """Medians of a forward's three parts, one after another: building its graph (Python),
    MLX encoding it with the device idle (``mx.async_eval``), and the wait for the device
    after that. A part far above its one-query value says whether the host or the device pays
    for a verification's extra tokens."""
    import mlx.core as mx

    from mlxc.runtime.model.cache import rewind_caches

    parts: dict[str, list[float]] = {"build": [], "encode": [], "device": []}
    for _ in range(repeats):
        start = time.perf_counter()
        out = model(ids, cache=cache)
        built = time.perf_counter()
        mx.async_eval(out)
        encoded = time.perf_counter()
        mx.eval(out)
        done = time.perf_counter()
        rewind_caches(cache, n)
        for name, t in zip(parts, (built - start, encoded - built, done - encoded)):
            parts[name].append(t)
    return {f"forward_{name}_s": statistics.median(t) for name, t in parts.items()}


def probe(
    model, prompt_len: int, queries: list[int], count: int, repeats: int, parts: bool = True
) -> list[dict]:
    """The table's rows, one per query count; ``parts``: also each projection of the first
    layer, the LM head and attention (by the llama's names: ``self_attn.o_proj``...), and on
    CUDA the forward through composed attention and through MLX's products."""
    import mlx.core as mx
    import numpy as np

    from bench.speculative import timed_pair
    from mlxc.runtime.model.cache import cache_arrays, make_caches, rewind_caches

    rng = np.random.default_rng(0)
    prompt = rng.integers(3, 1000, prompt_len).tolist()
    cache = make_caches(model)
    mx.eval(model(mx.array([prompt]), cache=cache))
    mx.eval(cache_arrays(cache))
    rows = []
    for n in queries:
        row: dict = {"queries": n}
        ids = mx.array([prompt[-n:]])

        def forward(ids=ids, n=n):
            mx.eval(model(ids, cache=cache))
            rewind_caches(cache, n)

        def forward_whole(forward=forward):
            with _in_one_piece():
                forward()

        forward()
        forward_whole()
        row["forward_s"], row["forward_whole_s"], *_ = timed_pair(
            forward, forward_whole, repeats * 5
        )
        with _in_one_piece():  # the parts of the whole forward
            row |= _forward_parts(model, ids, cache, n, repeats * 5)
        if parts:
            row |= _parts(model, ids, cache, n, prompt_len, count, repeats, forward)
        rows.append(row)
        print(json.dumps(row), file=sys.stderr, flush=True)
    return rows


@contextlib.contextmanager
def _in_one_piece():
    """Forwards of several tokens built and sent to the device whole (``layers.PIECE_LAYERS``
    0), as before ``layers.early_dispatch``."""
    from mlxc.runtime.model import layers

    pieces, layers.PIECE_LAYERS = layers.PIECE_LAYERS, 0
    try:
        yield
    finally:
        layers.PIECE_LAYERS = pieces


def _parts(model, ids, cache, n: int, prompt_len: int, count: int, repeats: int, forward) -> dict:
    """``probe``'s timings of the parts at ``n`` queries (``forward``: the whole forward)."""
    import mlx.core as mx
    from mlx import nn

    from bench.speculative import timed
    from mlxc.runtime.model import cuda_attention, cuda_matmul
    from mlxc.runtime.model.layers import attend, composed_attention

    kernel_applies = cuda_attention.applies
    rows_applies = cuda_matmul.applies

    def one_query_only(queries, values_dim, mask, quantized, buffers=False):
        return queries.shape[-2] == 1 and kernel_applies(
            queries, values_dim, mask, quantized, buffers
        )

    composed = cuda_attention.available()  # the kernel serves verifications only on CUDA
    layer = model.model.layers[0]
    attn = layer.self_attn
    dtype = mx.bfloat16 if isinstance(attn.o_proj, nn.QuantizedLinear) else attn.o_proj.weight.dtype
    projections = {
        name: module
        for name, module in layer.named_modules()
        if isinstance(module, (nn.Linear, nn.QuantizedLinear)) and "." in name
    }
    # The LM head: its own projection, or the tied embedding read as one.
    head = getattr(model, "lm_head", None) or model.model.embed_tokens.as_linear
    row: dict = {}
    if composed:
        cuda_attention.applies = one_query_only  # several queries: composed_attention
        try:
            forward()
            row["forward_composed_s"], _ = timed(forward, repeats * 5)
        finally:
            cuda_attention.applies = kernel_applies
        cuda_matmul.applies = lambda x, weight: False  # every product through MLX's
        try:
            forward()
            parts = _forward_parts(model, ids, cache, n, repeats * 5)
            row |= {k.replace("forward", "forward_mlx_products"): t for k, t in parts.items()}
        finally:
            cuda_matmul.applies = rows_applies
    for name, module in projections.items():
        width = (
            module.scales.shape[-1] * module.group_size
            if isinstance(module, nn.QuantizedLinear)
            else module.weight.shape[-1]
        )
        x = mx.random.normal((1, n, width)).astype(dtype)
        row[name + "_s"] = _per_call(lambda m=module, x=x: m(x), count, repeats)
        if isinstance(module, nn.Linear):
            if not mx.allclose(_as_rows(module, x), module(x), rtol=1e-2, atol=1e-2):
                raise RuntimeError(f"{name}: the product row by row differs from the layer's")
            row[name + "_as_rows_s"] = _per_call(
                lambda m=module, x=x: _as_rows(m, x), count, repeats
            )
    x = mx.random.normal((1, n, model.args.hidden_size)).astype(dtype)
    row["lm_head_s"] = _per_call(lambda x=x: head(x), count, repeats)
    q = mx.random.normal((1, attn.n_heads, n, attn.head_dim)).astype(dtype)
    k = mx.random.normal((1, attn.n_kv_heads, prompt_len + n, attn.head_dim)).astype(dtype)
    v = mx.random.normal(k.shape).astype(dtype)
    mask = None if n == 1 else "causal"
    row["attention_s"] = _per_call(
        lambda q=q, k=k, v=v, mask=mask: attend(q, k, v, scale=attn.scale, mask=mask),
        count,
        repeats,
    )
    if composed:
        row["attention_composed_s"] = _per_call(
            lambda q=q, k=k, v=v, mask=mask: composed_attention(
                q, k, v, scale=attn.scale, mask=mask
            ),
            count,
            repeats,
        )
    return row


def _as_rows(linear, x):
    """``linear(x)`` as one matrix-vector product per row: MLX's CUDA matmul folds a contiguous
    batch of one-row products against one weight into a GEMM (``gemm_and_bias``), which
    cuBLAS runs for a verification's few rows at 2.1-3.3x a row's time; rows a stride past
    their width stay a batch, which its matrix-vector kernel takes (each row reading the
    weight, from L2 after the first). Whether that costs a verification less."""
    import mlx.core as mx

    n, width = x.shape[-2], x.shape[-1]
    rows = mx.pad(x.reshape(n, width), ((0, 0), (0, 8)))[:, None, :width]  # [n, 1, width]
    out = rows @ linear.weight.T
    if "bias" in linear:
        out = out + linear.bias
    return out.reshape(*x.shape[:-1], -1)


def report(result: dict) -> str:
    rows = result["rows"]
    base = rows[0]
    keys = [k for k in base if k.endswith("_s")]
    head = "| work | " + " | ".join(f"{r['queries']} q (us)" for r in rows)
    head += " | " + " | ".join(f"{r['queries']} q / 1 q" for r in rows[1:]) + " |"
    lines = [
        f"# Verification forward probe ({result['device']}, {result['checkpoint']})",
        "",
        (
            f"MLX {result['mlx']}; prompt of {result['prompt_len']} tokens; each projection "
            f"and attention timed as {result['count']} copies per evaluation (launches included)."
        ),
        "",
        head,
        "|---" * (1 + 2 * len(rows) - 1) + "|",
    ]
    for key in keys:
        cells = [f"{r[key] * 1e6:,.1f}" for r in rows]
        cells += [f"{r[key] / base[key]:.2f}x" for r in rows[1:]]
        lines.append(f"| {key[:-2]} | " + " | ".join(cells) + " |")
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m bench.verify_probe", description=__doc__)
    p.add_argument("--model", help="checkpoint directory (default: bench.models' llama)")
    p.add_argument("--arch", default="llama", help="bench.models architecture (default llama)")
    p.add_argument("--size", default="small", choices=["small", "medium"])
    p.add_argument("--device", choices=["cpu", "gpu"], default=None)
    p.add_argument("--queries", default="1,3,5,9")
    p.add_argument("--prompt-len", type=int, default=640)
    p.add_argument("--count", type=int, default=32)
    p.add_argument(
        "--forward-only",
        action="store_true",
        help="time the whole forward only (an architecture without the llama's layer names)",
    )
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--out", required=True, help="write OUT.json and OUT.md")
    args = p.parse_args(argv)

    from mlxc import load_model  # noqa: I001  (mlxc first: it may load a BLAS before MLX)

    import mlx.core as mx

    from bench import models

    if args.device:
        mx.set_default_device(mx.gpu if args.device == "gpu" else mx.cpu)
    queries = [int(q) for q in args.queries.split(",")]
    if queries[0] != 1:
        p.error("--queries starts at 1 (the one-token step the others are compared with)")
    with tempfile.TemporaryDirectory(prefix="mlxc-verify-probe-") as tmp:
        path = (
            Path(args.model)
            if args.model
            else models.write_checkpoint(Path(tmp) / "m", args.arch, args.size)
        )
        model = load_model(str(path))
        mx.eval(model.parameters())
    rows = probe(
        model, args.prompt_len, queries, args.count, args.repeats, parts=not args.forward_only
    )
    result = {
        "device": str(mx.default_device()),
        "checkpoint": args.model or f"bench.models {args.arch} {args.size}",
        "mlx": mx.__version__,
        "prompt_len": args.prompt_len,
        "count": args.count,
        "rows": rows,
    }
    write_results(args.out, result, report(result))
    print(report(result))
    return 0


if __name__ == "__main__":
    sys.exit(main())
