"""Load an HF checkpoint directory into a generated model.

``config.json`` -> ``model_type`` -> generated module (through the registry the build writes)
-> safetensors headers (names and shapes; data is read lazily) -> layer counts checked against
them -> ``ModelArgs`` -> ``Model`` (lazy arrays: nothing allocated) -> spec rules
(``model.sanitize``), quantised when the config says so -> a strict name and shape check ->
``model.update``.

Every check runs before the model receives a single weight, so a failed load never leaves a
half-loaded model behind. All failures raise :class:`CheckpointError` with a message that names
the culprit (file, tensor, config entry) and says what to do.
"""

from __future__ import annotations

import copy
import importlib
import json
import re
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from pathlib import Path, PurePath
from types import ModuleType
from typing import Any

import mlx.core as mx
from mlx import nn
from mlx.utils import tree_flatten

from mlxc.runtime import blas
from mlxc.runtime.checkpoint import fp8
from mlxc.runtime.model import cuda_matmul, dequantized, layers
from mlxc.runtime.model.config import ConfigError, context_length, lookup, recording_reads
from mlxc.runtime.model.weights import packed_settings

INDEX_FILE = "model.safetensors.index.json"
_MAX_LISTED = 10  # tensor names listed per kind of mismatch; the rest are counted


class CheckpointError(Exception):
    """A checkpoint directory that cannot be loaded (missing files, bad config, weight mismatch)."""


# --- registry -------------------------------------------------------------------------------


def model_types() -> dict[str, str]:
    """The built-in registry: HF ``model_type`` -> importable module name (tests patch this)."""
    try:
        from mlxc.generated.registry import MODEL_TYPES
    except ImportError:
        return {}
    return {mt: f"mlxc.generated.{name}" for mt, name in MODEL_TYPES.items()}


Specs = str | Path | None  # a directory of your own specs (or one spec file), or None


def registry(specs: Specs = None) -> dict[str, str]:
    """The registry: the built-in one, plus the specs of ``specs`` compiled in memory
    (``mlxc.runtime.checkpoint.user_specs``). A spec there with lint findings, or serving a
    model_type the built-in registry serves (R001), raises ``user_specs.SpecError``."""
    types = model_types()
    if specs is None:
        return types
    from mlxc.runtime.checkpoint.user_specs import compile_specs

    extra = {}
    for compiled in compile_specs([specs], builtin=types):
        extra |= compiled.registry()
    return types | extra


def registry_key(config: dict[str, Any], specs: Specs = None) -> str | None:
    """The registry key of a config: ``model_type``, or ``model_type:text_model_type`` where a
    spec serves only one text backbone of a multimodal wrapper (mistral3 + mistral4)."""
    model_type = config.get("model_type")
    text_config = config.get("text_config")
    if isinstance(text_config, dict) and text_config.get("model_type"):
        key = f"{model_type}:{text_config['model_type']}"
        if key in registry(specs):
            return key
    return model_type


def resolve_module(model_type: str | None, specs: Specs = None) -> ModuleType:
    """The generated module serving ``model_type`` (``specs``: see :func:`registry`);
    CheckpointError listing the supported ones."""
    types = registry(specs)
    if model_type not in types:
        supported = ", ".join(sorted(types)) or "none (run `mlxc build specs/` first)"
        what = "no model_type" if model_type is None else f"unsupported model_type {model_type!r}"
        raise CheckpointError(f"{what}; supported model types: {supported}")
    return importlib.import_module(types[model_type])


# --- config and weight files ----------------------------------------------------------------


def read_config(path: str | Path) -> dict[str, Any]:
    """``config.json`` of a checkpoint directory as a dict."""
    path = Path(path)
    if not path.is_dir():
        what = "is not a directory" if path.exists() else "does not exist"
        raise CheckpointError(f"checkpoint directory {path} {what}")
    config_file = path / "config.json"
    if not config_file.is_file():
        raise CheckpointError(
            f"{path} is not a checkpoint: no config.json (point --model at an HF model directory)"
        )
    try:
        config = json.loads(config_file.read_text())
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
        raise CheckpointError(f"cannot read {config_file}: {e}; re-download the checkpoint") from e
    if not isinstance(config, dict):
        raise CheckpointError(
            f"{config_file} must hold a JSON object, found {type(config).__name__}"
        )
    return config


