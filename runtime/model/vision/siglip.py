"""SigLIP vision tower and the Gemma-3 multimodal projector (Gemma3ForConditionalGeneration).

Mirrors transformers 5 ``SiglipVisionModel`` (no pooling head: Gemma 3 reads the last hidden
state) and ``Gemma3MultiModalProjector``. Parameter names are the checkpoint names below the
prefixes, so a model holding these as ``vision_tower`` / ``multi_modal_projector`` loads
strictly once :func:`sanitize` has run:

* hub (transformers-4) checkpoints: ``vision_tower.vision_model.embeddings...``,
  ``multi_modal_projector.mm_input_projection_weight``;
* transformers-5 ``save_pretrained``: ``vision_tower.embeddings...`` (no ``vision_model.``);
* transformers-5 modules: ``model.vision_tower.embeddings...``.

Flow (``image_features``): each image ``[3, S, S]`` (``S = image_size``, the processor resizes
every image to it) -> patch conv + learned position embedding -> pre-norm encoder blocks
(LayerNorm, full attention within the image, LayerNorm, fc1 -> gelu-tanh -> fc2) ->
post_layernorm -> projector: average-pool the ``S/P x S/P`` patch grid down to
``sqrt(mm_tokens_per_image)`` per side, Gemma RMSNorm (scale ``1 + weight``), then
``x @ mm_input_projection_weight``. Output rows: image 0's pooled cells row-major, then image 1's,
...: the order of the ``<image_soft_token>`` tokens in the prompt.
"""

from __future__ import annotations

from dataclasses import dataclass

import mlx.core as mx
from mlx import nn

from mlxc.runtime.model.config import ConfigError, read
from mlxc.runtime.model.layers import ACTIVATIONS
from mlxc.runtime.model.vision import pixtral

# --- config ---------------------------------------------------------------------------------


@dataclass(frozen=True)
class SiglipVisionArgs:
    """``config.json["vision_config"]``; defaults are SiglipVisionConfig's (Gemma 3 hub configs
    override the sizes: 1152 wide, 27 layers, 16 heads, image 896, patch 14)."""

    hidden_size: int = 768
    intermediate_size: int = 3072
    num_hidden_layers: int = 12
    num_attention_heads: int = 12
    num_channels: int = 3
    image_size: int = 224
    patch_size: int = 16
    hidden_act: str = "gelu_pytorch_tanh"
    layer_norm_eps: float = 1e-6

    @property
    def patches_per_side(self) -> int:
        return self.image_size // self.patch_size

    @classmethod
    def from_config(cls, vision_config: dict) -> SiglipVisionArgs:
        c = vision_config
        args = cls(
            hidden_size=read(c, "hidden_size", int, cls.hidden_size),
            intermediate_size=read(c, "intermediate_size", int, cls.intermediate_size),
            num_hidden_layers=read(c, "num_hidden_layers", int, cls.num_hidden_layers),
            num_attention_heads=read(c, "num_attention_heads", int, cls.num_attention_heads),
            num_channels=read(c, "num_channels", int, cls.num_channels),
            image_size=read(c, "image_size", int, cls.image_size),
            patch_size=read(c, "patch_size", int, cls.patch_size),
            hidden_act=read(c, "hidden_act", str, cls.hidden_act),
            layer_norm_eps=read(c, "layer_norm_eps", float, cls.layer_norm_eps),
        )
        if args.hidden_size % args.num_attention_heads:
            raise ConfigError(
                f"vision_config hidden_size {args.hidden_size} is not a multiple of "
                f"num_attention_heads {args.num_attention_heads}"
            )
        return args


@dataclass(frozen=True)
class Gemma3ProjectorArgs:
    vision: SiglipVisionArgs
    text_hidden_size: int
    mm_tokens_per_image: int = 256

    @property
    def tokens_per_side(self) -> int:
        return int(self.mm_tokens_per_image**0.5)

    @property
    def pool(self) -> int:
        return self.vision.patches_per_side // self.tokens_per_side

    @classmethod
    def from_config(cls, config: dict) -> Gemma3ProjectorArgs:
        """From the whole gemma3 ``config.json`` (defaults are Gemma3Config's)."""
        args = cls(
            vision=SiglipVisionArgs.from_config(config.get("vision_config") or {}),
            text_hidden_size=read(config, "text_config.hidden_size", int),
            mm_tokens_per_image=read(config, "mm_tokens_per_image", int, 256),
        )
        side, per_side = args.tokens_per_side, args.vision.patches_per_side
        # transformers' AvgPool2d(kernel = per_side // side) would silently give another count.
        if side * side != args.mm_tokens_per_image or side == 0 or per_side % side:
            raise ConfigError(
                f"mm_tokens_per_image {args.mm_tokens_per_image} must be a square whose side "
                f"divides the {per_side}x{per_side} patch grid (image_size // patch_size)"
            )
        return args


