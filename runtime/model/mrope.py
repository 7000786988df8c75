"""Multimodal RoPE (MRoPE) for the Qwen VL family: position ids and the rotation.

Every position here is a ``monotonic-position``: absolute, counted from the start of the
sequence, never from a live count after ``trim_front``.

Positions. ``rope_index`` turns a prompt into ``base_positions [3, B, L]`` (temporal, height,
width) and ``rope_deltas [B]``, equal to transformers 5's ``get_rope_index``. A sequence keeps a
``PromptPositions`` (the model's ``position_state``), which gives each chunk of ``L`` tokens at
``cache.offset`` the prompt's rows while an image is still to come, and ``offset + i +
rope_deltas`` after (``TextPositions``).

Rotation. ``apply(q, k, position_ids, theta=..., mrope_section=..., interleaved=...)`` rotates
q and k ``[B, H, L, D]`` like transformers' ``apply_rotary_pos_emb`` with the qwen VL text rotary
embedding. Of the ``D/2`` frequencies, each takes its angle from one of the three position rows:
  chunked (qwen2_vl, qwen2_5_vl): consecutive runs of ``mrope_section = [t, h, w]`` frequencies;
  interleaved (qwen3_vl): frequency j takes h if ``j % 3 == 1 and j < 3*h``, w if
  ``j % 3 == 2 and j < 3*w``, else t.
To build the tables once per forward instead of once per layer, call ``cos_sin`` and
``apply_cos_sin``; a model calls ``rotation`` and ``turn``, which take plain RoPE where it is
the same rotation.

Text with no image token at or after it in its sequence (a decode step, a verification, a
text-only prompt) sits at ``start + i`` on all three rows (``TextPositions``). Every frequency
then reads the same position, so MRoPE is plain (non-traditional) RoPE at that position: on a
GPU ``mx.fast.rope``, one kernel for q and one for k, where the tables cost a gather, cos, sin
and casts a forward and a negation, a concatenation and a multiply-add for each of q and k a
layer. The CPU keeps the tables: there ``mx.fast.rope`` is its fallback ops, which make a table
every call (a small qwen3_vl decode step: 31 more graph nodes a layer).
"""

from __future__ import annotations

import itertools
from collections.abc import Sequence
from dataclasses import dataclass
from functools import lru_cache
from typing import Any

import mlx.core as mx
import numpy as np

# ---------------------------------------------------------------- position ids


def rope_index(
    input_ids: Any,
    image_grid_thw: Any = None,
    video_grid_thw: Any = None,
    *,
    spatial_merge_size: int,
    image_token_id: int,
    video_token_id: int,
    vision_start_token_id: int | None = None,
    tokens_per_second: float | None = None,
    second_per_grid_ts: Sequence[float] | None = None,
    frames_as_images: bool = False,
) -> tuple[np.ndarray, np.ndarray]:
    """3-D positions of a prompt, as transformers 5's ``get_rope_index``.

    Args:
      input_ids: [B, L] ints. Image tokens are ``image_token_id``, video tokens
        ``video_token_id`` (transformers 5 builds ``mm_token_type_ids`` from exactly these).
      image_grid_thw, video_grid_thw: [n, 3] (t, h, w) in patches, in prompt order over the whole
        batch (row 0's images first).
      spatial_merge_size: vision_config.spatial_merge_size.
      vision_start_token_id: accepted for call compatibility, unused: transformers 5 finds
        images by their own tokens, not by the token before them.
      tokens_per_second, second_per_grid_ts: qwen2_5_vl video timing (vision_config
        .tokens_per_second; per video, seconds per temporal patch, default 1.0).
      frames_as_images: qwen3_vl (see below).

    Text tokens count up by one on all three rows. An image of merged grid (t, gh, gw) starting
    at position p takes (p + t_index, p + row, p + col); the text after it starts at
    p + max(gh, gw).

    Video semantics (deliberate: transformers 5, which differs from 4.x after multi-frame video):
      * qwen2_vl: temporal row = p + frame index; the next text starts at p + max(gh, gw)
        (transformers 4 started it after the largest of all three rows).
      * qwen2_5_vl (``tokens_per_second`` set): temporal row =
        p + int(frame_index * tokens_per_second * second_per_grid_ts[video]), in float32.
      * qwen3_vl (``frames_as_images=True``): the prompt has one run of video tokens per frame,
        separated by timestamp text, so each frame is placed as a t=1 image.

    Returns:
      position_ids [3, B, L] int64 and rope_deltas [B] int64 where
      ``rope_deltas[b] = max(position_ids[:, b]) + 1 - L``, so the token after the prompt sits
      at ``L + rope_deltas``.
    """
    ids = np.asarray(input_ids)
    batch, length = ids.shape
    images = iter(_grid_rows(image_grid_thw))
    videos = _grid_rows(video_grid_thw)
    seconds = iter(second_per_grid_ts if second_per_grid_ts is not None else [1.0] * len(videos))
    if frames_as_images:  # one t=1 grid per frame
        videos = [(1, h, w) for t, h, w in videos for _ in range(t)]
    videos = iter(videos)

    position_ids = np.zeros((3, batch, length), np.int64)
    deltas = np.zeros(batch, np.int64)
    for b in range(batch):
        row = ids[b]
        kind = np.where(row == image_token_id, 1, np.where(row == video_token_id, 2, 0))
        bounds = [0, *(np.flatnonzero(np.diff(kind)) + 1).tolist(), len(row)]
        pieces, pos = [], 0
        for start, end in itertools.pairwise(bounds):  # runs of one kind
            if kind[start] == 0:
                pieces.append(np.broadcast_to(np.arange(pos, pos + end - start), (3, end - start)))
                pos += end - start
                continue
            while start < end:  # a run holds one grid's tokens (or several back to back)
                t, h, w = _next_grid(images if kind[start] == 1 else videos, b)
                gh, gw = h // spatial_merge_size, w // spatial_merge_size
                step = np.float32(1.0)
                if kind[start] == 2 and tokens_per_second is not None:
                    step = np.float32(tokens_per_second) * np.float32(next(seconds))
                temporal = (np.arange(t, dtype=np.float32) * step).astype(np.int64)
                grid = np.meshgrid(temporal, np.arange(gh), np.arange(gw), indexing="ij")
                pieces.append(np.stack(grid).reshape(3, -1) + pos)
                pos += max(gh, gw)
                start += t * gh * gw
            if start != end:
                raise ValueError(f"row {b}: placeholder tokens and grid sizes disagree")
        if pieces:
            llm = np.concatenate(pieces, axis=1)
            position_ids[:, b] = llm
            deltas[b] = llm.max() + 1 - len(row)
    return position_ids, deltas


