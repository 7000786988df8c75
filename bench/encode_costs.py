"""What one operation of each kind costs the host, before the device runs it: building it in a
graph (Python and MLX's C++) and MLX's encoding of it (``mx.async_eval`` with the device idle),
in microseconds an operation, beside the device's own time an operation.

A batch-1 decode step on a GPU is bound by the host (``docs/performance.md``): its time is its
graph's build plus MLX's encoding of every kernel, and two steps of the same kernel count can
differ by the kinds of kernel they launch. Each kind here is a decode step's operation at a
decode step's shapes (one token; a 2,048-wide hidden state; 64 experts, 8 chosen; 512 cached
keys; MLA's latent products with a key count fixed or new on every call, as decode steps go:
MLX's CUDA matmul asks cuBLASLt for a plan on each call, whose heuristics cache is keyed
by the shape), ``--ops`` of them per evaluation, independent of each other::

    python -m bench.encode_costs --device gpu --out bench/results/encode-costs-gpu-h200

Per kind, the median over ``--repeats`` evaluations, each after ``mx.synchronize()``: build (the
Python calls that make the operations), encode (``mx.async_eval`` of them, the device idle at
its start) and wall (from the end of the build until every result is ready, over the ops).
"""

from __future__ import annotations

import argparse
import itertools
import statistics
import sys
import time
from collections.abc import Callable

from bench.report import write_results

H, E, K, I, HEADS, KV_HEADS, D, KEYS = 2048, 64, 8, 512, 32, 8, 64, 512
LATENT = 512  # MLA's kv_lora_rank (deepseek_v3, glm4_moe_lite): a decode step's latent head