def weight_files(path: Path) -> list[Path]:
    """The safetensors files to load: the shards an index names, else the ``*.safetensors``."""
    index_file = path / INDEX_FILE
    if index_file.is_file():
        try:
            names = set(json.loads(index_file.read_text())["weight_map"].values())
        except (
            OSError,
            UnicodeDecodeError,
            json.JSONDecodeError,
            KeyError,
            TypeError,
            AttributeError,
        ) as e:
            raise CheckpointError(f"cannot read the shard index {index_file}: {e!r}") from e
        for name in names:
            _check_shard_name(name, index_file)
        shards = sorted(names)
        missing = [s for s in shards if not (path / s).is_file()]
        if missing:
            raise CheckpointError(
                f"{index_file.name} names shard(s) missing from {path}: {', '.join(missing)}; "
                "the download is incomplete, fetch the missing files"
            )
        return [path / s for s in shards]
    # No index: mlx-lm's `model*.safetensors` convention, else any safetensors file.
    files = sorted(path.glob("model*.safetensors")) or sorted(path.glob("*.safetensors"))
    if not files:
        raise CheckpointError(f"no *.safetensors weight files in {path}")
    return files


def _check_shard_name(name: Any, index_file: Path) -> None:
    """Refuse a shard the index places outside the checkpoint directory.

    Checked on the name, not by resolving links: the Hugging Face cache links every file of a
    snapshot to a blob outside it, which is fine; an absolute name or a ``..`` is not.
    """
    if not isinstance(name, str) or not name or "\0" in name:
        raise CheckpointError(f"{index_file} names a shard {name!r} that is not a file name")
    if PurePath(name).is_absolute() or ".." in PurePath(name).parts:
        raise CheckpointError(
            f"{index_file} names shard {name!r}, outside {index_file.parent}: refusing to read "
            "it (shard names are relative to the checkpoint directory)"
        )


def _read_weights(files: list[Path]) -> tuple[dict[str, mx.array], dict[str, str]]:
    """All tensors of ``files`` (lazily: data is read at eval), and tensor name -> file name."""
    weights: dict[str, mx.array] = {}
    source: dict[str, str] = {}
    for f in files:
        try:
            tensors = mx.load(str(f))
        except Exception as e:  # mx.load raises RuntimeError/ValueError with a reason
            raise CheckpointError(
                f"cannot read weight file {f}: {e}; corrupt or truncated, re-download it"
            ) from e
        if not isinstance(tensors, dict):
            raise CheckpointError(f"{f} is not a safetensors file")
        clash = sorted(set(tensors) & set(weights))
        if clash:
            raise CheckpointError(
                f"tensor(s) stored twice, in {source[clash[0]]} and {f.name}: "
                f"{_names(clash)}; remove the stray weight file"
            )
        weights.update(tensors)
        source.update(dict.fromkeys(tensors, f.name))
    return weights, source


# --- config.json against the checkpoint ----------------------------------------------------

# transformers' names for the length of a layer stack (text decoder, vision tower).
_LAYER_COUNT_KEYS = ("num_hidden_layers", "num_layers", "n_layers", "n_layer", "depth")
_LAYER_INDEX = re.compile(r"(?:^|\.)(?:layers|blocks|h)\.(\d+)\.")


def _config_items(node: dict, prefix: str = "") -> list[tuple[str, Any]]:
    """Every ``(dotted key, value)`` of config.json, nested objects included."""
    items = []
    for key, value in node.items():
        items.append((prefix + key, value))
        if isinstance(value, dict):
            items += _config_items(value, f"{prefix}{key}.")
    return items


def _check_layer_counts(config: dict, names: list[str], config_file: Path) -> None:
    """Refuse a layer count below 1 or beyond the checkpoint's deepest stack, before the model
    is built: building 1e5 layers takes a minute and gigabytes before a name check could fail.
    (Fewer layers than the stack is no error: DeepSeek-style checkpoints store an MTP layer.)"""
    indices = [int(m.group(1)) for n in names if (m := _LAYER_INDEX.search(n))]
    depth = max(indices) + 1 if indices else len(names)
    what = f"{depth} layers (indices 0-{depth - 1})" if indices else f"{depth} tensors"
    for key, value in _config_items(config):
        counts = key.rsplit(".", 1)[-1] in _LAYER_COUNT_KEYS
        if not counts or not isinstance(value, (int, float)) or isinstance(value, bool):
            continue
        if 1 <= value <= depth:
            continue
        shown = f"{value:g}" if isinstance(value, float) else value
        raise CheckpointError(
            f"{config_file}: '{key}' is {shown}, but the checkpoint's weights hold {what}: "
            "fix config.json or fetch the weights that belong to it"
        )


