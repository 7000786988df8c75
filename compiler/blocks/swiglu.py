"""Gated MLP (``kind: swiglu``): down(act(gate(x)) * up(x))."""

from __future__ import annotations

from typing import Literal

from mlxc.compiler.blocks.base import BlockKind, Sharding
from mlxc.compiler.pysource import pyrepr
from mlxc.compiler.schema_base import Block, BoolExpr, IntExpr


class SwiGLU(Block):
    kind: Literal["swiglu"]
    hidden: IntExpr
    bias: BoolExpr = False
    act: Literal["silu", "gelu", "gelu_approx", "relu"] = "silu"


class SwiGLUKind(BlockKind):
    part = "mlp"
    schema = SwiGLU
    doc = "gated MLP: silu, gelu, gelu_approx or relu"
    sharding = Sharding(
        doc="hidden width split over the ranks: gate and up by output, down by input",
        by_output=("gate_proj", "up_proj"),
        by_input=("down_proj",),
        widths=("hidden",),
    )

    def ctor(self, b: SwiGLU, gen) -> str:
        dim, hidden, bias = gen.py(gen.spec.text.embed.dim), gen.py(b.hidden), gen.py(b.bias)
        act = "" if b.act == "silu" else f", act={pyrepr(b.act)}"
        return f"layers.SwiGLU({dim}, {hidden}, bias={bias}{act})"

    def runtime_imports(self, b) -> dict[str, set[str]]:
        return {"mlxc.runtime.model": {"layers"}}


KIND = SwiGLUKind()
