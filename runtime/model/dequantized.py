"""Quantised products where MLX 0.32's quantised kernels are slow.

Mostly through a dequantised copy: dequantise the weights for the one product (the copy is
dropped after it) and take MLX's float kernel, which is faster there by more than the copy
costs. Where the copy does not pay on the CPU, MLX's kernel is split over its cores.

- **The CPU**, any product of ``CPU_ROWS`` rows or more. MLX's CPU ``quantized_matmul`` runs at
  ~3 GFLOP/s, scaling with the rows, while OpenBLAS's float32 GEMM runs at ~100 (2 cores,
  4-bit, group 64, a 2,048 x 2,048 weight: 1 row 2.8 ms against 5.0 through the copy, 2 rows
  5.7 against 5.4, 3 rows 8.6 against 5.5, 16 rows 45 against 5.2, 256 rows 710 against 14;
  ``bench/results/cpu-dequantized-products-s31.md``). So a prefill, a decode batch or a
  speculative verification multiplies through the copy, a single decode row keeps MLX's kernel.
  The copy is made in pieces of at most ``PIECE_BYTES`` along the outputs, each piece's product
  written beside the others: a piece stays in the caches while its product reads it (the small
  llama's 4-bit decode step of 4 rows took 260 ms with 4 MiB pieces, 470 with 64 MiB ones, 415
  through MLX's kernel), and an LM head's float32 copy never exists whole. Only with an
  optimised BLAS (``blas.fast_cpu_matmul``): MLX's reference one gives the copy no such edge.
  ``route`` gives a loaded model's quantised linears and embeddings this path.
- **The CPU, the products that keep MLX's kernel** (a decode row; every product without an
  optimised BLAS): MLX runs a stream's work on one thread, so ``quantized_matmul`` uses one
  core however many there are. ``split_product`` gives each core's stream its share of the
  output rows (2 cores, 4-bit: a 4,096 x 1,024 weight 2.75 -> 1.47 ms, the small llama's
  32,000 x 1,024 head 21.4 -> 11.3 ms); the parts are exactly the whole product's columns.
  A MoE's experts chosen for a decode token go out the same way, each core's stream running
  the whole expert MLP for its share of the choices (``split_choices``).
- **CUDA**, a MoE's expert gather over rows sorted by expert (a prefill): MLX's CUDA
  ``gather_qmm`` has no grouped path for sorted rows (it never reads ``sorted_indices``), while
  its ``gather_mm`` has. A 4-bit MoE prefilled at a sixth of its bf16 speed (H200, s8: qwen3_moe
  at 2,048 tokens 10.1k against 64.0k tokens/s). From ``EXPERT_ROWS`` pairs per expert the
  stacked experts are dequantised, whole where that copy is at most ``EXPERT_BYTES``, else in
  groups of experts within it, one group after another (``moe.Experts.copy_groups``), the
  copies alive at once bounded by ``admit``.
"""

from __future__ import annotations

import functools
import math
import os
from collections.abc import Callable

import mlx.core as mx
from mlx import nn

from mlxc.runtime import blas
from mlxc.runtime.model import cuda_attention, layers

CPU_ROWS = 3
# A weight smaller than this stays one product: the streams' hand-offs cost about what a
# second core saves (2 cores, 4-bit: 1,024 x 1,024, 0.5 MiB packed, 0.69 -> 0.55 ms).
SPLIT_BYTES = 256 << 10
PIECE_BYTES = 4 << 20
EXPERT_ROWS = 16
# Larger stacks (Qwen3-235B's 3 GiB gate|up, DeepSeek-V3's 14 GiB) are copied in groups of
# experts within it (``experts_per_copy``).
EXPERT_BYTES = 1 << 30


def on_cpu(x: mx.array) -> bool:
    """Whether a quantised product of ``x`` (``[..., in]``) goes through a copy on this CPU."""
    return (
        x.size >= CPU_ROWS * x.shape[-1]
        and mx.default_device() == mx.cpu
        and blas.fast_cpu_matmul()
    )


