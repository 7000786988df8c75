"""The spec language: a pydantic v2 schema for one architecture per YAML file.

Numbers and flags inside blocks may be literals or *expressions* (strings) over the spec's params,
the per-layer fields and ``layer_idx``; ``compiler/expr.py`` parses and checks them. Each block
kind's schema is in its module under ``blocks/``; ``Layers`` takes the kinds registered there.
Attention blocks label every input they consume with ``monotonic-position`` or ``live-window``;
the labels are checked by ``compiler/lint.py`` (not here) so that their findings carry our own
rule codes.
"""

from __future__ import annotations

import functools
import operator
from typing import Annotated, Any, Literal

from pydantic import Field

from mlxc.compiler import blocks, vision
from mlxc.compiler.schema_base import BoolExpr, FloatExpr, IntExpr, Name, Norm, Strict

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
    # type rope only. layer_type: the entry of a per-layer-type `rope_parameters` to read
    # (transformers 5: {sliding_attention: {...}, full_attention: {...}}); theta_from: where the
    # older form keeps this rope's theta instead of `rope_theta` (gemma3's rope_local_base_freq),
    # and that rope then takes no `rope_scaling` (which belongs to the main rope). A rope's
    # `default` is the theta of a config that names none (a number).
    layer_type: str | None = None
    theta_from: str | None = None

    @property
    def default_expr(self) -> str | None:
        """The default when it is an expression (a string default of a str or any param is
        the string itself)."""
        if isinstance(self.default, str) and self.type not in ("str", "any"):
            return self.default
        return None


class LayerField(Strict):
    """A per-layer value read from one entry of the ``for_each`` list (dotted path)."""

    type: Literal["int", "float", "bool", "str", "any"]
    from_: str = Field(alias="from")
    default: Any = None


# --- blocks --------------------------------------------------------------------------------


class _Kinds:
    """The union of the block kinds registered for one slot, tagged by ``kind``.

    Resolved whenever pydantic builds the schema, so ``rebuild`` picks up a newly registered
    kind.
    """

    def __init__(self, part: str) -> None:
        self.part = part

    def __get_pydantic_core_schema__(self, source, handler):
        models = [kind.schema for kind in blocks.BLOCKS[self.part].values()]
        union = functools.reduce(operator.or_, models)
        return handler.generate_schema(Annotated[union, Field(discriminator="kind")])


AttentionBlock = Annotated[Any, _Kinds("attention")]
MLPBlock = Annotated[Any, _Kinds("mlp")]


class Layers(Strict):
    """The decoder stack: ``repeat`` identical layers, or one layer per entry of ``for_each``."""

    repeat: IntExpr | None = None
    for_each: Name | None = None  # a list param, e.g. nemotron_nas block_configs
    fields: dict[Name, LayerField] = Field(default_factory=dict)
    norm: Norm  # pre-norm of each residual branch
    # Each branch's output is normed too before it joins the residual (Gemma: four norms per
    # layer, named input/post_attention and pre/post_feedforward_layernorm).
    post_norms: bool = False
    # Each branch's output times it before it joins the residual (MiniCPM's muP depth scale:
    # scale_depth / num_hidden_layers ** 0.5); may be null.
    residual_scale: FloatExpr | None = None
    attention: AttentionBlock | list[AttentionBlock]
    mlp: MLPBlock | list[MLPBlock]
    # DeepStack (qwen3_vl): the tower's extra feature sets are added, one per decoder layer
    # from the first, to that layer's output at the image-token rows.
    deepstack: bool = False


class Embedding(Strict):
    vocab: IntExpr
    dim: IntExpr
    scale: FloatExpr | None = None  # embeddings multiplied by it (Gemma: sqrt(hidden_size))


class LMHead(Strict):
    tied: BoolExpr = False
    softcap: FloatExpr | None = None  # logits -> softcap * tanh(logits / softcap); may be null
    # The final hidden states times it before the head (MiniCPM: dim_model_base / hidden_size).
    scale: FloatExpr | None = None


class TextModel(Strict):
    embed: Embedding
    layers: Layers
    final_norm: Norm
    lm_head: LMHead = LMHead()


TowerName = Literal[tuple(vision.TOWERS)]


class Vision(Strict):
    """A vision tower from the runtime; it reads its own settings from the whole config.json.

    Its features replace the embeddings of the ``image_token`` placeholders, in prompt order.
    """

    tower: TowerName
    image_token: Name  # param holding the image placeholder token id


class Rename(Strict):
    pattern: str  # regular expression over checkpoint tensor names
    to: str


class Weights(Strict):
    rename: list[Rename] = Field(default_factory=list)
    # regular expressions of tensors the model does not use
    drop: list[str] = Field(default_factory=list)
    # Text decoder layers `model.layers.{i}.*` with i at or past this are dropped with a log
    # line (DeepSeek's multi-token-prediction layers follow the stack: num_hidden_layers).
    drop_layers_from: IntExpr | None = None


class Serves(Strict):
    model_types: list[str] = Field(min_length=1)
    # For wrappers whose text backbone varies (mistral3 + mistral or mistral4): serve only
    # configs whose text_config.model_type is one of these.
    text_model_types: list[str] = Field(default_factory=list)
    architectures: list[str] = Field(default_factory=list)

    def registry_keys(self) -> list[str]:
        if not self.text_model_types:
            return list(self.model_types)
        return [f"{m}:{t}" for m in self.model_types for t in self.text_model_types]


class Spec(Strict):
    name: Name = Field(pattern=r"^[a-z][a-z0-9_]*$")  # the generated module's name
    doc: str
    serves: Serves
    # None: derived from the layers' cache kinds (codegen); kept so that specs may still say it.
    cache: Literal["pooled-kv", "model-owned"] | None = None
    params: dict[Name, Param]
    text: TextModel
    vision: Vision | None = None
    weights: Weights = Weights()
    # A tiny config.json that `mlxc verify` instantiates with random weights.
    tiny_config: dict[str, Any]


def rebuild() -> None:
    """Rebuild the models that hold block unions, after the registry changed."""
    for model in (Layers, TextModel, Spec):
        model.model_rebuild(force=True)