def _entries(reads: dict[str, Any], keep) -> str:
    """``'key' = value`` of the numbers the model read from config.json that ``keep`` selects."""
    numbers = {
        k: v for k, v in reads.items() if isinstance(v, (int, float)) and not isinstance(v, bool)
    }
    return ", ".join(f"'{k}' = {v!r}" for k, v in numbers.items() if keep(v))


def _build(module: ModuleType, config: dict, config_file: Path) -> tuple[nn.Module, dict]:
    """The model config.json describes (its arrays are lazy: nothing is allocated yet), and the
    entries it read; any failure is a CheckpointError naming config.json."""
    with recording_reads() as reads:
        try:
            model = module.Model(module.ModelArgs.from_config(config))
        except Exception as e:  # a bad value fails anywhere in from_config or a constructor
            detail = str(e) if isinstance(e, (ValueError, KeyError)) else f"{type(e).__name__}: {e}"
            if not isinstance(e, ConfigError) and (low := _entries(reads, lambda v: v <= 0)):
                detail += f" (entries at zero or below: {low})"
            raise CheckpointError(
                f"{config_file} is not a valid {config.get('model_type')} config: {detail}"
            ) from e
    return model, reads


def _check_heads(model: nn.Module, reads: dict[str, Any], config_file: Path) -> None:
    """Grouped-query attention needs its query heads to be a multiple of its key/value heads;
    the weights can fit while the attention cannot run."""
    for name, module in model.named_modules():
        q, kv = getattr(module, "n_heads", None), getattr(module, "n_kv_heads", None)
        if isinstance(q, int) and isinstance(kv, int) and (kv <= 0 or q % kv):
            named = _entries(reads, lambda v, heads=(q, kv): v in heads)
            raise CheckpointError(
                f"{config_file}: {name} has {q} query heads, not a multiple of its {kv} "
                f"key/value heads ({named})"
            )


# --- strict check ---------------------------------------------------------------------------


def _names(names: list[str]) -> str:
    shown = ", ".join(names[:_MAX_LISTED])
    return shown + (f" ... and {len(names) - _MAX_LISTED} more" if len(names) > _MAX_LISTED else "")


def _check_weights(
    model: nn.Module,
    weights: dict[str, mx.array],
    source: dict[str, str],
    where: str,
    reads: dict[str, Any] | None = None,
    advice: str | None = None,
) -> None:
    """Raise unless ``weights`` has exactly the model's tensors with the model's shapes.

    ``reads``: the config.json entries the model was built from; those that give a size the
    weights do not have are named. ``advice`` ends the message (by default: check config.json).
    """
    expected = dict(tree_flatten(model.parameters()))

    def origin(name: str) -> str:
        # Tensors renamed or built by sanitize have no single file of their own.
        return f" [{source[name]}]" if name in source else ""

    missing = sorted(set(expected) - set(weights))
    unexpected = sorted(set(weights) - set(expected))
    wrong = [
        f"{k}{origin(k)} is {tuple(weights[k].shape)}, model expects {tuple(expected[k].shape)}"
        for k in sorted(set(expected) & set(weights))
        if tuple(weights[k].shape) != tuple(expected[k].shape)
    ]
    problems = []
    if missing:
        problems.append(f"{len(missing)} missing tensor(s): {_names(missing)}")
    if unexpected:
        problems.append(
            f"{len(unexpected)} unexpected tensor(s): {_names([k + origin(k) for k in unexpected])}"
        )
    if wrong:
        problems.append(f"{len(wrong)} tensor(s) with the wrong shape: {_names(wrong)}")
        # (expected, found) sizes; an entry is named where it is the expected size, or a factor
        # of it (heads x head_dim) that the size found does not have.
        sizes = {
            (e, a)
            for k in set(expected) & set(weights)
            for e, a in zip(expected[k].shape, weights[k].shape)
            if e != a
        }

        def gives(v) -> bool:
            return isinstance(v, int) and any(
                v == e or (v > 0 and e % v == 0 and a % v) for e, a in sizes
            )

        if suspects := _entries(reads or {}, gives):
            problems.append(f"config.json entries giving the sizes the weights lack: {suspects}")
    if problems:
        raise CheckpointError(
            f"weights in {where} do not match the model: {'; '.join(problems)}. "
            + (
                advice
                or "Check that config.json belongs to these weights (re-convert or re-download)"
            )
        )


