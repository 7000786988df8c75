"""Tensor parallelism: one decoder block split over the ranks of an ``mx.distributed`` group.

The generated ``Model.shard(group)`` (mlx-lm's convention) calls :func:`shard` once per
sublayer with what its block kind declares (``compiler/blocks``: ``BlockKind.sharding``). The
residual stream stays whole on every rank: a block's first projections split by output
(``all-to-sharded``: each rank computes its heads or its slice of the hidden width from the
whole input) and its last by input (``sharded-to-all``: each rank's partial product, summed
over the ranks by one all-reduce). Embeddings, norms, the LM head and vision towers are not
touched: every rank holds them whole.
"""

from __future__ import annotations

import mlx.core as mx
from mlx import nn
from mlx.nn.layers.distributed import shard_inplace, shard_linear
from mlx.utils import tree_flatten, tree_map

from mlxc.runtime.model import layers


class ShardError(ValueError):
    """A model whose sizes do not divide over the group's ranks."""


def _get(module: nn.Module, path: str):
    """The submodule or array at dotted ``path``, or None where the module has none."""
    node = module
    for name in path.split("."):
        node = node.get(name) if isinstance(node, dict) else None
        if node is None:
            return None
    return node


def _set(module: nn.Module, path: str, value) -> None:
    *parents, name = path.split(".")
    node = module
    for parent in parents:
        node = node[parent]
    setattr(node, name, value)


def _split_dims(layer: nn.Module, by_output: bool) -> list[tuple[str, int]]:
    """(parameter, size along the split axis) of a linear or stacked expert linear, as
    ``mlx.nn.layers.distributed`` splits them (outputs: axis -2 of a matrix, biases on their
    last axis; inputs: the last axis, biases whole)."""
    dims = []
    for name, w in tree_flatten(layer.parameters()):
        if name == "bias" or name.endswith(".bias"):
            if by_output:
                dims.append((name, w.shape[-1]))
        else:
            dims.append((name, w.shape[max(w.ndim - 2, 0)] if by_output else w.shape[-1]))
    return dims


def _check_width(layer: nn.Module, path: str, by_output: bool, n: int, fields: str) -> None:
    for name, size in _split_dims(layer, by_output):
        if size % n:
            what = "outputs" if by_output else "inputs"
            if name != "weight" and "scales" in layer:  # quantised: whole groups per rank
                what = f"groups of {layer.group_size} inputs"
            raise ShardError(
                f"{path}.{name} has {size} {what}, which do not divide over {n} ranks ({fields})"
            )


def _named(what: str, entries: tuple[str, ...]) -> str:
    """``what`` and the config.json entries it comes from."""
    if not entries:
        return f"{what}, a literal of the spec"
    return f"{what}, from config entries {', '.join(repr(e) for e in entries)}"


def _kv_head_slice(layer: nn.Module, heads: int, keep: int) -> None:
    """Keep kv head ``keep`` of ``heads`` in a k or v projection (plain or quantised: every
    parameter has the outputs on axis 0), in place."""
    layer.update(
        tree_map(lambda w: mx.contiguous(mx.split(w, heads, axis=0)[keep]), layer.parameters())
    )


def shard(module: nn.Module, group: mx.distributed.Group, **split) -> None:
    """Split ``module`` over the ranks of ``group``, in place, as :func:`split_module` says. Projections
    fused at load (``layers.fuse``: q|k|v, gate|up) are split back into their parts first, so
    each part splits by its own heads or width, and fused again after."""
    if group.size() == 1:
        return
    fused = layers.unfuse(module)
    split_module(module, group, **split)
    if fused:
        layers.fuse(module)


def split_module(
    module: nn.Module,
    group: mx.distributed.Group,
    *,
    by_output: tuple[str, ...] = (),
    by_input: tuple[str, ...] = (),
    fused_halves: tuple[str, ...] = (),
    kv: tuple[str, ...] = (),
    per_head: tuple[str, ...] = (),
    heads: dict[str, tuple[str, ...]] | None = None,
    kv_heads: dict[str, tuple[str, ...]] | None = None,
    widths: tuple[str, ...] = (),
    reduces: bool = False,
) -> None:
    """Split ``module``, unfused, over the ranks of ``group``, in place.

    ``by_output`` / ``by_input``: linears split by output (``all-to-sharded``) or by input
    (``sharded-to-all``, which all-reduces its output), quantised ones included;
    ``fused_halves``: linears whose outputs are two halves (a fused gate and up), each half split
    by output, so every rank holds the matching slices of both. ``heads``:
    module attributes counting heads -> the config.json entries they come from (named in
    errors); each is divided by the ranks. ``kv_heads`` (one attribute): the key/value heads, split as
    the heads when they divide, and otherwise, when fewer than the ranks, replicated: each rank
    keeps the one kv head its query heads read (``kv``: those projections). ``per_head``:
    arrays ``[heads, ...]`` split by head. ``widths``: the config.json entries of the widths.
    ``reduces``: the module sums its ranks' outputs itself (``moe.MoE``): its linears split in
    place, with no communication of their own, and ``sharding_group`` is set on it; a bias of a
    linear split by input then stays on rank 0 only, so the sum adds it once.

    Names the module lacks (or holds as None) are skipped.
    """
    n, rank = group.size(), group.rank()
    if n == 1:
        return
    heads, kv_heads = heads or {}, kv_heads or {}
    for attr, fields in heads.items():
        count = getattr(module, attr)
        if count % n:
            raise ShardError(f"{count} heads ({_named(attr, fields)}) do not divide over {n} ranks")
    kv_split = True
    for attr, fields in kv_heads.items():
        count = getattr(module, attr)
        if count % n and n % count:
            raise ShardError(
                f"{count} key/value heads ({_named(attr, fields)}) neither divide over {n} "
                f"ranks nor divide {n} (to be replicated)"
            )
        kv_split = count % n == 0
    for path in (*by_output, *fused_halves, *by_input):
        if (layer := _get(module, path)) is None:
            continue
        output = path not in by_input
        segments = 2 if path in fused_halves else 1
        _check_width(layer, path, output, n * segments, _named("its width", widths))
        sharding = "all-to-sharded" if output else "sharded-to-all"
        if reduces:
            shard_inplace(layer, sharding, segments=segments, group=group)
            if not output and "bias" in layer and rank != 0:
                layer.bias = mx.zeros_like(layer.bias)
        else:
            _set(module, path, shard_linear(layer, sharding, segments=segments, group=group))
    for path in kv:
        if (layer := _get(module, path)) is None:
            continue
        if kv_split:
            _set(module, path, shard_linear(layer, "all-to-sharded", group=group))
        else:
            # Fewer kv heads than ranks: this rank's query heads all read kv head r * kv / n.
            (count,) = (getattr(module, a) for a in kv_heads)
            _kv_head_slice(layer, count, rank * count // n)
    for path in per_head:
        if (array := _get(module, path)) is not None:
            _set(module, path, mx.contiguous(mx.split(array, n, axis=0)[rank]))
    for attr in heads:
        setattr(module, attr, getattr(module, attr) // n)
    for attr in kv_heads:
        count = getattr(module, attr)
        setattr(module, attr, count // n if kv_split else 1)
    if reduces:
        module.sharding_group = group
    module.__dict__["split_over"] = group  # layers.step_compiled leaves such a module as written
