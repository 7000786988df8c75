"""Qwen VL vision towers: qwen2_vl, qwen2_5_vl, qwen3_vl (qwen3_vl_moe reuses qwen3_vl's).

Each mirrors transformers 5's tower (``Qwen2VisionTransformerPretrainedModel``,
``Qwen2_5_VisionTransformerPretrainedModel``, ``Qwen3VLVisionModel``). Parameter names are the
checkpoint names below the tower prefix: ``model.visual.`` in transformers-5 saves and in hub
Qwen3-VL checkpoints, ``visual.`` in hub Qwen2-VL / Qwen2.5-VL checkpoints. Strip the prefix, pass
the tensors through ``tower.sanitize`` and ``tower.load_weights(..., strict=True)`` works.

Input, as the Qwen image processors produce it:
  pixel_values [num_patches, C*T*P*P]  one row per patch, patches of each image in spatial-merge
                                       block order (the 2x2 patches merged into one token are
                                       consecutive), images one after another
  grid_thw     [n_images, 3]           (t, h, w) in patches per image (t = frames / T)
Output: merged features [sum(t*h*w) / merge**2, out_hidden], one row per image token in prompt
order (qwen3 also returns the DeepStack features, one array of the same shape per chosen layer).

Flow: patch embed (the Conv3d's stride equals its kernel, so it is one matmul of each flattened
patch with the flattened kernel) -> [qwen3: + learned position table bilinearly resampled to the
grid] -> blocks with 2-D RoPE (h, w patch coordinates), attention kept inside each frame of each
image [qwen2.5: inside windows, except the ``fullatt_block_indexes`` blocks] -> merger (norm,
concatenate each merge x merge block, MLP).
"""

from __future__ import annotations

from typing import Any

import mlx.core as mx
import numpy as np
from mlx import nn

from mlxc.runtime.model.config import read


def _quick_gelu(x: mx.array) -> mx.array:
    return x * mx.sigmoid(1.702 * x)


# Hugging Face activation names (ACT2FN keys) used by these towers.
ACT = {
    "quick_gelu": _quick_gelu,
    "silu": nn.silu,
    "gelu": nn.gelu,
    "gelu_pytorch_tanh": nn.gelu_approx,  # both are the tanh formula
}


def _grids(grid_thw: Any) -> list[tuple[int, int, int]]:
    return [(int(t), int(h), int(w)) for t, h, w in np.asarray(grid_thw).reshape(-1, 3)]


# ---------------------------------------------------------------- host-side index computations


def frame_seqlens(grids: list[tuple[int, int, int]]) -> list[int]:
    """Cumulative boundaries [0, ...] of the attention segments: every frame of every image."""
    lengths = [h * w for t, h, w in grids for _ in range(t)]
    return np.concatenate([[0], np.cumsum(lengths)]).astype(int).tolist()


