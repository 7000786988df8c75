"""Products of a few rows on CUDA, where MLX 0.32 calls cuBLAS.

A decode batch of B rows, or a verification forward of K + 1 tokens, multiplies every weight
by a few rows. MLX runs one row through its own matrix-vector kernel, and two or more through
cuBLASLt, whose every call costs the host more: MLX builds its descriptors, asks cuBLASLt's
heuristic for an algorithm and captures the call into its CUDA graph each time. On an H100
(s28, ``bench/results/rows-gather-gpu-h100-s28.md``) such a call took ~19 us of the host
to encode against ~7 for one row, and a decode step of mlx-lm's llama medium (65 products)
went from 1.72 ms at one row to 3.1 ms at two: a step that the host bounds paid for its rows in
host time, not device time.

``matmul`` is one launch of mlxc's kernel (``cuda_matmul.cuh``: tensor-core mmas, each weight
byte read once, the K axis split over a block's warps) for 2 to ``MAX_ROWS`` rows of bf16 or
fp16 activations against a weight of the same dtype. ``route`` gives a loaded model's dense
projections this path (``RowsLinear``, ``RowsEmbedding``); one row, other dtypes, quantised
and sharded layers keep MLX's.

Checked against MLX's matmul by ``tests/test_cuda_matmul.py`` on CUDA and, in CI, through the
emulator (``tests/cuda_emulator``, which emulates the mma instruction).
"""

from __future__ import annotations

import functools
import math
from pathlib import Path

import mlx.core as mx
from mlx import nn

from mlxc.runtime.model import cuda_attention, layers

# Rows a call takes: up to two tiles of the mma's 16, each tile a row of blocks (grid y) over
# all the columns, so a block does the same work at 32 rows as at 16, and there are twice as
# many. Each row of blocks reads all the weights (from L2 after the first) and each block its
# 16 rows of x, so the reads through L2 grow with the rows. On an H100 (s29, decode with every
# product routed, ``rows-matmul-64-gpu-h100-s29d.md``): 1.27x MLX's products at 16 rows, 1.09x
# at 32, 0.76x at 64 (there the wide weights' products took 2.7-3.6x cuBLAS's time), so more
# than 32 rows keep cuBLAS (s30, another H100, ``rows-matmul-32-gpu-h100-s30.md``: 1.28x at 16,
# 1.01x at 24 and 32; giving the LM head back to cuBLAS past 16 rows was no faster,
# ``rows-matmul-wide-ab-gpu-h100-s30.md``). Blocks of several row tiles lost at 32 and 64
# rows: their work is longer and their count smaller, and in a forward each product waits for
# the one before (s28, s29: ``rows-matmul-64-gpu-h100-s28.md``, ``-s29.md``, ``-s29b.md``,
# ``-s29c.md``).
MAX_ROWS = 32
TILE_COLS = 2  # tiles of 8 columns a block computes (NT)
WARPS = 4  # warps of a block, splitting K (KW)
K_STEP = 32  # the kernel takes K in steps of 32
_HALF = (mx.bfloat16, mx.float16)  # the dtypes it computes in

KERNEL_FILE = Path(__file__).with_name("cuda_matmul.cuh")
# One call of the kernel's template (the code is #included by path, as cuda_attention's).
_SOURCE = "  ::mlxc::rows_matmul<T, BF16, NT, KW>(x, x_shape, x_ndim, w, w_shape, y);\n"


@functools.cache
def _kernel():
    return mx.fast.cuda_kernel(
        name="mlxc_rows_matmul",
        input_names=["x", "w"],
        output_names=["y"],
        source=_SOURCE,
        header=cuda_attention.include_header(KERNEL_FILE),
        ensure_row_contiguous=True,
    )


def applies(x: mx.array, weight: mx.array) -> bool:
    """Whether ``x @ weight.T`` should take ``matmul`` on this device: 2 to MAX_ROWS rows of
    bf16 or fp16, the weight's dtype, K a multiple of 32, on CUDA. The row count first: every
    one-row product of a decode step asks, and takes MLX's."""
    K = x.shape[-1]
    return (
        K >= K_STEP
        and 2 <= x.size // K <= MAX_ROWS
        and K % K_STEP == 0
        and x.dtype == weight.dtype
        and x.dtype in _HALF
        and weight.ndim == 2
        and cuda_attention.available()
    )


