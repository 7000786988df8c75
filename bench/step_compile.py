"""What compiling a step's pieces saves the host: a decode step and a verification with the
layers' step functions replayed through ``mx.compile`` (``layers.step_compiled``: attention's
``project``) against the same model running them as written (``layers.STEP_TOKENS`` 0),
alternated in one process::

    python -m bench.step_compile --device gpu --size medium --arch llama --arch qwen3 \\
        --out bench/results/step-compile-gpu-h200
    python -m bench.step_compile --device cpu --gpu-paths --arch llama --out /tmp/step-compile

A GPU step of a few tokens is bound by the host (``docs/performance.md``), so per
architecture and way this reports, at 1 and ``--queries`` tokens on a prompt's cache (rewound
after each forward), the median of the forward's graph building (Python), MLX's encoding of it
(``mx.async_eval`` with the device idle) and the wait for the device after that; and the
tokens/s of greedy decoding through ``generate_tokens`` (its pipelined loop), the figure users
see. The MoE block's own compiled step (``moe.COMPILED_TOKENS``) is the same both ways. On a
GPU a forward of several tokens goes to the device in pieces (``layers.early_dispatch``), so
a verification's build includes the encoding of all but its last piece.

``--gpu-paths`` (CPU only): ``mx.default_device`` answers a GPU, so the model takes the GPU's
paths (the compiled ones among them) while MLX's ops still run on the CPU. Only the build
column means anything there: the CPU's encoding computes the step.
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

WAYS = ("as_written", "compiled")


def measure(model, prompt: list[int], queries: int, repeats: int, decode_tokens: int) -> dict:
    """``{way: {"forward_<n>q": {build_s, encode_s, device_s}, "decode_tps": x}}`` for ``model``,
    each timing alternated between the two ways, which goes first taking turns
    (``harness.in_turn``), so that a shared machine's slow spells fall on both."""
    import mlx.core as mx

    from bench.harness import in_turn
    from bench.verify_probe import _forward_parts
    from mlxc.runtime.model import layers
    from mlxc.runtime.model.cache import cache_arrays, make_caches
    from mlxc.runtime.serving.generate import generate_tokens

    default = layers.STEP_TOKENS
    settings = {"as_written": 0, "compiled": default}
    cache = make_caches(model)
    mx.eval(model(mx.array([prompt]), cache=cache))
    mx.eval(cache_arrays(cache))
    parts: dict = {way: {} for way in WAYS}
    tps: dict = {way: [] for way in WAYS}

    def forward(n: int) -> dict[str, float]:
        """One forward of ``n`` tokens, rewound: its build, encoding and device wait."""
        got = _forward_parts(model, mx.array([prompt[-n:]]), cache, n, repeats=1)
        return {k.removeprefix("forward_"): t for k, t in got.items()}

    def decode() -> float:
        times = [
            time.perf_counter() for _ in generate_tokens(model, prompt, max_tokens=decode_tokens)
        ]
        return (len(times) - 1) / (times[-1] - times[0])

    try:
        for n in sorted({1, queries}):
            for way in WAYS:  # warm-up: each way's traces made
                layers.STEP_TOKENS = settings[way]
                forward(n), forward(n)
            samples: dict = {way: [] for way in WAYS}
            for r in range(repeats * 10):
                for way in in_turn(WAYS, r):
                    layers.STEP_TOKENS = settings[way]
                    samples[way].append(forward(n))
            for way, got in samples.items():
                parts[way][f"forward_{n}q"] = {
                    key: statistics.median(t[key] for t in got) for key in got[0]
                }
        if decode_tokens:
            for way in WAYS:
                layers.STEP_TOKENS = settings[way]
                decode()
            for r in range(repeats):
                for way in in_turn(WAYS, r):
                    layers.STEP_TOKENS = settings[way]
                    tps[way].append(decode())
    finally:
        layers.STEP_TOKENS = default
    for way in WAYS:
        if tps[way]:
            parts[way]["decode_tps"] = statistics.median(tps[way])
    return parts


