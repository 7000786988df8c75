"""Where a 4-bit-KV decode step (``--kv-bits 4``) spends its extra time against the float cache's:
one model, its decode timed with parts of the quantised step swapped out::

    python -m bench.kv_step_parts --device gpu --size medium --out bench/results/kv-step-parts-gpu-h200

Variants (llama from ``bench.models``, greedy, a 512-token prompt then 128 tokens, interleaved,
median of ``--repeats``):

* ``float``: the float cache, as ``mlxc generate`` runs it (MLX's own one-query attention);
* ``float, mlxc kernel on buffers`` (CUDA only): the float cache's whole buffers read by mlxc's
  kernel (``runtime.model.cuda_attention``, replayed compiled; ``cache.BufferKV``,
  ``cuda_attention.BUFFER_DECODE`` on), as every 4-bit step reads its cache;
* ``float, mlxc kernel on slices`` (CUDA only): mlxc's kernel on the live slices, called
  directly (no ``BufferKV``), as every 4-bit and verification step did before s43;
* ``float, fresh tickets`` (CUDA only): as ``float``, each chunked call's tickets zeroed by a
  kernel of their own (an ``mx.zeros``, as before s27), not sliced from zeros shared by many
  calls (``cuda_attention.Tickets``): what that extra kernel a call costs;
* ``kv4``: the 4-bit cache (on CUDA its newest tokens staged in float and quantised 32 at a
  time, ``cache.StagingMixin``);
* ``kv4, packed slices`` (CUDA only): the 4-bit cache handing slices of its packed tokens
  (the kernel called directly, as before s43), not its whole buffers (replayed compiled);
* ``kv4, fresh tickets`` (CUDA only): the same, for the 4-bit cache;
* ``kv4, one chunk`` (CUDA only): the 4-bit cache with the kernel's keys in one chunk a block
  (no partial sums to merge): whether, at batch one, the work a chunked call adds costs more
  than the parallel chunks save on the device;
* ``kv4, unstaged`` (CUDA only): the 4-bit cache quantising each token on arrival, as it does
  off CUDA (and did everywhere before staging): what staging saves;
* ``kv4, no quantise``: the 4-bit cache, with each new token's packed parts taken from
  zero arrays of the right shapes instead of ``mx.quantize`` (unstaged on CUDA): the
  quantisation's cost alone (the writes and the packed attention stay; the tokens are then
  garbage, the timing is not);
* ``kv4, dequantised`` (CUDA only): the 4-bit cache (unstaged), its live keys and values
  dequantised each step for MLX's one-query kernel instead of read packed by mlxc's (what
  ``layers.attend`` does for a prefill chunk): whether, at batch one, expanding the cache costs
  less than the kernel.

Each variant's tokens/s comes from ``generate_tokens``'s own loop; the same steps are also run in
a plain loop that splits a step into building its graph (host, Python) and evaluating it
(``mx.eval``: MLX's encoding and the device), medians per step.

``--device cpu --gpu-paths`` builds every step as CUDA builds it (``bench.graph_nodes.gpu_paths``:
mlxc's CUDA-only choices taken, its attention kernel one stand-in node a call, so the CUDA
variants run): what a change to the step's Python saves the host can be read on a CPU. Only
the build column and the profiles are a GPU's figures there; the tokens are the stand-ins'.
"""

from __future__ import annotations

import argparse
import contextlib
import cProfile
import functools
import io
import pstats
import statistics
import sys
import tempfile
import time
from pathlib import Path

