"""Routed SwiGLU experts (``kind: moe``), with optional shared experts."""

from __future__ import annotations

from typing import Literal

from mlxc.compiler.blocks.base import BlockKind
from mlxc.compiler.pysource import pyrepr
from mlxc.compiler.schema_base import Block, BoolExpr, FloatExpr, IntExpr


class MoE(Block):
    """Routed SwiGLU experts (+ optional shared experts). Checkpoint expert layouts (per-expert,
    fused [E, 2I, H] or [E, H, 2I], mlx-lm switch_mlp) are converted on load."""

    kind: Literal["moe"]
    experts: IntExpr
    top_k: IntExpr
    expert_hidden: IntExpr
    router: Literal["softmax", "sigmoid"] = "softmax"
    norm_topk_prob: BoolExpr = False
    routed_scaling_factor: FloatExpr = 1.0
    n_group: IntExpr = 1  # group-limited routing (DeepSeek / mistral4)
    topk_group: IntExpr = 1
    group_score: Literal["top2", "max"] = "top2"
    shared_experts_hidden: IntExpr = 0  # 0: no shared experts


class MoEKind(BlockKind):
    part = "mlp"
    schema = MoE
    doc = "routed SwiGLU experts: softmax or sigmoid router, group-limited top-k, shared experts"

    def ctor(self, b: MoE, gen) -> str:
        options = [
            f"scoring={pyrepr(b.router)}",
            f"norm_topk_prob={gen.py(b.norm_topk_prob)}",
            f"routed_scaling_factor={gen.py(b.routed_scaling_factor)}",
            f"n_group={gen.py(b.n_group)}",
            f"topk_group={gen.py(b.topk_group)}",
            f"group_score={pyrepr(b.group_score)}",
            f"shared_hidden={gen.py(b.shared_experts_hidden)}",
        ]
        return (
            f"moe.MoE({gen.py(gen.spec.text.embed.dim)}, {gen.py(b.expert_hidden)}, "
            f"{gen.py(b.experts)}, {gen.py(b.top_k)}, {', '.join(options)})"
        )

    def runtime_imports(self, b) -> dict[str, set[str]]:
        return {"mlxc.runtime": {"moe"}}

    def model_context(self, b: MoE, gen) -> dict:
        # sanitize() converts the checkpoint's expert tensors to moe.MoE's stacked layout.
        return {
            "moe": {
                "hidden": gen.py(b.expert_hidden, args="self.args", layer=False),
                "experts": gen.py(b.experts, args="self.args", layer=False),
            }
        }


KIND = MoEKind()
