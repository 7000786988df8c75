"""Side-by-side benchmark: mlxc against the peer that serves each architecture today (mlx-lm).

One command::

    python -m bench.run --device cpu --size small  --out bench/results/cpu-small
    python -m bench.run --device gpu --size medium --out bench/results/gpu-h200-medium

writes ``OUT.json`` (every number, every repeat, the machine) and ``OUT.md`` (the tables).

It writes deterministic random checkpoints (bench/models.py) for each architecture into a
temporary directory, plus a 4-bit copy made by ``mlxc convert``, and loads the same files into
mlxc (``mlxc.load_model``) and into mlx-lm (``mlx_lm.utils.load_model``; its 4-bit is mlx-lm's
own ``quantize_model`` of the bf16 weights, as ``mlx_lm.convert -q`` does). ``--q4-file mlx-lm``
times both sides on one 4-bit file instead, mlx-lm's conversion (what mlx-community publishes),
so the 4-bit rows compare the same bytes. Each measurement runs both in one process,
interleaved, warmed up, repeated; the median is reported.

On a CPU device the comparison is made twice, in two child processes, because a BLAS can only
be chosen before MLX is imported (runtime/blas.py):

* ``openblas``: mlxc as shipped (OpenBLAS preloaded, bf16 weights computed in float32) against
  mlx-lm with the same BLAS and the same float32 weights: the kernel-level comparison.
* ``reference``: ``MLXC_BLAS=off``; mlx-lm as users run it today (its bundled reference BLAS,
  bf16 weights as loaded), and mlxc without an optimised BLAS. Reference-BLAS and bf16 CPU
  matmuls run at a few GFLOP/s, so this pass uses only the shortest prefill and fewer decode
  tokens.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import subprocess
import sys
import tempfile
import time
from pathlib import Path

DEFAULTS = {
    # size: prefill lengths, decode prompt, decode tokens, repeats
    "small": {"prefill": [256, 1024], "decode_prompt": 128, "decode_tokens": 64, "repeats": 3},
    "medium": {"prefill": [512, 2048], "decode_prompt": 512, "decode_tokens": 128, "repeats": 5},
}
QUANTS = ("bf16", "q4")
GROUP_SIZE, BITS = 64, 4
Q4 = {"group_size": GROUP_SIZE, "bits": BITS}  # quantize_model's arguments for the q4 rows
Q4_FILES = {  # --q4-file: where each side's 4-bit model comes from
    "each": "each side's own converter (mlxc convert; mlx-lm quantize_model)",
    "mlx-lm": "mlx-lm's conversion, loaded by both sides",
}


def _log(msg: str) -> None:
    print(msg, file=sys.stderr, flush=True)


# --- parent: checkpoints, children, report ---------------------------------------------------


def prepare(
    archs: list[str], size: str, quants: list[str], work: Path, q4_file: str = "each"
) -> dict:
    """Write each checkpoint (and its 4-bit conversion); {arch: {quant: dir}}. The "q4" dir is
    mlxc's conversion, or with ``q4_file="mlx-lm"`` mlx-lm's, which both sides then load."""
    from bench import models
    from mlxc.runtime.checkpoint.convert import convert

    dirs: dict[str, dict[str, str]] = {}
    for arch in archs:
        t = time.perf_counter()
        bf16 = work / f"{arch}-{size}-bf16"
        if not (bf16 / "config.json").exists():
            models.write_checkpoint(bf16, arch, size)
        dirs[arch] = {"bf16": str(bf16)}
        if "q4" in quants:
            if q4_file == "mlx-lm":
                q4 = peer_convert(bf16, work / f"{arch}-{size}-q4-mlx-lm")
            else:
                q4 = work / f"{arch}-{size}-q4"
                if not (q4 / "config.json").exists():
                    convert(bf16, q4, quantize=True, bits=BITS, group_size=GROUP_SIZE)
            dirs[arch]["q4"] = str(q4)
        n = models.parameter_count(arch, size)
        _log(f"checkpoint {arch} ({size}, {n / 1e6:.0f}M params): {time.perf_counter() - t:.1f} s")
    return dirs


def machine(device: str) -> dict:
    import mlx.core as mx

    info = {
        "device": device,
        "python": platform.python_version(),
        "platform": platform.platform(),
        "cpus": os.cpu_count(),
        "mlx": mx.__version__,
    }
    try:
        from importlib.metadata import version

        info["mlx_lm"] = version("mlx-lm")
        info["mlxc"] = version("mlxc")
    except Exception as e:  # noqa: BLE001 - metadata is informative only
        info["versions_error"] = repr(e)
    try:
        info["device_info"] = {k: str(v) for k, v in mx.device_info().items()}
    except Exception as e:  # noqa: BLE001 - informative only
        info["device_info_error"] = repr(e)
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                info["cpu"] = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    try:
        import inspect

        from mlxc.runtime.serving.generate import generate_tokens

        default = inspect.signature(generate_tokens).parameters["prefill_chunk_size"].default
        info["mlxc_prefill_chunk"] = default
    except (ImportError, KeyError, ValueError) as e:
        info["mlxc_prefill_chunk_error"] = repr(e)
    if os.environ.get("MLXC_BENCH_COMMIT"):
        info["commit"] = os.environ["MLXC_BENCH_COMMIT"]
        return info
    try:
        info["commit"] = subprocess.run(
            ["git", "rev-parse", "--short", "HEAD"],
            capture_output=True,
            text=True,
            check=False,
            cwd=Path(__file__).parent,
        ).stdout.strip()
    except OSError:
        pass
    if not info.get("commit"):  # a copy without git history (a GPU machine's): say so now
        _log("no commit recorded: run from a git checkout or set MLXC_BENCH_COMMIT")
    return info


def spawn(mode: str, args, dirs: dict, out_json: Path) -> dict:
    if args.resume and out_json.exists():
        _log(f"== {mode} pass: reusing {out_json} (--resume) ==")
        return json.loads(out_json.read_text())
    env = dict(os.environ)
    if mode == "reference":
        env["MLXC_BLAS"] = "off"
    else:
        env.pop("MLXC_BLAS", None)
    cmd = [
        sys.executable,
        "-m",
        "bench.run",
        "--child",
        mode,
        "--device",
        args.device,
        "--size",
        args.size,
        "--dirs",
        json.dumps(dirs),
        "--child-out",
        str(out_json),
        "--repeats",
        str(args.repeats),
        "--budget",
        str(args.budget),
        "--prefill",
        ",".join(map(str, args.prefill)),
        "--decode-prompt",
        str(args.decode_prompt),
        "--decode-tokens",
        str(args.decode_tokens),
        "--kv-bits",
        str(args.kv_bits or 0),
        "--kv-group-size",
        str(args.kv_group_size),
        "--q4-file",
        args.q4_file,
        "--quants",
        args.quants,
    ]
    _log(f"== {mode} pass ==")
    r = subprocess.run(cmd, env=env, check=False, cwd=Path(__file__).resolve().parent.parent)
    if r.returncode != 0:
        raise SystemExit(f"the {mode} pass failed (exit {r.returncode})")
    return json.loads(out_json.read_text())


# --- child: measure --------------------------------------------------------------------------


def kv_side(bits: int) -> str:
    """The name of the side that runs mlxc on ``bits``-bit KV caches."""
    return f"mlxc kv{bits}"


def peer_checkpoint(bf16: Path) -> Path:
    """The checkpoint mlx-lm loads for ``bf16``: the same directory, except for gpt_oss.

    mlx-lm reads gpt-oss experts as the hub's MXFP4 blocks or in its own split layout (what its
    converter writes), not as the bf16 layout of transformers 5 and the hub's bf16 conversions
    (``experts.gate_up_proj`` [E, H, 2I], gate and up interleaved), which mlxc reads. For
    gpt_oss this writes the same weights in mlx-lm's layout once, beside ``bf16``.
    """
    import mlx.core as mx

    config = json.loads((bf16 / "config.json").read_text())
    if config["model_type"] != "gpt_oss":
        return bf16
    out = bf16.with_name(bf16.name + "-mlx-lm-layout")
    if (out / "config.json").exists():
        return out
    tmp = out.with_name(out.name + ".partial")
    tmp.mkdir(parents=True, exist_ok=True)
    weight_map = {}
    for shard in sorted(bf16.glob("*.safetensors")):
        split = {}
        for name, w in mx.load(str(shard)).items():
            experts = name.rpartition(".")[0] + "."  # "model.layers.N.mlp.experts."
            if name.endswith("experts.gate_up_proj"):  # [E, H, 2I] -> two [E, I, H]
                split[experts + "gate_proj.weight"] = w[..., ::2].swapaxes(1, 2)
                split[experts + "up_proj.weight"] = w[..., 1::2].swapaxes(1, 2)
            elif name.endswith("experts.gate_up_proj_bias"):
                split[experts + "gate_proj.bias"] = w[..., ::2]
                split[experts + "up_proj.bias"] = w[..., 1::2]
            elif name.endswith("experts.down_proj"):  # [E, I, H] -> [E, H, I]
                split[experts + "down_proj.weight"] = w.swapaxes(1, 2)
            elif name.endswith("experts.down_proj_bias"):
                split[experts + "down_proj.bias"] = w
            else:
                split[name] = w
        split = {k: mx.contiguous(v) for k, v in split.items()}
        mx.save_safetensors(str(tmp / shard.name), split, metadata={"format": "mlx"})
        weight_map.update(dict.fromkeys(split, shard.name))
    index = {"metadata": {}, "weight_map": weight_map}
    (tmp / "model.safetensors.index.json").write_text(json.dumps(index) + "\n")
    (tmp / "config.json").write_text(json.dumps(config, indent=2) + "\n")
    tmp.rename(out)
    return out


def load_peer(bf16: Path, quant: str):
    """mlx-lm's model of the bf16 checkpoint ``bf16`` (in its layout: ``peer_checkpoint``);
    for "q4" quantised by its own ``quantize_model`` (as ``mlx_lm.convert -q`` does), not
    loaded from mlxc's conversion."""
    return _peer_model(bf16, Q4 if quant == "q4" else None)[0]


