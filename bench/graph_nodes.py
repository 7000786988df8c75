"""Primitives per decode token: the lazy graph of one batch-1 decode step, mlxc against mlx-lm.

On the H200 single-stream decode is bound by kernel launches (~3.6 us each, ~1,100-1,400 per
token), not by weight reads, so the number of kernels a step launches is what to cut. This
counts them without a GPU: for each ``bench.models`` architecture both sides load the *same*
checkpoint, prefill a short prompt, evaluate it and one decode step, then build (not evaluate)
the next decode step's forward for one token (since s40: a first step also does what a model
does once and keeps, as MLA's per-head halves of kv_b_proj, split on the first step, two
kernels a layer that later steps never launch); ``mx.export_to_dot`` writes that lazy graph
and every primitive node in it (a ``shape=rectangle`` node, labelled with the primitive's
name) is counted once, by name. The forward's logits are the output: sampling is left out
(the same on both sides). On a CPU
mlx-lm's model is cast to float32 (``set_dtype``), as mlxc computes a bf16 checkpoint in float32
there; otherwise each side would count the casts of its own dtype choice.

On a CPU the fast kernels (``mx.fast.rms_norm``, ``rope``, ``scaled_dot_product_attention``)
are built from their fallback ops (``Square``, ``Sum``, ``Rsqrt``, ``Cos``, ``Softmax``, ...),
where a GPU graph holds one ``RMSNorm``, ``RoPE`` or ``ScaledDotProductAttention`` node. So the
step is built twice: as the CPU runs it (``cpu_graph`` in the JSON), and under
``fast_kernels``, which swaps each ``mx.fast`` call for one stand-in node with the call's
output shape and inputs: those counts (``kernels``, ``views``, ``by_primitive``) are the ones
the tables report, the kernels a GPU launches, give or take a fast kernel that launches two
(MLX's two-pass attention for long keys). mlxc also takes paths of its own on a CPU (attention
in blocks of queries, a compiled polynomial exp, float copies of quantised weights), chosen by
asking ``mx.default_device()``: for the kernel counts its model is loaded again and run under
``gpu_paths``, which answers "a GPU" with MLX's CUDA backend, so they are of the graph mlxc
builds for one, its own CUDA kernels (``cuda_attention``'s) one stand-in node a call.

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

A view is not free for the host, though: MLX evaluates and encodes every node. A MoE step that
traded 3-5 kernels a layer for 10 views (slices) decoded slower on an H100
(``docs/performance.md``, s36), so read the kernel count with the total beside it.

    python -m bench.graph_nodes --out bench/results/graph-nodes-cpu
    python -m bench.graph_nodes --arch llama --arch qwen3 --out /tmp/nodes
    python -m bench.graph_nodes --bits 4 --out bench/results/graph-nodes-cpu-q4
    python -m bench.graph_nodes --compare BEFORE.json AFTER.json --out bench/results/compare

An architecture mlx-lm cannot build is reported as skipped with mlx-lm's error.
"""

from __future__ import annotations

import argparse
import collections
import contextlib
import json
import os
import re
import sys
import tempfile
from pathlib import Path

from bench.report import write_results
from bench.run import peer_checkpoint, peer_convert

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


# --- the fast kernels, one node each --------------------------------------------------------

# Primitives no model step uses, standing in for one fast kernel each while a step's graph is
# built under ``fast_kernels`` (renamed in the counts). Each is a scan, which mx.compile does
# not fuse with its neighbours, so a fast call inside a compiled function (attention's
# ``project``) stays one node there too.
# The stand-ins ``gpu_paths`` itself puts in mlxc's graph (CUDA kernels of mlxc's own, one node
# each): a graph built under it may hold them.
GPU_PATHS_STAND_INS = frozenset({"ErfInv", "Sort"})

STAND_INS = {
    "CumMax": "fast.rope",
    "CumMin": "fast.rms_norm",
    "CumProd": "fast.layer_norm",
    "CumLogAddExp": "fast.scaled_dot_product_attention",
    "ErfInv": "cuda_attention.latent_attention",
    "Sort": "cuda_attention.attention",
}


def _stand_in(op, like, *deps):
    """One ``op`` node (a scan along the last axis) shaped as ``like`` whose result depends on
    every array in ``deps``."""
    import mlx.core as mx

    deps = [d for d in deps if isinstance(d, mx.array)]
    out = op(like, axis=-1)
    return mx.depends([out], deps)[0] if deps else out


