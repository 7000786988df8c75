"""Primitives per decode token: the lazy graph of one batch-1 decode step, mlxc against mlx-lm.

On the H200 single-stream decode is bound by kernel launches (~3.6 us each, ~1,100-1,400 per
token), not by weight reads, so the number of kernels a step launches is what to cut. This
counts them without a GPU: for each ``bench.models`` architecture both sides load the *same*
checkpoint, prefill a short prompt, evaluate it, then build (not evaluate) one decode step's
forward for one token; ``mx.export_to_dot`` writes that lazy graph and every primitive node in
it (a ``shape=rectangle`` node, labelled with the primitive's name) is counted once, by name.
The forward's logits are the output: sampling is left out (the same on both sides). On a CPU
mlx-lm's model is cast to float32 (``set_dtype``), as mlxc computes a bf16 checkpoint in float32
there; otherwise each side would count the casts of its own dtype choice.

On a CPU the fast kernels (``mx.fast.rms_norm``, ``rope``, ``scaled_dot_product_attention``)
are built from their fallback ops (``Square``, ``Sum``, ``Rsqrt``, ``Cos``, ``Softmax``, ...),
where a GPU graph holds one ``RMSNorm``, ``RoPE`` or ``ScaledDotProductAttention`` node: CPU
counts are higher than a GPU's by those, equally on both sides, and a change's difference
(a matmul fused away, a cast dropped) is the same on either device.

Each primitive is classed as a **kernel** (launches work on the device) or a **view** (shares
its input's buffer, launches nothing). The classes come from MLX 0.32's GPU backend,
``mlx/backend/gpu/primitives.cpp``: ``AsStrided``, ``Broadcast``, ``BroadcastAxes``,
``Depends``, ``ExpandDims``, ``NumberOfElements``, ``Split``, ``Squeeze``, ``StopGradient``
and ``Transpose`` only call the shared-buffer ``eval`` there; ``Slice`` is a strided view
(``slice_gpu``: ``shared_buffer_slice``); ``Reshape``, ``Flatten`` and ``Unflatten`` share
the buffer unless ``prepare_reshape`` finds strides that force a copy, and ``Contiguous`` and
``View`` unless their input is not row contiguous: those five are counted as views, so a
reshape that does copy at run time is undercounted here. Everything else (``AsType``,
``Copy``, ``Concatenate``, ``SliceUpdate``, matmuls, the fast kernels, element-wise ops, and
``Compiled``: one fused kernel of an ``mx.compile``'d function) is a kernel.

    python -m bench.graph_nodes --out bench/results/graph-nodes-cpu
    python -m bench.graph_nodes --arch llama --arch qwen3 --out /tmp/nodes

An architecture mlx-lm cannot build is reported as skipped with mlx-lm's error.
"""

from __future__ import annotations

import argparse
import collections
import json
import os
import re
import sys
import tempfile
from pathlib import Path

# Primitives that launch nothing (see the module docstring for where each comes from).
VIEWS = frozenset(
    {
        "AsStrided",
        "Broadcast",
        "BroadcastAxes",
        "Contiguous",
        "Depends",
        "ExpandDims",
        "Flatten",
        "NumberOfElements",
        "Reshape",
        "Slice",
        "Split",
        "Squeeze",
        "StopGradient",
        "Transpose",
        "Unflatten",
        "View",
    }
)
PROMPT_TOKENS = 16
_NODE = re.compile(r'\[label ="([^"]*)", shape=rectangle\]')


def count(*outputs) -> collections.Counter:
    """Primitive name -> nodes in the lazy graph of ``outputs`` (nothing is evaluated)."""
    import mlx.core as mx

    fd, path = tempfile.mkstemp(suffix=".dot")
    os.close(fd)
    try:
        mx.export_to_dot(path, *outputs)
        text = Path(path).read_text()
    finally:
        os.remove(path)
    # A label may carry the primitive's settings after its name (e.g. "Compiled..."): the name
    # is its first word.
    return collections.Counter(re.split(r"[^A-Za-z0-9_]", m)[0] for m in _NODE.findall(text))


def summary(counts: collections.Counter) -> dict:
    kernels = {k: v for k, v in counts.items() if k not in VIEWS}
    return {
        "total": sum(counts.values()),
        "kernels": sum(kernels.values()),
        "views": sum(v for k, v in counts.items() if k in VIEWS),
        "by_primitive": dict(sorted(counts.items(), key=lambda kv: (-kv[1], kv[0]))),
    }


def mlxc_step(path: str) -> collections.Counter:
    import mlx.core as mx

    from mlxc import load_model
    from mlxc.runtime.model.cache import cache_arrays

    model = load_model(path)
    cache = model.make_cache()
    ids = mx.array([list(range(10, 10 + PROMPT_TOKENS))])
    y = mx.argmax(model(ids, cache=cache, last_only=True)[:, -1, :], axis=-1)
    mx.eval(y, cache_arrays(cache))
    # What generate_tokens' step builds: the last position's logits of one new token.
    return count(model(y[:, None], cache=cache, last_only=True)[:, -1, :])