def _peer_model(bf16: Path, quantize: dict | None):
    """(model, config) of mlx-lm for ``bf16``, quantised by ``quantize_model(**quantize)``."""
    from mlx_lm.utils import load_model as peer_load

    peer, config = peer_load(peer_checkpoint(bf16))
    if quantize is not None:
        import contextlib
        import io

        from mlx_lm.utils import quantize_model

        with contextlib.redirect_stdout(io.StringIO()):
            peer, config = quantize_model(peer, config, **quantize)
    return peer, config


def peer_convert(bf16: Path, out: Path, **quantize) -> Path:
    """mlx-lm's quantised conversion of ``bf16`` written to ``out`` (once), as ``mlx_lm.convert
    -q`` writes it: its layout, its recipe (8-bit MoE routers), its config. ``quantize``:
    ``quantize_model``'s arguments; by default 4-bit, group 64."""
    if (out / "config.json").exists():
        return out
    from mlx_lm.utils import save_config, save_model

    peer, config = _peer_model(bf16, quantize or Q4)
    tmp = out.with_name(out.name + ".partial")
    save_model(tmp, peer)
    save_config(config, tmp / "config.json")
    tmp.rename(out)
    return out


def _load_sides(
    mode: str, device: str, arch_dirs: dict, quant: str, kv_quant=None, q4_file: str = "each"
) -> list:
    """The sides to compare in this pass, for one architecture and quantisation."""
    import mlx.core as mx

    import mlxc
    from bench.harness import Side

    ours = mlxc.load_model(arch_dirs[quant])
    ours_dtype = _dtype_of(ours)
    sides = [Side("mlxc", "ours", ours, ours_dtype)]
    if kv_quant is not None:  # the same model on quantised KV caches (--kv-bits)
        sides.append(Side(kv_side(kv_quant.bits), "ours", ours, ours_dtype, kv_quant=kv_quant))

    if q4_file == "mlx-lm" and quant == "q4":  # the file mlxc has just loaded
        from mlx_lm.utils import load_model as peer_load

        peer = peer_load(Path(arch_dirs["q4"]))[0]
    else:
        peer = load_peer(Path(arch_dirs["bf16"]), quant)
    mx.eval(peer.parameters())
    if mode == "openblas":
        # Same BLAS and the same float32 compute as mlxc: the kernel-level comparison.
        peer.set_dtype(mx.float32)
        mx.eval(peer.parameters())
        sides.append(Side("mlx-lm f32", "peer", peer, _dtype_of(peer)))
    else:
        sides.append(Side("mlx-lm", "peer", peer, _dtype_of(peer)))
    return sides