@contextlib.contextmanager
def _gpu_paths(on: bool):
    """``mx.default_device`` answering a GPU (``graph_nodes.gpu_paths``), and forwards of
    several tokens built whole (``verify_probe._in_one_piece``: on the CPU a piece sent early
    would compute inside the build)."""
    from bench.graph_nodes import gpu_paths
    from bench.verify_probe import _in_one_piece

    if not on:
        yield
        return
    with gpu_paths(), _in_one_piece():
        yield


def report(result: dict) -> str:
    lines = [
        f"# Compiled step functions against as written ({result['device']})",
        "",
        f"MLX {result['mlx']}; {result['size']} `bench.models` checkpoints ({result['quant']}); "
        f"prompt of {result['prompt_len']} tokens; medians, the two ways alternated. "
        + (
            "The GPU's paths taken on the CPU: only the build column is a GPU's figure. "
            if result["gpu_paths"]
            else ""
        )
        + "Ratio: compiled / as written.",
        "",
        "| model | work | as written (us) | compiled (us) | ratio |",
        "|---|---|---:|---:|---:|",
    ]
    for arch, ways in result["archs"].items():
        a, c = ways["as_written"], ways["compiled"]
        for key in a:
            if key == "decode_tps":
                continue
            for part in ("build_s", "encode_s", "device_s"):
                x, y = a[key][part], c[key][part]
                name = f"{key.removeprefix('forward_')} {part[:-2]}"
                lines.append(
                    f"| {arch} | {name} | {x * 1e6:,.0f} | {y * 1e6:,.0f} | {y / x:.2f}x |"
                )
        if "decode_tps" in a:
            x, y = a["decode_tps"], c["decode_tps"]
            lines.append(f"| {arch} | decode tokens/s | {x:.1f} | {y:.1f} | {y / x:.2f}x |")
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m bench.step_compile", description=__doc__)
    p.add_argument("--arch", action="append", help="bench.models architecture (repeatable)")
    p.add_argument("--size", default="small", choices=["small", "medium"])
    p.add_argument("--device", choices=["cpu", "gpu"], default="cpu")
    p.add_argument("--gpu-paths", action="store_true", help="CPU: take the GPU's paths")
    p.add_argument("--quant", choices=["bf16", "q4"], default="bf16", help="q4: mlx-lm's 4-bit")
    p.add_argument("--queries", type=int, default=5, help="tokens of the verification")
    p.add_argument("--prompt-len", type=int, default=512)
    p.add_argument("--decode-tokens", type=int, default=64, help="0: no decode timing")
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--out", required=True, help="write OUT.json and OUT.md")
    args = p.parse_args(argv)
    if args.gpu_paths and args.device != "cpu":
        p.error("--gpu-paths imitates a GPU on the CPU")

    from mlxc import load_model  # noqa: I001  (mlxc first: it may load a BLAS before MLX)

    import mlx.core as mx

    from bench import models
    from bench.run import Q4, peer_convert

    mx.set_default_device(mx.gpu if args.device == "gpu" else mx.cpu)
    prompt = [3 + (17 * i) % 997 for i in range(args.prompt_len)]
    result = {
        "device": "cpu, the GPU's paths" if args.gpu_paths else str(mx.default_device()),
        "gpu_paths": args.gpu_paths,
        "mlx": mx.__version__,
        "size": args.size,
        "quant": args.quant,
        "prompt_len": args.prompt_len,
        "archs": {},
    }
    for arch in args.arch or ["llama"]:
        with tempfile.TemporaryDirectory(prefix="mlxc-step-compile-") as tmp:
            path = models.write_checkpoint(Path(tmp) / "m", arch, args.size)
            if args.quant == "q4":
                path = peer_convert(path, Path(tmp) / "q4", **Q4)
            model = load_model(str(path))  # as the CPU loads it: float32, its layouts
            mx.eval(model.parameters())
        with _gpu_paths(args.gpu_paths):
            result["archs"][arch] = measure(
                model, prompt, args.queries, args.repeats, args.decode_tokens
            )
        print(json.dumps({arch: result["archs"][arch]}), file=sys.stderr, flush=True)
        del model
    write_results(args.out, result, report(result))
    print(report(result))
    return 0


if __name__ == "__main__":
    sys.exit(main())