# --- a VL checkpoint without its vision tower ----------------------------------------------

# Every layout's vision tensors name the tower: the hub's ``visual.`` (Qwen), transformers 5's
# ``model.visual.``, and ``vision_tower.`` (pixtral, SigLIP, mlx-vlm's conversions); a text
# decoder's never do.
_VISION_TENSOR = re.compile(r"(^|\.)(visual|vision_tower)\.")


def checkpoint_tower(module: ModuleType, names: Iterable[str]) -> str | None:
    """The ``VISION_TOWER`` of ``module`` for a checkpoint holding the tensors ``names``: None
    for a text model, and for a VL checkpoint saved without its tower (mlx-lm's conversions
    of VL models keep only the text model), which loads and serves as a text model."""
    tower = getattr(module, "VISION_TOWER", None)
    if tower is not None and not any(_VISION_TENSOR.search(n) for n in names):
        return None
    return tower


# --- quantisation and dtype -----------------------------------------------------------------

# Hugging Face MXFP4 checkpoints (gpt-oss: ``quantization_config.quant_method: mxfp4``) store
# their experts as blocks and scales that are MLX's mxfp4 layout (runtime/model/moe.py); their other
# tensors (``modules_to_not_convert``) are float. Only modules with ``.scales`` get quantised.
MXFP4 = {"group_size": 32, "bits": 4, "mode": "mxfp4"}


def quantization(config: dict[str, Any]) -> Any:
    """How the checkpoint's weights are quantised, as ``_quantize`` takes it: mlx's
    ``quantization`` entry, :data:`MXFP4` for a Hugging Face MXFP4 checkpoint, or None."""
    if (quant := config.get("quantization")) is not None:
        return quant
    hf = config.get("quantization_config")
    if isinstance(hf, dict) and hf.get("quant_method") == "mxfp4":
        return dict(MXFP4)
    return None


# Hugging Face quantisation formats whose tensors the loader reads (MXFP4 experts; FP8 block
# scales, dequantised); others (GPTQ, AWQ, bitsandbytes, ...) pack weights under other names.
READ_QUANT_METHODS = ("mxfp4", "fp8")


def _unread_quantization_advice(config: dict[str, Any]) -> str | None:
    """What to do about a Hugging Face quantisation the loader does not read, if config.json
    names one (an MLX checkpoint's ``quantization`` entry is read whatever else it holds)."""
    hf = config.get("quantization_config")
    if config.get("quantization") is not None or not isinstance(hf, dict):
        return None
    method = hf.get("quant_method")
    if method in (None, *READ_QUANT_METHODS):
        return None
    return (
        f"config.json's quantization_config.quant_method is {method!r}, a format mlxc does not "
        "read: load the unquantised checkpoint (`mlxc convert --quantize` makes a 4-bit one) or "
        "one quantised by MLX (mlx-lm, mlx-vlm, mlxc)"
    )


def _quantize(
    model: nn.Module, quant: Any, weights: dict[str, mx.array], config_file: Path
) -> None:
    """Swap in quantised layers where the checkpoint has ``.scales`` (as mlx-lm does)."""
    if not isinstance(quant, dict) or "group_size" not in quant or "bits" not in quant:
        raise CheckpointError(
            f'{config_file}: "quantization" must be an object with "group_size" and "bits", '
            f"found {quant!r}"
        )

    def predicate(path: str, module: nn.Module) -> bool | dict:
        # mlx-lm checkpoints may carry per-layer overrides keyed by the layer path.
        if isinstance(quant.get(path), (bool, dict)):
            return quant[path]
        if not (hasattr(module, "to_quantized") and f"{path}.scales" in weights):
            return False
        return _layer_settings(module, weights[f"{path}.weight"], weights[f"{path}.scales"], quant)

    try:
        nn.quantize(
            model,
            group_size=quant["group_size"],
            bits=quant["bits"],
            mode=quant.get("mode", "affine"),
            class_predicate=predicate,
        )
    except (ValueError, TypeError) as e:
        raise CheckpointError(f"cannot quantise with {config_file} settings {quant!r}: {e}") from e


