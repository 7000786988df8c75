"""Pixtral vision tower and the Mistral-3 multimodal projector (Mistral-Small 3.x / 4).

Mirrors transformers 5 ``PixtralVisionModel`` and ``Mistral3MultiModalProjector``; parameter
names are the checkpoint names below the prefixes (``model.vision_tower.`` /
``model.multi_modal_projector.`` in transformers-5 saves, ``vision_tower.`` /
``multi_modal_projector.`` in hub checkpoints), so a model that holds them as ``vision_tower`` /
``multi_modal_projector`` loads strictly.

Flow (``image_features``): per image, crop the padded pixels to ``image_sizes``, patch conv ->
concatenate all images' patches into one sequence -> ln_pre -> blocks (2-D RoPE over the patch
row/col, attention only within an image) -> hidden state ``vision_feature_layer`` -> projector
(RMSNorm, merge ``spatial_merge_size``^2 neighbouring patches, linear_1 -> act -> linear_2).
Output rows are image 0's merged patches row-major, then image 1's, ...: the order of the
``[IMG]`` tokens in the prompt.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import mlx.core as mx
import numpy as np
from mlx import nn

from mlxc.runtime.model.config import ConfigError, lookup, read
from mlxc.runtime.model.layers import ACTIVATIONS, SwiGLU

# Hugging Face activation names -> runtime.model.layers.ACTIVATIONS keys.
_HF_ACT = {
    "silu": "silu",
    "swish": "silu",
    "gelu": "gelu",  # exact (erf) GELU, as torch's default
    "gelu_pytorch_tanh": "gelu_approx",
    "gelu_new": "gelu_approx",
    "relu": "relu",
}


def _act_name(name: str) -> str:
    if name not in _HF_ACT:
        raise ConfigError(f"unsupported activation {name!r} (known: {sorted(_HF_ACT)})")
    return _HF_ACT[name]


# --- config ---------------------------------------------------------------------------------


@dataclass(frozen=True)
class PixtralVisionArgs:
    hidden_size: int = 1024
    intermediate_size: int = 4096
    num_hidden_layers: int = 24
    num_attention_heads: int = 16
    num_channels: int = 3
    patch_size: int = 16
    rope_theta: float = 10000.0
    hidden_act: str = "gelu"

    @classmethod
    def from_config(cls, vision_config: dict) -> PixtralVisionArgs:
        """From ``config.json["vision_config"]`` (``rope_theta`` or ``rope_parameters``)."""
        c = vision_config
        rope = c.get("rope_parameters") or {}
        return cls(
            hidden_size=read(c, "hidden_size", int, cls.hidden_size),
            intermediate_size=read(c, "intermediate_size", int, cls.intermediate_size),
            num_hidden_layers=read(c, "num_hidden_layers", int, cls.num_hidden_layers),
            num_attention_heads=read(c, "num_attention_heads", int, cls.num_attention_heads),
            num_channels=read(c, "num_channels", int, cls.num_channels),
            patch_size=read(c, "patch_size", int, cls.patch_size),
            rope_theta=float(rope.get("rope_theta", c.get("rope_theta") or cls.rope_theta)),
            hidden_act=read(c, "hidden_act", str, cls.hidden_act),
        )


@dataclass(frozen=True)
class Mistral3ProjectorArgs:
    vision_hidden_size: int
    text_hidden_size: int
    patch_size: int
    spatial_merge_size: int = 2
    projector_hidden_act: str = "gelu"
    multimodal_projector_bias: bool = False
    rms_norm_eps: float = 1e-5  # text_config.rms_norm_eps: transformers uses the text eps here
    vision_feature_layer: int = -1

    @classmethod
    def from_config(cls, config: dict) -> Mistral3ProjectorArgs:
        """From the whole mistral3 ``config.json`` (defaults are Mistral3Config's)."""
        layer = lookup(config, "vision_feature_layer", -1)
        if not isinstance(layer, int) or isinstance(layer, bool):
            # transformers accepts a list, but its projector then fails: the RMSNorm and the patch
            # merger are sized for one layer's width while the concatenated features are wider.
            raise ConfigError(f"vision_feature_layer must be one int, got {layer!r}")
        return cls(
            vision_hidden_size=read(config, "vision_config.hidden_size", int, 1024),
            text_hidden_size=read(config, "text_config.hidden_size", int),
            patch_size=read(config, "vision_config.patch_size", int, 16),
            spatial_merge_size=read(config, "spatial_merge_size", int, 2),
            projector_hidden_act=read(config, "projector_hidden_act", str, "gelu"),
            multimodal_projector_bias=read(config, "multimodal_projector_bias", bool, False),
            rms_norm_eps=read(config, "text_config.rms_norm_eps", float, 1e-6),
            vision_feature_layer=layer,
        )


# --- vision tower ---------------------------------------------------------------------------


def _rotate_half(x: mx.array) -> mx.array:
    half = x.shape[-1] // 2
    return mx.concatenate([-x[..., half:], x[..., :half]], axis=-1)


def axial_rope_tables(
    grids: list[tuple[int, int]], head_dim: int, theta: float
) -> tuple[mx.array, mx.array]:
    """cos, sin ``[sum(h*w), head_dim]`` for the patches of each ``(h, w)`` grid, row-major.

    Frequencies alternate between the two axes: even ones rotate by the patch row, odd ones by
    the patch column. transformers lays them out for ``rotate_half`` as
    ``[row freqs | col freqs | row freqs | col freqs]``, each a quarter of ``head_dim``.
    """
    inv_freq = 1.0 / (theta ** (np.arange(0, head_dim, 2, dtype=np.float32) / head_dim))
    rows, cols = [], []
    for h, w in grids:
        r, c = np.meshgrid(np.arange(h), np.arange(w), indexing="ij")
        rows.append(r.reshape(-1))
        cols.append(c.reshape(-1))
    row = np.concatenate(rows).astype(np.float32)[:, None] * inv_freq[None, 0::2]
    col = np.concatenate(cols).astype(np.float32)[:, None] * inv_freq[None, 1::2]
    angles = np.concatenate([row, col, row, col], axis=-1)
    return mx.array(np.cos(angles)), mx.array(np.sin(angles))


class PixtralAttention(nn.Module):
    def __init__(self, args: PixtralVisionArgs) -> None:
        super().__init__()
        dim = args.hidden_size
        self.n_heads = args.num_attention_heads
        self.head_dim = dim // self.n_heads
        self.scale = self.head_dim**-0.5
        self.q_proj = nn.Linear(dim, dim, bias=False)
        self.k_proj = nn.Linear(dim, dim, bias=False)
        self.v_proj = nn.Linear(dim, dim, bias=False)
        self.o_proj = nn.Linear(dim, dim, bias=False)

    def __call__(self, x: mx.array, cos: mx.array, sin: mx.array, segments: list[int]) -> mx.array:
        L, D = x.shape

        def heads(t: mx.array) -> mx.array:  # [L, D] -> [1, H, L, hd]
            return t.reshape(1, L, self.n_heads, self.head_dim).transpose(0, 2, 1, 3)

        q, k, v = heads(self.q_proj(x)), heads(self.k_proj(x)), heads(self.v_proj(x))
        q = q * cos + _rotate_half(q) * sin
        k = k * cos + _rotate_half(k) * sin
        # Block-diagonal attention (transformers adds a -inf mask outside each image's block):
        # attend per image instead, which needs no [L, L] mask and keeps the mask-free fast path.
        outs, start = [], 0
        for n in segments:
            s = slice(start, start + n)
            outs.append(
                mx.fast.scaled_dot_product_attention(
                    q[:, :, s], k[:, :, s], v[:, :, s], scale=self.scale, mask=None
                )
            )
            start += n
        out = outs[0] if len(outs) == 1 else mx.concatenate(outs, axis=2)
        return self.o_proj(out.transpose(0, 2, 1, 3).reshape(L, D))


class PixtralAttentionLayer(nn.Module):
    def __init__(self, args: PixtralVisionArgs) -> None:
        super().__init__()
        self.attention_norm = nn.RMSNorm(args.hidden_size, eps=1e-5)  # eps fixed in transformers
        self.attention = PixtralAttention(args)
        self.ffn_norm = nn.RMSNorm(args.hidden_size, eps=1e-5)
        self.feed_forward = SwiGLU(
            args.hidden_size, args.intermediate_size, act=_act_name(args.hidden_act)
        )

    def __call__(self, x: mx.array, cos: mx.array, sin: mx.array, segments: list[int]) -> mx.array:
        x = x + self.attention(self.attention_norm(x), cos, sin, segments)
        return x + self.feed_forward(self.ffn_norm(x))


class PixtralTransformer(nn.Module):
    def __init__(self, args: PixtralVisionArgs) -> None:
        super().__init__()
        self.layers = [PixtralAttentionLayer(args) for _ in range(args.num_hidden_layers)]


class PixtralVisionModel(nn.Module):
    """Names: ``patch_conv.weight`` (MLX layout ``[D, P, P, C]``), ``ln_pre.weight``,
    ``transformer.layers.{i}.{attention_norm,ffn_norm}.weight``,
    ``transformer.layers.{i}.attention.{q,k,v,o}_proj.weight``,
    ``transformer.layers.{i}.feed_forward.{gate,up,down}_proj.weight``."""

    def __init__(self, args: PixtralVisionArgs) -> None:
        super().__init__()
        self.args = args
        self.patch_size = args.patch_size
        self.patch_conv = nn.Conv2d(
            args.num_channels, args.hidden_size, args.patch_size, stride=args.patch_size, bias=False
        )
        self.ln_pre = nn.RMSNorm(args.hidden_size, eps=1e-5)
        self.transformer = PixtralTransformer(args)

    def __call__(
        self, pixel_values: mx.array, image_sizes: Any, feature_layer: int = -1
    ) -> tuple[mx.array, list[tuple[int, int]]]:
        """Hidden state ``feature_layer`` of all images' patches, ``[sum(h*w), hidden]``, and the
        ``(h, w)`` patch grid of each image.

        ``pixel_values`` ``[N, C, H, W]`` (channels first, as the image processor pads them);
        ``image_sizes`` ``[N, 2]`` (height, width) in pixels, any array-like. ``feature_layer``
        indexes transformers' ``hidden_states``: 0 is the ln_pre output, i the output of block
        i, -1 the last block (later blocks are not run).
        """
        P = self.patch_size
        n_states = len(self.transformer.layers) + 1
        if not -n_states <= feature_layer < n_states:
            raise ValueError(f"feature_layer {feature_layer} out of range for {n_states} states")
        run = feature_layer % n_states  # number of blocks to run

        dtype = self.patch_conv.weight.dtype
        patches, grids = [], []
        for i, (height, width) in enumerate(_sizes(image_sizes)):
            h, w = height // P, width // P
            # Crop the batch padding first: stride == kernel, so the kept patches are unchanged.
            img = pixel_values[i, :, : h * P, : w * P].astype(dtype).transpose(1, 2, 0)[None]
            patches.append(self.patch_conv(img).reshape(h * w, -1))  # row-major over the grid
            grids.append((h, w))
        x = self.ln_pre(mx.concatenate(patches, axis=0) if len(patches) > 1 else patches[0])

        cos, sin = axial_rope_tables(
            grids, self.args.hidden_size // self.args.num_attention_heads, self.args.rope_theta
        )
        cos, sin = cos.astype(x.dtype), sin.astype(x.dtype)
        segments = [h * w for h, w in grids]
        for layer in self.transformer.layers[:run]:
            x = layer(x, cos, sin, segments)
        return x, grids


# --- projector ------------------------------------------------------------------------------


class Mistral3PatchMerger(nn.Module):
    def __init__(self, args: Mistral3ProjectorArgs) -> None:
        super().__init__()
        self.spatial_merge_size = s = args.spatial_merge_size
        d = args.vision_hidden_size
        self.merging_layer = nn.Linear(d * s * s, d, bias=False)

    def __call__(self, x: mx.array, grids: list[tuple[int, int]]) -> mx.array:
        """``[sum(h*w), d]`` -> ``[sum((h//s)*(w//s)), d]``.

        Like ``torch.nn.functional.unfold(kernel=stride=s)``: an odd last row/column is dropped,
        blocks come row-major, and each block's vector is ordered (channel, row in block,
        column in block).
        """
        s = self.spatial_merge_size
        d = x.shape[-1]
        out, start = [], 0
        for h, w in grids:
            grid = x[start : start + h * w].reshape(h, w, d)
            start += h * w
            hh, ww = h // s, w // s
            grid = grid[: hh * s, : ww * s].reshape(hh, s, ww, s, d)
            out.append(grid.transpose(0, 2, 4, 1, 3).reshape(hh * ww, d * s * s))
        return self.merging_layer(out[0] if len(out) == 1 else mx.concatenate(out, axis=0))


class Mistral3MultiModalProjector(nn.Module):
    """Names: ``norm.weight``, ``patch_merger.merging_layer.weight``,
    ``linear_1.weight``, ``linear_2.weight`` (plus ``.bias`` with ``multimodal_projector_bias``)."""

    def __init__(self, args: Mistral3ProjectorArgs) -> None:
        super().__init__()
        self.norm = nn.RMSNorm(args.vision_hidden_size, eps=args.rms_norm_eps)
        self.patch_merger = Mistral3PatchMerger(args)
        bias = args.multimodal_projector_bias
        self.linear_1 = nn.Linear(args.vision_hidden_size, args.text_hidden_size, bias=bias)
        self.linear_2 = nn.Linear(args.text_hidden_size, args.text_hidden_size, bias=bias)
        self.act = ACTIVATIONS[_act_name(args.projector_hidden_act)]

    def __call__(self, x: mx.array, grids: list[tuple[int, int]]) -> mx.array:
        x = self.patch_merger(self.norm(x), grids)
        return self.linear_2(self.act(self.linear_1(x)))


# --- entry points ---------------------------------------------------------------------------


def _sizes(image_sizes: Any) -> list[tuple[int, int]]:
    sizes = np.asarray(image_sizes).reshape(-1, 2).tolist()
    return [(int(h), int(w)) for h, w in sizes]


def image_features(
    vision_tower: PixtralVisionModel,
    projector: Mistral3MultiModalProjector,
    pixel_values: mx.array,
    image_sizes: Any,
    vision_feature_layer: int = -1,
) -> mx.array:
    """Image embeddings ``[total_image_tokens, text_hidden]`` for ``pixel_values [N, C, H, W]``
    and ``image_sizes [N, 2]``: ``torch.cat(Mistral3Model.get_image_features(...).pooler_output)``.

    Image i contributes ``(h_i // (P*s)) * (w_i // (P*s))`` rows (P patch size, s spatial merge),
    in the order its ``[IMG]`` tokens appear (row by row, ``[IMG_BREAK]``/``[IMG_END]`` excluded).
    """
    pixel_values = (
        mx.array(pixel_values) if not isinstance(pixel_values, mx.array) else pixel_values
    )
    hidden, grids = vision_tower(pixel_values, image_sizes, feature_layer=vision_feature_layer)
    return projector(hidden, grids)


def tokens_per_image(image_sizes: Any, patch_size: int, spatial_merge_size: int) -> list[int]:
    """Number of feature rows (= ``[IMG]`` tokens) of each image."""
    k = patch_size * spatial_merge_size
    return [(h // k) * (w // k) for h, w in _sizes(image_sizes)]


def sanitize(
    weights: dict[str, mx.array], num_channels: int = 3, suffix: str = "patch_conv.weight"
) -> dict[str, mx.array]:
    """Convert PyTorch-layout patch-conv weights to MLX's; every other tensor passes unchanged.

    Any key ending in ``suffix`` (with or without a prefix) is accepted (the SigLIP tower
    passes its ``patch_embedding.weight``). PyTorch
    stores ``[out, in, kh, kw]``; MLX's Conv2d wants channels last, ``[out, kh, kw, in]``
    (mlx-vlm / mlx-community checkpoints already store that). Idempotent: a tensor already in
    MLX layout (last axis == ``num_channels``, square kernel in axes 1-2) is left alone. The
    only ambiguous case, a patch size equal to ``num_channels``, raises.
    """
    out = dict(weights)
    for name, w in weights.items():
        if not name.endswith(suffix):
            continue
        if w.ndim != 4:
            raise ValueError(f"{name}: expected a 4-D conv weight, got shape {tuple(w.shape)}")
        torch_layout = w.shape[1] == num_channels and w.shape[2] == w.shape[3]
        mlx_layout = w.shape[3] == num_channels and w.shape[1] == w.shape[2]
        if torch_layout and mlx_layout:
            raise ValueError(f"{name}: layout of {tuple(w.shape)} is ambiguous")
        if torch_layout:
            out[name] = w.transpose(0, 2, 3, 1)
        elif not mlx_layout:
            raise ValueError(
                f"{name}: {tuple(w.shape)} is not a {num_channels}-channel conv weight"
            )
    return out
