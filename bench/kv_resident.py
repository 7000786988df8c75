"""Resident KV memory while a generation runs 10x past its bound: ``--max-kv-size N``, or the
sliding window of a model that has windowed layers.

Loads a benchmark checkpoint (``bench.models``, written to a temporary directory unless
``--model`` is given), generates greedily and samples the caches' live bytes, their allocated
buffer bytes and MLX's active memory as it goes. Flat means: once the bound is reached,
allocated KV bytes and active memory stop growing::

    python -m bench.kv_resident --arch llama --max-kv-size 256 --out bench/results/kv-cpu
    python -m bench.kv_resident --arch gemma3_text --max-kv-size 1024 --out bench/results/kv-gemma

A model without windowed layers runs once, mlxc under ``max_kv_size=N``, for ``--factor`` x N
tokens. A model with windowed layers (gemma3_text: five sliding-window layers to each full one)
runs ``--factor`` x its window W, and the windowed and the full layers are counted apart, three
times: mlxc with no bound (windowed layers flat at ~W, full ones growing), mlxc under
``--max-kv-size`` (full layers flat at N too), and mlx-lm with the cache its model makes
(``RotatingKVCache`` of W for the windowed layers, a growing ``KVCache`` for the full ones; it
takes no ``max_kv_size`` for a model that makes its own cache). On a CPU mlx-lm computes in
float32, as mlxc does there, so both hold the same bytes per token.
"""

from __future__ import annotations

import argparse
import sys
import tempfile
import time
from pathlib import Path

from bench.report import write_results

GROUPS = ("windowed", "full")


def _group(c) -> str:
    """Which kind of layer a cache (mlxc's or mlx-lm's) serves."""
    windowed = getattr(c, "window", None) is not None or type(c).__name__ == "RotatingKVCache"
    return GROUPS[0] if windowed else GROUPS[1]


def _allocated(c) -> int:
    return sum(
        a.nbytes for a in (getattr(c, "keys", None), getattr(c, "values", None)) if a is not None
    )


def _live(c) -> int:
    """Bytes of the tokens a cache holds (not its spare capacity)."""
    if not hasattr(c, "size"):  # mlxc: the LayerCache protocol's nbytes is the live bytes
        return c.nbytes
    if c.keys is None:  # mlx-lm: size() is the number of tokens held
        return 0
    return _allocated(c) // c.keys.shape[2] * c.size()


def _sample(cache: list, tokens: int, t0: float) -> dict:
    import mlx.core as mx

    s = {"tokens": tokens, "s": round(time.perf_counter() - t0, 3)}
    for g in GROUPS:
        s[f"{g}_live_kv_bytes"] = sum(_live(c) for c in cache if _group(c) == g)
        s[f"{g}_allocated_kv_bytes"] = sum(_allocated(c) for c in cache if _group(c) == g)
    s["live_kv_bytes"] = sum(s[f"{g}_live_kv_bytes"] for g in GROUPS)
    s["allocated_kv_bytes"] = sum(s[f"{g}_allocated_kv_bytes"] for g in GROUPS)
    s["active_bytes"] = mx.get_active_memory()
    return s


