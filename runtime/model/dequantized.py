"""Quantised products through a dequantised copy, where MLX 0.32's quantised kernels are slow.

Two places, one idea: dequantise the weights for the one product (the copy is dropped after it)
and take MLX's float kernel, which is faster there by more than the copy costs.

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
- **CUDA**, a MoE's expert gather over rows sorted by expert (a prefill): MLX's CUDA
  ``gather_qmm`` has no grouped path for sorted rows (it never reads ``sorted_indices``), while
  its ``gather_mm`` has. A 4-bit MoE prefilled at a sixth of its bf16 speed (H200, s8: qwen3_moe
  at 2,048 tokens 10.1k against 64.0k tokens/s). From ``EXPERT_ROWS`` pairs per expert the
  stacked experts are dequantised, whole where that copy is at most ``EXPERT_BYTES``, else in
  groups of experts within it, one group after another (``moe.Experts.copy_groups``), the
  copies alive at once bounded by ``admit``.
"""

from __future__ import annotations

import math

import mlx.core as mx
from mlx import nn

from mlxc.runtime import blas
from mlxc.runtime.model import cuda_attention, layers

CPU_ROWS = 3
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


class DequantizingLinear(nn.QuantizedLinear):
    """``nn.QuantizedLinear`` whose products of ``CPU_ROWS`` rows or more on the CPU go
    through a float copy (``route``)."""

    def __call__(self, x: mx.array) -> mx.array:
        if not on_cpu(x):
            return super().__call__(x)
        y = product(x, self)
        return y + self["bias"] if "bias" in self else y


class DequantizingEmbedding(nn.QuantizedEmbedding):
    """``nn.QuantizedEmbedding`` whose ``as_linear`` (a tied LM head) does the same."""

    def as_linear(self, x: mx.array) -> mx.array:
        return product(x, self) if on_cpu(x) else super().as_linear(x)


def route(model: nn.Module) -> nn.Module:
    """On a CPU with an optimised BLAS, give every ``nn.QuantizedLinear`` and
    ``nn.QuantizedEmbedding`` of ``model`` (exactly those types: sharded layers have their own)
    the copy for several rows, in place: their class changes, their parameters stay. A no-op
    elsewhere. Returns ``model``."""
    if mx.default_device() != mx.cpu or not blas.fast_cpu_matmul():
        return model
    classes = {nn.QuantizedLinear: DequantizingLinear, nn.QuantizedEmbedding: DequantizingEmbedding}
    return layers.retype(model, classes)
