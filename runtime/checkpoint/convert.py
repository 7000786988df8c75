"""``mlxc convert``: rewrite a checkpoint in another dtype, or quantised, as an MLX checkpoint.

The model is loaded through mlxc (so every checkpoint mlxc loads converts: HF layouts, fused
experts, FP8 block-scaled weights), optionally quantised with ``nn.quantize``, and written in
mlxc's own parameter layout (the names ``model.sanitize`` produces, which it maps to
themselves) as safetensors, with ``config.json`` carrying a ``quantization: {group_size, bits,
mode}`` key that ``runtime/checkpoint/loading.py::_quantize`` (and mlx-lm) read back. Tokenizer,
chat template and processor files are copied.

Quantisation follows mlx-lm's rules: every module with ``to_quantized`` (linears, embeddings,
stacked experts) whose input dimension divides by the group size; the rest stays float. Vision
towers and projectors stay float (as mlx-vlm does by default): they are small and their
features are sensitive to it. MoE routers stay float too (see ``ROUTERS``).

The output appears atomically: everything is written to a hidden temporary directory beside
``out``, which is renamed to ``out`` only when complete. Problems raise :class:`ConvertError`
(a :class:`~mlxc.runtime.checkpoint.loading.CheckpointError`) with a one-line reason.
"""

from __future__ import annotations

import json
import os
import shutil
import tempfile
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import mlx.core as mx
from mlx import nn
from mlx.utils import tree_flatten

from mlxc.runtime.checkpoint.loading import (
    INDEX_FILE,
    CheckpointError,
    load_model,
    quantization,
    read_config,
    weight_files,
)

BITS = (2, 3, 4, 5, 6, 8)
GROUP_SIZES = (32, 64, 128)
DTYPES = ("bfloat16", "float16", "float32")
MAX_SHARD_BYTES = 5 << 30  # mlx-lm's shard size
# Module paths that stay float: vision towers and the projectors into the text model.
SKIP_QUANTIZE = ("visual", "vision", "multi_modal_projector")
# MoE routers stay float: [E, H] is tiny, and routing is discrete, so rounding a router flips
# experts where scores nearly tie (mlx-lm keeps deepseek/mistral4 routers float too).
ROUTERS = ("gate", "shared_expert_gate")
# Linears whose ``.weight`` generated code reads as a matrix (absorbed MLA splits kv_b_proj into
# its key and value halves per head): quantising them would hand it packed integers.
READ_AS_MATRIX = ("kv_b_proj",)
# Files of a checkpoint directory that are weights or rewritten here; everything else is copied.
_NOT_COPIED_SUFFIXES = (".safetensors", ".bin", ".pt", ".pth", ".ckpt", ".h5", ".msgpack", ".gguf")
_NOT_COPIED_NAMES = ("config.json", INDEX_FILE, "pytorch_model.bin.index.json")


@contextmanager
def new_directory(out: Path, error: type[Exception]) -> Iterator[Path]:
    """A temporary directory beside ``out`` to fill: renamed to ``out`` (absent, or empty as
    the caller checked) when the block ends, removed if it raises. ``out`` appears whole or
    not at all; an OSError becomes ``error`` naming ``out``."""
    tmp = Path(tempfile.mkdtemp(prefix=f".{out.name}.tmp-", dir=out.resolve().parent))
    try:
        yield tmp
        os.chmod(tmp, 0o755)  # mkdtemp makes it 0700
        if out.exists():
            out.rmdir()
        tmp.rename(out)
    except BaseException as e:
        shutil.rmtree(tmp, ignore_errors=True)
        if isinstance(e, OSError):
            raise error(f"cannot write {out}: {e}") from e
        raise


class ConvertError(CheckpointError):
    """A conversion that cannot run (bad settings, output in the way) or failed."""


def _source_dtype(path: Path, config: dict[str, Any]) -> str:
    """The floating dtype the checkpoint's weights are in (FP8 counts as bfloat16)."""
    for key in ("dtype", "torch_dtype"):
        for cfg in (config, config.get("text_config") or {}):
            value = cfg.get(key) if isinstance(cfg, dict) else None
            if value in DTYPES:
                return value
    # No usable config key: the first floating tensor of the first weight file.
    names = {"BF16": "bfloat16", "F16": "float16", "F32": "float32"}
    for f in weight_files(path):
        with open(f, "rb") as fh:
            n = int.from_bytes(fh.read(8), "little")
            header = json.loads(fh.read(n))
        for k, v in header.items():
            if k != "__metadata__" and v.get("dtype") in names:
                return names[v["dtype"]]
    return "bfloat16"


def _skip(path: str) -> bool:
    parts = path.split(".")
    if parts[-1] in ROUTERS or parts[-1] in READ_AS_MATRIX:
        return True
    return any(part.startswith(SKIP_QUANTIZE) for part in parts)


def quantize(model: nn.Module, *, bits: int, group_size: int, mode: str = "affine") -> dict:
    """Quantise ``model`` in place as :func:`convert` does; the ``quantization`` config entry.

    Quantised: every module with ``to_quantized`` (linear, embedding, stacked experts) whose
    weight's input dimension (last axis) divides by ``group_size``, outside the vision tower,
    except MoE routers and MLA's ``kv_b_proj`` (read as a matrix by absorbed attention).
    """

    def predicate(path: str, module: nn.Module) -> bool:
        if not hasattr(module, "to_quantized") or _skip(path):
            return False
        weight = getattr(module, "weight", None)
        return isinstance(weight, mx.array) and weight.shape[-1] % group_size == 0

    nn.quantize(model, group_size=group_size, bits=bits, mode=mode, class_predicate=predicate)
    return {"group_size": group_size, "bits": bits, "mode": mode}


