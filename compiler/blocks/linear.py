"""One hidden->hidden linear in place of a sublayer (``kind: linear``, nemotron_nas)."""

from __future__ import annotations

from typing import Any, Literal

from pydantic import Field

from mlxc.compiler.blocks.base import BlockKind
from mlxc.compiler.schema_base import Block, BoolExpr


class LinearAttention(Block):
    """Attention replaced by one hidden->hidden linear (nemotron_nas); consumes no inputs."""

    kind: Literal["linear"]
    bias: BoolExpr = False
    inputs: dict[str, Any] = Field(default_factory=dict)


class LinearMLP(Block):
    kind: Literal["linear"]
    bias: BoolExpr = False


class LinearAttentionKind(BlockKind):
    part = "attention"
    schema = LinearAttention
    doc = "one hidden->hidden linear in place of attention; no KV cache"

    def ctor(self, b: LinearAttention, gen) -> str:
        return f"layers.LinearAttention({gen.py(gen.spec.text.embed.dim)}, bias={gen.py(b.bias)})"

    def runtime_imports(self, b) -> dict[str, set[str]]:
        return {"mlxc.runtime.model": {"layers"}}


class LinearMLPKind(BlockKind):
    part = "mlp"
    schema = LinearMLP
    doc = "one hidden->hidden linear in place of the MLP"

    def ctor(self, b: LinearMLP, gen) -> str:
        return f"layers.LinearMLP({gen.py(gen.spec.text.embed.dim)}, bias={gen.py(b.bias)})"

    def runtime_imports(self, b) -> dict[str, set[str]]:
        return {"mlxc.runtime.model": {"layers"}}


ATTENTION = LinearAttentionKind()
MLP = LinearMLPKind()