def _act(name: str):
    act = pixtral._act_name(name)  # the Hugging Face -> runtime names, kept in one place
    return ACTIVATIONS[act]


# --- vision tower ---------------------------------------------------------------------------


class SiglipVisionEmbeddings(nn.Module):
    def __init__(self, args: SiglipVisionArgs) -> None:
        super().__init__()
        P, D = args.patch_size, args.hidden_size
        self.patch_embedding = nn.Conv2d(args.num_channels, D, P, stride=P, bias=True)
        self.position_embedding = nn.Embedding(args.patches_per_side**2, D)

    def __call__(self, pixel_values: mx.array) -> mx.array:
        """``[N, C, S, S]`` channels first -> ``[N, (S/P)^2, D]``, patches row-major."""
        x = pixel_values.astype(self.patch_embedding.weight.dtype).transpose(0, 2, 3, 1)
        x = self.patch_embedding(x)
        N, h, w, D = x.shape
        n = self.position_embedding.weight.shape[0]
        if h * w != n:
            # Gemma 3 never interpolates positions: the processor makes every image image_size.
            raise ValueError(
                f"pixel_values give {h}x{w} patches but the tower has {n} positions: "
                "images must be image_size x image_size"
            )
        return x.reshape(N, h * w, D) + self.position_embedding.weight