def _next_grid(grids, row: int) -> tuple[int, int, int]:
    grid = next(grids, None)
    if grid is None:
        raise ValueError(f"row {row}: more image/video placeholder runs than grids")
    return grid


def _grid_rows(grid_thw: Any) -> list[tuple[int, int, int]]:
    if grid_thw is None:
        return []
    return [(int(t), int(h), int(w)) for t, h, w in np.asarray(grid_thw).reshape(-1, 3)]


@dataclass(frozen=True)
class TextPositions:
    """Positions ``start[b] + i`` on all three rows for the chunk's tokens ``i``: text with no
    image token at or after it in its sequence."""

    start: mx.array  # [B] int32: each row's first position, monotonic (offset + rope delta)
    length: int  # the chunk's tokens

    def ids(self) -> mx.array:
        """The positions as ``[3, B, L]`` position ids."""
        pos = self.start[:, None] + mx.arange(self.length, dtype=mx.int32)[None, :]
        return mx.broadcast_to(pos, (3, *pos.shape))


class PromptPositions:
    """MRoPE positions of one sequence whose prompt arrives in chunks.

    A token's position depends only on the tokens before it, so a chunk's positions are
    ``rope_index`` over every token seen so far, sliced at ``offset`` (``cache.offset``,
    monotonic). An image cut by the chunk boundary is completed with placeholder tokens first.
    Once every image token has been seen, positions continue as ``offset + i + rope_deltas``
    and the history is dropped.

    A batch of several prompts with images must bring all their image tokens in its first
    chunk: which grid belongs to which row is only known from whole prompts.
    """

    def __init__(self, **index_kwargs: Any) -> None:
        self.index_kwargs = index_kwargs  # spatial_merge_size, image/video token ids, ...
        self.grids: np.ndarray | None = None  # [n, 3] images whose tokens are still to come
        self.history: np.ndarray | None = None  # [B, T] tokens since the sequence start
        self.deltas: np.ndarray = np.zeros(1, np.int64)

    def add_images(self, image_grid_thw: Any) -> None:
        self.grids = np.asarray(image_grid_thw, np.int64).reshape(-1, 3)

    def __call__(self, input_ids: Any, offset: int) -> np.ndarray | TextPositions:
        """Positions ``[3, B, L]`` of the chunk ``input_ids [B, L]`` starting at ``offset``; once
        no image token is to come, ``TextPositions`` (``offset + rope_deltas`` a row)."""
        B, L = input_ids.shape
        if self.grids is None:  # from the shape alone: no host read of a lazy decode token
            start = offset + np.broadcast_to(self.deltas.reshape(-1), (B,))
            return TextPositions(mx.array(start, mx.int32), L)
        ids = np.asarray(input_ids)
        if self.history is None:  # text before the images ran at positions 0..offset-1
            self.history = np.full((B, offset), -1, ids.dtype)
        history = np.concatenate([self.history, ids], axis=1)
        merge = self.index_kwargs["spatial_merge_size"]
        per_grid = np.cumsum(self.grids.prod(axis=1) // merge**2)
        image_token = self.index_kwargs["image_token_id"]
        seen = int((history == image_token).sum())
        started = int(np.searchsorted(per_grid, seen, side="left")) + 1
        missing = int(per_grid[min(started, len(per_grid)) - 1]) - seen
        if missing and B > 1:
            raise ValueError(
                "a batch of prompts with images must bring all image tokens in its first chunk"
            )
        completed = history
        if missing:  # a chunk boundary inside an image: complete it to index the prefix
            completed = np.concatenate([history, np.full((1, missing), image_token)], axis=1)
        pos, deltas = rope_index(completed, self.grids[:started], **self.index_kwargs)
        if seen >= int(per_grid[-1]):  # every image seen: plain offsets from now on
            self.grids, self.history, self.deltas = None, None, deltas
        else:
            self.history = history
        return pos[:, :, offset : offset + L]


# ---------------------------------------------------------------- rotation


@lru_cache(maxsize=32)
def _tables(head_dim: int, theta: float, section: tuple[int, ...], interleaved: bool):
    """inv_freq [D/2] and, per frequency, the position row (0 t, 1 h, 2 w) it reads."""
    half = head_dim // 2
    if len(section) != 3:
        raise ValueError(f"mrope_section must have 3 entries, got {list(section)}")
    if interleaved:
        j = np.arange(half)
        axis = np.zeros(half, np.int32)
        axis[(j % 3 == 1) & (j < 3 * section[1])] = 1
        axis[(j % 3 == 2) & (j < 3 * section[2])] = 2
    else:
        if sum(section) != half:
            raise ValueError(f"mrope_section {list(section)} must sum to head_dim/2 = {half}")
        axis = np.repeat(np.arange(3, dtype=np.int32), section)
    inv_freq = 1.0 / theta ** (mx.arange(0, head_dim, 2, dtype=mx.float32) / head_dim)
    axis = mx.array(axis)
    mx.eval(inv_freq, axis)  # cached across calls and threads: never leave it lazy
    return inv_freq, axis


def rotation(
    position_ids: np.ndarray | TextPositions,
    head_dim: int,
    *,
    theta: float,
    mrope_section: Sequence[int],
    interleaved: bool,
    dtype: mx.Dtype,
) -> tuple[mx.array, ...]:
    """What every layer of a forward turns its q and k by (``turn``), made once: ``(start,)``
    for ``TextPositions`` on a GPU (plain RoPE), else the ``cos_sin`` tables ``(cos, sin)``."""
    if isinstance(position_ids, TextPositions):
        if mx.default_device() != mx.cpu:
            return (position_ids.start,)
        position_ids = position_ids.ids()
    return cos_sin(
        position_ids,
        head_dim,
        theta=theta,
        mrope_section=mrope_section,
        interleaved=interleaved,
        dtype=dtype,
    )


def turn(
    queries: mx.array, keys: mx.array, *rotation: mx.array, theta: float
) -> tuple[mx.array, mx.array]:
    """Rotate q, k ``[B, H, L, D]`` by ``rotation(...)``'s arrays."""
    if len(rotation) == 2:
        return apply_cos_sin(queries, keys, *rotation)
    (start,) = rotation  # every row's three positions equal: plain RoPE from ``start``
    dims = queries.shape[-1]
    return tuple(
        mx.fast.rope(x, dims, traditional=False, base=theta, scale=1.0, offset=start)
        for x in (queries, keys)
    )


def cos_sin(
    position_ids: Any,
    head_dim: int,
    *,
    theta: float,
    mrope_section: Sequence[int],
    interleaved: bool,
    dtype: mx.Dtype = mx.float32,
) -> tuple[mx.array, mx.array]:
    """cos, sin [B, L, head_dim] for position_ids [3, B, L] (angles in float32, then ``dtype``)."""
    inv_freq, axis = _tables(
        head_dim, float(theta), tuple(int(s) for s in mrope_section), bool(interleaved)
    )
    pos = mx.array(position_ids).astype(mx.float32)[axis]  # [D/2, B, L]: each frequency's row
    angles = pos.transpose(1, 2, 0) * inv_freq  # [B, L, D/2]
    angles = mx.concatenate([angles, angles], axis=-1)
    return mx.cos(angles).astype(dtype), mx.sin(angles).astype(dtype)


def _rotate_half(x: mx.array) -> mx.array:
    half = x.shape[-1] // 2
    return mx.concatenate([-x[..., half:], x[..., :half]], axis=-1)


def apply_cos_sin(
    queries: mx.array, keys: mx.array, cos: mx.array, sin: mx.array
) -> tuple[mx.array, mx.array]:
    """Rotate q, k [B, H, L, D] with tables [B, L, D] (non-interleaved halves, as HF)."""
    cos, sin = cos[:, None], sin[:, None]
    return queries * cos + _rotate_half(queries) * sin, keys * cos + _rotate_half(keys) * sin


def apply(
    queries: mx.array,
    keys: mx.array,
    position_ids: Any,
    *,
    theta: float,
    mrope_section: Sequence[int],
    interleaved: bool,
) -> tuple[mx.array, mx.array]:
    """``queries, keys = mrope.apply(queries, keys, position_ids, ...)``; q, k [B, H, L, D],
    position_ids [3, B, L] absolute (monotonic) positions."""
    cos, sin = cos_sin(
        position_ids,
        queries.shape[-1],
        theta=theta,
        mrope_section=mrope_section,
        interleaved=interleaved,
        dtype=queries.dtype,
    )
    return apply_cos_sin(queries, keys, cos, sin)
