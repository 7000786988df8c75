"""Running one model over the ranks of ``mx.distributed`` (``mlx.launch -n N mlxc ...``).

Every rank loads the checkpoint sharded (``loading.load_model(group=...)``: tensor
parallelism, the generated ``Model.shard``) and runs the same forwards in the same order: each
layer's all-reduces pair up across the ranks, so the ranks must agree on every input. Rank 0
reads the prompt and prints (``mlxc generate``) or binds HTTP (``mlxc serve``), and hands the
other ranks what they need through :func:`broadcast` (a small all-sum, as mlx-lm's server
does). The logits are the same on every rank (each all-reduce hands every rank the same sum),
so greedy decoding agrees without any exchange; sampling agrees once the random seeds do
(:func:`agree_on_seed`).
"""

from __future__ import annotations

import json

import mlx.core as mx
import numpy as np


def world() -> mx.distributed.Group | None:
    """The group ``mlx.launch`` started this process in; None when it runs alone."""
    group = mx.distributed.init()
    return group if group.size() > 1 else None


def broadcast(payload: object, group: mx.distributed.Group) -> object:
    """Rank 0's ``payload`` (anything JSON can hold) on every rank; other ranks pass None.

    Two all-sums: the length, then the bytes (zeros from every rank but 0). On the CPU so that
    the exchange never waits behind the device's queue.
    """
    data = json.dumps(payload).encode() if group.rank() == 0 else b""
    size = mx.distributed.all_sum(mx.array([len(data)], mx.int32), group=group, stream=mx.cpu)
    n = int(size.item())
    buffer = np.zeros(n, np.uint8)
    if group.rank() == 0:
        buffer[:] = np.frombuffer(data, np.uint8)
    # uint8 sums: every rank but rank 0 adds zeros, so no byte overflows.
    total = mx.distributed.all_sum(mx.array(buffer), group=group, stream=mx.cpu)
    return json.loads(bytes(np.array(total)).decode()) if n else None


def agree_on_seed(group: mx.distributed.Group) -> int:
    """Seed MLX's global generator with rank 0's seed on every rank (samplers without a seed
    of their own draw from it) and return it."""
    seed = int(np.random.default_rng().integers(2**31)) if group.rank() == 0 else None
    seed = broadcast(seed, group)
    mx.random.seed(seed)
    return seed