def _check_settings(
    model_dir: Path, out: Path, quantize: bool, bits: int, group_size: int, dtype: str | None
) -> None:
    if dtype is not None and dtype not in DTYPES:
        raise ConvertError(f"dtype must be one of {', '.join(DTYPES)}, got {dtype!r}")
    if quantize:
        if bits not in BITS:
            raise ConvertError(f"bits must be one of {', '.join(map(str, BITS))}, got {bits}")
        if group_size not in GROUP_SIZES:
            raise ConvertError(
                f"group size must be one of {', '.join(map(str, GROUP_SIZES))}, got {group_size}"
            )
    src, dst = model_dir.resolve(), out.resolve()
    if dst == src or src in dst.parents:
        raise ConvertError(f"--out {out} must not be the model directory or inside it")
    if dst.exists() and not (dst.is_dir() and not any(dst.iterdir())):
        raise ConvertError(f"--out {out} already exists: remove it or choose another directory")
    if not dst.parent.is_dir():
        raise ConvertError(f"the parent of --out ({dst.parent}) does not exist")


def _save_weights(weights: dict[str, mx.array], out: Path) -> list[str]:
    """Write ``weights`` as one safetensors file, or shards plus an index past 5 GB."""
    shards: list[dict[str, mx.array]] = [{}]
    size = 0
    for k, v in weights.items():
        if shards[-1] and size + v.nbytes > MAX_SHARD_BYTES:
            shards.append({})
            size = 0
        shards[-1][k] = v
        size += v.nbytes
    if len(shards) == 1:
        names = ["model.safetensors"]
    else:
        names = [
            f"model-{i:05d}-of-{len(shards):05d}.safetensors" for i in range(1, len(shards) + 1)
        ]
    weight_map = {}
    for name, shard in zip(names, shards, strict=True):
        mx.save_safetensors(str(out / name), shard, metadata={"format": "mlx"})
        weight_map.update(dict.fromkeys(shard, name))
    if len(shards) > 1:
        index = {
            "metadata": {"total_size": sum(v.nbytes for v in weights.values())},
            "weight_map": dict(sorted(weight_map.items())),
        }
        (out / INDEX_FILE).write_text(json.dumps(index, indent=2) + "\n")
    return names


def _copy_side_files(src: Path, out: Path) -> list[str]:
    copied = []
    for f in sorted(src.iterdir()):
        if not f.is_file() or f.name.startswith("."):
            continue
        if f.name in _NOT_COPIED_NAMES or f.name.endswith(_NOT_COPIED_SUFFIXES):
            continue
        shutil.copy2(f, out / f.name)
        copied.append(f.name)
    return copied


def convert(
    model_dir: str | Path,
    out: str | Path,
    *,
    quantize: bool = False,
    bits: int = 4,
    group_size: int = 64,
    dtype: str | None = None,
    mode: str = "affine",
) -> dict[str, Any]:
    """Write the checkpoint at ``model_dir`` to the new directory ``out``; a summary dict.

    ``dtype``: the float dtype of the written weights (and of the quantisation scales); default:
    the checkpoint's own (FP8 becomes bfloat16). ``quantize``: ``bits``-bit affine quantisation
    in groups of ``group_size`` (see :func:`quantize` for which layers). Raises
    :class:`ConvertError` / :class:`CheckpointError`; ``out`` then does not exist.
    """
    model_dir, out = Path(model_dir), Path(out)
    config = read_config(model_dir)
    _check_settings(model_dir, out, quantize, bits, group_size, dtype)
    if (quant := quantization(config)) is not None:
        # (An MXFP4 checkpoint's experts would be written quantised under a config without it.)
        raise ConvertError(
            f"{model_dir} is already quantised ({quant!r}): convert from the float checkpoint "
            "instead"
        )
    target = dtype or _source_dtype(model_dir, config)
    model = load_model(model_dir, dtype=target, fuse=False)  # the checkpoint's names
    n_params = sum(v.size for _, v in tree_flatten(model.parameters()))

    new_config = dict(config)
    new_config.pop("quantization_config", None)  # e.g. FP8 block scales: dequantised on load
    for key in ("dtype", "torch_dtype"):
        if key in new_config or key == "torch_dtype":
            new_config[key] = target
    if quantize:
        quant = _quantize_all(model, bits=bits, group_size=group_size, mode=mode)
        new_config["quantization"] = quant
        new_config["quantization_config"] = dict(quant)  # mlx-lm writes both
    weights = dict(tree_flatten(model.parameters()))

    with new_directory(out, ConvertError) as tmp:
        files = _save_weights(weights, tmp)
        (tmp / "config.json").write_text(json.dumps(new_config, indent=2, sort_keys=True) + "\n")
        copied = _copy_side_files(model_dir, tmp)
    quantized = sum(1 for _, m in model.named_modules() if hasattr(m, "scales"))
    return {
        "out": str(out),
        "dtype": target,
        "quantization": new_config.get("quantization"),
        "parameters": n_params,
        "quantized_modules": quantized,
        "bytes": sum(v.nbytes for v in weights.values()),
        "files": files,
        "copied": copied,
    }


def _quantize_all(model: nn.Module, *, bits: int, group_size: int, mode: str) -> dict:
    try:
        return quantize(model, bits=bits, group_size=group_size, mode=mode)
    except (ValueError, TypeError) as e:
        raise ConvertError(f"cannot quantise to {bits} bits, group size {group_size}: {e}") from e