@contextlib.contextmanager
def fast_kernels():
    """Build graphs as a GPU runs them: each ``mx.fast`` call one node (a GPU launches one
    kernel for it), where a CPU graph holds the ops of its fallback. For counting only: the
    values are not the model's."""
    import mlx.core as mx

    fast = mx.fast
    saved = {n: getattr(fast, n) for n in ("rope", "rms_norm", "layer_norm")}
    saved["scaled_dot_product_attention"] = fast.scaled_dot_product_attention

    def rope(x, dims, *, offset=0, freqs=None, **_):
        return _stand_in(mx.cummax, x, offset, freqs)

    def rms_norm(x, weight, eps, **_):
        return _stand_in(mx.cummin, x, weight)

    def layer_norm(x, weight, bias, eps, **_):
        return _stand_in(mx.cumprod, x, weight, bias)

    def sdpa(q, k, v, *, scale, mask=None, sinks=None, **_):
        like = mx.broadcast_to(q[..., :1], (*q.shape[:-1], v.shape[-1]))
        return _stand_in(mx.logcumsumexp, like, k, v, mask, sinks)

    fast.rope, fast.rms_norm, fast.layer_norm = rope, rms_norm, layer_norm
    fast.scaled_dot_product_attention = sdpa
    try:
        yield
    finally:
        for name, fn in saved.items():
            setattr(fast, name, fn)


def step_counts(make_step, placed: frozenset = frozenset()) -> dict:
    """Counts of one decode step: ``make_step()`` loads the model afresh, forwards its prompt
    and returns ``step`` (a function building one decode step's graph). Counted on the CPU
    graph, then, with each fast kernel one node, on another fresh model: its compiled
    functions trace their graphs on their first call, so they must first be called under the
    stand-ins. ``placed``: stand-in primitives the step's own build put there (``gpu_paths``);
    any other in the CPU graph is the model's, and would be miscounted."""
    cpu = count(make_step()())
    if any(name in cpu for name in STAND_INS if name not in placed):
        raise RuntimeError(f"a model step uses a stand-in primitive: {sorted(cpu)}")
    with fast_kernels():
        fast = count(make_step()())
    fast = collections.Counter({STAND_INS.get(k, k): v for k, v in fast.items()})
    return {"cpu_graph": summary(cpu), **summary(fast)}


@contextlib.contextmanager
def gpu_paths():
    """mlxc told that the default device is a GPU with MLX's CUDA backend: its CPU-only paths
    (attention in blocks of queries, a compiled polynomial exp, float copies of quantised
    weights, experts by expert) ask ``mx.default_device()``, and its CUDA-only ones
    ``cuda_attention.available()``, so under this it builds the graph CUDA runs, its Python
    included. MLX's own ops still run on the CPU (their stream is chosen in C++, not by this
    function). mlxc's attention kernel (``cuda_attention``: a verification's queries, a decode
    batch's ragged rows, a quantised cache's packed and staged tokens) is one stand-in node a
    call, built by the module's own Python (its replayed calls too), and MLA's decode kernel
    (``cuda_attention.latent_attention``) another. Their values are not the kernels': for
    counting and host timings only. ``cuda_matmul`` applies to half-precision weights only,
    which a CPU's float32 model does not have."""
    import mlx.core as mx

    from mlxc.runtime.model import cuda_attention

    def kernel(*, inputs, output_shapes, output_dtypes, **_):  # mx.fast.cuda_kernel's call
        out = _stand_in(mx.sort, mx.zeros(output_shapes[0], output_dtypes[0]), *inputs)
        return [out, *(mx.zeros(s, d) for s, d in zip(output_shapes[1:], output_dtypes[1:]))]

    def latent_attention(q_lat, q_pe, latents, k_pe, *, scale, mask, chunks=None):
        out = mx.erfinv(q_lat)  # one node shaped as the kernel's output
        deps = [a for a in (q_pe, latents, k_pe, mask) if isinstance(a, mx.array)]
        return mx.depends([out], deps)[0]

    def nothing(*args, **kwargs) -> None:
        return None

    patches = [
        (mx, "default_device", lambda: mx.Device(mx.gpu)),
        (cuda_attention, "_cuda_backend", lambda: True),
        (cuda_attention, "_kernel", lambda: kernel),
        (cuda_attention, "latent_attention", latent_attention),
        (cuda_attention, "_REPLAYS", {}),  # calls traced with the stand-in stay here
        # Nothing to compile, and warm's once-a-process cache is left to a real device's calls.
        (cuda_attention, "warm", nothing),
        (cuda_attention, "warm_latent", nothing),
    ]
    saved = [(owner, name, getattr(owner, name)) for owner, name, _ in patches]
    for owner, name, value in patches:
        setattr(owner, name, value)
    try:
        yield
    finally:
        for owner, name, value in saved:
            setattr(owner, name, value)


