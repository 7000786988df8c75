"""Where single-stream decode differs from mlx-lm's: attention against the MLP/MoE, side by side::

    python -m bench.decode_parts --device gpu --size medium --arch glm4_moe_lite --arch llama

(``--phase prefill``: the same parts of one prefill of the prompt instead of the decode steps.)

Both sides load the same ``bench.models`` checkpoint (bf16; on a CPU mlx-lm's model is cast to
float32, mlxc's compute dtype there; ``--quant q4``: 4-bit, as ``bench.run`` makes it, mlxc's
by ``mlxc convert`` and mlx-lm's by its ``quantize_model``), prefill the same prompt, then decode greedily in one and
the same pipelined loop (build a step, ``mx.async_eval`` it, build the next), four ways:

* ``full``: the model as it is;
* ``attention only``: every layer's MLP (dense or MoE) replaced by a function returning zeros;
* ``mlp only``: every layer's attention replaced by the same (the caches then stop growing);
* ``neither``: both replaced: embedding, norms, residual adds and the LM head.

Parts are found by mlx-lm's and mlxc's common names (``self_attn``, ``mlp``): a hybrid's mixers
(nemotron_h) are not split out.

A replaced part costs one zeros kernel on both sides. So ``attention only - neither`` is the
attention stack's time per token and ``mlp only - neither`` the MLP stack's, per side: where a
model's decode ratio against mlx-lm comes from (batch-1 decode on a GPU is bound by kernel
launches, so the parts add up to about the whole). Variants and sides interleave, median of
``--repeats``.

The whole step's host time is split too, per side: building its graph (the model's Python)
and ``mx.async_eval`` in the pipelined loop (MLX encoding and launching its kernels on the same
thread; it also waits there while the device is behind, so in a device-bound loop it takes the
rest of the step), and ``mx.async_eval`` of a step built while the device is idle (after an
``mx.eval``): the encoding alone. Where building and encoding alone add up to the step, the
host is the limit; where they fall short of it, the device is.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import time
from pathlib import Path

from bench.report import write_results

IDLE_STEPS = 8  # steps after the timed ones whose async_eval runs on an idle device

VARIANTS = {  # name -> (attention kept, mlp kept)
    "full": (True, True),
    "attention only": (True, False),
    "mlp only": (False, True),
    "neither": (False, False),
}


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(prog="python -m bench.decode_parts", description=__doc__)
    p.add_argument("--arch", action="append", help="bench.models architecture (repeatable)")
    p.add_argument("--device", choices=["cpu", "gpu"], default="gpu")
    p.add_argument("--size", choices=["small", "medium"], default="medium")
    p.add_argument("--quant", choices=["bf16", "q4"], default="bf16")
    p.add_argument("--prompt", type=int, default=512)
    p.add_argument("--tokens", type=int, default=64)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument(
        "--phase",
        choices=["decode", "prefill"],
        default="decode",
        help="time the decode steps (ms per step) or the prompt's prefill (ms per prefill)",
    )
    p.add_argument("--out", default=None, help="write OUT.json and OUT.md")
    args = p.parse_args(argv)
    archs = args.arch or ["glm4_moe_lite"]

    from mlxc.runtime import blas

    blas.preload(args.device)  # before MLX is imported
    import mlx.core as mx
    from mlx import nn
    from mlx_lm.models.cache import make_prompt_cache

    import mlxc
    from bench.harness import in_turn, prompt
    from bench.run import load_peer, prepare

    mx.set_default_device(mx.gpu if args.device == "gpu" else mx.cpu)

    def zeros(x, *_, **__):
        return mx.zeros_like(x)

    def keep(model, attention: bool, mlp: bool) -> None:
        """Replace (or restore) each layer's parts: an instance attribute shadows the module.
        A layer without the part (a hybrid's mixer, a no-op block) is left as it is."""
        for layer in model.model.layers:
            for name, kept in (("self_attn", attention), ("mlp", mlp)):
                if kept:
                    if vars(layer).get(name) is zeros:
                        del vars(layer)[name]
                elif isinstance(layer.get(name), nn.Module):
                    object.__setattr__(layer, name, zeros)

    def time_ms(model, cache, ids) -> tuple[float, dict[str, float]]:
        """Prefill ``ids``, then ``--tokens`` greedy steps, pipelined: ms per step, and the
        median ms per step spent building the graph and in ``mx.async_eval``, then that of
        IDLE_STEPS more steps each built on an idle device (with ``--phase prefill``: ms for
        the prefill, the steps not taken)."""
        start = time.perf_counter()
        y = mx.argmax(model(mx.array([ids]), cache=cache)[:, -1, :], axis=-1)
        mx.eval(y)
        if args.phase == "prefill":
            return 1e3 * (time.perf_counter() - start), {}
        warm = 4
        build, dispatch = [], []
        for i in range(warm + args.tokens):
            if i == warm:
                mx.eval(y)
                start = time.perf_counter()
            a = time.perf_counter()
            y = mx.argmax(model(y[:, None], cache=cache)[:, -1, :], axis=-1)
            b = time.perf_counter()
            mx.async_eval(y)
            build.append(b - a)
            dispatch.append(time.perf_counter() - b)
        mx.eval(y)
        step_ms = 1e3 * (time.perf_counter() - start) / args.tokens
        idle = []  # async_eval of a step while the device is idle: the encoding alone
        for _ in range(IDLE_STEPS):
            y = mx.argmax(model(y[:, None], cache=cache)[:, -1, :], axis=-1)
            b = time.perf_counter()
            mx.async_eval(y)
            idle.append(time.perf_counter() - b)
            mx.eval(y)
        host = {
            "build": 1e3 * statistics.median(build[warm:]),
            "async_eval": 1e3 * statistics.median(dispatch[warm:]),
            "encode_idle": 1e3 * statistics.median(idle),
        }
        return step_ms, host

    results = {}
    for arch in archs:
        with tempfile.TemporaryDirectory(prefix="mlxc-parts-") as tmp:
            dirs = prepare([arch], args.size, [args.quant], Path(tmp))[arch]
            sides = {"mlxc": mlxc.load_model(dirs[args.quant])}
            peer = load_peer(Path(dirs["bf16"]), args.quant)
            if args.device == "cpu":
                peer.set_dtype(mx.float32)  # the same compute dtype as mlxc on the CPU
            mx.eval(peer.parameters())
            sides["mlx-lm"] = peer
        caches = {"mlxc": lambda m: m.make_cache(), "mlx-lm": make_prompt_cache}
        ids = prompt(args.prompt, sides["mlxc"].args.vocab_size, 1)
        runs = {(v, s): [] for v in VARIANTS for s in sides}
        host_runs = {s: {"build": [], "async_eval": [], "encode_idle": []} for s in sides}
        for repeat in range(args.repeats + 1):  # the first round warms (kernels, buffers)
            print(f"[{arch}] round {repeat}", file=sys.stderr, flush=True)
            for variant, kept in VARIANTS.items():
                for side in in_turn(list(sides), repeat):
                    model = sides[side]
                    keep(model, *kept)
                    try:
                        ms, host = time_ms(model, caches[side](model), ids)
                    finally:
                        keep(model, True, True)
                    if repeat:
                        runs[variant, side].append(ms)
                        if variant == "full":
                            for k, v in host.items():
                                host_runs[side][k].append(v)
        ms = {key: statistics.median(xs) for key, xs in runs.items()}
        parts = {
            side: {
                "attention": ms["attention only", side] - ms["neither", side],
                "mlp": ms["mlp only", side] - ms["neither", side],
                "rest": ms["neither", side],
            }
            for side in sides
        }
        results[arch] = {
            "step_ms": {f"{v} / {s}": round(x, 4) for (v, s), x in ms.items()},
            "host_ms": {
                s: {k: round(statistics.median(xs), 4) for k, xs in h.items() if xs}
                for s, h in host_runs.items()
            },
            "runs_ms": {f"{v} / {s}": [round(x, 3) for x in xs] for (v, s), xs in runs.items()},
            "parts_ms": parts,
        }
        del sides, peer
        mx.clear_cache()

    device = mx.device_info().get("device_name", args.device) if args.device == "gpu" else "cpu"
    text = _markdown(results, args, device, mx.__version__, argv)
    print(text)
    if args.out:
        payload = {"args": vars(args), "device": device, "mlx": mx.__version__, **results}
        write_results(args.out, payload, text)


def _markdown(results: dict, args, device: str, mlx_version: str, argv) -> str:
    command = " ".join(argv if argv is not None else sys.argv[1:])
    if args.phase == "prefill":
        what = f"{args.prompt}-token prompt's prefill (one forward), median of {args.repeats}"
        unit = "ms per prefill"
    else:
        what = (
            f"{args.prompt}-token prompt, {args.tokens} greedy steps pipelined, median of "
            f"{args.repeats}"
        )
        unit = "ms per decode step"
    setting = (
        f"`python -m bench.decode_parts {command}`: {args.size} {args.quant} checkpoints, "
        f"{device}, MLX {mlx_version}; {what}. {unit}; a part's time is its variant's time "
        "less the time with neither part (`bench/decode_parts.py` says how the parts are "
        "taken out)."
    )
    lines = [
        f"# {args.phase.capitalize()}, part by part: mlxc against mlx-lm",
        "",
        setting,
        "",
        "| arch | part | mlxc ms | mlx-lm ms | mlxc / mlx-lm time |",
        "|---|---|---:|---:|---:|",
    ]
    for arch, r in results.items():
        step = r["step_ms"]
        rows = [
            (
                "whole " + ("prefill" if args.phase == "prefill" else "step"),
                step["full / mlxc"],
                step["full / mlx-lm"],
            )
        ]
        rows += [
            (part, r["parts_ms"]["mlxc"][part], r["parts_ms"]["mlx-lm"][part])
            for part in ("attention", "mlp", "rest")
        ]
        host = r.get("host_ms", {})
        rows += [
            (f"whole step, host: {label}", host["mlxc"][key], host["mlx-lm"][key])
            for key, label in (
                ("build", "building its graph"),
                ("async_eval", "mx.async_eval, pipelined"),
                ("encode_idle", "mx.async_eval, device idle"),
            )
            if key in host.get("mlxc", {}) and key in host.get("mlx-lm", {})
        ]
        for part, ours, peer in rows:
            ratio = f"{ours / peer:.2f}" if peer > 0 else "-"
            lines.append(f"| {arch} | {part} | {ours:.3f} | {peer:.3f} | {ratio} |")
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    main()