def _run(side: str, model, prompt: list[int], n_tokens: int, max_kv: int | None) -> list[dict]:
    """Generate ``n_tokens`` after ``prompt``; a sample of the caches every 1/40 of them."""
    import mlx.core as mx

    if side == "mlxc":
        from mlxc.runtime.serving.generate import generate_tokens

        cache = model.make_cache()
        steps = generate_tokens(model, prompt, max_tokens=n_tokens, max_kv_size=max_kv, cache=cache)
    else:
        from mlx_lm.generate import generate_step
        from mlx_lm.models.cache import make_prompt_cache

        cache = make_prompt_cache(model, max_kv)
        steps = generate_step(mx.array(prompt), model, max_tokens=n_tokens, prompt_cache=cache)
    every = max(n_tokens // 40, 1)
    samples, t0 = [], time.perf_counter()
    for i, _ in enumerate(steps):
        if (i + 1) % every == 0:
            samples.append(_sample(cache, len(prompt) + i + 1, t0))
    return samples


def _mib(b: int) -> str:
    return f"{b / 2**20:.2f}"


def _table(samples: list[dict], grouped: bool) -> list[str]:
    if grouped:
        head = "| tokens | windowed live / allocated KV MiB | full live / allocated KV MiB | MLX active MiB |"
    else:
        head = "| tokens | live KV MiB | allocated KV MiB | MLX active MiB |"
    lines = [head, "|---|---|---|---|"]
    shown = samples[:: max(len(samples) // 12, 1)]
    for s in shown + ([samples[-1]] if shown[-1] is not samples[-1] else []):
        if grouped:
            kv = [
                f"{_mib(s[f'{g}_live_kv_bytes'])} / {_mib(s[f'{g}_allocated_kv_bytes'])}"
                for g in GROUPS
            ]
        else:
            kv = [_mib(s["live_kv_bytes"]), _mib(s["allocated_kv_bytes"])]
        lines.append(f"| {s['tokens']} | {' | '.join(kv)} | {s['active_bytes'] / 2**20:.1f} |")
    return lines


def _summary(samples: list[dict], bound: int, group: str, what: str) -> str:
    """Growth from the first sample at or past ``bound`` tokens to the end; ``group`` "windowed",
    "full" or "" (all layers)."""
    key = f"{group}_allocated_kv_bytes" if group else "allocated_kv_bytes"
    first = next(s for s in samples if s["tokens"] >= bound)
    tail = [s for s in samples if s["tokens"] >= bound]
    last = samples[-1]
    quarter = [s for s in samples if s["tokens"] >= last["tokens"] * 3 // 4]
    dt = max(quarter[-1]["s"] - quarter[0]["s"], 1e-9)
    tps = (quarter[-1]["tokens"] - quarter[0]["tokens"]) / dt
    growth = max(s["active_bytes"] for s in tail) - first["active_bytes"]
    return (
        f"From {first['tokens']} to {last['tokens']} tokens ({last['tokens'] / bound:.1f}x "
        f"{what}): allocated{' ' + group if group else ''} KV {_mib(first[key])} -> max "
        f"{_mib(max(s[key] for s in tail))} MiB; MLX active memory grew by at most "
        f"{growth / 2**20:.2f} MiB; decode {tps:.1f} tokens/s over the last quarter."
    )


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m bench.kv_resident", description=__doc__)
    p.add_argument("--model", help="checkpoint directory (default: write one with bench.models)")
    p.add_argument("--arch", default="llama")
    p.add_argument("--size", default="small", choices=["small", "medium"])
    p.add_argument("--device", choices=["cpu", "gpu"], default=None, help="default: MLX's")
    p.add_argument("--max-kv-size", type=int, default=256)
    p.add_argument("--factor", type=int, default=10, help="generate factor x the bound")
    p.add_argument("--out", required=True, help="write OUT.json and OUT.md")
    args = p.parse_args(argv)

    # mlxc first: on a Linux CPU it loads an optimised BLAS before MLX is imported.
    from mlxc import load_model  # noqa: I001

    import mlx.core as mx

    from bench import models

    if args.device:
        mx.set_default_device(mx.gpu if args.device == "gpu" else mx.cpu)
    n = args.max_kv_size
    with tempfile.TemporaryDirectory(prefix="mlxc-kv-bench-") as tmp:
        path = args.model or str(models.write_checkpoint(Path(tmp) / "m", args.arch, args.size))
        model = load_model(path)
        mx.eval(model.parameters())  # read every weight before the directory goes
        windowed = [c for c in model.make_cache() if getattr(c, "window", None) is not None]
        window = max((c.window for c in windowed), default=None)
        peer = None
        if window:
            from mlx_lm.utils import load_model as peer_load

            peer, _ = peer_load(Path(path))
            if mx.default_device() == mx.cpu:
                peer.set_dtype(mx.float32)  # as mlxc computes on a CPU: the same KV bytes
            mx.eval(peer.parameters())
    bound = window or n
    prompt = list(range(10, 10 + bound // 2))
    todo = [("mlxc", None), ("mlx-lm", None), ("mlxc", n)] if window else [("mlxc", n)]
    result = {
        "args": vars(args),
        "device": mx.device_info().get("device_name", "?"),
        "mlx": mx.__version__,
        "window": window,
        "slack": max((c.slack for c in windowed), default=0),
        "prompt_tokens": len(prompt),
        "new_tokens": args.factor * bound,
        "runs": {},
    }
    for side, max_kv in todo:
        name = side if side == "mlx-lm" else f"mlxc, max_kv_size {max_kv}"
        print(f"{name}: {args.factor * bound} tokens", file=sys.stderr, flush=True)
        samples = _run(side, model if side == "mlxc" else peer, prompt, args.factor * bound, max_kv)
        result["runs"][name] = {"side": side, "max_kv_size": max_kv, "samples": samples}
        # Written after every run: a long CPU run keeps what it finished.
        text = markdown(result)
        write_results(args.out, result, text)
    print(text)
    return 0


def markdown(result: dict) -> str:
    a, window = result["args"], result["window"]
    n = a["max_kv_size"]
    lines = [
        f"### Resident KV: {a['arch']} {a['size']} ({result['device']}, mlx {result['mlx']})",
        "",
    ]
    if window:
        slack = result["slack"]
        lines += [
            (
                f"Sliding window W = {window}; {result['prompt_tokens']}-token prompt, then "
                f"{result['new_tokens']} greedy tokens. mlxc's windowed layers hold fewer than "
                f"W - 1 + {slack} keys between steps (the oldest dropped {slack} at a time); "
                "mlx-lm's RotatingKVCache holds W. mlx-lm makes its own cache for this model "
                "and takes no max_kv_size."
            ),
            "",
        ]
    for name, r in result["runs"].items():
        s = r["samples"]
        lines += [f"**{name}**", "", *_table(s, grouped=bool(window)), ""]
        if window:
            lines.append(_summary(s, window, "windowed", "W") + "  ")
            full_bound = r["max_kv_size"] or window
            lines.append(_summary(s, full_bound, "full", "N" if r["max_kv_size"] else "W"))
        else:
            lines.append(_summary(s, n, "", "N"))
        lines.append("")
    return "\n".join(lines)


if __name__ == "__main__":
    sys.exit(main())