def matmul(x: mx.array, weight: mx.array) -> mx.array:
    """``x @ weight.T`` for ``x [..., K]`` of 2 to MAX_ROWS rows and ``weight [N, K]``
    (``applies``), float sums rounded to ``x``'s dtype. Called by every projection of a
    host-bound step, so through ``mx.compile``: a replayed trace reuses its kernel call, where
    a direct call has MLX assemble the kernel's source and its template arguments again (s28,
    H100, ``rows-matmul-ab-gpu-h100-s28``: batched decode 1.47x MLX's products compiled, 1.31x
    direct). A compiled function per weight shape keeps each one's traces few (one per row
    layout)."""
    return _compiled(*weight.shape, x.dtype)(x, weight)


def _call(x: mx.array, weight: mx.array) -> mx.array:
    (y,) = _kernel()(inputs=[x, weight], **_launch(x.shape, x.dtype, weight.shape[0]))
    return y


@functools.lru_cache(maxsize=256)
def _compiled(n: int, k: int, dtype: mx.Dtype):
    # A function object of its own: MLX keys a compiled function's traces by the function
    # compiled, and looks through them one by one.
    def call(x: mx.array, weight: mx.array) -> mx.array:
        return _call(x, weight)

    return mx.compile(call)


@functools.lru_cache(maxsize=1024)
def _launch(shape: tuple[int, ...], dtype: mx.Dtype, n: int) -> dict:
    """A call's keyword arguments (template, grid, block, output) from its shapes."""
    return {
        "template": [("T", dtype), ("BF16", dtype == mx.bfloat16)]
        + [("NT", TILE_COLS), ("KW", WARPS)],
        "grid": (
            math.ceil(n / (8 * TILE_COLS)) * WARPS * 32,
            math.ceil(math.prod(shape[:-1]) / 16),
            1,
        ),
        "threadgroup": (WARPS * 32, 1, 1),
        "output_shapes": [(*shape[:-1], n)],
        "output_dtypes": [dtype],
    }


class RowsLinear(nn.Linear):
    """``nn.Linear`` whose products of 2 to MAX_ROWS rows take ``matmul`` (``route``)."""

    def __call__(self, x: mx.array) -> mx.array:
        weight = self["weight"]  # the item, not the attribute: nn.Module's lookup costs more
        if not applies(x, weight):
            return super().__call__(x)
        y = matmul(x, weight)
        return y + self["bias"] if "bias" in self else y


class RowsEmbedding(nn.Embedding):
    """``nn.Embedding`` whose ``as_linear`` (a tied LM head) takes ``matmul`` for 2 to
    MAX_ROWS rows (``route``)."""

    def as_linear(self, x: mx.array) -> mx.array:
        weight = self["weight"]
        return matmul(x, weight) if applies(x, weight) else super().as_linear(x)


def route(model: nn.Module) -> nn.Module:
    """On CUDA, give every ``nn.Linear`` and ``nn.Embedding`` of ``model`` (exactly those
    types: quantised and sharded layers have their own) ``matmul`` for a few rows, in place:
    their class becomes ``RowsLinear`` / ``RowsEmbedding``, their parameters stay. A no-op
    elsewhere. Returns ``model``."""
    if not cuda_attention.available():
        return model
    return layers.retype(model, {nn.Linear: RowsLinear, nn.Embedding: RowsEmbedding})


def warm(model: nn.Module) -> None:
    """Compile the kernel for the dtypes of ``model``'s routed layers, so the first forward of
    a few rows does not wait for NVRTC (about a second; MLX keeps no disk cache of custom
    kernels: elsewhere a process's first such forward, a prompt of 2 to MAX_ROWS tokens,
    waits). A no-op off CUDA or where none is routed."""
    if not cuda_attention.available():
        return
    dtypes = {
        m.weight.dtype
        for _, m in model.named_modules()
        if isinstance(m, RowsLinear | RowsEmbedding) and m.weight.dtype in _HALF
    }
    for dtype in sorted(dtypes, key=str):
        _warm(dtype)


@functools.cache
def _warm(dtype: mx.Dtype) -> None:
    mx.eval(matmul(mx.zeros((2, K_STEP), dtype), mx.zeros((8, K_STEP), dtype)))