def _layer_settings(
    module: nn.Module, packed: mx.array, scales: mx.array, quant: dict
) -> bool | dict:
    """True for a layer quantised as ``quant`` says, else its own settings.

    An mlx-lm checkpoint keys its per-layer overrides (a MoE router at 8 bits where the rest
    is 4, experts in mxfp4 where the rest is 8-bit affine) by mlx-lm's module paths, which
    ``sanitize`` may rename (gpt-oss's ``mlp.router`` is mlxc's ``mlp.gate``). The tensors tell
    the settings whatever the name (``weights.packed_settings``)."""
    bits, group_size, mode = packed_settings(packed, scales, module.weight.shape[-1])
    if mode is None:
        raise CheckpointError(
            f"cannot tell the quantisation mode of a layer with uint8 scales, {bits} bits and "
            f"groups of {group_size} (shapes {tuple(packed.shape)}, {tuple(scales.shape)})"
        )
    if (bits, group_size, mode) == (
        quant["bits"],
        quant["group_size"],
        quant.get("mode", "affine"),
    ):
        return True
    return {"bits": bits, "group_size": group_size, "mode": mode}


def _target_dtype(dtype: mx.Dtype | str | None) -> mx.Dtype | None:
    """The floating dtype to cast to, or None to keep each checkpoint dtype."""
    if isinstance(dtype, str):
        try:
            dtype = getattr(mx, dtype)
        except AttributeError:
            raise ValueError(f"unknown dtype {dtype!r}") from None
    if dtype is not None:
        if not isinstance(dtype, mx.Dtype) or not mx.issubdtype(dtype, mx.floating):
            raise ValueError(f"dtype must be a floating dtype, got {dtype!r}")
        return dtype
    # Half-precision matmuls are ~20x slower than float32 on the CPU backend.
    return mx.float32 if mx.default_device() == mx.cpu else None


def _cast(
    weights: dict[str, mx.array], dtype: mx.Dtype | None, explicit: bool
) -> dict[str, mx.array]:
    if dtype is None:
        return weights
    halves = (mx.float16, mx.bfloat16)
    out = {}
    for k, w in weights.items():
        # Quantised (integer) tensors keep their dtype; by default only half floats are widened.
        floating = mx.issubdtype(w.dtype, mx.floating)
        if floating and (explicit or w.dtype in halves) and w.dtype != dtype:
            w = w.astype(dtype)
        out[k] = w
    return out


# --- public API -----------------------------------------------------------------------------


