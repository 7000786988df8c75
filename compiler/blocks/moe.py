"""Routed gated experts (``kind: moe``), with optional shared experts."""

from __future__ import annotations

import dataclasses
from typing import Literal

from mlxc.compiler.blocks.base import BlockKind, Sharding
from mlxc.compiler.pysource import pyrepr
from mlxc.compiler.schema_base import Block, BoolExpr, FloatExpr, IntExpr


class MoE(Block):
    """Routed gated experts (+ optional shared experts). Checkpoint expert layouts (per-expert,
    fused [E, 2I, H] or [E, H, 2I], MXFP4 blocks, mlx-lm switch_mlp) are converted on load."""

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
    router_bias: BoolExpr = False  # the softmax router's linear has a bias (gpt_oss)
    expert_bias: BoolExpr = False  # every expert's gate, up and down have a bias (gpt_oss)
    # silu: down(silu(gate) * up). clamped_swiglu (gpt_oss): gate clamped from above and up both
    # ways at swiglu_limit, then down((up + 1) * gate * sigmoid(swiglu_alpha * gate)).
    act: Literal["silu", "clamped_swiglu"] = "silu"
    swiglu_alpha: FloatExpr = 1.702
    swiglu_limit: FloatExpr = 7.0
    # How the checkpoint's fused gate_up_proj holds gate and up along its outputs: the first and
    # last halves, or interleaved (gate at even, up at odd outputs: gpt_oss).
    fused_gate_up: Literal["halves", "interleaved"] = "halves"
    # Dense fused tensors: told apart by shape as transformers does, or always [E, in, out]
    # (gpt_oss, whose H == I no shape can tell).
    fused_orientation: Literal["by_shape", "in_out"] = "by_shape"


class MoEKind(BlockKind):
    part = "mlp"
    schema = MoE
    doc = (
        "routed gated experts: softmax (optionally biased) or sigmoid router, group-limited "
        "top-k, shared experts, silu or clamped SwiGLU (gpt_oss), expert biases, MXFP4 "
        "checkpoint experts as MLX mxfp4"
    )
    sharding = Sharding(
        doc="every expert's width split over the ranks (each rank holds a slice of every "
        "expert), shared experts too, the router whole; one all-reduce sums their outputs",
        by_output=(
            "experts.gate_proj", "experts.up_proj",
            "shared_experts.gate_proj", "shared_experts.up_proj",
        ),
        by_input=("experts.down_proj", "shared_experts.down_proj"),
        widths=("expert_hidden", "shared_experts_hidden"),
        reduces=True,
    )  # fmt: skip

    def sharding_of(self, b: MoE) -> Sharding:
        if b.shared_experts_hidden != 0:
            return self.sharding
        routed = [name for name in self.sharding.by_output if not name.startswith("shared_")]
        return dataclasses.replace(
            self.sharding, by_output=tuple(routed), by_input=("experts.down_proj",)
        )

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
        # Printed only when set, so that specs without them generate as before.
        if b.router_bias is not False:
            options.append(f"router_bias={gen.py(b.router_bias)}")
        if b.expert_bias is not False:
            options.append(f"expert_bias={gen.py(b.expert_bias)}")
        if b.act != "silu":
            options.append(f"act={pyrepr(b.act)}")
        if b.act == "clamped_swiglu":
            options.append(f"swiglu_alpha={gen.py(b.swiglu_alpha)}")
            options.append(f"swiglu_limit={gen.py(b.swiglu_limit)}")
        return (
            f"moe.MoE({gen.py(gen.spec.text.embed.dim)}, {gen.py(b.expert_hidden)}, "
            f"{gen.py(b.experts)}, {gen.py(b.top_k)}, {', '.join(options)})"
        )

    def runtime_imports(self, b) -> dict[str, set[str]]:
        return {"mlxc.runtime.model": {"moe"}}

    def model_context(self, b: MoE, gen) -> dict:
        # sanitize() converts the checkpoint's expert tensors to moe.MoE's stacked layout.
        layout = ""  # the defaults are left out, so that specs without them generate as before
        if b.fused_gate_up != "halves":
            layout += f", gate_up={pyrepr(b.fused_gate_up)}"
        if b.fused_orientation != "by_shape":
            layout += f", fused={pyrepr(b.fused_orientation)}"
        return {
            "moe": {
                "hidden": gen.py(b.expert_hidden, args="self.args", layer=False),
                "experts": gen.py(b.experts, args="self.args", layer=False),
                "layout": layout,
            }
        }


KIND = MoEKind()