def mlx_lm_step(path: str) -> collections.Counter:
    import mlx.core as mx
    from mlx_lm.models.cache import make_prompt_cache
    from mlx_lm.utils import load_model as peer_load

    model, _ = peer_load(Path(path))
    if mx.default_device() == mx.cpu:
        model.set_dtype(mx.float32)  # as mlxc computes a bf16 checkpoint on a CPU
    cache = make_prompt_cache(model)
    ids = mx.array([list(range(10, 10 + PROMPT_TOKENS))])
    y = mx.argmax(model(ids, cache=cache)[:, -1, :], axis=-1)
    mx.eval(y, [c.state for c in cache])
    # What mlx_lm.generate's step builds before sampling.
    return count(model(y[:, None], cache=cache)[:, -1, :])


def measure(arch: str, size: str, log=print) -> dict:
    from bench import models

    cfg = models.config(arch, size)
    row: dict = {"layers": cfg.get("num_hidden_layers")}
    with tempfile.TemporaryDirectory(prefix="mlxc-nodes-") as tmp:
        path = str(models.write_checkpoint(Path(tmp) / "m", arch, size))
        row["mlxc"] = summary(mlxc_step(path))
        try:
            row["mlx-lm"] = summary(mlx_lm_step(path))
        except Exception as e:  # noqa: BLE001 - an architecture or config mlx-lm does not build
            row["mlx-lm"] = None
            row["skipped"] = f"mlx-lm: {type(e).__name__}: {e}"[:300]
    peer = row["mlx-lm"]
    log(
        f"{arch:14s} mlxc {row['mlxc']['kernels']:5d} kernels ({row['mlxc']['total']} nodes)"
        + (f"   mlx-lm {peer['kernels']:5d} ({peer['total']})" if peer else "   mlx-lm skipped")
    )
    return row


def markdown(result: dict) -> str:
    title = (
        f"### Graph nodes per decode token: {result['size']} ({result['device']}, "
        f"mlx {result['mlx']}, mlx-lm {result['mlx_lm']})"
    )
    about = (
        f"One batch-1 decode step after a {PROMPT_TOKENS}-token prompt, the forward's logits "
        "(`python -m bench.graph_nodes`). Kernels: primitives that launch device work; views: "
        "reshapes, transposes, slices, broadcasts (no launch). On a CPU the fast kernels "
        "(rms_norm, rope, attention) count as their fallback ops."
    )
    header = (
        "| arch | layers | mlxc kernels | mlx-lm kernels | mlxc / mlx-lm | mlxc kernels / layer "
        "| mlxc views | mlx-lm views |"
    )
    lines = [
        title,
        "",
        about,
        "",
        header,
        "| --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: |",
    ]
    for arch, row in result["archs"].items():
        ours, peer = row["mlxc"], row["mlx-lm"]
        per_layer = f"{ours['kernels'] / row['layers']:.1f}" if row["layers"] else "-"
        if peer:
            ratio = f"{ours['kernels'] / peer['kernels']:.2f}"
            cells = [str(peer["kernels"]), ratio, per_layer, str(ours["views"]), str(peer["views"])]
        else:
            cells = ["skipped", "-", per_layer, str(ours["views"]), "-"]
        lines.append(
            f"| {arch} | {row['layers']} | {ours['kernels']} | " + " | ".join(cells) + " |"
        )
    skipped = {a: r["skipped"] for a, r in result["archs"].items() if r.get("skipped")}
    if skipped:
        lines += ["", *(f"- {a}: {why}" for a, why in skipped.items())]
    lines += ["", "Kernels by primitive (mlxc / mlx-lm), where they differ:", ""]
    for arch, row in result["archs"].items():
        ours = row["mlxc"]["by_primitive"]
        peer = (row["mlx-lm"] or {}).get("by_primitive", {})
        diff = [
            f"{k} {ours.get(k, 0)}/{peer.get(k, 0)}"
            for k in sorted(set(ours) | set(peer))
            if k not in VIEWS and ours.get(k, 0) != peer.get(k, 0)
        ]
        lines.append(f"- {arch}: {', '.join(diff) if diff else 'the same'}")
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    # mlxc first: on a Linux CPU it loads an optimised BLAS before MLX is imported.
    import mlxc  # noqa: F401, I001

    from bench import models

    p = argparse.ArgumentParser(prog="python -m bench.graph_nodes", description=__doc__)
    p.add_argument("--arch", action="append", choices=models.ARCHS, help="default: all")
    p.add_argument("--size", default="small", choices=models.SIZES)
    p.add_argument("--device", choices=["cpu", "gpu"], default="cpu")
    p.add_argument("--out", required=True, help="write OUT.json and OUT.md")
    args = p.parse_args(argv)

    import mlx.core as mx
    import mlx_lm

    mx.set_default_device(mx.gpu if args.device == "gpu" else mx.cpu)
    result = {
        "size": args.size,
        "device": mx.device_info().get("device_name", args.device),
        "mlx": mx.__version__,
        "mlx_lm": mlx_lm.__version__,
        "prompt_tokens": PROMPT_TOKENS,
        "archs": {},
    }
    for arch in args.arch or models.ARCHS:
        result["archs"][arch] = measure(arch, args.size, log=lambda s: print(s, file=sys.stderr))
        # Written after every arch: a long run keeps what it finished.
        Path(f"{args.out}.json").write_text(json.dumps(result, indent=1) + "\n")
        Path(f"{args.out}.md").write_text(markdown(result))
    print(markdown(result))
    return 0


if __name__ == "__main__":
    sys.exit(main())