class SiglipAttention(nn.Module):
    def __init__(self, args: SiglipVisionArgs) -> None:
        super().__init__()
        D = args.hidden_size
        self.n_heads = args.num_attention_heads
        self.scale = (D // self.n_heads) ** -0.5
        self.q_proj = nn.Linear(D, D)
        self.k_proj = nn.Linear(D, D)
        self.v_proj = nn.Linear(D, D)
        self.out_proj = nn.Linear(D, D)

    def __call__(self, x: mx.array) -> mx.array:
        N, L, D = x.shape

        def heads(t: mx.array) -> mx.array:  # [N, L, D] -> [N, H, L, hd]
            return t.reshape(N, L, self.n_heads, -1).transpose(0, 2, 1, 3)

        q, k, v = heads(self.q_proj(x)), heads(self.k_proj(x)), heads(self.v_proj(x))
        out = mx.fast.scaled_dot_product_attention(q, k, v, scale=self.scale, mask=None)
        return self.out_proj(out.transpose(0, 2, 1, 3).reshape(N, L, D))


class SiglipMLP(nn.Module):
    def __init__(self, args: SiglipVisionArgs) -> None:
        super().__init__()
        self.fc1 = nn.Linear(args.hidden_size, args.intermediate_size)
        self.fc2 = nn.Linear(args.intermediate_size, args.hidden_size)
        self.act = _act(args.hidden_act)

    def __call__(self, x: mx.array) -> mx.array:
        return self.fc2(self.act(self.fc1(x)))


class SiglipEncoderLayer(nn.Module):
    def __init__(self, args: SiglipVisionArgs) -> None:
        super().__init__()
        self.layer_norm1 = nn.LayerNorm(args.hidden_size, eps=args.layer_norm_eps)
        self.self_attn = SiglipAttention(args)
        self.layer_norm2 = nn.LayerNorm(args.hidden_size, eps=args.layer_norm_eps)
        self.mlp = SiglipMLP(args)

    def __call__(self, x: mx.array) -> mx.array:
        x = x + self.self_attn(self.layer_norm1(x))
        return x + self.mlp(self.layer_norm2(x))


class SiglipEncoder(nn.Module):
    def __init__(self, args: SiglipVisionArgs) -> None:
        super().__init__()
        self.layers = [SiglipEncoderLayer(args) for _ in range(args.num_hidden_layers)]


class SiglipVisionModel(nn.Module):
    """Names: ``embeddings.patch_embedding.{weight,bias}`` (MLX layout ``[D, P, P, C]``),
    ``embeddings.position_embedding.weight``,
    ``encoder.layers.{i}.{layer_norm1,layer_norm2}.{weight,bias}``,
    ``encoder.layers.{i}.self_attn.{q,k,v,out}_proj.{weight,bias}``,
    ``encoder.layers.{i}.mlp.{fc1,fc2}.{weight,bias}``, ``post_layernorm.{weight,bias}``."""

    def __init__(self, args: SiglipVisionArgs) -> None:
        super().__init__()
        self.args = args
        self.embeddings = SiglipVisionEmbeddings(args)
        self.encoder = SiglipEncoder(args)
        self.post_layernorm = nn.LayerNorm(args.hidden_size, eps=args.layer_norm_eps)

    def __call__(self, pixel_values: mx.array) -> mx.array:
        """``last_hidden_state`` ``[N, (S/P)^2, D]`` of ``pixel_values [N, C, S, S]``."""
        x = self.embeddings(pixel_values)
        for layer in self.encoder.layers:
            x = layer(x)
        return self.post_layernorm(x)


# --- projector ------------------------------------------------------------------------------


class GemmaRMSNorm(nn.Module):
    """Gemma's RMSNorm: the weight is stored as an offset from 1 (scale ``1 + weight``), and
    transformers normalises in float32 before casting back."""

    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.weight = mx.zeros((dim,))
        self.eps = eps

    def __call__(self, x: mx.array) -> mx.array:
        w = 1.0 + self.weight.astype(mx.float32)
        return mx.fast.rms_norm(x.astype(mx.float32), w, self.eps).astype(x.dtype)


class Gemma3MultiModalProjector(nn.Module):
    """Names: ``mm_input_projection_weight`` ``[vision_hidden, text_hidden]`` (used as
    ``x @ W``, not transposed like a Linear) and ``mm_soft_emb_norm.weight``."""

    def __init__(self, args: Gemma3ProjectorArgs) -> None:
        super().__init__()
        self.args = args
        D = args.vision.hidden_size
        self.mm_input_projection_weight = mx.zeros((D, args.text_hidden_size))
        # transformers uses the vision config's layer_norm_eps here.
        self.mm_soft_emb_norm = GemmaRMSNorm(D, eps=args.vision.layer_norm_eps)

    def __call__(self, hidden: mx.array) -> mx.array:
        """``[N, (S/P)^2, D]`` -> ``[N, mm_tokens_per_image, text_hidden]``."""
        N, _, D = hidden.shape
        side, k = self.args.tokens_per_side, self.args.pool
        # AvgPool2d(k, stride=k) over the row-major patch grid; cells come out row-major.
        grid = hidden.reshape(N, side, k, side, k, D)
        pooled = grid.astype(mx.float32).mean(axis=(2, 4)).astype(hidden.dtype)
        x = self.mm_soft_emb_norm(pooled.reshape(N, side * side, D))
        return x @ self.mm_input_projection_weight.astype(x.dtype)


# --- entry points ---------------------------------------------------------------------------


def image_features(
    vision_tower: SiglipVisionModel, projector: Gemma3MultiModalProjector, pixel_values
) -> mx.array:
    """Image embeddings ``[N * mm_tokens_per_image, text_hidden]`` for ``pixel_values
    [N, C, S, S]``: ``Gemma3Model.get_image_features(...).pooler_output`` flattened over the
    images, in the order their ``<image_soft_token>`` runs appear."""
    if not isinstance(pixel_values, mx.array):
        pixel_values = mx.array(pixel_values)
    out = projector(vision_tower(pixel_values))
    return out.reshape(-1, out.shape[-1])


def sanitize(weights: dict[str, mx.array], num_channels: int = 3) -> dict[str, mx.array]:
    """Checkpoint tensors -> this module's names and layouts; other tensors pass unchanged.

    Drops the ``vision_model.`` level of hub names (``...vision_tower.vision_model.X`` ->
    ``...vision_tower.X``, as transformers 5 does when loading), drops the SigLIP pooling head
    (``vision_tower.head.*``: transformers builds it when ``vision_use_head`` is on, Gemma 3
    never runs it) and converts the patch conv to MLX's channels-last layout (idempotent).
    """
    out = {}
    for name, w in weights.items():
        name = name.replace("vision_tower.vision_model.", "vision_tower.", 1)
        if "vision_tower.head." in name:
            continue
        out[name] = w
    return pixtral.sanitize(out, num_channels, suffix="patch_embedding.weight")
