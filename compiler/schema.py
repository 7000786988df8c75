"""The spec language: a pydantic v2 schema for one architecture per YAML file.

Numbers and flags inside blocks may be literals or *expressions* (strings) over the spec's params,
the per-layer fields and ``layer_idx``; ``compiler/expr.py`` parses and checks them. Attention
blocks label every input they consume with ``monotonic-position`` or ``live-window``; the labels
are checked by ``compiler/lint.py`` (not here) so that their findings carry our own rule codes.
"""

from __future__ import annotations

import keyword
from typing import Annotated, Any, Literal

from pydantic import AfterValidator, BaseModel, ConfigDict, Field

IntExpr = int | str
FloatExpr = float | int | str
BoolExpr = bool | str


def _python_name(name: str) -> str:
    # Param and layer-field names (and the params other fields name) are emitted as names in
    # generated code; anything else there would be code (`__import__("os")...`).
    if not (name.isascii() and name.isidentifier()) or keyword.iskeyword(name):
        raise ValueError(
            f"{name!r} is not a Python name (ASCII letters, digits and _, not starting with a "
            "digit, not a keyword): the generated code uses it as one"
        )
    return name


Name = Annotated[str, AfterValidator(_python_name)]

MONOTONIC = "monotonic-position"
LIVE_WINDOW = "live-window"
LABELS = (MONOTONIC, LIVE_WINDOW)

# Every attention input the vocabulary knows, with the one label that is right for it.
INPUT_LABELS: dict[str, str] = {
    "positions": MONOTONIC,  # RoPE / MRoPE position ids: read cache.offset
    "rope_deltas": MONOTONIC,  # MRoPE decode shift: absolute, carried from prefill
    "attn_scale": MONOTONIC,  # Llama-4 attention temperature: grows with absolute position
    "mask": LIVE_WINDOW,  # causal mask key width: read cache.live_len
    "window": LIVE_WINDOW,  # sliding-window clamp on live keys
}


class Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", populate_by_name=True)


# --- params -------------------------------------------------------------------------------


class Param(Strict):
    """A typed value read from config.json.

    ``from``: a dotted path (default: the param's name), or a list of paths tried in order, for
    keys that moved between config versions (``[text_config.hidden_size, hidden_size]``).
    """

    type: Literal["int", "float", "bool", "str", "list", "dict", "rope", "any"]
    from_: str | list[str] | None = Field(default=None, alias="from")
    # Literal default, or for non-str types a string expression over other params.
    default: Any = None
    doc: str | None = None


class LayerField(Strict):
    """A per-layer value read from one entry of the ``for_each`` list (dotted path)."""

    type: Literal["int", "float", "bool", "str", "any"]
    from_: str = Field(alias="from")
    default: Any = None


# --- blocks --------------------------------------------------------------------------------


class Norm(Strict):
    kind: Literal["rms"] = "rms"
    eps: FloatExpr


class RopeRef(Strict):
    """Which rope param an attention block applies, and how."""

    param: Name  # name of a param of type rope
    traditional: BoolExpr = False  # interleaved pairs (GPT-J style) instead of split halves
    dims: IntExpr | None = None  # rotate only the first `dims` features (default: all)
    mrope: Literal["chunked", "interleaved"] | None = None  # multimodal sections (Qwen VL)


class Bias(Strict):
    qkv: BoolExpr = False
    o: BoolExpr = False


class _Block(Strict):
    when: BoolExpr | None = None  # in a variant list: the condition that picks this variant


class GQA(_Block):
    kind: Literal["gqa"]
    heads: IntExpr
    kv_heads: IntExpr
    head_dim: IntExpr
    bias: Bias = Bias()
    qk_norm: Norm | None = None  # per-head RMSNorm of q and k before RoPE (qwen3)
    rope: RopeRef | None = None
    scale: Literal["default", "llama4"] = "default"
    sliding_window: IntExpr | None = None
    inputs: dict[str, Any] = {}


class MLA(_Block):
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
    inputs: dict[str, Any] = {}


class LinearAttention(_Block):
    """Attention replaced by one hidden->hidden linear (nemotron_nas); consumes no inputs."""

    kind: Literal["linear"]
    bias: BoolExpr = False
    inputs: dict[str, Any] = {}


class NoAttention(_Block):
    kind: Literal["none"]
    inputs: dict[str, Any] = {}


AttentionBlock = Annotated[GQA | MLA | LinearAttention | NoAttention, Field(discriminator="kind")]


class SwiGLU(_Block):
    kind: Literal["swiglu"]
    hidden: IntExpr
    bias: BoolExpr = False
    act: Literal["silu", "gelu", "gelu_approx", "relu"] = "silu"


class LinearMLP(_Block):
    kind: Literal["linear"]
    bias: BoolExpr = False


class NoMLP(_Block):
    kind: Literal["none"]


class MoE(_Block):
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


MLPBlock = Annotated[SwiGLU | LinearMLP | NoMLP | MoE, Field(discriminator="kind")]


class Layers(Strict):
    """The decoder stack: ``repeat`` identical layers, or one layer per entry of ``for_each``."""

    repeat: IntExpr | None = None
    for_each: Name | None = None  # a list param, e.g. nemotron_nas block_configs
    fields: dict[Name, LayerField] = {}
    norm: Norm  # pre-norm of each residual branch
    attention: AttentionBlock | list[AttentionBlock]
    mlp: MLPBlock | list[MLPBlock]
    # DeepStack (qwen3_vl): the tower's extra feature sets are added, one per decoder layer
    # from the first, to that layer's output at the image-token rows.
    deepstack: bool = False


class Embedding(Strict):
    vocab: IntExpr
    dim: IntExpr


class LMHead(Strict):
    tied: BoolExpr = False


class TextModel(Strict):
    embed: Embedding
    layers: Layers
    final_norm: Norm
    lm_head: LMHead = LMHead()


class Vision(Strict):
    """A vision tower from the runtime; it reads its own settings from the whole config.json.

    Its features replace the embeddings of the ``image_token`` placeholders, in prompt order.
    """

    tower: Literal["qwen2_vit", "qwen2_5_vit", "qwen3_vit", "pixtral"]
    image_token: Name  # param holding the image placeholder token id


class Rename(Strict):
    pattern: str  # regular expression over checkpoint tensor names
    to: str


class Weights(Strict):
    rename: list[Rename] = []
    drop: list[str] = []  # regular expressions of tensors the model does not use


class Serves(Strict):
    model_types: list[str] = Field(min_length=1)
    # For wrappers whose text backbone varies (mistral3 + mistral or mistral4): serve only
    # configs whose text_config.model_type is one of these.
    text_model_types: list[str] = []
    architectures: list[str] = []

    def registry_keys(self) -> list[str]:
        if not self.text_model_types:
            return list(self.model_types)
        return [f"{m}:{t}" for m in self.model_types for t in self.text_model_types]


class Spec(Strict):
    name: Name = Field(pattern=r"^[a-z][a-z0-9_]*$")  # the generated module's name
    doc: str
    serves: Serves
    cache: Literal["pooled-kv", "model-owned"] = "pooled-kv"
    params: dict[Name, Param]
    text: TextModel
    vision: Vision | None = None
    weights: Weights = Weights()
    # A tiny config.json that `mlxc verify` instantiates with random weights.
    tiny_config: dict[str, Any]