def rope_positions(grids: list[tuple[int, int, int]], merge: int) -> np.ndarray:
    """(h, w) patch coordinates [N, 2] in the processor's spatial-merge block order."""
    out = []
    for t, h, w in grids:
        hpos, wpos = np.meshgrid(np.arange(h), np.arange(w), indexing="ij")
        block = (h // merge, merge, w // merge, merge)
        hpos = hpos.reshape(block).transpose(0, 2, 1, 3).reshape(-1)
        wpos = wpos.reshape(block).transpose(0, 2, 1, 3).reshape(-1)
        out.append(np.tile(np.stack([hpos, wpos], axis=-1), (t, 1)))
    return np.concatenate(out)


def window_index(
    grids: list[tuple[int, int, int]], merge: int, window_size: int, patch_size: int
) -> tuple[np.ndarray, list[int]]:
    """qwen2.5 windows: merged-token order that makes each window contiguous, and the window
    boundaries in patches. Windows are ``window_size`` pixels square, cut per frame from the
    top-left corner; edge windows are smaller."""
    side = window_size // merge // patch_size  # window side in merged tokens
    order, bounds, base = [], [0], 0
    for t, h, w in grids:
        gh, gw = h // merge, w // merge
        ids = np.arange(t * gh * gw).reshape(t, gh, gw)
        for f in range(t):
            for r in range(0, gh, side):
                for c in range(0, gw, side):
                    win = ids[f, r : r + side, c : c + side].reshape(-1)
                    order.append(win + base)
                    bounds.append(bounds[-1] + win.size * merge * merge)
        base += t * gh * gw
    return np.concatenate(order), bounds


def _bilinear_axis(n: int, side: int) -> tuple[np.ndarray, np.ndarray]:
    """Taps (lower, upper) into a ``side``-long axis and their weights for ``n`` targets,
    align_corners=True, in float32 like transformers."""
    src = np.arange(n, dtype=np.float32) * np.float32(side - 1) / np.float32(max(n - 1, 1))
    lo = np.floor(src)
    frac = src - lo
    lo = lo.astype(np.int64)
    return np.stack([lo, np.minimum(lo + 1, side - 1)], -1), np.stack([1 - frac, frac], -1)


def pos_embed_taps(
    grids: list[tuple[int, int, int]], side: int, merge: int
) -> tuple[np.ndarray, np.ndarray]:
    """qwen3: the learned ``side x side`` position table resampled to each grid (bilinear,
    align_corners=True) as 4 table rows and 4 weights per patch [N, 4], patches in merge order."""
    indices, weights = [], []
    for t, h, w in grids:
        (h_tap, h_wt), (w_tap, w_wt) = _bilinear_axis(h, side), _bilinear_axis(w, side)
        idx = h_tap[:, None, :, None] * side + w_tap[None, :, None, :]  # [h, w, 2, 2]
        wt = h_wt[:, None, :, None] * w_wt[None, :, None, :]
        block = (h // merge, merge, w // merge, merge, 4)
        idx = idx.reshape(block).transpose(0, 2, 1, 3, 4).reshape(-1, 4)
        wt = wt.reshape(block).transpose(0, 2, 1, 3, 4).reshape(-1, 4)
        indices.append(np.tile(idx, (t, 1)))
        weights.append(np.tile(wt, (t, 1)))
    return np.concatenate(indices), np.concatenate(weights)


# ---------------------------------------------------------------- layers


class Conv3dAsLinear(nn.Module):
    """The patch Conv3d. Its stride equals its kernel, so over one flattened patch it is a dot
    product with the flattened kernel. Keeps PyTorch's ``[out, in, t, p, p]`` weight shape (the
    checkpoint's), whose flattening order matches the processor's ``C*T*P*P`` rows."""

    def __init__(self, in_channels: int, out: int, t: int, p: int, bias: bool) -> None:
        super().__init__()
        self.weight = mx.zeros((out, in_channels, t, p, p))
        if bias:
            self.bias = mx.zeros((out,))

    def __call__(self, x: mx.array) -> mx.array:
        w = self.weight.reshape(self.weight.shape[0], -1)
        y = x.astype(w.dtype) @ w.T
        return y + self.bias if "bias" in self else y


class PatchEmbed(nn.Module):
    def __init__(self, in_channels: int, dim: int, t: int, p: int, bias: bool) -> None:
        super().__init__()
        self.proj = Conv3dAsLinear(in_channels, dim, t, p, bias)

    def __call__(self, x: mx.array) -> mx.array:
        return self.proj(x)


def _rotate_half(x: mx.array) -> mx.array:
    half = x.shape[-1] // 2
    return mx.concatenate([-x[..., half:], x[..., :half]], axis=-1)


def vision_rope(positions: np.ndarray, head_dim: int, theta: float) -> tuple[mx.array, mx.array]:
    """cos, sin [N, head_dim]: a quarter of the frequencies for h, a quarter for w, doubled."""
    quarter = head_dim // 2
    inv_freq = 1.0 / theta ** (mx.arange(0, quarter, 2, dtype=mx.float32) / quarter)
    angles = mx.array(positions, dtype=mx.float32)[..., None] * inv_freq  # [N, 2, hd/4]
    angles = angles.reshape(angles.shape[0], -1)  # h block, then w block
    angles = mx.concatenate([angles, angles], axis=-1)
    return mx.cos(angles), mx.sin(angles)


class VisionAttention(nn.Module):
    """Bidirectional attention inside each segment ``[bounds[i], bounds[i+1])`` of the sequence."""

    def __init__(self, dim: int, heads: int) -> None:
        super().__init__()
        self.heads = heads
        self.scale = (dim // heads) ** -0.5
        self.qkv = nn.Linear(dim, 3 * dim, bias=True)
        self.proj = nn.Linear(dim, dim, bias=True)

    def __call__(self, x: mx.array, bounds: list[int], cos: mx.array, sin: mx.array) -> mx.array:
        n = x.shape[0]
        q, k, v = self.qkv(x).reshape(n, 3, self.heads, -1).transpose(1, 2, 0, 3)  # [H, N, D] each
        cos, sin = cos[None], sin[None]
        # RoPE in float32, as transformers does, whatever the weights' dtype.
        q = (q.astype(mx.float32) * cos + _rotate_half(q.astype(mx.float32)) * sin).astype(v.dtype)
        k = (k.astype(mx.float32) * cos + _rotate_half(k.astype(mx.float32)) * sin).astype(v.dtype)
        out = segment_attention(q, k, v, bounds, self.scale)  # [H, N, D]
        return self.proj(out.transpose(1, 0, 2).reshape(n, -1))


def segment_attention(
    q: mx.array, k: mx.array, v: mx.array, bounds: list[int], scale: float
) -> mx.array:
    """Attention of q, k, v [H, N, D] inside each segment ``[bounds[i], bounds[i+1])``.

    Segments of equal length (the full windows, the frames of one image size) are stacked and
    go through one batched call, so the work is the segments' own, with no N x N mask and no
    Python loop over hundreds of windows.
    """
    lengths = np.diff(bounds)
    if len(lengths) == 1:
        return mx.fast.scaled_dot_product_attention(q[None], k[None], v[None], scale=scale)[0]
    starts = np.asarray(bounds[:-1])
    heads, dim = q.shape[0], q.shape[-1]
    outs, rows = [], []
    for length in np.unique(lengths):
        idx = (starts[lengths == length][:, None] + np.arange(length)).reshape(-1)
        take, n = mx.array(idx), int(length)
        qs, ks, vs = [
            x[:, take].reshape(heads, -1, n, dim).transpose(1, 0, 2, 3) for x in (q, k, v)
        ]
        o = mx.fast.scaled_dot_product_attention(qs, ks, vs, scale=scale)  # [segments, H, n, D]
        outs.append(o.transpose(1, 0, 2, 3).reshape(heads, -1, dim))
        rows.append(idx)
    # back to sequence order
    return mx.concatenate(outs, axis=1)[:, mx.array(np.argsort(np.concatenate(rows)))]


class MLP(nn.Module):
    """qwen2_vl: fc1 -> act -> fc2."""

    def __init__(self, dim: int, hidden: int, act: str) -> None:
        super().__init__()
        self.fc1 = nn.Linear(dim, hidden)
        self.fc2 = nn.Linear(hidden, dim)
        self.act = ACT[act]

    def __call__(self, x: mx.array) -> mx.array:
        return self.fc2(self.act(self.fc1(x)))


class GatedMLP(nn.Module):
    """qwen2_5_vl: down(act(gate(x)) * up(x)), with biases."""

    def __init__(self, dim: int, hidden: int, act: str) -> None:
        super().__init__()
        self.gate_proj = nn.Linear(dim, hidden)
        self.up_proj = nn.Linear(dim, hidden)
        self.down_proj = nn.Linear(hidden, dim)
        self.act = ACT[act]

    def __call__(self, x: mx.array) -> mx.array:
        return self.down_proj(self.act(self.gate_proj(x)) * self.up_proj(x))


class Qwen3MLP(nn.Module):
    """qwen3_vl: linear_fc1 -> act -> linear_fc2."""

    def __init__(self, dim: int, hidden: int, act: str) -> None:
        super().__init__()
        self.linear_fc1 = nn.Linear(dim, hidden)
        self.linear_fc2 = nn.Linear(hidden, dim)
        self.act = ACT[act]

    def __call__(self, x: mx.array) -> mx.array:
        return self.linear_fc2(self.act(self.linear_fc1(x)))


class VisionBlock(nn.Module):
    """Pre-norm block: x + attn(norm1(x)), then x + mlp(norm2(x)); LayerNorm or RMSNorm, 1e-6."""

    def __init__(self, dim: int, heads: int, mlp: nn.Module, rms_norm: bool = False) -> None:
        super().__init__()
        norm = nn.RMSNorm if rms_norm else nn.LayerNorm
        self.norm1, self.norm2 = norm(dim, eps=1e-6), norm(dim, eps=1e-6)
        self.attn = VisionAttention(dim, heads)
        self.mlp = mlp

    def __call__(self, x: mx.array, bounds: list[int], cos: mx.array, sin: mx.array) -> mx.array:
        x = x + self.attn(self.norm1(x), bounds, cos, sin)
        return x + self.mlp(self.norm2(x))


class PatchMerger(nn.Module):
    """qwen2 / qwen2.5 merger: ln_q per patch, concat merge**2 patches, mlp.0 -> GELU -> mlp.2."""

    def __init__(self, dim: int, out: int, merge: int, rms_norm: bool = False) -> None:
        super().__init__()
        self.hidden = dim * merge * merge
        self.ln_q = nn.RMSNorm(dim, eps=1e-6) if rms_norm else nn.LayerNorm(dim, eps=1e-6)
        self.mlp = [nn.Linear(self.hidden, self.hidden), nn.GELU(), nn.Linear(self.hidden, out)]

    def __call__(self, x: mx.array) -> mx.array:
        x = self.ln_q(x).reshape(-1, self.hidden)
        for layer in self.mlp:
            x = layer(x)
        return x


class Qwen3PatchMerger(nn.Module):
    """qwen3 merger: LayerNorm per patch (or, for the DeepStack mergers, after concatenating),
    linear_fc1 -> GELU -> linear_fc2."""

    def __init__(self, dim: int, out: int, merge: int, postshuffle_norm: bool) -> None:
        super().__init__()
        self.hidden = dim * merge * merge
        self.postshuffle_norm = postshuffle_norm
        self.norm = nn.LayerNorm(self.hidden if postshuffle_norm else dim, eps=1e-6)
        self.linear_fc1 = nn.Linear(self.hidden, self.hidden)
        self.linear_fc2 = nn.Linear(self.hidden, out)

    def __call__(self, x: mx.array) -> mx.array:
        if self.postshuffle_norm:
            x = self.norm(x.reshape(-1, self.hidden))
        else:
            x = self.norm(x).reshape(-1, self.hidden)
        return self.linear_fc2(nn.gelu(self.linear_fc1(x)))


# ---------------------------------------------------------------- towers


class _Tower(nn.Module):
    """Config reading and weight sanitising shared by the three towers."""

    def _read_common(self, cfg: dict, dim_key: str, default_patch: int) -> int:
        self.depth = read(cfg, ("depth", "num_hidden_layers"), int, 32)
        self.heads = read(cfg, ("num_heads", "num_attention_heads"), int, 16)
        self.in_channels = read(cfg, ("in_channels", "in_chans"), int, 3)  # hub: in_chans
        self.patch_size = read(cfg, "patch_size", int, default_patch)
        self.temporal_patch_size = read(cfg, "temporal_patch_size", int, 2)
        self.merge = read(cfg, "spatial_merge_size", int, 2)
        dim = read(cfg, dim_key, int)
        self.head_dim = dim // self.heads
        rope = cfg.get("rope_parameters") or {}  # transformers 5; hub configs rely on the default
        self.rope_theta = float(rope.get("rope_theta", cfg.get("rope_theta", 10000.0)))
        return dim

    def sanitize(self, weights: dict[str, mx.array]) -> dict[str, mx.array]:
        """Weights (tower prefix stripped) ready for ``load_weights(strict=True)``.

        The patch kernel is kept as PyTorch's ``[out, in, t, p, p]``. A kernel in MLX's
        channels-last layout ``[out, t, p, p, in]`` (MLX conversions, e.g. mlx-vlm's) is
        transposed back; everything else passes unchanged.
        """
        out = dict(weights)
        key = "patch_embed.proj.weight"
        if key in out:
            w = out[key]
            want = tuple(self.patch_embed.proj.weight.shape)
            if tuple(w.shape) != want:
                mlx_layout = (want[0], want[2], want[3], want[4], want[1])
                if tuple(w.shape) != mlx_layout:
                    raise ValueError(f"{key}: shape {tuple(w.shape)}, expected {want}")
                out[key] = w.transpose(0, 4, 1, 2, 3)
        return out

    def _rope(self, grids: list[tuple[int, int, int]]) -> tuple[mx.array, mx.array]:
        return vision_rope(rope_positions(grids, self.merge), self.head_dim, self.rope_theta)


class Qwen2VisionTower(_Tower):
    """qwen2_vl. Config keys: depth, embed_dim, hidden_size (= output width), mlp_ratio,
    num_heads, hidden_act, in_channels/in_chans, patch_size, temporal_patch_size,
    spatial_merge_size."""

    def __init__(self, vision_config: dict) -> None:
        super().__init__()
        cfg = vision_config
        dim = self._read_common(cfg, "embed_dim", 14)
        out = read(cfg, "hidden_size", int, 3584)
        hidden = int(dim * read(cfg, "mlp_ratio", float, 4.0))
        act = read(cfg, "hidden_act", str, "quick_gelu")
        t, p = self.temporal_patch_size, self.patch_size
        self.patch_embed = PatchEmbed(self.in_channels, dim, t, p, bias=False)
        self.blocks = [
            VisionBlock(dim, self.heads, MLP(dim, hidden, act)) for _ in range(self.depth)
        ]
        self.merger = PatchMerger(dim, out, self.merge)

    def __call__(self, pixel_values: mx.array, grid_thw: Any) -> mx.array:
        grids = _grids(grid_thw)
        bounds = frame_seqlens(grids)
        cos, sin = self._rope(grids)
        x = self.patch_embed(pixel_values)
        for block in self.blocks:
            x = block(x, bounds, cos, sin)
        return self.merger(x)


class Qwen25VisionTower(_Tower):
    """qwen2_5_vl. Config keys: depth, hidden_size, intermediate_size, out_hidden_size,
    num_heads, hidden_act, window_size (pixels), fullatt_block_indexes, patch sizes, merge size."""

    def __init__(self, vision_config: dict) -> None:
        super().__init__()
        cfg = vision_config
        dim = self._read_common(cfg, "hidden_size", 14)
        out = read(cfg, "out_hidden_size", int, 3584)
        hidden = read(cfg, "intermediate_size", int, 3420)
        act = read(cfg, "hidden_act", str, "silu")
        self.window_size = read(cfg, "window_size", int, 112)
        self.fullatt_block_indexes = list(read(cfg, "fullatt_block_indexes", list, [7, 15, 23, 31]))
        t, p = self.temporal_patch_size, self.patch_size
        self.patch_embed = PatchEmbed(self.in_channels, dim, t, p, bias=False)
        self.blocks = [
            VisionBlock(dim, self.heads, GatedMLP(dim, hidden, act), rms_norm=True)
            for _ in range(self.depth)
        ]
        self.merger = PatchMerger(dim, out, self.merge, rms_norm=True)

    def __call__(self, pixel_values: mx.array, grid_thw: Any) -> mx.array:
        grids = _grids(grid_thw)
        frames = frame_seqlens(grids)
        order, windows = window_index(grids, self.merge, self.window_size, self.patch_size)
        unit = self.merge * self.merge

        # Reorder merged tokens (each a block of `unit` patches) so every window is contiguous;
        # frames stay contiguous too, so the per-frame bounds still hold for full attention.
        def permute(a: mx.array) -> mx.array:
            a = a.reshape(-1, unit, a.shape[-1])[mx.array(order)]
            return a.reshape(-1, a.shape[-1])

        x = permute(self.patch_embed(pixel_values))
        cos, sin = (permute(c) for c in self._rope(grids))
        for i, block in enumerate(self.blocks):
            x = block(x, frames if i in self.fullatt_block_indexes else windows, cos, sin)
        return self.merger(x)[mx.array(np.argsort(order))]


class Qwen3VisionTower(_Tower):
    """qwen3_vl / qwen3_vl_moe. Config keys: depth, hidden_size, intermediate_size,
    out_hidden_size, num_heads, hidden_act, num_position_embeddings, deepstack_visual_indexes,
    patch sizes, merge size. ``__call__`` returns ``(embeds, deepstack_features)``."""

    def __init__(self, vision_config: dict) -> None:
        super().__init__()
        cfg = vision_config
        dim = self._read_common(cfg, "hidden_size", 16)
        out = read(cfg, "out_hidden_size", int, 3584)
        hidden = read(cfg, "intermediate_size", int, 4304)
        act = read(cfg, "hidden_act", str, "gelu_pytorch_tanh")
        num_pos = read(cfg, "num_position_embeddings", int, 2304)
        self.grid_side = int(num_pos**0.5)
        self.deepstack_visual_indexes = list(
            read(cfg, "deepstack_visual_indexes", list, [8, 16, 24])
        )
        t, p = self.temporal_patch_size, self.patch_size
        self.patch_embed = PatchEmbed(self.in_channels, dim, t, p, bias=True)
        self.pos_embed = nn.Embedding(num_pos, dim)
        self.blocks = [
            VisionBlock(dim, self.heads, Qwen3MLP(dim, hidden, act)) for _ in range(self.depth)
        ]
        self.merger = Qwen3PatchMerger(dim, out, self.merge, postshuffle_norm=False)
        self.deepstack_merger_list = [
            Qwen3PatchMerger(dim, out, self.merge, postshuffle_norm=True)
            for _ in self.deepstack_visual_indexes
        ]

    def __call__(self, pixel_values: mx.array, grid_thw: Any) -> tuple[mx.array, list[mx.array]]:
        grids = _grids(grid_thw)
        bounds = frame_seqlens(grids)
        cos, sin = self._rope(grids)
        x = self.patch_embed(pixel_values)
        taps, weights = pos_embed_taps(grids, self.grid_side, self.merge)
        pos = (self.pos_embed(mx.array(taps)) * mx.array(weights)[..., None]).sum(axis=1)
        x = x + pos.astype(x.dtype)
        deepstack = []
        for i, block in enumerate(self.blocks):
            x = block(x, bounds, cos, sin)
            if i in self.deepstack_visual_indexes:
                merger = self.deepstack_merger_list[self.deepstack_visual_indexes.index(i)]
                deepstack.append(merger(x))
        return self.merger(x), deepstack


TOWERS: dict[str, type[_Tower]] = {
    "qwen2_vl": Qwen2VisionTower,
    "qwen2_5_vl": Qwen25VisionTower,
    "qwen3_vl": Qwen3VisionTower,
    "qwen3_vl_moe": Qwen3VisionTower,
}
