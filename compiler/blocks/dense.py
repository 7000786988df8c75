"""Non-gated MLP (``kind: dense``): down(act(up(x))) (nemotron_h's relu2 MLP)."""

from __future__ import annotations

from typing import Literal

from mlxc.compiler.blocks.base import BlockKind, Sharding
from mlxc.compiler.pysource import pyrepr
from mlxc.compiler.schema_base import Block, BoolExpr, IntExpr


class Dense(Block):
    kind: Literal["dense"]
    hidden: IntExpr
    bias: BoolExpr = False
    act: Literal["relu2", "relu", "silu", "gelu", "gelu_approx"] = "relu2"


class DenseKind(BlockKind):
    part = "mlp"
    schema = Dense
    doc = "non-gated MLP, down(act(up(x))): relu2 (squared ReLU), relu, silu, gelu, gelu_approx"
    sharding = Sharding(
        doc="hidden width split over the ranks: up by output, down by input",
        by_output=("up_proj",),
        by_input=("down_proj",),
        widths=("hidden",),
    )

    def ctor(self, b: Dense, gen) -> str:
        dim, hidden, bias = gen.py(gen.spec.text.embed.dim), gen.py(b.hidden), gen.py(b.bias)
        return f"layers.MLP({dim}, {hidden}, bias={bias}, act={pyrepr(b.act)})"

    def runtime_imports(self, b) -> dict[str, set[str]]:
        return {"mlxc.runtime.model": {"layers"}}


KIND = DenseKind()
