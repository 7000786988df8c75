"""Grouped-query attention (``kind: gqa``): RoPE or MRoPE, optional q/k norm and biases."""

from __future__ import annotations

import dataclasses
from typing import Any, Literal

from pydantic import Field

from mlxc.compiler.blocks import attention_inputs as inp
from mlxc.compiler.blocks.base import FULL_KV, WINDOWED_KV, BlockKind, NotCompiled, Sharding
from mlxc.compiler.labels import route
from mlxc.compiler.schema_base import Block, BoolExpr, FloatExpr, IntExpr, Norm, RopeRef, Strict
from mlxc.compiler.vision import TOWERS


class Bias(Strict):
    qkv: BoolExpr = False
    o: BoolExpr = False


class GQA(Block):
    kind: Literal["gqa"]
    heads: IntExpr
    kv_heads: IntExpr
    head_dim: IntExpr
    bias: Bias = Bias()
    qk_norm: Norm | None = None  # per-head RMSNorm of q and k before RoPE (qwen3)
    rope: RopeRef | None = None
    scale: Literal["default", "llama4"] = "default"
    scaling: FloatExpr | None = None  # the scores' scale; default head_dim ** -0.5
    # Keys this layer attends to, counting its own (a config's sliding_window may be null:
    # full attention then). Its cache keeps only those (cache kind windowed-kv).
    sliding_window: IntExpr | None = None
    sinks: BoolExpr = False  # learned per-head sink logits (gpt-oss)
    inputs: dict[str, Any] = Field(default_factory=dict)


class GQAKind(BlockKind):
    part = "attention"
    schema = GQA
    doc = (
        "grouped-query attention: RoPE (yarn too) or MRoPE, optional q/k norm and biases, "
        "sliding window, sinks, Llama-4 query scale"
    )
    # In the order lint lists the known inputs (L005).
    inputs = (inp.ROPE_POSITIONS, inp.ROPE_DELTAS, inp.ATTN_SCALE, inp.MASK, inp.WINDOW)
    template = "attention_gqa.py.j2"
    class_name = "Attention"
    cache = FULL_KV
    sharding = Sharding(
        doc="heads split over the ranks: q by output, k/v by kv head (replicated when fewer "
        "than ranks), o by input",
        by_output=("q_proj",),
        kv=("k_proj", "v_proj"),
        by_input=("o_proj",),
        per_head=("sinks",),
        heads=(("n_heads", "heads"),),
        kv_heads=("n_kv_heads", "kv_heads"),
    )

    def not_compiled(self, b: GQA, spec):
        if b.scale == "llama4" and b.rope is None:
            # its beta and period are read from the rope param
            yield NotCompiled(("scale",), "the llama4 scale needs a rope")
        mrope_tower = spec.vision is not None and TOWERS[spec.vision.tower].mrope
        if b.rope and b.rope.mrope and not mrope_tower:
            yield NotCompiled(("rope", "mrope"), "mrope positions need a qwen vision tower")

    def sharding_of(self, b: GQA):
        return (
            self.sharding
            if b.sinks is not False
            else dataclasses.replace(self.sharding, per_head=())
        )

    def cache_kind(self, b: GQA):
        return FULL_KV if b.sliding_window is None else WINDOWED_KV

    def context(self, b: GQA, gen) -> dict:
        values = [b.heads, b.kv_heads, b.head_dim, b.bias.qkv, b.bias.o]
        values += [b.scaling, b.sliding_window, b.sinks]
        rope = None
        if b.rope is not None:
            values += [b.rope.dims, b.rope.traditional]
            rope = {
                "mrope": b.rope.mrope,
                "param": b.rope.param,
                "dims": "self.head_dim" if b.rope.dims is None else gen.py(b.rope.dims),
                "traditional": gen.py(b.rope.traditional),
            }
        qk_norm = None
        if b.qk_norm is not None:
            values.append(b.qk_norm.eps)
            qk_norm = gen.norm(b.qk_norm, "self.head_dim")
        return {
            "dim": gen.py(gen.spec.text.embed.dim),
            "mask": route(b, "mask"),
            "positions": route(b, "positions") if b.rope is not None else None,
            "attn_scale": route(b, "attn_scale") if b.scale == "llama4" else None,
            **gen.layer_dependence(*values),
            "heads": gen.py(b.heads),
            "kv_heads": gen.py(b.kv_heads),
            "head_dim": gen.py(b.head_dim),
            "qkv_bias": gen.py(b.bias.qkv),
            "o_bias": gen.py(b.bias.o),
            "qk_norm": qk_norm,
            "rope": rope,
            "scaling": gen.py_optional(b.scaling),
            "window": gen.py_optional(b.sliding_window),
            "window_route": route(b, "window") if b.sliding_window is not None else None,
            "sinks": gen.py(b.sinks),
        }

    def runtime_imports(self, b: GQA) -> dict[str, set[str]]:
        imports = {
            "mlxc.runtime.model": {"masks"},
            "mlxc.runtime.model.cache": {"KVCache"},
            "mlxc.runtime.model.layers": {"attend"},
        }
        if b.sliding_window is not None:
            imports["mlxc.runtime.model.cache"].add("attention_cache")
        if b.rope is not None and b.rope.mrope:
            imports["mlxc.runtime.model"].add("mrope")
        elif b.rope is not None:
            imports["mlxc.runtime.model.rope"] = {"make_rope"}
        if b.scale == "llama4":
            imports["mlxc.runtime.model"].add("yarn")  # TextModel's yarn.llama4_attn_scale
        return imports

    def model_context(self, b: GQA, gen) -> dict:
        if b.rope is None or not b.rope.mrope:
            return {}
        # MRoPE: the text model computes the cos/sin tables once per forward, for every layer.
        return {
            "mrope": {
                "interleaved": b.rope.mrope == "interleaved",
                "param": b.rope.param,
                "head_dim": gen.py(b.head_dim, layer=False),
                "positions": route(b, "positions"),
                "rope_deltas": route(b, "rope_deltas"),
            }
        }


KIND = GQAKind()