def _dtype_of(model) -> str:
    from mlx.utils import tree_flatten

    dtypes = {str(v.dtype).replace("mlx.core.", "") for _, v in tree_flatten(model.parameters())}
    quant = "q4/" if "uint32" in dtypes else ""
    floats = sorted(d for d in dtypes if d.startswith(("float", "bfloat")))
    return quant + "+".join(floats)


def plan(args, quant: str) -> tuple[list[int], int, int, int]:
    """(prefill lengths, decode prompt, decode tokens, repeats) of one pass and quantisation.

    On the CPU, MLX's quantised matmul runs at ~1/30 of float32 OpenBLAS (mlx-lm's 4-bit
    prefill: ~10 tokens/s here; mlxc's products of several rows go through a float copy,
    ``runtime.model.dequantized``), so 4-bit is measured at the shortest prefill only and
    decodes after a short prompt; and the reference pass (reference BLAS, bf16 at a few GFLOP/s)
    uses the shortest prefill, half the decode tokens and one repeat.
    """
    prefill, decode_prompt, tokens, repeats = (
        list(args.prefill),
        args.decode_prompt,
        args.decode_tokens,
        args.repeats,
    )
    if args.device == "cpu":
        if quant == "q4":
            prefill, decode_prompt, tokens = prefill[:1], 32, min(tokens, 32)
        if args.child == "reference":
            prefill, tokens, repeats = prefill[:1], max(tokens // 2, 16), 1
    return prefill, decode_prompt, tokens, repeats


def child(args) -> None:
    # A BLAS must be chosen before the first `import mlx.core` (runtime/blas.py).
    from mlxc.runtime import blas

    st = blas.preload(args.device)
    import mlx.core as mx

    from bench.harness import Cell, measure, prompt, run_once

    if args.device == "gpu":
        mx.set_default_device(mx.gpu)
    else:
        mx.set_default_device(mx.cpu)
    dirs = json.loads(args.dirs)
    gpu = args.device == "gpu"
    kv_quant = None
    if args.kv_bits:
        from mlxc.runtime.model.cache import KVQuant

        kv_quant = KVQuant(args.kv_bits, args.kv_group_size)
    results = {"mode": args.child, "blas": st.as_dict(), "cells": []}
    _log(f"[{args.child}] {st.reason}")
    for arch, arch_dirs in dirs.items():
        vocab = json.loads((Path(arch_dirs["bf16"]) / "config.json").read_text())["vocab_size"]
        for quant in [q for q in QUANTS if q in args.quants.split(",")]:
            _log(f"  {arch} {quant}")
            sides = _load_sides(args.child, args.device, arch_dirs, quant, kv_quant, args.q4_file)
            failed = {}
            for s in list(sides):  # a short run first on every side (allocations, kernel set-up)
                try:
                    run_once(s, prompt(16, vocab, 9), 3)
                except (RuntimeError, ValueError) as e:  # e.g. an op the device lacks
                    _log(f"    {s.name} cannot run {arch} {quant} here: {e}")
                    failed[s.name] = {"error": str(e), "dtype": s.dtype}
                    sides.remove(s)
            prefill, decode_prompt, decode_tokens, repeats = plan(args, quant)
            cells = [Cell(f"prefill {n}", prompt(n, vocab, n), 1) for n in prefill]
            cells.append(
                Cell(f"decode@{decode_prompt}", prompt(decode_prompt, vocab, 1), decode_tokens + 1)
            )
            for cell in cells:
                res = measure(
                    sides,
                    cell,
                    repeats=repeats,
                    budget_s=args.budget,
                    warmup=gpu,  # the GPU compiles kernels per shape; the CPU has nothing to warm
                    log=_log,
                )
                results["cells"].append(
                    {
                        "arch": arch,
                        "quant": quant,
                        "cell": cell.label,
                        "kind": "decode" if cell.max_tokens > 1 else "prefill",
                        "prompt_tokens": len(cell.ids),
                        "new_tokens": cell.max_tokens,
                        "sides": {
                            **{
                                name: dict(r, dtype=next(s.dtype for s in sides if s.name == name))
                                for name, r in res.items()
                            },
                            **failed,
                        },
                    }
                )
            del sides
            mx.clear_cache()
    Path(args.child_out).write_text(json.dumps(results, indent=1))


# --- main ------------------------------------------------------------------------------------


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(prog="python -m bench.run", description=__doc__.split("\n")[0])
    p.add_argument("--device", choices=["cpu", "gpu"], default="cpu")
    p.add_argument("--size", choices=["small", "medium"], default=None)
    p.add_argument("--out", default=None, help="results path without suffix (.json/.md added)")
    p.add_argument(
        "--archs",
        default="llama,qwen3,nemotron_nas,mistral4,gemma3_text,qwen3_moe,deepseek_v3,glm4_moe_lite,"
        "nemotron_h,qwen2,deepseek_v2,minicpm3,gpt_oss,jamba,granitemoehybrid",
    )
    p.add_argument("--quants", default="bf16,q4")
    p.add_argument("--repeats", type=int, default=None)
    p.add_argument("--budget", type=float, default=60.0, help="seconds per cell before stopping")
    p.add_argument("--prefill", default=None, help="comma-separated prompt lengths")
    p.add_argument("--decode-prompt", type=int, default=None)
    p.add_argument("--decode-tokens", type=int, default=None)
    p.add_argument(
        "--kv-bits",
        type=int,
        choices=[0, 4, 8],
        default=0,
        help="also run mlxc on KV caches quantised to this many bits (a side 'mlxc kvN'); 0: not",
    )
    p.add_argument("--kv-group-size", type=int, choices=[32, 64, 128], default=64)
    p.add_argument(
        "--q4-file",
        choices=list(Q4_FILES),
        default="each",
        help="4-bit rows: each side's own conversion, or mlx-lm's conversion on both sides",
    )
    p.add_argument("--work-dir", default=None, help="keep checkpoints here (default: temp)")
    p.add_argument("--modes", default=None, help="CPU passes: openblas,reference")
    p.add_argument(
        "--resume", action="store_true", help="reuse finished passes found in --work-dir"
    )
    # internal: one measuring pass in a child process
    p.add_argument("--child", default=None, help=argparse.SUPPRESS)
    p.add_argument("--dirs", default=None, help=argparse.SUPPRESS)
    p.add_argument("--child-out", default=None, help=argparse.SUPPRESS)
    args = p.parse_args(argv)

    size = args.size or ("medium" if args.device == "gpu" else "small")
    args.size = size
    d = DEFAULTS[size]
    args.prefill = [int(x) for x in (args.prefill or ",".join(map(str, d["prefill"]))).split(",")]
    args.decode_prompt = args.decode_prompt or d["decode_prompt"]
    args.decode_tokens = args.decode_tokens or d["decode_tokens"]
    args.repeats = args.repeats or d["repeats"]

    if args.child:
        child(args)
        return

    # The parent writes checkpoints; imports of MLX here do not affect the children.
    from mlxc.runtime import blas

    blas.preload(args.device)
    from bench import models, report

    out = Path(args.out or f"bench/results/{args.device}-{size}")
    out.parent.mkdir(parents=True, exist_ok=True)
    archs = args.archs.split(",")
    quants = [q for q in args.quants.split(",") if q]
    modes = ["gpu"] if args.device == "gpu" else (args.modes or "openblas,reference").split(",")
    if args.device == "cpu" and "openblas" in modes and not blas._candidates():
        _log(f"no optimised BLAS installed: skipping the openblas pass ({blas.INSTALL_HINT})")
        modes = [m for m in modes if m != "openblas"]

    t0 = time.perf_counter()
    with tempfile.TemporaryDirectory(prefix="mlxc-bench-") as tmp:
        work = Path(args.work_dir or tmp)
        work.mkdir(parents=True, exist_ok=True)
        dirs = prepare(archs, size, quants, work, args.q4_file)
        passes = {}
        for mode in modes:
            passes[mode] = spawn(mode, args, dirs, work / f"pass-{mode}.json")
    result = {
        "command": "python -m bench.run " + " ".join(argv if argv is not None else sys.argv[1:]),
        "machine": machine(args.device),
        "size": size,
        "settings": {
            "prefill": args.prefill,
            "decode_prompt": args.decode_prompt,
            "decode_tokens": args.decode_tokens,
            "repeats": args.repeats,
            "budget_s": args.budget,
            "quantization": {
                "bits": BITS,
                "group_size": GROUP_SIZE,
                "q4_file": Q4_FILES[args.q4_file],
            },
            "kv_quantization": (
                {"bits": args.kv_bits, "group_size": args.kv_group_size} if args.kv_bits else None
            ),
        },
        "params": {a: models.parameter_count(a, size) for a in archs},
        "passes": passes,
        "wall_s": round(time.perf_counter() - t0, 1),
    }
    report.write_results(out, result, report.markdown(result))
    _log(f"wrote {out}.json and {out}.md ({result['wall_s']} s)")
    print(report.markdown(result))


if __name__ == "__main__":
    main()