def load_model(
    path: str | Path,
    dtype: mx.Dtype | str | None = None,
    specs: Specs = None,
    group: mx.distributed.Group | None = None,
    fuse: bool = True,
) -> nn.Module:
    """Build the generated model for the checkpoint at ``path`` and load its weights.

    ``dtype``: None keeps each tensor's checkpoint dtype, except that on a CPU device float16
    and bfloat16 weights become float32; a floating dtype (``mx.float16`` or ``"float16"``)
    casts every floating weight to it. ``specs``: a directory of your own specs, compiled in
    memory next to the built-in ones (:func:`registry`; ``user_specs.SpecError`` on lint
    findings). ``group``: a distributed group of more than one rank: the model is sharded over
    it (tensor parallelism, the generated ``Model.shard``) before any weight is read, so each
    rank keeps only its share. ``fuse``: once loaded, projections of one input become one
    matmul (``runtime.model.layers.fuse``: q/k/v, gate/up); off, the model holds the
    checkpoint's own layout (``mlxc convert`` writes that). Raises :class:`CheckpointError` on
    any problem with the checkpoint.
    """
    path = Path(path)
    blas.log_status()  # once per process: which CPU BLAS MLX uses, or how to get a fast one
    target = _target_dtype(dtype)
    config = read_config(path)
    try:
        module = resolve_module(registry_key(config, specs), specs)
    except CheckpointError as e:
        raise CheckpointError(f"{path / 'config.json'}: {e}") from e

    # The weights are read lazily: here only their headers (names and shapes).
    files = weight_files(path)
    weights, source = _read_weights(files)
    has_tower = getattr(module, "VISION_TOWER", None) is not None
    text_only = has_tower and checkpoint_tower(module, weights) is None  # a VL model's text half
    if text_only:  # built without vision_config, the templates build no tower or projector
        config = {k: v for k, v in config.items() if k != "vision_config"}
    _check_layer_counts(config, list(weights), path / "config.json")
    model, reads = _build(module, config, path / "config.json")
    if text_only:
        model.vision_tower = None  # reported on the instance: images refused as for a text model
    _check_heads(model, reads, path / "config.json")

    try:
        block = tuple((config.get("quantization_config") or {}).get("weight_block_size", fp8.BLOCK))
        weights = fp8.dequantize(weights, block, dtype=target or mx.bfloat16)
        weights = model.sanitize(weights)
    except Exception as e:  # KeyError, ValueError, or an MLX error from a reshape
        raise CheckpointError(
            f"the weights in {path} do not fit the {module.__name__} weight rules: {e!r}"
        ) from e

    if (quant := quantization(config)) is not None:
        _quantize(model, quant, weights, path / "config.json")

    where = files[0] if len(files) == 1 else path
    _check_weights(model, weights, source, str(where), reads, _unread_quantization_advice(config))

    weights = _cast(weights, target, explicit=dtype is not None)
    if group is not None and group.size() > 1:
        model.load_weights(list(weights.items()), strict=True)  # lazy: nothing read yet
        del weights  # the whole tensors live on only in the graphs of their slices
        model = _shard_and_read(model, group, files, path / "config.json")
        return _finish(model, fuse)
    try:
        # Read every tensor before the model sees any (loads are lazy: a read can fail here).
        mx.eval(list(weights.values()))
    except Exception as e:
        del weights
        raise CheckpointError(f"cannot read the weights: {_find_unreadable(files, e)}") from e

    model.load_weights(list(weights.items()), strict=True)
    del weights
    model.eval()
    mx.eval(model.parameters())
    return _finish(model, fuse)


def _finish(model: nn.Module, fuse: bool) -> nn.Module:
    """A loaded model as it runs: projections of one input fused (``fuse``), on CUDA its dense
    projections' products of a few rows through mlxc's kernel (``cuda_matmul.route``), on the
    CPU its quantised products through a float copy or over its cores (``dequantized.route``)."""
    return dequantized.route(cuda_matmul.route(layers.fuse(model) if fuse else model))


def _shard_and_read(
    model: nn.Module, group: mx.distributed.Group, files: list[Path], config_file: Path
) -> nn.Module:
    """Shard ``model``, whose weights are still lazy, over ``group``, then read them: each rank
    keeps only its slices, each whole tensor dropped as soon as it is cut."""
    from mlxc.runtime.model.parallel import ShardError

    try:
        model.shard(group)
    except ShardError as e:
        raise CheckpointError(f"{config_file}: {e}") from e
    model.eval()
    try:
        # One tensor at a time: one eval of them all would read every whole tensor before
        # cutting any (a peak above the unsharded model's); so the peak is this rank's share
        # plus the largest tensor.
        for _, p in tree_flatten(model.parameters()):
            mx.eval(p)
    except Exception as e:
        raise CheckpointError(f"cannot read the weights: {_find_unreadable(files, e)}") from e
    return model


def _find_unreadable(files: list[Path], error: Exception) -> str:
    """Name the file whose data cannot be read (only runs on the error path)."""
    for f in files:
        try:
            mx.eval(list(mx.load(str(f)).values()))
        except (RuntimeError, ValueError, OSError) as e:
            return f"{f}: {e}; the file is corrupt or truncated, re-download it"
    return f"{error} (files: {', '.join(f.name for f in files)})"


def load(
    path: str | Path,
    dtype: mx.Dtype | str | None = None,
    specs: Specs = None,
    group: mx.distributed.Group | None = None,
) -> tuple[nn.Module, Any]:
    """``(model, tokenizer)``; the tokenizer is None when the directory has no tokenizer files.
    ``dtype``, ``specs`` and ``group`` as in :func:`load_model`."""
    from mlxc.runtime.checkpoint.tokenizer import load_tokenizer

    model = load_model(path, dtype=dtype, specs=specs, group=group)
    return model, load_tokenizer(path)


