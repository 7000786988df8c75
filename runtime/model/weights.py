"""Checkpoint tensor-name mapping from a spec's ``weights:`` rules (generated code builds one)."""

from __future__ import annotations

import logging
import re
from collections.abc import Callable
from dataclasses import dataclass

import mlx.core as mx

log = logging.getLogger("mlxc.load")
_TEXT_LAYER = re.compile(r"^model\.layers\.(\d+)\.")
_TIED_HEAD = re.compile(r"^lm_head\.(weight|scales|biases)$")


@dataclass(frozen=True)
class WeightRules:
    rename: tuple[tuple[str, str], ...] = ()  # (regex, replacement), applied in order
    drop: tuple[str, ...] = ()  # regexes of tensors the model does not use

    def apply(
        self,
        weights: dict[str, mx.array],
        tied_lm_head: bool,
        drop_layers_from: int | None = None,
        layer_rules: tuple[str, Callable[[int], list[tuple[str, str]]]] | None = None,
    ) -> dict[str, mx.array]:
        """``weights`` renamed, without the dropped tensors. ``drop_layers_from``: decoder layers
        ``model.layers.{i}.*`` with ``i`` at or past it are not the model's (DeepSeek-style
        multi-token-prediction layers stored after the stack): dropped, with one log line.
        ``layer_rules``: (the decoder layers' name prefix, e.g. ``model.layers.``, and the
        renames that hold for layer ``i``), applied after the others to the names under it."""
        if drop_layers_from is not None:
            weights = _drop_layers(weights, drop_layers_from)
        drops = [re.compile(p) for p in self.drop]
        renames = [(re.compile(p), to) for p, to in self.rename]
        out: dict[str, mx.array] = {}
        for name, tensor in weights.items():
            if any(d.search(name) for d in drops):
                continue
            for pattern, to in renames:
                name = pattern.sub(to, name)
            if layer_rules is not None:
                name = _layer_renamed(name, *layer_rules)
            # A tied head is the embedding's; a copy on disk goes, under any layout's name
            # (mlx-vlm writes Gemma 3's as language_model.lm_head, quantised where the rest is).
            if tied_lm_head and _TIED_HEAD.match(name):
                continue
            out[name] = tensor
        return out


# The quantisation modes whose scales are uint8 (exponents), by their one (bits, group size).
_UINT8_SCALE_MODES = {(4, 32): "mxfp4", (4, 16): "nvfp4", (8, 32): "mxfp8"}


def packed_settings(
    packed: mx.array, scales: mx.array, in_dims: int
) -> tuple[int, int, str | None]:
    """(bits, group size, mode) of an MLX-quantised weight of ``in_dims`` inputs, from its
    tensors' shapes and dtypes (nothing is read), as mlx-lm infers them: the packed width gives
    the bits, the scales' count the group size, their dtype the mode (affine keeps float scales;
    each other mode has uint8 scales and one bits-group pair; None where none has this one)."""
    bits, group_size = packed.shape[-1] * 32 // in_dims, in_dims // scales.shape[-1]
    if scales.dtype != mx.uint8:
        return bits, group_size, "affine"
    return bits, group_size, _UINT8_SCALE_MODES.get((bits, group_size))


def _layer_renamed(name: str, prefix: str, rules: Callable[[int], list[tuple[str, str]]]) -> str:
    match = re.match(re.escape(prefix) + r"(\d+)\.", name)
    if match is None:
        return name
    for pattern, to in rules(int(match.group(1))):
        name = re.sub(pattern, to, name)
    return name


def _drop_layers(weights: dict[str, mx.array], first: int) -> dict[str, mx.array]:
    kept, dropped = {}, set()
    for name, tensor in weights.items():
        m = _TEXT_LAYER.match(name)
        if m and int(m[1]) >= first:
            dropped.add(int(m[1]))
        else:
            kept[name] = tensor
    if dropped:
        n = len(weights) - len(kept)
        log.info(
            "dropped %d tensors of layers %s: past the %d decoder layers (multi-token "
            "prediction), unused here",
            n, ", ".join(map(str, sorted(dropped))), first,
        )  # fmt: skip
    return kept
