"""``mlxc checkpoint``: a checkpoint with RANDOM weights for a spec, to run it end to end.

The spec is compiled in memory (``mlxc.runtime.checkpoint.user_specs``) and its model built from its
``tiny_config`` (or a given config) with weights of real variance (``mlxc.verify.randomize``,
seeded: the same seed writes the same bytes). The directory holds ``config.json``, one float32
``model.safetensors`` under the model's own tensor names (what ``mlxc convert`` writes; for a
spec without ``weights.rename`` they are the hub names too), checked to load strictly, and the
demo's byte-level tokenizer sized to the vocabulary, with a chat template
(``mlxc.runtime.checkpoint.demo.write_tokenizer``: every id decodes). It is written to a temporary
directory renamed into place: it appears complete or not at all.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import mlx.core as mx
from mlx.utils import tree_flatten

from mlxc.runtime.checkpoint import demo, loading
from mlxc.runtime.checkpoint.convert import new_directory
from mlxc.runtime.checkpoint.loading import CheckpointError
from mlxc.runtime.checkpoint.user_specs import compile_specs
from mlxc.verify import randomize


def read_config_file(path: str | Path) -> dict[str, Any]:
    """A config.json-style file (``--config``) as a dict."""
    try:
        config = json.loads(Path(path).read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
        raise CheckpointError(f"cannot read --config {path}: {e}") from e
    if not isinstance(config, dict):
        raise CheckpointError(f"--config {path} must hold a JSON object")
    return config


def write_checkpoint(
    spec_path: str | Path,
    out: str | Path,
    *,
    config: dict[str, Any] | None = None,
    seed: int = 0,
) -> dict[str, Any]:
    """Write a random-weights checkpoint for the spec at ``spec_path`` into the new directory
    ``out``; a summary dict. ``config``: the config.json to build (default: the spec's
    ``tiny_config``). Raises ``user_specs.SpecError`` (lint findings) or CheckpointError."""
    spec_path, out = Path(spec_path), Path(out)
    if out.exists() and not (out.is_dir() and not any(out.iterdir())):
        raise CheckpointError(f"--out {out} already exists: remove it or choose another directory")
    if not out.resolve().parent.is_dir():
        raise CheckpointError(f"the parent of --out ({out.resolve().parent}) does not exist")
    (compiled,) = compile_specs([spec_path], builtin={})  # not registered: no clash to check
    spec, module = compiled.spec, compiled.module
    if spec.vision is not None:
        raise CheckpointError(
            f"{spec_path}: mlxc checkpoint writes text models only; spec {spec.name} has a "
            f"vision tower ({spec.vision.tower}), whose image processor files it cannot write yet"
        )
    source = "the spec's tiny_config" if config is None else "the given config"
    config = dict(spec.tiny_config if config is None else config)
    where = f"{spec_path} ({source})"
    _check_model_type(config, spec.serves.registry_keys(), where)

    model, reads = loading._build(module, config, where)
    loading._check_heads(model, reads, where)
    randomize(model, seed)
    weights = dict(tree_flatten(model.parameters()))
    vocab_size = model(mx.array([[0]])).shape[-1]  # the tokenizer's ids fill the logits' width
    # What the loader will do to these names: they must come back unchanged, strictly.
    loading._check_weights(model, model.sanitize(dict(weights)), {}, f"{where}, renamed")

    with new_directory(out, CheckpointError) as tmp:  # out is absent or empty: checked above
        mx.save_safetensors(str(tmp / "model.safetensors"), weights, metadata={"format": "mlx"})
        try:
            token_ids = demo.write_tokenizer(tmp, vocab_size)
        except ValueError as e:
            raise CheckpointError(f"{where}: {e}") from e
        for key, value in token_ids.items():
            config.setdefault(key, value)
        if spec.serves.architectures:
            config.setdefault("architectures", spec.serves.architectures[:1])
        config.setdefault("torch_dtype", "float32")
        (tmp / "config.json").write_text(json.dumps(config, indent=2) + "\n")
    return {
        "out": str(out),
        "spec": spec.name,
        "config": source,
        "seed": seed,
        "parameters": sum(v.size for v in weights.values()),
        "bytes": sum(v.nbytes for v in weights.values()),
        "vocab_size": vocab_size,
    }


def _check_model_type(config: dict, keys: list[str], where: str) -> None:
    """The config's registry key must be one the spec serves, or nothing will load it."""
    model_type, text = config.get("model_type"), config.get("text_config")
    key = model_type
    if isinstance(text, dict) and f"{model_type}:{text.get('model_type')}" in keys:
        key = f"{model_type}:{text['model_type']}"
    if key not in keys:
        raise CheckpointError(
            f"{where}: model_type {model_type!r} is not one the spec serves ({', '.join(keys)})"
        )