def mlxc_step(path: str) -> dict:
    """mlxc's counts; on a CPU the kernel counts are of the graph it builds for a GPU
    (``gpu_paths``, a second load), ``cpu_graph`` of the one it runs on the CPU."""
    import mlx.core as mx

    counts = _mlxc_step(path, on_gpu_paths=False)
    if mx.default_device() == mx.cpu:
        gpu = _mlxc_step(path, on_gpu_paths=True)
        counts = {**gpu, "cpu_graph": counts["cpu_graph"]}
    return counts


def _mlxc_step(path: str, on_gpu_paths: bool) -> dict:
    import mlx.core as mx

    from mlxc import load_model
    from mlxc.runtime.model.cache import cache_arrays

    paths = gpu_paths if on_gpu_paths else contextlib.nullcontext

    def make_step():
        model = load_model(path)  # outside gpu_paths: a CPU's float32 copy of bf16 weights
        # Compiled functions trace their Python (and its device checks) on the first call, so
        # the prompt's forward is under gpu_paths too.
        with paths():
            cache = model.make_cache()
            ids = mx.array([list(range(10, 10 + PROMPT_TOKENS))])
            y = mx.argmax(model(ids, cache=cache, last_only=True)[:, -1, :], axis=-1)
            mx.eval(y, cache_arrays(cache))
            # One step first: the counted one is a step like every later one (see above).
            y = mx.argmax(model(y[:, None], cache=cache, last_only=True)[:, -1, :], axis=-1)
            mx.eval(y, cache_arrays(cache))

        def step():  # what generate_tokens' step builds: the last position's logits
            with paths():
                return model(y[:, None], cache=cache, last_only=True)[:, -1, :]

        return step

    return step_counts(make_step, GPU_PATHS_STAND_INS if on_gpu_paths else frozenset())


def mlx_lm_step(path: str) -> dict:
    import mlx.core as mx
    from mlx_lm.models.cache import make_prompt_cache
    from mlx_lm.utils import load_model as peer_load

    def make_step():
        model, _ = peer_load(peer_checkpoint(Path(path)))  # gpt_oss: its experts' layout
        if mx.default_device() == mx.cpu:
            model.set_dtype(mx.float32)  # as mlxc computes a bf16 checkpoint on a CPU
        cache = make_prompt_cache(model)
        ids = mx.array([list(range(10, 10 + PROMPT_TOKENS))])
        y = mx.argmax(model(ids, cache=cache)[:, -1, :], axis=-1)
        mx.eval(y, [c.state for c in cache])
        y = mx.argmax(model(y[:, None], cache=cache)[:, -1, :], axis=-1)  # one step first
        mx.eval(y, [c.state for c in cache])
        # What mlx_lm.generate's step builds before sampling.
        return lambda: model(y[:, None], cache=cache)[:, -1, :]

    return step_counts(make_step)


def measure(arch: str, size: str, bits: int | None = None, log=print) -> dict:
    """``bits``: the checkpoint quantised first, by mlx-lm (``bench.run.peer_convert``, as
    ``mlx_lm.convert -q`` writes it); both sides load that one."""
    from bench import models

    cfg = models.config(arch, size)
    row: dict = {"layers": cfg.get("num_hidden_layers")}
    with tempfile.TemporaryDirectory(prefix="mlxc-nodes-") as tmp:
        path = str(models.write_checkpoint(Path(tmp) / "m", arch, size))
        if bits is not None:  # mlx-lm's conversion, which both sides read (group 64)
            path = str(peer_convert(Path(path), Path(tmp) / "q", group_size=64, bits=bits))
            row["quantised_by"] = "mlx-lm (`bench.run.peer_convert`)"
        row["mlxc"] = mlxc_step(path)
        try:
            row["mlx-lm"] = mlx_lm_step(path)
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
        f"### Graph nodes per decode token: {result['size']}"
        + (f", {result['bits']}-bit" if result.get("bits") else "")
        + f" ({result['device']}, "
        f"mlx {result['mlx']}, mlx-lm {result['mlx_lm']})"
    )
    about = (
        f"One batch-1 decode step after a {PROMPT_TOKENS}-token prompt and a first step, the "
        "forward's logits "
        "(`python -m bench.graph_nodes`). Kernels: primitives that launch device work, each "
        "`mx.fast` call (rms_norm, rope, attention) one, as a GPU runs it; views: reshapes, "
        "transposes, slices, broadcasts (no launch); mlxc's counted on the paths it takes on a "
        "GPU. CPU graph: the kernels of the graph the CPU runs, where each fast call is its "
        "fallback ops."
    )
    header = (
        "| arch | layers | mlxc kernels | mlx-lm kernels | mlxc / mlx-lm | mlxc kernels / layer "
        "| mlxc views | mlx-lm views | CPU graph mlxc / mlx-lm |"
    )
    lines = [title, "", about, "", header, "| --- |" + " ---: |" * 8]
    for arch, row in result["archs"].items():
        ours, peer = row["mlxc"], row["mlx-lm"]
        per_layer = f"{ours['kernels'] / row['layers']:.1f}" if row["layers"] else "-"
        cpu = ours["cpu_graph"]["kernels"]
        if peer:
            ratio = f"{ours['kernels'] / peer['kernels']:.2f}"
            cells = [peer["kernels"], ratio, per_layer, ours["views"], peer["views"]]
            cells.append(f"{cpu} / {peer['cpu_graph']['kernels']}")
        else:
            cells = ["skipped", "-", per_layer, ours["views"], "-", f"{cpu} / -"]
        cells = [row["layers"], ours["kernels"], *cells]
        lines.append(f"| {arch} | " + " | ".join(map(str, cells)) + " |")
    skipped = {a: r["skipped"] for a, r in result["archs"].items() if r.get("skipped")}
    if skipped:
        lines += ["", *(f"- {a}: {why}" for a, why in skipped.items())]
    by = {a: r["quantised_by"] for a, r in result["archs"].items() if r.get("quantised_by")}
    if by:
        lines += ["", "Quantised by:", "", *(f"- {a}: {who}" for a, who in by.items())]
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


