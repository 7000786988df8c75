"""Vision-language side by side: mlxc against mlx-vlm, one prompt with one image, then decode.

One command::

    python -m bench.vl_compare --device cpu --size small  --peer-path /tmp/mlxvlm-peer \\
        --out bench/results/vl-cpu-small
    python -m bench.vl_compare --device gpu --size medium --peer-path /tmp/mlxvlm-peer \\
        --out bench/results/vl-gpu-h200-medium

writes ``OUT.json`` (every number and repeat, the machine, both sides' versions) and ``OUT.md``.

For qwen2_vl, qwen3_vl and mistral3 it writes a deterministic random checkpoint directory
(``bench.models.write_vl_checkpoint``: hub config.json and tensor names, bf16, tokenizer, chat
template, processor files) and a deterministic random-pixel PNG, and loads the same directory
into mlxc (``mlxc.load_model`` and the processor ``mlxc serve`` uses) and into mlx-vlm (its
``load``). Each side runs its users' path from the prompt text and the image file: mlxc renders
the chat template and preprocesses the image (``Processor.encode_text_and_images``), then
``generate_tokens``; mlx-vlm ``apply_chat_template``, then ``stream_generate``. Both greedy, EOS
ignored, interleaved and repeated by ``bench.harness.measure``; the median is reported. Time to
the first token covers the image's decoding and preprocessing, the vision tower and prefill;
prefill tokens/s is each side's own prompt length over it; decode tokens/s counts the tokens
after the first.

mlx-vlm is a benchmark-only peer, not a dependency: install it (with the two modules it imports
that the project's environment lacks) into a directory of its own and pass it as
``--peer-path`` (bench/README.md has the commands). It runs in this process, on the same MLX
as mlxc, so the sides interleave. On a CPU device OpenBLAS is preloaded (runtime/blas.py) and
mlxc computes in float32, so the peer is cast to float32 too ("mlx-vlm f32", the kernel-level
comparison of bench.run's openblas pass); on a GPU both run the bf16 weights as loaded.
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import mlxc  # first: its import hook loads OpenBLAS before MLX (runtime/blas.py)
from bench.harness import Side
from bench.report import write_results

DEFAULTS = {
    # size: image (height, width), decode tokens, repeats
    "tiny": {"image": (56, 84), "decode_tokens": 4, "repeats": 1},
    "small": {"image": (336, 336), "decode_tokens": 32, "repeats": 5},
    "medium": {"image": (768, 1024), "decode_tokens": 128, "repeats": 5},
}
TEXT = "describe the quick brown fox under the soft blue seas"
# OpenBLAS's DYNAMIC_ARCH may not know a CPU and fall back to slow kernels (Prescott): recorded.
ENV = ("OPENBLAS_CORETYPE", "MLXC_BLAS")


def _log(msg: str) -> None:
    print(msg, file=sys.stderr, flush=True)


def write_image(path: Path, height: int, width: int, seed: int = 0) -> Path:
    """A deterministic random-pixel RGB PNG (noise: the tower's cost does not depend on it)."""
    import numpy as np
    from PIL import Image

    rng = np.random.default_rng(seed)
    Image.fromarray(rng.integers(0, 256, (height, width, 3), dtype=np.uint8)).save(path)
    return path


@dataclass
class VLSide(Side):
    """A side whose prompt is text plus one image file, run through its users' whole path.

    ``prompt_tokens`` / ``image_tokens``: what its processor made of them (set at load).
    """

    processor: Any = None
    text: str = TEXT
    image: str = ""
    prompt_tokens: int = 0
    image_tokens: int = 0

    def make_cache(self) -> list:
        if self.kind == "ours":
            return super().make_cache()
        from mlx_vlm.models.cache import make_prompt_cache

        return make_prompt_cache(self.model.language_model)

    def generate(self, ids: list[int], max_tokens: int, cache: list):
        # ``ids`` is unused: each side encodes the text and image itself, inside the timing.
        if self.kind == "ours":
            return self._ours(max_tokens, cache)
        return self._peer(max_tokens, cache)

    def encode(self):
        """mlxc's prompt: the chat template, the image preprocessed, placeholders expanded."""
        from mlxc.runtime.checkpoint import processor as proc

        return self.processor.encode_text_and_images(self.text, [proc.load_image(self.image)])

    def _ours(self, max_tokens: int, cache: list):
        from mlxc.runtime.serving.generate import generate_tokens

        prompt = self.encode()
        yield from generate_tokens(
            self.model, prompt.ids, max_tokens=max_tokens, cache=cache, vision_inputs=prompt.vision
        )

    def peer_prompt(self) -> str:
        from mlx_vlm.prompt_utils import apply_chat_template

        return apply_chat_template(self.processor, self.model.config, self.text, num_images=1)

    def _peer(self, max_tokens: int, cache: list):
        from mlx_vlm import stream_generate

        results = stream_generate(
            self.model,
            self.processor,
            self.peer_prompt(),
            image=[self.image],
            max_tokens=max_tokens,
            temperature=0.0,
            prompt_cache=cache,
        )
        for n, r in enumerate(results):
            if r.token is None or n == max_tokens:  # its closing result carries no new token
                break
            yield r.token


def load_ours(path: str, image: str) -> VLSide:
    from bench.run import _dtype_of
    from mlxc.runtime.checkpoint import processor as proc
    from mlxc.runtime.checkpoint.tokenizer import load_tokenizer

    model = mlxc.load_model(path)
    side = VLSide("mlxc", "ours", model, _dtype_of(model), image=image)
    side.processor = proc.load_processor(path, load_tokenizer(path), model)
    prompt = side.encode()
    side.prompt_tokens = len(prompt.ids)
    side.image_tokens = prompt.ids.count(side.processor.image_token_id)
    return side


def load_peer(path: str, image: str, device: str) -> VLSide:
    import mlx.core as mx
    from mlx_vlm import load
    from mlx_vlm.utils import prepare_inputs

    from bench.run import _dtype_of

    model, processor = load(path)
    name = "mlx-vlm"
    if device == "cpu":  # mlxc computes in float32 on a CPU (see the module docstring)
        model.set_dtype(mx.float32)
        name = "mlx-vlm f32"
    mx.eval(model.parameters())
    # Random weights: a greedy run may hit EOS at any step; both sides decode all N tokens.
    processor.tokenizer.stopping_criteria = lambda token: False
    side = VLSide(name, "peer", model, _dtype_of(model), processor=processor, image=image)
    image_id = getattr(model.config, "image_token_index", None)
    image_id = model.config.image_token_id if image_id is None else image_id
    inputs = prepare_inputs(processor, images=[image], prompts=[side.peer_prompt()])
    ids = [int(i) for i in inputs["input_ids"].reshape(-1).tolist()]
    side.prompt_tokens, side.image_tokens = len(ids), ids.count(image_id)
    return side


def measure_arch(
    path: str,
    image: str,
    *,
    device: str,
    decode_tokens: int,
    repeats: int,
    budget_s: float,
    peer: bool = True,
    log=_log,
) -> dict:
    """Both sides on one checkpoint: {"sides": {name: numbers or {"error": ...}}}."""
    import mlx.core as mx

    from bench.harness import Cell, measure, run_once

    sides, failed = [load_ours(path, image)], {}
    if peer:
        try:
            sides.append(load_peer(path, image, device))
        except Exception as e:  # noqa: BLE001 - a peer that cannot load is a result
            log(f"    mlx-vlm cannot load {path}: {type(e).__name__}: {e}")
            failed["mlx-vlm"] = {"error": f"{type(e).__name__}: {e}"}
    for s in list(sides):  # a short run first on every side (allocations, kernel set-up)
        try:
            run_once(s, [], 2)
        except Exception as e:  # a side that cannot run is a result
            if s.kind == "ours":
                raise
            log(f"    {s.name} cannot run {path}: {type(e).__name__}: {e}")
            failed[s.name] = {"error": f"{type(e).__name__}: {e}", "dtype": s.dtype}
            sides.remove(s)
    ours = sides[0]
    # The cell's ids only label the run: each side encodes its own prompt inside the timing.
    cell = Cell("image+decode", [0] * ours.prompt_tokens, decode_tokens + 1)
    res = measure(sides, cell, repeats=repeats, budget_s=budget_s, warmup=device == "gpu", log=log)
    out = {}
    for s in sides:
        r = dict(res[s.name])
        r["prefill_tps"] = s.prompt_tokens / r["first_token_s"]  # its own prompt length
        r.update(dtype=s.dtype, prompt_tokens=s.prompt_tokens, image_tokens=s.image_tokens)
        out[s.name] = r
    mx.clear_cache()
    # Same weights, same prompt, greedy: the peers' first tokens should be ours (float32; bf16
    # rounding may part them after a near tie).
    same = {k: r["tokens"] == out["mlxc"]["tokens"] for k, r in out.items() if k != "mlxc"}
    return {"sides": {**out, **failed}, "same_tokens": same}


def versions(peer_path: str | None) -> dict:
    from importlib.metadata import PackageNotFoundError, version

    out = {}
    for dist in ("mlx", "mlx-lm", "transformers", "mlxc"):
        try:
            out[dist] = version(dist)
        except PackageNotFoundError:
            out[dist] = None
    try:
        import mlx_vlm

        out["mlx-vlm"] = mlx_vlm.__version__
        out["mlx-vlm_path"] = str(Path(mlx_vlm.__file__).parent)
    except Exception as e:  # noqa: BLE001 - informative only
        out["mlx-vlm"] = f"not importable: {e}"
    out["peer_path"] = peer_path
    return out


# --- report ----------------------------------------------------------------------------------


def markdown(result: dict) -> str:
    from bench.report import _fmt, _mib, _ratio

    m = result["machine"]
    peer_name = "mlx-vlm f32" if m["device"] == "cpu" else "mlx-vlm"
    h, w = result["settings"]["image"]
    n = result["settings"]["decode_tokens"]
    lines = [
        f"# VL: mlxc vs {peer_name} ({m['device']}, size {result['size']})",
        "",
        f"`{result['command']}`",
        "",
        (
            f"One prompt with one {w}x{h} image (random pixels), then {n} greedy decode tokens. "
            "Prefill = the side's prompt tokens / time to the first token (image decoding and "
            "preprocessing, vision tower, prefill); decode = tokens/s after the first; "
            f"ratio = mlxc / {peer_name}; peak = own weights + the run's extra peak."
        ),
        "",
        (
            "| model | params | image tokens | prompt tokens | first token s mlxc / peer | "
            "prefill tok/s mlxc | peer | ratio | decode tok/s mlxc | peer | ratio | "
            "peak MiB mlxc / peer | same tokens |"
        ),
        "|" + "---|" * 13,
    ]
    for arch, a in result["archs"].items():
        o = a["sides"]["mlxc"]
        p = next((v for k, v in a["sides"].items() if k.startswith("mlx-vlm")), {})
        if "error" in p:
            fails = f"fails: {p['error'][:120]}"
            pp = pd = fails
            pf, ppk, pimg, ptok = "—", None, "—", "—"
        else:
            pp, pd, pf = p.get("prefill_tps"), p.get("decode_tps"), _fmt(p.get("first_token_s"))
            ppk, pimg, ptok = p.get("peak_bytes"), p.get("image_tokens"), p.get("prompt_tokens")
        lines.append(
            "| "
            + " | ".join(
                [
                    arch,
                    f"{a['params'] / 1e6:,.0f}M",
                    f"{o['image_tokens']} / {pimg}",
                    f"{o['prompt_tokens']} / {ptok}",
                    f"{_fmt(o['first_token_s'])} / {pf}",
                    _fmt(o["prefill_tps"]),
                    _fmt(pp),
                    _ratio(o["prefill_tps"], pp),
                    _fmt(o["decode_tps"]),
                    _fmt(pd),
                    _ratio(o["decode_tps"], pd),
                    f"{_mib(o['peak_bytes'])} / {_mib(ppk)}",
                    {True: "yes", False: "no"}.get(
                        next(iter(a.get("same_tokens", {}).values()), None), "—"
                    ),
                ]
            )
            + " |"
        )
    v = result["versions"]
    lines += [
        "",
        f"Versions: mlx {v['mlx']}, mlx-vlm {v['mlx-vlm']}, transformers {v['transformers']}, "
        f"mlxc {v['mlxc']} ({m.get('commit', '?')}); {m.get('cpu', '')} {m['cpus']} cores; "
        f"dtypes: "
        + "; ".join(
            f"{arch} {k}: {s.get('dtype', '?')}"
            for arch, a in result["archs"].items()
            for k, s in a["sides"].items()
        )
        + f". Wall {result['wall_s']} s; load average (1, 5, 15 min) at the start "
        f"{_load(result.get('loadavg_start'))}, at the end {_load(result.get('loadavg_end'))}.",
        "",
    ]
    return "\n".join(lines)


def _load(avg) -> str:
    return "—" if avg is None else " / ".join(f"{x:.1f}" for x in avg)


# --- main ------------------------------------------------------------------------------------


def main(argv: list[str] | None = None) -> None:
    from bench import models

    p = argparse.ArgumentParser(
        prog="python -m bench.vl_compare", description=__doc__.split("\n")[0]
    )
    p.add_argument("--device", choices=["cpu", "gpu"], default="cpu")
    p.add_argument("--size", choices=models.VL_SIZES, default=None)
    p.add_argument("--out", default=None, help="results path without suffix (.json/.md added)")
    p.add_argument("--archs", default=",".join(models.VL_ARCHS))
    p.add_argument("--peer-path", default=None, help="a directory holding mlx_vlm (pip --target)")
    p.add_argument("--no-peer", action="store_true", help="mlxc only")
    p.add_argument("--image", default=None, help="HEIGHTxWIDTH of the image")
    p.add_argument("--decode-tokens", type=int, default=None)
    p.add_argument("--repeats", type=int, default=None)
    p.add_argument("--budget", type=float, default=60.0, help="seconds per arch before stopping")
    p.add_argument("--work-dir", default=None, help="keep checkpoints here (default: temp)")
    args = p.parse_args(argv)
    size = args.size or ("medium" if args.device == "gpu" else "small")
    d = DEFAULTS[size]
    height, width = (int(x) for x in args.image.split("x")) if args.image else d["image"]
    decode_tokens = args.decode_tokens or d["decode_tokens"]
    repeats = args.repeats or d["repeats"]
    if args.peer_path:  # after the project's packages: the peer dir adds, never replaces
        sys.path.append(str(Path(args.peer_path).resolve()))

    # A BLAS must be chosen before the first `import mlx.core` (runtime/blas.py).
    from mlxc.runtime import blas

    st = blas.preload(args.device)
    import mlx.core as mx

    from bench.run import machine

    mx.set_default_device(mx.gpu if args.device == "gpu" else mx.cpu)
    _log(st.reason)
    out = Path(args.out or f"bench/results/vl-{args.device}-{size}")
    out.parent.mkdir(parents=True, exist_ok=True)
    t0 = time.perf_counter()
    result: dict = {
        "command": "".join(f"{k}={os.environ[k]} " for k in ENV if os.environ.get(k))
        + "python -m bench.vl_compare "
        + " ".join(argv if argv is not None else sys.argv[1:]),
        "machine": machine(args.device),
        "blas": st.as_dict(),
        "env": {k: os.environ.get(k) for k in ENV},
        "versions": versions(args.peer_path),
        "loadavg_start": os.getloadavg(),  # a shared machine's other work shows here
        "size": size,
        "settings": {
            "image": [height, width],
            "decode_tokens": decode_tokens,
            "repeats": repeats,
            "budget_s": args.budget,
            "text": TEXT,
        },
        "archs": {},
    }
    with tempfile.TemporaryDirectory(prefix="mlxc-vl-bench-") as tmp:
        work = Path(args.work_dir or tmp)
        work.mkdir(parents=True, exist_ok=True)
        image = str(write_image(work / f"image-{height}x{width}.png", height, width))
        for arch in args.archs.split(","):
            t = time.perf_counter()
            path = work / f"{arch}-{size}"
            if not (path / "config.json").exists():
                models.write_vl_checkpoint(path, arch, size)
            params = models.vl_parameter_count(arch, size)
            _log(f"{arch} ({size}, {params / 1e6:.0f}M params): {time.perf_counter() - t:.1f} s")
            r = measure_arch(
                str(path),
                image,
                device=args.device,
                decode_tokens=decode_tokens,
                repeats=repeats,
                budget_s=args.budget,
                peer=not args.no_peer,
            )
            result["archs"][arch] = {"params": params, **r}
    result["loadavg_end"] = os.getloadavg()
    result["wall_s"] = round(time.perf_counter() - t0, 1)
    write_results(out, result, markdown(result))
    _log(f"wrote {out}.json and {out}.md ({result['wall_s']} s)")
    print(markdown(result))


if __name__ == "__main__":
    main()
