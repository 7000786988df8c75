"""A Mamba2 token mixer in the attention slot (``kind: mamba2``, nemotron_h).

It reads no attention input: its memory of earlier tokens is the recurrent state in its cache
(cache kind recurrent-state, ``runtime.model.ssm.RecurrentCache``), which every chunk and step
advances and nothing trims.
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import Field

from mlxc.compiler.blocks.base import RECURRENT_STATE, BlockKind
from mlxc.compiler.schema_base import Block, BoolExpr, FloatExpr, IntExpr


class Mamba2(Block):
    kind: Literal["mamba2"]
    heads: IntExpr
    head_dim: IntExpr
    state_size: IntExpr
    n_groups: IntExpr  # B and C are shared by groups of heads
    conv_kernel: IntExpr
    chunk_size: IntExpr  # the SSD scan's chunk in prefill
    # [min, max] clamp of the time step; an expression naming a list param, or null: (0, inf).
    time_step_limit: str | None = None
    norm_eps: FloatExpr  # the gated group RMSNorm
    bias: BoolExpr = False  # in_proj and out_proj
    conv_bias: BoolExpr = True
    inputs: dict[str, Any] = Field(default_factory=dict)


class RecurrentMixerKind(BlockKind):
    """What the state-space mixers (``mamba2``, ``mamba``) share: the attention slot, no
    attention input, a recurrent-state cache, ``runtime.model.ssm`` and torch's conv layout."""

    part = "attention"
    cache = RECURRENT_STATE

    def mixer_context(self, gen, *values) -> dict:
        """The context keys every mixer has; ``values``: the fields its constructor reads."""
        return {
            **gen.layer_dependence(*values),
            # TextModel resolves no input for it (masks and positions come from the others).
            "mask": None,
            "positions": None,
            "attn_scale": None,
            "dim": gen.py(gen.spec.text.embed.dim),
        }

    def runtime_imports(self, b) -> dict[str, set[str]]:
        return {"mlxc.runtime.model": {"ssm"}}

    def model_context(self, b, gen) -> dict:
        return {"conv_weights": True}  # sanitize: torch's depthwise conv1d layout -> MLX's


class Mamba2Kind(RecurrentMixerKind):
    schema = Mamba2
    doc = (
        "Mamba2 mixer (grouped B/C, gated RMSNorm, causal conv1d; chunked SSD scan in prefill, "
        "the recurrence in decode); caches recurrent state, never trimmed"
    )
    template = "mixer_mamba2.py.j2"
    class_name = "Mamba2"

    def context(self, b: Mamba2, gen) -> dict:
        values = [b.heads, b.head_dim, b.state_size, b.n_groups, b.conv_kernel, b.chunk_size]
        values += [b.time_step_limit, b.norm_eps, b.bias, b.conv_bias]
        return {
            **self.mixer_context(gen, *values),
            "heads": gen.py(b.heads),
            "head_dim": gen.py(b.head_dim),
            "state_size": gen.py(b.state_size),
            "n_groups": gen.py(b.n_groups),
            "conv_kernel": gen.py(b.conv_kernel),
            "chunk_size": gen.py(b.chunk_size),
            "time_step_limit": gen.py_optional(b.time_step_limit),
            "norm_eps": gen.py(b.norm_eps),
            "bias": gen.py(b.bias),
            "conv_bias": gen.py(b.conv_bias),
        }


KIND = Mamba2Kind()
