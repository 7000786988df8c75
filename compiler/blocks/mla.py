"""Multi-head latent attention (``kind: mla``, DeepSeek-V2 style)."""

from __future__ import annotations

import dataclasses
from typing import Any, Literal

from pydantic import Field

from mlxc.compiler.blocks import attention_inputs as inp
from mlxc.compiler.blocks.base import FULL_KV, BlockKind, Sharding
from mlxc.compiler.labels import route
from mlxc.compiler.schema_base import Block, BoolExpr, FloatExpr, IntExpr, RopeRef


class MLA(Block):
    """Multi-head latent attention (DeepSeek-V2 style). The cache keeps the compressed latent
    and the shared RoPE key, not per-head K/V; queries are absorbed into the latent space."""

    kind: Literal["mla"]
    heads: IntExpr
    q_lora_rank: IntExpr | None = None  # an expression may evaluate to None: no q LoRA
    kv_lora_rank: IntExpr
    qk_nope_head_dim: IntExpr
    qk_rope_head_dim: IntExpr
    v_head_dim: IntExpr
    bias: BoolExpr = False  # on q_a_proj, kv_a_proj_with_mqa and o_proj
    rope: RopeRef
    scale: Literal["default", "llama4"] = "default"
    norm_eps: FloatExpr = 1e-6  # q_a_layernorm / kv_a_layernorm (fixed in transformers)
    inputs: dict[str, Any] = Field(default_factory=dict)


_WINDOW = dataclasses.replace(inp.WINDOW, when="`sliding_window`, not an mla field (S001)")


class MLAKind(BlockKind):
    part = "attention"
    schema = MLA
    doc = "multi-head latent attention: the cache holds the compressed latent, queries absorbed"
    # `rope` is required, so positions always. As for gqa, lint also asks for a rope_deltas
    # label under `rope.mrope` (which this template ignores) and a window label under
    # `sliding_window` (not a field here: S001 too), as it always has.
    inputs = (inp.POSITIONS, inp.ROPE_DELTAS, inp.ATTN_SCALE, inp.MASK, _WINDOW)
    template = "attention_mla.py.j2"
    class_name = "LatentAttention"
    cache = FULL_KV
    sharding = Sharding(
        doc="heads split over the ranks: the per-head projections (q_proj or q_b_proj, both "
        "halves of kv_b_proj) by output, o_proj by input; the latent and the shared rope key "
        "are computed whole on every rank",
        by_output=("q_proj", "q_b_proj", "kv_b_proj"),
        by_input=("o_proj",),
        heads=(("n_heads", "heads"),),
    )

    def context(self, b: MLA, gen) -> dict:
        values = [
            b.heads, b.q_lora_rank, b.kv_lora_rank, b.qk_nope_head_dim, b.qk_rope_head_dim,
            b.v_head_dim, b.bias, b.norm_eps, b.rope.traditional,
        ]  # fmt: skip
        return {
            "dim": gen.py(gen.spec.text.embed.dim),
            "mask": route(b, "mask"),
            "positions": route(b, "positions"),
            "attn_scale": route(b, "attn_scale") if b.scale == "llama4" else None,
            **gen.layer_dependence(*values),
            "heads": gen.py(b.heads),
            "q_lora_rank": gen.py(b.q_lora_rank),
            "kv_lora_rank": gen.py(b.kv_lora_rank),
            "qk_nope_head_dim": gen.py(b.qk_nope_head_dim),
            "qk_rope_head_dim": gen.py(b.qk_rope_head_dim),
            "v_head_dim": gen.py(b.v_head_dim),
            "bias": gen.py(b.bias),
            "norm_eps": gen.py(b.norm_eps),
            "rope": {"param": b.rope.param, "traditional": gen.py(b.rope.traditional)},
        }

    def model_context(self, b: MLA, gen) -> dict:
        # sanitize() joins mlx-lm's split kv_b_proj (embed_q / unembed_out) back together.
        return {
            "mla": {
                "nope": gen.py(b.qk_nope_head_dim, args="self.args", layer=False),
                "kv_lora_rank": gen.py(b.kv_lora_rank, args="self.args", layer=False),
            }
        }

    def runtime_imports(self, b: MLA) -> dict[str, set[str]]:
        return {
            # yarn: the mla softmax and llama4 scales; latent: mlx-lm's split kv_b_proj
            "mlxc.runtime.model": {"latent", "masks", "yarn"},
            "mlxc.runtime.model.cache": {"KVCache", "dense"},
            "mlxc.runtime.model.layers": {"attend"},
            "mlxc.runtime.model.rope": {"make_rope"},
        }


KIND = MLAKind()
