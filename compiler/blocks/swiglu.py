"""Gated MLP (``kind: swiglu``): down(act(gate(x)) * up(x))."""

from __future__ import annotations

from typing import Literal

from mlxc.compiler.blocks.base import BlockKind
from mlxc.compiler.pysource import pyrepr
from mlxc.compiler.schema_base import Block, BoolExpr, IntExpr


class SwiGLU(Block):
    kind: Literal["swiglu"]
    hidden: IntExpr
    bias: BoolExpr = False
    act: Literal["silu", "gelu", "gelu_approx", "relu"] = "silu"
    # gate and up as the halves of one input_linear, down as output_linear (granite)
    fused: bool = False


class SwiGLUKind(BlockKind):
    part = "mlp"
    schema = SwiGLU
    doc = "gated MLP: silu, gelu, gelu_approx or relu; gate and up fused in one linear (granite)"

    def ctor(self, b: SwiGLU, gen) -> str:
        dim, hidden, bias = gen.py(gen.spec.text.embed.dim), gen.py(b.hidden), gen.py(b.bias)
        act = "" if b.act == "silu" else f", act={pyrepr(b.act)}"
        cls = "FusedSwiGLU" if b.fused else "SwiGLU"
        return f"layers.{cls}({dim}, {hidden}, bias={bias}{act})"

    def runtime_imports(self, b) -> dict[str, set[str]]:
        return {"mlxc.runtime.model": {"layers"}}


KIND = SwiGLUKind()