# --- a checkpoint up to its weights ---------------------------------------------------------


class ProcessorFilesError(ValueError):
    """The processor files of a VL checkpoint do not fit it (``load_processor``'s ValueError)."""


@dataclass
class Checkpoint:
    """What ``mlxc generate`` and the server read of a checkpoint before its weights: config,
    generated module, tokenizer, processor (None for a text model) and the numbers they take
    from them. The model itself loads apart, through :meth:`load_model`: the server builds it
    on its scheduler thread (MLX streams are per thread), generate only once the prompt fits."""

    path: Path
    config: dict[str, Any]
    module: ModuleType
    tokenizer: Any
    processor: Any  # built on prompt_tokenizer
    prompt_tokenizer: Any  # the tokenizer itself, or the copy asked for (prompt workers)
    eos_token_ids: set[int]
    context_length: int | None
    vocab_size: int | None
    # The module's VISION_TOWER; None: a text model, or a VL checkpoint without its tower.
    vision_tower: str | None
    specs: Specs = None

    def load_model(
        self, dtype: mx.Dtype | str | None = None, group: mx.distributed.Group | None = None
    ) -> nn.Module:
        """The model with its weights, sharded over ``group`` if given (:func:`load_model`)."""
        return load_model(self.path, dtype=dtype, specs=self.specs, group=group)


def _config_int(config: dict[str, Any], key: str) -> int | None:
    for prefix in ("", "text_config."):
        value = lookup(config, prefix + key, None)
        if isinstance(value, int) and not isinstance(value, bool):
            return value
    return None


def load_checkpoint(
    path: str | Path,
    *,
    specs: Specs = None,
    chat_template: str | None = None,
    tokenizer_hint: str = "copy the tokenizer files of the model there",
    copy_tokenizer: bool = False,
    before_tokenizer: Callable[[dict[str, Any], str | None], None] | None = None,
) -> Checkpoint:
    """Read the checkpoint at ``path`` up to its weights: config.json, the generated module
    (``specs`` as in :func:`load_model`), then ``before_tokenizer(config, vision_tower)`` if
    given (checks to fail before any slow load; the tower as :func:`checkpoint_tower` says), the
    tokenizer (``tokenizer_hint`` ends the "no tokenizer" error), and a VL model's processor
    (``chat_template`` as in ``load_processor``).
    ``copy_tokenizer``: the processor and ``prompt_tokenizer`` get a deep copy of the tokenizer
    (the server encodes prompts in worker threads). Raises CheckpointError, and
    :class:`ProcessorFilesError` (a ValueError) when the processor files do not fit."""
    from mlxc.runtime.checkpoint.tokenizer import eos_token_ids, load_tokenizer

    path = Path(path)
    config = read_config(path)  # "not a checkpoint" before anything else
    module = resolve_module(registry_key(config, specs), specs)
    tower = getattr(module, "VISION_TOWER", None)
    if tower is not None:  # the tensor names only: no weight data is read
        files = weight_files(path)
        tower = checkpoint_tower(module, _read_weights(files)[0])
    if before_tokenizer is not None:
        before_tokenizer(config, tower)
    tokenizer = load_tokenizer(path)
    if tokenizer is None:
        raise CheckpointError(
            f"no tokenizer in {path} (tokenizer.json, tokenizer_config.json or "
            f"tokenizer.model): {tokenizer_hint}"
        )
    prompt_tokenizer = copy.deepcopy(tokenizer) if copy_tokenizer else tokenizer
    processor = None
    # A VL model renders every prompt, with images or without, through its processor.
    if tower is not None:
        from mlxc.runtime.checkpoint.processor import load_processor

        try:
            processor = load_processor(path, prompt_tokenizer, tower, chat_template=chat_template)
        except ValueError as e:
            raise ProcessorFilesError(str(e)) from e
    return Checkpoint(
        path=path,
        config=config,
        module=module,
        tokenizer=tokenizer,
        processor=processor,
        prompt_tokenizer=prompt_tokenizer,
        eos_token_ids=eos_token_ids(tokenizer, path),
        context_length=context_length(config),
        vocab_size=_config_int(config, "vocab_size"),
        vision_tower=tower,
        specs=specs,
    )
