"""A Mamba (v1, selective scan) token mixer in the attention slot (``kind: mamba``, jamba).

Like ``mamba2`` it reads no attention input and caches recurrent state (cache kind
recurrent-state, ``runtime.model.ssm.RecurrentCache``), advanced by every token, never trimmed.
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import Field

from mlxc.compiler.blocks.mamba2 import RecurrentMixerKind
from mlxc.compiler.schema_base import Block, BoolExpr, IntExpr, Norm


class Mamba(Block):
    kind: Literal["mamba"]
    inner: IntExpr  # channels: expand * hidden
    state_size: IntExpr
    conv_kernel: IntExpr
    dt_rank: IntExpr  # the time step's low-rank input
    # RMSNorms of the time step's input and of B and C (Jamba's dt/b/c_layernorm)
    bc_norm: Norm | None = None
    bias: BoolExpr = False  # in_proj and out_proj
    conv_bias: BoolExpr = True
    inputs: dict[str, Any] = Field(default_factory=dict)


class MambaKind(RecurrentMixerKind):
    schema = Mamba
    doc = (
        "Mamba selective-scan mixer (dt_rank, x_proj, dt_proj, causal conv1d, optional dt/B/C "
        "RMSNorms; a parallel scan in prefill, one step in decode); caches recurrent state, "
        "never trimmed"
    )
    template = "mixer_mamba.py.j2"
    class_name = "Mamba"

    def context(self, b: Mamba, gen) -> dict:
        values = [b.inner, b.state_size, b.conv_kernel, b.dt_rank, b.bias, b.conv_bias]
        values += [b.bc_norm.eps] if b.bc_norm is not None else []
        return {
            **self.mixer_context(gen, *values),
            "inner": gen.py(b.inner),
            "state_size": gen.py(b.state_size),
            "conv_kernel": gen.py(b.conv_kernel),
            "dt_rank": gen.py(b.dt_rank),
            "bc_norm_eps": None if b.bc_norm is None else gen.py(b.bc_norm.eps),
            "bias": gen.py(b.bias),
            "conv_bias": gen.py(b.conv_bias),
        }


KIND = MambaKind()