from bench.report import write_results


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(prog="python -m bench.kv_step_parts", description=__doc__)
    p.add_argument("--device", choices=["cpu", "gpu"], default="gpu")
    p.add_argument("--size", choices=["small", "medium"], default="medium")
    p.add_argument("--prompt", type=int, default=512)
    p.add_argument("--tokens", type=int, default=128)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--out", default=None, help="write OUT.json and OUT.md")
    p.add_argument(
        "--profile",
        type=int,
        default=0,
        metavar="N",
        help="also profile each variant's graph building (cProfile) and report its N costliest "
        "functions by own and by cumulative time (OUT-profile.txt, or printed)",
    )
    p.add_argument(
        "--gpu-paths",
        action="store_true",
        help="on the CPU, build each step as CUDA does (`bench.graph_nodes.gpu_paths`: mlxc's "
        "CUDA-only choices, its attention kernel a stand-in node): only the build column is a "
        "GPU's figure, the tokens the stand-ins' garbage",
    )
    args = p.parse_args(argv)
    if args.gpu_paths and args.device != "cpu":
        p.error("--gpu-paths is for --device cpu")

    from mlxc.runtime import blas

    blas.preload(args.device)  # before MLX is imported
    import mlx.core as mx

    import mlxc
    from bench import models
    from bench.harness import prompt
    from mlxc.runtime.model import cache as kv
    from mlxc.runtime.model import cuda_attention
    from mlxc.runtime.serving.generate import generate_tokens

    mx.set_default_device(mx.gpu if args.device == "gpu" else mx.cpu)
    with tempfile.TemporaryDirectory(prefix="mlxc-kvparts-") as tmp:
        path = Path(tmp) / "llama"
        models.write_checkpoint(path, "llama", args.size)
        model = mlxc.load_model(path)
    ids = prompt(args.prompt, model.args.vocab_size, 1)
    quant = kv.KVQuant(4, 64)
    paths = contextlib.ExitStack()
    if args.gpu_paths:
        from bench.graph_nodes import gpu_paths

        paths.enter_context(gpu_paths())  # left in the `finally` below
    real_quantize, real_applies, real_staging, real_buffers, real_chunks, real_tickets = (
        kv.KVQuant.quantize,
        cuda_attention.applies,
        kv.staging,
        kv.reads_buffers,
        cuda_attention._chunks,
        cuda_attention.TICKETS,
    )

    class FreshTickets:
        """Each chunked call's tickets zeroed by a kernel of their own."""

        def take(self, n):
            return mx.zeros((n,), mx.uint32)

    @functools.cache
    def zero_parts(shape, dtype, bits, group):
        *lead, dim = shape
        packed = mx.zeros((*lead, dim * bits // 32), mx.uint32)
        scales = mx.zeros((*lead, dim // group), dtype)
        return packed, scales, mx.zeros_like(scales)

    def no_quantize(self, x):
        return kv.QuantizedKV(zero_parts(tuple(x.shape), x.dtype, self.bits, self.group_size), self)

    real_window = kv.StagingMixin._packed_window
    real_buffer_decode = cuda_attention.BUFFER_DECODE

    def sliced_window(self, n_new):  # the packed live tokens as slices: direct kernel calls
        end = self._packed_end
        return self.keys[:, :, :end], self.values[:, :, :end], end

    def through_kernel(queries, values_dim, mask, quantized, buffers=False):
        return real_applies(queries, values_dim, mask, True)

    def float_only(queries, values_dim, mask, quantized, buffers=False):
        return not quantized and real_applies(queries, values_dim, mask, quantized)

    variants = {"float": (None, {}), "kv4": (quant, {}), "kv4, no quantise": (quant, {"q": 1})}
    if cuda_attention.available():
        variants = {
            "float": variants["float"],
            "float, mlxc kernel on buffers": (None, {"b": 1}),
            "float, mlxc kernel on slices": (None, {"k": 1, "s": 1}),
            "float, fresh tickets": (None, {"z": 1}),
            "kv4": variants["kv4"],
            "kv4, packed slices": (quant, {"p": 1}),
            "kv4, fresh tickets": (quant, {"z": 1}),
            "kv4, one chunk": (quant, {"c": 1}),
            "kv4, unstaged": (quant, {"u": 1}),
            "kv4, no quantise": (quant, {"q": 1, "u": 1}),
            "kv4, dequantised": (quant, {"d": 1, "u": 1}),
        }

    def patched(options):
        cuda_attention.BUFFER_DECODE = True if "b" in options else real_buffer_decode
        kv.KVQuant.quantize = no_quantize if "q" in options else real_quantize
        kv.staging = (lambda keys, values: False) if "u" in options else real_staging
        kv.reads_buffers = (lambda keys, values: False) if "s" in options else real_buffers
        kv.StagingMixin._packed_window = sliced_window if "p" in options else real_window
        cuda_attention.applies = (
            through_kernel if "k" in options else float_only if "d" in options else real_applies
        )
        cuda_attention._chunks = (
            (lambda blocks, key_rounds, target=512: 1) if "c" in options else real_chunks
        )
        cuda_attention.TICKETS = FreshTickets() if "z" in options else real_tickets
        cuda_attention._launch.cache_clear()  # launches planned under the other _chunks

    def own_loop(kv_quant) -> float:
        times = []
        for _ in generate_tokens(model, ids, max_tokens=args.tokens + 1, kv_quant=kv_quant):
            times.append(time.perf_counter())
        return args.tokens / (times[-1] - times[0])

    def split_loop(kv_quant, profiler=None) -> tuple[float, float]:
        cache = kv.make_caches(model, kv_quant)
        y = mx.argmax(model(mx.array([ids]), cache=cache)[:, -1, :], axis=-1)
        mx.eval(y)
        builds, evals = [], []
        for _ in range(args.tokens):
            t0 = time.perf_counter()
            if profiler is not None:
                profiler.enable()
            y = mx.argmax(model(y[:, None], cache=cache)[:, -1, :], axis=-1)
            if profiler is not None:
                profiler.disable()
            t1 = time.perf_counter()
            mx.eval(y)
            builds.append(t1 - t0)
            evals.append(time.perf_counter() - t1)
        skip = min(8, args.tokens // 2)  # the first steps after a prefill settle
        return 1e3 * statistics.median(builds[skip:]), 1e3 * statistics.median(evals[skip:])

    try:
        cuda_attention.warm(model, (1,), quant)
        for kv_quant, options in variants.values():  # warm: kernels compiled, buffers grown
            patched(options)
            own_loop(kv_quant)
        tps = {name: [] for name in variants}
        for _ in range(args.repeats):
            for name, (kv_quant, options) in variants.items():
                patched(options)
                tps[name].append(own_loop(kv_quant))
        split = {}
        for name, (kv_quant, options) in variants.items():
            patched(options)
            split[name] = split_loop(kv_quant)
        profiles = {}
        for name, (kv_quant, options) in variants.items() if args.profile else ():
            patched(options)
            profiler = cProfile.Profile()
            split_loop(kv_quant, profiler)
            report = io.StringIO()
            stats = pstats.Stats(profiler, stream=report).strip_dirs()  # no machine's paths
            for key in ("tottime", "cumulative"):
                stats.sort_stats(key).print_stats(args.profile)
            profiles[name] = report.getvalue()
    finally:
        patched({})
        paths.close()

    base = statistics.median(tps["float"])
    rows = {
        name: {
            "tokens_per_s": statistics.median(xs),
            "all": [round(x, 1) for x in xs],
            "vs_float": statistics.median(xs) / base,
            "build_ms": split[name][0],
            "eval_ms": split[name][1],
        }
        for name, xs in tps.items()
    }
    device = mx.device_info().get("device_name", args.device) if args.device == "gpu" else "cpu"
    command = " ".join(argv or sys.argv[1:])
    setting = (
        f"`python -m bench.kv_step_parts {command}`: llama {args.size}, {device}, MLX "
        f"{mx.__version__}; {args.prompt}-token prompt, {args.tokens} greedy tokens, median of "
        f"{args.repeats}. Build: the step's graph built in Python; eval: `mx.eval` of it (MLX's "
        "encoding and the device); medians per step of a plain loop."
        + (
            " Built as CUDA builds it, on the CPU (`--gpu-paths`): only the build column is a "
            "GPU's figure."
            if args.gpu_paths
            else ""
        )
    )
    lines = [
        "# 4-bit KV decode, part by part",
        "",
        setting,
        "",
        "| variant | tokens/s | vs float | build ms | eval ms | runs |",
        "|---|---:|---:|---:|---:|---|",
    ]
    for name, r in rows.items():
        lines.append(
            f"| {name} | {r['tokens_per_s']:.1f} | {r['vs_float']:.2f}x | {r['build_ms']:.2f} "
            f"| {r['eval_ms']:.2f} | {r['all']} |"
        )
    text = "\n".join(lines) + "\n"
    print(text)
    if args.out:
        write_results(args.out, {"args": vars(args), "device": device, "variants": rows}, text)
    if profiles:
        report = "".join(
            f"## {name}: building {args.tokens} steps' graphs under cProfile\n{text}\n"
            for name, text in profiles.items()
        )
        if args.out:
            Path(f"{args.out}-profile.txt").write_text(report)
        else:
            print(report)


if __name__ == "__main__":
    main()
