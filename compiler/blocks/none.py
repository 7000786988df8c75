"""No sublayer at all (``kind: none``): the layer skips it and its norm."""

from __future__ import annotations

from typing import Any, Literal

from pydantic import Field

from mlxc.compiler.blocks.base import BlockKind
from mlxc.compiler.schema_base import Block


class NoAttention(Block):
    kind: Literal["none"]
    inputs: dict[str, Any] = Field(default_factory=dict)


class NoMLP(Block):
    kind: Literal["none"]


class NoAttentionKind(BlockKind):
    part = "attention"
    schema = NoAttention
    doc = "no attention sublayer; no KV cache"

    def ctor(self, b, gen) -> None:
        return None


class NoMLPKind(BlockKind):
    part = "mlp"
    schema = NoMLP
    doc = "no MLP sublayer"

    def ctor(self, b, gen) -> None:
        return None


ATTENTION = NoAttentionKind()
MLP = NoMLPKind()