def compare_markdown(before: dict, after: dict) -> str:
    """Before/after table of two results (``--compare``): kernels per token of each side."""
    bits = f", {after['bits']}-bit" if after.get("bits") else ""
    title = (
        f"### Kernels per decode token, before and after: {after['size']}{bits} "
        f"({after['device']}, mlx {after['mlx']}, mlx-lm {after['mlx_lm']})"
    )
    header = (
        "| arch | mlxc before | mlxc after | change | per layer before -> after | mlx-lm "
        "| mlxc / mlx-lm before -> after |"
    )
    lines = [title, "", header, "| --- |" + " ---: |" * 6]
    for arch, row in after["archs"].items():
        old = before["archs"].get(arch)
        if old is None:
            continue
        b, a, n = old["mlxc"]["kernels"], row["mlxc"]["kernels"], row["layers"]
        peer = row["mlx-lm"]["kernels"] if row["mlx-lm"] else None
        ratios = f"{b / peer:.2f} -> {a / peer:.2f}" if peer else "-"
        cells = [b, a, f"{a - b:+d} ({(a - b) / b:+.0%})", f"{b / n:.1f} -> {a / n:.1f}"]
        cells += [peer if peer else "skipped", ratios]
        lines.append(f"| {arch} | " + " | ".join(map(str, cells)) + " |")
    return "\n".join(lines) + "\n"


def _stderr(line: str) -> None:
    print(line, file=sys.stderr)


def main(argv: list[str] | None = None) -> int:
    # mlxc first: on a Linux CPU it loads an optimised BLAS before MLX is imported.
    import mlxc  # noqa: F401, I001

    from bench import models

    p = argparse.ArgumentParser(prog="python -m bench.graph_nodes", description=__doc__)
    p.add_argument("--arch", action="append", choices=models.ARCHS, help="default: all")
    p.add_argument("--size", default="small", choices=models.SIZES)
    p.add_argument("--device", choices=["cpu", "gpu"], default="cpu")
    p.add_argument("--bits", type=int, choices=[4, 8], help="quantise the checkpoint (mlx-lm)")
    p.add_argument("--out", required=True, help="write OUT.json and OUT.md")
    p.add_argument(
        "--compare",
        nargs=2,
        metavar=("BEFORE", "AFTER"),
        help="measure nothing: write OUT.md, the before/after table of two result JSONs",
    )
    args = p.parse_args(argv)
    if args.compare:
        before, after = (json.loads(Path(f).read_text()) for f in args.compare)
        text = compare_markdown(before, after)
        Path(f"{args.out}.md").write_text(text)
        print(text)
        return 0

    import mlx.core as mx
    import mlx_lm

    mx.set_default_device(mx.gpu if args.device == "gpu" else mx.cpu)
    result = {
        "size": args.size,
        "bits": args.bits,
        "device": mx.device_info().get("device_name", args.device),
        "mlx": mx.__version__,
        "mlx_lm": mlx_lm.__version__,
        "prompt_tokens": PROMPT_TOKENS,
        "archs": {},
    }
    for arch in args.arch or models.ARCHS:
        result["archs"][arch] = measure(arch, args.size, args.bits, log=_stderr)
        # Written after every arch: a long run keeps what it finished.
        write_results(args.out, result, markdown(result))
    print(markdown(result))
    return 0


if __name__ == "__main__":
    sys.exit(main())