def copy_bytes(shape: tuple[int, ...], bits: int, dtype: mx.Dtype) -> int:
    """Bytes of the ``dtype`` copy of a packed weight ``shape`` (``[..., in * bits / 32]``)."""
    *lead, packed = shape
    return math.prod(lead) * (packed * 32 // bits) * dtype.size


def copies_experts(pairs: int, num_experts: int) -> bool:
    """Whether a gather of ``pairs`` rows sorted by expert, over ``num_experts`` stacked
    quantised experts, multiplies through dequantised copies: on CUDA, from ``EXPERT_ROWS``
    pairs per expert."""
    return pairs >= EXPERT_ROWS * num_experts and cuda_attention.available()


def experts_per_copy(num_experts: int, largest_copy: int) -> int:
    """How many experts each copy holds where a gather copies them (``copies_experts``), one
    group of experts after another (``largest_copy``: the bytes of the largest stacked linear's
    whole copy): in as few groups of even size as keep a copy within ``EXPERT_BYTES``
    (``num_experts``: the whole stack at once)."""
    most = max(1, EXPERT_BYTES * num_experts // largest_copy)
    groups = -(-num_experts // most)
    return -(-num_experts // groups)  # groups of even size: 128 experts at most 42 -> 4 of 32


# The last product ``admit`` started, as a one-element array made from it (which, once evaluated,
# holds none of the product's memory).
_admitted: mx.array | None = None


def admit(product: mx.array) -> mx.array:
    """Bound the copies of a CUDA forward alive at once: start evaluating ``product`` (made
    through a copy) and wait until the product admitted before it has run; returns ``product``.
    MLX's CUDA backend keeps a kernel's inputs until the kernel has run, and encodes a forward
    far ahead of the device, so without this every MoE layer's copy in a prefill was allocated
    at once (H100, s32: the 4-bit qwen3_moe medium prefill peaked at 10.6 GB, mlx-lm's at 6.5,
    its bf16 twin's at 11.8). One product stays queued, so the device does not wait for the
    host. It evaluates, so never inside ``mx.compile``."""
    global _admitted
    marker = product[:1].sum()
    mx.async_eval(marker)
    previous, _admitted = _admitted, marker
    if previous is not None:
        mx.eval(previous)
    return product


def weight(
    layer: nn.Module,
    dtype: mx.Dtype,
    rows: slice | int = slice(None),
    after: mx.array | None = None,
) -> mx.array:
    """``layer``'s quantised weight (``weight``, ``scales``, ``biases``: a quantised linear,
    embedding or stack of experts), dequantised to ``dtype``; ``rows``: an index of its
    leading axis (output rows, or one expert of a stack); ``after``: made only once that array
    is."""
    biases = layer.get("biases")
    packed = layer["weight"][rows]
    return mx.dequantize(
        packed if after is None else mx.depends(packed, after),
        layer["scales"][rows],
        None if biases is None else biases[rows],
        group_size=layer.group_size,
        bits=layer.bits,
        mode=layer.mode,
        dtype=dtype,
    )


def product(
    x: mx.array, layer: nn.Module, expert: int | None = None, after: mx.array | None = None
) -> mx.array:
    """``x @ W.T`` for ``layer``'s quantised weight ``W [out, in]`` (``expert``: that one of a
    stack ``[E, out, in]``), through float copies of at most ``PIECE_BYTES`` each, each made
    after the product before it (the first after ``after``, where given): independent of one
    another, MLX would make several before their products (a 256-token prefill of the small
    llama peaked 220 MiB over its weights with 4 MiB pieces, 53 chained)."""
    out = layer["weight"].shape[-2]
    step = max(1, PIECE_BYTES // (x.shape[-1] * x.dtype.size))
    pieces = []
    for start in range(0, out, step):
        rows = slice(start, min(start + step, out))
        index = rows if expert is None else (expert, rows)
        pieces.append(x @ weight(layer, x.dtype, index, pieces[-1] if pieces else after).T)
    return pieces[0] if len(pieces) == 1 else mx.concatenate(pieces, axis=-1)


@functools.cache
def cpu_streams() -> tuple[mx.Stream, ...]:
    """One CPU stream per core this process may run on (MLX gives each stream a thread of its
    own), or ``MLXC_CPU_THREADS`` of them (processes sharing the cores: tensor-parallel ranks on
    one machine); none for one."""
    setting = os.environ.get("MLXC_CPU_THREADS", "").strip()
    if setting:
        if not setting.isdigit() or int(setting) < 1:
            raise ValueError(f"MLXC_CPU_THREADS must be a whole number >= 1, got {setting!r}")
        n = int(setting)
    else:
        n = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
    return tuple(mx.new_stream(mx.cpu) for _ in range(n or 1)) if (n or 1) > 1 else ()


def split_product(x: mx.array, layer: nn.Module) -> mx.array | None:
    """``x @ W.T`` for ``layer``'s quantised weight ``W [out, in]`` by MLX's
    ``quantized_matmul``, its output rows shared out over ``cpu_streams`` (contiguous slices,
    no copy) and the parts joined; None where it stays one product (not the CPU, one core, or
    a weight under ``SPLIT_BYTES``)."""
    packed = layer["weight"]
    if mx.default_device() != mx.cpu or packed.nbytes < SPLIT_BYTES:
        return None
    streams = cpu_streams()
    if not streams:
        return None
    biases = layer.get("biases")
    step = -(-packed.shape[0] // len(streams))
    parts = [
        mx.quantized_matmul(
            x,
            packed[a : a + step],
            layer["scales"][a : a + step],
            None if biases is None else biases[a : a + step],
            transpose=True,
            group_size=layer.group_size,
            bits=layer.bits,
            mode=layer.mode,
            stream=stream,
        )
        for stream, a in zip(streams, range(0, packed.shape[0], step))
    ]
    return mx.concatenate(parts, axis=-1)


def split_choices(experts: Callable[[mx.array], mx.array], indices: mx.array) -> mx.array | None:
    """``experts(indices)`` (``[N, k, ...]`` out for the chosen experts ``indices [N, k]``) on
    the CPU, each core's stream computing it for its share of the ``k`` choices, the parts
    joined along that axis: MLX's CPU ``gather_qmm`` uses one core. None where it stays one
    computation (not the CPU, one core, one choice)."""
    if mx.default_device() != mx.cpu or indices.shape[-1] < 2:
        return None  # before cpu_streams: a GPU process makes no CPU streams (threads)
    streams, k = cpu_streams(), indices.shape[-1]
    if not streams:
        return None
    step = -(-k // min(len(streams), k))
    parts = []
    for stream, a in zip(streams, range(0, k, step)):
        with mx.stream(stream):
            parts.append(experts(indices[:, a : a + step]))
    return mx.concatenate(parts, axis=1)


def _cpu_product(x: mx.array, layer: nn.Module) -> mx.array | None:
    """``layer``'s product on the CPU: through a copy, split over the cores, or None (MLX's
    one product)."""
    return product(x, layer) if on_cpu(x) else split_product(x, layer)


class CPUQuantizedLinear(nn.QuantizedLinear):
    """``nn.QuantizedLinear`` whose products on the CPU take ``_cpu_product`` (``route``)."""

    def __call__(self, x: mx.array) -> mx.array:
        y = _cpu_product(x, self)
        if y is None:
            return super().__call__(x)
        return y + self["bias"] if "bias" in self else y


class CPUQuantizedEmbedding(nn.QuantizedEmbedding):
    """``nn.QuantizedEmbedding`` whose ``as_linear`` (a tied LM head) does the same."""

    def as_linear(self, x: mx.array) -> mx.array:
        y = _cpu_product(x, self)
        return super().as_linear(x) if y is None else y


def route(model: nn.Module) -> nn.Module:
    """On a CPU, give every ``nn.QuantizedLinear`` and ``nn.QuantizedEmbedding`` of ``model``
    (exactly those types: sharded layers have their own) the CPU's products, in place: their
    class changes, their parameters stay. A no-op elsewhere. Returns ``model``."""
    if mx.default_device() != mx.cpu:
        return model
    classes = {nn.QuantizedLinear: CPUQuantizedLinear, nn.QuantizedEmbedding: CPUQuantizedEmbedding}
    return layers.retype(model, classes)
