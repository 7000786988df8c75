"""Checkpoint tensor-name mapping from a spec's ``weights:`` rules (generated code builds one)."""

from __future__ import annotations

import re
from dataclasses import dataclass

import mlx.core as mx


@dataclass(frozen=True)
class WeightRules:
    rename: tuple[tuple[str, str], ...] = ()  # (regex, replacement), applied in order
    drop: tuple[str, ...] = ()  # regexes of tensors the model does not use

    def apply(self, weights: dict[str, mx.array], tied_lm_head: bool) -> dict[str, mx.array]:
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