def kinds(mx, nn) -> dict[str, Callable[[int], list]]:
    """``{kind: build(n) -> n independent results}``, their inputs made (and evaluated) here."""
    from mlxc.runtime.model import cuda_attention, layers, moe
    from mlxc.runtime.model.cache import BufferKV, KVQuant, StagedKV

    dtype = mx.bfloat16 if mx.default_device() == mx.gpu else mx.float32
    rand = lambda *shape: mx.random.normal(shape).astype(dtype)
    x, w = rand(1, H), rand(H, H)
    wq, scales, biases = mx.quantize(w, 64, 4)
    xe = x.reshape(1, 1, 1, H)
    we = rand(E, I, H)
    weq = mx.quantize(we, 64, 4)
    experts = (mx.arange(K, dtype=mx.uint32) * (E // K))[None]  # K of the E, spread out
    chosen_ids = experts.astype(mx.int32)
    router = mx.random.normal((1, E))
    chosen, weights = rand(1, K, H), router[:, :K]  # the chosen experts' outputs, weights
    q, keys, values = rand(1, HEADS, 1, D), rand(1, KV_HEADS, KEYS, D), rand(1, KV_HEADS, KEYS, D)
    qt = rand(1, 1, HEADS, D).transpose(0, 2, 1, 3)  # a projection's heads, as attention reads them
    buffer = mx.zeros((1, KV_HEADS, 2 * KEYS, D), dtype)
    new = rand(1, KV_HEADS, 1, D)
    norm_w = rand(H)
    glu = layers.glu(nn.silu)  # what a SwiGLU layer calls
    mask = mx.ones((1, 1, 1, KEYS), mx.bool_)
    # MLA decode (latent.absorbed_attention): the heads as the rows of the one latent head, by
    # the live latents, whose count grows by one every step. A "new" kind takes a key count it
    # has never taken before on every call (cuBLASLt plans each new shape); "fixed", one count.
    # (The weights are a slice of wider ones in both kinds: the matmul copies that strided
    # operand first, in both.)
    q_lat, latents = rand(1, 1, HEADS, LATENT), rand(1, 1, KEYS + 16384, LATENT)
    probs = rand(1, 1, HEADS, latents.shape[-2])
    mx.eval(x, w, wq, scales, biases, we, *weq, chosen_ids, router, chosen, weights, q, keys)
    mx.eval(values, qt, buffer, new, norm_w, mask, q_lat, latents, probs)
    counts = itertools.count(KEYS + 1)

    def new_count() -> int:
        return min(next(counts), latents.shape[-2])

    def weights_by_latents(t: int) -> mx.array:
        return probs[..., :t] @ latents[:, :, :t]

    def each(op) -> Callable[[int], list]:
        return lambda n: [op() for _ in range(n)]

    def slice_updates(n: int) -> list:
        # Each into the buffer the one before left, at the next column, as a cache appends
        # (static starts, as the caches write; one zeros kernel more for the n).
        out = mx.zeros_like(buffer)
        for i in range(n):
            column = i % (2 * KEYS)
            out[:, :, column : column + 1] = new
        return [out]

    table = {
        "matmul (1 x 2,048 by 2,048 x 2,048)": each(lambda: x @ w.T),
        "quantized_matmul (4-bit, same shape)": each(
            lambda: mx.quantized_matmul(x, wq, scales, biases, transpose=True, bits=4)
        ),
        "gather_mm (1 token, 8 of 64 experts)": each(
            lambda: mx.gather_mm(xe, we.swapaxes(-1, -2), rhs_indices=experts)
        ),
        "gather_qmm (4-bit, same)": each(
            lambda: mx.gather_qmm(xe, *weq, rhs_indices=experts, transpose=True, bits=4)
        ),
        "add (1 x 2,048)": each(lambda: x + x),
        "astype (1 x 2,048, to float32)": each(lambda: x.astype(mx.float32)),
        "compiled silu(gate) * up (layers.glu, one fused kernel)": each(lambda: glu(x, x)),
        "fast.rms_norm (1 x 2,048)": each(lambda: mx.fast.rms_norm(x, norm_w, 1e-6)),
        "fast.rope (32 heads x 64)": each(
            lambda: mx.fast.rope(q, D, traditional=False, base=10000.0, scale=1.0, offset=KEYS)
        ),
        "fast.scaled_dot_product_attention (1 query, 512 keys)": each(
            lambda: mx.fast.scaled_dot_product_attention(q, keys, values, scale=0.125)
        ),
        "contiguous copy (a transposed 32 x 64)": each(lambda: mx.contiguous(qt)),
        "slice_update (a token into a cache buffer)": slice_updates,
        "quantize (a token's keys, 4-bit, group 64: --kv-bits 4)": each(
            lambda: mx.quantize(new, 64, 4)
        ),
        "argpartition (top 8 of 64)": each(lambda: mx.argpartition(router, -K, axis=-1)),
        "take_along_axis (8 of 64)": each(lambda: mx.take_along_axis(router, chosen_ids, axis=-1)),
        "compiled MoE weighted sum (8 x 2,048)": each(lambda: moe._weighted_sum(chosen, weights)),
        "MLA scores (32 heads as rows by 512 latents of 512), a fixed key count": each(
            lambda: q_lat @ latents[:, :, :KEYS].swapaxes(-1, -2)
        ),
        "MLA scores (same), a new key count every call": each(
            lambda: q_lat @ latents[:, :, : new_count()].swapaxes(-1, -2)
        ),
        "MLA weights by latents (32 x 512 by 512 x 512), a fixed key count": each(
            lambda: weights_by_latents(KEYS)
        ),
        "MLA weights by latents (same), a new key count every call": each(
            lambda: weights_by_latents(new_count())
        ),
    }
    if cuda_attention.available():
        table["mlxc CUDA attention kernel (1 query, 512 keys, a mask)"] = each(
            lambda: cuda_attention.attention(q, keys, values, scale=0.125, mask=mask)
        )
        # 4-bit keys as a quantised cache holds them: all packed, or its newest 16 staged
        quant = KVQuant(4, 64)
        pk, pv = quant.quantize(keys), quant.quantize(values)
        sk = StagedKV(pk[:, :, : KEYS - 16], keys[:, :, KEYS - 16 :])
        sv = StagedKV(pv[:, :, : KEYS - 16], values[:, :, KEYS - 16 :])
        mx.eval(pk.parts, pv.parts)
        table["mlxc CUDA attention kernel (4-bit keys, packed)"] = each(
            lambda: cuda_attention.attention(q, pk, pv, scale=0.125, mask=None)
        )
        table["mlxc CUDA attention kernel (4-bit keys, 16 of them staged)"] = each(
            lambda: cuda_attention.attention(q, sk, sv, scale=0.125, mask=None)
        )
        # The same as a quantised cache hands them since s43: its whole buffers (packed, twice
        # the live keys; staged, a stage of 32) and the live counts, the call replayed compiled
        twice = [mx.concatenate([x, x], axis=2) for x in (keys, values)]
        recent = [mx.concatenate([x[:, :, KEYS - 16 :]] * 2, axis=2) for x in (keys, values)]
        bk, bv = (
            StagedKV(quant.quantize(x), r, KEYS - 16, 16, buffers=True)
            for x, r in zip(twice, recent)
        )
        mx.eval(bk.packed.parts, bv.packed.parts, recent)
        table["mlxc CUDA attention kernel (same, the cache's buffers: replayed)"] = each(
            lambda: cuda_attention.attention(q, bk, bv, scale=0.125, mask=None)
        )
        # A float cache's buffer (BufferKV: what a verification reads since s43), one query
        fk, fv = BufferKV(twice[0], KEYS), BufferKV(twice[1], KEYS)
        table["mlxc CUDA attention kernel (1 query, a float cache's buffers: replayed)"] = each(
            lambda: cuda_attention.attention(q, fk, fv, scale=0.125, mask=None)
        )
        # The same call with the kernel's code inline in the source MLX assembles and hashes
        # per call, as before s25 (cuda_attention.cuh's text as the header, not its #include)
        code = cuda_attention.KERNEL_FILE.read_text()
        inline = mx.fast.cuda_kernel(
            name="mlxc_attention_inline",
            input_names=cuda_attention._INPUTS,
            output_names=cuda_attention._OUTPUTS,
            source=cuda_attention._SOURCE,
            header=code,
            ensure_row_contiguous=False,
        )

        def with_code_inline(n: int) -> list:
            kernel, cuda_attention._kernel = cuda_attention._kernel, lambda: inline
            try:
                return [
                    cuda_attention.attention(q, sk, sv, scale=0.125, mask=None) for _ in range(n)
                ]
            finally:
                cuda_attention._kernel = kernel

        table[f"mlxc CUDA attention kernel (same, its code inline: {len(code) / 1024:.0f} KB)"] = (
            with_code_inline
        )
    return table


def measure(build: Callable[[int], list], ops: int, repeats: int) -> dict[str, float]:
    """Median microseconds an operation: build, encode (``async_eval``, device idle), wall."""
    import mlx.core as mx

    mx.eval(build(ops))  # first use: kernels compile, plans are made
    samples = []
    for _ in range(repeats):
        mx.synchronize()
        t0 = time.perf_counter()
        outs = build(ops)
        t1 = time.perf_counter()
        mx.async_eval(outs)
        t2 = time.perf_counter()
        mx.eval(outs)
        t3 = time.perf_counter()
        samples.append((t1 - t0, t2 - t1, t3 - t1))
    build_s, encode_s, wall_s = (statistics.median(s) for s in zip(*samples))
    return {
        k: 1e6 * v / ops for k, v in (("build", build_s), ("encode", encode_s), ("wall", wall_s))
    }


def markdown(report: dict) -> str:
    meta = report["meta"]
    lines = [
        f"# Host cost of one operation, by kind ({meta['device_name']}, MLX {meta['mlx']})",
        "",
        (
            f"`{meta['command']}`: {meta['ops']} independent operations of each kind per "
            f"evaluation, median of {meta['repeats']}; {meta['dtype']}. Build: the Python calls "
            "that make them; encode: `mx.async_eval` of them with the device idle at its start "
            "(MLX's encoding and launching); wall: from the build's end until all are ready. "
            "Microseconds an operation (the slice updates: a chain into one buffer, as a cache writes)."
        ),
        "",
        "| kind | build us | encode us | wall us |",
        "|---|---:|---:|---:|",
    ]
    for kind, r in report["kinds"].items():
        lines.append(f"| {kind} | {r['build']:.2f} | {r['encode']:.2f} | {r['wall']:.2f} |")
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m bench.encode_costs", description=__doc__)
    p.add_argument("--device", choices=["cpu", "gpu"], default="cpu")
    p.add_argument("--ops", type=int, default=200, help="operations of a kind per evaluation")
    p.add_argument("--repeats", type=int, default=9)
    p.add_argument("--out", required=True, help="write OUT.json and OUT.md")
    args = p.parse_args(argv)
    from mlxc.runtime import blas

    blas.preload(args.device)
    import mlx.core as mx
    from mlx import nn

    from bench import run

    mx.set_default_device(mx.gpu if args.device == "gpu" else mx.cpu)
    results = {}
    for kind, build in kinds(mx, nn).items():
        results[kind] = measure(build, args.ops, args.repeats)
        print(f"{kind}: " + ", ".join(f"{k} {v:.2f} us" for k, v in results[kind].items()))
    machine = run.machine(args.device)
    report = {
        "meta": {
            "command": "python -m bench.encode_costs " + " ".join(argv or sys.argv[1:]),
            "device_name": machine.get("device_info", {}).get("device_name")
            or machine.get("cpu", "CPU"),
            "mlx": mx.__version__,
            "ops": args.ops,
            "repeats": args.repeats,
            "dtype": "bf16" if args.device == "gpu" else "float32",
        },
        "kinds": results,
    }
    text = markdown(report)
    write_results(args.out, report, text)
    print(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
