"""The attention inputs that attention kinds share, each with its label and the field of the
block's mapping that makes the block consume it."""

from __future__ import annotations

from mlxc.compiler.blocks.base import Input
from mlxc.compiler.labels import LIVE_WINDOW, MONOTONIC


def _rope(raw: dict) -> bool:
    return raw.get("rope") is not None


def _mrope(raw: dict) -> bool:
    rope = raw.get("rope")
    return isinstance(rope, dict) and bool(rope.get("mrope"))


def _llama4_scale(raw: dict) -> bool:
    return raw.get("scale") == "llama4"


def _sliding_window(raw: dict) -> bool:
    return raw.get("sliding_window") is not None


POSITIONS = Input("positions", MONOTONIC)  # RoPE / MRoPE position ids: read cache.offset
ROPE_POSITIONS = Input("positions", MONOTONIC, "`rope`", _rope)
ROPE_DELTAS = Input("rope_deltas", MONOTONIC, "`rope.mrope`", _mrope)  # MRoPE decode shift
ATTN_SCALE = Input("attn_scale", MONOTONIC, "`scale: llama4`", _llama4_scale)  # grows with it
MASK = Input("mask", LIVE_WINDOW)  # causal mask key width: read cache.live_len
WINDOW = Input("window", LIVE_WINDOW, "`sliding_window`", _sliding_window)  # clamps live keys
