"""Checkpoint tensor-name mapping from a spec's ``weights:`` rules (generated code builds one)."""

from __future__ import annotations

import logging
import re
from dataclasses import dataclass

import mlx.core as mx

log = logging.getLogger("mlxc.load")
_TEXT_LAYER = re.compile(r"^model\.layers\.(\d+)\.")


@dataclass(frozen=True)
class WeightRules:
    rename: tuple[tuple[str, str], ...] = ()  # (regex, replacement), applied in order
    drop: tuple[str, ...] = ()  # regexes of tensors the model does not use

    def apply(
        self, weights: dict[str, mx.array], tied_lm_head: bool, drop_layers_from: int | None = None
    ) -> dict[str, mx.array]:
        """``weights`` renamed, without the dropped tensors. ``drop_layers_from``: decoder layers
        ``model.layers.{i}.*`` with ``i`` at or past it are not the model's (DeepSeek-style
        multi-token-prediction layers stored after the stack): dropped, with one log line."""
        if drop_layers_from is not None:
            weights = _drop_layers(weights, drop_layers_from)
        drops = [re.compile(p) for p in self.drop]
        if tied_lm_head:
            drops.append(re.compile(r"^lm_head\.weight$"))
        renames = [(re.compile(p), to) for p, to in self.rename]
        out: dict[str, mx.array] = {}
        for name, tensor in weights.items():
            if any(d.search(name) for d in drops):
                continue
            for pattern, to in renames:
                name = pattern.sub(to, name)
            out[name] = tensor
        return out


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
